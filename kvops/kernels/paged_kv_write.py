"""Triton kernel for ``kvops.paged_kv_write``: scatter token rows into pool slots.

A token's K (or V) row is ``Hkv * D`` values; in a page-contiguous pool it is one contiguous run
at ``page * stride_page + offset * Hkv * D``. When the input rows are contiguous too (head stride
D, the usual case) the kernel moves each row as one flat run of ``ROW = Hkv * D`` values
(``PARTS = 1``); otherwise it moves ``PARTS = Hkv`` runs of ``ROW = D`` values, one per head.
A program moves a ``[BLOCK_T, BLOCK_C]`` tile: BLOCK_T tokens, BLOCK_C values of one part, K
and V with one slot load. Grid ``(cdiv(N, BLOCK_T), PARTS * cdiv(ROW, BLOCK_C))``; it depends on
shapes only, so a captured graph replays with any slot values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._common import next_pow2, sm_count
from kvops.kernels._launch import Launch, keep_plan

# Values a program moves per tensor (K or V): 4096 (8 KiB of 16-bit data), and at least
# PROGRAMS_PER_SM programs an SM where N allows, so small steps still spread over the GPU.
TILE_VALUES = 4096
MAX_BLOCK_C = 1024
PROGRAMS_PER_SM = 2


def write_tile(N: int, row: int, parts: int, sms: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_C, num_warps)`` for ``N`` tokens of ``parts`` runs of ``row`` values.

    BLOCK_C covers a run up to MAX_BLOCK_C values; BLOCK_T (a power of two, at most
    TILE_VALUES / BLOCK_C) halves until the grid has ``PROGRAMS_PER_SM * sms`` programs or
    BLOCK_T is 1. Eight warps for full 4096-value tiles, four below.
    """
    block_c = min(next_pow2(row), MAX_BLOCK_C)
    chunks = parts * triton.cdiv(row, block_c)
    block_t = max(1, TILE_VALUES // block_c)
    while block_t > 1 and triton.cdiv(max(N, 1), block_t) * chunks < PROGRAMS_PER_SM * sms:
        block_t //= 2
    return block_t, block_c, 8 if block_t * block_c >= TILE_VALUES else 4


@triton.jit(do_not_specialize=["N"])     # the token count changes every step: one binary
def _paged_kv_write_kernel(
    K, V, KC, VC, Slots, N, num_slots,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_kcp, stride_vcp,
    S: tl.constexpr, ROW: tl.constexpr, PARTS: tl.constexpr, HD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_pc = tl.program_id(1)
    CHUNKS: tl.constexpr = (ROW + BLOCK_C - 1) // BLOCK_C
    i_part = i_pc // CHUNKS
    i_c = i_pc % CHUNKS
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_t = o_t < N
    b_slot = tl.load(Slots + o_t, mask=m_t, other=-1).to(tl.int64)
    m_t = m_t & (b_slot >= 0) & (b_slot < num_slots)
    b_slot = tl.where(m_t, b_slot, 0)
    b_page = b_slot // S
    b_off = b_slot % S
    m = m_t[:, None] & (o_c < ROW)[None, :]
    o_n = o_t.to(tl.int64)[:, None]
    # part i_part is head i_part when PARTS == Hkv, the whole row when PARTS == 1
    o_in_k = o_n * stride_kn + i_part * stride_kh + o_c[None, :]
    o_in_v = o_n * stride_vn + i_part * stride_vh + o_c[None, :]
    o_row = (b_off * HD + i_part * ROW)[:, None] + o_c[None, :]
    b_k = tl.load(K + o_in_k, mask=m)
    b_v = tl.load(V + o_in_v, mask=m)
    tl.store(KC + b_page[:, None] * stride_kcp + o_row, b_k, mask=m)
    tl.store(VC + b_page[:, None] * stride_vcp + o_row, b_v, mask=m)


_PLANS: dict = {}


def paged_kv_write_fwd(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                       block_t: int | None = None, block_c: int | None = None,
                       num_warps: int | None = None, signature=None) -> None:
    """Launch the kernel. Inputs are already checked by the op (shapes, dtypes, page-contiguous
    caches, D contiguous in k and v). The keyword knobs override ``write_tile`` (tests, benches).
    A launch's plan (tile, grid, strides, binary key) is kept per argument signature
    (``signature``: the op's, else one is computed here) and knobs.
    """
    if k.shape[0] == 0:
        return
    tensors = (k, v, k_cache, v_cache, slot_mapping)
    if signature is None:
        signature = tuple(sig(t) for t in tensors)
    key = (signature, block_t, block_c, num_warps)
    plan = _PLANS.get(key) or keep_plan(_PLANS, key, _plan(*tensors, block_t, block_c,
                                                           num_warps))
    plan(*tensors)


def _plan(k, v, k_cache, v_cache, slot_mapping, block_t, block_c, num_warps):
    N, Hkv, D = k.shape
    P, S = k_cache.shape[:2]
    flat = (Hkv == 1 or (k.stride(1) == D and v.stride(1) == D))
    row, parts = (Hkv * D, 1) if flat else (D, Hkv)
    bt, bc, nw = write_tile(N, row, parts, sm_count(k.device))
    bt, bc, nw = block_t or bt, block_c or bc, num_warps or nw
    grid = (triton.cdiv(N, bt), parts * triton.cdiv(row, bc))
    ints = (N, P * S, k.stride(0), k.stride(1) if Hkv > 1 else 0, v.stride(0),
            v.stride(1) if Hkv > 1 else 0, k_cache.stride(0), v_cache.stride(0))
    meta = dict(S=S, ROW=row, PARTS=parts, HD=Hkv * D, BLOCK_T=bt, BLOCK_C=bc, num_warps=nw)
    key = (ints[1:], k.dtype, k.device, slot_mapping.dtype, tuple(meta.values()),   # N: unspecialized
           tuple(t.data_ptr() % 16 for t in (k, v, k_cache, v_cache, slot_mapping)))
    return Launch(_paged_kv_write_kernel, grid, key, ints, meta)
