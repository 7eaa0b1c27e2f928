"""far_view_summarize: kernel and reference against a float64 oracle, plus the op contract
(opcheck, compile without recompiles, CUDA graphs, input errors, validation mode)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvops
from kvops.kernels.far_view_summarize import far_view_summarize_fwd
from kvops.ops.far_view_summarize import far_view_summarize_ref
from kvops.ops.static_sliding_attention import static_sliding_attention_ref
from tests.conftest import capture_graph, counting_backend, requires_cuda
from tests.oracles_far_view import far_view_summarize_oracle
from tests.tolerances import assert_close

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# A mean is one float32 sum (error ~ sqrt(M*S) * 2^-24 relative) rounded once to the output
# dtype: half an ulp, 2^-11 (fp16) or 2^-8 (bf16) relative.
SUM_TOL = {
    torch.float32: (1e-6, 1e-5),
    torch.float16: (1e-5, 1e-3),
    torch.bfloat16: (1e-4, 8e-3),
}


def make_case(B, C, M, S, Hkv, D, dtype, device, seed, empty=0.25, spare=3):
    """A pool of unit-scale K/V with random page ids (repeats allowed, as when chunks share
    pages) and about ``empty`` of the chunks empty; an empty chunk's other entries are garbage,
    which the op must ignore."""
    gen = torch.Generator().manual_seed(seed)
    P = B * C * M + spare
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(device)
    k_cache, v_cache = rnd(P, S, Hkv, D), rnd(P, S, Hkv, D)
    table = torch.randint(0, P, (B, C, M), generator=gen, dtype=torch.int32)
    hole = torch.rand(B, C, generator=gen) < empty
    table[..., 0][hole] = -1
    if M > 1:
        table[..., 1][hole] = torch.randint(-5, 2 * P, (int(hole.sum()),), generator=gen,
                                            dtype=torch.int32)
    return dict(k_cache=k_cache, v_cache=v_cache, chunk_table=table.to(device))


def case_id(B, C, M, S, Hkv, D, dtype):
    return f"B{B}-C{C}-M{M}-S{S}-Hkv{Hkv}-D{D}-{str(dtype).replace('torch.', '')}"


def check_against_oracle(k_sum, v_sum, case, dtype, name):
    want_k, want_v = far_view_summarize_oracle(**case)
    atol, rtol = SUM_TOL[dtype]
    B, C, _ = case["chunk_table"].shape
    _, _, Hkv, D = case["k_cache"].shape
    for got, label in ((k_sum, "k_sum"), (v_sum, "v_sum")):
        assert got.dtype == dtype and got.shape == (B, C, Hkv, D), f"{name} {label}: {got.shape}"
    assert_close("k_sum", k_sum, want_k, atol, rtol, name)
    assert_close("v_sum", v_sum, want_v, atol, rtol, name)


shapes = st.tuples(
    st.integers(1, 3),                                 # B (odd sizes included)
    st.integers(1, 5),                                 # C
    st.sampled_from([1, 2, 3]),                        # M pages per chunk
    st.sampled_from([8, 16, 64]),                      # S
    st.sampled_from([1, 2, 3]),                        # Hkv (3: F = Hkv * D not a power of two)
    st.sampled_from([16, 64, 128, 256]),               # D
    st.sampled_from(DTYPES),
    st.integers(0, 2**31 - 1),                         # seed
)


@given(shape=shapes, blocks=st.sampled_from([(None, None), (4, 64), (1, 128), (64, 32)]))
def test_kernel_matches_oracle(kernel_device, poison, shape, blocks):
    *dims, seed = shape
    case = make_case(*dims, device=kernel_device, seed=seed)
    block_t, block_f = blocks
    k_sum, v_sum = far_view_summarize_fwd(**case, block_t=block_t, block_f=block_f)
    check_against_oracle(k_sum, v_sum, case, dims[-1], case_id(*dims) + f"-blocks{blocks}")


@given(shape=shapes)
def test_reference_matches_oracle(shape):
    *dims, seed = shape
    case = make_case(*dims, device="cpu", seed=seed)
    k_sum, v_sum = far_view_summarize_ref(**case)
    check_against_oracle(k_sum, v_sum, case, dims[-1], case_id(*dims))


def test_empty_slots_are_zero_and_bad_pages_add_nothing(kernel_device, poison):
    case = make_case(2, 4, 3, 16, 2, 64, torch.float32, kernel_device, seed=1, empty=0.0)
    table = case["chunk_table"]
    table[0, 1] = torch.tensor([-1, 0, 1], dtype=torch.int32)        # empty slot
    table[1, 2, 1] = case["k_cache"].shape[0]                         # past the pool: zeros
    table[1, 3, 2] = -7
    k_sum, v_sum = far_view_summarize_fwd(**case)
    assert torch.equal(k_sum[0, 1].cpu(), torch.zeros(2, 64))
    assert torch.equal(v_sum[0, 1].cpu(), torch.zeros(2, 64))
    check_against_oracle(k_sum, v_sum, case, torch.float32, "holes")
    # the divisor stays M * S: a chunk of one good page out of three is a third of that page
    P = case["k_cache"].shape[0]
    table[1, 0] = torch.tensor([5, P, P + 1], dtype=torch.int32)
    k_sum, _ = far_view_summarize_fwd(**case)
    torch.testing.assert_close(k_sum[1, 0], case["k_cache"][5].mean(0) / 3, atol=1e-6, rtol=1e-5)


def test_strided_pool_and_table(kernel_device):
    """A layer's view of a [P, layers, S, Hkv, D] pool and a strided chunk table."""
    gen = torch.Generator().manual_seed(2)
    P, S, Hkv, D = 9, 8, 2, 32
    pool = torch.randn(P, 2, 2, S, Hkv, D, generator=gen).to(kernel_device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    table = torch.randint(0, P, (3, 4, 2 * 2), generator=gen, dtype=torch.int32)
    case = dict(k_cache=k_cache, v_cache=v_cache, chunk_table=table.to(kernel_device)[..., ::2])
    assert not k_cache.is_contiguous() and not case["chunk_table"].is_contiguous()
    k_sum, v_sum = far_view_summarize_fwd(**case)
    check_against_oracle(k_sum, v_sum, case, torch.float32, "strided")


def test_op_dispatches_to_kernel_under_triton_backend(kernel_device):
    case = make_case(3, 2, 2, 8, 1, 64, torch.float16, kernel_device, seed=3)
    with kvops.backend("triton"):
        k_sum, v_sum = torch.ops.kvops.far_view_summarize(**case)
    check_against_oracle(k_sum, v_sum, case, torch.float16, "op-triton")


def test_opcheck():
    for dtype in (torch.float32, torch.bfloat16):
        case = make_case(2, 3, 2, 8, 2, 32, dtype, "cpu", seed=4)
        torch.library.opcheck(torch.ops.kvops.far_view_summarize.default, (), case)


def test_compiled_far_view_step_never_recompiles():
    """Summaries feeding the decode kernel, the chunk table changing every step: one compile."""
    torch._dynamo.reset()
    backend, calls = counting_backend()
    B, C, M, S, Hkv, G, D, W = 2, 3, 2, 8, 2, 2, 32, 24
    case = make_case(B, C, M, S, Hkv, D, torch.float32, "cpu", seed=5)
    k_cache, v_cache = case["k_cache"], case["v_cache"]
    win = torch.randn(2, B, W, Hkv, D)
    win_start = torch.zeros(B, dtype=torch.int32)
    win_len = torch.full((B,), W, dtype=torch.int32)

    @torch.compile(backend=backend, fullgraph=True)
    def step(q, table, far_bias):
        far_k, far_v = torch.ops.kvops.far_view_summarize(k_cache, v_cache, table)
        return torch.ops.kvops.static_sliding_attention(q, win[0], win[1], win_start, win_len,
                                                        far_k, far_v, far_bias)

    P = k_cache.shape[0]
    gen = torch.Generator().manual_seed(6)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(12):
            q = torch.randn(B, Hkv * G, D, generator=gen)
            table = torch.randint(0, P, (B, C, M), generator=gen, dtype=torch.int32)
            table[t % B, t % C, 0] = -1
            far_bias = torch.where(table[..., 0] >= 0, float(M * S), 1.0).log()
            far_bias[table[..., 0] < 0] = float("-inf")
            out, lse = step(q, table, far_bias)
            far_k, far_v = far_view_summarize_ref(k_cache, v_cache, table)
            want, want_lse = static_sliding_attention_ref(q, win[0], win[1], win_start, win_len,
                                                          far_k, far_v, far_bias)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1


@requires_cuda
def test_cuda_graph_replay_with_new_tables():
    """One capture; new chunk tables and new cache contents replay correctly."""
    B, C, M, S, Hkv, D = 3, 16, 8, 16, 8, 128
    case = make_case(B, C, M, S, Hkv, D, torch.float16, "cuda", seed=7)
    static = {n: t.clone() for n, t in case.items()}
    graph, (k_sum, v_sum) = capture_graph(lambda: torch.ops.kvops.far_view_summarize(**static))
    for seed in range(8, 11):
        fresh = make_case(B, C, M, S, Hkv, D, torch.float16, "cuda", seed=seed)
        for n, t in fresh.items():
            static[n].copy_(t)
        graph.replay()
        check_against_oracle(k_sum, v_sum, fresh, torch.float16, f"graph-seed{seed}")


@requires_cuda
def test_large_pool_offsets_do_not_overflow():
    """A pool of more than 2**31 elements: page offsets must be 64-bit."""
    S, Hkv, D = 16, 8, 128
    P = 2**31 // (S * Hkv * D) + 64                     # 4.3 GB per cache in fp16
    k_cache = torch.empty(P, S, Hkv, D, device="cuda", dtype=torch.float16)
    v_cache = torch.empty_like(k_cache)
    tail = slice(P - 8, P)
    k_cache[tail].normal_()
    v_cache[tail].normal_()
    table = torch.arange(P - 8, P, device="cuda", dtype=torch.int32).view(1, 2, 4)
    k_sum, v_sum = torch.ops.kvops.far_view_summarize(k_cache, v_cache, table)
    want_k = k_cache[tail].float().view(2, 4 * S, Hkv, D).mean(1)
    want_v = v_cache[tail].float().view(2, 4 * S, Hkv, D).mean(1)
    torch.testing.assert_close(k_sum[0].float(), want_k, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(v_sum[0].float(), want_v, atol=1e-3, rtol=1e-3)


def _bad_inputs():
    ok = make_case(2, 3, 2, 8, 2, 64, torch.float16, "cpu", seed=0)
    yield "k-rank", dict(ok, k_cache=ok["k_cache"][0]), ValueError, "k_cache: expected rank 4"
    yield "k-dtype", dict(ok, k_cache=ok["k_cache"].double(), v_cache=ok["v_cache"].double()), \
        TypeError, "k_cache: expected dtype"
    yield "v-dtype", dict(ok, v_cache=ok["v_cache"].float()), TypeError, "v_cache: expected dtype"
    yield "v-shape", dict(ok, v_cache=ok["v_cache"][:3]), ValueError, "v_cache: expected shape"
    yield "page-size", dict(ok, k_cache=ok["k_cache"][:, :6], v_cache=ok["v_cache"][:, :6]), \
        ValueError, "S=6"
    yield "head-dim", dict(ok, k_cache=ok["k_cache"][..., :40].contiguous(),
                           v_cache=ok["v_cache"][..., :40].contiguous()), ValueError, "D=40"
    yield "table-dtype", dict(ok, chunk_table=ok["chunk_table"].long()), TypeError, \
        "chunk_table: expected dtype"
    yield "table-rank", dict(ok, chunk_table=ok["chunk_table"][0]), ValueError, \
        "chunk_table: expected rank 3"
    yield "table-no-pages", dict(ok, chunk_table=ok["chunk_table"][..., :0]), ValueError, "M >= 1"
    yield "heads-strided", dict(ok, k_cache=ok["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)), \
        ValueError, r"k_cache: expected contiguous pages \[S, Hkv, D\]"
    yield "not-tensor", dict(ok, chunk_table=[[0]]), RuntimeError, "type 'Tensor' for argument"


@pytest.mark.parametrize("name,kwargs,exc,msg", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise(name, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        torch.ops.kvops.far_view_summarize(**kwargs)


def test_validation_mode_raises_on_out_of_range():
    case = make_case(2, 3, 2, 8, 2, 32, torch.float32, "cpu", seed=9, empty=0.0)
    P = case["k_cache"].shape[0]
    case["chunk_table"][1, 2, 1] = P
    k_sum, _ = torch.ops.kvops.far_view_summarize(**case)   # a zero page, no error by default
    assert torch.isfinite(k_sum).all()
    with kvops.validate(True), pytest.raises(
            IndexError, match=rf"chunk_table \(pages of a non-empty chunk\): values must lie in \[0, {P}\)"):
        torch.ops.kvops.far_view_summarize(**case)
    case["chunk_table"][1, 2, 1] = 0
    case["chunk_table"][0, 0, 0] = -2
    with kvops.validate(True), pytest.raises(IndexError, match=r"first page.*or -1, found -2"):
        torch.ops.kvops.far_view_summarize(**case)
    case["chunk_table"][0, 0] = torch.tensor([-1, P + 5], dtype=torch.int32)   # empty: ignored
    with kvops.validate(True):
        k_sum, _ = torch.ops.kvops.far_view_summarize(**case)
    assert torch.equal(k_sum[0, 0], torch.zeros_like(k_sum[0, 0]))
    assert kvops.validate() is False
