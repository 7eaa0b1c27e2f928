"""Triton kernels for ``kvops.paged_gather_merged``: copy trains of pages, graph-replayable.

Two fixed-shape launches:

1. ``_train_ends_kernel`` (one program) turns the used rows of ``trains`` into running page
   counts ``ends[t + 1] = pages of rows 0..t`` (rows past ``num_trains`` and rows that do not
   lie in the pool / arena count 0 pages), so the work of the step is ``ends[T]`` pages, known
   on the device only.
2. ``_gather_pages_kernel`` runs a persistent grid sized from shapes (about 32 programs per SM,
   never more than the arena's pages allow). A page is ``UNITS`` blocks of ``BLOCK`` contiguous
   elements (a power of two dividing ``S * Hkv * D``, so there are no masks and every access is
   a 16-byte vector). The ``ends[T] * UNITS`` blocks of the step are split into equal contiguous
   ranges, one per program: a program binary-searches ``ends`` once for the train holding its
   first block, then walks forward through its range, stepping to the next train when it
   crosses one's end. One long train is spread over every program, and many one-page trains
   are packed several to a program, so both fill the GPU.

``num_trains`` is read on the device, so one captured graph serves any count up to ``T``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops.kernels._common import next_pow2, sm_count


@triton.jit
def _train_ends_kernel(Trains, NumTrains, Ends, T, P, Q, BLOCK_T: tl.constexpr):
    num = tl.minimum(tl.maximum(tl.load(NumTrains), 0), T)
    tl.store(Ends, 0)
    carry = tl.full([], 0, tl.int32)
    for start in range(0, T, BLOCK_T):
        o_t = start + tl.arange(0, BLOCK_T)
        m_t = o_t < num
        p_row = Trains + o_t.to(tl.int64) * 3
        b_src = tl.load(p_row, mask=m_t, other=0)
        b_dst = tl.load(p_row + 1, mask=m_t, other=0)
        b_n = tl.load(p_row + 2, mask=m_t, other=0)
        m_ok = m_t & (b_n >= 1) & (b_src >= 0) & (b_src <= P - b_n) & (b_dst >= 0) \
            & (b_dst <= Q - b_n)
        b_n = tl.where(m_ok, b_n, 0)
        tl.store(Ends + 1 + o_t, tl.cumsum(b_n, 0) + carry, mask=o_t < T)
        carry += tl.sum(b_n, 0)


@triton.jit
def _gather_pages_kernel(
    K, V, KOut, VOut, Trains, Ends, T, log_t,
    UNITS: tl.constexpr, BLOCK: tl.constexpr,
):
    i_p = tl.program_id(0)
    total = tl.load(Ends + T) * UNITS
    per = tl.cdiv(total, tl.num_programs(0))
    lo = i_p * per
    hi = tl.minimum(lo + per, total)
    if lo < hi:
        # the train t of the first block: ends[t] <= page < ends[t + 1]
        g = lo // UNITS
        t_lo = tl.full([], 0, tl.int32)
        t_hi = tl.full([], 0, tl.int32) + T
        for _ in range(log_t):
            mid = (t_lo + t_hi) // 2
            m_up = tl.load(Ends + mid) <= g
            t_lo = tl.where(m_up, mid, t_lo)
            t_hi = tl.where(m_up, t_hi, mid)
        t = t_lo
        first = tl.load(Ends + t)
        nxt = tl.load(Ends + t + 1)
        src = tl.load(Trains + t.to(tl.int64) * 3)
        dst = tl.load(Trains + t.to(tl.int64) * 3 + 1)
        o_e = tl.arange(0, BLOCK)
        for w in range(lo, hi):
            g = w // UNITS
            while g >= nxt:
                t += 1
                first = nxt
                nxt = tl.load(Ends + t + 1)
                src = tl.load(Trains + t.to(tl.int64) * 3)
                dst = tl.load(Trains + t.to(tl.int64) * 3 + 1)
            o_blk = (w % UNITS) * BLOCK
            o_src = (src + g - first).to(tl.int64) * (UNITS * BLOCK) + o_blk
            o_dst = (dst + g - first).to(tl.int64) * (UNITS * BLOCK) + o_blk
            b_k = tl.load(K + o_src + o_e)
            b_v = tl.load(V + o_src + o_e)
            tl.store(KOut + o_dst + o_e, b_k)
            tl.store(VOut + o_dst + o_e, b_v)


def default_block(page_elems: int, itemsize: int) -> int:
    """Elements per block: the largest power of two dividing the page, at most 4 KiB (one
    16-byte vector per thread of 8 warps; best in the H200 sweep,
    bench/results/2026-11-30-paged_gather-tune.md)."""
    return min(page_elems & -page_elems, 4096 // itemsize)


def paged_gather_merged_fwd(
    k_cache: torch.Tensor, v_cache: torch.Tensor, trains: torch.Tensor, num_trains: torch.Tensor,
    k_out: torch.Tensor, v_out: torch.Tensor,
    *, num_programs: int | None = None, block: int | None = None, num_warps: int | None = None,
) -> None:
    """Launch the two kernels. Inputs are already checked by the op (contiguous, same shapes).

    k_cache, v_cache [P, S, Hkv, D]; trains int32 [T, 3]; num_trains int32 [1];
    k_out, v_out [Q, S, Hkv, D] (written in place). The keyword-only knobs override the tuned
    defaults (benchmarks and tests use them); the grid depends on shapes only.
    """
    T, Q = trains.shape[0], k_out.shape[0]
    if T == 0 or Q == 0:
        return
    P, S, Hkv, D = k_cache.shape
    page_elems = S * Hkv * D
    block = block or default_block(page_elems, k_cache.element_size())
    if page_elems % block or block & (block - 1):
        raise ValueError(f"block: expected a power of two dividing S*Hkv*D={page_elems}, "
                         f"got {block}")
    units = page_elems // block
    ends = torch.empty(T + 1, dtype=torch.int32, device=trains.device)
    _train_ends_kernel[(1,)](trains, num_trains, ends, T, P, Q,
                             BLOCK_T=min(4096, next_pow2(T)), num_warps=8)
    grid = num_programs or min(Q * units, 32 * sm_count(k_cache.device))  # tuned, as above
    _gather_pages_kernel[(grid,)](
        k_cache, v_cache, k_out, v_out, trains, ends, T, max(1, T.bit_length()),
        UNITS=units, BLOCK=block,
        num_warps=num_warps or 8,
    )
