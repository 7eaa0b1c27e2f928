"""What every op shares: its own documentation in ``help()``, one page layout (page-contiguous
``[S, Hkv, D]`` rows with any page stride, so an interleaved ``[P, 2, S, Hkv, D]`` pool works
everywhere) refused with one message otherwise, and the compiled-kernel launch path that
replaces the JIT's per-call dispatch after a shape's first call."""

from __future__ import annotations

import pydoc

import pytest
import torch
import triton

import kvops
from kvops.kernels import _launch
from kvops.layouts import codecs
from tests.conftest import requires_cuda

OPS = ["static_sliding_attention", "elastic_attention", "paged_gather_merged",
       "far_view_summarize", "pack_base_pairs", "refine_base_pairs", "paged_kv_write",
       "paged_prefill_attention", "far_page_summarize", "far_page_select", "far_slot_update",
       "far_view_rank", "far_view_observe"]
PAGES_MSG = r"expected contiguous pages \[S, Hkv, D\] \(any page stride\)"


@pytest.mark.parametrize("name", OPS)
def test_help_shows_the_ops_own_documentation(name):
    fn = getattr(kvops, name)
    text = pydoc.render_doc(fn)
    assert f"torch.ops.kvops.{name}" in text and "CustomOpDef" not in text
    assert len(fn.__doc__.splitlines()) > 5
    assert callable(getattr(torch.ops.kvops, name).default)


def _pool(P, S, Hkv, D, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(P, 2, S, Hkv, D, generator=g).to(dtype).to(device)


def _calls(k, v, device):
    """name -> a function of (k_cache, v_cache) returning the op's outputs (clones)."""
    P, S, Hkv, D = k.shape
    B, L = 2, 3
    q = torch.randn(B, Hkv * 2, D, generator=torch.Generator().manual_seed(1)).to(k.dtype)
    q = q.to(device)
    table = torch.arange(B * L, dtype=torch.int32, device=device).view(B, L)
    seq = torch.tensor([L * S - 3, S + 1], dtype=torch.int32, device=device)
    span = torch.tensor([[0, 2], [1, 2]], dtype=torch.int32, device=device)
    trains = torch.tensor([[1, 0, 2], [5, 2, 1]], dtype=torch.int32, device=device)
    num = torch.tensor([2], dtype=torch.int32, device=device)
    chunks = torch.tensor([[[0, 1]], [[-1, 2]]], dtype=torch.int32, device=device)
    pairs = torch.tensor([[0, 1, 0], [3, 4, 2]], dtype=torch.int32, device=device)

    def gather(kc, vc):
        ko, vo = torch.zeros(4, S, Hkv, D, dtype=k.dtype, device=device), \
            torch.zeros(4, S, Hkv, D, dtype=k.dtype, device=device)
        torch.ops.kvops.paged_gather_merged(kc, vc, trains, num, ko, vo)
        return ko, vo

    def pack_refine(kc, vc):
        codec = codecs.default_codec(k.dtype)
        back = torch.empty(2, 2, S, Hkv, D, dtype=codecs.backing_dtype(codec, k.dtype),
                           device=device)
        kc = kc.clone() if kc.is_contiguous() else kc
        before = kc.clone()
        torch.ops.kvops.pack_base_pairs(kc, pairs, back)
        packed = kc.clone()
        torch.ops.kvops.refine_base_pairs(kc, torch.tensor([[0, 1, 0], [3, 4, 2]],
                                                            dtype=torch.int32, device=device),
                                          back)
        return packed, kc, before

    def write(kc, vc):
        kc, vc = kc.clone() if kc.is_contiguous() else kc, vc.clone() if vc.is_contiguous() else vc
        new = torch.ones(3, Hkv, D, dtype=k.dtype, device=device)
        slots = torch.tensor([0, S + 3, -1], dtype=torch.int32, device=device)
        torch.ops.kvops.paged_kv_write(new, -new, kc, vc, slots)
        return kc, vc

    def slot_update(kc, vc):
        K = 2
        new = torch.tensor([[0, 2], [1, -1]], dtype=torch.int32, device=device)
        index = torch.tensor([[2, -1], [-1, -1]], dtype=torch.int32, device=device)
        far_k = torch.zeros(B, K * S, Hkv, D, dtype=k.dtype, device=device)
        far_v, bias = torch.zeros_like(far_k), torch.zeros(B, K * S, device=device)
        torch.ops.kvops.far_slot_update(new, table, kc, vc, index, far_k, far_v, bias)
        return index, far_k, far_v, bias

    qs = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    qp = q[:, :, :].reshape(B * Hkv * 2, D)[:3].reshape(3, 1, D).expand(3, Hkv * 2, D)
    qp = qp.contiguous()
    return {
        "paged_kv_write": write,
        "paged_prefill_attention": lambda kc, vc: torch.ops.kvops.paged_prefill_attention(
            qp, kc, vc, table, qs, seq),
        "elastic_attention": lambda kc, vc: torch.ops.kvops.elastic_attention(q, kc, vc, table,
                                                                              seq),
        "elastic_attention (structured)": lambda kc, vc: torch.ops.kvops.elastic_attention(
            q, kc, vc, table, seq, base_span=span),
        "paged_gather_merged": gather,
        "far_slot_update": slot_update,
        "far_view_summarize": lambda kc, vc: torch.ops.kvops.far_view_summarize(kc, vc, chunks),
        "pack_base_pairs / refine_base_pairs": pack_refine,
    }


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_interleaved_pool_works_in_every_op(kernel_device, backend):
    device = "cpu" if backend == "torch" else kernel_device
    kv = _pool(8, 8, 2, 32, torch.float16, device, seed=2)
    with kvops.backend(backend):
        for name, call in _calls(kv[:, 0], kv[:, 1], device).items():
            kv_copy = kv.clone()
            got = call(kv_copy[:, 0], kv_copy[:, 1])
            want = call(kv[:, 0].contiguous(), kv[:, 1].contiguous())
            for g, w in zip(got, want):     # random bytes read as BASE may decode to NaN
                torch.testing.assert_close(g, w, atol=0, rtol=0, equal_nan=True, msg=name)


def test_every_pool_op_refuses_other_layouts_with_one_message():
    wide = torch.zeros(8, 8, 2, 64, dtype=torch.float16)[..., :32]     # rows not dense
    for name, call in _calls(wide, wide.clone(), "cpu").items():
        with pytest.raises(ValueError, match=PAGES_MSG):
            call(wide, wide)
        del name


@requires_cuda
def test_compiled_launch_path_matches_the_jit():
    """The second call of a shape launches the compiled kernel directly; its results equal the
    JIT path's bit for bit."""
    dev = torch.device("cuda")
    B, W, Hkv, G, D = 3, 300, 2, 4, 128
    q = torch.randn(B, Hkv * G, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, W, Hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ws = torch.randint(0, W, (B,), device=dev, dtype=torch.int32)
    wl = torch.randint(0, W + 1, (B,), device=dev, dtype=torch.int32)
    first = torch.ops.kvops.static_sliding_attention(q, k, v, ws, wl)
    n = len(_launch._BINS)
    assert n > 0 and _launch._STATE["direct"]
    q2 = torch.randn_like(q)
    fast = torch.ops.kvops.static_sliding_attention(q2, k, v, ws, wl)
    assert _launch._STATE["mode"] is not None         # the direct path ran
    if triton.__version__.startswith("3.6"):          # its launcher's C entry point is known
        assert _launch._STATE["mode"] == "c"
    saved = _launch._STATE["direct"]
    _launch._STATE["direct"] = False
    try:
        slow = torch.ops.kvops.static_sliding_attention(q2, k, v, ws, wl)
    finally:
        _launch._STATE["direct"] = saved
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    assert not torch.equal(first[0], fast[0])


def _query_layouts(q):
    """``q`` [B, H, D] as a contiguous tensor, a dense permuted one, a slice of wider rows and,
    for B 1, a contiguous one whose size-1 dim has an odd stride."""
    B, H, D = q.shape
    permuted = q.transpose(0, 1).contiguous().transpose(0, 1)
    wide = torch.zeros(B, H + 3, D, dtype=q.dtype, device=q.device)
    wide[:, 1:H + 1] = q
    odd = torch.empty(7 * H * D, dtype=q.dtype, device=q.device)[:H * D].as_strided(
        (1, H, D), (7 * H * D, D, 1))
    odd.copy_(q[:1])
    return [("contiguous", q), ("permuted", permuted), ("slice", wide[:, 1:H + 1]),
            ("size-1 odd stride", odd)]


def test_attention_outputs_are_contiguous_whatever_the_query_layout(kernel_device):
    """out [*, Hq, D] and lse [*, Hq] come back with a new tensor's strides and the same values
    for a contiguous query and for dense permuted, sliced and odd-strided ones (a query of
    standard strides gets its out allocated like it), through the kernels (the interpreter on
    the CPU; the prefill with the chunk's rows, the Gluon kernel on sm_90)."""
    device = kernel_device
    g = torch.Generator().manual_seed(5)
    P, S, Hkv, D, G = 8, 16, 2, 64, 2
    kc, vc = (torch.randn(P, S, Hkv, D, generator=g).half().to(device) for _ in range(2))
    table = torch.arange(6, dtype=torch.int32, device=device).view(2, 3)
    seq = torch.tensor([20, 9], dtype=torch.int32, device=device)
    k, v = kc[:6].view(2, 3 * S, Hkv, D), vc[:6].view(2, 3 * S, Hkv, D)
    ws = torch.zeros(2, dtype=torch.int32, device=device)

    def prefill(q, n, rows):   # q's n rows: sequence 0's last n tokens
        starts = torch.tensor([0, n], dtype=torch.int32, device=device)
        lens = torch.tensor([20], dtype=torch.int32, device=device)
        new = dict(k=k[0, 20 - n:20], v=v[0, 20 - n:20]) if rows else {}
        return torch.ops.kvops.paged_prefill_attention(q, kc, vc, table[:1], starts, lens, **new)

    calls = {
        "static_sliding_attention": lambda q, n: torch.ops.kvops.static_sliding_attention(
            q, k[:n], v[:n], ws[:n], seq[:n]),
        "elastic_attention": lambda q, n: torch.ops.kvops.elastic_attention(
            q, kc, vc, table[:n], seq[:n]),
        "paged_prefill_attention": lambda q, n: prefill(q, n, False),
        "paged_prefill_attention (rows)": lambda q, n: prefill(q, n, True),
    }
    q0 = torch.randn(2, Hkv * G, D, generator=g).half().to(device)
    with kvops.backend("triton"):
        for name, call in calls.items():
            for layout, q in _query_layouts(q0):
                n = q.shape[0]
                want = call(q0[:n].contiguous(), n)
                got = call(q, n)
                for w, t in zip(want, got):
                    assert t.shape == w.shape and t.stride() == w.stride() == torch.empty(
                        t.shape).stride(), (name, layout, t.stride())
                    torch.testing.assert_close(t, w, atol=0, rtol=0, msg=f"{name}, {layout}")
