"""The frame's many-block calls (``pages_at``, ``refcounts``, ``remap_many``, ``retain_many``,
``release_many``) equal the per-block calls on random frames: the same answers, the same
shadow after the edits (overlays, pending reference counts, freed pages in order), the same
commit, and an abort after them restores the pager; bad input raises naming the argument and
changes nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvops.runtime import Pager

S = 4


def _world(seed):
    """A pager with committed sessions (some aliased, some trimmed), and an open frame with
    growth, a new session and an EOS, so the view mixes committed, overlay and grown blocks."""
    rng = random.Random(seed)
    pager = Pager(96, S, 8, 12)
    with pager.frame() as f:
        for k in range(4):
            f.reserve(k, rng.randint(5, 30))
    with pager.frame() as f:
        f.alias(4, 0, S * rng.randint(0, 1))
        f.trim(1, [0])
    f = pager.frame()
    f.reserve(2, rng.randint(1, 9))            # growth-only
    f.reserve(5, rng.randint(1, 9))            # new
    f.trim(3)                                  # EOS
    return rng, pager, f


def _state(pager, f):
    e = f.edits
    return ({k: dict(v) for k, v in e.overlay.items()}, dict(e.ref), list(e.freed_pages),
            dict(e.length), dict(e.grown), dict(e.app))


def _committed(pager):
    c = pager.committed
    return ({k: (s.slot, list(s.blocks)) for k, s in c.sessions.items()}, dict(c.lengths),
            list(c.refs), pager.host_tables["block_table"].tolist(), pager.free_pages)


def _live_blocks(f, rng, n):
    keys = [k for k in (0, 1, 2, 4, 5) if f.has(k)]
    out = []
    for key in keys:
        nb = -(-f.length(key) // S)
        out += [(key, j) for j in range(nb) if f.page(key, j) >= 0]
    rng.shuffle(out)
    return out[:n]


@pytest.mark.parametrize("seed", range(6))
def test_reads_equal_the_per_block_reads(seed):
    rng, pager, f = _world(seed)
    keys = [rng.choice([0, 1, 2, 4, 5]) for _ in range(20)]
    blocks = [rng.randint(0, 14) for _ in keys]
    got = f.pages_at(keys, np.array(blocks))
    assert got.dtype == np.int64
    assert got.tolist() == [f.page(k, j) for k, j in zip(keys, blocks)]
    pages = [rng.randrange(pager.num_pages) for _ in range(30)]
    assert f.refcounts(pages).tolist() == [f.refcount(p) for p in pages]
    assert f.pages_at([], []).shape == (0,) and f.refcounts([]).shape == (0,)
    f.abort()


@pytest.mark.parametrize("seed", range(12))
def test_edits_equal_the_per_block_edits(seed):
    """The same random remaps, retains and releases through both paths, from the same frame:
    equal shadows and commits, or both refuse (the many-block call then changes nothing); an
    abort after them restores the committed state."""
    outcomes = []
    for many in (False, True):
        rng, pager, f = _world(seed)
        held = f.hold(6)
        entries = _live_blocks(f, rng, 7)
        # targets: held pages, mapped pages and the old pages of other entries
        olds = [f.page(k, j) for k, j in entries]
        targets = [rng.choice(held if rng.random() < 0.85 else olds) for _ in entries]
        keys, js = [k for k, _ in entries], [j for _, j in entries]
        start = _state(pager, f)
        try:
            if many:
                f.remap_many(keys, np.array(js, dtype=np.int32), targets)
            else:
                for k, j, p in zip(keys, js, targets):
                    f.remap(k, j, p)
        except ValueError:
            if many:
                assert _state(pager, f) == start
            f.abort()
            outcomes.append("refused")
            continue
        if many:
            f.retain_many(held[:3])
            f.release_many(held + held[:3])
        else:
            for p in held[:3]:
                f.retain(p)
            for p in held + held[:3]:
                f.release(p)
        state = _state(pager, f)
        f.commit()
        outcomes.append((state, _committed(pager)))
    assert outcomes[0] == outcomes[1]
    _, pager, f = _world(seed)
    f.abort()
    before = _committed(pager)
    rng, pager, f = _world(seed)                 # the many-block edits, aborted
    held = f.hold(4)
    entries = _live_blocks(f, rng, 4)
    f.remap_many([k for k, _ in entries], [j for _, j in entries], held[:len(entries)])
    f.retain_many(held)
    f.release_many(held)
    f.abort()
    assert _committed(pager) == before


def test_remap_many_follows_the_per_block_order():
    """A target that an earlier entry leaves with no reference is refused, as the per-block
    calls refuse it; a page that is a target before it is an old page stays live."""
    pager = Pager(32, S, 4, 8)
    with pager.frame() as f:
        f.reserve("a", 3 * S)
    f = pager.frame()
    a0, a1, a2 = (f.page("a", j) for j in range(3))
    (h,) = f.hold(1)
    with pytest.raises(ValueError, match=r"pages\[1\]"):
        f.remap_many(["a", "a"], [0, 1], [h, a0])     # a0 has no reference after the first
    assert f.page("a", 0) == a0 and f.refcount(h) == 1     # nothing changed
    with pytest.raises(ValueError, match=r"pages\[1\]"):
        f.remap_many(["a", "a"], [0, 1], [a1, a0])        # a swap: refused per block too
    f.remap_many(["a", "a"], [0, 1], [a1, h])
    assert [f.page("a", j) for j in range(3)] == [a1, h, a2]
    assert f.refcount(a1) == 1 and f.refcount(a0) == 0 and f.edits.freed_pages == [a0]
    f.abort()


def test_bad_inputs_name_the_argument_and_change_nothing():
    pager = Pager(32, S, 4, 8)
    with pager.frame() as f:
        f.reserve("a", 3 * S)
        f.reserve("b", 2 * S)
    with pager.frame() as f:
        f.trim("b", [1])
    f = pager.frame()
    (h,) = f.hold(1)
    state = _state(pager, f)
    cases = [
        (lambda: f.pages_at(["a"], [-1]), r"pages_at: blocks.*-1 at \[0\]"),
        (lambda: f.pages_at(["a"], [0.5]), r"pages_at: blocks: expected a 1-D"),
        (lambda: f.pages_at(["a", "a"], [0]), r"pages_at: keys: expected 1"),
        (lambda: f.pages_at("a", [0]), r"pages_at: keys: expected a sequence"),
        (lambda: f.refcounts([[1]]), r"refcounts: pages: expected a 1-D"),
        (lambda: f.refcounts([32]), r"refcounts: pages.*\[0, 32\)"),
        (lambda: f.remap_many(["a"], [3], [h]), r"blocks\[0\] of 'a' must lie in \[0, 3\)"),
        (lambda: f.remap_many(["b"], [1], [h]), r"blocks\[0\]: block 1 of 'b' is trimmed"),
        (lambda: f.remap_many(["a", "a"], [0, 0], [h, h]), r"blocks\[1\].*twice"),
        (lambda: f.remap_many(["a"], [0], [31]), r"pages\[0\]: expected a live page"),
        (lambda: f.remap_many(["a"], [0], [40]), r"remap_many: pages.*live pages"),
        (lambda: f.remap_many(["a"], [0], [h, h]), r"remap_many: pages: expected 1"),
        (lambda: f.release_many([h, h]), r"release_many: pages\[0\]"),
        (lambda: f.retain_many([h, 30]), r"retain_many: pages\[1\]"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()
        assert _state(pager, f) == state
    with pytest.raises(KeyError, match="not a live session"):
        f.pages_at(["a", "zz"], [0, 0])
    with pytest.raises(KeyError, match="not a live session"):
        f.remap_many(["zz"], [0], [h])
    assert _state(pager, f) == state
    f.abort()
    with pytest.raises(RuntimeError, match="closed"):
        f.remap_many([], [], [])
