"""Triton kernels for ``kvops.paged_gather_merged``: copy trains of pages, graph-replayable.

The work of a step is the pages of the first ``num_trains`` rows of ``trains`` (rows that do not
lie in the pool / arena count 0 pages), known on the device only. A grid sized from shapes (64-256
programs per SM by ``default_programs_per_sm``, never more than the arena's pages allow) splits
it: a page is ``UNITS`` blocks of ``BLOCK`` contiguous elements (a power of two dividing ``S * Hkv
* D``, so there are no masks and every access is a 16-byte vector), and the blocks of the step
are cut into equal contiguous ranges, one per program. A program finds the train holding its
first block, then walks forward through its range, stepping to the next train when it crosses
one's end (the next train's row is loaded one train ahead, so a step waits on no load). One long
train is spread over every program, and many one-page trains are packed several to a program, so
both fill the GPU.

Finding the first train, two ways (``FUSED``):

- few trains (``T <= FUSE_MAX_TRAINS``, a decode step's moves): one launch; every program loads
  the used rows, and a cumulative sum of their pages in registers gives the train directly;
- many trains: ``_train_ends_kernel`` (one program) first writes the running page counts
  ``ends[t + 1] = pages of rows 0..t``, and each program searches ``ends`` ``FANOUT`` entries a
  round (three dependent rounds for 4,096 trains, where a binary search takes 13).

``num_trains`` is read on the device, so one captured graph serves any count up to ``T``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._common import check_copy_block, next_pow2, page_copy_block, sm_count
from kvops.kernels._launch import keep_plan, launch

# Up to this many rows, one launch (every program re-reads the rows: 12 KiB at 1024);
# docs/tuning.md.
FUSE_MAX_TRAINS = 1024
# Rows times programs an SM that one launch may re-read (see default_programs_per_sm).
FUSED_ROW_READS_PER_SM = 131072


@triton.jit
def _row_pages(b_src, b_dst, b_n, P, Q):
    """Pages a train row moves: ``n`` when ``[src, src+n)`` lies in the pool and ``[dst, dst+n)``
    in the arena, else 0."""
    m_ok = (b_n >= 1) & (b_src >= 0) & (b_src <= P - b_n) & (b_dst >= 0) & (b_dst <= Q - b_n)
    return tl.where(m_ok, b_n, 0)


@triton.jit
def _load_row(Trains, t, num, P, Q):
    """(src, dst, pages) of row ``t``; a row at or past ``num`` moves 0 pages."""
    m = t < num
    p_row = Trains + t.to(tl.int64) * 3
    b_src = tl.load(p_row, mask=m, other=0)
    b_dst = tl.load(p_row + 1, mask=m, other=0)
    b_n = tl.load(p_row + 2, mask=m, other=0)
    return b_src, b_dst, _row_pages(b_src, b_dst, b_n, P, Q)


@triton.jit
def _add2(a0, a1, b0, b1):
    """Combine of a two-value sum reduction (``tl.reduce`` over a pair of tensors)."""
    return a0 + b0, a1 + b1


@triton.jit
def _train_ends_kernel(Trains, NumTrains, Ends, T, P, Q, BLOCK_T: tl.constexpr):
    num = tl.minimum(tl.maximum(tl.load(NumTrains), 0), T)
    tl.store(Ends, 0)
    carry = tl.full([], 0, tl.int32)
    for start in range(0, T, BLOCK_T):
        o_t = start + tl.arange(0, BLOCK_T)
        b_n = _load_row(Trains, o_t, num, P, Q)[2]
        tl.store(Ends + 1 + o_t, tl.cumsum(b_n, 0) + carry, mask=o_t < T)
        carry += tl.sum(b_n, 0)


@triton.jit
def _search_ends(Ends, T, g, FANOUT: tl.constexpr):
    """The last ``t`` in ``[0, T]`` with ``ends[t] <= g`` (``ends`` is non-decreasing, ``ends[0]
    = 0 <= g < ends[T]``): each round loads ``FANOUT`` evenly spaced entries of the range left."""
    o_f = tl.arange(0, FANOUT)
    t = tl.full([], 0, tl.int32)
    width = tl.full([], 0, tl.int32) + T + 1
    while width > 1:
        step = tl.cdiv(width, FANOUT)
        o_t = t + o_f * step
        m_t = (o_f * step < width) & (o_t <= T)
        b_le = (tl.load(Ends + o_t, mask=m_t, other=0) <= g) & m_t
        t += (tl.sum(b_le.to(tl.int32), 0) - 1) * step
        width = step
    return t


@triton.jit
def _gather_pages_kernel(
    K, V, KOut, VOut, Trains, NumTrains, Ends, T, P, Q,
    stride_kp, stride_vp, stride_kop, stride_vop,
    UNITS: tl.constexpr, BLOCK: tl.constexpr, FUSED: tl.constexpr, BLOCK_T: tl.constexpr,
    FANOUT: tl.constexpr,
):
    i_p = tl.program_id(0)
    num = tl.minimum(tl.maximum(tl.load(NumTrains), 0), T)
    if FUSED:
        o_t = tl.arange(0, BLOCK_T)
        b_n = _load_row(Trains, o_t, num, P, Q)[2]
        b_end = tl.cumsum(b_n, 0)                       # pages of rows 0..t
        pages = tl.sum(b_n, 0)
    else:
        pages = tl.load(Ends + T)
    total = pages * UNITS
    per = tl.cdiv(total, tl.num_programs(0))
    lo = i_p * per
    hi = tl.minimum(lo + per, total)
    if lo < hi:
        # the train t of the first block: first <= page < nxt, its first and end pages
        g = lo // UNITS
        if FUSED:
            # rows ending at or before page g are the rows before t: one reduction gives their
            # count (t) and their pages (first)
            b_before = b_end <= g
            t, first = tl.reduce((b_before.to(tl.int32), tl.where(b_before, b_n, 0)), 0, _add2)
        else:
            t = _search_ends(Ends, T, g, FANOUT)
            first = tl.load(Ends + t)
        src, dst, n_t = _load_row(Trains, t, num, P, Q)
        nxt = first + n_t
        src1, dst1, n1 = _load_row(Trains, t + 1, num, P, Q)
        o_e = tl.arange(0, BLOCK)
        for w in range(lo, hi):
            g = w // UNITS
            while g >= nxt:
                t += 1
                first = nxt
                nxt = first + n1
                src = src1
                dst = dst1
                src1, dst1, n1 = _load_row(Trains, t + 1, num, P, Q)
            o_blk = (w % UNITS) * BLOCK
            o_src = (src + g - first).to(tl.int64)
            o_dst = (dst + g - first).to(tl.int64)
            b_k = tl.load(K + o_src * stride_kp + o_blk + o_e)
            b_v = tl.load(V + o_src * stride_vp + o_blk + o_e)
            tl.store(KOut + o_dst * stride_kop + o_blk + o_e, b_k)
            tl.store(VOut + o_dst * stride_vop + o_blk + o_e, b_v)


def default_block(page_elems: int, itemsize: int) -> int:
    """Elements per block: the largest power of two dividing the page, at most 4 KiB (one
    16-byte vector per thread of 8 warps; docs/tuning.md)."""
    return page_copy_block(page_elems, itemsize, 4096)


def default_programs_per_sm(T: int, fused: bool) -> int:
    """Programs an SM. Small programs balance best (the hardware hands the next block range to
    whichever SM frees first), but in one launch every program first sums all ``T`` rows, so
    the count falls as ``T`` grows (``FUSED_ROW_READS_PER_SM``): 256 up to 512 rows, 128 at
    1,024. Two launches search the train ends instead: 64. docs/tuning.md."""
    if not fused:
        return 64
    return max(64, min(256, FUSED_ROW_READS_PER_SM // next_pow2(T)))


_PLANS: dict = {}


def paged_gather_merged_fwd(
    k_cache: torch.Tensor, v_cache: torch.Tensor, trains: torch.Tensor, num_trains: torch.Tensor,
    k_out: torch.Tensor, v_out: torch.Tensor,
    *, num_programs: int | None = None, block: int | None = None, num_warps: int | None = None,
    fuse_max_trains: int = FUSE_MAX_TRAINS, signature=None,
) -> None:
    """Launch the kernel(s). Inputs are already checked by the op (pages contiguous,
    any page stride; same shapes).

    k_cache, v_cache [P, S, Hkv, D]; trains int32 [T, 3]; num_trains int32 [1];
    k_out, v_out [Q, S, Hkv, D] (written in place). The keyword-only knobs override the tuned
    defaults (benchmarks and tests use them); the grid depends on shapes only. A launch's plan
    (block, grid, strides, binary key) is kept per argument signature (``signature``: the
    op's, else one is computed here) and knobs.
    """
    tensors = (k_cache, v_cache, trains, num_trains, k_out, v_out)
    if signature is None:
        signature = tuple(sig(t) for t in tensors)
    key = (signature, num_programs, block, num_warps, fuse_max_trains)
    plan = _PLANS.get(key) or keep_plan(_PLANS, key, _plan(*tensors, num_programs, block,
                                                           num_warps, fuse_max_trains))
    if plan is _NOTHING:
        return
    grid, bin_key, ints, meta, ends_launch = plan
    if ends_launch is None:
        ends = trains             # not read
    else:
        ends = torch.empty(ints[0] + 1, dtype=torch.int32, device=trains.device)
        launch(_train_ends_kernel, (1,), bin_key, (trains, num_trains, ends, *ints[:3]),
               ends_launch)
    launch(_gather_pages_kernel, grid, bin_key,
           (k_cache, v_cache, k_out, v_out, trains, num_trains, ends, *ints), meta)


_NOTHING = ()      # the plan of a call with no trains or no output pages


def _plan(k_cache, v_cache, trains, num_trains, k_out, v_out, num_programs, block, num_warps,
          fuse_max_trains):
    T, Q = trains.shape[0], k_out.shape[0]
    if T == 0 or Q == 0:
        return _NOTHING
    P, S, Hkv, D = k_cache.shape
    page_elems = S * Hkv * D
    block = block or default_block(page_elems, k_cache.element_size())
    check_copy_block("block", block, page_elems)
    units = page_elems // block
    fused = T <= fuse_max_trains
    strides = (k_cache.stride(0), v_cache.stride(0), k_out.stride(0), v_out.stride(0))
    ends_launch = None if fused else dict(BLOCK_T=min(4096, next_pow2(T)), num_warps=8)
    per_sm = default_programs_per_sm(T, fused)
    grid = (num_programs or min(Q * units, per_sm * sm_count(k_cache.device)),)
    meta = dict(UNITS=units, BLOCK=block, FUSED=fused, BLOCK_T=next_pow2(T) if fused else 1,
                FANOUT=64, num_warps=num_warps or 8)
    # the train ends are fresh, so always 16-byte aligned
    bin_key = (k_cache.shape, k_cache.dtype, k_cache.device, T, Q, strides, grid,
               tuple(meta.values()),
               tuple(t.data_ptr() % 16 for t in (k_cache, v_cache, k_out, v_out, trains,
                                                  num_trains)))
    return grid, bin_key, (T, P, Q, *strides), meta, ends_launch
