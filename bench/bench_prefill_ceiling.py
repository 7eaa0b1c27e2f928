"""GPU benchmark: what a Triton flash-attention forward reaches on this GPU and Triton, the
ceiling a paged prefill kernel written in Triton can aim at.

One causal prefill of ``N`` tokens from nothing (Llama-3-8B heads by default, bf16), timed for:

- ``tma``: K/V tiles loaded by the tensor copy engine through host tensor descriptors over
  contiguous ``[N, Hkv * D]`` K and V (one program a 128-row query tile and query head);
- ``tma-paged``: the same kernel reading K/V from a pool of ``S``-token pages through a block
  table, one descriptor load a page (so ``BLOCK_N == S``);
- ``ws``: either of those with the key loop warp-specialized (``tl.range(...,
  warp_specialize=True)``), where this Triton compiles it for the GPU;
- ``kvops``: ``paged_prefill_attention`` on pages of 16 and of 64 (the op's own rule);
- SDPA cuDNN and flash on the dense tensors.

TFLOP/s counts ``4 Hq D`` per visible (query, key) pair. Medians of CUDA-event timings of
back-to-back launches (each call is a millisecond or more, so host time does not show).

    python -m bench.bench_prefill_ceiling                 # 8k, Llama-3-8B heads
    python -m bench.bench_prefill_ceiling --n 4096 --heads 28,4,128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

import kvops  # noqa: F401 - registers torch.ops.kvops
from bench.common import table, write_result

LOG2E = 1.4426950408889634


@triton.jit
def _tile(q, k, v, acc, m_i, l_i, scale_log2, o_m, n, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASK:
        s = tl.where(o_m[:, None] >= (n + tl.arange(0, BLOCK_N))[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _kv(desc_k, desc_v, BT, n, col, PAGED: tl.constexpr, S: tl.constexpr):
    """The K and V tiles of keys from ``n``: rows ``n`` of contiguous K/V, or (PAGED) of the
    page the block table maps key ``n`` to."""
    row = n
    if PAGED:
        row = tl.load(BT + n // S) * S
    return desc_k.load([row, col]), desc_v.load([row, col])


@triton.jit
def _fwd(desc_q, desc_k, desc_v, desc_o, BT, scale_log2, G: tl.constexpr, D: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, S: tl.constexpr,
         WS: tl.constexpr):
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)      # the longest tiles first
    i_h = tl.program_id(1)
    col = (i_h // G) * D
    m0 = i_m * BLOCK_M
    q = desc_q.load([m0, i_h * D])
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n in tl.range(0, m0, BLOCK_N, warp_specialize=WS):
        k, v = _kv(desc_k, desc_v, BT, n, col, PAGED, S)
        acc, m_i, l_i = _tile(q, k, v, acc, m_i, l_i, scale_log2, o_m, n, BLOCK_N, False)
    for n in tl.range(m0, m0 + BLOCK_M, BLOCK_N):       # the diagonal, masked
        k, v = _kv(desc_k, desc_v, BT, n, col, PAGED, S)
        acc, m_i, l_i = _tile(q, k, v, acc, m_i, l_i, scale_log2, o_m, n, BLOCK_N, True)
    desc_o.store([m0, i_h * D], (acc / l_i[:, None]).to(desc_o.dtype))


def triton_fwd(q, k, v, table, S, bm, bn, warps, stages, ws):
    """q [N, Hq, D]; k, v [N, Hkv, D] (table None) or pools [P, S, Hkv, D] with table [pages]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    N, Hq, D = q.shape
    Hkv = k.shape[-2]
    out = torch.empty_like(q)
    dq = TensorDescriptor.from_tensor(q.view(N, Hq * D), [bm, D])
    do = TensorDescriptor.from_tensor(out.view(N, Hq * D), [bm, D])
    dk = TensorDescriptor.from_tensor(k.reshape(-1, Hkv * D), [bn, D])
    dv = TensorDescriptor.from_tensor(v.reshape(-1, Hkv * D), [bn, D])
    _fwd[(N // bm, Hq)](dq, dk, dv, do, table if table is not None else q, D ** -0.5 * LOG2E,
                        G=Hq // Hkv, D=D, BLOCK_M=bm, BLOCK_N=bn, PAGED=table is not None,
                        S=S, WS=ws, num_warps=warps, num_stages=stages)
    return out


def time_ms(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def paged_pool(k, v, S, gen):
    """k, v [N, Hkv, D] scattered into pools of S-token pages (twice as many pages as needed,
    in random order); returns the pools, the table and the op's int32 arguments."""
    N, Hkv, D = k.shape
    blocks = N // S
    P = 2 * blocks
    pages = torch.randperm(P, generator=gen)[:blocks].cuda()
    kc = torch.randn(P, S, Hkv, D, dtype=k.dtype, device="cuda")
    vc = torch.randn_like(kc)
    kc[pages] = k.view(blocks, S, Hkv, D)
    vc[pages] = v.view(blocks, S, Hkv, D)
    return kc, vc, pages.int()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--heads", default="32,8,128", help="Hq,Hkv,D")
    ap.add_argument("--record", action="store_true", help="write bench/results/<date>-<HHMM>-<name>.md")
    args = ap.parse_args()
    Hq, Hkv, D = (int(x) for x in args.heads.split(","))
    N = args.n
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(N, Hq, D, dtype=torch.bfloat16, generator=gen).cuda()
    k = torch.randn(N, Hkv, D, dtype=torch.bfloat16, generator=gen).cuda()
    v = torch.randn(N, Hkv, D, dtype=torch.bfloat16, generator=gen).cuda()
    flop = 4 * Hq * D * N * (N + 1) / 2
    qd, kd, vd = (t.transpose(0, 1)[None] for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qd.float(), kd.float(), vd.float(), is_causal=True,
                                         enable_gqa=True)[0].transpose(0, 1)
    rows = []

    def add(name, fn):
        try:
            err = (fn().float() - ref).abs().max().item()
            ms = time_ms(fn)
        except Exception as e:  # noqa: BLE001 - a config this Triton refuses is a result too
            rows.append([name, "-", "-", "-", f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"])
            return
        rows.append([name, f"{ms * 1e3:.1f}", f"{flop / ms / 1e9:.0f}", f"{err:.1e}", ""])
        print(rows[-1], flush=True)

    qc, kc_, vc_ = qd.contiguous(), kd.contiguous(), vd.contiguous()
    for be, label in ((SDPBackend.CUDNN_ATTENTION, "sdpa cudnn"), (SDPBackend.FLASH_ATTENTION, "sdpa flash")):
        def sdpa(be=be):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(qc, kc_, vc_, is_causal=True,
                                                      enable_gqa=True)[0].transpose(0, 1)
        add(label, sdpa)
    pools = {S: paged_pool(k, v, S, gen) for S in (16, 64, 128)}
    for S in (16, 64):
        kc, vc, pages = pools[S]
        qs = torch.tensor([0, N], dtype=torch.int32, device="cuda")
        lens = torch.tensor([N], dtype=torch.int32, device="cuda")
        add(f"kvops S {S}", lambda kc=kc, vc=vc, pages=pages, qs=qs, lens=lens:
            torch.ops.kvops.paged_prefill_attention(q, kc, vc, pages[None], qs, lens)[0])
    configs = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
               (128, 128, 8, 3), (128, 128, 4, 2)]
    for ws in (False, True):
        for bm, bn, w, st in configs:
            add(f"tma {bm}/{bn}/{w}/{st}{' ws' if ws else ''}",
                lambda bm=bm, bn=bn, w=w, st=st, ws=ws: triton_fwd(q, k, v, None, 0, bm, bn, w, st, ws))
        for bm, bn, w, st in configs:
            kc, vc, pages = pools[bn]
            add(f"tma-paged S {bn} {bm}/{bn}/{w}/{st}{' ws' if ws else ''}",
                lambda bm=bm, bn=bn, w=w, st=st, ws=ws, kc=kc, vc=vc, pages=pages:
                triton_fwd(q, kc, vc, pages, bn, bm, bn, w, st, ws))
    head = ["kernel", "us", "TFLOP/s", "max err", "note"]
    text = table(head, rows)
    print(text)
    if args.record:
        write_result("prefill-ceiling", f"N {N}, heads {Hq}/{Hkv}/{D}, bf16, causal\n\n{text}\n")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"{time.time() - t0:.0f} s")
