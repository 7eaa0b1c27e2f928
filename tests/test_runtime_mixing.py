"""Verbs and policies mixed in one frame: each case reads the real K/V bytes through the
committed tables (or the far view's leave table) and compares them with what was written.

Each test here names the defect it catches: a mix of verbs that used to lose or corrupt data.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvops  # noqa: F401  (registers the ops)
from kvops.runtime import FarView, OutOfPages, Pager, apply_copies
from kvops.runtime.fidelity import Fidelity
from tests.test_fidelity import World

HKV, D = 2, 16


def _rows(cache, pages, n, S):
    """The first ``n`` token rows of a session whose blocks map ``pages``."""
    return torch.stack([cache[pages[t // S], t % S] for t in range(n)])


def _write(w: World, key, old, new, copies, truth=None):
    """``World.write`` for a session whose truth starts as another's prefix."""
    if truth is not None:
        w.truth[key] = truth
    w.write(key, old, new, copies)


def test_cow_source_demoted_in_the_same_frame_keeps_target_bytes():
    """Defect 1: B's copy-on-write reads A's block 2 after the step packed it to BASE."""
    w = World(min_batch=1, protect_recent=2)
    S = w.S
    with w.pager.frame() as f:
        g = w.grow(f, "a", 6 * S)
    w.write(*g, f.result.copies)
    with w.pager.frame() as f:
        f.alias("b", "a", 2 * S + 4)                # b's tail shares a's full block 2
    tk, tv = w.truth["a"]
    w.truth["b"] = (tk[: 2 * S + 4], tv[: 2 * S + 4])
    with w.pager.frame() as f:
        f.reserve("b", 1)                           # copy-on-write of a's block 2
        w.fid.step(f, need=w.pager.free_pages + 1)        # shortage: demote a pair
    w.write("b", 2 * S + 4, 2 * S + 5, f.result.copies)
    w.check_all()


def test_alias_of_tokens_written_in_the_same_frame_then_cow_is_refused():
    """Defect 2: a copy of a page whose tokens this very step writes has no right order; the
    reserve refuses it (nothing changes) and the same edit one frame later is right."""
    pager = Pager(16, 8, 4, 4)
    k = torch.randn(16, 8, HKV, D)
    v = torch.randn(16, 8, HKV, D)
    with pager.frame() as f:
        f.reserve("a", 12)
        f.alias("b", "a", 10)
        free = f.free_pages
        with pytest.raises(ValueError, match="written in this frame"):
            f.reserve("b", 1)
        assert f.length("b") == 10 and f.free_pages == free
    truth = torch.randn(12, HKV, D)
    pa = pager.pages("a")
    for t in range(12):
        k[pa[t // 8], t % 8] = truth[t]
    with pager.frame() as f:
        f.reserve("b", 1)
    apply_copies(k, v, f.result.copies)
    pb = pager.pages("b")
    new = torch.randn(HKV, D)
    k[pb[1], 2] = new
    assert torch.equal(_rows(k, pb, 10, 8), truth[:10])
    assert torch.equal(k[pb[1], 2], new)
    assert torch.equal(_rows(k, pa, 12, 8), truth)


def test_chained_copies_apply_in_dependency_order():
    """Defect 3: [(X, Y), (Y, Z)] must give Z the bytes of X, and a copy reading a page a
    later copy overwrites must read it first."""
    k = torch.arange(6 * 4, dtype=torch.float32).view(6, 4, 1, 1).expand(6, 4, 1, 16).clone()
    v = -k
    k0, v0 = k.clone(), v.clone()
    apply_copies(k, v, [(0, 1), (1, 2), (3, 4), (5, 3)])
    for dst, src in ((1, 0), (2, 0), (4, 3), (3, 5)):
        assert torch.equal(k[dst], k0[src]) and torch.equal(v[dst], v0[src]), (dst, src)


def test_fork_of_a_fork_in_one_frame_reads_the_right_bytes():
    """Defect 3 through the pager: b forks a's tail, c forks b's new tail, in one frame."""
    S = 8
    pager = Pager(16, S, 4, 4)
    k = torch.zeros(16, S, HKV, D)
    truth = torch.randn(5, HKV, D)
    with pager.frame() as f:
        f.reserve("a", 5)
    for t in range(5):
        k[pager.pages("a")[0], t] = truth[t]
    with pager.frame() as f:
        f.alias("b", "a", 5)
    with pager.frame() as f:
        f.reserve("b", 1)                   # copy a's tail page to b's
        f.alias("c", "b", 5)
        f.reserve("c", 1)                   # copy b's new page to c's
    copies = f.result.copies
    assert len(copies) == 2 and copies[0][1] == copies[1][0]
    apply_copies(k, k.clone(), copies)
    for key in "abc":
        assert torch.equal(_rows(k, pager.pages(key), 5, S), truth), key


def test_alias_of_a_base_tail_block_then_a_write_is_refused():
    """Defect 4: the copy-on-write page hid the BASE page from the alias refusal."""
    w = World(min_batch=1, protect_recent=2)
    S = w.S
    with w.pager.frame() as f:
        g = w.grow(f, "a", 6 * S)
    w.write(*g, f.result.copies)
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 1)
    assert w.fid.span("a") == (0, 2)
    snap = w.snapshot()
    with pytest.raises(ValueError, match="BASE"), w.pager.frame() as f:
        f.alias("b", "a", S + 4)                    # b's tail is a's BASE block 1
        f.reserve("b", 1)
    w.unchanged(snap)
    w.check_all()


def test_abort_runs_every_undo_even_when_one_raises():
    """Defect 5: a raising on_abort callback skipped the ones registered before it."""
    pager = Pager(8, 8, 2, 2)
    ran = []

    def boom():
        ran.append("boom")
        raise RuntimeError("boom")

    f = pager.frame()
    f.reserve("a", 8)
    f.on_abort(lambda: ran.append("first"))
    f.on_abort(boom)
    f.on_abort(lambda: ran.append("last"))
    with pytest.raises(RuntimeError, match="boom"):
        f.abort()
    assert sorted(ran) == ["boom", "first", "last"]
    assert pager.free_pages == 8 and pager.sessions() == []
    with pager.frame() as f:                        # the pager is usable again
        f.reserve("a", 8)


def test_abort_undoes_a_demotion_despite_a_raising_callback():
    """Defect 5 with the fidelity policy: the refine that undoes an in-frame demotion runs."""
    w = World(min_batch=1, protect_recent=2)
    S = w.S
    with w.pager.frame() as f:
        g = w.grow(f, "a", 6 * S)
    w.write(*g, f.result.copies)
    snap = w.snapshot()
    f = w.pager.frame()
    w.fid.step(f, need=w.pager.free_pages + 1)

    def boom():
        raise RuntimeError("boom")

    f.on_abort(boom)
    with pytest.raises(RuntimeError, match="boom"):
        f.abort()
    w.unchanged(snap)
    w.check_all()


def test_far_view_never_summarizes_a_queued_chunk_whose_blocks_were_trimmed():
    """Defect 6: a queued far chunk kept its page ids; trimmed and reused, they held another
    session's tokens when the chunk's turn came."""
    S, W, CHUNK = 8, 16, 16
    pager = Pager(10, S, max_sessions=2, max_blocks=24, device="cpu")
    far = FarView(pager, window_tokens=W, chunk_tokens=CHUNK, cap=2, num_layers=1,
                  num_kv_heads=HKV, head_dim=D, dtype=torch.float32, max_leave=1)
    with pager.frame() as f:
        f.reserve("a", 8 * S)                        # 3 far chunks: 0 now, 1 and 2 queued
    a = pager.pages("a")
    with pager.frame() as f:
        f.trim("a", [2, 3])                          # chunk 1's blocks go back
        f.reserve("b", 4 * S)                        # and are reused
    b = set(pager.pages("b"))
    assert set(a[2:4]) <= b
    row = pager.slot("a")                            # max_leave = 1: row = slot
    leave = pager.host_tables["far_leave_pages"][row].tolist()
    assert not set(leave) & b, "a chunk of a's summarizes b's pages"
    assert pager.host_tables["far_leave_ids"][row] == 2 and leave == a[4:6]
    assert far.summarized(row) == [0, 2]


def test_attention_kwargs_always_does_not_recompile_on_the_first_demotion():
    w = World(min_batch=1, protect_recent=2)
    S = w.S
    with w.pager.frame() as f:
        g = w.grow(f, "a", 6 * S)
    w.write(*g, f.result.copies)
    calls = []

    def backend(gm, example_inputs):
        calls.append(1)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def step(x):
        return x + w.fid.attention_kwargs(always=True)["base_span"].sum()

    x = torch.zeros(1, dtype=torch.int32)
    step(x)
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 1)
    assert w.fid.span("a") != (0, 0)
    step(x)
    assert len(calls) == 1


@pytest.mark.parametrize("device", [None, "cpu"])
def test_device_tables_exist_before_the_first_frame(device):
    pager = Pager(8, 8, 2, 2, device=device)
    tables = pager.device_tables
    assert set(tables) >= {"block_table", "seq_lens"}
    bt = tables["block_table"]
    assert bt.shape == (2, 2) and bool((bt == -1).all())
    with pager.frame() as f:
        f.reserve("a", 9)
    assert pager.device_tables["block_table"] is bt or \
        pager.device_tables["block_table"].data_ptr() == bt.data_ptr()
    assert bt[pager.slot("a")].tolist() == pager.pages("a")
    assert int(pager.device_tables["seq_lens"][pager.slot("a")]) == 9
    with pytest.raises(RuntimeError, match="fixed"):
        pager.add_table("late", (1,))


def test_decaying_reserve_reaches_zero_and_the_last_pair_is_promoted():
    w = World(min_batch=1, protect_recent=2, reserve_decay=0.5)
    S = w.S
    with w.pager.frame() as f:
        g = w.grow(f, "a", 6 * S)
    w.write(*g, f.result.copies)
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 1)
    assert w.fid.stats["demoted"] == 1
    for _ in range(200):
        with w.pager.frame() as f:
            w.fid.step(f)
    assert w.fid.reserve == 0
    assert w.fid.span("a") == (0, 0) and w.fid.stats["promoted"] == 1
    w.check_all()


def test_step_with_need_then_reserve_works_under_a_real_shortage():
    """The documented decode step: ``fid.step(f, need=...)`` then the reserves, in one frame,
    with the pool too short for them before the step."""
    w = World(P=24, B=4, L=24, min_batch=1, protect_recent=2)
    S = w.S
    with w.pager.frame() as f:
        gs = [w.grow(f, key, 10 * S) for key in ("a", "b")]
    for g in gs:
        w.write(*g, f.result.copies)
    assert w.pager.free_pages == 4
    plan = {"c": 5 * S + 1}
    with w.pager.frame() as f:
        need = w.fid.need(f, plan)
        assert need == 6
        w.fid.step(f, need=need)
        g = w.grow(f, "c", plan["c"])
    w.write(*g, f.result.copies)
    w.check_all()


def test_eos_and_new_session_share_a_slot_in_one_frame():
    pager = Pager(8, 8, 1, 2)
    with pager.frame() as f:
        f.reserve("a", 16)
    with pager.frame() as f:
        f.trim("a")
        f.reserve("b", 16)                           # a's slot and pages, same frame
    assert pager.sessions() == ["b"] and pager.slot("b") == 0
    assert pager.host_tables["block_table"][0].tolist() == pager.pages("b")
    assert pager.host_tables["seq_lens"][0] == 16


@pytest.mark.parametrize("make", [np.int64, np.int32, lambda n: torch.tensor(n)],
                         ids=["np.int64", "np.int32", "0-d tensor"])
def test_verbs_accept_numpy_and_tensor_ints(make):
    pager = Pager(16, 8, 4, 4)
    with pager.frame() as f:
        f.reserve("a", make(12))
        f.alias("b", "a", make(8))
        f.trim("a", [make(0)])
        page = f.hold(make(1))[0]
        f.retain(make(page))
        f.release(make(page))
        f.release(make(page))
        f.remap("b", make(0), make(f.page("b", 0)))
    assert pager.length("a") == 12 and pager.length("b") == 8
    with pager.frame() as f:
        for bad in (1.5, torch.tensor(2.0), True):
            with pytest.raises((TypeError, ValueError), match="n_tokens"):
                f.reserve("a", bad)


def test_fidelity_cache_shape_error_names_the_pagers_page_count():
    pager = Pager(16, 8, 2, 4)
    k = torch.zeros(12, 8, HKV, D, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"P=16"):
        Fidelity(pager, [k, k.clone()])


def test_out_of_pages_in_a_frame_that_freed_pages_uses_them():
    """Pages a trim frees in a frame are reservable in it; an abort leaves both as before."""
    pager = Pager(4, 8, 2, 4)
    with pager.frame() as f:
        f.reserve("a", 32)
    with pytest.raises(OutOfPages):
        with pager.frame() as f:
            f.reserve("b", 8)
    with pytest.raises(RuntimeError, match="boom"), pager.frame() as f:
        f.trim("a", [0, 1])
        f.reserve("b", 16)
        raise RuntimeError("boom")
    assert pager.free_pages == 0 and pager.pages("a") == pager.pages("a")
    assert all(p >= 0 for p in pager.pages("a"))
    with pager.frame() as f:
        f.trim("a", [0, 1])
        f.reserve("b", 16)
    assert sorted(pager.pages("b") + pager.pages("a")[2:]) == [0, 1, 2, 3]
