"""FarRetrieval policy: key bounds once per page as pages leave the window (on the device, fed
by the block table), top-K selection by the query, exact gather into fixed far slots, slot
reuse, trimmed pages, selection every N steps, a compiled and a graph-captured step."""

from __future__ import annotations

import pytest
import torch

import kvops
from kvops.ops.static_sliding_attention import static_sliding_attention_ref
from kvops.runtime import FarRetrieval, Pager
from tests.conftest import capture_graph, requires_cuda
from tests.oracles_far_retrieval import far_page_summarize_oracle, page_scores_oracle, select_oracle

S, W, HKV, G, D, LAYERS, L = 8, 16, 2, 2, 16, 2, 24


def setup(top_k=3, max_leave=1, sessions=2, pages=64, device="cpu", seed=0):
    pager = Pager(pages, S, max_sessions=sessions, max_blocks=L, device=device)
    ret = FarRetrieval(pager, window_tokens=W, top_k=top_k, num_layers=LAYERS,
                       num_kv_heads=HKV, head_dim=D, dtype=torch.float32, max_leave=max_leave)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, pages, S, HKV, D, generator=gen).to(device)
    v = torch.randn(LAYERS, pages, S, HKV, D, generator=gen).to(device)
    return pager, ret, k, v


def step(pager, ret, k, v, grow, q=None, select=True, close=()):
    """One decode step: the frame, begin_step, and per layer absorb (+ select with ``q``)."""
    with pager.frame() as f:
        for key in close:
            f.trim(key)
        for key, n in grow.items():
            f.reserve(key, n)
    ret.begin_step()
    for layer in range(LAYERS):
        ret.absorb(layer, k[layer])
        if select:
            ret.select(layer, q[layer], k[layer], v[layer])


def queries(seed, B=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, B, HKV * G, D, generator=gen)


def far_count(pager, key):
    return max(0, -(-pager.length(key) // S) - W // S)


def expected_pages(pager, ret, k, key, layer, q_row, done, top_k):
    """The ``top_k`` logical blocks the oracle chooses among the first ``done`` blocks, sorted."""
    blocks = pager.pages(key)[:done]
    lo, hi = far_page_summarize_oracle(k[layer], torch.tensor([blocks], dtype=torch.int32))
    scores = page_scores_oracle(q_row[None], lo, hi, torch.tensor([done]))
    return sorted(select_oracle(scores, [done], top_k)[0])


def test_bounds_are_computed_once_when_pages_leave_the_window():
    pager, ret, k, v = setup(max_leave=1)
    for t in range(8):                                   # one block per step
        step(pager, ret, k, v, {"a": S}, select=False)
        b = pager.slot("a")
        nf = far_count(pager, "a")
        assert int(ret.done[b]) == nf, f"step {t}"
        if t not in (2, 7):                              # the oracle is slow; two checks
            continue
        blocks = torch.tensor([pager.pages("a")[:nf]], dtype=torch.int32)
        for layer in range(LAYERS):
            lo, hi = far_page_summarize_oracle(k[layer], blocks)
            torch.testing.assert_close(ret.k_min[layer, b, :nf].double(), lo[0], rtol=0, atol=0)
            torch.testing.assert_close(ret.k_max[layer, b, :nf].double(), hi[0], rtol=0, atol=0)
    # a summary is never recomputed: changing a far page's keys leaves its bounds alone
    step(pager, ret, k, v, {"a": 1}, select=False)       # a new block: one more far page
    assert int(ret.done[b]) == 7
    before = ret.k_min.clone()
    k[:, pager.pages("a")[0]] += 5.0
    step(pager, ret, k, v, {"a": 1}, select=False)       # no new block, no new far page
    assert torch.equal(ret.k_min, before)


def test_selection_scores_only_blocks_that_can_be_far():
    """The choice sees ``L - W / S`` entries (at least K), every block a session can have
    before its window, and a session that long has all of them as candidates: its selection
    equals the oracle's over them."""
    pager, ret, k, v = setup(top_k=3)
    assert ret.bounds(0)[0].shape[1] == L - W // S == 22
    wide = FarRetrieval(Pager(8, S, max_sessions=1, max_blocks=L, device="cpu"),
                        window_tokens=22 * S, top_k=3, num_layers=1, num_kv_heads=HKV,
                        head_dim=D, dtype=torch.float32)
    assert wide.far_width == 3                             # 2 far blocks at most, 3 slots
    step(pager, ret, k, v, {"a": L * S - 1}, select=False)
    for _ in range(22):
        step(pager, ret, k, v, {}, select=False)
    b = pager.slot("a")
    assert int(ret.done[b]) == far_count(pager, "a") == 22
    q = queries(2)
    step(pager, ret, k, v, {}, q=q)
    for layer in range(LAYERS):
        want = expected_pages(pager, ret, k, "a", layer, q[layer, b], 22, 3)
        assert sorted(ret.index[layer, b].tolist()) == want


def test_prefill_drains_max_leave_pages_per_step():
    pager, ret, k, v = setup(max_leave=2)
    step(pager, ret, k, v, {"a": 9 * S}, select=False)   # 9 blocks: 7 far at once
    b = pager.slot("a")
    got = [int(ret.done[b])]
    for _ in range(4):
        step(pager, ret, k, v, {"a": 1}, select=False)
        got.append(int(ret.done[b]))
    assert got == [2, 4, 6, 8, 8]                      # the first +1 token adds block 10


def test_a_draining_step_summarizes_every_far_page_at_once():
    """``begin_step(drain=True)`` after a prefill: every far page's bounds in one step (the
    oracle's, bit for bit), so the next step's selection chooses among all of them as the
    oracle does; a step that drains nothing new leaves the tables alone, and the steps after it
    go on at ``max_leave`` a step."""
    pager, ret, k, v = setup(max_leave=1)
    with pager.frame() as f:
        f.reserve("a", 13 * S)                             # 13 blocks: 11 far at once
        f.reserve("b", 3 * S)                              # 1 far
    ret.begin_step(drain=True)
    for layer in range(LAYERS):
        ret.absorb(layer, k[layer])
    for key, nf in (("a", 11), ("b", 1)):
        b = pager.slot(key)
        assert int(ret.done[b]) == far_count(pager, key) == nf
        blocks = torch.tensor([pager.pages(key)[:nf]], dtype=torch.int32)
        lo, hi = far_page_summarize_oracle(k[1], blocks)
        torch.testing.assert_close(ret.k_min[1, b, :nf].double(), lo[0], rtol=0, atol=0)
        torch.testing.assert_close(ret.k_max[1, b, :nf].double(), hi[0], rtol=0, atol=0)
    before = ret.k_min.clone()
    ret.begin_step(drain=True)                             # nothing new is far
    for layer in range(LAYERS):
        ret.absorb(layer, k[layer])
    assert torch.equal(ret.k_min, before)
    q = queries(3)
    step(pager, ret, k, v, {"a": 1, "b": 2 * S}, q=q)      # b: 2 more far, 1 summarized
    b = pager.slot("b")
    assert int(ret.done[b]) == 2 and far_count(pager, "b") == 3
    a = pager.slot("a")
    for layer in range(LAYERS):
        assert sorted(ret.index[layer, a].tolist()) == expected_pages(
            pager, ret, k, "a", layer, q[layer, a], 11, 3)


def test_selection_is_the_top_k_by_bound_and_gathers_exact_pages():
    pager, ret, k, v = setup(top_k=3)
    step(pager, ret, k, v, {"a": 8 * S, "b": 4 * S}, select=False)
    for _ in range(6):
        step(pager, ret, k, v, {"a": 1, "b": 1}, select=False)
    q = queries(1)
    step(pager, ret, k, v, {"a": 1, "b": 1}, q=q)
    for key in ("a", "b"):
        b, done = pager.slot(key), int(ret.done[pager.slot(key)])
        assert done == far_count(pager, key)
        for layer in range(LAYERS):
            want = expected_pages(pager, ret, k, key, layer, q[layer, b], done, 3)
            got = ret.index[layer, b].tolist()
            n = min(3, done)
            assert got[n:] == [-1] * (3 - n)
            assert sorted(got[:n]) == want, (key, layer)
            far_k, far_v, far_bias = ret.view(layer)
            for slot, j in enumerate(got):
                rows = slice(slot * S, (slot + 1) * S)
                if j < 0:
                    assert torch.isneginf(far_bias[b, rows]).all()
                    continue
                page = pager.pages(key)[j]
                assert torch.equal(far_k[b, rows], k[layer, page])
                assert torch.equal(far_v[b, rows], v[layer, page])
                assert (far_bias[b, rows] == 0).all()


def check_slots(pager, ret, k, v, key, layer):
    """Every slot of ``key`` at ``layer`` holds its block's page exact (bias 0) or is empty."""
    b = pager.slot(key)
    far_k, far_v, far_bias = ret.view(layer)
    for slot, j in enumerate(ret.index[layer, b].tolist()):
        rows = slice(slot * S, (slot + 1) * S)
        if j < 0:
            assert torch.isneginf(far_bias[b, rows]).all()
            continue
        page = pager.pages(key)[j]
        assert torch.equal(far_k[b, rows], k[layer, page]), (key, layer, slot)
        assert torch.equal(far_v[b, rows], v[layer, page]), (key, layer, slot)
        assert (far_bias[b, rows] == 0).all()


@pytest.mark.parametrize("strided", [False, True], ids=["pool", "strided-pool"])
def test_successive_selections_keep_every_slot_exact(strided):
    """Pages chosen again keep their slots (not copied), new ones fill the freed slots; one
    layer of a [P, layers, ...] pool (any page stride) works the same. Every slot stays exact."""
    pager, ret, k, v = setup(top_k=3)
    if strided:                                       # one layer of a [P, layers, ...] pool
        k = k.transpose(0, 1).contiguous().transpose(0, 1)
        v = v.transpose(0, 1).contiguous().transpose(0, 1)
        assert not k[0].is_contiguous()
    step(pager, ret, k, v, {"a": 9 * S, "b": 5 * S}, select=False)
    for _ in range(6):
        step(pager, ret, k, v, {"a": 1, "b": 1}, select=False)
    for t in range(6):
        before = ret.index.clone()
        with kvops.validate(t == 0):              # the copy plan passes the gather's checks
            step(pager, ret, k, v, {"a": 1, "b": 2}, q=queries(30 + t))
        for layer in range(LAYERS):
            for key in ("a", "b"):
                check_slots(pager, ret, k, v, key, layer)
                b = pager.slot(key)
                want = expected_pages(pager, ret, k, key, layer,
                                      queries(30 + t)[layer, b], int(ret.done[b]), 3)
                got = [j for j in ret.index[layer, b].tolist() if j >= 0]
                assert sorted(got) == want
                # a page chosen again sits in the slot it had
                for slot, j in enumerate(before[layer, b].tolist()):
                    if j >= 0 and j in got:
                        assert ret.index[layer, b, slot] == j


def test_far_slots_in_the_kernel_equal_attention_over_window_and_pages():
    """The view fed to static_sliding_attention is attention over window + chosen pages."""
    pager, ret, k, v = setup(top_k=2, sessions=1)
    step(pager, ret, k, v, {"a": 7 * S}, select=False)
    for _ in range(5):
        step(pager, ret, k, v, {"a": 1}, select=False)
    q = queries(2, B=1)
    step(pager, ret, k, v, {"a": 1}, q=q)
    layer, blocks = 1, pager.pages("a")
    win_pages = blocks[-(W // S):]
    kw = k[layer, win_pages].reshape(1, W, HKV, D)
    vw = v[layer, win_pages].reshape(1, W, HKV, D)
    ws = torch.zeros(1, dtype=torch.int32)
    wl = torch.tensor([pager.length("a") - (len(blocks) - W // S) * S], dtype=torch.int32)
    out, _ = static_sliding_attention_ref(q[layer], kw, vw, ws, wl, *ret.view(layer))
    chosen = [blocks[j] for j in ret.index[layer, 0].tolist() if j >= 0]
    keys = torch.cat([kw[0, : int(wl)], *[k[layer, p] for p in chosen]]).double()
    vals = torch.cat([vw[0, : int(wl)], *[v[layer, p] for p in chosen]]).double()
    qf = q[layer, 0].double().view(HKV, G, D)
    logits = torch.einsum("hgd,nhd->hgn", qf, keys) * D ** -0.5
    want = torch.einsum("hgn,nhd->hgd", logits.softmax(-1), vals).reshape(1, HKV * G, D)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_reused_slot_starts_over_and_shows_nothing_of_the_old_session():
    pager, ret, k, v = setup(top_k=2, sessions=1)
    step(pager, ret, k, v, {"a": 6 * S}, select=False)
    for _ in range(4):
        step(pager, ret, k, v, {"a": 1}, q=queries(3, B=1))
    assert int(ret.done[0]) == far_count(pager, "a") == 5 and (ret.far_bias[:, 0] == 0).any()
    step(pager, ret, k, v, {}, select=False, close=("a",))
    assert int(ret.done[0]) == 0 and torch.isneginf(ret.far_bias[:, 0]).all()
    step(pager, ret, k, v, {"b": 3 * S}, select=False)     # the same slot
    assert pager.slot("b") == 0
    assert int(ret.done[0]) == 1                       # b's first far block, summarized anew
    assert torch.isneginf(ret.far_bias[:, 0]).all() and (ret.index[:, 0] == -1).all()
    step(pager, ret, k, v, {"b": 1}, q=queries(4, B=1))
    assert far_count(pager, "b") == 2
    for layer in range(LAYERS):
        got = ret.index[layer, 0].tolist()
        assert sorted(got) == [0, 1]
        for slot, j in enumerate(got):                  # b's pages, not a's
            page = pager.pages("b")[j]
            assert torch.equal(ret.far_k[layer, 0, slot * S:(slot + 1) * S], k[layer, page])


def test_trimmed_far_block_is_never_gathered():
    pager, ret, k, v = setup(top_k=4, sessions=1)
    step(pager, ret, k, v, {"a": 6 * S}, select=False)
    for _ in range(4):
        step(pager, ret, k, v, {"a": 1}, select=False)
    with pager.frame() as f:
        f.trim("a", [1])
    ret.begin_step()
    for layer in range(LAYERS):
        ret.absorb(layer, k[layer])
        ret.select(layer, queries(5, B=1)[layer], k[layer], v[layer])
    assert far_count(pager, "a") == 5
    assert (ret.index[:, 0] != 1).all()                 # chosen or not, block 1 shows -1
    live = (ret.index[:, 0] >= 0).sum(dim=1)
    assert (live >= 3).all()
    assert torch.equal((ret.far_bias[:, 0] == 0).sum(dim=1), live * S)


def test_steps_without_selection_keep_the_last_pages():
    pager, ret, k, v = setup(top_k=2)
    step(pager, ret, k, v, {"a": 6 * S}, select=False)
    for _ in range(4):
        step(pager, ret, k, v, {"a": 1}, select=False)
    step(pager, ret, k, v, {"a": 1}, q=queries(6))
    kept = [t.clone() for t in (ret.far_k, ret.far_bias, ret.index)]
    for _ in range(3):
        step(pager, ret, k, v, {"a": S}, select=False)      # pages leave, no selection
    assert int(ret.done[pager.slot("a")]) == far_count(pager, "a") == 8
    for a, b in zip(kept, (ret.far_k, ret.far_bias, ret.index)):
        assert torch.equal(a, b)


def test_summarizing_only_when_selecting_chooses_what_summarizing_every_step_does():
    """Every 4th step selects; between them ``begin_step(summarize=False)`` and no absorb.
    With ``max_leave`` 2 (ceil(4 / S) + 1) the selecting step summarizes the pages that left
    meanwhile: the same bounds and pages as a twin that summarizes every step, and an absorb
    after a step that summarizes nothing changes nothing."""
    lazy, eager = setup(max_leave=2), setup(max_leave=2)
    for pager, ret, k, _ in (lazy, eager):
        with pager.frame() as f:
            f.reserve("a", 4 * S)
            f.reserve("b", 3 * S)
        ret.begin_step(drain=True)
        for layer in range(LAYERS):
            ret.absorb(layer, k[layer])
    for i in range(24):                                    # a: 3 tokens a step, b: 1
        q, selecting = queries(10 + i), i % 4 == 3
        for (pager, ret, k, v), lazy_one in ((lazy, True), (eager, False)):
            with pager.frame() as f:
                f.reserve("a", 3)
                f.reserve("b", 1)
            ret.begin_step(summarize=selecting or not lazy_one)
            for layer in range(LAYERS):
                if selecting or not lazy_one:
                    ret.absorb(layer, k[layer])
                if selecting:
                    ret.select(layer, q[layer], k[layer], v[layer])
        if not selecting:
            before = lazy[1].k_min.clone()
            lazy[1].absorb(0, lazy[2][0])                  # nothing picked: nothing written
            assert torch.equal(lazy[1].k_min, before)
            continue
        for key in ("a", "b"):
            b = lazy[0].slot(key)
            assert int(lazy[1].done[b]) == int(eager[1].done[b]) == far_count(lazy[0], key)
        for name in ("k_min", "k_max", "index", "far_k", "far_bias"):
            assert torch.equal(getattr(lazy[1], name), getattr(eager[1], name)), (i, name)


def test_host_commit_edits_only_the_generation_table():
    pager, ret, k, v = setup()
    with pager.frame() as f:
        f.reserve("a", 3 * S)
    gen = pager.host_tables["far_ret_gen"]
    assert gen.tolist() == [1, 0]
    with pager.frame() as f:
        f.reserve("a", S)
    assert gen.tolist() == [1, 0]
    with pager.frame() as f:
        f.trim("a")
    assert gen.tolist() == [2, 0]


def test_bad_arguments():
    pager = Pager(16, S, max_sessions=1, max_blocks=L, device="cpu")
    kw = dict(num_layers=1, num_kv_heads=HKV, head_dim=D, dtype=torch.float32)
    with pytest.raises(ValueError, match="window_tokens"):
        FarRetrieval(pager, window_tokens=12, top_k=2, **kw)
    with pytest.raises(ValueError, match="top_k"):
        FarRetrieval(pager, window_tokens=W, top_k=L + 1, **kw)
    with pytest.raises(ValueError, match="no device"):
        FarRetrieval(Pager(16, S, 1, L), window_tokens=W, top_k=2, **kw)


def test_compiled_layer_step_never_recompiles():
    """Traced whole (fullgraph) once across commits; the graph runs eagerly (inductor's own
    handling of these ops is covered in test_far_page_ops.py), which keeps the test short."""
    torch._dynamo.reset()
    calls = []

    def backend(gm, example_inputs):
        calls.append(1)
        return gm.forward
    pager, ret, k, v = setup(top_k=2)

    @torch.compile(backend=backend, fullgraph=True)
    def layer_step(q):
        ret.absorb(0, k[0])
        ret.select(0, q, k[0], v[0])
        return ret.view(0)

    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(6):
            with pager.frame() as f:
                f.reserve("a", S)
                f.reserve("b", 2 * S)
            ret.begin_step()
            q = queries(10 + t)[0]
            far_k, _, far_bias = layer_step(q)
            for key in ("a", "b"):
                b, done = pager.slot(key), int(ret.done[pager.slot(key)])
                n = min(2, done)
                want = expected_pages(pager, ret, k, key, 0, q[b], done, 2)
                got = ret.index[0, b].tolist()
                assert sorted(got[:n]) == want
    assert len(calls) == 1


@requires_cuda
def test_cuda_graph_step_replays_across_commits():
    """begin_step + absorb + select + view captured once, replayed after new commits, against
    an eager twin policy on the same pager inputs."""
    pager, ret, k, v = setup(top_k=3, device="cuda", pages=128)
    twin_pager, twin, _, _ = setup(top_k=3, device="cuda", pages=128)
    q = torch.zeros(LAYERS, 2, HKV * G, D, device="cuda")

    def run(r):
        r.begin_step()
        for layer in range(LAYERS):
            r.absorb(layer, k[layer])
            r.select(layer, q[layer], k[layer], v[layer])

    for p in (pager, twin_pager):
        with p.frame() as f:
            f.reserve("a", 5 * S)
    graph, _ = capture_graph(lambda: run(ret))
    run(twin)
    for t in range(8):
        for p in (pager, twin_pager):
            with p.frame() as f:
                f.reserve("a", S)
                f.reserve("b", 3)
        q.copy_(queries(20 + t).cuda())
        graph.replay()
        run(twin)
        torch.cuda.synchronize()
        assert torch.equal(ret.done, twin.done)
        assert torch.equal(ret.index, twin.index)
        assert torch.equal(ret.far_k, twin.far_k) and torch.equal(ret.far_bias, twin.far_bias)
