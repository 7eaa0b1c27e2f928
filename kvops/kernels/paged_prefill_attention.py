"""Triton kernel for ``kvops.paged_prefill_attention``: causal attention of packed query chunks
over paged prefixes, flash-attention style.

A program takes one query tile of one sequence and one KV head. The tile's ``BLOCK_M`` rows
are ``BLOCK_Q = BLOCK_M // G`` tokens times the G query heads of that KV head (row ``r`` is
token ``r // G``, head ``r % G``), so every K/V tile loaded serves the whole group in one
``tl.dot``. The program walks its sequence's block table ``BLOCK_N`` keys at a time, gathering
key rows from their pages (``page * stride_page + offset * Hkv * D``, 64-bit), with an online
base-2 softmax in float32. Key tiles come in three runs: leading tiles cut by the sliding
window (masked), interior tiles every row sees whole (no position mask), and the tiles on the
causal diagonal (masked); tiles past the tile's last query are never read (the causal skip).

Tiles of sequence ``b`` are numbered from ``T_b = query_start[b] // BLOCK_Q + b``; since a
sequence of ``n`` queries needs at most ``n // BLOCK_Q + 1`` tiles, ``T_b`` leaves room for
them, and a grid of ``N // BLOCK_Q + B + 1`` tiles (from shapes only, so graphs replay with any
lengths) covers every sequence plus the padding rows after ``query_start[B]``, which get
out 0 and lse -inf. A program finds its sequence by counting the ``T_b`` at or below its
tile (the ``B + 1`` starts are read a ``BLOCK_B`` chunk at a time) and exits if its tile lies
past its sequence's queries. Tiles run last-first, so the longest (latest) tiles of a sequence
start first.

On Hopper and newer, with pages of at least 64 tokens (``prefill_tma``), a key tile lies inside
one page and comes whole through a tensor descriptor over the pool's rows ``[rows, Hkv * D]``
(``_key_tile_tma``): the tensor copy engine loads it, with no per-row addresses or masks in
registers, and one warpgroup holds a 64-row tile. On the H100 an 8k prefill runs 1.58x faster
than through the gathered loads at pages of 16
(bench/results/2026-12-06-1202-paged_prefill_attention-S64.md). Smaller pages keep the gathered
loads.

When the tiles are too few to fill the GPU (a short chunk over a long prefix), each tile's key
range is cut into ``NUM_SPLITS`` BLOCK_N-aligned parts (grid dim 2, ``prefill_splits``), each
writing a normalized float32 partial and its lse. In eager calls the last split of each (tile,
KV head) to finish merges the tile's rows in the same launch (``_splitk.arrive`` and
``merge_rows``, on counters kept per stream); under CUDA-graph capture
``_splitk.merge_split_outputs`` merges them in a second launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._attention import LN2, LOG2E, dot
from kvops.kernels._common import (
    cuda_capability,
    dot_precision,
    next_pow2,
    nvidia_ptx,
    sm_count,
)
from kvops.kernels._launch import Launch, keep_plan
from kvops.kernels._splitk import (
    arrive,
    launch_split,
    merge_plan,
    merge_rows,
    split_outputs,
    standard_strides,
)
from kvops.kernels.paged_prefill_gluon import (
    gluon_launch,
    gluon_plan,
    paged_prefill_gluon_fwd,
    prefill_gluon,
)

# Splits of a tile's key range only while the tiles fill less than this share of the SMs, and
# only as far as each split keeps at least MIN_SPLIT_TILES key tiles of the longest context.
SPLIT_BELOW_FILL = 0.5
MIN_SPLIT_TILES = 8
MAX_SPLITS = 8


def prefill_tile(N: int, B: int, G: int, D: int, dtype: torch.dtype,
                 tma: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a call with ``N`` query rows over ``B``
    sequences, group ``G``, head dim ``D``; ``tma``: K/V tiles through descriptors
    (``prefill_tma``).

    BLOCK_M: 128 rows (64 at D > 128 or float32, whose tiles take twice the registers), fewer
    when the sequences' mean chunk times G is smaller (down to 16, the smallest ``tl.dot``), and
    at least G rounded up to a power of two so a tile holds a whole group. BLOCK_N 64 keys (32 at
    D > 128 or float32). Eight warps for 128-row tiles, four below; three stages at D <= 128,
    two above (shared memory). With TMA 64-row tiles of four warps: the tiles need no address
    registers, and on the H100 64/64/4/3 ran 1.15x faster than 128/64/4/3 and 1.09x faster
    than 128/64/8/4 at an 8k prefill (1212, 1389, 1317 us), 1.09x / 1.03x at 512 over 16k
    (bench/results/2026-12-06-1201-paged_prefill_attention-tune-S64.md).
    """
    big = D <= 128 and dtype != torch.float32
    max_m = 128 if big and not tma else 64
    per_seq = -(-max(N, 1) // max(B, 1))
    block_m = min(max_m, max(16, next_pow2(per_seq * G)))
    block_m = max(block_m, next_pow2(G))
    block_n = 64 if big else 32
    warps = 4 if tma or block_m < 128 else 8
    return block_m, block_n, warps, 3 if big else 2


# whether descriptor plans launch through the compiled launcher's entry (``_launch``) like
# every other plan; off, they go through the JIT's dispatch.
# ``test_tma_direct_launch_matches_the_jit`` checks the direct launch bit for bit on a GPU
TMA_DIRECT = True

# whether the launch rule may choose the Gluon kernel (``prefill_gluon``); tests of the Triton
# kernel's own plans turn it off
GLUON = True

# K/V tiles come through the tensor copy engine only where a key tile lies inside one page:
# pages of at least this many tokens (the rule's BLOCK_N at D <= 128)
TMA_MIN_PAGE = 64


def prefill_tma(S: int, D: int, dtype: torch.dtype, capability: tuple[int, int],
                aligned: bool) -> bool:
    """Whether a call loads its K/V tiles through tensor descriptors (the tensor copy engine)
    instead of gathered pointer loads: on NVIDIA Hopper or newer (``capability >= (9, 0)`` of a
    device the caller knows compiles NVIDIA code: ROCm's gfx9 parts report 9.x too),
    16-bit caches, ``D`` a power of two in [16, 256] (a tile row is the head's ``D`` values and
    a descriptor's box is at most 256 wide), pages of at least TMA_MIN_PAGE tokens (so a key
    tile is one page's rows: the descriptor reads a box, not a gather), and ``aligned`` pools
    (nothing ``_descriptor_misfit`` finds)."""
    return (capability >= (9, 0) and dtype in (torch.float16, torch.bfloat16)
            and 16 <= D <= 256 and D & (D - 1) == 0 and S >= TMA_MIN_PAGE and aligned)


def prefill_tma_rows(D: int, dtype: torch.dtype, capability: tuple[int, int],
                     aligned: bool) -> bool:
    """Whether a call given the new tokens' rows (``k``, ``v``) loads the chunks' own key
    tiles from them through tensor descriptors: ``prefill_tma``'s rule without the page size
    (the rows are contiguous whatever the pages), for ``aligned`` rows (nothing
    ``_rows_misfit`` finds)."""
    return prefill_tma(TMA_MIN_PAGE, D, dtype, capability, aligned)


def prefill_off64(P: int, page_stride: int, S: int, F: int, N: int, row_stride: int) -> bool:
    """Whether the gathered and pointer loads need 64-bit element offsets: a pool of ``P``
    pages ``page_stride`` elements apart, each ``S`` rows of ``F = Hkv * D``, or ``N`` new-token
    rows ``row_stride`` apart (0 when none), spanning more than 2**31 elements (an offset past
    int32's). Within it the offsets are 32-bit: with 64-bit ones the gathered tile (pages of
    16, 128/64/8/3) spills 960 bytes a thread on triton 3.6's sm_90 build, with 32-bit ones
    544 (bench/results/2026-12-06-1450-paged_prefill-kernel-resources-cpu.md), and the
    gathered loads run 1.13-1.16x faster on the H100
    (bench/results/2026-12-06-1650-paged_prefill-row-tile-forms.md)."""
    pool = (P - 1) * page_stride + S * F
    rows = (N - 1) * row_stride + F if N and row_stride else 0
    return max(pool, rows) > 2**31


def _pool_descriptor(cache: torch.Tensor, block_n: int):
    """A descriptor over a pool ``[P, S, Hkv, D]`` as rows of ``Hkv * D`` values (page ``p``'s
    rows start at row ``p * stride(0) / (Hkv * D)``, so one layer's slice of a bigger pool and
    an interleaved K/V pool work without a copy), loading ``[block_n, D]`` boxes: one KV head's
    ``block_n`` keys of one page. A 2-D box feeds the tensor cores straight from shared memory
    (a 3-D ``[1, block_n, D]`` box reshaped to 2-D ran 1.4x slower on the H100)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    P, S, Hkv, D = cache.shape
    F = Hkv * D
    rows = (P - 1) * (cache.stride(0) // F) + S
    return TensorDescriptor(cache, [rows, F], [F, 1], [block_n, D])


def prefill_splits(programs: int, max_ctx: int, block_n: int, sms: int) -> int:
    """Key-range splits for ``programs`` (query tile, KV head) programs over contexts of at most
    ``max_ctx`` keys (the block table's span: the lengths are on the device). Unsplit while the
    programs fill at least SPLIT_BELOW_FILL of the ``sms`` SMs (split partials cost a float32
    write and read of ``out`` per split, and a split run of about one wave gains nothing);
    below that, enough splits for one wave, at most MAX_SPLITS and at most one per
    MIN_SPLIT_TILES key tiles of ``max_ctx``.
    """
    programs = max(programs, 1)
    if programs >= SPLIT_BELOW_FILL * sms:
        return 1
    want = sms // programs
    return max(1, min(want, MAX_SPLITS, max_ctx // (MIN_SPLIT_TILES * block_n)))


@triton.jit
def _tile_pages(p_bt, n, seq_len, lo_key, L, S: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page ids of keys ``[n, n + BLOCK_N)``: -1 for a key outside ``[lo_key, seq_len)``."""
    o_n = n + tl.arange(0, BLOCK_N)
    m_n = (o_n < seq_len) & (o_n >= lo_key) & (o_n // S < L)
    return tl.load(p_bt + o_n // S, mask=m_n, other=-1)


@triton.jit
def _pages_mapped(p_bt, lo, hi, P, S: tl.constexpr):
    """Whether every page holding keys ``[lo, hi)`` has an id in ``[0, P)`` (read 128 table
    entries at a time; true for an empty range)."""
    end = tl.cdiv(hi, S)
    bad = tl.zeros([], tl.int32)
    for j in range(lo // S, end, 128):
        o_j = j + tl.arange(0, 128)
        m_j = o_j < end
        b_pg = tl.load(p_bt + o_j, mask=m_j, other=0)
        bad += tl.sum((m_j & ((b_pg < 0) | (b_pg >= P))).to(tl.int32), axis=0)
    return bad == 0


@triton.jit
def _key_tile(b_q, b_acc, b_m, b_l, KC, VC, b_page, n, P, i_h, stride_kp, stride_vp,
              b_pos, window, scale_log2, S: tl.constexpr, HKV: tl.constexpr,
              D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              MASK: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
              OFF64: tl.constexpr):
    """Fold keys ``[n, n + BLOCK_N)`` (pages ``b_page`` from ``_tile_pages``) into the running
    softmax of the tile's rows. Element offsets are 32-bit unless OFF64 (``prefill_off64``):
    a tile's 64-bit offsets cost the kernel spilled registers.

    A key is read only if its page id lies in ``[0, P)`` (``_tile_pages`` gives -1 outside
    ``[lo_key, seq_len)``); any other is loaded as 0 and masked, so a NaN there changes nothing.
    MASK adds each row's causal (and, WINDOW, window) visibility; without it every read key is
    visible to all rows.
    """
    o_n = n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_n = (b_page >= 0) & (b_page < P)
    o_row = (o_n % S) * (HKV * D) + i_h * D
    b_base = b_page
    if OFF64:
        o_row = o_row.to(tl.int64)
        b_base = b_page.to(tl.int64)
    m_kv = m_n[:, None] & (o_d < D)[None, :]
    p_k = KC + (b_base * stride_kp + o_row)[:, None] + o_d[None, :]
    b_k = tl.load(p_k, mask=m_kv, other=0.0)
    b_s = _visible(dot(b_q, tl.trans(b_k), PRECISION) * scale_log2, m_n, o_n, b_pos, window,
                   MASK, WINDOW)
    b_p, b_alpha, b_m, b_l = _softmax_step(b_s, b_m, b_l)
    p_v = VC + (b_base * stride_vp + o_row)[:, None] + o_d[None, :]
    b_v = tl.load(p_v, mask=m_kv, other=0.0)
    b_acc = b_acc * b_alpha[:, None] + dot(b_p.to(b_v.dtype), b_v, PRECISION)
    return b_acc, b_m, b_l


@triton.jit
def _visible(b_s, m_n, o_n, b_pos, window, MASK: tl.constexpr, WINDOW: tl.constexpr):
    """Scores ``b_s`` with -inf where a key is not read (``m_n`` false) or, MASK, not visible to
    the row at position ``b_pos`` (causal, and WINDOW, inside its window)."""
    if MASK:
        m_vis = m_n[None, :] & (o_n[None, :] <= b_pos[:, None])
        if WINDOW:
            m_vis = m_vis & (o_n[None, :] > b_pos[:, None] - window)
        return tl.where(m_vis, b_s, float("-inf"))
    return tl.where(m_n[None, :], b_s, float("-inf"))


@triton.jit
def _softmax_step(b_s, b_m, b_l):
    """One key tile's scores ``b_s`` (base 2) into the running max ``b_m`` and sum ``b_l``:
    returns the tile's weights, the factor rescaling what came before, and the new max and
    sum. A row with no visible key yet keeps max -inf and weights 0."""
    b_mn = tl.maximum(b_m, tl.max(b_s, 1))
    b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    b_alpha = tl.exp2(b_m - b_ms)
    b_p = tl.exp2(b_s - b_ms[:, None])
    return b_p, b_alpha, b_mn, b_l * b_alpha + tl.sum(b_p, 1)


@triton.jit
def _key_tile_tma(b_q, b_acc, b_m, b_l, KD, VD, page_rows, p_bt, n, seq_len, lo_key, P, L, i_h,
                  b_pos, window, scale_log2, S: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASK: tl.constexpr, WINDOW: tl.constexpr,
                  PRECISION: tl.constexpr):
    """``_key_tile`` with the tile (``BLOCK_N <= S``, BLOCK_N-aligned, so inside one page)
    loaded whole by the tensor copy engine through descriptors ``KD``, ``VD`` over the pools'
    rows (page ``p``'s first row ``p * page_rows``). The page id is one scalar load, so the
    pipeliner issues it and the tile's load stages ahead. A page id outside ``[0, P)`` reads
    rows ``-BLOCK_N .. -1``: out of the descriptor's bounds, so zeros, and masked. The
    page's rows past the visible keys are read too, so masked tiles zero their V rows (a NaN
    there would otherwise reach the accumulator through ``0 * NaN``)."""
    o_n = n + tl.arange(0, BLOCK_N)
    pg = tl.load(p_bt + n // S, mask=n // S < L, other=-1)
    ok = (pg >= 0) & (pg < P)
    row = tl.where(ok, pg * page_rows + n % S, -BLOCK_N)     # rows -BLOCK_N..-1: all zeros
    b_k = KD.load([row, i_h * D])
    m_n = ok & (o_n < seq_len) & (o_n >= lo_key)
    b_s = _visible(dot(b_q, tl.trans(b_k), PRECISION) * scale_log2, m_n, o_n, b_pos, window,
                   MASK, WINDOW)
    b_p, b_alpha, b_m, b_l = _softmax_step(b_s, b_m, b_l)
    b_v = VD.load([row, i_h * D])
    if MASK:
        b_v = tl.where(m_n[:, None], b_v, 0.0)
    b_acc = b_acc * b_alpha[:, None] + dot(b_p.to(b_v.dtype), b_v, PRECISION)
    return b_acc, b_m, b_l


@triton.jit
def _key_tile_rows(b_q, b_acc, b_m, b_l, KN, VN, n, seq_len, lo_key, i_h, new_row0, stride_kn,
                   stride_vn, b_pos, window, scale_log2, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, MASK: tl.constexpr, WINDOW: tl.constexpr,
                   PRECISION: tl.constexpr, NEW_TMA: tl.constexpr, OFF64: tl.constexpr):
    """``_key_tile`` for keys ``[n, n + BLOCK_N)`` of the chunk itself, read from the new
    tokens' rows ``k, v [N, Hkv, D]`` (key position ``j`` is row ``new_row0 + j``) instead of
    their pages: contiguous rows, with no page ids (the caller reads rows only where every
    page of them is mapped, ``_pages_mapped``), through descriptors ``KN``, ``VN`` over
    ``[N, Hkv * D]`` (NEW_TMA) or pointer loads. Keys outside ``[lo_key, seq_len)`` (past it:
    the next sequence's rows, or zeros past ``N``) are masked, and in masked tiles their V rows
    zeroed (a NaN there would otherwise reach the accumulator)."""
    o_n = n + tl.arange(0, BLOCK_N)
    m_n = (o_n < seq_len) & (o_n >= lo_key)
    if NEW_TMA:
        b_k = KN.load([new_row0 + n, i_h * D])
    else:
        o_d = tl.arange(0, BLOCK_D)
        o_row = new_row0 + o_n
        if OFF64:
            o_row = o_row.to(tl.int64)
        m_kv = m_n[:, None] & (o_d < D)[None, :]
        b_k = tl.load(KN + (o_row * stride_kn + i_h * D)[:, None] + o_d[None, :], mask=m_kv,
                      other=0.0)
    b_s = _visible(dot(b_q, tl.trans(b_k), PRECISION) * scale_log2, m_n, o_n, b_pos, window,
                   MASK, WINDOW)
    b_p, b_alpha, b_m, b_l = _softmax_step(b_s, b_m, b_l)
    if NEW_TMA:
        b_v = VN.load([new_row0 + n, i_h * D])
        if MASK:
            b_v = tl.where(m_n[:, None], b_v, 0.0)
    else:
        b_v = tl.load(VN + (o_row * stride_vn + i_h * D)[:, None] + o_d[None, :], mask=m_kv,
                      other=0.0)
    b_acc = b_acc * b_alpha[:, None] + dot(b_p.to(b_v.dtype), b_v, PRECISION)
    return b_acc, b_m, b_l


@triton.jit
def _key_tile_mixed(b_q, b_acc, b_m, b_l, KC, VC, KR, VR, p_bt, n, pos0, seq_len, lo_key, P, L,
                    i_h, new_row0, stride_kp, stride_vp, stride_kn, stride_vn, b_pos, window,
                    scale_log2, S: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr,
                    WINDOW: tl.constexpr, PRECISION: tl.constexpr, OFF64: tl.constexpr):
    """The one tile holding the chunk's first position ``pos0`` past its start: keys before
    ``pos0`` from their pages (ids in ``[0, P)`` only), the rest from the new tokens' rows
    (``KR``, ``VR``: pointers, whatever loads the other row tiles), by pointer loads with
    complementary masks."""
    o_n = n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_d = (o_d < D)[None, :]
    b_page = _tile_pages(p_bt, n, pos0, lo_key, L, S, BLOCK_N)
    m_pg = (b_page >= 0) & (b_page < P)
    m_rw = (o_n >= pos0) & (o_n < seq_len) & (o_n >= lo_key)
    o_row = (o_n % S) * (HKV * D) + i_h * D
    b_base = b_page
    o_rw = new_row0 + o_n
    if OFF64:
        o_row = o_row.to(tl.int64)
        b_base = b_page.to(tl.int64)
        o_rw = o_rw.to(tl.int64)
    b_k = (tl.load(KC + (b_base * stride_kp + o_row)[:, None] + o_d[None, :],
                   mask=m_pg[:, None] & m_d, other=0.0)
           + tl.load(KR + (o_rw * stride_kn + i_h * D)[:, None] + o_d[None, :],
                     mask=m_rw[:, None] & m_d, other=0.0))
    m_n = m_pg | m_rw
    b_s = _visible(dot(b_q, tl.trans(b_k), PRECISION) * scale_log2, m_n, o_n, b_pos, window,
                   MASK, WINDOW)
    b_p, b_alpha, b_m, b_l = _softmax_step(b_s, b_m, b_l)
    b_v = (tl.load(VC + (b_base * stride_vp + o_row)[:, None] + o_d[None, :],
                   mask=m_pg[:, None] & m_d, other=0.0)
           + tl.load(VR + (o_rw * stride_vn + i_h * D)[:, None] + o_d[None, :],
                     mask=m_rw[:, None] & m_d, other=0.0))
    b_acc = b_acc * b_alpha[:, None] + dot(b_p.to(b_v.dtype), b_v, PRECISION)
    return b_acc, b_m, b_l


@triton.jit
def _key_run(b_q, b_acc, b_m, b_l, KC, VC, KD, VD, KN, VN, KR, VR, page_rows, p_bt, lo, hi, pos0,
             new_row0, seq_len, lo_key, P, L, i_h, stride_kp, stride_vp, stride_kn, stride_vn,
             b_pos, window, scale_log2, S: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr,
             WINDOW: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
             TMA: tl.constexpr, NEW: tl.constexpr, NEW_TMA: tl.constexpr, OFF64: tl.constexpr):
    """Key tiles ``[lo, hi)`` (BLOCK_N-aligned) in BLOCK_N steps. Without NEW, all from their
    pages (``_page_run``). With NEW the chunk's own keys (positions from ``pos0``) come from
    the new tokens' rows: tiles before the one holding ``pos0`` from pages, that one mixed when
    ``pos0`` lies inside it (``_key_tile_mixed``; with descriptors for both, its pages' half
    and then its rows' half, each a descriptor load: the mixed tile's two address tiles made
    the 64-row tile spill 1,592 bytes a thread under triton 3.6, the halves 224), the rest
    from rows (``_key_tile_rows``)."""
    if NEW:
        first = tl.maximum(pos0, 0) // BLOCK_N * BLOCK_N     # the tile holding pos0
        split = tl.minimum(tl.maximum(first, lo), tl.maximum(hi, lo))
        b_acc, b_m, b_l = _page_run(
            b_q, b_acc, b_m, b_l, KC, VC, KD, VD, page_rows, p_bt, lo, split, seq_len, lo_key,
            P, L, i_h, stride_kp, stride_vp, b_pos, window, scale_log2, S, HKV, D, BLOCK_N,
            BLOCK_D, MASK, WINDOW, PRECISION, PREFETCH, TMA, OFF64)
        start = split
        if (pos0 > first) & (first >= lo) & (first < hi):
            if TMA and NEW_TMA:     # both halves through descriptors, one after the other
                b_acc, b_m, b_l = _key_tile_tma(
                    b_q, b_acc, b_m, b_l, KD, VD, page_rows, p_bt, first, pos0, lo_key, P, L,
                    i_h, b_pos, window, scale_log2, S, D, BLOCK_N, True, WINDOW, PRECISION)
                b_acc, b_m, b_l = _key_tile_rows(
                    b_q, b_acc, b_m, b_l, KN, VN, first, seq_len, tl.maximum(lo_key, pos0),
                    i_h, new_row0, stride_kn, stride_vn, b_pos, window, scale_log2, D,
                    BLOCK_N, BLOCK_D, True, WINDOW, PRECISION, NEW_TMA, OFF64)
            else:
                b_acc, b_m, b_l = _key_tile_mixed(
                    b_q, b_acc, b_m, b_l, KC, VC, KR, VR, p_bt, first, pos0, seq_len, lo_key, P,
                    L, i_h, new_row0, stride_kp, stride_vp, stride_kn, stride_vn, b_pos,
                    window, scale_log2, S, HKV, D, BLOCK_N, BLOCK_D, MASK, WINDOW, PRECISION,
                    OFF64)
            start = first + BLOCK_N
        for n in range(start, hi, BLOCK_N):
            b_acc, b_m, b_l = _key_tile_rows(
                b_q, b_acc, b_m, b_l, KN, VN, n, seq_len, lo_key, i_h, new_row0, stride_kn,
                stride_vn, b_pos, window, scale_log2, D, BLOCK_N, BLOCK_D, MASK, WINDOW,
                PRECISION, NEW_TMA, OFF64)
    else:
        b_acc, b_m, b_l = _page_run(
            b_q, b_acc, b_m, b_l, KC, VC, KD, VD, page_rows, p_bt, lo, hi, seq_len, lo_key, P,
            L, i_h, stride_kp, stride_vp, b_pos, window, scale_log2, S, HKV, D, BLOCK_N,
            BLOCK_D, MASK, WINDOW, PRECISION, PREFETCH, TMA, OFF64)
    return b_acc, b_m, b_l


@triton.jit
def _page_run(b_q, b_acc, b_m, b_l, KC, VC, KD, VD, page_rows, p_bt, lo, hi, seq_len, lo_key, P,
              L, i_h, stride_kp, stride_vp, b_pos, window, scale_log2, S: tl.constexpr,
              HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              MASK: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
              PREFETCH: tl.constexpr, TMA: tl.constexpr, OFF64: tl.constexpr):
    """Key tiles ``[lo, hi)`` from their pages, in BLOCK_N steps. TMA: each tile through the
    descriptors (``_key_tile_tma``). Else PREFETCH loads each tile's page ids one tile ahead (a
    loop-carried value), so the K/V loads' addresses do not wait on a load of the same
    iteration; without it each tile loads its own page ids."""
    if TMA:
        for n in range(lo, hi, BLOCK_N):
            b_acc, b_m, b_l = _key_tile_tma(
                b_q, b_acc, b_m, b_l, KD, VD, page_rows, p_bt, n, seq_len, lo_key, P, L, i_h,
                b_pos, window, scale_log2, S, D, BLOCK_N, MASK, WINDOW, PRECISION)
    elif PREFETCH:
        b_page = _tile_pages(p_bt, lo, seq_len, lo_key, L, S, BLOCK_N)
        for n in range(lo, hi, BLOCK_N):
            b_next = _tile_pages(p_bt, n + BLOCK_N, seq_len, lo_key, L, S, BLOCK_N)
            b_acc, b_m, b_l = _key_tile(
                b_q, b_acc, b_m, b_l, KC, VC, b_page, n, P, i_h, stride_kp, stride_vp, b_pos,
                window, scale_log2, S, HKV, D, BLOCK_N, BLOCK_D, MASK, WINDOW, PRECISION, OFF64)
            b_page = b_next
    else:
        for n in range(lo, hi, BLOCK_N):
            b_page = _tile_pages(p_bt, n, seq_len, lo_key, L, S, BLOCK_N)
            b_acc, b_m, b_l = _key_tile(
                b_q, b_acc, b_m, b_l, KC, VC, b_page, n, P, i_h, stride_kp, stride_vp, b_pos,
                window, scale_log2, S, HKV, D, BLOCK_N, BLOCK_D, MASK, WINDOW, PRECISION, OFF64)
    return b_acc, b_m, b_l


# The batch's sizes change every engine step; a specialization on them (an int that is 1 or a
# multiple of 16 compiles its own binary, as does each constexpr value) would put a compile of
# a second or more inside a serving step whenever a new combination first appears. So they are
# not specialized, and the sequence starts are read in chunks of one fixed width.
SEQ_CHUNK = 128


@triton.jit(do_not_specialize=["N", "B", "num_tiles", "window", "NUM_SPLITS"])
def _paged_prefill_kernel(
    Q, KC, VC, BT, QS, SL, O, LSE, Out, Lse, Counts, KD, VD, KN, VN, KR, VR,
    N, B, P, L, page_rows, num_tiles, window, scale_log2, NUM_SPLITS,
    stride_qn, stride_qh, stride_kp, stride_vp, stride_bt, stride_on, stride_oh, stride_os,
    stride_ln, stride_lh, stride_ls, stride_kn, stride_vn,
    S: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, PREFETCH: tl.constexpr, FUSED_MERGE: tl.constexpr,
    BLOCK_S: tl.constexpr, TMA: tl.constexpr, NEW: tl.constexpr, NEW_TMA: tl.constexpr,
    OFF64: tl.constexpr,
):
    i_t = num_tiles - 1 - tl.program_id(0)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    # the sequence: how many tile starts T_k = query_start[k] // BLOCK_Q + k lie at or below i_t
    count = tl.full([], 0, tl.int32)
    for start in range(0, B + 1, BLOCK_B):
        o_b = start + tl.arange(0, BLOCK_B)
        b_qs = tl.minimum(tl.maximum(tl.load(QS + o_b, mask=o_b <= B, other=N), 0), N)
        count += tl.sum(((b_qs // BLOCK_Q + o_b <= i_t) & (o_b <= B)).to(tl.int32), 0)
    i_b = tl.minimum(tl.maximum(count - 1, 0), B)
    q_lo = tl.minimum(tl.maximum(tl.load(QS + i_b), 0), N)
    q_hi = tl.minimum(tl.maximum(tl.load(QS + tl.minimum(i_b + 1, B)), q_lo), N)
    q_hi = tl.where(i_b == B, N, q_hi)                 # B: the padding rows after the last
    t0 = q_lo + (i_t - (q_lo // BLOCK_Q + i_b)) * BLOCK_Q
    if (t0 < q_lo) | (t0 >= q_hi):
        return
    o_r = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_tok = t0 + o_r // G
    o_head = i_h * G + o_r % G
    m_r = (o_r < BLOCK_Q * G) & (o_tok < q_hi)
    p_o = (O + o_tok.to(tl.int64)[:, None] * stride_on + o_head[:, None] * stride_oh
           + i_s * stride_os + o_d[None, :])
    p_lse = LSE + o_tok.to(tl.int64) * stride_ln + o_head * stride_lh + i_s * stride_ls
    m_o = m_r[:, None] & (o_d < D)[None, :]
    o_out = o_tok.to(tl.int64) * (HKV * G) + o_head       # row of out [N, Hq, D], lse [N, Hq]
    if i_b == B:
        if FUSED_MERGE:   # padding rows: every split writes the same final zeros, no merge
            tl.store(Out + o_out[:, None] * D + o_d[None, :],
                     tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(Out.dtype.element_ty), mask=m_o)
            tl.store(Lse + o_out, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=m_r)
        else:
            tl.store(p_o, tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(p_o.dtype.element_ty),
                     mask=m_o)
            tl.store(p_lse, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=m_r)
        return
    seq_len = tl.minimum(tl.maximum(tl.load(SL + i_b), 0), L * S)
    pos0 = seq_len - (q_hi - q_lo)                      # position of the sequence's first query
    new_row0 = q_lo - pos0                              # NEW: key j >= pos0 is k's row
    b_pos = pos0 + (o_tok - q_lo)
    p_first = pos0 + (t0 - q_lo)
    p_last = pos0 + tl.minimum(t0 + BLOCK_Q, q_hi) - 1 - q_lo
    hi = tl.minimum(p_last + 1, seq_len)
    lo_key = 0
    if WINDOW:
        lo_key = tl.maximum(p_first - window + 1, 0)
    p_q = Q + o_tok.to(tl.int64)[:, None] * stride_qn + o_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_o, other=0.0)
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    p_bt = BT + i_b.to(tl.int64) * stride_bt
    rows0 = pos0
    if NEW:   # rows only where the pages of the chunk's keys are all mapped: else pages
        # alone decide (an unmapped one is left out), as without the rows
        rows0 = tl.where(_pages_mapped(p_bt, pos0, seq_len, P, S), pos0, seq_len)
    # split i_s of NUM_SPLITS takes BLOCK_N-aligned keys [s_lo, s_hi) of the tile's range
    k_lo = lo_key // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - k_lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = k_lo + i_s * chunk
    s_hi = tl.minimum(s_lo + chunk, hi)
    # interior: keys every row sees (at or before the first row's position, and, WINDOW,
    # inside the last row's window)
    mid_hi = tl.maximum((p_first + 1) // BLOCK_N * BLOCK_N, 0)
    mid_lo = 0
    if WINDOW:
        mid_lo = tl.minimum(tl.cdiv(tl.maximum(p_last - window + 1, 0), BLOCK_N) * BLOCK_N,
                            mid_hi)
        b_acc, b_m, b_l = _key_run(
            b_q, b_acc, b_m, b_l, KC, VC, KD, VD, KN, VN, KR, VR, page_rows, p_bt,
            tl.maximum(k_lo, s_lo), tl.minimum(mid_lo, s_hi), rows0, new_row0, seq_len,
            lo_key, P, L, i_h, stride_kp, stride_vp, stride_kn, stride_vn, b_pos, window,
            scale_log2, S, HKV, D, BLOCK_N, BLOCK_D, True, True, PRECISION, PREFETCH, TMA, NEW,
            NEW_TMA, OFF64)
    b_acc, b_m, b_l = _key_run(
        b_q, b_acc, b_m, b_l, KC, VC, KD, VD, KN, VN, KR, VR, page_rows, p_bt,
        tl.maximum(mid_lo, s_lo), tl.minimum(mid_hi, s_hi), rows0, new_row0, seq_len, lo_key, P,
        L, i_h, stride_kp, stride_vp, stride_kn, stride_vn, b_pos, window, scale_log2, S, HKV,
        D, BLOCK_N, BLOCK_D, False, WINDOW, PRECISION, PREFETCH, TMA, NEW, NEW_TMA, OFF64)
    b_acc, b_m, b_l = _key_run(
        b_q, b_acc, b_m, b_l, KC, VC, KD, VD, KN, VN, KR, VR, page_rows, p_bt,
        tl.maximum(mid_hi, s_lo), s_hi, rows0, new_row0, seq_len, lo_key, P, L, i_h, stride_kp,
        stride_vp, stride_kn, stride_vn, b_pos, window, scale_log2, S, HKV, D, BLOCK_N, BLOCK_D,
        True, WINDOW, PRECISION, PREFETCH, TMA, NEW, NEW_TMA, OFF64)
    b_has = b_l > 0
    b_out = b_acc / tl.where(b_has, b_l, 1.0)[:, None]
    b_lse = tl.where(b_has, (b_m + tl.log2(tl.where(b_has, b_l, 1.0))) * LN2,
                     float("-inf"))
    tl.store(p_o, b_out.to(p_o.dtype.element_ty), mask=m_o)
    tl.store(p_lse, b_lse, mask=m_r)
    if FUSED_MERGE:    # the last split of this (tile, KV head) merges the tile's rows
        if arrive(Counts + i_t * HKV + i_h, NUM_SPLITS):
            merge_rows(p_o - i_s * stride_os, stride_os, p_lse - i_s * stride_ls, m_r,
                       Out + o_out[:, None] * D + o_d[None, :], Lse + o_out, NUM_SPLITS, D,
                       BLOCK_D, BLOCK_S)
            tl.atomic_xchg(Counts + i_t * HKV + i_h, 0)


class PrefillPlan(NamedTuple):
    """What a call of one argument signature and knobs launches (``_plan``)."""

    splits: int
    gluon: bool          # the Gluon kernel's plan (unsplit)
    launch: Launch       # the two-launch form's first launch (an unsplit plan's only one; the
                         # Gluon kernel's ``DescribedLaunch``): its grid, integers, constants
                         # and binary key
    fused: Launch | None     # the one-launch form (split plans)
    merge: tuple | None  # ``merge_plan`` of the two-launch form (None unsplit)
    ready: list          # ``load_capture_form``'s: empty until the two-launch form ran eagerly
    like_q: bool         # out allocated as ``empty_like(q)`` (``split_outputs``)


_PLANS: dict = {}
_RULES = (None,) * 5 + (True,) + (None,) * 4      # no knob given: every rule's own choice


def paged_prefill_attention_fwd(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    query_start: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
    window: int = 0, *, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, num_splits: int | None = None,
    prefetch: bool = True, tma: bool | None = None, k: torch.Tensor | None = None,
    v: torch.Tensor | None = None, new_tma: bool | None = None, off64: bool | None = None,
    gluon: bool | None = None, signature=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate, pick the tile (``prefill_tile``) and the splits (``prefill_splits``), launch,
    and merge split partials (in the launch, or ``_splitk.merge_split_outputs`` under capture).
    Inputs are already checked by the op;
    the keyword knobs override the rules (tests, benches); ``prefetch`` (on unless a caller
    turns it off) loads page ids a tile ahead (``_key_run``; docs/tuning.md); ``tma`` forces
    K/V tiles through descriptors on (where the tile fits a page) or off, else
    ``prefill_tma`` decides. ``k``, ``v`` ``[N, Hkv, D]``: the new tokens' rows the pool
    holds at the chunks' positions; the chunks' own key tiles are read from them
    (``_key_tile_rows``), through descriptors where ``new_tma`` (or, None,
    ``prefill_tma_rows``) says so; ``off64`` forces 64-bit element offsets on or off, else
    ``prefill_off64`` decides; ``gluon`` forces the Gluon kernel (``paged_prefill_gluon``)
    on (where it applies) or off, else ``prefill_gluon`` decides. A launch's plan
    (tile, splits, strides, binary key) is kept per argument signature (``signature``: the
    op's, of every tensor with scale and window, else one is computed here) and knobs.
    Returns ``(out, lse)``."""
    N, Hq, D = q.shape
    if N == 0:
        return split_outputs(0, Hq, D, 1, q.dtype, q.device, 0)[:2]
    tensors = (q, k_cache, v_cache, block_table, query_start, seq_lens)
    news = (k, v) if k is not None else None
    if signature is None:
        signature = (*(sig(t) for t in tensors), scale, window,
                     *(sig(t) for t in news or ()))
    knobs = (block_m, block_n, num_warps, num_stages, num_splits, prefetch, tma, new_tma, off64,
             gluon)
    # the op's int signature keys the rules' plan; knobs or a signature made here key their own
    key = signature if knobs == _RULES and type(signature) is int else (signature, knobs)
    plan = _PLANS.get(key) or keep_plan(_PLANS, key,
                                        _plan(*tensors, news, scale, window, knobs))
    # out [N, Hq, D] and lse [N, Hq] are a decode launch's outputs with N rows
    out, lse, part_o, part_l, count = split_outputs(
        N, Hq, D, plan.splits, q.dtype, q.device, plan.launch.grid[0] * plan.launch.grid[1],
        q if plan.like_q else None)
    if plan.gluon:                    # unsplit: out and lse themselves, no counters
        paged_prefill_gluon_fwd(*tensors, *news, out, lse, plan.launch)
        return out, lse
    meta = plan.launch.meta
    # the descriptors hold the tensors' addresses, so they are made each call (without TMA
    # the kernel never reads the first two arguments, without NEW the last two)
    descs = ((_pool_descriptor(k_cache, meta["BLOCK_N"]),
              _pool_descriptor(v_cache, meta["BLOCK_N"])) if meta["TMA"] else
             (k_cache, v_cache))
    rows = ((k_cache, v_cache) if news is None else
            tuple(_rows_descriptor(t, meta["BLOCK_N"]) for t in news) if meta["NEW_TMA"] else
            news)
    launch_split((*tensors, part_o, part_l, out, lse), count, seq_lens,
                 (*descs, *rows, *(news or (k_cache, v_cache))), plan)
    return out, lse


def _rows_descriptor(rows: torch.Tensor, block_n: int):
    """A descriptor over new tokens' rows ``[N, Hkv, D]`` (heads contiguous in a row, any row
    stride) as ``[N, Hkv * D]``, loading ``[block_n, D]`` boxes: one KV head's keys of
    ``block_n`` consecutive tokens."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    N, Hkv, D = rows.shape
    return TensorDescriptor(rows, [N, Hkv * D], [rows.stride(0), 1], [block_n, D])


def _aligned16(tensors, stride: int) -> bool:
    """Whether ``tensors`` start on 16-byte boundaries and rows ``stride`` elements apart do
    too (what a descriptor's base and strides need)."""
    return (stride * tensors[0].element_size() % 16 == 0
            and all(t.data_ptr() % 16 == 0 for t in tensors))


def _rows_misfit(k: torch.Tensor, v: torch.Tensor) -> str | None:
    """What new-token rows ``[N, Hkv, D]`` (heads contiguous in a row: ``_plan`` checks) lack
    for ``_rows_descriptor``, or None: D a power of two (a box of D values), 16-byte aligned
    bases and row strides, fewer than ``2**31`` rows."""
    N, _, D = k.shape
    if D != next_pow2(D):
        return f"D a power of two, got D {D}"
    for name, t in (("k", k), ("v", v)):
        if not _aligned16((t,), t.stride(0)):
            return f"{name} with a 16-byte aligned base and row stride, got stride {t.stride(0)}"
    if N >= 2**31:
        return f"fewer than 2**31 rows, got {N}"
    return None


def _descriptor_misfit(k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """What pools ``[P, S, Hkv, D]`` lack for descriptors over their rows (``_pool_descriptor``),
    or None: one page stride for K and V, a multiple of ``Hkv * D`` and at least a page (each
    page's rows its own), 16-byte aligned bases and strides, at least one page, and fewer than
    ``2**31`` rows (descriptor coordinates are int32)."""
    P, S, Hkv, D = k_cache.shape
    F, stride = Hkv * D, k_cache.stride(0)
    if v_cache.stride(0) != stride:
        return f"k_cache and v_cache with one page stride, got {stride} and {v_cache.stride(0)}"
    if stride % F or stride < S * F:
        return (f"a page stride that is a multiple of Hkv * D = {F} and at least S * Hkv * D, "
                f"got {stride}")
    if not _aligned16((k_cache, v_cache), stride):
        return "16-byte aligned pools and page strides"
    if not 0 < P * (stride // F) < 2**31:
        return f"between 1 and 2**31 - 1 rows of Hkv * D, got {P * (stride // F)}"
    return None


def _plan(q, k_cache, v_cache, block_table, query_start, seq_lens, news, scale, window, knobs):
    N, Hq, D = q.shape
    P, S, Hkv, _ = k_cache.shape
    B, L = block_table.shape
    G = Hq // Hkv
    (block_m, block_n, num_warps, num_stages, num_splits, prefetch, tma, new_tma, off64,
     gluon) = knobs
    # a forced tile, split or load form is the Triton kernel's (tests, benches)
    forced = any(x is not None for x in (block_m, block_n, num_warps, num_stages, num_splits,
                                         tma, new_tma, off64))
    misfit = _descriptor_misfit(k_cache, v_cache)
    if tma is None:
        tma = nvidia_ptx(q.device) and prefill_tma(S, D, q.dtype, cuda_capability(q.device),
                                                   misfit is None)
    elif tma and misfit:
        raise ValueError(f"tma: expected {misfit}")
    if news is not None and any(t.stride(2) != 1 or t.stride(1) != D for t in news):
        raise ValueError(f"k, v: expected each row's heads contiguous (strides [*, {D}, 1]), "
                         f"got {news[0].stride()} and {news[1].stride()}")
    rows_misfit = _rows_misfit(*news) if news is not None else "k and v"
    if new_tma is None:
        new_tma = news is not None and nvidia_ptx(q.device) and prefill_tma_rows(
            D, q.dtype, cuda_capability(q.device), rows_misfit is None)
    elif new_tma and rows_misfit:
        raise ValueError(f"new_tma: expected {rows_misfit}")
    bm, bn, nw, ns = prefill_tile(N, B, G, D, q.dtype, tma)
    bm, bn = block_m or bm, block_n or bn
    nw, ns = num_warps or nw, num_stages or ns
    if bm < G:
        raise ValueError(f"block_m: expected at least G={G} rows, got {bm}")
    if tma and (bn > S or D != next_pow2(D)):
        raise ValueError(f"tma: expected a key tile inside a page (block_n {bn} <= S {S}) and "
                         f"D a power of two, got D {D}")
    block_q = bm // G
    num_tiles = N // block_q + B + 1
    nsp = num_splits or prefill_splits(N // block_q * Hkv, L * S, bn, sm_count(q.device))
    scale = D ** -0.5 if scale is None else scale
    # out and lse, or the partials, are contiguous [N, Hq, (nsp,) D] and [N, Hq, (nsp)]
    out_strides = ((Hq * nsp * D, nsp * D, D, Hq * nsp, nsp, 1) if nsp > 1 else
                   (Hq * D, D, 0, Hq, 1, 0))
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), v_cache.stride(0),
               block_table.stride(0), *out_strides,
               *((news[0].stride(0), news[1].stride(0)) if news is not None else (0, 0)))
    page_rows = k_cache.stride(0) // (Hkv * D)
    if off64 is None:
        off64 = prefill_off64(P, max(k_cache.stride(0), v_cache.stride(0)), S, Hkv * D, N,
                              0 if news is None else max(t.stride(0) for t in news))
    fit = (misfit is None and rows_misfit is None and q.stride(2) == 1 and q.stride(1) == D
           and _aligned16((q,), q.stride(0)))
    structural = nvidia_ptx(q.device) and prefill_gluon(
        cuda_capability(q.device), q.dtype, D, S, window, news is not None, fit, 1,
        N // 128 + B + 1)
    if gluon is None:
        gluon = GLUON and structural and nsp == 1 and not forced
    elif gluon and not structural:
        raise ValueError("gluon: expected an sm_90 device, 16-bit K/V, D 64 or 128, pages of a "
                         "multiple of 16, no window, the chunk's rows and descriptor-fit "
                         "tensors")
    if gluon:
        grid, ints, meta = gluon_plan(q, k_cache, block_table, scale)
        return PrefillPlan(1, True, gluon_launch(grid, ints, meta, D, S, q.dtype), None, None,
                           [], standard_strides(q))
    ints = (N, B, P, L, page_rows, num_tiles, window, scale * LOG2E.value, nsp, *strides)
    meta = dict(S=S, HKV=Hkv, G=G, D=D, BLOCK_Q=block_q, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_D=next_pow2(max(D, 16)), BLOCK_B=SEQ_CHUNK,
                WINDOW=window > 0, PRECISION=dot_precision(q.dtype), PREFETCH=prefetch,
                FUSED_MERGE=False, BLOCK_S=1, TMA=bool(tma), NEW=news is not None,
                NEW_TMA=bool(new_tma), OFF64=bool(off64), num_warps=nw, num_stages=ns)
    merge = merge_plan(N, Hq, nsp, D, q.dtype, False, q.device) if nsp > 1 else None
    # N, B, num_tiles and window are not specialized (one binary serves every value of them),
    # so they stay out of the binary's key; the rest of what the kernel specializes on is in
    # it, with the inputs' alignments (out, lse and the partials are always 16-byte aligned)
    token = ("prefill", P, L, nsp, strides, Hq, q.dtype, q.device, tuple(meta.values()),
             tuple(t.data_ptr() % 16 == 0 for t in (q, k_cache, v_cache, block_table,
                                                     query_start, seq_lens, *(news or ()))))
    if (tma or new_tma) and not TMA_DIRECT:
        token = None                # descriptor plans launch through the JIT
    fused = None
    if nsp > 1:   # the one-launch form: its own constants, so its own binary key
        f_meta = dict(meta, FUSED_MERGE=True, BLOCK_S=next_pow2(nsp))
        fused = Launch(_paged_prefill_kernel, (num_tiles, Hkv, nsp),
                       None if token is None else ("fused", *token), ints, f_meta)
    return PrefillPlan(nsp, False,
                       Launch(_paged_prefill_kernel, (num_tiles, Hkv, nsp), token, ints, meta),
                       fused, merge, [], standard_strides(q))
