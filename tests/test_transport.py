"""Transport: committed view deltas -> ring-window page moves -> trains, checked end to end by
running the committed tables through paged_gather_merged and reading the arena back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

import kvops
from kvops.layouts import arena_as_pages, plan_trains
from kvops.runtime import OutOfPages, Pager, Transport, apply_copies
from tests.conftest import KERNEL_DEVICES, capture_graph, requires_cuda

S, HKV, D = 8, 1, 16


class Harness:
    """A pool whose token (session tag, position) is written as the K value and its negation as
    the V value; the arena must hold each session's window in ring order after each gather."""

    def __init__(self, device, P=48, B=3, W=24, L=16, copy_tail=True, **transport):
        self.device = device
        self.pager = Pager(P, S, B, L, device=device)
        self.tr = Transport(self.pager, W, S * HKV * D * 4, copy_tail=copy_tail, **transport)
        self.W = W
        self.k = torch.zeros(P, S, HKV, D, device=device)
        self.v = torch.zeros(P, S, HKV, D, device=device)
        self.k_arena = torch.full((B, W, HKV, D), float("nan"), device=device)
        self.v_arena = torch.full((B, W, HKV, D), float("nan"), device=device)
        self.tags: dict = {}

    def step(self, edits):
        old = {k: self.pager.length(k) for k in self.pager.sessions()}
        with self.pager.frame() as f:
            edits(f)
        apply_copies(self.k, self.v, f.result.copies)
        for key in self.pager.sessions():
            pages = self.pager.pages(key)
            for p in range(old.get(key, 0), self.pager.length(key)):
                if key in old or not self._aliased(key, p):
                    val = self.tags.setdefault(key, len(self.tags) + 1) * 1000 + p
                    self.k[pages[p // S], p % S] = val
                    self.v[pages[p // S], p % S] = -val
                    if not self.tr.copy_tail:    # the model writes through, prefill too
                        self.k_arena[self.pager.slot(key), p % self.W] = val
                        self.v_arena[self.pager.slot(key), p % self.W] = -val
        self.gather()
        return f.result.stats["transport"]

    def gather(self):
        """One gather of the committed trains (the graph test swaps in a replay)."""
        dev = self.pager.device_tables
        torch.ops.kvops.paged_gather_merged(self.k, self.v, dev["trains"], dev["num_trains"],
                                            arena_as_pages(self.k_arena, S),
                                            arena_as_pages(self.v_arena, S))

    def _aliased(self, key, p):
        return p < getattr(self, "alias_len", {}).get(key, 0)

    def check_windows(self, keys=None):
        for key in self.pager.sessions() if keys is None else keys:
            slot = self.pager.slot(key)
            ws, wl = self.tr.window_of(key)
            n = self.pager.length(key)
            assert wl == n - max(0, -(-n // S) - self.W // S) * S
            assert (ws + wl - n) % self.W == 0, "window start and length disagree with ring"
            for p in range(n - wl, n):
                want = self.expected(key, p)
                got_k = self.k_arena[slot, p % self.W, 0, 0].item()
                got_v = self.v_arena[slot, p % self.W, 0, 0].item()
                assert (got_k, got_v) == (want, -want), f"{key} token {p} slot {p % self.W}"

    def expected(self, key, p):
        src = getattr(self, "alias_src", {}).get(key)
        if src is not None and p < self.alias_len[key]:
            return self.expected(src, p)
        return self.tags[key] * 1000 + p


@pytest.fixture(params=[("torch", "cpu")] + [("triton", d) for d in KERNEL_DEVICES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def harness(request):
    impl, device = request.param
    with kvops.backend(impl if device == "cpu" else "auto"):
        yield Harness(torch.device(device))


def test_decode_moves_one_page_per_session_per_step(harness):
    h = harness
    stats = h.step(lambda f: [f.reserve(s, 21) for s in ("a", "b")])
    assert stats["moves"] == 6 and stats["groups"] == 2      # 3 contiguous pages each
    h.check_windows()
    for _ in range(30):
        stats = h.step(lambda f: [f.reserve(s, 1) for s in ("a", "b")])
        assert stats["moves"] == 2 and stats["groups"] == 2
        h.check_windows()
    assert h.pager.length("a") == 51


def test_alias_cow_and_eos(harness):
    h = harness
    h.step(lambda f: f.reserve("a", 29))
    h.alias_src, h.alias_len = {"c": "a"}, {"c": 29}
    stats = h.step(lambda f: (f.alias("c", "a", 29), f.reserve("c", 2), f.reserve("a", 1)))
    # c's window: 3 blocks, its tail copied on write; a's tail gained a token
    assert stats["moves"] == 3 + 1
    h.check_windows()
    assert h.pager.pages("c")[:3] == h.pager.pages("a")[:3]
    assert h.pager.pages("c")[3] != h.pager.pages("a")[3]
    for _ in range(12):
        h.step(lambda f: (f.reserve("a", 1), f.reserve("c", 1)))
        h.check_windows()
    slot = h.pager.slot("a")
    stats = h.step(lambda f: (f.trim("a"), f.trim("c", [0, 1])))
    assert stats["moves"] == 0 and stats["groups"] == 0
    assert h.pager.host_tables["win_len"][slot] == 0
    h.check_windows()


def test_new_session_in_reused_slot_moves_its_whole_window(harness):
    h = harness
    h.step(lambda f: (f.reserve("a", 40), f.reserve("b", 3)))
    slot = h.pager.slot("a")
    h.step(lambda f: f.trim("a"))
    stats = h.step(lambda f: f.reserve("z", 17))
    assert h.pager.slot("z") == slot and stats["moves"] == 3
    h.check_windows()


def test_write_through_moves_only_new_windows_and_remaps(harness):
    """copy_tail=False: the model writes new tokens into the arena, prefill's too, so neither
    an arrival's own tokens nor decode move anything; an aliased arrival moves the window
    blocks it shares and a copy-on-write moves the remapped tail."""
    h = Harness(harness.device, copy_tail=False)
    stats = h.step(lambda f: (f.reserve("a", 21), f.reserve("b", 5)))
    assert stats["moves"] == 0 and stats["groups"] == 0
    h.check_windows()
    for _ in range(20):
        stats = h.step(lambda f: [f.reserve(s, 1) for s in ("a", "b")])
        assert stats["moves"] == 0 and stats["groups"] == 0
        h.check_windows()
    h.alias_src, h.alias_len = {"c": "a"}, {"c": 41}
    stats = h.step(lambda f: (f.alias("c", "a", 41), f.reserve("a", 1)))
    # c's window (3 blocks) moves; a's shared tail is copied on write and moved once
    assert stats["moves"] == 3 + 1
    h.check_windows()


def test_deferred_aliased_blocks_move_by_the_first_decode_and_only_in_its_window(harness):
    """defer_aliased: an aliased arrival's window blocks are staged, not moved; each commit
    moves stage_pages of the newest, the first one-token step moves the rest, and blocks a
    later prefill chunk pushes out of the window are never moved."""
    h = Harness(harness.device, P=64, copy_tail=False, defer_aliased=True, stage_pages=1)
    h.step(lambda f: f.reserve("a", 60))
    h.alias_src, h.alias_len = {"c": "a", "d": "a"}, {"c": 40, "d": 40}
    # c: 44 tokens, window blocks 3..5, aliased 3 and 4: block 4 moves, 3 stays staged
    stats = h.step(lambda f: (f.alias("c", "a", 40), f.reserve("c", 4)))
    assert (stats["moves"], stats["staged"], stats["dropped"]) == (1, 1, 0)
    stats = h.step(lambda f: f.reserve("c", 4))                 # prefill: block 3 moves
    assert (stats["moves"], stats["staged"], stats["dropped"]) == (1, 0, 0)
    for _ in range(10):                                         # decode reads a whole window
        stats = h.step(lambda f: f.reserve("c", 1))
        assert stats["moves"] == 0
        h.check_windows(["a", "c"])
    # d: 48 tokens (blocks 3, 4 staged, 4 moves), then 16 more push block 3 out unmoved
    stats = h.step(lambda f: (f.alias("d", "a", 40), f.reserve("d", 8)))
    assert (stats["moves"], stats["staged"]) == (1, 1)
    stats = h.step(lambda f: f.reserve("d", 16))
    assert (stats["moves"], stats["staged"], stats["dropped"]) == (0, 0, 1)
    stats = h.step(lambda f: [f.reserve(k, 1) for k in ("c", "d")])
    assert stats["moves"] == 0
    h.check_windows()


def test_deferred_aliased_blocks_left_to_the_deadline_move_in_one_step(harness):
    h = Harness(harness.device, P=64, copy_tail=False, defer_aliased=True, stage_pages=0)
    h.step(lambda f: f.reserve("a", 60))
    h.alias_src, h.alias_len = {"c": "a"}, {"c": 44}             # block 5 partly shared
    stats = h.step(lambda f: (f.alias("c", "a", 44), f.reserve("c", 3)))
    assert (stats["moves"], stats["staged"]) == (0, 3)           # blocks 3, 4, 5
    stats = h.step(lambda f: f.reserve("c", 1))                  # the first decode
    assert (stats["moves"], stats["staged"]) == (3, 0)
    h.check_windows()
    stats = h.step(lambda f: (f.trim("c"), f.reserve("a", 1)))
    assert stats["moves"] == 0
    h.check_windows()


@settings(max_examples=40, deadline=None)
@given(alias=st.integers(1, 59), chunks=st.lists(st.integers(1, 20), min_size=1, max_size=4),
       stage=st.integers(0, 3), other=st.booleans())
def test_deferred_aliased_windows_are_whole_at_every_decode(alias, chunks, stage, other):
    """Any aliased length, prefill chunks and staging budget: at every step in which a session
    grows by one token its whole window is in the arena, and no other session's is disturbed."""
    h = Harness(torch.device("cpu"), P=64, copy_tail=False, defer_aliased=True,
                stage_pages=stage)
    h.step(lambda f: (f.reserve("a", 60), f.reserve("b", 30)))
    h.alias_src, h.alias_len = {"c": "a"}, {"c": alias}
    first = chunks[0] if chunks[0] > 1 else 2
    h.step(lambda f: (f.alias("c", "a", alias), f.reserve("c", first)))
    for n in chunks[1:]:
        h.step(lambda f, n=n: (f.reserve("c", n),) + ((f.reserve("b", 1),) if other else ()))
        if other:
            h.check_windows(["a", "b"])
    for _ in range(4):
        stats = h.step(lambda f: [f.reserve(k, 1) for k in ("b", "c")])
        assert stats["staged"] == 0
        h.check_windows()


def test_an_aborted_frame_leaves_the_staged_blocks_as_they_were():
    h = Harness(torch.device("cpu"), P=64, copy_tail=False, defer_aliased=True, stage_pages=0)
    h.step(lambda f: f.reserve("a", 60))
    h.step(lambda f: (f.alias("c", "a", 40), f.reserve("c", 4)))
    before = dict(h.tr._staged)
    assert before
    with pytest.raises(RuntimeError, match="boom"):
        with h.pager.frame() as f:
            f.trim("c")
            f.alias("d", "a", 40)
            f.reserve("d", 3)
            raise RuntimeError("boom")
    assert h.tr._staged == before


def test_defer_aliased_needs_write_through():
    with pytest.raises(ValueError, match="defer_aliased: expected copy_tail=False"):
        Transport(Pager(8, 16, 2, 4), 32, 1024, copy_tail=True, defer_aliased=True)
    with pytest.raises(ValueError, match="stage_pages: expected an int >= 0, got -1"):
        Transport(Pager(8, 16, 2, 4), 32, 1024, copy_tail=False, defer_aliased=True,
                  stage_pages=-1)


def test_stats_match_planner_and_tables():
    pager = Pager(64, 16, 4, 8)
    tr = Transport(pager, 64, 32768)
    with pager.frame() as f:
        for s in range(4):
            f.reserve(s, 50)
    stats = f.result.stats["transport"]
    moves_src, moves_dst = [], []
    for s in range(4):
        for j, page in enumerate(pager.pages(s)):
            moves_src.append(page)
            moves_dst.append(pager.slot(s) * 4 + j % 4)
    order = sorted(range(len(moves_src)), key=lambda i: moves_dst[i])
    trains, want = plan_trains([moves_src[i] for i in order], [moves_dst[i] for i in order],
                               32768)
    assert stats == dict(want, moves=16)
    n = want["groups"]
    assert pager.host_tables["num_trains"][0] == n
    assert pager.host_tables["trains"][:n].tolist() == trains.tolist()
    assert tr.arena_pages == 16


def test_bad_window_raises():
    with pytest.raises(ValueError, match="multiple of the page size"):
        Transport(Pager(8, 16, 2, 4), 40, 1024)


@requires_cuda
def test_one_captured_gather_follows_every_commit():
    """The gather is captured once on the pager's device tables; each step only commits a
    frame (one upload) and replays the graph, and the arena follows the moving mappings."""
    h = Harness(torch.device("cuda"), P=64, B=3, W=24, L=16)
    h.step(lambda f: (f.reserve("a", 9), f.reserve("b", 2)))
    graph, _ = capture_graph(h.gather)
    h.gather = graph.replay
    h.alias_src, h.alias_len = {"c": "a"}, {"c": 30}
    for t in range(40):
        if t == 21:
            h.step(lambda f: (f.alias("c", "a", 30), f.reserve("c", 1), f.trim("b")))
        else:
            h.step(lambda f: [f.reserve(k, 1) for k in h.pager.sessions()])
        torch.cuda.synchronize()
        h.check_windows()



def test_window_tables_drive_static_sliding_attention():
    """Attention over the gathered arena with the committed win_start/win_len equals softmax
    attention over each session's visible tokens read straight from the pool."""
    gen = torch.Generator().manual_seed(4)
    P, B, W, L, Hkv, G, Dh = 40, 3, 32, 12, 2, 2, 16
    pager = Pager(P, S, B, L, device="cpu")
    Transport(pager, W, S * Hkv * Dh * 4)
    k = torch.randn(P, S, Hkv, Dh, generator=gen)
    v = torch.randn(P, S, Hkv, Dh, generator=gen)
    k_arena, v_arena = torch.zeros(B, W, Hkv, Dh), torch.zeros(B, W, Hkv, Dh)
    lengths = {"a": 5, "b": 29, "c": 0}
    pager.frame().commit()                  # an empty first step fixes the device tables
    dev = pager.device_tables
    for step in range(31):
        with pager.frame() as f:
            for key in ("a", "b"):
                f.reserve(key, lengths[key] if step == 0 else 1)
                lengths[key] += 0 if step == 0 else 1
            if step == 10:
                f.alias("c", "b", 36)
                lengths["c"] = 36
        torch.ops.kvops.paged_gather_merged(k, v, dev["trains"], dev["num_trains"],
                                            arena_as_pages(k_arena, S),
                                            arena_as_pages(v_arena, S))
        q = torch.randn(B, Hkv * G, Dh, generator=gen)
        out, _ = torch.ops.kvops.static_sliding_attention(q, k_arena, v_arena,
                                                          dev["win_start"], dev["win_len"])
        for key in pager.sessions():
            slot, n = pager.slot(key), lengths[key]
            pages = pager.pages(key)
            first = max(0, -(-n // S) - W // S) * S
            toks = torch.stack([k[pages[p // S], p % S] for p in range(first, n)])
            vals = torch.stack([v[pages[p // S], p % S] for p in range(first, n)])
            qs = q[slot].view(Hkv, G, Dh).double()
            logits = torch.einsum("hgd,nhd->hgn", qs, toks.double()) * Dh ** -0.5
            want = torch.einsum("hgn,nhd->hgd", logits.softmax(-1), vals.double())
            torch.testing.assert_close(out[slot].double(), want.reshape(Hkv * G, Dh),
                                       atol=1e-5, rtol=1e-5)


# -- the commit's fast paths against a from-scratch model ------------------------------------
class _Recorder:
    """A policy written against ``on_commit(frame, deltas, grown)``: it records what the
    commit hands every policy (the deltas, and the growth batch with appended blocks)."""

    def tables(self):
        return {}

    def on_commit(self, frame, deltas, grown):
        self.seen = ([(d.key, d.slot, d.new, d.closed, d.before_length, d.after_length,
                       [d.page_after(j) for j in range(-(-d.after_length // FS))])
                      for d in deltas],
                     list(zip(grown.keys, grown.slots.tolist(), grown.before.tolist(),
                              grown.after.tolist(), grown.tails.tolist(),
                              grown.appended.tolist())))
        return {}


FP, FS, FB, FL, FW = 48, 4, 5, 12, 12        # pages, page size, slots, blocks, window tokens
FNW = FW // FS


class _Boom(Exception):
    pass


class TransportMachine(RuleBasedStateMachine):
    """Random frames of reserve / alias / trim verbs (several per frame, some failing, some
    frames aborted) through a Pager with the Transport and a legacy hook attached. After each
    commit: the trains equal plan_trains over the moves computed from the committed views
    before and after (the transport's definition, from scratch), the window tables equal
    their formula, the legacy hook saw what it would have without the fast path, and a model
    of the arena (page and content version per arena page), updated only by the committed
    trains (and by the model itself in write-through mode), holds every live session's window
    blocks."""

    def __init__(self):
        super().__init__()
        self.copy_tail = True
        self.started = False

    @initialize(copy_tail=st.booleans())
    def start(self, copy_tail):
        self.copy_tail = copy_tail
        self.pager = Pager(FP, FS, FB, FL, device="cpu")
        # 2-page trains at most: merging and the cap both happen
        self.tr = Transport(self.pager, FW, 64, max_train_bytes=128, copy_tail=copy_tail)
        self.rec = _Recorder()
        self.pager.attach(self.rec)
        self.pager.frame().commit()                 # an empty step fixes the tables
        self.version = [0] * FP
        self.arena: dict[int, tuple[int, int]] = {}
        self.next_key = 0

    def _views(self):
        pg = self.pager
        return {k: (pg.length(k), pg.pages(k), pg.slot(k)) for k in pg.sessions()}

    def _snapshot(self):
        pg = self.pager
        return (pg.epoch, pg.free_pages, pg.allocator.spans(), list(pg.committed.refs), self._views(),
                pg.table_set.master.copy().tolist(), sorted(pg.committed.free_slots), self.tr._ones)

    @rule(data=st.data(), abort=st.integers(0, 7))
    def frame(self, data, abort):
        pg = self.pager
        before, snap = self._views(), self._snapshot()
        alias_len: dict = {}
        ops = data.draw(st.lists(st.tuples(st.sampled_from("rrrrnatT"), st.integers(0, 99),
                                           st.integers(0, 14)), max_size=8))
        try:
            with pg.frame() as f:
                for op, pick, n in ops:
                    live = sorted(k for k in set(pg.sessions()) | set(f._new) if f.has(k))
                    key = live[pick % len(live)] if live else None
                    try:
                        if op == "r" and key is not None:
                            f.reserve(key, n % 10)
                        elif op == "n":
                            f.reserve(self.next_key, n)
                            self.next_key += 1
                        elif op == "a" and key is not None:
                            dst = self.next_key
                            self.next_key += 1
                            m = n * f.length(key) // 14
                            f.alias(dst, key, m)
                            alias_len[dst] = m
                        elif op == "t" and key is not None:
                            nb = -(-f.length(key) // FS)
                            f.trim(key, [j for j in range(nb) if (n >> (j % 4)) & 1][:2])
                        elif op == "T" and key is not None:
                            f.trim(key)
                    except (OutOfPages, ValueError):
                        pass
                if abort == 0:
                    raise _Boom
        except _Boom:
            assert self._snapshot() == snap and f.aborted
            return
        after = self._views()
        self._check_pager(after)
        self._check_trains(before, after, f.result.stats["transport"], alias_len)
        self._check_windows(after)
        self._check_policy_view(before, after)
        self._model_step(before, after, f.result.copies, alias_len)

    def _check_pager(self, after):
        """Refcounts equal the mappings, no page is both mapped and free or lost, and the
        pager's tables equal its views."""
        pg = self.pager
        owners = [0] * FP
        bt, lens = pg.host_tables["block_table"], pg.host_tables["seq_lens"]
        for n, pages, slot in after.values():
            assert len(pages) == -(-n // FS) and lens[slot] == n
            assert bt[slot].tolist() == pages + [-1] * (FL - len(pages))
            for page in pages:
                if page >= 0:
                    owners[page] += 1
        assert owners == pg.committed.refs
        assert pg.free_pages + sum(r > 0 for r in owners) == FP
        for start, n in pg.allocator.spans():
            assert not any(owners[start: start + n])

    def teardown(self):
        if hasattr(self, "pager"):
            with self.pager.frame() as f:
                for key in self.pager.sessions():
                    f.trim(key)
            assert self.pager.free_pages == FP and not any(self.pager.committed.refs)

    def _moves(self, before, after, alias_len):
        """The transport's moves, from the committed views before and after the commit (and
        the tokens each new session aliased: write-through moves only their blocks)."""
        moves = []
        for key, (n, pages, slot) in sorted(after.items(), key=lambda kv: kv[1][2]):
            nb = -(-n // FS)
            first = max(0, nb - FNW)
            old = before.get(key)
            if old is None:
                had = nb if self.copy_tail else -(-alias_len.get(key, 0) // FS)
                todo = [j for j in range(first, min(nb, had)) if pages[j] >= 0]
            else:
                b_len, b_pages, _ = old
                grew = self.copy_tail and n > b_len
                grew_from = b_len // FS if grew else nb
                old_end = min(grew_from, len(b_pages))
                todo = [j for j in range(first, old_end)
                        if pages[j] >= 0 and pages[j] != b_pages[j]]
                todo += [j for j in range(max(first, grew_from), nb) if pages[j] >= 0]
            moves += [(pages[j], slot * FNW + j % FNW) for j in todo]
        return moves

    def _check_trains(self, before, after, stats, alias_len):
        moves = self._moves(before, after, alias_len)
        want, _ = plan_trains([s for s, _ in moves], [d for _, d in moves], 64, 128)
        host = self.pager.host_tables
        T = int(host["num_trains"][0])
        assert host["trains"][:T].tolist() == want.tolist()
        assert stats["moves"] == len(moves) and stats["groups"] == T
        assert (host["trains"][: self.tr._ones, 2] == 1).all()

    def _check_windows(self, after):
        host = self.pager.host_tables
        live = {}
        for n, _, slot in after.values():
            first = max(0, -(-n // FS) - FNW) * FS
            live[slot] = (first % FW, n - first)
        for slot in range(FB):
            got = (int(host["win_start"][slot]), int(host["win_len"][slot]))
            assert got == live.get(slot, (0, 0)), f"slot {slot}"

    def _check_policy_view(self, before, after):
        deltas, grown = self.rec.seen
        seen = set()
        for key, slot, new, closed, b_len, a_len, pages in deltas:
            seen.add(key)
            assert new == (key not in before) and closed == (key not in after)
            if not closed:
                assert (a_len, pages, slot) == after[key]
            if not new:
                assert b_len == before[key][0]
        for key, slot, b_len, a_len, tail, appended in grown:
            seen.add(key)
            n, pages, s = after[key]
            old = before[key][1]
            assert (s, a_len) == (slot, n) and b_len == before[key][0] < n
            assert pages[: len(old)] == old, "a growth-only session's blocks changed"
            assert appended == (len(pages) > len(old))
            assert tail == pages[(n - 1) // FS]
        changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
        assert changed <= seen

    def _model_step(self, before, after, copies, alias_len):
        for src, dst in copies:
            self.version[dst] = self.version[src]
        written = []
        for key, (n, pages, slot) in after.items():
            start = before[key][0] if key in before else alias_len.get(key, 0)
            for j in sorted({p // FS for p in range(start, n)}):
                if pages[j] >= 0:
                    self.version[pages[j]] += 1
                    written.append((slot * FNW + j % FNW, pages[j]))
        if not self.copy_tail:          # the model writes its new tokens into the arena too
            for at, page in written:
                self.arena[at] = (page, self.version[page])
        host = self.pager.host_tables
        for src, dst, n in host["trains"][: int(host["num_trains"][0])].tolist():
            for i in range(n):
                self.arena[dst + i] = (src + i, self.version[src + i])
        for key, (n, pages, slot) in after.items():
            nb = -(-n // FS)
            for j in range(max(0, nb - FNW), nb):
                if pages[j] >= 0:
                    assert self.arena.get(slot * FNW + j % FNW) == \
                        (pages[j], self.version[pages[j]]), f"{key} block {j}"


TestTransportMachine = TransportMachine.TestCase
TestTransportMachine.settings = settings(max_examples=80, stateful_step_count=25, deadline=None)
