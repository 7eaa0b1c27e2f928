"""Triton kernel for ``kvops.static_sliding_attention``: fixed-shape decode over a ring window.

One program handles one (sequence, KV head, split): it loads the ``G`` query heads of that KV
head's group once, streams its share of the visible window slots in logical (ring) order, so
each K/V row is read once for the whole group and invisible slots are never read, and writes a
normalized partial. With one split the partial is the output; with more, a second fixed-shape
launch merges them (``_splitk.merge_splits``). The far view, when given, is one extra split
of the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops.kernels._attention import (
    LOG2E,
    finish_rows,
    load_query_group,
    online_softmax_tile,
    split_range,
)
from kvops.kernels._common import dot_precision, grid_waves, kv_block_n, kv_tile_bytes, next_pow2
from kvops.kernels._splitk import default_num_splits, merge_splits, split_outputs, use_pdl


@triton.jit
def _sliding_window_kernel(
    Q, K, V, WinStart, WinLen, FarK, FarV, FarBias, O, L,
    scale_log2,
    stride_qb, stride_qh,
    stride_kb, stride_kw, stride_kh,
    stride_vb, stride_vw, stride_vh,
    stride_fkb, stride_fkc, stride_fkh,
    stride_fvb, stride_fvc, stride_fvh,
    stride_fbb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    W, C, Hkv, NUM_SPLITS,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_FAR: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # let the split merge launch now; it waits for this grid on-device
        tl.extra.cuda.gdc_launch_dependents()
    i_bh = tl.program_id(0)
    i_s = tl.program_id(1)
    i_b = (i_bh // Hkv).to(tl.int64)
    i_h = i_bh % Hkv
    o_d = tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    m_d = o_d < D
    b_q = load_query_group(Q, i_b, i_h, stride_qb, stride_qh, G, D, BLOCK_G, BLOCK_D)

    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if HAS_FAR and i_s == NUM_SPLITS:
        # the far view: C summary slots, each biased (log-count, or -inf when empty)
        for start in range(0, C, BLOCK_N):
            m_n = start + o_n < C
            m_kv = m_n[:, None] & m_d[None, :]
            p_k = FarK + i_b * stride_fkb + (start + o_n)[:, None] * stride_fkc \
                + i_h * stride_fkh + o_d[None, :]
            p_v = FarV + i_b * stride_fvb + (start + o_n)[:, None] * stride_fvc \
                + i_h * stride_fvh + o_d[None, :]
            b_k = tl.load(p_k, mask=m_kv, other=0.0)
            b_v = tl.load(p_v, mask=m_kv, other=0.0)
            b_bias = tl.load(FarBias + i_b * stride_fbb + start + o_n, mask=m_n,
                             other=float("-inf")) * LOG2E
            b_m, b_l, b_acc = online_softmax_tile(b_q, b_k, b_v, b_bias, b_m, b_l, b_acc,
                                                  scale_log2, PRECISION)
    else:
        # the near window: visible slots are ring positions ws, ws+1, ... (wl of them)
        wl = tl.minimum(tl.maximum(tl.load(WinLen + i_b), 0), W)
        ws = tl.load(WinStart + i_b) % W
        ws = tl.where(ws < 0, ws + W, ws)
        lo, hi = split_range(wl, i_s, NUM_SPLITS, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            m_n = start + o_n < hi
            slot = ws + start + o_n
            slot = tl.where(slot >= W, slot - W, slot)
            m_kv = m_n[:, None] & m_d[None, :]
            p_k = K + i_b * stride_kb + slot[:, None] * stride_kw + i_h * stride_kh + o_d[None, :]
            p_v = V + i_b * stride_vb + slot[:, None] * stride_vw + i_h * stride_vh + o_d[None, :]
            b_k = tl.load(p_k, mask=m_kv, other=0.0)
            b_v = tl.load(p_v, mask=m_kv, other=0.0)
            b_bias = tl.where(m_n, 0.0, float("-inf"))
            b_m, b_l, b_acc = online_softmax_tile(b_q, b_k, b_v, b_bias, b_m, b_l, b_acc,
                                                  scale_log2, PRECISION)

    finish_rows(b_m, b_l, b_acc, O, L, i_b, i_h, i_s, stride_ob, stride_oh, stride_os,
                stride_lb, stride_lh, G, D, BLOCK_G, BLOCK_D)


SHORT_WINDOW = 1024   # unsplit windows up to this many rows take the short-loop tile
SPILL_FILL = 0.82     # past one wave: 128-row grids filling at most this share of their slots
IDLE_FILL = 0.65      # within one wave: unsplit 128-row grids busy on at most this share of SMs


def wave_tile(pairs: int, block_n: int, D: int, dtype: torch.dtype,
              device: torch.device) -> int:
    """Rows a tile for an unsplit launch of ``pairs`` programs without far slots, whose tile
    and split count are the launcher's own: ``block_n``, or 64 where 128-row tiles would fill
    the GPU's waves poorly. Measured for 16-bit K/V of D 65-128 only, the one case it changes:
    there a 128-row tile is 64 KiB, one program fills an SM, and an unsplit program reads about
    45-49 GB/s, so grids of such programs run in whole waves. 64-row tiles (32 KiB, at least two
    programs an SM) replace them where

    - past one wave, the programs fill at most ``SPILL_FILL`` of their waves' slots. H200, Hkv 8,
      W 4096: B 17-24 (52-73 %) 79.7-95.9 against 106.9-110.1 us, B 34-36 (69-73 %) 7-11 %
      faster, B 40, 50, 67 (76-81 %) 3-4 % faster. Above it 128 rows stay: B 28 (85 %) is a wash,
      B 44 (89 %) and 56 (85 %) run 2-8 % slower with 64 rows, full waves (97 %) equal at B 32
      and 48 and 3-11 % slower at B 64 and 128; B 100 (87 %) would gain 7 % but keeps 128 rows;
    - within one wave, at most ``IDLE_FILL`` of the SMs are busy, an empirical bound: B 9
      (55 %) runs 4-20 % faster over W 2k-16k with 64-row tiles in 3 splits (``default_num_splits``
      re-splits them), B 10 (61 %) 7-11 % faster at 8k-16k, equal at 4k and 4 % slower at 2k;
      B 11 (67 %) is a wash, B 12 (73 %) and up lose.

    Sweeps: bench/results/2026-11-30-static_sliding_attention-waves.md."""
    if block_n != 128 or dtype.itemsize != 2 or next_pow2(D) != 128:
        return block_n
    waves, fill = grid_waves(pairs, device)
    return 64 if fill <= (SPILL_FILL if waves > 1 else IDLE_FILL) else block_n


def static_sliding_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    win_start: torch.Tensor, win_len: torch.Tensor,
    far_k: torch.Tensor | None = None, far_v: torch.Tensor | None = None,
    far_bias: torch.Tensor | None = None, scale: float | None = None,
    *, num_splits: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the sliding-window decode kernel. Inputs are already checked by the op.

    q [B, Hq, D]; k, v [B, W, Hkv, D]; win_start, win_len int32 [B];
    far_k, far_v [B, C, Hkv, D] and far_bias float32 [B, C], or all None.
    Returns out [B, Hq, D] (q.dtype) and lse float32 [B, Hq].
    The keyword-only knobs override the tuned defaults (benchmarks and tests use them).
    """
    B, Hq, D = q.shape
    W, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    has_far = far_k is not None
    C = far_k.shape[1] if has_far else 0
    tuned_tile = block_n is None and num_stages is None
    auto_splits = num_splits is None
    block_n = block_n or kv_block_n(D, k.dtype)
    if auto_splits:
        num_splits = default_num_splits(B * Hkv, W, block_n, kv_tile_bytes(block_n, D, k.dtype),
                                        q.device)
    if tuned_tile and num_splits == 1 and W <= SHORT_WINDOW:
        # many short programs: the 3-stage pipeline's fill and drain dominate; halve the tile
        # and take 2 stages (H200 tune, B=64, W=1024: 64.4 us vs 69.8 us). Split programs at
        # small batch keep the big tile (B=1, W=4096: 10.3 us with 128 rows, 10.6 with 64).
        block_n, num_stages = min(block_n, 64), 2
    elif tuned_tile and auto_splits and num_splits == 1 and not has_far:
        tile = wave_tile(B * Hkv, block_n, D, k.dtype, q.device)
        if tile != block_n:
            block_n = tile
            num_splits = default_num_splits(B * Hkv, W, block_n,
                                            kv_tile_bytes(block_n, D, k.dtype), q.device)
    nsp = num_splits + int(has_far)
    pdl = nsp > 1 and (use_pdl(q.device) if pdl is None else pdl)
    out, lse, part_o, part_l, s_os = split_outputs(B, Hq, D, nsp, q.dtype, q.device)
    if not has_far:  # the kernel never reads these; pass valid pointers of the right type
        far_k, far_v, far_bias = k, v, lse
    _sliding_window_kernel[(B * Hkv, nsp)](
        q, k, v, win_start, win_len, far_k, far_v, far_bias, part_o, part_l,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        far_k.stride(0), far_k.stride(1), far_k.stride(2),
        far_v.stride(0), far_v.stride(1), far_v.stride(2),
        far_bias.stride(0),
        part_o.stride(0), part_o.stride(1), s_os,
        part_l.stride(0), part_l.stride(1),
        W, C, Hkv, num_splits,
        G=G, D=D, BLOCK_G=max(16, next_pow2(G)), BLOCK_D=next_pow2(D), BLOCK_N=block_n,
        HAS_FAR=has_far, PRECISION=dot_precision(q.dtype), USE_PDL=pdl,
        num_warps=num_warps or 4, num_stages=num_stages or 3,
    )
    if nsp > 1:
        merge_splits(part_o.view(B * Hq, nsp, D), part_l.view(B * Hq, nsp),
                     out.view(B * Hq, D), lse.view(B * Hq), pdl=pdl)
    return out, lse
