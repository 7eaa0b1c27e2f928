"""Triton kernel for ``kvops.far_view_summarize``: the mean K and V of each far chunk.

A page's ``S`` tokens are ``S`` rows of ``F = Hkv * D`` contiguous elements. One program owns
one (sequence, chunk, column block of ``BLOCK_F`` of the ``F`` columns): it walks the chunk's
``M`` pages in ``[BLOCK_T, BLOCK_F]`` tiles, loading the K tile and the V tile of the same rows
together, and keeps float32 running sums in registers; at the end it reduces over rows, scales
by ``1 / (M * S)`` and stores in the cache dtype. Every byte of every chunk is read exactly once,
by one program, and each tile row is a run of ``BLOCK_F`` contiguous elements (a whole page when
``BLOCK_F >= F``), so loads are wide. An empty slot (first page -1) and out-of-range page ids
are masked loads: nothing is read and the sum stays zero. Page offsets are 64-bit.

The grid is one-dimensional (column blocks fastest, so neighbouring programs read neighbouring
bytes of the same pages) and depends on shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._common import next_pow2, sm_count
from kvops.kernels._launch import Launch, keep_plan


@triton.jit
def _far_view_summarize_kernel(
    K, V, Table, KSum, VSum,
    stride_kp, stride_ks, stride_vp, stride_vs,
    stride_tb, stride_tc, stride_tm,
    P, C, F, M, inv_count,
    NUM_F: tl.constexpr, S: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
):
    i_pid = tl.program_id(0)
    i_f = i_pid % NUM_F
    i_bc = i_pid // NUM_F
    i_b = i_bc // C
    i_c = i_bc % C
    o_t = tl.arange(0, BLOCK_T)
    o_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
    m_f = o_f < F
    p_row = Table + i_b.to(tl.int64) * stride_tb + i_c * stride_tc
    first = tl.load(p_row)

    b_k = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
    b_v = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
    for i_m in range(M):
        page = tl.load(p_row + i_m * stride_tm)
        m_page = (first >= 0) & (page >= 0) & (page < P)
        page = tl.where(m_page, page, 0).to(tl.int64)
        # the page's validity folded into the column bound (one vector compare per page)
        m_kv = (o_t[:, None] < BLOCK_T) & (o_f < tl.where(m_page, F, 0))[None, :]
        p_k = K + page * stride_kp + o_t[:, None] * stride_ks + o_f[None, :]
        p_v = V + page * stride_vp + o_t[:, None] * stride_vs + o_f[None, :]
        for _ in range(0, S, BLOCK_T):
            b_k += tl.load(p_k, mask=m_kv, other=0.0).to(tl.float32)
            b_v += tl.load(p_v, mask=m_kv, other=0.0).to(tl.float32)
            p_k += BLOCK_T * stride_ks
            p_v += BLOCK_T * stride_vs

    o_out = i_bc.to(tl.int64) * F + o_f
    tl.store(KSum + o_out, (tl.sum(b_k, axis=0) * inv_count).to(KSum.dtype.element_ty), mask=m_f)
    tl.store(VSum + o_out, (tl.sum(b_v, axis=0) * inv_count).to(VSum.dtype.element_ty), mask=m_f)


def default_blocks(chunks: int, F: int, S: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_F): a tile of about 4096 elements per tensor (two 16-byte vectors per
    thread and tensor at 4 warps, fp16), as wide as the page row allows; the columns are split
    further (down to 128) while the grid would be under two waves of 4 programs per SM.
    Depends on shapes only."""
    block_f = min(next_pow2(F), 1024)
    while block_f > 128 and chunks * triton.cdiv(F, block_f) < 8 * sm_count(device):
        block_f //= 2
    block_t = max(1, min(S, 4096 // block_f))
    return block_t, block_f


_PLANS: dict = {}


def far_view_summarize_fwd(
    k_cache: torch.Tensor, v_cache: torch.Tensor, chunk_table: torch.Tensor,
    *, block_t: int | None = None, block_f: int | None = None, num_warps: int | None = None,
    signature=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the summarize kernel. Inputs are already checked by the op.

    k_cache, v_cache [P, S, Hkv, D] (each page's [Hkv, D] dense); chunk_table int32 [B, C, M].
    Returns k_sum, v_sum [B, C, Hkv, D] in the cache dtype. The keyword-only knobs override the
    defaults (benchmarks and tests use them); ``block_t`` must be a power of two. A launch's
    plan (blocks, grid, strides, binary key) is kept per argument signature (``signature``:
    the op's, else one is computed here) and knobs.
    """
    if signature is None:
        signature = (sig(k_cache), sig(v_cache), sig(chunk_table))
    key = (signature, block_t, block_f, num_warps)
    plan = _PLANS.get(key) or keep_plan(_PLANS, key, _plan(k_cache, v_cache, chunk_table,
                                                           block_t, block_f, num_warps))
    shape, run = plan
    k_sum = torch.empty(*shape, device=k_cache.device, dtype=k_cache.dtype)
    v_sum = torch.empty(*shape, device=v_cache.device, dtype=v_cache.dtype)
    if run is not None:
        run(k_cache, v_cache, chunk_table, k_sum, v_sum)
    return k_sum, v_sum


def _plan(k_cache, v_cache, chunk_table, block_t, block_f, num_warps):
    P, S, Hkv, D = k_cache.shape
    B, C, M = chunk_table.shape
    shape = (B, C, Hkv, D)
    if B * C == 0:
        return shape, None
    F = Hkv * D
    dt, df = default_blocks(B * C, F, S, k_cache.device)
    block_t, block_f = min(block_t or dt, S), block_f or df
    num_f = triton.cdiv(F, block_f)
    ints = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            chunk_table.stride(0), chunk_table.stride(1), chunk_table.stride(2), P, C, F, M,
            1.0 / (M * S))
    meta = dict(NUM_F=num_f, S=S, BLOCK_T=block_t, BLOCK_F=block_f, num_warps=num_warps or 4)
    # the outputs are fresh, so always 16-byte aligned
    bin_key = (k_cache.shape, k_cache.dtype, k_cache.device, chunk_table.shape, ints,
               tuple(meta.values()),
               tuple(t.data_ptr() % 16 for t in (k_cache, v_cache, chunk_table)))
    return shape, Launch(_far_view_summarize_kernel, (B * C * num_f,), bin_key, ints, meta)
