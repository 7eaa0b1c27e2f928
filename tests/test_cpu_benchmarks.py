"""CPU microbenchmarks of every op's PyTorch path and of the host-side planners (pytest-benchmark).

CI runs each once as a check (``--benchmark-disable`` is in the pytest options): every benchmark
also asserts what the op must compute against an independent expression, so none passes by
timing alone. For timings:

    python -m pytest tests/test_cpu_benchmarks.py --benchmark-enable --benchmark-columns=min,median,max

GPU numbers come from the scripts in ``bench/`` (CUDA-graph replays, TB/s against the ceilings).
Shapes: Llama-3-8B heads scaled down to CPU (Hq 8, Hkv 2, D 128), float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvops
from kvops.layouts import codecs, plan_trains

HQ, HKV, D = 8, 2, 128


@pytest.fixture(autouse=True)
def torch_backend():
    with kvops.backend("torch"):   # the PyTorch reference path, whatever the environment says
        yield


def test_static_sliding_attention(benchmark):
    """B 4, W 1024, full windows starting mid-ring: equals dense SDPA over the rotated window."""
    gen = torch.Generator().manual_seed(0)
    B, W = 4, 1024
    q = torch.randn(B, HQ, D, generator=gen)
    k = torch.randn(B, W, HKV, D, generator=gen)
    v = torch.randn(B, W, HKV, D, generator=gen)
    ws = torch.full((B,), 300, dtype=torch.int32)
    wl = torch.full((B,), W, dtype=torch.int32)
    out, lse = benchmark(torch.ops.kvops.static_sliding_attention, q, k, v, ws, wl)
    kr, vr = k.roll(-300, dims=1), v.roll(-300, dims=1)
    want = F.scaled_dot_product_attention(q[:, :, None], kr.transpose(1, 2), vr.transpose(1, 2),
                                          enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert lse.shape == (B, HQ)


def test_paged_gather_merged(benchmark):
    """256 pages of 16 tokens moved in 64-page trains: the arena equals an index_select."""
    gen = torch.Generator().manual_seed(1)
    P, Q, S = 512, 256, 16
    kc, vc = torch.randn(P, S, HKV, D, generator=gen), torch.randn(P, S, HKV, D, generator=gen)
    src = torch.randperm(P // 64, generator=gen)[:Q // 64] * 64
    trains = torch.stack([src, torch.arange(0, Q, 64), torch.full_like(src, 64)], 1).int()
    k_out, v_out = torch.zeros(Q, S, HKV, D), torch.zeros(Q, S, HKV, D)
    num = torch.tensor([trains.shape[0]], dtype=torch.int32)
    benchmark(torch.ops.kvops.paged_gather_merged, kc, vc, trains, num, k_out, v_out)
    pages = (src[:, None] + torch.arange(64)).reshape(-1)
    assert torch.equal(k_out, kc[pages]) and torch.equal(v_out, vc[pages])


def test_far_view_summarize(benchmark):
    """B 4, 16 chunks of 8 pages: each summary is the mean of its chunk's tokens."""
    gen = torch.Generator().manual_seed(2)
    P, S, B, C, M = 1024, 16, 4, 16, 8
    kc, vc = torch.randn(P, S, HKV, D, generator=gen), torch.randn(P, S, HKV, D, generator=gen)
    table = torch.randperm(P, generator=gen)[:B * C * M].reshape(B, C, M).int()
    k_sum, v_sum = benchmark(torch.ops.kvops.far_view_summarize, kc, vc, table)
    want = kc[table.long()].mean(dim=(2, 3))
    torch.testing.assert_close(k_sum, want, atol=1e-5, rtol=1e-5)
    assert v_sum.shape == (B, C, HKV, D)


def test_far_page_summarize(benchmark):
    """B 4, 256 pages each: per-channel key min and max of every page."""
    gen = torch.Generator().manual_seed(3)
    P, S, B, N = 1024, 16, 4, 256
    kc = torch.randn(P, S, HKV, D, generator=gen)
    pages = torch.randperm(P, generator=gen)[:B * N].reshape(B, N).int()
    lo, hi = benchmark(torch.ops.kvops.far_page_summarize, kc, pages)
    rows = kc[pages.long()]                                   # [B, N, S, Hkv, D]
    assert torch.equal(lo, rows.min(dim=2).values) and torch.equal(hi, rows.max(dim=2).values)


def test_far_page_select(benchmark):
    """B 4, 2048 far pages, top 64: 32 pages by best key bound over the heads, 32 by the
    bounds summed over the heads among the others."""
    gen = torch.Generator().manual_seed(4)
    B, N, K = 4, 2048, 64
    lo = torch.randn(B, N, HKV, D, generator=gen)
    hi = lo + torch.rand(B, N, HKV, D, generator=gen)
    q = torch.randn(B, HQ, D, generator=gen)
    num_far = torch.full((B,), N, dtype=torch.int32)
    idx, val = benchmark(torch.ops.kvops.far_page_select, q, lo, hi, num_far, K)
    qg = q.view(B, HKV, HQ // HKV, D)
    bound = (torch.einsum("bhgd,bnhd->bnhg", qg.clamp(min=0), hi)
             + torch.einsum("bhgd,bnhd->bnhg", qg.clamp(max=0), lo))
    best, total = bound.amax(dim=(2, 3)), bound.sum(dim=(2, 3))
    first = best.topk(K // 2, dim=1)
    rest = total.scatter(1, first.indices, float("-inf")).topk(K // 2, dim=1).values
    torch.testing.assert_close(val, torch.cat([first.values, rest], 1), atol=1e-4, rtol=1e-5)
    got = idx.long()
    torch.testing.assert_close(best.gather(1, got[:, :K // 2]), val[:, :K // 2], atol=1e-4,
                               rtol=1e-5)
    torch.testing.assert_close(total.gather(1, got[:, K // 2:]), val[:, K // 2:], atol=1e-4,
                               rtol=1e-5)


@pytest.mark.parametrize("dtype,codec", [(torch.float16, "hi8"), (torch.bfloat16, "e4m3")],
                         ids=["fp16-hi8", "bf16-e4m3"])
def test_pack_then_refine_base_pairs(benchmark, dtype, codec):
    """64 pairs packed in place and refined back: every TARGET page returns bit for bit."""
    gen = torch.Generator().manual_seed(3)
    P, S, N = 128, 16, 64
    orig = torch.randn(P, S, HKV, D, generator=gen).to(dtype)
    pairs = torch.stack([torch.arange(0, P, 2), torch.arange(1, P, 2), torch.arange(0, P, 2)],
                        1).int()
    backing = torch.empty((N, 2, S, HKV, D), dtype=codecs.backing_dtype(codec, dtype))

    def round_trip():
        cache = orig.clone()
        torch.ops.kvops.pack_base_pairs(cache, pairs, backing, codec)
        torch.ops.kvops.refine_base_pairs(cache, pairs, backing, codec)
        return cache

    cache = benchmark(round_trip)
    assert torch.equal(cache.view(torch.int16), orig.view(torch.int16))


def test_elastic_attention_native(benchmark):
    """B 4 x 1024 tokens in 16-token pages under a shuffled block table: equals the dense
    static kernel's reference over the same tokens."""
    gen = torch.Generator().manual_seed(4)
    B, S, L = 4, 16, 64
    P = B * L
    kc, vc = torch.randn(P, S, HKV, D, generator=gen), torch.randn(P, S, HKV, D, generator=gen)
    table = torch.randperm(P, generator=gen).reshape(B, L).int()
    q = torch.randn(B, HQ, D, generator=gen)
    seq = torch.full((B,), L * S, dtype=torch.int32)
    out, _ = benchmark(torch.ops.kvops.elastic_attention, q, kc, vc, table, seq)
    dense_k = kc[table.long()].reshape(B, L * S, HKV, D)
    dense_v = vc[table.long()].reshape(B, L * S, HKV, D)
    zero = torch.zeros(B, dtype=torch.int32)
    want, _ = torch.ops.kvops.static_sliding_attention(q, dense_k, dense_v, zero, seq)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_paged_kv_write(benchmark):
    """2,048 tokens into shuffled slots of a 4,096-page pool: every slot holds its token."""
    gen = torch.Generator().manual_seed(6)
    P, S, N = 4096, 16, 2048
    kc, vc = torch.zeros(P, S, HKV, D), torch.zeros(P, S, HKV, D)
    k, v = torch.randn(N, HKV, D, generator=gen), torch.randn(N, HKV, D, generator=gen)
    slots = torch.randperm(P * S, generator=gen)[:N]
    benchmark(torch.ops.kvops.paged_kv_write, k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, HKV, D)[slots], k) and torch.equal(vc.view(-1, HKV, D)[slots], v)


def test_paged_prefill_attention(benchmark):
    """A 256-token chunk over a 768-token prefix in shuffled pages: equals causal SDPA over
    the gathered 1,024 tokens' last 256 queries."""
    gen = torch.Generator().manual_seed(7)
    S, L, new = 16, 64, 256
    kc, vc = torch.randn(L, S, HKV, D, generator=gen), torch.randn(L, S, HKV, D, generator=gen)
    table = torch.randperm(L, generator=gen)[None].int()
    q = torch.randn(new, HQ, D, generator=gen)
    qs = torch.tensor([0, new], dtype=torch.int32)
    seq = torch.tensor([L * S], dtype=torch.int32)
    out, _ = benchmark(torch.ops.kvops.paged_prefill_attention, q, kc, vc, table, qs, seq)
    k = kc[table[0].long()].reshape(L * S, HKV, D).transpose(0, 1)
    v = vc[table[0].long()].reshape(L * S, HKV, D).transpose(0, 1)
    mask = torch.ones(L * S, L * S, dtype=torch.bool).tril()[-new:]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask,
                                          enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_plan_trains_10000_moves(benchmark):
    """10,000 page moves in runs of random length: the trains cover every move exactly once."""
    gen = torch.Generator().manual_seed(5)
    runs = torch.randint(1, 9, (2500,), generator=gen)
    starts = torch.randperm(100_000, generator=gen)[:runs.numel()] * 16
    src = torch.cat([s + torch.arange(int(n)) for s, n in zip(starts, runs)])[:10_000]
    dst = torch.arange(src.numel())
    trains, stats = benchmark(plan_trains, src, dst, 32768)
    pages = torch.cat([t[0] + torch.arange(int(t[2])) for t in trains.long()])
    assert torch.equal(pages, src)
    assert stats["bytes"] == 10_000 * 32768
