"""The share-goal arithmetic of ``bench.bench_elastic`` (no GPU): ``overhead_budget`` against
bounds solved by hand."""

from __future__ import annotations

import pytest

from bench.bench_elastic import overhead_budget


def floors(*rows):
    """{label: (floor us, bytes)} for (share %, floor us, bytes) rows."""
    return {f"struct {p}%": (f, nb) for p, f, nb in rows}


def test_bounds_of_a_floor_that_streams_at_one_rate():
    """Floors proportional to bytes (2 and 1 us for 2 and 1 units): 1.7x allows
    (2 - 1.7) / 0.7 = 3/7 us; the spread 2 (1 + x) / (2 + x) <= 1.1 allows x <= 2/9 us. A middle
    share sits between the two ends and changes neither bound."""
    for rows in [((0, 2.0, 2), (100, 1.0, 1)), ((0, 2.0, 2), (50, 1.5, 1.5), (100, 1.0, 1))]:
        x_speedup, x_spread = overhead_budget(floors(*rows))
        assert x_speedup == pytest.approx(3 / 7)
        assert x_spread == pytest.approx(2 / 9, abs=2e-3)


def test_a_floor_that_misses_both_goals_gives_negative_bounds():
    """A floor with 1 us of fixed cost a launch (3 and 2 us for 2 and 1 units) is 1.5x and
    spreads 33 %: no added cost meets either goal."""
    x_speedup, x_spread = overhead_budget(floors((0, 3.0, 2), (100, 2.0, 1)))
    assert x_speedup == pytest.approx((3 - 3.4) / 0.7)
    assert x_spread < 0


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
