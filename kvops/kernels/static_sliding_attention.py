"""Triton kernel for ``kvops.static_sliding_attention``: fixed-shape decode over a ring window.

One program handles one (sequence, KV head, split): it loads the ``G`` query heads of that KV
head's group once, streams its share of the visible window slots in logical (ring) order, so
each K/V row is read once for the whole group and invisible slots are never read, and writes a
normalized partial. The far slots, when given, are rows after the window's: the splits cut the
visible window and the far slots together into equal ranges, so a far view costs what a window
as wide costs. With one split the partial is the output; with more, the last split of each
(sequence, KV head) merges them in the same launch (eager calls, ``_splitk.merge_if_last``) or a
second fixed-shape launch does (CUDA-graph capture, ``_splitk.merge_split_outputs``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._attention import (
    LOG2E,
    finish_rows,
    load_query_group,
    online_softmax_tile,
    split_range,
)
from kvops.kernels._common import (
    LOG2E as LOG2E_F,
)
from kvops.kernels._common import (
    DeviceProps,
    device_props,
    dot_precision,
    grid_waves,
    kv_block_n,
    kv_tile_bytes,
    next_pow2,
)
from kvops.kernels._launch import Launch, keep_plan
from kvops.kernels._splitk import (
    DecodePlan,
    default_num_splits,
    launch_split,
    merge_if_last,
    merge_plan,
    split_outputs,
    standard_strides,
    use_pdl,
)


@triton.jit
def _sliding_window_kernel(
    Q, K, V, WinStart, WinLen, FarK, FarV, FarBias, O, L, Out, Lse, Count,
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
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_FAR: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
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
    wl_raw = tl.load(WinLen + i_b)
    # the rows are the visible window slots (ring positions ws, ws+1, ..., wl of them), then
    # the C far slots; split i_s takes rows [lo, hi) of them
    wl = tl.minimum(tl.maximum(wl_raw, 0), W)
    ws = tl.load(WinStart + i_b) % W
    ws = tl.where(ws < 0, ws + W, ws)
    lo, hi = split_range(wl + C, i_s, NUM_SPLITS, BLOCK_N)
    w_hi = tl.minimum(hi, wl)
    for start in range(lo, w_hi, BLOCK_N):
        m_n = start + o_n < w_hi
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
    if HAS_FAR:
        # far slots [f_lo, f_hi), each biased (log-count, 0, or -inf when empty), in tiles of
        # BLOCK_C rows (a few far slots do not pay for a window-sized tile)
        o_c = tl.arange(0, BLOCK_C)
        f_lo = tl.maximum(lo, wl) - wl
        f_hi = tl.maximum(hi, wl) - wl
        # each tile's bias is loaded a tile ahead: the K/V loads it masks do not wait on it
        p_fb = FarBias + i_b * stride_fbb + o_c
        b_next = tl.load(p_fb + f_lo, mask=f_lo + o_c < f_hi, other=float("-inf"))
        for start in range(f_lo, f_hi, BLOCK_C):
            m_n = start + o_c < f_hi
            p_k = FarK + i_b * stride_fkb + (start + o_c)[:, None] * stride_fkc \
                + i_h * stride_fkh + o_d[None, :]
            p_v = FarV + i_b * stride_fvb + (start + o_c)[:, None] * stride_fvc \
                + i_h * stride_fvh + o_d[None, :]
            b_bias = b_next * LOG2E
            b_next = tl.load(p_fb + start + BLOCK_C, mask=start + BLOCK_C + o_c < f_hi,
                             other=float("-inf"))
            # an empty slot (bias -inf) is not read: NaN or inf there must not reach the output
            m_live = (m_n & (b_bias > float("-inf")))[:, None] & m_d[None, :]
            b_k = tl.load(p_k, mask=m_live, other=0.0)
            b_v = tl.load(p_v, mask=m_live, other=0.0)
            b_m, b_l, b_acc = online_softmax_tile(b_q, b_k, b_v, b_bias, b_m, b_l, b_acc,
                                                  scale_log2, PRECISION)

    if (wl_raw < 0) | (wl_raw > W):   # outside [0, W]: NaN out and lse (the op's docstring)
        b_m = tl.full([BLOCK_G], float("nan"), tl.float32)
        b_l = tl.full([BLOCK_G], 1.0, tl.float32)
        b_acc = tl.full([BLOCK_G, BLOCK_D], float("nan"), tl.float32)
    finish_rows(b_m, b_l, b_acc, O, L, i_b, i_h, i_s, stride_ob, stride_oh, stride_os,
                stride_lb, stride_lh, G, D, BLOCK_G, BLOCK_D)
    if FUSED_MERGE:
        merge_if_last(O, L, Out, Lse, Count + i_bh, i_b, i_h, Hkv, stride_ob, stride_oh,
                      stride_os, stride_lb, stride_lh, NUM_SPLITS, G, D, BLOCK_G, BLOCK_D,
                      BLOCK_S)


SHORT_WINDOW = 1024   # unsplit windows (far slots included) up to this many rows: the short-window rule
SHORT_SHARED = 1152   # ... up to this many with more programs than SMs (a 1k window and far slots)
SPILL_FILL = 0.82     # past one wave: 128-row grids filling at most this share of their slots
IDLE_FILL = 0.65      # within one wave: unsplit 128-row grids busy on at most this share of SMs


class SlidingLaunch(NamedTuple):
    block_n: int
    splits: int
    warps: int
    stages: int


def wave_tile(pairs: int, block_n: int, D: int, itemsize: int, sms: int) -> int:
    """Rows a tile for an unsplit launch of ``pairs`` programs: ``block_n``,
    or 64 where 128-row tiles (16-bit K/V of D 65-128, 64 KiB: one program an SM) would fill the
    SMs' waves poorly: past one wave at most ``SPILL_FILL`` of the waves' slots, within one wave
    at most ``IDLE_FILL`` of the SMs (docs/tuning.md)."""
    if block_n != 128 or itemsize != 2 or next_pow2(D) != 128:
        return block_n
    waves, fill = grid_waves(pairs, sms)
    return 64 if fill <= (SPILL_FILL if waves > 1 else IDLE_FILL) else block_n


def far_tile(C: int, block_n: int) -> int:
    """Rows of the far-slot tile: the far slots rounded up to a power of two, at least 16 (a
    ``tl.dot`` operand) and at most the window's tile. ``C`` 16 summaries take one 16-row tile
    instead of a window-sized one whose other rows are masked."""
    return min(block_n, max(16, next_pow2(C)))


@functools.lru_cache(maxsize=4096)
def sliding_launch(B: int, Hkv: int, W: int, D: int, itemsize: int, C: int,
                   props: DeviceProps, block_n: int | None = None, splits: int | None = None,
                   warps: int | None = None, stages: int | None = None) -> SlidingLaunch:
    """The launch of ``B * Hkv`` (sequence, KV head) programs over windows of ``W`` rows and
    ``C`` far slots (0: none), cut together as ``W + C`` rows; the given knobs are kept, the
    others chosen (docs/tuning.md has each rule's measurements):

    - tile rows ``kv_block_n`` (64 KiB of K and V), split count ``default_num_splits`` (about
      64 KiB of tiles in flight an SM), 4 warps, 3 stages;
    - unsplit launches with more programs than SMs and at most ``SHORT_SHARED`` rows (a 1k
      window with up to 128 far slots): 64-row tiles (several short programs an SM); with at
      most one program an SM and at most ``SHORT_WINDOW`` rows the large tile;
    - other unsplit launches: ``wave_tile``, re-split for its tile.
    """
    rows = W + C
    tuned_tile = block_n is None and stages is None
    auto_splits = splits is None
    pairs = B * Hkv
    block_n = block_n or kv_block_n(D, itemsize)
    if auto_splits:
        splits = default_num_splits(pairs, rows, block_n, kv_tile_bytes(block_n, D, itemsize),
                                    props.sms)
    shared = pairs > props.sms         # more than one program an SM
    if tuned_tile and splits == 1 and rows <= (SHORT_SHARED if shared else SHORT_WINDOW):
        if shared:                     # the short-loop tile
            block_n = min(block_n, 64)
        stages = 3
    elif tuned_tile and auto_splits and splits == 1:
        tile = wave_tile(pairs, block_n, D, itemsize, props.sms)
        if tile != block_n:
            block_n = tile
            splits = default_num_splits(pairs, rows, block_n, kv_tile_bytes(block_n, D, itemsize),
                                        props.sms)
    return SlidingLaunch(block_n, splits, warps or 4, stages or 3)


_PLANS: dict = {}
_NO_KNOBS = (None,) * 6


def _plan(q, k, v, win_start, win_len, far_k, far_v, far_bias, scale, knobs):
    B, Hq, D = q.shape
    W, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    has_far = far_k is not None
    C = far_k.shape[1] if has_far else 0
    props = device_props(q.device)
    block_n, num_splits, num_warps, num_stages, pdl, far_block_n = knobs
    if far_block_n is not None and (far_block_n < 16 or far_block_n & (far_block_n - 1)):
        raise ValueError(f"far_block_n: expected a power of two >= 16 (a tl.dot operand), "
                         f"got {far_block_n}")
    lp = sliding_launch(B, Hkv, W, D, k.element_size(), C, props, block_n, num_splits,
                        num_warps, num_stages)
    nsp = lp.splits
    pdl = nsp > 1 and (use_pdl(props) if pdl is None else pdl)
    if has_far:
        far_strides = (far_k.stride(0), far_k.stride(1), far_k.stride(2),
                       far_v.stride(0), far_v.stride(1), far_v.stride(2), far_bias.stride(0))
    else:   # the kernel reads no far pointer: it gets None (no argument for the launcher to
        # resolve) and these strides
        far_strides = (0, 0, 0, 0, 0, 0, 1)
    if nsp == 1:
        o_strides = (Hq * D, D, 0, Hq, 1)
    else:
        o_strides = (Hq * nsp * D, nsp * D, D, Hq * nsp, nsp)
    scale = D ** -0.5 if scale is None else scale
    ints = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), *far_strides, *o_strides,
            W, C, Hkv, lp.splits)
    meta = dict(G=G, D=D, BLOCK_G=max(16, next_pow2(G)), BLOCK_D=next_pow2(D),
                BLOCK_N=lp.block_n, BLOCK_C=far_block_n or far_tile(C, lp.block_n),
                HAS_FAR=has_far, PRECISION=dot_precision(q.dtype),
                USE_PDL=pdl, FUSED_MERGE=False, BLOCK_S=1, num_warps=lp.warps,
                num_stages=lp.stages)
    merge = fused = None
    # the plan's own tokens key its compiled kernels: a plan made again (another rule, patched
    # constants in tests) never launches a binary compiled for the old one
    first = Launch(_sliding_window_kernel, (B * Hkv, nsp), object(), (scale * LOG2E_F, *ints),
                   meta)
    if nsp > 1:
        merge = merge_plan(B, Hq, nsp, D, q.dtype, pdl, q.device)
        fused = Launch(_sliding_window_kernel, (B * Hkv, nsp), object(), (scale * LOG2E_F, *ints),
                       dict(meta, USE_PDL=False, FUSED_MERGE=True, BLOCK_S=next_pow2(nsp)))
    return DecodePlan(B, Hq, D, nsp, merge, fused, first, [], standard_strides(q))


def static_sliding_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    win_start: torch.Tensor, win_len: torch.Tensor,
    far_k: torch.Tensor | None = None, far_v: torch.Tensor | None = None,
    far_bias: torch.Tensor | None = None, scale: float | None = None,
    *, num_splits: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, pdl: bool | None = None,
    far_block_n: int | None = None, signature=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the sliding-window decode kernel. Inputs are already checked by the op.

    q [B, Hq, D]; k, v [B, W, Hkv, D]; win_start, win_len int32 [B];
    far_k, far_v [B, C, Hkv, D] and far_bias float32 [B, C], or all None.
    Returns out [B, Hq, D] (q.dtype) and lse float32 [B, Hq].
    The keyword-only knobs override the launch rule (``sliding_launch``, and ``far_tile`` for
    ``far_block_n``; benchmarks and tests use them). A launch's plan (rule, strides,
    constants) is kept per argument signature: ``signature`` is the op's (the int key its
    ``CheckedSignatures`` names the arguments' signature by), else one is computed here.
    """
    knobs = (block_n, num_splits, num_warps, num_stages, pdl, far_block_n)
    if signature is not None and knobs == _NO_KNOBS:
        key = signature
    else:
        key = (knobs, sig(q), sig(k), sig(v), sig(win_start), sig(win_len), sig(far_k),
               sig(far_v), sig(far_bias), scale)
    plan = _PLANS.get(key) or keep_plan(
        _PLANS, key, _plan(q, k, v, win_start, win_len, far_k, far_v, far_bias, scale, knobs))
    out, lse, part_o, part_l, count = split_outputs(
        plan.B, plan.Hq, plan.D, plan.splits, q.dtype, q.device, plan.launch.grid[0],
        q if plan.like_q else None)
    launch_split((q, k, v, win_start, win_len, far_k, far_v, far_bias, part_o, part_l, out, lse),
                 count, win_len, (), plan)
    return out, lse
