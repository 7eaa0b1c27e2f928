"""The share-goal arithmetic of ``bench.bench_elastic`` (no GPU): ``overhead_budget`` against a
brute-force scan over the added cost and against bounds solved by hand."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.bench_elastic import overhead_budget


def floors(*rows):
    """{label: (floor us, bytes)} for (share %, floor us, bytes) rows."""
    return {f"struct {p}%": (f, nb) for p, f, nb in rows}


def meets(fl, x, speedup_goal=1.7, spread_goal=0.10, slack=1e-9):
    """Whether a step adding ``x`` us to every floor meets each goal (the definitions, with
    ``slack`` for rounding: a pair of shares can sit exactly on the spread bound at every ``x``)."""
    bw = [nb / (f + x) for f, nb in fl.values()]
    return ((fl["struct 0%"][0] + x) / (fl["struct 100%"][0] + x) >= speedup_goal - slack,
            max(bw) / min(bw) - 1 <= spread_goal + slack)


@settings(deadline=None, max_examples=200)
@given(st.lists(st.tuples(st.floats(0.5, 50.0), st.floats(0.5, 4.0)), min_size=1, max_size=3),
       st.floats(0.5, 50.0), st.floats(0.5, 50.0))
def test_budget_is_the_largest_cost_that_meets_each_goal(middle, f0, f100):
    """Random floors (bytes 2 at 0 %, 1 at 100 %, anything between, so a middle share may be
    the one that binds): the returned bound meets its goal, a cost just above it does not, and
    None means no cost in a fine scan of [0, 200] us meets it."""
    fl = floors((0, f0, 2.0), (100, f100, 1.0), *((25 + i, f, nb) for i, (f, nb) in
                                                  enumerate(middle)))
    scan = [i * 0.01 for i in range(20001)]
    for k, x in enumerate(overhead_budget(fl)):
        ok = [x_ for x_ in scan if meets(fl, x_)[k]]
        if x is None:
            assert not ok, (k, ok[:3])
            continue
        assert meets(fl, x)[k] or math.isinf(x), (k, x)
        if not math.isinf(x):
            assert not meets(fl, x + 0.02)[k], (k, x)
            if ok:
                assert abs(max(ok) - x) <= 0.011, (k, x, max(ok))


def test_bounds_solved_by_hand():
    """Floors proportional to bytes (2 and 1 us for 2 and 1 units): 1.7x allows
    (2 - 1.7) / 0.7 = 3/7 us; the spread 2 (1 + x) / (2 + x) <= 1.1 allows x <= 2/9 us."""
    x_speedup, x_spread = overhead_budget(floors((0, 2.0, 2), (100, 1.0, 1)))
    assert x_speedup == pytest.approx(3 / 7)
    assert x_spread == pytest.approx(2 / 9)


def test_a_floor_that_misses_both_goals_gives_none():
    """1 us of fixed cost in the floor itself (3 and 2 us for 2 and 1 units): 1.5x and 33 %
    spread, and adding cost only makes both worse."""
    assert overhead_budget(floors((0, 3.0, 2), (100, 2.0, 1))) == (None, None)


def test_a_middle_share_can_bind():
    """The 50 % share reads slowly (1.9 us for 1.5 units) against both ends' 1 unit a us: at no
    added cost it already spreads 1.5 / 1.9 against 1, 27 %, so the spread goal has no budget,
    while 1.7x, which looks only at the ends, still has its 3/7 us."""
    x_speedup, x_spread = overhead_budget(floors((0, 2.0, 2), (50, 1.9, 1.5), (100, 1.0, 1)))
    assert x_speedup == pytest.approx(3 / 7)
    assert x_spread is None


def test_the_measured_b1_floor():
    """The H200's read floor of B 1 x 16k (16.75 and 9.21 us for 64 and 32 MiB,
    bench/results/2026-11-30-elastic-read-floor.md) leaves 1.56 us for 1.7x."""
    x_speedup, _ = overhead_budget(floors((0, 16.75, 64), (100, 9.21, 32)))
    assert x_speedup == pytest.approx(1.5614, abs=1e-3)


def test_other_paths_are_ignored():
    """Only structured rows count (native and general rows ride along in the benchmark)."""
    base = floors((0, 2.0, 2), (100, 1.0, 1))
    assert overhead_budget({**base, "native": (50.0, 2), "general 50%": (0.1, 1)}) == \
        overhead_budget(base)
