"""Triton kernel for ``kvops.far_page_summarize``: per-channel min and max of a page's keys.

A page's ``S`` tokens are ``S`` rows of ``F = Hkv * D`` contiguous elements. One program owns
one (entry, column block of ``BLOCK_F`` columns): it walks the page's rows in ``[BLOCK_T,
BLOCK_F]`` tiles keeping a running min and max in registers (in float32, which holds every
16-bit value exactly), reduces over rows and stores in the cache dtype. Each byte of each listed
page is read once; an empty entry (id outside ``[0, P)``) reads nothing and stores zeros. Page
offsets are 64-bit. The grid is one-dimensional, column blocks fastest, and depends on shapes
only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops.kernels._common import next_pow2, sm_count
from kvops.kernels._launch import launch


@triton.jit
def _far_page_summarize_kernel(
    K, Pages, KMin, KMax,
    stride_kp, stride_ks, stride_pb, stride_pn,
    P, N, F,
    NUM_F: tl.constexpr, S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
):
    i_pid = tl.program_id(0)
    i_f = i_pid % NUM_F
    i_bn = i_pid // NUM_F
    i_b = i_bn // N
    i_n = i_bn % N
    o_t = tl.arange(0, BLOCK_T)
    o_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
    m_f = o_f < F
    page = tl.load(Pages + i_b.to(tl.int64) * stride_pb + i_n * stride_pn)
    live = (page >= 0) & (page < P)
    page = tl.where(live, page, 0).to(tl.int64)
    m_kv = (o_t[:, None] < BLOCK_T) & (o_f < tl.where(live, F, 0))[None, :]
    p_k = K + page * stride_kp + o_t[:, None] * stride_ks + o_f[None, :]
    b_lo = tl.full([BLOCK_T, BLOCK_F], float("inf"), tl.float32)
    b_hi = tl.full([BLOCK_T, BLOCK_F], float("-inf"), tl.float32)
    for _ in range(0, S, BLOCK_T):
        b_k = tl.load(p_k, mask=m_kv, other=0.0).to(tl.float32)
        b_lo = tl.minimum(b_lo, b_k)
        b_hi = tl.maximum(b_hi, b_k)
        p_k += BLOCK_T * stride_ks
    # an empty entry loaded zeros everywhere, so its min and max are 0
    o_out = i_bn.to(tl.int64) * F + o_f
    tl.store(KMin + o_out, tl.min(b_lo, axis=0).to(KMin.dtype.element_ty), mask=m_f)
    tl.store(KMax + o_out, tl.max(b_hi, axis=0).to(KMax.dtype.element_ty), mask=m_f)


def default_blocks(entries: int, F: int, S: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_F): a tile of about 4096 elements, as wide as the page row allows; the
    columns are split further (down to 128) while the grid would be under 8 programs per SM.
    Depends on shapes only."""
    block_f = min(next_pow2(F), 1024)
    while block_f > 128 and entries * triton.cdiv(F, block_f) < 8 * sm_count(device):
        block_f //= 2
    return max(1, min(S, 4096 // block_f)), block_f


def far_page_summarize_fwd(k_cache: torch.Tensor, pages: torch.Tensor, *,
                           block_t: int | None = None, block_f: int | None = None,
                           num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the page-bounds kernel. Inputs are already checked by the op.

    k_cache [P, S, Hkv, D] (each page's [Hkv, D] dense); pages int32 [B, N]. Returns k_min,
    k_max [B, N, Hkv, D] in the cache dtype. Keyword knobs override the tile (tests, benches);
    ``block_t`` and ``block_f`` must be powers of two.
    """
    P, S, Hkv, D = k_cache.shape
    B, N = pages.shape
    F = Hkv * D
    k_min = torch.empty((B, N, Hkv, D), device=k_cache.device, dtype=k_cache.dtype)
    k_max = torch.empty_like(k_min)
    if B * N == 0:
        return k_min, k_max
    dt, df = default_blocks(B * N, F, S, k_cache.device)
    block_t, block_f = min(block_t or dt, S), block_f or df
    num_f = triton.cdiv(F, block_f)
    ints = (k_cache.stride(0), k_cache.stride(1), pages.stride(0), pages.stride(1), P, N, F)
    meta = dict(NUM_F=num_f, S=S, BLOCK_T=block_t, BLOCK_F=block_f, num_warps=num_warps or 4)
    tensors = (k_cache, pages, k_min, k_max)
    key = (k_cache.dtype, k_cache.device, ints, tuple(meta.items()),
           tuple(t.data_ptr() % 16 for t in tensors))
    launch(_far_page_summarize_kernel, (B * N * num_f,), key, (*tensors, *ints), meta)
    return k_min, k_max
