"""Triton kernel for ``kvops.far_page_summarize``: per-channel min and max of a page's keys.

A page's ``S`` tokens are ``S`` rows of ``F = Hkv * D`` contiguous elements. One program owns
one (entry, column block of ``BLOCK_F`` columns): it walks the page's rows in ``[BLOCK_T,
BLOCK_F]`` tiles keeping a running min and max in registers (in float32, which holds every
16-bit value exactly), reduces over rows and stores in the cache dtype. Each byte of each listed
page is read once; an empty entry (id outside ``[0, P)``) reads nothing and stores zeros. Page
offsets are 64-bit. The grid is one-dimensional, column blocks fastest, and depends on shapes
only.

``far_page_summarize_into`` runs the same kernel with each entry's destination row read from a
``rows`` table and the bounds stored into rows of persistent tables (the retrieval far view's
summary tables), so summarizing and placing are one launch; an entry whose row is outside the
table stores nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._common import next_pow2, sm_count
from kvops.kernels._launch import Launch, keep_plan


@triton.jit
def _far_page_summarize_kernel(
    K, Pages, Rows, KMin, KMax,
    stride_kp, stride_ks, stride_pb, stride_pn, stride_rb, stride_rn,
    stride_lb, stride_ln, stride_ub, stride_un,
    P, N, F, R,
    NUM_F: tl.constexpr, S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
    HAS_ROWS: tl.constexpr,
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
    if HAS_ROWS:
        row = tl.load(Rows + i_b.to(tl.int64) * stride_rb + i_n * stride_rn).to(tl.int64)
        m_f = o_f < tl.where((row >= 0) & (row < R), F, 0)
    else:
        row = i_n.to(tl.int64)
    o_lo = i_b.to(tl.int64) * stride_lb + row * stride_ln + o_f
    o_hi = i_b.to(tl.int64) * stride_ub + row * stride_un + o_f
    tl.store(KMin + o_lo, tl.min(b_lo, axis=0).to(KMin.dtype.element_ty), mask=m_f)
    tl.store(KMax + o_hi, tl.max(b_hi, axis=0).to(KMax.dtype.element_ty), mask=m_f)


def default_blocks(entries: int, F: int, S: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_F): a tile of about 4096 elements, as wide as the page row allows; the
    columns are split further (down to 128) while the grid would be under 8 programs per SM.
    Depends on shapes only."""
    block_f = min(next_pow2(F), 1024)
    while block_f > 128 and entries * triton.cdiv(F, block_f) < 8 * sm_count(device):
        block_f //= 2
    return max(1, min(S, 4096 // block_f)), block_f


_PLANS: dict = {}


def _launch(k_cache, pages, rows, k_min, k_max, block_t, block_f, num_warps,
            signature=None) -> None:
    """Launch by a plan (blocks, grid, strides, binary key) kept per argument signature and
    knobs: ``signature``, the op's (what its checks read, which fixes the plan), else the
    signatures of the five tensors."""
    tensors = (k_cache, pages, rows, k_min, k_max)
    if signature is None:
        signature = tuple(sig(t) for t in tensors)
    key = (signature, block_t, block_f, num_warps)
    plan = _PLANS.get(key) or keep_plan(_PLANS, key, _plan(*tensors, block_t, block_f,
                                                           num_warps))
    if plan is _NOTHING:
        return
    plan(k_cache, pages, pages if rows is None else rows, k_min, k_max)


_NOTHING = ()      # the plan of a call with no entries


def _plan(k_cache, pages, rows, k_min, k_max, block_t, block_f, num_warps):
    P, S, Hkv, D = k_cache.shape
    B, N = pages.shape
    F = Hkv * D
    if B * N == 0:
        return _NOTHING
    dt, df = default_blocks(B * N, F, S, k_cache.device)
    block_t, block_f = min(block_t or dt, S), block_f or df
    num_f = triton.cdiv(F, block_f)
    has_rows = rows is not None
    rows = rows if has_rows else pages            # not read without HAS_ROWS
    ints = (k_cache.stride(0), k_cache.stride(1), pages.stride(0), pages.stride(1),
            rows.stride(0), rows.stride(1), k_min.stride(0), k_min.stride(1), k_max.stride(0),
            k_max.stride(1), P, N, F, k_min.shape[1])
    meta = dict(NUM_F=num_f, S=S, BLOCK_T=block_t, BLOCK_F=block_f, HAS_ROWS=has_rows,
                num_warps=num_warps or 4)
    bin_key = (k_cache.dtype, k_cache.device, rows.dtype, ints, tuple(meta.items()),
               tuple(t.data_ptr() % 16 for t in (k_cache, pages, rows, k_min, k_max)))
    return Launch(_far_page_summarize_kernel, (B * N * num_f,), bin_key, ints, meta)


def far_page_summarize_fwd(k_cache: torch.Tensor, pages: torch.Tensor, *,
                           block_t: int | None = None, block_f: int | None = None,
                           num_warps: int | None = None,
                           signature=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the page-bounds kernel. Inputs are already checked by the op.

    k_cache [P, S, Hkv, D] (each page's [Hkv, D] dense); pages int32 [B, N]. Returns k_min,
    k_max [B, N, Hkv, D] in the cache dtype. Keyword knobs override the tile (tests, benches);
    ``block_t`` and ``block_f`` must be powers of two. ``signature``: the op's, of ``k_cache``
    and ``pages`` (the outputs are fresh, so it fixes theirs), else computed here.
    """
    B, N = pages.shape
    k_min = torch.empty(B, N, *k_cache.shape[2:], device=k_cache.device, dtype=k_cache.dtype)
    k_max = torch.empty_like(k_min)
    _launch(k_cache, pages, None, k_min, k_max, block_t, block_f, num_warps, signature)
    return k_min, k_max


def far_page_summarize_into_fwd(k_cache: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor,
                                k_min: torch.Tensor, k_max: torch.Tensor, *,
                                block_t: int | None = None, block_f: int | None = None,
                                num_warps: int | None = None, signature=None) -> None:
    """Launch the page-bounds kernel storing entry ``(b, n)`` at row ``rows[b, n]`` of
    ``k_min, k_max [B, R, Hkv, D]`` (each row's ``[Hkv, D]`` dense); rows outside ``[0, R)``
    store nothing. Inputs are already checked by the op (``signature``: its, of the five
    tensors, else computed here)."""
    _launch(k_cache, pages, rows, k_min, k_max, block_t, block_f, num_warps, signature)
