"""The pager: allocator spans, the four verbs, Frame atomicity, and a hypothesis state machine
checking after every step that no page leaks or is double-owned, refcounts match mappings,
copy-on-write isolates sessions, and the uploaded tables equal the views."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvops.runtime import OutOfPages, Pager, SpanAllocator, apply_copies
from tests.conftest import requires_cuda

P, S, B, L = 40, 4, 6, 12


class Boom(Exception):
    pass


class PagerMachine(RuleBasedStateMachine):
    """Model: every session's token tags; the pool's content as a [P, S] array of tags, written
    through the committed mappings (after the commit's copy-on-write copies)."""

    def __init__(self):
        super().__init__()
        self.pager = Pager(P, S, B, L, device="cpu")
        self.pager.frame().commit()                    # an empty step fixes the tables
        self.content = np.full((P, S), -1, dtype=np.int64)
        self.tokens: dict[int, list[int | None]] = {}
        self.next_key = 0
        self.next_tag = 0

    # -- helpers ---------------------------------------------------------------------------
    def _write(self, commit, grown: dict[int, int]):
        for src, dst in commit.copies:
            self.content[dst] = self.content[src]
        for key, old in grown.items():
            pages = self.pager.pages(key)
            for p in range(old, self.pager.length(key)):
                self.next_tag += 1
                if pages[p // S] >= 0:                 # not trimmed in the same frame
                    self.content[pages[p // S], p % S] = self.next_tag
                self.tokens[key].append(self.next_tag)

    def _snapshot(self):
        pg = self.pager
        return (pg.epoch, pg.free_pages, pg.allocator.spans(), list(pg.committed.refs),
                {k: (pg.length(k), pg.pages(k), pg.slot(k)) for k in pg.sessions()},
                pg.host_tables["block_table"].tolist(),
                sorted(pg.committed.free_slots))

    # -- rules -----------------------------------------------------------------------------
    @rule(n=st.integers(1, 14))
    def new_session(self, n):
        key = self.next_key
        self.next_key += 1
        try:
            with self.pager.frame() as f:
                f.reserve(key, n)
        except (OutOfPages, ValueError):
            assert key not in self.pager.sessions()
            return
        self.tokens[key] = []
        self._write(f.result, {key: 0})

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 6))
    def decode_step(self, data, n):
        """One frame: every live session grows by n tokens (or some of them)."""
        keys = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), unique=True, min_size=1))
        before = self._snapshot()
        old = {k: self.pager.length(k) for k in keys}
        try:
            with self.pager.frame() as f:
                for k in keys:
                    f.reserve(k, n)
        except (OutOfPages, ValueError):
            assert self._snapshot() == before
            return
        self._write(f.result, old)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), frac=st.floats(0, 1))
    def alias(self, data, frac):
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        n = int(frac * self.pager.length(src))
        dst = self.next_key
        self.next_key += 1
        before = self._snapshot()
        try:
            with self.pager.frame() as f:
                f.alias(dst, src, n)
        except (ValueError, OutOfPages):
            assert self._snapshot() == before
            return
        self.tokens[dst] = self.tokens[src][:n]
        assert not f.result.copies

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def trim_cold(self, data):
        key = data.draw(st.sampled_from(sorted(self.tokens)))
        nb = -(-self.pager.length(key) // S)
        if nb == 0:
            return
        blocks = data.draw(st.lists(st.integers(0, nb - 1), unique=True, max_size=3))
        with self.pager.frame() as f:
            f.trim(key, blocks)
        for j in blocks:
            for p in range(j * S, min((j + 1) * S, self.pager.length(key))):
                self.tokens[key][p] = None
            assert self.pager.pages(key)[j] == -1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def end_session(self, data):
        key = data.draw(st.sampled_from(sorted(self.tokens)))
        with self.pager.frame() as f:
            f.trim(key)
        del self.tokens[key]
        assert key not in self.pager.sessions()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def mixed_frame(self, data):
        """Alias, grow both, end another session: all in one frame."""
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        victim = data.draw(st.sampled_from(sorted(self.tokens)))
        n = self.pager.length(src)
        dst = self.next_key
        self.next_key += 1
        before = self._snapshot()
        old = {src: n, dst: n}
        try:
            with self.pager.frame() as f:
                f.alias(dst, src, n)
                f.reserve(dst, 2)
                f.reserve(src, 1)
                if victim != src:
                    f.trim(victim)
        except (ValueError, OutOfPages):
            assert self._snapshot() == before
            return
        self.tokens[dst] = list(self.tokens[src])
        if victim != src:
            del self.tokens[victim]
        self._write(f.result, old)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n1=st.integers(0, 9), n2=st.integers(0, 9), trim=st.booleans())
    def grow_twice_then_trim(self, data, n1, n2, trim):
        """Growth on the fast path (inside the tail page or into fresh blocks), twice in one
        frame, then maybe a cold trim, which moves the session to the general overlay with
        the pages it just took."""
        key = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self._snapshot()
        old = {key: self.pager.length(key)}
        try:
            with self.pager.frame() as f:
                f.reserve(key, n1)
                f.reserve(key, n2)
                if trim:
                    f.trim(key, [0])
        except (OutOfPages, ValueError):
            assert self._snapshot() == before
            return
        self._write(f.result, old)
        if trim:
            for p in range(min(S, self.pager.length(key))):
                self.tokens[key][p] = None

    @rule(n=st.integers(1, 9), blocks=st.booleans())
    def short_lived_session(self, n, blocks):
        """A session that starts and ends (or drops blocks) within one frame."""
        key = self.next_key
        self.next_key += 1
        try:
            with self.pager.frame() as f:
                f.reserve(key, n)
                if blocks:
                    f.trim(key, [0])
                f.trim(key)
        except OutOfPages:
            return
        assert key not in self.pager.sessions()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def failing_frame(self, data):
        """An exception inside the frame leaves every mapping, count and table as it was."""
        keys = sorted(self.tokens)
        before = self._snapshot()
        with pytest.raises(Boom), self.pager.frame() as f:
            for k in keys:
                try:
                    f.reserve(k, data.draw(st.integers(1, 9)))
                except (OutOfPages, ValueError):
                    pass
            try:
                f.alias(self.next_key, keys[0], 0)
            except OutOfPages:
                pass
            f.trim(keys[-1])
            raise Boom
        assert self._snapshot() == before
        assert f.aborted

    @rule()
    def oversized_reserve(self):
        before = self._snapshot()
        with pytest.raises(OutOfPages), self.pager.frame() as f:
            for i in range(B):                         # 6 full sessions need 72 > 40 pages
                f.reserve(("big", i), L * S)
        assert self._snapshot() == before

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def pages_accounted(self):
        pg = self.pager
        owners = np.zeros(P, dtype=np.int64)
        for key in pg.sessions():
            for page in pg.pages(key):
                if page >= 0:
                    owners[page] += 1
        assert list(owners) == pg.committed.refs, "refcounts differ from the mappings"
        free = np.zeros(P, dtype=bool)
        for start, n in pg.allocator.spans():
            assert not free[start: start + n].any(), "free spans overlap"
            free[start: start + n] = True
        assert not (free & (owners > 0)).any(), "a mapped page is on a free list"
        assert free.sum() + (owners > 0).sum() == P, "a page leaked"
        assert pg.free_pages == free.sum()
        spans = pg.allocator.spans()
        for (a, n), (b, _) in zip(spans, spans[1:]):
            assert a + n < b, "adjacent free spans were not coalesced"

    @invariant()
    def sessions_see_their_own_tokens(self):
        pg = self.pager
        assert sorted(pg.sessions()) == sorted(self.tokens)
        for key, toks in self.tokens.items():
            assert pg.length(key) == len(toks)
            pages = pg.pages(key)
            for p, tag in enumerate(toks):
                if tag is not None:
                    assert self.content[pages[p // S], p % S] == tag, (
                        f"session {key} token {p}: sees another session's write")

    @invariant()
    def tables_match_views(self):
        pg = self.pager
        bt = pg.host_tables["block_table"]
        lens = pg.host_tables["seq_lens"]
        slots = set()
        for key in pg.sessions():
            slot = pg.slot(key)
            slots.add(slot)
            pages = pg.pages(key)
            assert list(bt[slot, : len(pages)]) == pages
            assert (bt[slot, len(pages):] == -1).all()
            assert lens[slot] == pg.length(key)
        for slot in set(range(B)) - slots:
            assert (bt[slot] == -1).all() and lens[slot] == 0
        for name, host in pg.host_tables.items():
            assert np.array_equal(pg.device_tables[name].numpy(), host), f"{name} not uploaded"

    def teardown(self):
        with self.pager.frame() as f:
            for key in list(self.tokens):
                f.trim(key)
        assert self.pager.free_pages == P and self.pager.allocator.spans() == [(0, P)]
        assert not any(self.pager.committed.refs)


TestPagerMachine = PagerMachine.TestCase
TestPagerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_allocator_coalesces_and_prefers_contiguous():
    a = SpanAllocator(32)
    runs = a.take(5)
    assert runs == [(0, 5)]
    assert a.take_at(5, 3) == 3 and a.spans() == [(8, 24)]
    assert a.take_at(9, 1) == 0                    # 9 is inside a span, not its start
    (start, n), = a.take(4, spread=True)           # a new session lands mid-span
    assert n == 4 and start == 8 + (24 - 4) // 2
    for p in range(8):
        a.give(p)
    assert a.spans() == [(0, 18), (22, 10)]
    for p in range(start, start + 4):
        a.give(p)
    assert a.spans() == [(0, 32)] and a.free == 32
    with pytest.raises(OutOfPages):
        a.take(33)


def test_growth_stays_contiguous_for_interleaved_sessions():
    """Eight sessions decoding in lockstep still get physically contiguous pages."""
    pg = Pager(256, 16, 8, 32)
    for step in range(16 * 20):
        with pg.frame() as f:
            for s in range(8):
                f.reserve(s, 1 if step else 1)
    for s in range(8):
        pages = pg.pages(s)
        assert len(pages) == 20
        assert pages == list(range(pages[0], pages[0] + 20)), f"session {s}: {pages}"


def test_cow_on_shared_tail_and_commit_copies():
    k = torch.arange(8 * 4, dtype=torch.float32).view(8, 4, 1, 1).repeat(1, 1, 1, 16)
    v = -k
    pg = Pager(8, 4, 4, 4)
    with pg.frame() as f:
        f.reserve("a", 6)                          # blocks 0 (full) and 1 (2 tokens)
    with pg.frame() as f:
        f.alias("b", "a", 6)
        f.reserve("b", 1)                          # writes into shared block 1 -> copy
    commit = f.result
    a1, b1 = pg.pages("a")[1], pg.pages("b")[1]
    assert commit.copies == [(a1, b1)] and a1 != b1
    assert pg.pages("a")[0] == pg.pages("b")[0] and pg.refcount(pg.pages("a")[0]) == 2
    apply_copies(k, v, commit.copies)
    assert torch.equal(k[b1], k[a1]) and torch.equal(v[b1], v[a1])
    with pg.frame() as f:
        f.reserve("a", 1)                          # block 1 of a is no longer shared
    assert not f.result.copies and pg.pages("a")[1] == a1


def test_commit_is_idempotent_and_verbs_need_a_frame():
    pg = Pager(16, 8, 2, 4, device="cpu")
    with pytest.raises(RuntimeError, match="inside a frame"):
        pg.reserve("a", 3)
    f = pg.frame()
    pg.reserve("a", 9)
    with pytest.raises(RuntimeError, match="already open"):
        pg.frame()
    first = f.commit()
    state = (pg.epoch, pg.pages("a"), pg.free_pages, pg.device_tables["seq_lens"].clone())
    again = f.commit()
    assert again is first and first.epoch == 1
    assert (pg.epoch, pg.pages("a"), pg.free_pages) == state[:3]
    assert torch.equal(pg.device_tables["seq_lens"], state[3])
    with pytest.raises(RuntimeError, match="closed"):
        f.reserve("a", 1)


def test_failing_hook_aborts_the_commit():
    """A hook that raises during commit leaves the pager as before the frame."""

    class Failing:
        def tables(self):
            return {}

        def on_commit(self, frame, deltas, grown):
            if any(d.new for d in deltas):
                raise Boom
            return {}

    pg = Pager(16, 4, 4, 4)
    pg.attach(Failing())
    with pg.frame() as f:
        pass
    before = (pg.epoch, pg.free_pages, pg.allocator.spans(), pg.sessions())
    with pytest.raises(Boom), pg.frame() as f:
        f.reserve("a", 9)
    assert (pg.epoch, pg.free_pages, pg.allocator.spans(), pg.sessions()) == before
    assert f.aborted and pg.frame() is not None


def test_out_of_pages_leaves_mappings_intact():
    pg = Pager(6, 4, 4, 8)
    with pg.frame() as f:
        f.reserve("a", 12)
        f.reserve("b", 8)
    before = (pg.pages("a"), pg.pages("b"), pg.free_pages, pg.epoch)
    with pytest.raises(OutOfPages, match="needs 2 pages, 0 of 6 free"), pg.frame() as f:
        f.reserve("a", 1)                          # fits: takes the last page
        f.reserve("b", 8)                          # does not
    assert (pg.pages("a"), pg.pages("b"), pg.free_pages, pg.epoch) == before
    with pytest.raises(OutOfPages, match="session slots"), pg.frame() as f:
        for s in range(5):
            f.reserve(("s", s), 0)
    assert pg.free_pages == 1


def test_generic_table_edits_ride_the_same_commit():
    """A policy (e.g. the far view) registers its own table and edits rows inside frames."""
    pg = Pager(16, 8, 3, 4, device="cpu")
    pg.add_table("far_chunks", (3, 2, 4), fill=-1)
    with pg.frame() as f:
        f.reserve("a", 5)
        f.edit("far_chunks", pg_slot := 0, [7, 8, 9, 10], start=4)
    assert pg.device_tables["far_chunks"][pg_slot].tolist() == [[-1] * 4, [7, 8, 9, 10]]
    with pytest.raises(Boom), pg.frame() as f:
        f.edit("far_chunks", 1, [1])
        raise Boom
    assert (pg.device_tables["far_chunks"][1] == -1).all()
    with pytest.raises(ValueError, match="no run"), pg.frame() as f:
        f.edit("far_chunks", 2, [1, 2], start=7)
    with pytest.raises(RuntimeError, match="fixed once"):
        pg.add_table("late", (1,))


def test_a_write_through_a_view_uploads_the_elements_it_names():
    """``Frame.write(..., via=view, at=flat)`` copies just those elements into the upload (the
    device table then equals the host one); without ``at`` such a write uploads the table.
    Rows scattered over a table upload just their elements, rows close together their range."""
    pg = Pager(16, 8, 3, 4, device="cpu")
    pg.add_table("sel", (2 * 3, 4), fill=-1)             # [layers * B, C], as far_select
    pg.add_table("wide", (12, 2), fill=-1)
    uploads = []
    real = pg.table_set.upload
    pg.table_set.upload = lambda epoch, changed: (uploads.append(list(changed)),
                                                  real(epoch, changed))[1]
    with pg.frame() as f:
        f.reserve("a", 5)
    view = pg.host_tables["sel"].reshape(2, 3, 4)
    rows, slots, cols = np.array([[0], [1]]), np.array([2]), np.array([[1], [3]])
    at = ((rows * 3 + slots) * 4 + cols).reshape(-1)
    with pg.frame() as f:
        f.write("sel", (rows, slots, cols), 7, via=view, at=at)
    region = pg.table_set.region["sel"]
    assert [c.tolist() for c in uploads[-1] if isinstance(c, np.ndarray)] == \
        [(region.start + at).tolist()]
    want = np.full((6, 4), -1)
    want[2, 1] = want[5, 3] = 7
    assert np.array_equal(pg.host_tables["sel"], want)
    assert np.array_equal(pg.device_tables["sel"].numpy(), want)
    with pg.frame() as f:                                # no ``at``: the whole table
        f.write("sel", (rows, slots, cols), 8, via=view)
    assert region in uploads[-1]
    want[2, 1] = want[5, 3] = 8
    assert np.array_equal(pg.device_tables["sel"].numpy(), want)
    wide = pg.table_set.region["wide"]
    with pg.frame() as f:                                # rows far apart: just those rows
        f.write("wide", np.array([0, 11]), np.array([[1, 2], [3, 4]]))
    assert [c.tolist() for c in uploads[-1] if isinstance(c, np.ndarray)] == \
        [[wide.start, wide.start + 1, wide.start + 22, wide.start + 23]]
    rows12 = np.full((12, 2), -1)
    rows12[0], rows12[11] = [1, 2], [3, 4]
    assert np.array_equal(pg.device_tables["wide"].numpy(), rows12)
    with pg.frame() as f:                                # rows close together: their range
        f.write("wide", np.array([1, 3]), 9)
    assert slice(wide.start + 2, wide.start + 8) in uploads[-1]
    rows12[[1, 3]] = 9
    assert np.array_equal(pg.device_tables["wide"].numpy(), rows12)


def test_policy_verbs_move_references_and_callbacks_follow_the_frame():
    """remap / hold / retain / release move page references as the fidelity policy needs;
    on_commit callbacks run only when the frame commits, on_abort ones only when it aborts."""
    pager = Pager(8, 4, 2, 4)
    with pager.frame() as f:
        f.reserve("a", 12)                                    # pages 0-2 (or any three)
    a = pager.pages("a")
    log = []
    with pager.frame() as f:
        held = f.hold(2)
        f.remap("a", 1, a[0])                                 # blocks 0 and 1 share a[0]
        f.remap("a", 2, held[0])
        f.retain(a[0])
        f.release(held[1])                                    # taken and dropped in-frame
        f.on_commit(lambda: log.append("commit"))
        f.on_abort(lambda: log.append("abort"))
    assert log == ["commit"]
    assert pager.pages("a") == [a[0], a[0], held[0]]
    assert [pager.refcount(p) for p in (a[0], a[1], a[2], held[0], held[1])] == [3, 0, 0, 2, 0]
    assert pager.host_tables["block_table"][pager.slot("a"), :3].tolist() == pager.pages("a")
    assert pager.free_pages == 8 - 2
    with pytest.raises(Boom):
        with pager.frame() as f:
            f.hold(3)
            f.release(a[0])
            f.on_commit(lambda: log.append("commit"))
            f.on_abort(lambda: log.append("abort"))
            raise Boom
    assert log == ["commit", "abort"] and pager.free_pages == 6 and pager.refcount(a[0]) == 3
    with pager.frame() as f:
        f.release(a[0])
        f.release(held[0])
        f.trim("a")
    assert pager.free_pages == 8
    with pager.frame() as f:
        f.reserve("b", 4)
        for verb, args, msg in [
                (f.remap, ("b", 1, 0), r"remap: block of 'b' must lie in \[0, 1\), got 1"),
                (f.remap, ("b", 0, 7), r"remap: page must be a live page in \[0, 8\), got 7"),
                (f.retain, (9,), r"retain: page must be a live page"),
                (f.release, (-1,), r"release: page must be a live page"),
                (f.hold, (-2,), r"hold: n: expected an int >= 0, got -2")]:
            with pytest.raises(ValueError, match=msg):
                verb(*args)
        with pytest.raises(OutOfPages):
            f.hold(8)


def test_bad_verb_arguments_raise():
    pg = Pager(16, 4, 4, 3)
    with pytest.raises(ValueError, match="block table holds L=3"), pg.frame() as f:
        f.reserve("a", 13)
    with pg.frame() as f:
        f.reserve("a", 5)
    with pytest.raises(ValueError, match=r"n_tokens must be an int in \[0, 5\]"), \
            pg.frame() as f:
        f.alias("b", "a", 6)
    with pytest.raises(ValueError, match="already exists"), pg.frame() as f:
        f.alias("a", "a", 1)
    with pytest.raises(KeyError), pg.frame() as f:
        f.trim("zzz")
    with pytest.raises(ValueError, match=r"blocks of 'a' must lie in \[0, 2\)"), \
            pg.frame() as f:
        f.trim("a", [2])
    with pg.frame() as f:
        f.trim("a", [1])
    with pytest.raises(ValueError, match="trimmed block"), pg.frame() as f:
        f.reserve("a", 1)
    with pytest.raises(ValueError, match="trimmed blocks"), pg.frame() as f:
        f.alias("c", "a", 5)
    with pytest.raises(ValueError, match="ended in this frame"), pg.frame() as f:
        f.trim("a")
        f.reserve("a", 1)
    assert pg.pages("a")[0] >= 0 and pg.free_pages == 15


@requires_cuda
def test_cuda_upload_double_buffer_keeps_every_commit():
    """Back-to-back commits without syncing: each upload carries that commit's tables."""
    pg = Pager(4096, 16, 64, 64, device="cuda")
    snaps = []
    for step in range(40):
        with pg.frame() as f:
            for s in range(64):
                f.reserve(s, 1 + (s * step) % 17)
            if step % 7 == 6:
                f.trim(step % 64, [0])
        snaps.append((pg.device_tables["block_table"].clone(),
                      pg.device_tables["seq_lens"].clone(),
                      pg.host_tables["block_table"].copy(), pg.host_tables["seq_lens"].copy()))
    torch.cuda.synchronize()
    for dev_bt, dev_len, host_bt, host_len in snaps:
        assert np.array_equal(dev_bt.cpu().numpy(), host_bt)
        assert np.array_equal(dev_len.cpu().numpy(), host_len)


def test_a_raising_commit_callback_does_not_skip_the_others():
    """A policy's callback registered after a raising one still runs (its host state follows
    the commit); the first exception reaches the caller and the commit stands."""
    pager = Pager(8, 4, 2, 4)
    log = []

    def boom(tag):
        log.append(tag)
        raise Boom(tag)

    with pytest.raises(Boom, match="first"):
        with pager.frame() as f:
            f.reserve("a", 4)
            f.on_commit(lambda: boom("first"))
            f.on_commit(lambda: log.append("policy"))
            f.on_commit(lambda: boom("second"))
    assert log == ["first", "policy", "second"]
    assert pager.sessions() == ["a"] and pager.epoch == 1
