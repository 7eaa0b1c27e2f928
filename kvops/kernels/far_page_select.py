"""Triton kernel for the scoring half of ``kvops.far_page_select``: key-bound page scores.

One program owns one (sequence, block of ``BLOCK_N`` pages). For each KV head it loads the
group's ``G`` query heads once, splits them into their positive and negative parts and scores
the block with two dots, ``q+ . kmax + q- . kmin`` (= ``sum_c max(q_c kmin_c, q_c kmax_c)``),
keeping both the best over the group's rows and the KV heads and the sum over them. Each
summary byte is read once. Pages past ``num_far`` are neither read nor scored (``-inf``). The
selection that follows is two ``torch.topk`` on the ``[B, N]`` scores (fixed shape, on the
device; ``kvops.ops.far_page_select``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops.kernels._attention import dot, load_query_group
from kvops.kernels._common import dot_precision, next_pow2
from kvops.kernels._launch import launch


@triton.jit
def _far_page_scores_kernel(
    Q, KMin, KMax, NumFar, Best, Total,
    stride_qb, stride_qh,
    stride_lb, stride_ln, stride_lh,
    stride_ub, stride_un, stride_uh,
    N, Hkv, NUM_N,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    i_pid = tl.program_id(0)
    i_b = (i_pid // NUM_N).to(tl.int64)
    o_n = (i_pid % NUM_N) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_g = tl.arange(0, BLOCK_G)
    nf = tl.minimum(tl.maximum(tl.load(NumFar + i_b), 0), N)
    m_n = o_n < nf
    m_kv = m_n[:, None] & (o_d < D)[None, :]
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_N], tl.float32)
    if tl.sum(m_n.to(tl.int32)) > 0:
        for i_h in range(Hkv):
            b_q = load_query_group(Q, i_b, i_h, stride_qb, stride_qh, G, D, BLOCK_G, BLOCK_D)
            if PRECISION == "upcast":
                b_q = b_q.to(tl.float32)
            b_pos = tl.where(b_q > 0, b_q, 0.0).to(b_q.dtype)
            b_neg = tl.where(b_q < 0, b_q, 0.0).to(b_q.dtype)
            p_lo = KMin + i_b * stride_lb + o_n[:, None] * stride_ln + i_h * stride_lh + o_d[None, :]
            p_hi = KMax + i_b * stride_ub + o_n[:, None] * stride_un + i_h * stride_uh + o_d[None, :]
            b_lo = tl.load(p_lo, mask=m_kv, other=0.0)
            b_hi = tl.load(p_hi, mask=m_kv, other=0.0)
            b_s = dot(b_pos, tl.trans(b_hi), PRECISION) + dot(b_neg, tl.trans(b_lo), PRECISION)
            m_g = (o_g < G)[:, None]
            best = tl.maximum(best, tl.max(tl.where(m_g, b_s, float("-inf")), axis=0))
            total += tl.sum(tl.where(m_g, b_s, 0.0), axis=0)
    best = tl.where(m_n, best, float("-inf"))
    total = tl.where(m_n, total, float("-inf"))
    tl.store(Best + i_b * N + o_n, best, mask=o_n < N)
    tl.store(Total + i_b * N + o_n, total, mask=o_n < N)


def default_block_n(D: int) -> int:
    """Pages per program: 64 (a 64 x D tile of each bound), 32 for D above 128."""
    return 64 if D <= 128 else 32


def far_page_scores_fwd(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor,
                        num_far: torch.Tensor, *, block_n: int | None = None,
                        num_warps: int | None = None) -> torch.Tensor:
    """Launch the scoring kernel. Inputs are already checked by the op.

    q [B, Hq, D]; k_min, k_max [B, N, Hkv, D] (last dim contiguous); num_far int32 [B].
    Returns scores float32 [2, B, N]: ``[0]`` the best bound over query heads, ``[1]`` the
    bounds summed over them; ``-inf`` past num_far.
    """
    B, Hq, D = q.shape
    N, Hkv = k_min.shape[1], k_min.shape[2]
    G = Hq // Hkv
    scores = torch.empty((2, B, N), device=q.device, dtype=torch.float32)
    if B * N == 0:
        return scores
    block_n = block_n or default_block_n(D)
    num_n = triton.cdiv(N, block_n)
    q = q if q.stride(-1) == 1 else q.contiguous()
    ints = (q.stride(0), q.stride(1), k_min.stride(0), k_min.stride(1), k_min.stride(2),
            k_max.stride(0), k_max.stride(1), k_max.stride(2), N, Hkv, num_n)
    meta = dict(G=G, D=D, BLOCK_G=max(16, next_pow2(G)), BLOCK_D=next_pow2(D), BLOCK_N=block_n,
                PRECISION=dot_precision(q.dtype), num_warps=num_warps or 4)
    tensors = (q, k_min, k_max, num_far, scores[0], scores[1])
    key = (q.dtype, q.device, ints, tuple(meta.items()),
           tuple(t.data_ptr() % 16 for t in tensors))
    launch(_far_page_scores_kernel, (B * num_n,), key, (*tensors, *ints), meta)
    return scores
