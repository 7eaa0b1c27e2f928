"""far_page_summarize and far_page_select (the retrieval far view's ops): kernels and
references against float64 loop oracles, plus the op contract (opcheck, compile without
recompiles, CUDA graphs, input errors, validation mode)."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvops
from kvops.kernels.far_page_select import far_page_scores_fwd, far_page_top_fwd
from kvops.kernels.far_page_summarize import far_page_summarize_fwd, far_page_summarize_into_fwd
from kvops.ops.far_page_select import _top, far_page_select_ref, page_scores_ref
from kvops.ops.far_page_summarize import far_page_summarize_into_ref, far_page_summarize_ref
from tests.conftest import capture_graph, counting_backend, requires_cuda
from tests.oracles_far_retrieval import far_page_summarize_oracle, page_scores_oracle, select_oracle
from tests.tolerances import assert_close

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def make_pool(P, S, Hkv, D, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(P, S, Hkv, D, generator=gen).to(dtype).to(device)


def make_pages(B, N, P, seed, empty=0.25):
    """Page ids with repeats, about ``empty`` of them -1 or out of the pool."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randint(0, P, (B, N), generator=gen, dtype=torch.int32)
    hole = torch.rand(B, N, generator=gen) < empty
    bad = torch.randint(0, 3, (B, N), generator=gen)
    pages[hole] = torch.where(bad[hole] == 0, P, torch.where(bad[hole] == 1, -3, -1)).to(torch.int32)
    return pages


def check_bounds(lo, hi, k_cache, pages, name):
    want_lo, want_hi = far_page_summarize_oracle(k_cache, pages)
    B, N = pages.shape
    assert lo.shape == hi.shape == (B, N, *k_cache.shape[2:]) and lo.dtype == k_cache.dtype, name
    # a min and a max of values of the cache dtype are exact
    assert_close("k_min", lo, want_lo, 0.0, 0.0, name)
    assert_close("k_max", hi, want_hi, 0.0, 0.0, name)


summarize_shapes = st.tuples(
    st.integers(1, 3),                        # B
    st.integers(1, 6),                        # N
    st.sampled_from([8, 16, 32]),             # S
    st.sampled_from([1, 2, 3]),               # Hkv (3: F not a power of two)
    st.sampled_from([16, 64, 128]),           # D
    st.sampled_from(DTYPES),
    st.integers(0, 2**31 - 1),
)


@given(shape=summarize_shapes, blocks=st.sampled_from([(None, None), (4, 64), (1, 128), (8, 32)]))
def test_summarize_kernel_matches_oracle(kernel_device, poison, shape, blocks):
    B, N, S, Hkv, D, dtype, seed = shape
    P = B * N + 2
    k_cache = make_pool(P, S, Hkv, D, dtype, kernel_device, seed)
    pages = make_pages(B, N, P, seed).to(kernel_device)
    lo, hi = far_page_summarize_fwd(k_cache, pages, block_t=blocks[0], block_f=blocks[1])
    check_bounds(lo, hi, k_cache, pages, f"{shape} blocks {blocks}")


@given(shape=summarize_shapes)
def test_summarize_reference_matches_oracle(shape):
    B, N, S, Hkv, D, dtype, seed = shape
    P = B * N + 2
    k_cache = make_pool(P, S, Hkv, D, dtype, "cpu", seed)
    pages = make_pages(B, N, P, seed)
    check_bounds(*far_page_summarize_ref(k_cache, pages), k_cache, pages, str(shape))


@given(shape=summarize_shapes, R=st.integers(1, 9), blocks=st.sampled_from([(None, None), (1, 128)]))
def test_summarize_into_rows_matches_oracle(kernel_device, shape, R, blocks):
    """Bounds land at their rows (int32 or int64, distinct, some outside ``[0, R)``: nothing
    stored), every other row keeps its value, through the kernel and the reference alike."""
    B, N, S, Hkv, D, dtype, seed = shape
    P = 5
    k_cache = make_pool(P, S, Hkv, D, dtype, kernel_device, seed)
    pages = make_pages(B, N, P, seed).to(kernel_device)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.full((B, N), R + 7)                      # past the table: stores nothing
    take = min(N, R + 2)
    for b in range(B):                                    # distinct rows in [-1, R]
        rows[b, :take] = (torch.randperm(R + 2, generator=gen) - 1)[:take]
    rows = rows.to(torch.int32 if seed % 2 else torch.int64).to(kernel_device)
    fill = torch.randn(B, R, Hkv, D, generator=gen).to(dtype).to(kernel_device)
    want_lo, want_hi = far_page_summarize_oracle(k_cache, pages)
    for impl in ("kernel", "ref"):
        lo, hi = fill.clone(), fill + 1
        if impl == "kernel":
            far_page_summarize_into_fwd(k_cache, pages, rows, lo, hi, block_t=blocks[0],
                                        block_f=blocks[1])
        else:
            lo, hi = lo.cpu(), hi.cpu()
            far_page_summarize_into_ref(k_cache.cpu(), pages.cpu(), rows.cpu(), lo, hi)
        exp_lo, exp_hi = fill.cpu().double(), (fill + 1).cpu().double()
        for b in range(B):
            for n in range(N):
                r = int(rows[b, n])
                if 0 <= r < R:
                    exp_lo[b, r], exp_hi[b, r] = want_lo[b, n], want_hi[b, n]
        assert_close("k_min", lo, exp_lo, 0.0, 0.0, f"{impl} {shape}")
        assert_close("k_max", hi, exp_hi, 0.0, 0.0, f"{impl} {shape}")


def test_summarize_into_op_validates_and_checks():
    k = make_pool(6, 8, 2, 32, torch.float32, "cpu", 0)
    pages = torch.tensor([[0, -1, 5]], dtype=torch.int32)
    lo, hi = torch.zeros(1, 4, 2, 32), torch.zeros(1, 4, 2, 32)
    torch.ops.kvops.far_page_summarize_into(k, pages, torch.tensor([[3, 0, 9]]), lo, hi)
    want_lo, _ = far_page_summarize_ref(k, pages)
    assert torch.equal(lo[0, 3], want_lo[0, 0]) and torch.equal(lo[0, 0], want_lo[0, 1])
    assert not lo[0, 1:3].any()
    with kvops.validate(True), pytest.raises(IndexError, match="rows"):
        torch.ops.kvops.far_page_summarize_into(k, pages, torch.tensor([[3, 0, 9]]), lo, hi)
    with pytest.raises(ValueError, match="rows: expected shape"):
        torch.ops.kvops.far_page_summarize_into(k, pages, torch.tensor([[3, 0]]), lo, hi)
    with pytest.raises(TypeError, match="k_max: expected dtype"):
        torch.ops.kvops.far_page_summarize_into(k, pages, torch.tensor([[3, 0, 1]]), lo,
                                                hi.double())
    with pytest.raises(ValueError, match="k_min: expected shape"):
        torch.ops.kvops.far_page_summarize_into(k, pages, torch.tensor([[3, 0, 1]]),
                                                lo[:, :, :1], hi)
    torch.library.opcheck(torch.ops.kvops.far_page_summarize_into.default,
                          (k, pages, torch.tensor([[3, 0, 1]], dtype=torch.int32), lo, hi))


def test_compiled_summarize_into_layer_views_of_a_table():
    """Under torch.compile (aot_eager: functionalized mutation) the op writes its rows of one
    layer's view of a [layers, B, R, Hkv, D] table and leaves every other row alone."""
    torch._dynamo.reset()
    k = make_pool(6, 8, 2, 32, torch.float32, "cpu", 1)
    pages = torch.tensor([[0, 5], [-1, 2]], dtype=torch.int32)
    rows = torch.tensor([[3, 1], [4, 0]])
    lo, hi = torch.randn(2, 2, 5, 2, 32), torch.randn(2, 2, 5, 2, 32)
    want_lo, want_hi = lo.clone(), hi.clone()
    far_page_summarize_into_ref(k, pages, rows, want_lo[1], want_hi[1])

    @torch.compile(backend="aot_eager", fullgraph=True)
    def absorb(layer_lo, layer_hi):
        torch.ops.kvops.far_page_summarize_into(k, pages, rows, layer_lo, layer_hi)

    absorb(lo[1], hi[1])
    assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi)


def test_summarize_strided_pool_and_table(kernel_device):
    """One layer of a [P, layers, 2, S, Hkv, D] pool and a strided page table."""
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(7, 2, 2, 8, 2, 32, generator=gen).to(kernel_device)
    k_cache = pool[:, 1, 0]
    pages = torch.randint(0, 7, (2, 10), generator=gen, dtype=torch.int32).to(kernel_device)[:, ::2]
    assert not k_cache.is_contiguous() and not pages.is_contiguous()
    check_bounds(*far_page_summarize_fwd(k_cache, pages), k_cache, pages, "strided")


def make_select_case(B, N, Hkv, G, D, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    lo = torch.randn(B, N, Hkv, D, generator=gen)
    hi = lo + torch.rand(B, N, Hkv, D, generator=gen)
    q = torch.randn(B, Hkv * G, D, generator=gen)
    num_far = torch.randint(-1, N + 2, (B,), generator=gen, dtype=torch.int32)
    cast = lambda t: t.to(dtype).to(device)
    return cast(q), cast(lo), cast(hi), num_far.to(device)


def score_tol(dtype, D, Hq=1):
    # products of two values of the input dtype are exact in float32; only the float32 sums of
    # D of them a head, and of the Hq heads' bounds, round (the oracle sums in float64)
    return Hq * (1e-5 * D if dtype != torch.float32 else 2e-6 * D)


def check_selection(idx, val, q, lo, hi, num_far, top_k, name, tol):
    """The op's rule against the float64 oracle, ties allowed within ``tol``: the first
    ``ceil(top_k / 2)`` entries are a top set by best bound, the rest a top set by summed bound
    among the other candidates, each part in decreasing order; ``-1`` past the candidates."""
    want = page_scores_oracle(q, lo, hi, num_far)                    # [2, B, N] float64
    B, N = want.shape[1:]
    assert idx.shape == val.shape == (B, top_k) and idx.dtype == torch.int32, name
    for b in range(B):
        nf = min(max(int(num_far[b]), 0), N)
        got = idx[b].tolist()
        n = min(top_k, nf)
        assert all(j == -1 for j in got[n:]), f"{name} row {b}: {got} past {n} candidates"
        assert torch.isneginf(val[b, n:]).all(), name
        chosen = got[:n]
        assert len(set(chosen)) == n and all(0 <= j < nf for j in chosen), f"{name} row {b}: {got}"
        h = min((top_k + 1) // 2, n)
        for rule, part, pool in ((0, chosen[:h], range(nf)),
                                 (1, chosen[h:], [j for j in range(nf) if j not in chosen[:h]])):
            if not part:
                continue
            ranked = sorted((want[rule, b, j].item() for j in pool), reverse=True)
            kth = ranked[len(part) - 1]
            assert min(want[rule, b, j].item() for j in part) >= kth - tol, f"{name} row {b}"
            got_val = val[b, chosen.index(part[0]):chosen.index(part[0]) + len(part)].cpu()
            assert_close("score", got_val, want[rule, b, part], tol, 1e-5, name)
            assert (got_val[1:] <= got_val[:-1] + tol).all(), f"{name} row {b}: order"


select_shapes = st.tuples(
    st.integers(1, 3),                        # B
    st.integers(1, 70),                       # N (past one 64-page block)
    st.sampled_from([1, 2, 3]),               # Hkv
    st.sampled_from([1, 3, 4]),               # G
    st.sampled_from([16, 64, 128]),           # D
    st.sampled_from(DTYPES),
    st.integers(0, 2**31 - 1),
)


@given(shape=select_shapes, k=st.integers(1, 8), block_n=st.sampled_from([None, 16]))
def test_select_kernel_matches_oracle(kernel_device, poison, shape, k, block_n):
    B, N, Hkv, G, D, dtype, seed = shape
    q, lo, hi, num_far = make_select_case(B, N, Hkv, G, D, dtype, kernel_device, seed)
    score = far_page_scores_fwd(q, lo, hi, num_far, block_n=block_n)
    want = page_scores_oracle(q, lo, hi, num_far)
    assert_close("score", score, want, score_tol(dtype, D, Hkv * G), 1e-5, str(shape))
    top_k = min(k, N)
    with kvops.backend("triton"):
        idx, val = torch.ops.kvops.far_page_select(q, lo, hi, num_far, top_k)
    check_selection(idx.cpu(), val.cpu(), q, lo, hi, num_far.cpu(), top_k, str(shape),
                    score_tol(dtype, D, Hkv * G))


@given(shape=select_shapes, k=st.integers(1, 8))
def test_select_reference_matches_oracle(shape, k):
    B, N, Hkv, G, D, dtype, seed = shape
    q, lo, hi, num_far = make_select_case(B, N, Hkv, G, D, dtype, "cpu", seed)
    top_k = min(k, N)
    idx, val = far_page_select_ref(q, lo, hi, num_far, top_k)
    check_selection(idx, val, q, lo, hi, num_far, top_k, str(shape), score_tol(dtype, D, Hkv * G))


def _distinct_scores(B, N, num_far, seed):
    """Scores [2, B, N] with no tie in a row (a permutation scaled, either sign), -inf past
    num_far, as the scoring kernel writes them."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.stack([torch.stack([torch.randperm(N, generator=gen) for _ in range(B)])
                     for _ in range(2)]).float().sub(N / 3).mul(0.37)
    cand = torch.arange(N)[None, :] < num_far[:, None]
    return torch.where(cand, s, float("-inf"))


@given(B=st.integers(1, 3), N=st.sampled_from([1, 2, 5, 64, 100, 1025]),
       k=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_choice_kernel_matches_the_oracle(kernel_device, B, N, k, seed):
    """The choice kernel alone: exactly the oracle's pages in order (scores without ties), their
    scores, -1 and -inf past the candidates; rows of 1025 pages take the 8-warp block."""
    top_k = min(k, N)
    gen = torch.Generator().manual_seed(seed)
    num_far = torch.randint(0, N + 1, (B,), generator=gen)
    num_far[0] = N
    scores = _distinct_scores(B, N, num_far, seed)
    idx, val = far_page_top_fwd(scores.to(kernel_device), top_k)
    want = select_oracle(scores, num_far, top_k)
    for b in range(B):
        row = want[b] + [-1] * (top_k - len(want[b]))
        assert idx[b].tolist() == row, (b, idx[b].tolist(), row)
        half = (top_k + 1) // 2
        ref = [float(scores[0 if i < half else 1, b, j]) if j >= 0 else float("-inf")
               for i, j in enumerate(row)]
        assert val[b].tolist() == ref
    r_idx, r_val = _top(scores, top_k)
    assert torch.equal(idx.cpu(), r_idx) and torch.equal(val.cpu(), r_val)


@pytest.mark.parametrize("N,top_k", [(600, 300), (600, 201), (300, 300), (130, 129)])
def test_choice_kernel_long_halves(kernel_device, N, top_k):
    """Halves longer than one ranking tile (64 entries): the rank counts run over several tiles
    of the packed half; every entry as the torch choice gives it."""
    B = 2
    num_far = torch.tensor([N, N - 37])
    scores = _distinct_scores(B, N, num_far, N + top_k)
    idx, val = far_page_top_fwd(scores.to(kernel_device), top_k)
    r_idx, r_val = _top(scores, top_k)
    assert torch.equal(idx.cpu(), r_idx) and torch.equal(val.cpu(), r_val)


def test_choice_of_rows_past_the_kernel_cap_takes_torch_topk(kernel_device, monkeypatch):
    """Rows longer than ``CHOICE_MAX_PAGES`` choose by two ``torch.topk`` (the kernel holds a
    row in one block): the same pages."""
    import kvops.kernels.far_page_select as fps

    op_module = sys.modules["kvops.ops.far_page_select"]
    q, lo, hi, num_far = make_select_case(2, 40, 2, 2, 32, torch.float32, kernel_device, 3)
    with kvops.backend("triton"):
        want = torch.ops.kvops.far_page_select(q, lo, hi, num_far, 5)

    def refuse(*args, **kwargs):
        raise AssertionError("the choice kernel ran past its cap")

    monkeypatch.setattr(fps, "CHOICE_MAX_PAGES", 39)
    monkeypatch.setattr(op_module, "far_page_select_fwd", refuse)
    with kvops.backend("triton"):
        got = torch.ops.kvops.far_page_select(q, lo, hi, num_far, 5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_choice_kernel_with_equal_scores(kernel_device):
    """Every page scores the same: distinct pages all the same, none repeated, none past N."""
    scores = torch.zeros(2, 2, 40)
    scores[:, 1, 30:] = float("-inf")
    idx, val = far_page_top_fwd(scores.to(kernel_device), 7)
    for b in range(2):
        got = idx[b].tolist()
        assert len(set(got)) == 7 and all(0 <= j < (40 if b == 0 else 30) for j in got), got
    assert (val == 0).all()


def test_select_bound_is_an_upper_bound_and_finds_the_planted_page(kernel_device):
    """Every key's logit is at most its page's score; a page holding the query direction
    outranks pages of noise."""
    gen = torch.Generator().manual_seed(3)
    P, S, Hkv, G, D = 12, 8, 2, 2, 32
    k_cache = torch.randn(P, S, Hkv, D, generator=gen)
    q = torch.randn(1, Hkv * G, D, generator=gen)
    k_cache[7, 3, 1] = 4 * q[0, 2]                       # head 2 is in KV head 1's group
    pages = torch.arange(P, dtype=torch.int32)[None]
    lo, hi = far_page_summarize_ref(k_cache, pages)
    dev = kernel_device
    score = far_page_scores_fwd(q.to(dev), lo.to(dev), hi.to(dev),
                                torch.tensor([P], dtype=torch.int32, device=dev)).cpu()
    logits = torch.einsum("hd,pshd->psh", q[0], k_cache.repeat_interleave(G, dim=2))
    assert (logits.amax(dim=(1, 2)) <= score[0, 0] + 1e-4).all()
    assert (logits.sum(dim=2).amax(dim=1) <= score[1, 0] + 1e-4).all()
    with kvops.backend("triton"):
        idx, _ = torch.ops.kvops.far_page_select(q.to(dev), lo.to(dev), hi.to(dev),
                                                 torch.tensor([P], dtype=torch.int32,
                                                              device=dev), 1)
    assert idx.tolist() == [[7]]


def _halves_case(device):
    """Page 0 is one head's (best bound 10, sum 0), pages 1 and 2 both heads' (sums 8 and 6),
    page 3 leans to one head (best 6, sum 1): the best bound alone would take 0 and 3, the sum
    alone 1 and 2; the op takes 0 (by best bound), then 1 (by sum)."""
    D = 16
    q = torch.zeros(1, 2, D)
    q[0, 0, 0] = q[0, 1, 1] = 1.0                       # head 0 reads channel 0, head 1 channel 1
    rows = [[10.0, -10.0], [4.0, 4.0], [3.0, 3.0], [6.0, -5.0]]
    lo = torch.zeros(1, 4, 1, D)
    lo[0, :, 0, :2] = torch.tensor(rows)
    nf = torch.tensor([4], dtype=torch.int32)
    return q.to(device), lo.to(device), nf.to(device)


def test_select_takes_half_by_the_best_head_and_half_by_all_heads():
    q, lo, nf = _halves_case("cpu")
    idx, val = torch.ops.kvops.far_page_select(q, lo, lo, nf, 2)
    assert idx.tolist() == [[0, 1]] and val.tolist() == [[10.0, 8.0]]


def test_select_kernel_takes_half_by_the_best_head_and_half_by_all_heads(kernel_device):
    q, lo, nf = _halves_case(kernel_device)
    with kvops.backend("triton"):
        idx, val = torch.ops.kvops.far_page_select(q, lo, lo, nf, 2)
    assert idx.tolist() == [[0, 1]] and val.tolist() == [[10.0, 8.0]]


def test_select_kernel_best_bound_when_every_bound_is_negative(kernel_device):
    """Every bound below zero, G 3 of a 16-row group tile: the padded rows of the tile must not
    lift the best bound to 0 (nor add to the sum)."""
    q, lo, hi, num_far = make_select_case(2, 20, 2, 3, 32, torch.float32, "cpu", seed=9)
    q = q.abs()                                     # q >= 0 against keys <= -1: all bounds < 0
    hi = -1.0 - torch.rand_like(hi)
    lo = hi - 1.0
    num_far = torch.tensor([20, 7], dtype=torch.int32)
    dev = kernel_device
    score = far_page_scores_fwd(q.to(dev), lo.to(dev), hi.to(dev), num_far.to(dev)).cpu()
    want = page_scores_oracle(q, lo, hi, num_far)
    assert (want[:, 0, :7] < 0).all()
    assert_close("score", score, want, 1e-4, 1e-5, "negative bounds")


def test_select_expanded_table(kernel_device):
    """One summary table shared by many query rows (stride 0 over B), as the evaluation uses."""
    q, lo, hi, _ = make_select_case(1, 20, 2, 2, 32, torch.float32, kernel_device, seed=4)
    qs = torch.randn(5, 4, 32).to(kernel_device)
    nf = torch.tensor([20, 3, 0, 11, 20], dtype=torch.int32, device=kernel_device)
    score = far_page_scores_fwd(qs, lo.expand(5, -1, -1, -1), hi.expand(5, -1, -1, -1), nf)
    want = page_scores_oracle(qs, lo.expand(5, -1, -1, -1), hi.expand(5, -1, -1, -1), nf)
    assert_close("score", score, want, 1e-4, 1e-5, "expanded")
    # the reference contracts against the one table, not its five expanded copies
    ref = page_scores_ref(qs.cpu(), lo.cpu().expand(5, -1, -1, -1), hi.cpu().expand(5, -1, -1, -1),
                          nf.cpu())
    assert_close("score", ref, want, 1e-4, 1e-5, "expanded reference")


def test_opcheck():
    k_cache = make_pool(6, 8, 2, 32, torch.float32, "cpu", 5)
    pages = make_pages(2, 3, 6, 5)
    torch.library.opcheck(torch.ops.kvops.far_page_summarize.default, (k_cache, pages))
    q, lo, hi, nf = make_select_case(2, 9, 2, 2, 32, torch.float32, "cpu", 6)
    # distinct scores, so the order is defined
    torch.library.opcheck(torch.ops.kvops.far_page_select.default, (q, lo, hi, nf, 4))


def test_compiled_retrieval_step_never_recompiles():
    """Summarize, select, gather and attend with tables changing every step: one compile (the
    Triton kernels on a GPU; the interpreter or the references on CPU)."""
    torch._dynamo.reset()
    backend, calls = counting_backend()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B, N, K, S, Hkv, G, D, W = 2, 6, 2, 8, 2, 2, 32, 16
    P = B * N
    k_cache, v_cache = (make_pool(P, S, Hkv, D, torch.float32, dev, s) for s in (7, 8))
    win = torch.randn(2, B, W, Hkv, D).to(dev)
    ws = torch.zeros(B, dtype=torch.int32, device=dev)
    wl = torch.full((B,), W, dtype=torch.int32, device=dev)

    def step(q, pages, num_far):
        lo, hi = torch.ops.kvops.far_page_summarize(k_cache, pages)
        idx, _ = torch.ops.kvops.far_page_select(q, lo, hi, num_far, K)
        page = pages.gather(1, idx.clamp(min=0).long())
        live = (idx >= 0) & (page >= 0)
        rows = torch.where(live, page, 0).flatten()
        fk = k_cache.index_select(0, rows).view(B, K * S, Hkv, D)
        fv = v_cache.index_select(0, rows).view(B, K * S, Hkv, D)
        fb = torch.where(live, 0.0, float("-inf")).repeat_interleave(S, dim=1)
        return torch.ops.kvops.static_sliding_attention(q, win[0], win[1], ws, wl, fk, fv, fb)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(9)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(6):
            q = torch.randn(B, Hkv * G, D, generator=gen).to(dev)
            pages = torch.randperm(P, generator=gen)[: B * N].view(B, N).to(torch.int32).to(dev)
            num_far = torch.tensor([t % (N + 1), N], dtype=torch.int32, device=dev)
            out, lse = compiled(q, pages, num_far)
            want, want_lse = step(q, pages, num_far)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1


@requires_cuda
def test_cuda_graph_replay_with_new_inputs():
    """One capture of summarize + select; new pools, pages, queries and counts replay right."""
    B, N, S, Hkv, G, D, K = 4, 96, 16, 8, 4, 128, 8
    P = B * N
    static = dict(k=make_pool(P, S, Hkv, D, torch.float16, "cuda", 0),
                  pages=make_pages(B, N, P, 0).cuda(),
                  q=torch.randn(B, Hkv * G, D, device="cuda", dtype=torch.float16),
                  nf=torch.full((B,), N, dtype=torch.int32, device="cuda"))

    def fn():
        lo, hi = torch.ops.kvops.far_page_summarize(static["k"], static["pages"])
        return (lo, hi, *torch.ops.kvops.far_page_select(static["q"], lo, hi, static["nf"], K))

    graph, (lo, hi, idx, val) = capture_graph(fn)
    for seed in range(1, 4):
        static["k"].copy_(make_pool(P, S, Hkv, D, torch.float16, "cuda", seed))
        static["pages"].copy_(make_pages(B, N, P, seed).cuda())
        static["q"].normal_()
        static["nf"].copy_(torch.tensor([N, 5, 0, 70], dtype=torch.int32))
        graph.replay()
        check_bounds(lo, hi, static["k"], static["pages"], f"graph-{seed}")
        check_selection(idx.cpu(), val.cpu(), static["q"], lo, hi, static["nf"].cpu(), K,
                        f"graph-{seed}", score_tol(torch.float16, D, Hkv * G))


def _bad_inputs():
    k = make_pool(6, 8, 2, 32, torch.float16, "cpu", 0)
    pages = make_pages(2, 3, 6, 0)
    yield "sum-k-rank", torch.ops.kvops.far_page_summarize, (k[0], pages), ValueError, \
        "k_cache: expected rank 4"
    yield "sum-k-dtype", torch.ops.kvops.far_page_summarize, (k.double(), pages), TypeError, \
        "k_cache: expected dtype"
    yield "sum-page-size", torch.ops.kvops.far_page_summarize, (k[:, :6], pages), ValueError, \
        "S=6"
    yield "sum-heads-strided", torch.ops.kvops.far_page_summarize, \
        (k.transpose(2, 3).contiguous().transpose(2, 3), pages), ValueError, "each page's"
    yield "sum-pages-dtype", torch.ops.kvops.far_page_summarize, (k, pages.long()), TypeError, \
        "pages: expected dtype"
    yield "sum-pages-rank", torch.ops.kvops.far_page_summarize, (k, pages[0]), ValueError, \
        "pages: expected rank 2"
    q, lo, hi, nf = make_select_case(2, 5, 2, 2, 32, torch.float16, "cpu", 0)
    sel = torch.ops.kvops.far_page_select
    yield "sel-q-rank", sel, (q[0], lo, hi, nf, 2), ValueError, "q: expected rank 3"
    yield "sel-dtype", sel, (q, lo.float(), hi, nf, 2), TypeError, "k_min: expected dtype"
    yield "sel-shape", sel, (q, lo, hi[:, :4], nf, 2), ValueError, "k_max: expected shape"
    yield "sel-heads", sel, (q[:, :3], lo, hi, nf, 2), ValueError, "Hq=3"
    yield "sel-num-far", sel, (q, lo, hi, nf.long(), 2), TypeError, "num_far: expected dtype"
    yield "sel-num-far-shape", sel, (q, lo, hi, nf[:1], 2), ValueError, "num_far: expected shape"
    yield "sel-top-k", sel, (q, lo, hi, nf, 6), ValueError, "top_k: expected an int in"
    yield "sel-top-k-0", sel, (q, lo, hi, nf, 0), ValueError, "top_k"
    yield "sel-last-dim", sel, (q, lo.transpose(1, 3).contiguous().transpose(1, 3), hi, nf, 2), \
        ValueError, "last dim"


@pytest.mark.parametrize("name,op,args,exc,msg", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise(name, op, args, exc, msg):
    with pytest.raises(exc, match=msg):
        op(*args)


def test_validation_mode_raises_on_out_of_range_pages():
    k = make_pool(6, 8, 2, 32, torch.float32, "cpu", 0)
    ok = torch.tensor([[0, -1, 5]], dtype=torch.int32)
    with kvops.validate(True):
        torch.ops.kvops.far_page_summarize(k, ok)
        with pytest.raises(IndexError, match="pages"):
            torch.ops.kvops.far_page_summarize(k, torch.tensor([[0, 6]], dtype=torch.int32))
    lo, hi = torch.ops.kvops.far_page_summarize(k, torch.tensor([[0, 6, -2]], dtype=torch.int32))
    assert not lo[0, 1:].any() and not hi[0, 1:].any()
