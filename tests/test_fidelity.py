"""The ElasticKV fidelity policy (kvops.runtime.fidelity) over the pager: demotion frees pages
and leaves every BASE block decoding as the codec defines, promotion restores TARGET bit for bit,
an aborted frame leaves the pool's bytes and the tables as they were, and no page leaks.

Each session's true K/V (what was written at reserve time) is kept beside the pool; the oracle
reads a session's rows through the committed tables (``elastic_rows``, which decodes BASE halves
through torch's float8 dtypes) and compares them with the truth: exact for TARGET blocks, the
codec's BASE for BASE blocks.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvops  # noqa: F401  (registers the ops)
from kvops.layouts import arena_as_pages, codecs
from kvops.layouts.paged import arena_page
from kvops.runtime import FarView, OutOfPages, Pager, Transport, apply_copies
from kvops.runtime.fidelity import BASE, PROMOTING, TARGET, Fidelity
from tests.oracles_elastic import elastic_oracle, elastic_rows

HKV, D = 2, 16


class _Flag:
    """A stand-in for a promotion's CUDA event on the CPU: done only once set."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class _SlowFidelity(Fidelity):
    """The policy with promotions that finish only when a test sets their flag (on the CPU
    they finish at once), so settles can be partial and sessions can end with work in flight."""

    def _issue(self, frame, pend, picks):
        before = {k: len(v) for k, v in pend.issued.items()}
        super()._issue(frame, pend, picks)
        flag = _Flag()
        for key, prs in pend.issued.items():
            for pr in prs[before.get(key, 0):]:
                pr.done = flag


class World:
    """A pager, a K and a V pool, a fidelity policy, and every session's true K/V rows."""

    def __init__(self, P=48, S=8, B=6, L=24, dtype=torch.float16, device="cpu", one_pool=False,
                 slow=False, **kw):
        """``one_pool``: K and V are two slices of one allocation (one pack or refine call for
        both); else two tensors (a call each). ``slow``: promotions wait for their flag."""
        self.S, self.dtype = S, dtype
        self.pager = Pager(P, S, B, L, device=device)
        if one_pool:
            self.k, self.v = torch.randn(2, P, S, HKV, D, device=device).to(dtype).unbind(0)
        else:
            self.k = torch.randn(P, S, HKV, D, device=device).to(dtype)
            self.v = torch.randn(P, S, HKV, D, device=device).to(dtype)
        self.fid = (_SlowFidelity if slow else Fidelity)(self.pager, [self.k, self.v], **kw)
        assert (self.fid._pool is not None) == one_pool
        self.truth: dict = {}

    def grow(self, f, key, n):
        """Reserve ``n`` tokens of ``key`` in frame ``f`` and write their K/V after commit."""
        old = f.length(key) if f.has(key) else 0
        f.reserve(key, n)
        return key, old, old + n

    def write(self, key, old, new, copies=()):
        """After the commit: run its copy-on-write copies, then write the new tokens."""
        apply_copies(self.k, self.v, list(copies))
        pages = self.pager.pages(key)
        kv = torch.randn(2, new - old, HKV, D).to(self.dtype)
        for t in range(old, new):
            page, row = pages[t // self.S], t % self.S
            self.k[page, row] = kv[0, t - old].to(self.k.device)
            self.v[page, row] = kv[1, t - old].to(self.v.device)
        tk, tv = self.truth.get(key, (kv[0, :0], kv[1, :0]))
        self.truth[key] = (torch.cat([tk, kv[0]]), torch.cat([tv, kv[1]]))

    def tables(self):
        t = self.pager.host_tables
        return (torch.from_numpy(t["block_table"].copy()), torch.from_numpy(t["seq_lens"].copy()),
                torch.from_numpy(t["base_span"].copy()))

    def check(self, key):
        """The session's rows through the tables equal its truth (BASE blocks as the codec's
        BASE; trimmed blocks, never in the span, are skipped), and the fidelity state table
        agrees with the span."""
        bt, sl, span = self.tables()
        slot = self.pager.slot(key)
        k, v = elastic_rows(slot, self.k.cpu(), self.v.cpu(), bt, sl, base_span=span)
        tk, tv = self.truth[key]
        first, end = self.fid.span(key)
        assert (int(span[slot, 0]), int(span[slot, 1])) == ((first, end) if end > first
                                                           else (0, 0))
        states = self.fid.block_states(key)
        pages = self.pager.pages(key)
        for j in range(len(states)):
            rows = slice(j * self.S, min((j + 1) * self.S, len(tk)))
            if pages[j] < 0:
                assert not first <= j < end, f"{key} block {j}: trimmed inside the span"
                continue
            if first <= j < end:
                assert states[j] in (BASE, PROMOTING)
                for got, want in ((k, tk), (v, tv)):
                    base, _ = codecs.encode(want[rows], self.fid.codec)
                    exp = codecs.decode(base, self.dtype).double()
                    assert torch.equal(got[rows], exp), f"{key} block {j} (BASE)"
            else:
                assert states[j] == TARGET
                assert torch.equal(k[rows], tk[rows].double()), f"{key} block {j} (K)"
                assert torch.equal(v[rows], tv[rows].double()), f"{key} block {j} (V)"

    def check_all(self):
        """Every session reads its truth; every page's refcount is its mappings plus the
        references promotions in flight hold (two refined pages and the retained BASE page);
        host slots taken are the BASE pairs plus orphaned promotions; unused span rows are
        empty; the device tables are the host tables."""
        pager, fid = self.pager, self.fid
        for key in pager.sessions():
            self.check(key)
        want = Counter(p for key in pager.sessions() for p in pager.pages(key) if p >= 0)
        for pr in [*fid._orphans, *(pr for stack in fid._flight.values() for pr in stack)]:
            want.update([*pr.new, pr.page])
        assert [pager.refcount(p) for p in range(pager.num_pages)] == \
            [want[p] for p in range(pager.num_pages)]
        assert sum(1 for p in range(pager.num_pages) if want[p]) + pager.free_pages == \
            pager.num_pages
        assert fid._host.alloc.num_pages - fid._host.free == len(fid._pairs) + len(fid._orphans)
        if not pager.epoch:
            return                                          # no tables before the first frame
        live = {pager.slot(key) for key in pager.sessions()}
        span = pager.host_tables["base_span"]
        assert all((span[b] == 0).all() for b in range(pager.max_sessions) if b not in live)
        for name, t in pager.device_tables.items():
            assert np.array_equal(t.cpu().numpy(), pager.host_tables[name]), name


    def snapshot(self):
        """What a refused or aborted frame must leave as it was."""
        live = [p for p in range(self.pager.num_pages) if self.pager.refcount(p)]
        return (live, self.k[live].view(torch.uint8).clone(),
                self.v[live].view(torch.uint8).clone(), [t.clone() for t in self.tables()],
                self.pager.free_pages, self.pager.epoch, self.fid._host.free,
                dict(self.fid._span), {k: len(v) for k, v in self.fid._flight.items()})

    def unchanged(self, snap):
        live, k, v, tables, free, epoch, host_free, spans, flight = snap
        assert [p for p in range(self.pager.num_pages) if self.pager.refcount(p)] == live
        assert torch.equal(self.k[live].view(torch.uint8), k)
        assert torch.equal(self.v[live].view(torch.uint8), v)
        assert all(torch.equal(a, b) for a, b in zip(self.tables(), tables))
        assert (self.pager.free_pages, self.pager.epoch, self.fid._host.free) == \
            (free, epoch, host_free)
        assert dict(self.fid._span) == spans and self.fid._pend is None
        assert {k: len(v) for k, v in self.fid._flight.items()} == flight


def start(w: World, lengths: dict):
    with w.pager.frame() as f:
        grown = [w.grow(f, key, n) for key, n in lengths.items()]
    for g in grown:
        w.write(*g, f.result.copies)


@pytest.mark.parametrize("one_pool", [False, True], ids=["two-pools", "one-pool"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_demote_then_promote_round_trip(dtype, one_pool):
    torch.manual_seed(0)
    w = World(dtype=dtype, one_pool=one_pool, min_batch=4, protect_recent=1)
    start(w, {"a": 9 * w.S + 3, "b": 6 * w.S, "c": 2 * w.S + 1})
    free0 = w.pager.free_pages
    with w.pager.frame() as f:
        got = w.fid.step(f, need=free0 + 5)
    assert got["demoted"] == 5                      # the shortage (5) beats min_batch (4)
    assert w.pager.free_pages == free0 + 5          # one page back a pair
    assert w.fid.stats["demotion_batches"] == 1 and w.fid.stats["base_blocks"] == 10
    w.check_all()
    # attention through the tables: the op (BASE via base_span) against the float64 oracle
    bt, sl, span = w.tables()
    q = torch.randn(w.pager.max_sessions, 2 * HKV, D).to(dtype)
    kw = w.fid.attention_kwargs()
    assert set(kw) == {"base_span"}
    out, lse = torch.ops.kvops.elastic_attention(
        q, w.k, w.v, w.pager.device_tables["block_table"], w.pager.device_tables["seq_lens"], **kw)
    want, want_lse = elastic_oracle(q, w.k, w.v, bt, sl, base_span=span)
    live = sl > 0
    torch.testing.assert_close(out[live].double(), want[live], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[live].double(), want_lse[live], atol=1e-3, rtol=1e-3)
    # promotion: issued when nothing is short and the reserve has room, mapped a step later
    with w.pager.frame() as f:
        got = w.fid.step(f, need=0)
    assert got["promoted"] == 5 and w.fid.stats["in_flight"] == 5
    w.check_all()                                   # BASE still executes while in flight
    assert (w.fid.block_states("a") == PROMOTING).sum() > 0
    with w.pager.frame() as f:
        got = w.fid.step(f, need=0)
    assert got["settled"] == 5 and w.fid.stats["promoted"] == 5
    assert w.pager.free_pages == free0 and w.fid.attention_kwargs() == {}
    w.check_all()                                   # TARGET again, bit for bit


def test_min_batch_spreads_over_sessions():
    torch.manual_seed(1)
    w = World(P=64, L=16, min_batch=6, protect_recent=2)
    start(w, {k: 10 * w.S for k in "abc"})
    with w.pager.frame() as f:
        assert w.fid.step(f, need=w.pager.free_pages + 1)["demoted"] == 6
    assert [w.fid.span(k) for k in "abc"] == [(0, 4)] * 3     # two pairs each
    w.check_all()


def test_protected_blocks_are_never_demoted():
    torch.manual_seed(2)
    w = World(P=40, min_batch=16, protect_first=1, protect_recent=3)
    start(w, {"a": 8 * w.S + 5})          # 9 blocks: 1 sink, 3 recent (incl. the tail)
    with w.pager.frame() as f:
        assert w.fid.step(f, need=w.pager.free_pages + 1)["demoted"] == 2
    assert w.fid.span("a") == (1, 5)
    w.check_all()


def test_reserve_holds_back_promotion_then_decays():
    torch.manual_seed(3)
    w = World(P=24, min_batch=4, protect_recent=1, reserve_decay=0.5)
    start(w, {"a": 12 * w.S})
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 4)           # 4 pairs -> 4 pages freed
    free = w.pager.free_pages
    assert w.fid.reserve == 4
    promoted = []
    for _ in range(2):                                        # spare = free - need - reserve
        with w.pager.frame() as f:
            promoted.append(w.fid.step(f, need=free - 5)["promoted"])
    assert promoted == [0, 1]          # spare 5 - 4 = 1, then 5 - 2 = 3: one pair (two pages)


def test_eager_promotion_without_reserve():
    w = World(P=24, min_batch=2, protect_recent=1, reserve_decay=0.0)
    start(w, {"a": 12 * w.S})
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 2)
    with w.pager.frame() as f:
        assert w.fid.step(f, need=0)["promoted"] == 2


@pytest.mark.parametrize("one_pool", [False, True], ids=["two-pools", "one-pool"])
def test_aborted_frame_leaves_pool_and_tables_unchanged(one_pool):
    torch.manual_seed(4)
    w = World(one_pool=one_pool, min_batch=3, protect_recent=1)
    start(w, {"a": 7 * w.S, "b": 5 * w.S})
    k0, v0, t0 = w.k.clone(), w.v.clone(), [t.clone() for t in w.tables()]
    free0, epoch = w.pager.free_pages, w.pager.epoch
    with pytest.raises(RuntimeError, match="boom"):
        with w.pager.frame() as f:
            assert w.fid.step(f, need=free0 + 3)["demoted"] == 3
            raise RuntimeError("boom")
    assert torch.equal(w.k.view(torch.uint8), k0.view(torch.uint8))
    assert torch.equal(w.v.view(torch.uint8), v0.view(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(w.tables(), t0))
    assert (w.pager.free_pages, w.pager.epoch) == (free0, epoch)
    assert w.fid.span("a") == (0, 0) and w.fid.stats["demoted"] == 0
    w.check_all()
    # an aborted promotion: its held pages go back, the pair stays BASE
    with w.pager.frame() as f:
        w.fid.step(f, need=free0 + 3)
    with pytest.raises(RuntimeError, match="boom"):
        with w.pager.frame() as f:
            assert w.fid.step(f, need=0)["promoted"] == 3
            raise RuntimeError("boom")
    assert w.fid.stats["in_flight"] == 0 and w.pager.free_pages == free0 + 3
    w.check_all()


def test_alias_of_base_blocks_and_trim_inside_span_are_refused():
    torch.manual_seed(5)
    w = World(min_batch=2, protect_first=1, protect_recent=1)
    start(w, {"a": 7 * w.S})
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 2)
    assert w.fid.span("a") == (1, 5)
    k0, free0 = w.k.clone(), w.pager.free_pages
    with pytest.raises(ValueError, match="alias: session 'x' would share BASE block 1"):
        with w.pager.frame() as f:
            f.alias("x", "a", 3 * w.S)
    with pytest.raises(ValueError, match="trim: block 2 of 'a' is BASE"):
        with w.pager.frame() as f:
            f.trim("a", [2])
    assert torch.equal(w.k.view(torch.uint8), k0.view(torch.uint8))
    assert w.pager.free_pages == free0 and "x" not in w.pager.sessions()
    with w.pager.frame() as f:              # a prefix before the span may still be shared
        f.alias("x", "a", w.S)
    w.truth["x"] = tuple(t[: w.S] for t in w.truth["a"])
    w.check_all()


def test_session_end_with_promotion_in_flight_leaks_nothing():
    torch.manual_seed(6)
    w = World(min_batch=2, protect_recent=1)
    start(w, {"a": 8 * w.S, "b": 6 * w.S})
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 4)
    with w.pager.frame() as f:
        assert w.fid.step(f, need=0)["promoted"] == 4
    with w.pager.frame() as f:
        f.trim("a")
        f.trim("b")
    assert w.fid.stats["in_flight"] == 4
    w.fid.drain()
    with w.pager.frame() as f:
        w.fid.step(f)
    assert w.pager.free_pages == w.pager.num_pages and w.fid._host.free == w.pager.num_pages // 2
    assert w.fid.stats["in_flight"] == 0 and w.fid.stats["base_blocks"] == 0


def test_a_shortage_waits_for_promotions_in_flight_and_demotes_their_pairs():
    """A promotion still running when a step is short settles first, so the session's pairs
    are demotable as ``demotable`` counted them while it ran (the scheduler plans on that)."""
    torch.manual_seed(7)
    w = World(P=24, min_batch=2, protect_recent=1, reserve_decay=0.0, slow=True)
    start(w, {"a": 12 * w.S})
    before = w.fid.demotable("a")
    with w.pager.frame() as f:
        assert w.fid.step(f, need=w.pager.free_pages + 2)["demoted"] == 2
    with w.pager.frame() as f:
        assert w.fid.step(f, need=0)["promoted"] == 2
    flag = w.fid._flight["a"][0].done
    assert not flag.query() and w.fid.demotable("a") == before     # counted as settled
    with w.pager.frame() as f:                                     # no shortage: no wait
        assert w.fid.step(f, need=0) == {"demoted": 0, "promoted": 0, "settled": 0}
    assert not flag.query() and w.fid.stats["in_flight"] == 2
    free = w.pager.free_pages
    with w.pager.frame() as f:
        got = w.fid.step(f, need=free + 3)
        assert f.free_pages >= free + 3                            # the shortage is met
    assert flag.query() and got["settled"] == 2 and got["demoted"] >= 1
    assert w.fid.stats["in_flight"] == 0
    w.check_all()


def test_host_pairs_bound_demotion_and_slots_come_back():
    torch.manual_seed(8)
    w = World(P=48, min_batch=8, protect_recent=1, host_pairs=3)
    start(w, {"a": 9 * w.S, "b": 9 * w.S})
    with w.pager.frame() as f:
        assert w.fid.step(f, need=w.pager.free_pages + 8)["demoted"] == 3
    assert w.fid._host.free == 0
    w.check_all()
    with w.pager.frame() as f:
        w.fid.promote(f, "a")
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages)              # settle, no new promotions
    assert w.fid.span("a") == (0, 0) and w.fid._host.free == 3 - len(w.fid._pairs)
    w.check_all()


def test_promote_one_session_and_out_of_pages():
    torch.manual_seed(7)
    w = World(P=16, min_batch=4, protect_recent=1)
    start(w, {"a": 10 * w.S, "b": 5 * w.S})           # 15 of 16 pages
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 4)
    spans = {k: w.fid.span(k) for k in "ab"}
    with pytest.raises(OutOfPages):
        with w.pager.frame() as f:
            f.reserve("c", 4 * w.S)                    # take all but one free page
            w.fid.promote(f, "a")
    assert {k: w.fid.span(k) for k in "ab"} == spans and w.fid.stats["in_flight"] == 0
    w.check_all()
    with w.pager.frame() as f:
        n = w.fid.promote(f, "b")
    assert n == (spans["b"][1] - spans["b"][0]) // 2 and w.fid.stats["in_flight"] == n
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages)
    assert w.fid.span("b") == (0, 0)
    w.check_all()


def test_promote_a_limited_number_of_top_pairs():
    """``promote(frame, key, limit)``: the span's top ``limit`` pairs, so a pool with few free
    pages promotes in rounds (two held pages a pair, the BASE page freed at the settle)."""
    torch.manual_seed(9)
    w = World(P=16, min_batch=4, protect_recent=1)
    start(w, {"a": 10 * w.S, "b": 5 * w.S})           # 15 of 16 pages
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 4)
    first, end = w.fid.span("a")
    assert end - first >= 4
    with pytest.raises(ValueError, match="limit: expected an int >= 0, got -1"):
        with w.pager.frame() as f:
            w.fid.promote(f, "a", limit=-1)
    with w.pager.frame() as f:
        assert w.fid.promote(f, "a", limit=0) == 0
        assert w.fid.promote(f, "a", limit=1) == 1
    states = w.fid.block_states("a")
    assert list(states[end - 2: end]) == [PROMOTING] * 2 and (states[first: end - 2] == BASE).all()
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages)          # settle, no new promotions
    assert w.fid.span("a") == (first, end - 2)
    w.check_all()


def test_promotion_after_a_settle_holds_pool_pages_only():
    """Pages a settle frees in a step's frame are reusable by reserves, not held: with an
    empty pool the step promotes nothing (it counted them and raised OutOfPages in hold)."""
    S = 8
    w = World(P=40, B=4, L=40, min_batch=16, protect_recent=1, reserve_decay=0.0)
    start(w, {"a": 33 * S})
    with w.pager.frame() as f:
        assert w.fid.step(f, need=w.pager.free_pages + 16)["demoted"] == 16
    start(w, {"b": (w.pager.free_pages - 4) * S})      # 4 free pages
    with w.pager.frame() as f:                          # the reserve decays to 0
        w.fid.step(f, need=f.free_pages)
    with w.pager.frame() as f:
        assert w.fid.promote(f, "a", limit=2) == 2      # holds the 4
    assert w.pager.free_pages == 0
    with w.pager.frame() as f:                          # settles 2: their BASE pages free
        assert w.fid.step(f, need=0) == {"demoted": 0, "promoted": 0, "settled": 2}
    assert w.pager.free_pages == 2
    with w.pager.frame() as f:                          # pool pages now: one more promotion
        assert w.fid.step(f, need=0)["promoted"] == 1
    w.check_all()


def test_verbs_in_the_frame_of_a_step_see_its_edits():
    """One frame holding a step and other verbs (a second reading found each of these broken
    when the policy read only committed state): the session ending in its first demotion's
    frame, the last promotion settling in the frame that ends its session, promote then step,
    alias and trim of pairs demoted in the same frame, a second step, blocks reserved before
    the step."""
    S = 8
    w = World(one_pool=True, min_batch=2, protect_recent=1)
    start(w, {"a": 6 * S, "b": 6 * S})
    with w.pager.frame() as f:                       # first demotion and EOS together
        w.fid.step(f, need=w.pager.free_pages + 4)
        f.trim("a")
    del w.truth["a"]
    assert w.fid.span("a") == (0, 0) and all(p.key != "a" for p in w.fid._pairs.values())
    start(w, {"c": 5 * S})                           # reuses a's slot: its span row is empty
    w.check_all()
    with pytest.raises(ValueError, match="step: already called"):
        with w.pager.frame() as f:
            w.fid.step(f, need=0)
            w.fid.step(f, need=0)
    w.check_all()
    with w.pager.frame() as f:                       # promote, then a step in the same frame
        n = w.fid.promote(f, "b")
        assert w.fid.step(f, need=w.pager.free_pages + 2)["demoted"] == 2  # c's, not b's
    assert w.fid.stats["in_flight"] == n and w.fid.span("b") != (0, 0)
    w.check_all()
    w.fid.drain()
    with w.pager.frame() as f:                       # b's promotions settle as b ends
        assert w.fid.step(f, need=0)["settled"] == n
        f.trim("b")
    del w.truth["b"]
    w.check_all()
    for verb in (lambda f: f.alias("x", "c", 2 * S), lambda f: f.trim("c", [1])):
        with pytest.raises(ValueError, match="BASE"):
            with w.pager.frame() as f:               # c's first pairs became BASE above
                verb(f)
    with w.pager.frame() as f:
        g = w.grow(f, "c", 3 * S)                    # reserved, not written yet
        w.fid.step(f, need=w.pager.free_pages + 8)
    w.write(*g, f.result.copies)
    assert w.fid.span("c")[1] <= 5                   # only blocks committed before the frame
    w.check_all()


def test_aborted_settle_then_trim_is_refused():
    w = World(min_batch=2, protect_recent=1)
    start(w, {"a": 6 * w.S})
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 2)
    with w.pager.frame() as f:
        w.fid.step(f, need=0)
    with pytest.raises(RuntimeError, match="boom"):
        with w.pager.frame() as f:
            assert w.fid.step(f, need=0)["settled"] == 2
            raise RuntimeError("boom")
    with pytest.raises(ValueError, match="trim: block 0 of 'a' is BASE"):
        with w.pager.frame() as f:
            f.trim("a", [0])
    with w.pager.frame() as f:
        assert w.fid.step(f, need=0)["settled"] == 2
    w.check_all()


def test_refused_frames_after_a_demotion_or_before_a_settle():
    """A second reading of 43ef335 found the first two accepted: a trim of a pair's second
    block in the frame that demoted the pair (the pair's promotion then failed in every later
    step), and an alias that took BASE pages whose promotion settled later in its frame (the
    new session read packed BASE bytes as TARGET). A promotion of a pair trimmed in its frame
    said only that a page was not live."""
    S = 8
    w = World(one_pool=True, min_batch=2, protect_recent=1)
    start(w, {"a": 6 * S})
    snap = w.snapshot()
    with pytest.raises(ValueError, match="trim: block 1 of 'a' is BASE"):
        with w.pager.frame() as f:
            w.fid.step(f, need=w.pager.free_pages + 2)
            f.trim("a", [1])
    w.unchanged(snap)
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 2)
    assert w.fid.span("a") == (0, 4)
    snap = w.snapshot()
    with pytest.raises(ValueError, match="promote: BASE blocks 2, 3 of 'a' were trimmed"):
        with w.pager.frame() as f:
            f.trim("a", [3])
            w.fid.promote(f, "a")
    w.unchanged(snap)
    with w.pager.frame() as f:
        w.fid.promote(f, "a")
    snap = w.snapshot()
    with pytest.raises(ValueError, match="alias: session 'x' would share BASE block 0 of 'a'"):
        with w.pager.frame() as f:
            f.alias("x", "a", 4 * S)
            assert w.fid.step(f, need=0)["settled"] == 2
    w.unchanged(snap)
    with w.pager.frame() as f:              # settle first, then alias: the refined pages
        assert w.fid.step(f, need=0)["settled"] == 2
        f.alias("x", "a", 4 * S)
    w.truth["x"] = tuple(t[: 4 * S] for t in w.truth["a"])
    w.check_all()


def test_transport_window_never_holds_a_demoted_block():
    """A transport may share the pager when ``protect_recent`` covers its window (refused
    otherwise, whichever attaches first); its arena then matches the truth through demotions
    and promotions. A far view is refused."""
    S, NW = 8, 3
    page_bytes = S * HKV * D * 2
    w = World(P=64, one_pool=True, min_batch=2, protect_recent=NW)
    tr = Transport(w.pager, NW * S, page_bytes)
    with pytest.raises(ValueError, match="protect_recent: expected >= 4"):
        Transport(w.pager, 4 * S, page_bytes)
    with pytest.raises(ValueError, match="Fidelity and FarView"):
        FarView(w.pager, window_tokens=NW * S, chunk_tokens=2 * S, cap=2, num_layers=1,
                num_kv_heads=HKV, head_dim=D)
    other = Pager(8, S, 2, 8, device="cpu")
    Transport(other, NW * S, page_bytes)
    with pytest.raises(ValueError, match="protect_recent: expected >= 3"):
        Fidelity(other, [torch.zeros(8, S, HKV, D, dtype=torch.float16)], protect_recent=2)
    ka, va = (torch.zeros(w.pager.max_sessions, NW * S, HKV, D, dtype=w.dtype) for _ in "kv")

    def step(need, grow):
        with w.pager.frame() as f:
            w.fid.step(f, need=need)
            grown = [w.grow(f, key, n) for key, n in grow.items()]
        for g in grown:
            w.write(*g, f.result.copies)
        t = w.pager.device_tables
        torch.ops.kvops.paged_gather_merged(w.k, w.v, t["trains"], t["num_trains"],
                                            arena_as_pages(ka, S), arena_as_pages(va, S))
        w.check_all()
        for key in w.pager.sessions():
            slot, n = w.pager.slot(key), w.pager.length(key)
            nb = -(-n // S)
            for j in range(max(0, nb - NW), nb):
                rows = slice(j * S, min(n, (j + 1) * S))
                page = arena_page(slot, j, NW)
                for arena, truth in ((ka, w.truth[key][0]), (va, w.truth[key][1])):
                    got = arena_as_pages(arena, S)[page][: rows.stop - rows.start]
                    assert torch.equal(got, truth[rows]), (key, j)

    torch.manual_seed(11)
    step(0, {"a": 9 * S, "b": 7 * S + 3})
    step(w.pager.free_pages + 4, {"a": S})              # demotes, then a's window slides
    assert w.fid.stats["base_blocks"] >= 4 and tr.last["moves"] >= 1
    step(w.pager.free_pages + 2, {"a": 2 * S, "b": 5})
    step(0, {"a": 1})                                   # promotions issued and settled
    step(0, {"b": 2 * S})
    assert w.fid.stats["promoted"] >= 1


def test_attention_kwargs_always_for_a_fixed_graph():
    w = World(min_batch=2, protect_recent=1)
    start(w, {"a": 6 * w.S})
    assert w.fid.attention_kwargs() == {}
    table = w.fid.attention_kwargs(always=True)["base_span"]
    assert table is w.pager.device_tables["base_span"] and not table.any()


def test_bad_arguments_name_themselves():
    pager = Pager(8, 8, 2, 4)
    k = torch.zeros(8, 8, HKV, D, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"caches\[1\]: expected torch.float16"):
        Fidelity(pager, [k, k.float()])
    with pytest.raises(ValueError, match="min_batch: expected an int >= 1, got 0"):
        Fidelity(pager, [k], min_batch=0)
    with pytest.raises(ValueError, match="reserve_decay"):
        Fidelity(pager, [k], reserve_decay=1.0)
    with pytest.raises(ValueError, match="codec: expected one of"):
        Fidelity(pager, [k], codec="e4m3")
    fid = Fidelity(pager, [k])
    with pytest.raises(ValueError, match="need: expected an int >= 0, got -1"):
        with pager.frame() as f:
            fid.step(f, need=-1)


class FidelityMachine(RuleBasedStateMachine):
    """Random growth, session ends, shortages, promotions (finishing when a rule says so),
    aliases and trims; after every step each session reads back its truth (BASE blocks as the
    codec's BASE) and no page is lost; a refused or aborted frame changes nothing."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = World(P=40, S=8, B=5, L=12, one_pool=True, slow=True, min_batch=2,
                       protect_recent=1, reserve_decay=0.5, max_promote=2)
        self.n = 0
        with self.w.pager.frame():          # the tables exist from the first commit on
            pass

    @rule(n=st.integers(1, 40), data=st.data())
    def grow(self, n, data):
        keys = self.w.pager.sessions()
        if keys and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(keys))
        else:
            key, self.n = f"s{self.n}", self.n + 1
        try:
            with self.w.pager.frame() as f:
                g = self.w.grow(f, key, n)
        except (OutOfPages, ValueError):
            return
        self.w.write(*g, f.result.copies)

    @precondition(lambda self: self.w.pager.sessions())
    @rule(data=st.data())
    def end(self, data):
        key = data.draw(st.sampled_from(self.w.pager.sessions()))
        with self.w.pager.frame() as f:
            f.trim(key)
        del self.w.truth[key]

    @rule(extra=st.integers(-12, 6))
    def step(self, extra):
        with self.w.pager.frame() as f:      # short of pages by ``extra`` when positive
            self.w.fid.step(f, need=max(0, self.w.pager.free_pages + extra))

    @precondition(lambda self: self.w.pager.sessions())
    @rule(data=st.data())
    def promote(self, data):
        key = data.draw(st.sampled_from(self.w.pager.sessions()))
        try:
            with self.w.pager.frame() as f:
                self.w.fid.promote(f, key)
        except OutOfPages:
            pass

    @precondition(lambda self: self.w.pager.sessions())
    @rule(data=st.data(), blocks=st.integers(0, 6))
    def alias(self, data, blocks):
        src = data.draw(st.sampled_from(self.w.pager.sessions()))
        n = min(blocks * self.w.S, self.w.pager.length(src))
        first, end = self.w.fid.span(src)
        dst, self.n = f"s{self.n}", self.n + 1
        try:
            with self.w.pager.frame() as f:
                f.alias(dst, src, n)
        except ValueError as e:
            nb = -(-n // self.w.S)
            if "trimmed" in str(e):
                assert min(self.w.pager.pages(src)[:nb]) < 0
            else:
                assert end > first and nb > first
            return
        except OutOfPages:
            return
        self.w.truth[dst] = tuple(t[:n] for t in self.w.truth[src])

    @precondition(lambda self: self.w.fid.stats["in_flight"])
    @rule(data=st.data())
    def finish(self, data):
        """One batch of promotions finishes on its (stand-in) side stream."""
        fid = self.w.fid
        flags = []                          # in a replayable order (not by id)
        for p in [*fid._orphans, *(p for s in fid._flight.values() for p in s)]:
            if all(p.done is not g for g in flags):
                flags.append(p.done)
        data.draw(st.sampled_from(flags)).done = True

    @rule(data=st.data(), acts=st.lists(st.sampled_from(["step", "promote", "end", "alias",
                                                          "grow", "trim"]),
                                        min_size=2, max_size=6),
          abort=st.booleans())
    def mixed_frame(self, data, acts, abort):
        """Several verbs in one frame (a step at most once), maybe aborted: the policy must
        read its own pending edits, and a refused or aborted frame must change nothing."""
        w, S = self.w, self.w.S
        grown, aliased, ended, stepped = [], [], [], False
        snap = w.snapshot()
        try:
            with w.pager.frame() as f:
                for act in acts:
                    live = [k for k in w.pager.sessions() if f.has(k)]
                    if act == "step" and not stepped:
                        stepped = True
                        w.fid.step(f, need=max(0, w.pager.free_pages +
                                               data.draw(st.integers(-8, 6))))
                    elif act == "promote" and live:
                        w.fid.promote(f, data.draw(st.sampled_from(live)))
                    elif act == "end" and live:
                        key = data.draw(st.sampled_from(live))
                        if key not in [g[0] for g in grown]:
                            f.trim(key)
                            ended.append(key)
                    elif act == "alias" and live:
                        src = data.draw(st.sampled_from(live))
                        n = min(data.draw(st.integers(0, 6)) * S, w.pager.length(src))
                        dst, self.n = f"s{self.n}", self.n + 1
                        f.alias(dst, src, n)
                        aliased.append((dst, src, n))
                    elif act == "grow":
                        key = data.draw(st.sampled_from(live)) if live and \
                            data.draw(st.booleans()) else f"s{self.n}"
                        if key == f"s{self.n}":
                            self.n += 1
                        grown.append(w.grow(f, key, data.draw(st.integers(1, 20))))
                    elif act == "trim" and live:
                        key = data.draw(st.sampled_from(live))
                        nb = -(-f.length(key) // S)
                        if key not in [g[0] for g in grown] and nb > 1:
                            f.trim(key, [data.draw(st.integers(0, nb - 2))])
                if abort:
                    raise RuntimeError("abort")
        except (RuntimeError, ValueError, OutOfPages):
            w.unchanged(snap)
            return
        apply_copies(w.k, w.v, f.result.copies)
        truth = {dst: tuple(t[:n] for t in w.truth[src]) for dst, src, n in aliased}
        for g in grown:
            w.write(*g)
        w.truth.update(truth)
        for key in ended:
            del w.truth[key]

    @invariant()
    def consistent(self):
        self.w.check_all()

    def teardown(self):
        with self.w.pager.frame() as f:
            for key in self.w.pager.sessions():
                f.trim(key)
        self.w.fid.drain()
        with self.w.pager.frame() as f:
            self.w.fid.step(f)
        assert self.w.pager.free_pages == self.w.pager.num_pages
        assert self.w.fid._host.free == self.w.pager.num_pages // 2


TestFidelityMachine = FidelityMachine.TestCase
TestFidelityMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@given(seed=st.integers(0, 2**16))
@settings(max_examples=5, deadline=None)
def test_cuda_side_stream_promotion(seed):
    """On CUDA: pinned backings, the side stream's refine, and attention reading BASE while the
    promotion is in flight, then TARGET once it is mapped."""
    torch.manual_seed(seed)
    w = World(P=64, S=16, B=4, L=16, dtype=torch.bfloat16, device="cuda", one_pool=seed % 2 == 0,
              min_batch=4, protect_recent=1)
    start(w, {"a": 9 * w.S + 2, "b": 7 * w.S})
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 6)
    assert all(c.is_pinned() for c in w.fid._host.chunks.values())
    with w.pager.frame() as f:
        assert w.fid.step(f, need=0)["promoted"] == 6
    q = torch.randn(4, 2 * HKV, D, device="cuda").to(torch.bfloat16)
    out, _ = torch.ops.kvops.elastic_attention(
        q, w.k, w.v, w.pager.device_tables["block_table"], w.pager.device_tables["seq_lens"],
        **w.fid.attention_kwargs())
    bt, sl, span = w.tables()
    want, _ = elastic_oracle(q, w.k, w.v, bt, sl, base_span=span)
    torch.testing.assert_close(out[:2].double().cpu(), want[:2], atol=2e-2, rtol=2e-2)
    w.check_all()
    w.fid.drain()
    with w.pager.frame() as f:
        assert w.fid.step(f, need=0)["settled"] == 6
    torch.cuda.synchronize()
    w.check_all()
