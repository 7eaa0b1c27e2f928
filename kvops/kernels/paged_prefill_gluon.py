"""Gluon kernel for ``kvops.paged_prefill_attention`` on Hopper (sm_90): warp-specialized, with
the chunk's own rows given, pages of a multiple of 16 tokens, no window.

A program takes 128 query rows of one sequence's chunk and one query head. Three partitions
share it: two consumer warpgroups of 64 rows each (the default partition and a 4-warp worker)
and one loader warp. The loader fills a ring of ``STAGES`` K and V buffers of 128 keys
through the tensor copy engine: first the sequence's prefix from its pages (``128 /
box_rows(S)`` boxes a tile, each one page's rows, through a descriptor over the pool's rows;
an unmapped page or a key past the prefix reads out of bounds, so zeros; a tile's page ids
are read before the stage's wait and held for K and V), then the chunk's own rows from a
descriptor over ``k``, ``v`` (tiles aligned to the chunk's start, so the causal diagonal is
the query tile's own). Each consumer issues tile ``j + 1``'s QK^T before tile ``j``'s PV and
runs ``j + 1``'s softmax while PV is in flight (two warpgroup MMAs in flight), with registers
moved to the consumers (240 each, 24 for the loader). Where the rows are not usable (a page of
the chunk's keys is unmapped) the prefix loop runs over the chunk's keys too, from the pages,
as the Triton kernel does.

On the H100 with the chunk's rows, pages of 64 / 16: an 8k prefill from nothing 912.3 / 922.4
us (603 / 596 TFLOP/s, 1.08x / 1.06x SDPA's cuDNN), 2048 tokens over 4k 283.4 / 300.4, 512
over 16k (Qwen2.5-7B) 230.5 / 241.4, 512 from nothing 13.7 / 14.1 against cuDNN's 12.7
(bench/results/2026-12-07-0915-paged_prefill_attention-partial-new-rows-gluon-S16-S64.md; the
Triton kernel at pages of 16: 1949.5, 638.1, 455.3, 21.5). Masks are applied inside their
branches, which pass scores on: a boolean tile carried out of a branch is kept as packed bits
and unpacked an element at a time, which cost a third of a consumer's instructions
(bench/results/2026-12-07-0858-paged_prefill-gluon-profile-h100.md).

Keys that are masked in a tile (past the prefix, past the chunk, or on an unmapped page) get
-inf scores, and where such keys sit in a tile their V rows are zeroed in shared memory before
PV (a NaN there would reach the accumulator through ``0 * NaN``). Query rows past the chunk
are computed and not stored; a consumer whose 64 rows are all the chunk's writes them through
the query's buffer with one tensor store, else with a masked store (the next sequence's rows
follow). The query rows load while the program checks its sequence's pages. Padding rows after
``query_start[B]`` get out 0 and lse -inf.

Tile numbering is the Triton kernel's (``T_b = query_start[b] // 128 + b``; a grid of
``N // 128 + B + 1`` tiles from shapes only), run last-first.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton.language as tl

try:  # Gluon (triton.experimental) with the Hopper ops: triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # the TMA load's name: ``async_load`` in newer triton, ``async_copy_global_to_shared``
    # in 3.5-3.6 (newer ones keep that name only to raise)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _DESC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TensorDescriptor)
                      if f.default is not dataclasses.MISSING}
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - an older triton: the Triton kernel serves every call
    HAVE_GLUON = False

from kvops.kernels._attention import LOG2E
from kvops.kernels._launch import DescribedLaunch

# (constexpr: the kernels read them; ``int()`` on the host)
BLOCK_M = tl.constexpr(128)    # query rows a program (two consumer warpgroups of HALF)
HALF = tl.constexpr(64)
BLOCK_N = tl.constexpr(128)    # keys a stage
BOX = tl.constexpr(64)         # most pool rows a descriptor box holds (``box_rows``)
STAGES = tl.constexpr(2)       # K and V buffers in the ring (32 KiB each at D 128)
SEQ_CHUNK = tl.constexpr(128)  # sequence starts read at once while finding a tile's sequence


def box_rows(S: int) -> int:
    """Pool rows a descriptor box loads at pages of ``S`` tokens: the largest power of two
    dividing both ``S`` and ``BOX`` (a box never crosses a page; a key tile is
    ``BLOCK_N // box_rows(S)`` boxes, at least 16 rows each: ``prefill_gluon``)."""
    return math.gcd(S, int(BOX))


def prefill_gluon(capability: tuple[int, int], dtype: torch.dtype, D: int, S: int, window: int,
                  rows: bool, aligned: bool, splits: int, tiles: int = 1) -> bool:
    """Whether a call runs the Gluon kernel: Gluon's Hopper ops present (``HAVE_GLUON``), an
    sm_90 device (warpgroup MMA is Hopper's alone), 16-bit K/V, D 64 or 128 (a consumer holds
    64 x D float32 accumulators and 64 x 128 scores in its 240 registers), pages of a multiple
    of 16 tokens (a key tile from a prefix's pages is at most eight boxes of one page's
    rows: ``box_rows``), no sliding window, the chunk's rows given,
    descriptor-fit pools and rows (``aligned``), a call the Triton kernel would not split
    (``splits`` 1: the Gluon kernel has no split partials), and at most 65,535 query ``tiles``
    (``N // 128 + B + 1``: the grid's second dimension)."""
    return (HAVE_GLUON and capability == (9, 0) and dtype in (torch.float16, torch.bfloat16)
            and D in (64, 128) and S % 16 == 0 and window == 0 and rows and aligned
            and splits == 1 and tiles <= 65535)


if HAVE_GLUON:

    @gluon.jit
    def _scores(s, j, n_pre, hi_pre, pos0, nq, q_pos, q_pos0, mapped, p_bt, S, P,
                scale_log2, s_layout: gl.constexpr):
        """Tile ``j``'s scores in log2 units, masked where a key is past its run's end, after
        the row's position, or (an unmapped prefix) on a page outside ``[0, P)``."""
        s = s * scale_log2
        if j < n_pre:
            k0 = j * BLOCK_N
            lim = hi_pre
        else:
            k0 = pos0 + (j - n_pre) * BLOCK_N
            lim = pos0 + nq
        holes = (j < n_pre) & (mapped == 0)
        if (k0 + BLOCK_N > lim) | (k0 + BLOCK_N - 1 > q_pos0) | holes:
            kpos = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where((kpos[None, :] <= q_pos[:, None]) & (kpos < lim)[None, :], s,
                         -float("inf"))
            # the branches pass scores on, not a mask: a boolean tile carried out of a branch
            # lives in registers as packed bits, unpacked an element at a time (that took
            # more instructions than the tile's softmax)
            if holes:
                pg = gl.load(p_bt + kpos // S, mask=kpos < lim, other=-1)
                s = gl.where(((pg >= 0) & (pg < P))[None, :], s, -float("inf"))
        return s

    @gluon.jit
    def _softmax(s, m_i, l_i):
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new > -float("inf"), m_new, 0.0)   # a row with nothing visible yet
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _zero_tail(v_buf, j, n_pre, hi_pre, nq):
        """Zero the V rows of tile ``j`` past its run's end (rows the loader read from past the
        prefix or the chunk, where a NaN would reach PV)."""
        if j < n_pre:
            valid = hi_pre - j * BLOCK_N
        else:
            valid = nq - (j - n_pre) * BLOCK_N
        if valid < BLOCK_N:       # 16 rows at a time: a whole tile would take 64 registers
            layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            for i in gl.static_range(BLOCK_N // 16):
                if valid < (i + 1) * 16:
                    part = v_buf.slice(i * 16, 16)
                    r = i * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
                    tile = part.load(layout)
                    part.store(gl.where((r < valid)[:, None], tile, gl.zeros_like(tile)))
            fence_async_shared()

    @gluon.jit
    def _consume(out_ptr, lse_ptr, p_bt, q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty,
                 v_ready, v_empty, h, HQ, t_row, q_lo, q_hi, pos0, nq, n_pre, hi_pre, n_kv,
                 mapped, S, P, scale_log2, o_desc, WG: gl.constexpr):
        D: gl.constexpr = k_bufs.type.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        dtype: gl.constexpr = k_bufs.dtype

        q_smem = q_bufs.index(WG)
        r0 = t_row + WG * HALF
        rows = r0 + gl.arange(0, HALF, layout=row_layout)
        q_pos = pos0 + rows - q_lo
        q_pos0 = pos0 + r0 - q_lo
        m_i = gl.full([HALF], -float("inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([HALF], gl.float32, layout=row_layout)
        acc = gl.zeros([HALF, D], gl.float32, layout=o_layout)
        s = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)

        mbarrier.wait(q_bars.index(WG), 0)
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s, use_acc=False,
                              is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(0), count=1)
        s = _scores(s, 0, n_pre, hi_pre, pos0, nq, q_pos, q_pos0, mapped, p_bt, S, P,
                    scale_log2, s_layout)
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

        for j in range(0, n_kv - 1):
            st = j % STAGES
            nxt = j + 1
            mbarrier.wait(k_ready.index(nxt % STAGES), (nxt // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_bufs.index(nxt % STAGES).permute((1, 0)), s,
                                  use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
            _zero_tail(v_bufs.index(st), j, n_pre, hi_pre, nq)
            acc_tok = warpgroup_mma(p_op, v_bufs.index(st), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(nxt % STAGES), count=1)
            s = _scores(s, nxt, n_pre, hi_pre, pos0, nq, q_pos, q_pos0, mapped, p_bt, S, P,
                        scale_log2, s_layout)
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
            mbarrier.arrive(v_empty.index(st), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)

        last = n_kv - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        _zero_tail(v_bufs.index(last % STAGES), last, n_pre, hi_pre, nq)
        acc_tok = warpgroup_mma(p_op, v_bufs.index(last % STAGES), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)

        has = l_i > 0
        l_o = gl.convert_layout(gl.where(has, l_i, 1.0), gl.SliceLayout(1, o_layout))
        out = (acc / l_o[:, None]).to(dtype)
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453,
                       -float("inf"))
        gl.store(lse_ptr + rows.to(gl.int64) * HQ + h, lse, mask=rows < q_hi)
        if r0 + HALF <= q_hi:     # rows all this chunk's: through Q's buffer, one tensor store
            q_smem.store(out)
            fence_async_shared()
            _tma_store(o_desc, [r0, h * D], q_smem)
            tma.store_wait(0)
        else:                     # the chunk's last rows: a masked store keeps the next's
            o_rows = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
            o_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
            p_o = out_ptr + (o_rows.to(gl.int64) * HQ + h)[:, None] * D + o_d[None, :]
            gl.store(p_o, out, mask=(o_rows < q_hi)[:, None])

    @gluon.jit
    def _box_row(p_bt, p, hi_pre, S, P, page_rows, pool_rows):
        """The pool row of prefix position ``p``'s box, or ``pool_rows`` (out of bounds: the
        box reads zeros) past the prefix or on an unmapped page. Branch-free, so a tile's
        page-id loads are in flight together."""
        pg = gl.load(p_bt + p // S, mask=p < hi_pre, other=-1)
        return gl.where((pg >= 0) & (pg < P), pg * page_rows + p % S, pool_rows)

    @gluon.jit
    def _boxes(desc, bar, buf, col, r0, r1, r2, r3, r4, r5, r6, r7, NB: gl.constexpr):
        """A key tile's ``NB`` (2, 4 or 8) boxes from pool rows ``r0``..: box ``i`` into rows
        ``[i * R, (i + 1) * R)`` of ``buf``."""
        R: gl.constexpr = BLOCK_N // NB
        _tma_load(desc, [r0, col], bar, buf.slice(0, R))
        _tma_load(desc, [r1, col], bar, buf.slice(R, R))
        if NB > 2:
            _tma_load(desc, [r2, col], bar, buf.slice(2 * R, R))
            _tma_load(desc, [r3, col], bar, buf.slice(3 * R, R))
        if NB > 4:
            _tma_load(desc, [r4, col], bar, buf.slice(4 * R, R))
            _tma_load(desc, [r5, col], bar, buf.slice(5 * R, R))
            _tma_load(desc, [r6, col], bar, buf.slice(6 * R, R))
            _tma_load(desc, [r7, col], bar, buf.slice(7 * R, R))

    @gluon.jit
    def _load(p_bt, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, q_lo, n_pre, hi_pre,
              n_kv, S, P, page_rows, pool_rows, kvh, kp_desc, vp_desc, kn_desc, vn_desc):
        D: gl.constexpr = k_bufs.type.shape[2]
        R: gl.constexpr = kp_desc.block_type.shape[0]    # pool rows a box (``box_rows``)
        NB: gl.constexpr = BLOCK_N // R
        for j in range(n_kv):
            st = j % STAGES
            ph = (j // STAGES) & 1
            k_buf = k_bufs.index(st)
            v_buf = v_bufs.index(st)
            if j < n_pre:
                # the boxes' page ids are read before the wait (their latency hides behind
                # it) and held for V: one round trip a tile, not one a box
                p0 = j * BLOCK_N
                r0 = _box_row(p_bt, p0, hi_pre, S, P, page_rows, pool_rows)
                r1 = _box_row(p_bt, p0 + R, hi_pre, S, P, page_rows, pool_rows)
                r2 = r0
                r3 = r0
                r4 = r0
                r5 = r0
                r6 = r0
                r7 = r0
                if NB > 2:
                    r2 = _box_row(p_bt, p0 + 2 * R, hi_pre, S, P, page_rows, pool_rows)
                    r3 = _box_row(p_bt, p0 + 3 * R, hi_pre, S, P, page_rows, pool_rows)
                if NB > 4:
                    r4 = _box_row(p_bt, p0 + 4 * R, hi_pre, S, P, page_rows, pool_rows)
                    r5 = _box_row(p_bt, p0 + 5 * R, hi_pre, S, P, page_rows, pool_rows)
                    r6 = _box_row(p_bt, p0 + 6 * R, hi_pre, S, P, page_rows, pool_rows)
                    r7 = _box_row(p_bt, p0 + 7 * R, hi_pre, S, P, page_rows, pool_rows)
                mbarrier.wait(k_empty.index(st), ph ^ 1)
                mbarrier.expect(k_ready.index(st), kn_desc.block_type.nbytes)
                _boxes(kp_desc, k_ready.index(st), k_buf, kvh * D, r0, r1, r2, r3, r4, r5, r6,
                       r7, NB)
                mbarrier.wait(v_empty.index(st), ph ^ 1)
                mbarrier.expect(v_ready.index(st), vn_desc.block_type.nbytes)
                _boxes(vp_desc, v_ready.index(st), v_buf, kvh * D, r0, r1, r2, r3, r4, r5, r6,
                       r7, NB)
            else:
                row = q_lo + (j - n_pre) * BLOCK_N
                mbarrier.wait(k_empty.index(st), ph ^ 1)
                mbarrier.expect(k_ready.index(st), kn_desc.block_type.nbytes)
                _tma_load(kn_desc, [row, kvh * D], k_ready.index(st), k_buf)
                mbarrier.wait(v_empty.index(st), ph ^ 1)
                mbarrier.expect(v_ready.index(st), vn_desc.block_type.nbytes)
                _tma_load(vn_desc, [row, kvh * D], v_ready.index(st), v_buf)

    @gluon.jit
    def _bad_pages(p_bt, pg, pos0, seq_len, P, S, layout: gl.constexpr):
        """Whether a page holding positions ``[0, pos0)`` (the prefix) and one holding
        ``[pos0, seq_len)`` (the chunk) has an id outside ``[0, P)``: one pass over the table,
        whose first 128 entries ``pg`` the caller loaded. One reduction a block: the prefix's
        count (at most 128) and 256 times the chunk's in one sum."""
        end = gl.cdiv(seq_len, S)
        split = pos0 // S                    # pages before it hold prefix keys only
        o = gl.arange(0, 128, layout=layout)
        bad_pre = 0
        bad_chunk = 0
        for j in range(0, end, 128):
            if j > 0:
                pg = gl.load(p_bt + j + o, mask=j + o < end, other=0)
            o_j = j + o
            bad = (o_j < end) & ((pg < 0) | (pg >= P))
            both = gl.sum((bad & (o_j * S < pos0)).to(gl.int32)
                          + (bad & (o_j >= split)).to(gl.int32) * 256, axis=0)
            bad_pre += both % 256
            bad_chunk += both // 256
        return bad_pre, bad_chunk

    @gluon.jit(do_not_specialize=["N", "B", "num_tiles"])
    def _paged_prefill_gluon_kernel(q_desc, kp_desc, vp_desc, kn_desc, vn_desc, o_desc, out_ptr,
                                    lse_ptr, BT, QS, SL, N, B, P, L, S, page_rows, pool_rows,
                                    num_tiles, stride_bt, scale_log2, HQ: gl.constexpr,
                                    G: gl.constexpr):
        D: gl.constexpr = kn_desc.block_type.shape[1]
        h = gl.program_id(0)
        i_t = num_tiles - 1 - gl.program_id(1)            # last tiles (the longest) first
        # the sequence, as the Triton kernel finds it (a Gluon kernel calls Gluon functions
        # only): the last ``b`` whose first tile ``T_b`` is at or below ``i_t``, found with its
        # length in one reduction of ``b << 32 | seq_lens[b]`` (one round trip to memory where
        # reading the length after the search would take a second)
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        best = h.to(gl.int64) * 0 - 1
        for start in range(0, B + 1, SEQ_CHUNK):
            o_b = start + gl.arange(0, SEQ_CHUNK, layout=layout)
            qs = gl.minimum(gl.maximum(gl.load(QS + o_b, mask=o_b <= B, other=N), 0), N)
            sl = gl.minimum(gl.maximum(gl.load(SL + o_b, mask=o_b < B, other=0), 0), L * S)
            key = (o_b.to(gl.int64) << 32) | sl.to(gl.int64)
            best = gl.maximum(best, gl.max(gl.where((qs // BLOCK_M + o_b <= i_t) & (o_b <= B),
                                                    key, -1), axis=0))
        seq_len = (best - ((best >> 32) << 32)).to(gl.int32)
        i_b = gl.maximum(best >> 32, 0).to(gl.int32)
        # the sequence's first 128 pages, read beside its query range
        p_bt = BT + i_b.to(gl.int64) * stride_bt
        o_p = gl.arange(0, 128, layout=layout)
        pg = gl.load(p_bt + o_p, mask=(o_p < L) & (i_b < B), other=0)
        q_lo = gl.minimum(gl.maximum(gl.load(QS + i_b), 0), N)
        q_hi = gl.minimum(gl.maximum(gl.load(QS + gl.minimum(i_b + 1, B)), q_lo), N)
        q_hi = gl.where(i_b == B, N, q_hi)                # B: the padding rows after the last
        t_row = q_lo + (i_t - (q_lo // BLOCK_M + i_b)) * BLOCK_M
        if (t_row < q_lo) | (t_row >= q_hi):
            return
        if i_b == B:        # padding rows: out 0, lse -inf
            pad: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            r = t_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, pad))
            d = gl.arange(0, D, layout=gl.SliceLayout(0, pad))
            gl.store(out_ptr + (r.to(gl.int64) * HQ + h)[:, None] * D + d[None, :],
                     gl.zeros([BLOCK_M, D], out_ptr.dtype.element_ty, pad),
                     mask=(r < q_hi)[:, None])
            gl.store(lse_ptr + r.to(gl.int64) * HQ + h,
                     gl.full([BLOCK_M], -float("inf"), gl.float32, gl.SliceLayout(1, pad)),
                     mask=r < q_hi)
            return
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, D], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(kn_desc.dtype, [STAGES, BLOCK_N, D], kn_desc.layout)
        v_bufs = gl.allocate_shared_memory(vn_desc.dtype, [STAGES, BLOCK_N, D], vn_desc.layout)
        bar: gl.constexpr = mbarrier.MBarrierLayout()
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)      # both consumers release a stage
            mbarrier.init(v_empty.index(i), count=2)
        # the query rows load while the sequence's pages are checked
        for wg in gl.static_range(2):
            mbarrier.expect(q_bars.index(wg), q_desc.block_type.nbytes)
            _tma_load(q_desc, [t_row + wg * HALF, h * D], q_bars.index(wg), q_bufs.index(wg))
        nq = q_hi - q_lo
        pos0 = seq_len - nq          # negative only for more queries than context (bad input)
        # the chunk's keys from the rows where their pages are all mapped, else from the pages
        # (an unmapped one left out), as without the rows; a chunk longer than its context
        # takes the pages too, where rows at negative positions see no key (out 0, lse -inf),
        # as in the Triton kernel
        bad_pre, bad_chunk = _bad_pages(p_bt, pg, pos0, seq_len, P, S, layout)
        rows_ok = (bad_chunk == 0) & (pos0 >= 0)
        hi_pre = gl.where(rows_ok, pos0, gl.maximum(
            gl.minimum(pos0 + t_row + BLOCK_M - q_lo, seq_len), 0))
        n_chunk = gl.where(rows_ok, (t_row - q_lo) // BLOCK_N + 1, 0)
        # at least one tile: the consumers wait on the first before they know the count
        n_pre = gl.where(rows_ok, gl.cdiv(hi_pre, BLOCK_N), gl.maximum(gl.cdiv(hi_pre, BLOCK_N), 1))
        # pages unmapped where the prefix loop reads: its tiles check each key's page
        mapped = ((bad_pre == 0) & rows_ok).to(gl.int32)

        n_kv = n_pre + n_chunk
        # the consumers (the default partition and a worker, one warpgroup index each) and the
        # loader
        gl.warp_specialize([
            (_consume, (out_ptr, lse_ptr, p_bt, q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty,
                        v_ready, v_empty, h, HQ, t_row, q_lo, q_hi, pos0, nq, n_pre, hi_pre,
                        n_kv, mapped, S, P, scale_log2, o_desc, 0)),
            (_consume, (out_ptr, lse_ptr, p_bt, q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty,
                        v_ready, v_empty, h, HQ, t_row, q_lo, q_hi, pos0, nq, n_pre, hi_pre,
                        n_kv, mapped, S, P, scale_log2, o_desc, 1)),
            (_load, (p_bt, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, q_lo, n_pre,
                     hi_pre, n_kv, S, P, page_rows, pool_rows, h // G, kp_desc, vp_desc,
                     kn_desc, vn_desc)),
        ], [4, 1], [240, 24])


@functools.cache
def _layout(rows: int, D: int, dtype: torch.dtype):
    """The shared-memory layout of a ``[rows, D]`` box (made once: 6 us of host time each)."""
    return gl.NVMMASharedLayout.get_default_for(
        [rows, D], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _descriptor(base: torch.Tensor, shape, strides, box, layout):
    """Gluon's ``TensorDescriptor`` without its ``__post_init__`` checks (4 us of host time a
    descriptor on the H100's host; a launch makes one for each new address of a position, and
    six a call where triton's wrapper encodes them): ``prefill_gluon``'s ``aligned`` and
    the op's checks already hold what they assert (16-byte bases and strides, rank, a
    contiguous last dim). The fields' defaults (padding, and what newer triton adds) are the
    class's own."""
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(_DESC_DEFAULTS, base=base, shape=shape, strides=strides, block_shape=box,
                      layout=layout)
    return d


def _rows(t: torch.Tensor):
    """``(shape, strides)`` of a descriptor over rows ``[N, H, D]`` (heads contiguous in a row):
    the tensor as ``[N, H * D]`` with its row stride (a box is one head's consecutive rows)."""
    N, H, D = t.shape
    return [N, H * D], [t.stride(0), 1]


def _pool(cache: torch.Tensor):
    """``(shape, strides)`` of a descriptor over a pool ``[P, S, Hkv, D]``: rows of ``Hkv * D``
    values, page ``p``'s first row ``p * stride(0) / (Hkv * D)`` (so a layer's slice of a
    bigger pool and an interleaved K/V pool need no copy), up to the last page's last row."""
    P, S, Hkv, D = cache.shape
    F = Hkv * D
    return [(P - 1) * (cache.stride(0) // F) + S, F], [F, 1]


def gluon_plan(q, k_cache, block_table, scale: float):
    """``(grid, ints, meta)`` of a call: what its shapes fix (kept in the caller's plan, so a
    call only makes its descriptors and launches). 168 registers a thread for the 12 warps
    fill the SM's 64K; the partitions move them to the consumers (240 each) from the loader
    (24)."""
    N, Hq, D = q.shape
    P, S, Hkv, _ = k_cache.shape
    B, L = block_table.shape
    page_rows = k_cache.stride(0) // (Hkv * D)
    num_tiles = N // int(BLOCK_M) + B + 1
    ints = (N, B, P, L, S, page_rows, (P - 1) * page_rows + S, num_tiles,
            block_table.stride(0), scale * LOG2E.value)
    meta = {"HQ": Hq, "G": Hq // Hkv, "num_warps": 4, "maxnreg": 168}
    return (Hq, num_tiles), ints, meta


def gluon_launch(grid: tuple, ints: tuple, meta: dict, D: int, S: int,
                 dtype: torch.dtype) -> DescribedLaunch:
    """The plan's launch of the Gluon kernel (``gluon_plan``'s ``grid``, ``ints``, ``meta``):
    its six descriptors, ``[HALF, D]`` boxes of query and output rows, ``[box_rows(S), D]`` of
    pool rows and ``[BLOCK_N, D]`` of new-token rows, with their layouts. The plan's own token
    keys the binary."""
    half, pool, new = (int(HALF), D), (box_rows(S), D), (int(BLOCK_N), D)
    descs = tuple((describe, list(box), _layout(*box, dtype)) for describe, box in (
        (_rows, half), (_pool, pool), (_pool, pool), (_rows, new), (_rows, new), (_rows, half)))
    return DescribedLaunch(_paged_prefill_gluon_kernel, grid, object(), ints, meta, descs,
                           _descriptor)


def paged_prefill_gluon_fwd(q, k_cache, v_cache, block_table, query_start, seq_lens, k, v, out,
                            lse, run: DescribedLaunch) -> None:
    """Launch the Gluon kernel into ``out [N, Hq, D]`` and ``lse [N, Hq]`` (contiguous) through
    the plan's ``run`` (``gluon_launch``); the caller took ``prefill_gluon``'s rule."""
    run((q, k_cache, v_cache, k, v, out), out, lse, block_table, query_start, seq_lens)
