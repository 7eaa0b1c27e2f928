"""FarView policy: summaries computed once when chunks leave the window, EMA utility from the
kernel's lse, top-C selection committed through the pager's frame, the log-count bias switch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvops
from kvops.ops.static_sliding_attention import static_sliding_attention_ref
from kvops.runtime import FarView, Pager
from tests.conftest import counting_backend, requires_cuda

S, W, CHUNK, HKV, G, D, LAYERS = 8, 16, 16, 2, 2, 16, 2
M = CHUNK // S


def _token_qkv(T: int, seed: int):
    """Random q [T, HKV * G, D] and k, v [T, HKV, D] of one sequence, for the evaluation's
    attention paths."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, HKV * G, D, generator=gen), torch.randn(T, HKV, D, generator=gen),
            torch.randn(T, HKV, D, generator=gen))


def setup(cap=2, max_leave=1, sessions=2, ema=0.9, bias=True, seed=0, pages=64):
    pager = Pager(pages, S, max_sessions=sessions, max_blocks=24, device="cpu")
    far = FarView(pager, window_tokens=W, chunk_tokens=CHUNK, cap=cap, num_layers=LAYERS,
                  num_kv_heads=HKV, head_dim=D, dtype=torch.float32, max_leave=max_leave,
                  ema=ema, log_count_bias=bias)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, pages, S, HKV, D, generator=gen)
    v = torch.randn(LAYERS, pages, S, HKV, D, generator=gen)
    return pager, far, k, v


def commit(pager, far, k, v, grow):
    """One step: a frame reserving ``grow[key]`` tokens, then every layer's absorb. Returns
    the chunk ids summarized in the step per slot (read from the committed leave table)."""
    with pager.frame() as f:
        for key, n in grow.items():
            f.reserve(key, n)
    ids = pager.host_tables["far_leave_ids"].reshape(far.B, far.max_leave)
    for layer in range(LAYERS):
        far.absorb(layer, k[layer], v[layer])
    return {b: [j for j in ids[b].tolist() if j != far.J] for b in range(far.B)}


def chosen(far, layer, slot):
    """The chunk ids ``slot`` shows at ``layer``, ascending (a row's slots are in no order)."""
    return sorted(j for j in far.selection(layer, slot) if j >= 0)


def chunk_mean(cache, pages, j):
    rows = torch.cat([cache[p] for p in pages[j * M:(j + 1) * M]]).double()
    return rows.mean(0)


def test_chunks_are_summarized_once_when_they_leave_the_window():
    pager, far, k, v = setup()
    seen: list[int] = []
    for step in range(12):                       # one block per step
        got = commit(pager, far, k, v, {"a": S})
        slot = pager.slot("a")
        seen += got[slot]
        nb = step + 1
        assert far.summarized(slot) == list(range(max(0, nb - W // S) // M)), f"step {step}"
    assert seen == list(range(5))                # each chunk in exactly one step's table
    pages = pager.pages("a")
    before = far.k_store.clone()
    k[:, pages[0]] += 100.0                      # cached: later steps do not re-read chunk 0
    commit(pager, far, k, v, {"a": S})
    assert torch.equal(far.k_store[:, slot, 0], before[:, slot, 0])
    for layer in range(LAYERS):
        for j in range(5):
            torch.testing.assert_close(far.v_store[layer, slot, j].double(),
                                       chunk_mean(v[layer], pages, j))
            if j:
                torch.testing.assert_close(far.k_store[layer, slot, j].double(),
                                           chunk_mean(k[layer], pages, j))


def test_prefill_queue_drains_max_leave_per_commit():
    pager, far, k, v = setup(max_leave=2)
    got = commit(pager, far, k, v, {"a": 14 * S})       # 14 blocks: 6 far chunks at once
    slot = pager.slot("a")
    assert got[slot] == [0, 1] and far.last["pending"] == 4
    got = commit(pager, far, k, v, {})                   # an empty frame still drains
    assert got[slot] == [2, 3]
    got = commit(pager, far, k, v, {"a": 0})
    assert got[slot] == [4, 5] and far.last["pending"] == 0
    got = commit(pager, far, k, v, {})
    assert got[slot] == []                               # last commit's rows cleared
    assert np.all(pager.host_tables["far_leave_pages"] == -1)
    pages = pager.pages("a")
    for j in range(6):
        torch.testing.assert_close(far.k_store[1, slot, j].double(), chunk_mean(k[1], pages, j))


def test_selection_is_top_cap_by_utility_and_fresh_chunks_get_in():
    pager, far, k, v = setup(cap=2, max_leave=8)
    commit(pager, far, k, v, {"a": 10 * S})              # chunks 0..3 far, all fresh
    slot = pager.slot("a")
    # four fresh chunks, cap 2: the newest two win the tie
    assert chosen(far, 0, slot) == [2, 3]
    far.host_scores[0, slot, :4] = [0.5, 0.9, 0.1, 0.2]
    far.host_scores[1, slot, :4] = [0.3, 0.3, 0.3, 0.0]
    far.pull_scores(far.host_scores.copy())
    commit(pager, far, k, v, {"a": 1})
    assert chosen(far, 0, slot) == [0, 1]
    assert chosen(far, 1, slot) == [1, 2]              # ties broken toward the newer chunk
    commit(pager, far, k, v, {"a": 2 * S - 1})           # 12 blocks: chunk 4 becomes far
    assert 4 in far.selection(0, slot) and 4 in far.selection(1, slot)
    assert chosen(far, 0, slot) == [1, 4]
    assert far.last["select_rows_changed"] == 2
    far.host_scores[:, slot, 4] = 1.0                    # as pull_scores would bring it
    far.pull_scores(far.host_scores.copy())
    commit(pager, far, k, v, {"a": 1})
    assert far.last["select_rows_changed"] == 0          # no change, no edit
    assert chosen(far, 1, slot) == [2, 4]
    far.host_scores[0, slot, 4] = 0.0
    far.pull_scores(far.host_scores.copy())
    commit(pager, far, k, v, {"a": 1})
    assert chosen(far, 0, slot) == [0, 1]
    # the device table is the committed host table
    dev = pager.device_tables["far_select"].view(LAYERS, far.B, far.C)
    assert dev[0, slot].tolist() == far.selection(0, slot)


class _FailingPolicy:
    """A policy planned after the far view whose plan raises on demand: the commit then
    fails after the far view has planned."""

    kind, sharing, fail = "failing", {}, False

    def tables(self):
        return {}

    def plan(self, frame, deltas, grown):
        if self.fail:
            raise RuntimeError("a later policy fails")
        return None


def test_a_commit_failing_after_a_pull_leaves_the_pull_as_it_came():
    """A general commit after a pull takes a new summary into the pulled rows; when a later
    policy's plan fails that commit, the next commit writes the pull's rows as the pull
    ranked them, without the summary the failed commit took (its chunk is not summarized)."""
    pager, far, k, v = setup(cap=2, max_leave=8, sessions=3)
    boom = _FailingPolicy()
    pager.attach(boom)
    commit(pager, far, k, v, {"a": 10 * S})              # chunks 0..3 far
    slot = pager.slot("a")
    far.host_scores[:, slot, :4] = [0.5, 0.9, 0.1, 0.2]
    far.pull_scores(far.host_scores.copy())              # every row of "a" changes: [0, 1]
    boom.fail = True
    with pytest.raises(RuntimeError, match="later policy"):
        with pager.frame() as f:
            f.reserve("a", 2 * S)                        # chunk 4 becomes far
            f.trim("a", [0])                             # an edit: the general path
    boom.fail = False
    commit(pager, far, k, v, {"a": 1})
    for layer in range(LAYERS):
        assert chosen(far, layer, slot) == [0, 1], layer
    commit(pager, far, k, v, {"a": 2 * S - 1})           # now chunk 4 is far and summarized
    assert all(4 in far.selection(layer, slot) for layer in range(LAYERS))


@pytest.mark.parametrize("bias", [True, False], ids=["log-count", "zero"])
def test_view_gathers_stored_summaries_with_the_bias_switch(bias):
    pager, far, k, v = setup(cap=3, max_leave=4, bias=bias)
    commit(pager, far, k, v, {"a": 8 * S, "b": 4 * S})   # a: 3 far chunks, b: 1
    a, b = pager.slot("a"), pager.slot("b")
    for layer in range(LAYERS):
        far_k, far_v, far_bias = far.view(layer)
        assert far_k.shape == (2, 3, HKV, D) and far_bias.dtype == torch.float32
        live = float(torch.tensor(math.log(CHUNK), dtype=torch.float32)) if bias else 0.0
        assert far_bias[a].tolist() == [live] * 3
        assert far_bias[b].tolist() == [live, float("-inf"), float("-inf")]
        for c, j in enumerate(far.selection(layer, a)):
            assert torch.equal(far_k[a, c], far.k_store[layer, a, j])
            assert torch.equal(far_v[a, c], far.v_store[layer, a, j])
        assert torch.equal(far_k[b, 1:], torch.zeros_like(far_k[b, 1:]))


def mass_oracle(q, k, v, far_k, far_bias, scale):
    """Attention probability of each far slot, summed over query heads, by explicit softmax."""
    B, Hq, _ = q.shape
    W_, C = k.shape[1], far_k.shape[1]
    mass = torch.zeros(B, C, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kv = h // (Hq // HKV)
            logits = [float(q[b, h].double() @ k[b, j, kv].double()) * scale for j in range(W_)]
            far = [float(q[b, h].double() @ far_k[b, c, kv].double()) * scale + float(far_bias[b, c])
                   for c in range(C)]
            top = max(logits + far)
            total = sum(math.exp(x - top) for x in logits + far)
            for c in range(C):
                mass[b, c] += math.exp(far[c] - top) / total
    return mass


def test_observe_mass_from_lse_and_ema_update():
    pager, far, k, v = setup(cap=3, max_leave=4, ema=0.75)
    commit(pager, far, k, v, {"a": 8 * S, "b": 4 * S})
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, HKV * G, D, generator=gen)
    win_k, win_v = torch.randn(2, W, HKV, D, generator=gen), torch.randn(2, W, HKV, D, generator=gen)
    ws = torch.zeros(2, dtype=torch.int32)
    wl = torch.full((2,), W, dtype=torch.int32)
    layer = 1
    far.scores[layer].uniform_(0.0, 1.0)
    before = far.scores.clone()
    far_k, far_v, far_bias = far.view(layer)
    _, lse = static_sliding_attention_ref(q, win_k, win_v, ws, wl, far_k, far_v, far_bias)
    mass = far.observe(layer, q, far_k, far_bias, lse)
    want = mass_oracle(q, win_k, win_v, far_k, far_bias, D ** -0.5)
    torch.testing.assert_close(mass.double(), want, atol=1e-6, rtol=1e-5)
    for b in range(2):
        for c, j in enumerate(far.selection(layer, b)):
            if j < 0:
                continue
            torch.testing.assert_close(far.scores[layer, b, j].double(),
                                       0.75 * before[layer, b, j].double() + 0.25 * want[b, c])
    assert torch.equal(far.scores[0], before[0])         # other layers untouched
    unselected = [j for j in range(far.J) if j not in far.selection(layer, 1)]
    assert torch.equal(far.scores[layer, 1, unselected[1:]], before[layer, 1, unselected[1:]])


def test_an_absorb_is_due_only_after_a_commit_that_queued_summaries():
    """Without queued summaries every leave row is empty: skipping the absorb changes nothing."""
    pager, far, k, v = setup(cap=2, max_leave=1)
    commit(pager, far, k, v, {"a": 6 * S})              # chunks 0 and 1 far: one summary a commit
    assert far.summaries_due
    commit(pager, far, k, v, {"a": 1})                   # the queue's second chunk
    assert far.summaries_due
    with pager.frame() as f:
        f.reserve("a", 1)                                # nothing new is far
    assert not far.summaries_due
    stores = (far.k_store.clone(), far.v_store.clone(), far.scores.clone())
    for layer in range(LAYERS):
        far.absorb(layer, k[layer], v[layer])
    for before, after in zip(stores, (far.k_store, far.v_store, far.scores)):
        assert torch.equal(before[:, :, : far.J], after[:, :, : far.J])


def test_a_bucket_of_the_first_slots_sees_and_scores_only_its_live_rows():
    """A decode bucket of ``R`` rows gets the first ``R`` slots' far rows; ``observe`` with a
    live mask moves the live rows' utilities as the whole batch would and leaves the others'."""
    pager, far, k, v = setup(cap=2, max_leave=4, sessions=3)
    commit(pager, far, k, v, {"a": 8 * S, "b": 6 * S, "c": 8 * S})
    layer = 0
    full = far.view(layer)
    part = far.view(layer, 2)
    for got, want in zip(part, full):
        assert torch.equal(got, want[:2])
    for rows in (2, 3):                 # a step's one prepare serves every layer's view
        prep = far.prepare(rows)
        for i in range(LAYERS):
            fk, fv, fb = far.view(i, rows, prep)
            for r in range(rows):
                for c, j in enumerate(far.selection(i, r)):
                    at = j if j >= 0 else far.J      # an empty slot reads the sink row
                    assert torch.equal(fk[r, c], far.k_store[i, r, at])
                    assert torch.equal(fv[r, c], far.v_store[i, r, at])
                    assert (fb[r, c] == float("-inf")) == (j < 0)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, HKV * G, D, generator=gen)
    win_k, win_v = torch.randn(3, W, HKV, D, generator=gen), torch.randn(3, W, HKV, D, generator=gen)
    ws, wl = torch.zeros(3, dtype=torch.int32), torch.full((3,), W, dtype=torch.int32)
    far.scores.uniform_(0.0, 1.0, generator=gen)
    before = far.scores.clone()
    _, lse = static_sliding_attention_ref(q, win_k, win_v, ws, wl, *full)
    far.observe(layer, q, full[0], full[2], lse)              # every row live: the reference
    want = far.scores.clone()
    far.scores.copy_(before)
    fk, fv, fb = part
    live = torch.tensor([False, True])
    far.observe(layer, q[:2], fk, fb, lse[:2], live=live)
    assert torch.equal(far.scores[layer, 0], before[layer, 0])     # not live: untouched
    assert torch.equal(far.scores[layer, 1], want[layer, 1])       # live: as in the full batch
    assert torch.equal(far.scores[layer, 2], before[layer, 2])     # outside the bucket
    assert not torch.equal(want[layer, 1], before[layer, 1])        # the update did something
    with pytest.raises(ValueError, match="rows"):
        far.view(layer, 4)


def test_utility_keeps_the_attended_chunk_in_view():
    """A query aligned with one far chunk's keys: that chunk stays selected as newer chunks
    arrive and compete for two slots; chunks nobody attends to rotate out."""
    pager, far, k, v = setup(cap=2, max_leave=1, sessions=1, seed=4)
    gen = torch.Generator().manual_seed(5)
    u = torch.randn(HKV, D, generator=gen)
    k *= 0.1
    q = (u * 3.0).repeat_interleave(G, dim=0)[None]                   # [1, Hq, D]
    ws = torch.zeros(1, dtype=torch.int32)
    wl = torch.full((1,), W, dtype=torch.int32)
    win = torch.zeros(1, W, HKV, D)
    hot_seen, others = 0, set()
    for step in range(24):
        with pager.frame() as f:
            f.reserve("a", S)
        pages = pager.pages("a")
        if step == 3:                                # chunk 1 (blocks 2, 3) is written
            for layer in range(LAYERS):
                for p in pages[2:4]:
                    k[layer, p] = u + 0.1 * torch.randn(S, HKV, D, generator=gen)
        for layer in range(LAYERS):
            far.absorb(layer, k[layer], v[layer])
            far_k, far_v, far_bias = far.view(layer)
            _, lse = static_sliding_attention_ref(q, win, win, ws, wl, far_k, far_v, far_bias)
            far.observe(layer, q, far_k, far_bias, lse)
        far.pull_scores()
        if 1 in far.summarized(0):
            hot_seen += 1
            for layer in range(LAYERS):
                assert 1 in far.selection(layer, 0), f"step {step}: {far.selection(layer, 0)}"
                others.update(set(far.selection(layer, 0)) - {1, -1})
    ids = far.summarized(0)
    assert hot_seen > 10 and len(ids) >= 8
    assert far.host_scores[0, 0, 1] == far.host_scores[0, 0, ids].max()
    assert len(others) >= 4                      # the second slot went round the cold chunks


class _FailingHook:
    """A hook after the far view's that fails on demand, aborting the commit after the far
    view has staged its edits."""

    fail = False

    def tables(self):
        return {}

    def on_commit(self, frame, deltas, grown=None):
        if self.fail:
            raise RuntimeError("boom")
        return {}


def test_aborted_commit_and_closed_session():
    pager = Pager(64, S, max_sessions=2, max_blocks=24, device="cpu")
    far = FarView(pager, window_tokens=W, chunk_tokens=CHUNK, cap=2, num_layers=LAYERS,
                  num_kv_heads=HKV, head_dim=D, dtype=torch.float32, max_leave=2)
    hook = _FailingHook()
    pager.attach(hook)
    k = torch.randn(LAYERS, 64, S, HKV, D)
    commit(pager, far, k, k, {"a": 8 * S})            # 3 far chunks: [0, 1] now, 2 pending
    slot = pager.slot("a")
    state = far.summarized(slot), far.selection(0, slot), far.last["pending"]
    assert state == ([0, 1], [0, 1], 1)
    hook.fail = True
    with pytest.raises(RuntimeError, match="boom"), pager.frame() as f:
        f.reserve("a", 4 * S)
    hook.fail = False
    assert (far.summarized(slot), far.selection(0, slot)) == state[:2]
    got = commit(pager, far, k, k, {"b": S})          # the retry drains the same queue
    assert got[slot] == [2] and far.summarized(slot) == [0, 1, 2]
    with pager.frame() as f:
        f.trim("a")
    assert all(far.selection(layer, slot) == [-1, -1] for layer in range(LAYERS))
    commit(pager, far, k, k, {"c": 6 * S})            # a new session reuses the slot
    assert pager.slot("c") == slot and far.summarized(slot) == [0, 1]
    torch.testing.assert_close(far.k_store[0, slot, 1].double(),
                               chunk_mean(k[0], pager.pages("c"), 1))


def test_bad_parameters():
    pager = Pager(16, S, max_sessions=1, max_blocks=8, device="cpu")
    kw = dict(window_tokens=W, chunk_tokens=CHUNK, cap=2, num_layers=1, num_kv_heads=1,
              head_dim=16)
    with pytest.raises(ValueError, match="window_tokens"):
        FarView(pager, **dict(kw, window_tokens=12))
    with pytest.raises(ValueError, match="chunk_tokens"):
        FarView(pager, **dict(kw, chunk_tokens=4))
    with pytest.raises(ValueError, match="ema"):
        FarView(pager, **kw, ema=1.0)
    with pytest.raises(ValueError, match="cap"):
        FarView(pager, **dict(kw, cap=0))


def test_compiled_far_view_layer_never_recompiles():
    """absorb + view + attention + observe compiled once; tables and values change per step."""
    torch._dynamo.reset()
    backend, calls = counting_backend()
    pager, far, k, v = setup(cap=2, max_leave=1, sessions=2)
    ws = torch.zeros(2, dtype=torch.int32)
    wl = torch.full((2,), W, dtype=torch.int32)
    gen = torch.Generator().manual_seed(6)
    win = torch.randn(2, W, HKV, D, generator=gen)

    @torch.compile(backend=backend, fullgraph=True)
    def layer_step(q, kc, vc):
        far.absorb(0, kc, vc)
        far_k, far_v, far_bias = far.view(0)
        out, lse = torch.ops.kvops.static_sliding_attention(q, win, win, ws, wl, far_k, far_v, far_bias)
        far.observe(0, q, far_k, far_bias, lse)
        return out

    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(10):
            with pager.frame() as f:
                f.reserve("a", S)
                f.reserve("b", 2 * S)
            q = torch.randn(2, HKV * G, D, generator=gen)
            out = layer_step(q, k[0], v[0])
            far_k, far_v, far_bias = far.view(0)
            want, _ = static_sliding_attention_ref(q, win, win, ws, wl, far_k, far_v, far_bias)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1
    assert len(far.summarized(pager.slot("b"))) >= 8
    assert kvops.validate() is False


@requires_cuda
def test_cuda_graph_replays_far_view_layer_across_commits():
    """absorb + view + attention + observe captured once; each commit's upload changes what the
    replay summarizes and selects, and the replay matches eager on a twin policy."""
    def build():
        pager = Pager(64, S, max_sessions=2, max_blocks=24, device="cuda")
        far = FarView(pager, window_tokens=W, chunk_tokens=CHUNK, cap=2, num_layers=1,
                      num_kv_heads=HKV, head_dim=D, dtype=torch.float16, device="cuda")
        return pager, far

    gen = torch.Generator().manual_seed(7)
    k = torch.randn(64, S, HKV, D, generator=gen).half().cuda()
    v = torch.randn(64, S, HKV, D, generator=gen).half().cuda()
    win = torch.randn(2, W, HKV, D, generator=gen).half().cuda()
    q = torch.randn(2, HKV * G, D, generator=gen).half().cuda()
    ws = torch.zeros(2, dtype=torch.int32, device="cuda")
    wl = torch.full((2,), W, dtype=torch.int32, device="cuda")
    (pager, far), (twin_pager, twin) = build(), build()

    def layer(f):
        f.absorb(0, k, v)
        far_k, far_v, far_bias = f.view(0)
        out, lse = torch.ops.kvops.static_sliding_attention(q, win, win, ws, wl, far_k, far_v, far_bias)
        f.observe(0, q, far_k, far_bias, lse)
        return out

    for p in (pager, twin_pager):
        with p.frame() as fr:
            fr.reserve("a", S)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(far)
    torch.cuda.current_stream().wait_stream(s)
    layer(twin)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(far)
    for _ in range(12):
        for p, f in ((pager, far), (twin_pager, twin)):
            f.pull_scores()
            with p.frame() as fr:
                fr.reserve("a", S)
                fr.reserve("b", 2 * S)
        graph.replay()
        want = layer(twin)
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(far.scores, twin.scores, atol=1e-4, rtol=1e-4)
    assert len(far.summarized(pager.slot("b"))) >= 8


@requires_cuda
def test_device_pulls_rank_as_the_host_does():
    """A far view on CUDA pulls through the ranking op and its pinned buffers; a CPU twin
    given the same utilities ranks on the host. Pulls back to back, pulls followed by a
    commit a later policy fails, and general commits (trims, new sessions) leave both with
    the same selection rows and ranking keys at every step."""
    rng = np.random.default_rng(3)
    views = []
    for dev in ("cuda", "cpu"):
        pager = Pager(128, S, max_sessions=3, max_blocks=48, device=dev)
        far = FarView(pager, window_tokens=W, chunk_tokens=CHUNK, cap=2, num_layers=LAYERS,
                      num_kv_heads=HKV, head_dim=D, dtype=torch.float32, max_leave=2,
                      device=dev)
        boom = _FailingPolicy()
        pager.attach(boom)
        gen = torch.Generator().manual_seed(1)
        k = torch.randn(LAYERS, 128, S, HKV, D, generator=gen).to(dev)
        views.append((pager, far, boom, k))
    for step in range(40):
        u = rng.integers(0, 4, views[0][1].scores.shape).astype(np.float32)
        pulls = int(rng.integers(0, 3)) if step % 3 == 2 else 0
        for _ in range(pulls):
            views[0][1].scores.copy_(torch.from_numpy(u))
            views[0][1].pull_scores()
            views[1][1].pull_scores(u)
        edits = {"a": int(rng.choice([1, S // 2, S]))}
        if step % 5 == 1:
            edits["b"] = S
        fail = pulls and rng.random() < 0.4
        trim = step > 6 and rng.random() < 0.3
        for pager, far, boom, k in views:
            for attempt in ((True, False) if fail else (False,)):
                boom.fail = attempt
                try:
                    with pager.frame() as f:
                        for key, n in edits.items():
                            f.reserve(key, n)
                        if trim:
                            f.trim("a", [0])
                except RuntimeError:
                    assert attempt
            for layer in range(LAYERS):
                far.absorb(layer, k[layer], k[layer])
        (p0, f0, _, _), (p1, f1, _, _) = views
        rows = (LAYERS, f0.B, f0.C)             # a changed row's entries are in no order
        for a, b in ((p0.host_tables["far_select"], p1.host_tables["far_select"]),
                     (f0._sel_key, f1._sel_key)):
            assert np.array_equal(np.sort(a.reshape(rows), axis=2),
                                  np.sort(b.reshape(rows), axis=2)), step
        assert torch.equal(p0.device_tables["far_select"].cpu(),
                           torch.from_numpy(p0.host_tables["far_select"]))
    assert len(f0.summarized(p0.slot("a"))) > 4


def test_decode_with_far_view_matches_the_block_parallel_evaluation(monkeypatch):
    """Token by token through Pager + FarView + the ops equals what kvops.evals.far_view
    computes for all positions at once (cap holding every far chunk), bias on and off."""
    from kvops.evals import far_view as ev

    Wt, cap, T = 32, 8, 120
    monkeypatch.setattr(ev, "WINDOW", Wt)
    monkeypatch.setattr(ev, "PAGE", S)
    monkeypatch.setattr(ev, "CHUNK", CHUNK)
    q, k, v = _token_qkv(T, 8)
    for bias in (True, False):
        want = ev.attention_banded(q, k, v, "far", cap, bias)
        pager = Pager(32, S, max_sessions=1, max_blocks=16, device="cpu")
        far = FarView(pager, window_tokens=Wt, chunk_tokens=CHUNK, cap=cap, num_layers=1,
                      num_kv_heads=HKV, head_dim=D, dtype=torch.float32, log_count_bias=bias)
        pool_k, pool_v = torch.zeros(32, S, HKV, D), torch.zeros(32, S, HKV, D)
        for t in range(T):
            with pager.frame() as f:
                f.reserve("a", 1)
            page = pager.pages("a")[t // S]
            pool_k[page, t % S], pool_v[page, t % S] = k[t], v[t]
            far.absorb(0, pool_k, pool_v)
            first = max(0, -(-(t + 1) // S) - Wt // S) * S          # the transport's window
            win_k, win_v = torch.zeros(1, Wt, HKV, D), torch.zeros(1, Wt, HKV, D)
            win_k[0, : t + 1 - first], win_v[0, : t + 1 - first] = k[first:t + 1], v[first:t + 1]
            far_k, far_v, far_bias = far.view(0)
            out, lse = torch.ops.kvops.static_sliding_attention(
                q[t:t + 1], win_k, win_v, torch.zeros(1, dtype=torch.int32),
                torch.tensor([t + 1 - first], dtype=torch.int32), far_k, far_v, far_bias)
            far.observe(0, q[t:t + 1], far_k, far_bias, lse)
            far.pull_scores()
            torch.testing.assert_close(out[0], want[t], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, t=t, b=bias: f"position {t}, bias {b}: {m}")
        assert len(far.summarized(0)) == (T - Wt) // CHUNK


def test_rank_keys_order_by_utility_then_newer_chunk():
    from kvops.ops.far_view_rank import EMPTY_KEY as _EMPTY_KEY
    from kvops.ops.far_view_rank import rank_keys

    u = np.array([-np.inf, -2.0, -1.0, -0.0, 0.0, 1e-30, 0.5, 0.5, 2.0, np.inf], np.float32)
    ids = np.array([9, 3, 4, 5, 1, 2, 6, 7, 0, 8])
    key = rank_keys(u, ids)
    assert np.all(np.diff(key) > 0)
    assert np.array_equal(key & 0xFFFFFFFF, ids)                 # the id is the low bits
    empty = np.int64(_EMPTY_KEY)                # below every key, and reads as -1 in int32
    assert empty < key.min() and empty.astype(np.int32) == -1
    t = rank_keys(torch.from_numpy(u), torch.from_numpy(ids.astype(np.int64)))
    assert np.array_equal(t.numpy(), key)                         # tensors key alike
    assert rank_keys(np.float32([0.5]), np.array([1]))[0] < rank_keys(np.float32([0.5]),
                                                                       np.array([2]))[0]


@pytest.mark.parametrize("max_leave", [1, 2])
def test_selection_matches_a_top_cap_oracle_under_random_steps(max_leave):
    """Random growth (decode and long appends), trims of far and window blocks, sessions closed and
    opened, pulls of utilities with many ties: after every commit each row holds the top C
    of the slot's summaries by (utility, id), a summary stored since the last pull ranking
    above every pulled one (the host does not know its utility yet; among those, the newer)."""
    rng = np.random.default_rng(max_leave)
    cap, sessions = 3, 4
    pager = Pager(200, S, max_sessions=sessions, max_blocks=40, device="cpu")
    far = FarView(pager, window_tokens=W, chunk_tokens=CHUNK, cap=cap, num_layers=LAYERS,
                  num_kv_heads=HKV, head_dim=D, dtype=torch.float32, max_leave=max_leave)
    fresh: dict[int, set] = {}                  # session -> chunks stored since the last pull
    next_key = most = gaps = 0
    for step in range(160):
        with pager.frame() as f:
            for key in list(fresh):
                n = pager.length(key)
                r = rng.random()
                if r < 0.04:                                     # EOS
                    f.trim(key)
                    del fresh[key]
                elif r < 0.1 and n > W + 2 * CHUNK:              # a far block goes back
                    f.trim(key, [int(rng.integers(0, -(-n // S) - W // S))])
                elif r < 0.13 and n > 2 * S:                     # a block before the tail
                    f.trim(key, [int(rng.integers(0, -(-n // S) - 1))])
                elif n < 30 * S:
                    f.reserve(key, int(rng.choice([1, 1, 1, S, 3 * CHUNK])))
            if len(fresh) < sessions and rng.random() < 0.3:
                fresh[next_key] = set()
                f.reserve(next_key, int(rng.integers(1, 12 * S)))
                next_key += 1
        for name in ("far_select", "far_leave_pages", "far_leave_ids"):  # the upload's ranges
            assert np.array_equal(pager.device_tables[name].numpy(), pager.host_tables[name])
        ids = pager.host_tables["far_leave_ids"].reshape(sessions, max_leave)
        for key, new in fresh.items():
            b = pager.slot(key)
            new |= {j for j in ids[b].tolist() if j != far.J}
            have = far.summarized(b)
            assert new <= set(have)
            lead = 0
            while lead in set(have):
                lead += 1
            assert far.leading_summarized(b) == lead, (step, key)
            most = max(most, len(have))
            gaps += len(have) < (max(have) + 1 if have else 0)    # a dropped chunk
            for layer in range(LAYERS):
                util = far.host_scores[layer, b]
                rank = sorted(have, key=lambda j: (j in new, 0.0 if j in new else util[j], j))
                assert chosen(far, layer, b) == sorted(rank[-cap:]), (step, layer, key)
        if step % 5 == 4:                                        # a pull: ties on purpose
            u = rng.integers(0, 3, far.host_scores.shape).astype(np.float32)
            # the device's ranking (torch, any device) is the host's (numpy)
            summ = (np.arange(far.J) < far._done[:, None]) & ~far._dropped
            sel = pager.host_tables["far_select"]
            want = far._rank_host(u, sel, summ)
            want, moved = want
            got, got_moved = (t.numpy() for t in far._rank(
                torch.from_numpy(u), torch.from_numpy(sel), torch.from_numpy(summ)))
            assert np.array_equal(got_moved, moved)
            assert np.array_equal(got[~moved], want[~moved])     # in the committed order
            assert np.array_equal(np.sort(got[moved], axis=1), np.sort(want[moved], axis=1))
            far.pull_scores(u)
            fresh = {key: set() for key in fresh}
            if fresh and rng.random() < 0.5:     # an aborted frame: the ranking waits for
                with pytest.raises(RuntimeError):            # the next commit
                    with pager.frame() as f:
                        f.reserve(next(iter(fresh)), S)
                        raise RuntimeError("abort")
    assert most > cap + 2 and gaps and next_key > sessions      # ranked, dropped, reused


def test_retrieval_eval_runs_on_other_page_sizes(monkeypatch):
    """``ret<K>@<S>``: the retrieval far view of the evaluation on pages of S tokens (window,
    bounds and selection), the block-parallel path equal to the kvops-op path; bad sizes are
    refused naming the config."""
    from kvops.evals import far_view as ev

    assert ev.parse_config("ret128@8") == ("ret", 128, False, 0)
    assert (ev.retrieval_page("ret64-every4@8"), ev.retrieval_every("ret64-every4@8")) == (8, 4)
    assert ev.retrieval_page("ret64") == ev.retrieval_page("far64") == ev.PAGE
    for bad in ("ret64@4", "ret64@12", "far64@8", "ret64@x"):
        with pytest.raises(ValueError, match="config: expected"):
            ev.parse_config(bad)
    monkeypatch.setattr(ev, "WINDOW", 32)
    T = 120
    q, k, v = _token_qkv(T, 9)
    fine = ev.attention_banded(q, k, v, "ret", 4, False, page=8)
    torch.testing.assert_close(fine, ev.attention_far(q, k, v, "ret", 4, False, q_block=32,
                                                      page=8), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fine, ev.attention_banded(q, k, v, "ret", 4, False, page=16))


def test_selection_churn_runs_on_the_configs_page_size(monkeypatch):
    """``--task churn`` honours ``@<S>``: with a window of 32 tokens and T 120 the last
    position has 11 far pages of 8 but 6 of 16, so 7 pages are a choice on pages of 8 and more
    than any position has on pages of 16, which raises."""
    from kvops.evals import far_view as ev
    from kvops.models import Llama, LlamaConfig

    monkeypatch.setattr(ev, "WINDOW", 32)
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=HKV * G, n_kv_heads=HKV,
                      head_dim=D, hidden_dim=64, max_seq_len=256)
    model = Llama.random(cfg, seed=1)
    ids = torch.randint(0, 64, (120,), generator=torch.Generator().manual_seed(2))
    share = ev.selection_churn(model, ids, 3, lags=(1, 4), page=8)
    assert set(share) == {1, 4} and all(0.0 <= s <= 1.0 for s in share.values())
    assert ev.selection_churn(model, ids, 7, lags=(1,), page=8)
    with pytest.raises(ValueError, match="no position of the 120 has 7 far pages of 16"):
        ev.selection_churn(model, ids, 7, lags=(1,), page=16)


@pytest.mark.parametrize("page,top_k", [(8, 3), (16, 2)])
def test_retrieval_decode_through_the_runtime_matches_the_banded_evaluation(monkeypatch, page,
                                                                             top_k):
    """Token by token through Pager + FarRetrieval + static_sliding_attention, a random model
    gives the next-token NLL the block-parallel evaluation of ``ret<K>@<S>`` gives: the
    runtime's summaries, selection and far slots are what the recorded quality tables
    measured."""
    from kvops.evals import far_view as ev
    from kvops.evals.perplexity import nll_sum
    from kvops.models import Llama, LlamaConfig

    monkeypatch.setattr(ev, "WINDOW", 32)
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=HKV * G, n_kv_heads=HKV,
                      head_dim=D, hidden_dim=64, max_seq_len=256)
    model = Llama.random(cfg, seed=3, std=0.2)
    ids = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(4))
    banded = nll_sum(model, ev.hidden_states(model, ids, f"ret{top_k}@{page}")[:-1], ids[1:])
    near = nll_sum(model, ev.hidden_states(model, ids, "near")[:-1], ids[1:])
    got = ev.sequential_nll_retrieval(model, ids, top_k, page=page)
    assert got == pytest.approx(float(banded), rel=1e-5)
    assert abs(float(banded) - float(near)) > 1e-3          # the far pages change the result


@pytest.mark.parametrize("config,every", [("ret2+decode@8", 1), ("ret2-every8+decode@8", 8)])
def test_served_retrieval_prefills_densely_and_decodes_through_the_runtime(monkeypatch, config,
                                                                           every):
    """``ret<K>[-every<N>]+decode@<S>``: positions before the prompt's end are dense's, and
    the answer's positions give the NLL a runtime gives that prefills the prompt densely, drains
    every far page's bounds in the first decode step (``begin_step(drain=True)``) and decodes
    through Pager + FarRetrieval + static_sliding_attention; with ``-every8`` the first decode
    step's choice serves the next seven. The far view changes the answer's positions, so the
    check can fail."""
    from kvops.evals import far_view as ev
    from kvops.evals.perplexity import nll_sum
    from kvops.models import Llama, LlamaConfig

    assert ev.parse_config(config) == ("ret", 2, False, 0)
    assert ev.decode_only(config) and not ev.decode_only("ret2@8")
    assert ev.parse_config("ret2+sink1+decode@8") == ("ret", 2, False, 1)   # +decode composes
    for bad in ("far64+decode", "dense+decode"):       # no runtime drains these
        with pytest.raises(ValueError, match="expected \\+decode after near or ret"):
            ev.parse_config(bad)
    assert (ev.retrieval_page(config), ev.retrieval_every(config)) == (8, every)
    monkeypatch.setattr(ev, "WINDOW", 32)
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=HKV * G, n_kv_heads=HKV,
                      head_dim=D, hidden_dim=64, max_seq_len=256)
    model = Llama.random(cfg, seed=3, std=0.2)
    ids = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(4))
    P = 91                                                  # 7 far pages of 8 at the prompt's end
    dense, kvs = ev.hidden_states_from(model, ids, "dense")
    served = ev.hidden_states_served(model, ids, config, P, (dense, kvs))
    torch.testing.assert_close(served[:P], dense[:P], rtol=0, atol=0)
    assert not torch.allclose(served[P:], dense[P:], atol=1e-4)
    near = ev.hidden_states_served(model, ids, "near+decode", P, (dense, kvs))  # the control
    torch.testing.assert_close(near[:P], dense[:P], rtol=0, atol=0)
    assert not torch.allclose(near[P:], served[P:], atol=1e-4)
    if every == 1:
        got = ev.sequential_nll_retrieval(model, ids, 2, page=8, prefill=P)
        want = nll_sum(model, served[:-1], ids[1:])
        assert got == pytest.approx(float(want), rel=1e-5)
    else:                      # one choice for positions P..P+7: the first one's pages
        once = ev.hidden_states_served(model, ids[:P + 1], "ret2+decode@8", P)
        torch.testing.assert_close(served[P], once[P], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(served[P + 1:], ev.hidden_states_served(
            model, ids, "ret2+decode@8", P)[P + 1:], atol=1e-4)
    with pytest.raises(ValueError, match="decodes after a prompt"):
        ev.hidden_states(model, ids, config)
    with pytest.raises(ValueError, match="prompt_len: expected 1..99"):
        ev.hidden_states_served(model, ids, config, 100)


def test_per_head_retrieval_diagnostic_attends_to_each_heads_own_pages(monkeypatch):
    """``reth<K>@<S>`` (diagnostic): each KV head attends to its window plus the K far pages of
    best bound for its own query group; equal to a per-head brute force, and equal to ``ret``
    when there is one KV head and K covers every far page."""
    from kvops.evals import far_view as ev

    assert ev.parse_config("reth128@8") == ("reth", 128, False, 0)
    assert ev.retrieval_page("reth128@8") == 8
    monkeypatch.setattr(ev, "WINDOW", 32)
    T, S, K = 120, 8, 3
    q, k, v = _token_qkv(T, 11)
    got = ev.attention_banded(q, k, v, "reth", K, False, page=S)
    win_start, win_len, _ = ev.window_geometry(T, "cpu", S)
    first = torch.arange(T) - win_len + 1
    want = torch.empty_like(q)
    pages = k[: T // S * S].view(-1, S, HKV, D)
    lo, hi = pages.amin(1), pages.amax(1)                                # [N, Hkv, D]
    for t in range(T):
        nf = int(first[t]) // S
        for h in range(HKV):
            qg = q[t, h * G:(h + 1) * G]                                 # [G, D]
            bound = (qg.clamp(min=0) @ hi[:nf, h].T + qg.clamp(max=0) @ lo[:nf, h].T).amax(0)
            chosen = torch.topk(bound, min(K, nf)).indices if nf else torch.zeros(0, dtype=int)
            keys = torch.cat([(p * S + torch.arange(S)) for p in chosen.tolist()]
                             + [torch.arange(int(first[t]), t + 1)])
            att = torch.softmax(qg @ k[keys, h].T * D ** -0.5, dim=-1)
            want[t, h * G:(h + 1) * G] = att @ v[keys, h]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    one = slice(0, 1)
    q1, k1, v1 = q[:, :G], k[:, one], v[:, one]
    torch.testing.assert_close(ev.attention_banded(q1, k1, v1, "reth", 16, False, page=S),
                               ev.attention_banded(q1, k1, v1, "ret", 16, False, page=S),
                               atol=1e-5, rtol=1e-5)


def test_needle_page_ranks_reads_the_selection_it_reports(monkeypatch):
    """``needle_page_ranks``: one row a layer; layer 0's best-bound rank is the count of far
    pages scoring above the best span page (brute force); a choice as wide as every far page
    always holds every span page, one of a single page only when its rank is 0; a span inside
    the window is never far."""
    from kvops.evals import far_view as ev
    from kvops.models import Llama, LlamaConfig
    from kvops.ops.far_page_select import page_scores_ref

    monkeypatch.setattr(ev, "WINDOW", 32)
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=HKV * G, n_kv_heads=HKV,
                      head_dim=D, hidden_dim=64, max_seq_len=256)
    model = Llama.random(cfg, seed=5, std=0.2)
    ids = torch.randint(0, 64, (120,), generator=torch.Generator().manual_seed(6))
    span, at, S = (16, 30), [100, 101], 8
    wide = ev.needle_page_ranks(model, ids, span, at, 32, page=S)
    assert len(wide) == 2 and all(r["chosen"] == r["span_far"] == 2 for r in wide)
    T = ids.shape[0]
    x = model.layers[0].attention_norm(model.tok_embeddings(ids))
    q, k, _ = model.layers[0].attention._qkv(x, model.rope_cos[:T], model.rope_sin[:T])
    lo, hi = ev.page_bounds(k, S)
    _, win_len, _ = ev.window_geometry(T, "cpu", S)
    nf = ((torch.tensor(at) - win_len[at] + 1) // S).to(torch.int32)
    sc = page_scores_ref(q[at], lo.expand(2, -1, -1, -1), hi.expand(2, -1, -1, -1), nf)[0]
    want = min(int((sc[i] > sc[i, p]).sum()) for i in range(2) for p in (2, 3))
    assert wide[0]["best_bound_rank"] == want
    one = ev.needle_page_ranks(model, ids, span, at, 1, page=S)
    for r in one:
        assert r["chosen"] == (r["best_bound_rank"] == 0)    # one page at most
    inside = ev.needle_page_ranks(model, ids, (96, 100), at, 4, page=S)
    assert all(r["best_bound_rank"] == lo.shape[1] and r["chosen"] == r["span_far"] == 0
               for r in inside)


def test_retrieval_with_sink_tokens_counts_each_key_once(monkeypatch):
    """``ret<K>+sink<n>@<S>`` (diagnostic): the first n tokens join every query's keys; when
    the choice already holds them (K covers every far page) nothing changes, so no key is
    counted twice; with a narrow choice they change the result."""
    from kvops.evals import far_view as ev

    assert ev.parse_config("ret128+sink4@8") == ("ret", 128, False, 4)
    assert ev.retrieval_page("ret128+sink4@8") == 8
    monkeypatch.setattr(ev, "WINDOW", 32)
    T = 120
    q, k, v = _token_qkv(T, 12)
    wide = ev.attention_banded(q, k, v, "ret", 16, False, sink=4, page=8)
    torch.testing.assert_close(wide, ev.attention_banded(q, k, v, "ret", 16, False, page=8),
                               atol=1e-6, rtol=1e-6)
    narrow = ev.attention_banded(q, k, v, "ret", 1, False, sink=4, page=8)
    assert not torch.allclose(narrow, ev.attention_banded(q, k, v, "ret", 1, False, page=8))


def test_retrieval_rest_adds_each_unchosen_far_page_as_its_mean(monkeypatch):
    """``ret<K>+rest@<S>`` (diagnostic): the retrieval far view's keys plus, per far page not
    chosen, the page's mean key and value with bias ``log(S)``, against a loop oracle; with
    every far page chosen there is nothing left and it is ``ret<K>`` itself."""
    from kvops.evals import far_view as ev

    assert ev.parse_config("ret4+rest@8") == ("ret", 4, False, 0)
    assert ev.retrieval_rest("ret4+rest@8") and not ev.retrieval_rest("ret4@8")
    monkeypatch.setattr(ev, "WINDOW", 32)
    T, page, top = 120, 8, 2
    q, k, v = _token_qkv(T, 11)
    got = ev.attention_banded(q, k, v, "ret", top, False, page=page, rest=True)
    first = torch.arange(T) - ev.window_geometry(T, "cpu", page)[1] + 1
    n_pages = first // page
    sel = ev.retrieval_pages(q, ev.page_bounds(k, page), torch.arange(T), n_pages, top)
    scale = D ** -0.5
    for t in (60, 77, 119):
        keys = [j for j in range(t + 1) if j >= first[t] or sel[t, j // page]]
        far = [p for p in range(int(n_pages[t])) if not sel[t, p]]
        assert far and len(keys) > t + 1 - first[t]               # both kinds take part
        for h in range(HKV * G):
            kv = h // G
            kk = torch.cat([k[keys, kv], torch.stack([k[p * page:(p + 1) * page, kv].mean(0)
                                                      for p in far])])
            vv = torch.cat([v[keys, kv], torch.stack([v[p * page:(p + 1) * page, kv].mean(0)
                                                      for p in far])])
            logit = kk @ q[t, h] * scale
            logit[len(keys):] += math.log(page)
            torch.testing.assert_close(got[t, h], torch.softmax(logit, 0) @ vv,
                                       atol=1e-5, rtol=1e-5)
    everything = ev.attention_banded(q, k, v, "ret", T, False, page=page, rest=True)
    torch.testing.assert_close(everything, ev.attention_banded(q, k, v, "ret", T, False,
                                                               page=page))


def test_absorb_layers_and_views_equal_the_per_layer_calls():
    """``absorb_layers`` (every layer from the stacked pools in one pass) leaves the stores and
    utilities bit for bit as a per-layer ``absorb`` loop does, with utilities that differ by
    layer (a new summary starts at its layer's best selected utility), and ``views`` gives
    each layer's ``view``; pools that are not one stacked allocation are refused."""
    twins = [setup(cap=2, max_leave=4, sessions=3, seed=5) for _ in range(2)]
    gen = torch.Generator().manual_seed(9)
    steps = [{"a": 8 * S, "b": 6 * S, "c": 8 * S}, {"a": 3 * S, "b": 4 * S}, {"c": 5 * S, "a": 2},
             {"b": 9 * S}]
    for grow in steps:
        u = torch.rand(twins[0][1].scores.shape, generator=gen)
        for one, (pager, far, k, v) in enumerate(twins):
            far.scores.copy_(u)
            with pager.frame() as f:
                for key, n in grow.items():
                    f.reserve(key, n)
            if one:
                far.absorb_layers(k, v)
            else:
                for layer in range(LAYERS):
                    far.absorb(layer, k[layer], v[layer])
        a, b = twins[0][1], twins[1][1]
        assert torch.equal(a.k_store, b.k_store) and torch.equal(a.v_store, b.v_store)
        assert torch.equal(a.scores, b.scores)
        for rows in (2, 3):
            fk, fv, fb = b.views(rows)
            for layer in range(LAYERS):
                for got, want in zip((fk[layer], fv[layer], fb[layer]), a.view(layer, rows)):
                    assert torch.equal(got, want)
    assert a.k_store.abs().sum(dim=(-1, -2)).count_nonzero() > 2 * LAYERS   # summaries landed
    assert (a.scores[0] != a.scores[1]).any()
    _, far, k, v = twins[1]
    with pytest.raises(ValueError, match=r"k_pools, v_pools: expected \[layers=2"):
        far.absorb_layers(k[0], v[0])
    spread = torch.zeros(k.shape[1], LAYERS, *k.shape[2:]).transpose(0, 1)   # page-major
    with pytest.raises(ValueError, match="k_pools: expected the layers' pools back to back"):
        far.absorb_layers(spread, spread)
