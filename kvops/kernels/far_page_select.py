"""Triton kernels of ``kvops.far_page_select``: key-bound page scores, then the split choice.

Scoring: one program owns one (sequence, block of ``BLOCK_N`` pages). For each KV head it
loads the group's ``G`` query heads once, splits them into their positive and negative parts and scores
the block with two dots, ``q+ . kmax + q- . kmin`` (= ``sum_c max(q_c kmin_c, q_c kmax_c)``),
keeping both the best over the group's rows and the KV heads and the sum over them. Each
summary byte is read once. Pages past ``num_far`` are neither read nor scored (``-inf``).

Choice: one program owns one sequence's row of both scores (``N`` pages in one block). A
page's score becomes an order-preserving integer. The ``ceil(top_k / 2)``-th largest best
bound is found bit by bit from the top (32 counts over the row); the pages above it, and those
equal to it in page order up to the count, are the first half. The same search over the summed
bounds of the other pages gives the rest. Each half is packed into its output entries, then
every entry moves to its rank among them (a compare of the half against itself), so each half
comes out in decreasing score. One launch in place of two ``torch.topk``, a scatter and the
joins (2.5-3x faster: docs/tuning.md).

Eager calls score and choose in one launch (``far_page_select_fwd``): the scoring program of a
row that finishes last (``_splitk.arrive`` on a counter kept per stream) makes the row's
choice, with the scores in the stream's scratch. A captured graph runs the two kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._attention import dot, load_query_group
from kvops.kernels._common import dot_precision, next_pow2
from kvops.kernels._keys import score_bits, score_key
from kvops.kernels._launch import Launch, keep_plan, launch
from kvops.kernels._splitk import arrive, load_capture_form
from kvops.kernels._workspace import split_scratch


@triton.jit
def _far_page_scores_kernel(
    Q, KMin, KMax, NumFar, Scores, Index, Score, Count,
    stride_qb, stride_qh,
    stride_lb, stride_ln, stride_lh,
    stride_ub, stride_un, stride_uh,
    N, Hkv, NUM_N, TOP_K, stride_s,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, CHOOSE: tl.constexpr,
    HALF: tl.constexpr, CHOICE_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr,
):
    i_pid = tl.program_id(0)
    i_b = (i_pid // NUM_N).to(tl.int64)
    o_n = (i_pid % NUM_N) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_g = tl.arange(0, BLOCK_G)
    nf = tl.minimum(tl.maximum(tl.load(NumFar + i_b), 0), N)
    m_n = o_n < nf
    m_kv = m_n[:, None] & (o_d < D)[None, :]
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_N], tl.float32)
    if tl.sum(m_n.to(tl.int32)) > 0:
        for i_h in range(Hkv):
            b_q = load_query_group(Q, i_b, i_h, stride_qb, stride_qh, G, D, BLOCK_G, BLOCK_D)
            if PRECISION == "upcast":
                b_q = b_q.to(tl.float32)
            b_pos = tl.where(b_q > 0, b_q, 0.0).to(b_q.dtype)
            b_neg = tl.where(b_q < 0, b_q, 0.0).to(b_q.dtype)
            p_lo = KMin + i_b * stride_lb + o_n[:, None] * stride_ln + i_h * stride_lh + o_d[None, :]
            p_hi = KMax + i_b * stride_ub + o_n[:, None] * stride_un + i_h * stride_uh + o_d[None, :]
            b_lo = tl.load(p_lo, mask=m_kv, other=0.0)
            b_hi = tl.load(p_hi, mask=m_kv, other=0.0)
            b_s = dot(b_pos, tl.trans(b_hi), PRECISION) + dot(b_neg, tl.trans(b_lo), PRECISION)
            m_g = (o_g < G)[:, None]
            best = tl.maximum(best, tl.max(tl.where(m_g, b_s, float("-inf")), axis=0))
            total += tl.sum(tl.where(m_g, b_s, 0.0), axis=0)
    best = tl.where(m_n, best, float("-inf"))
    total = tl.where(m_n, total, float("-inf"))
    tl.store(Scores + i_b * N + o_n, best, mask=o_n < N)
    tl.store(Scores + stride_s + i_b * N + o_n, total, mask=o_n < N)
    if CHOOSE:     # one launch: the last block of a row to finish makes the row's choice
        if arrive(Count + i_b, NUM_N):
            _choose_row(Scores, stride_s, Index, Score, i_b, N, TOP_K, HALF, CHOICE_N,
                        BLOCK_K, BLOCK_J)
            tl.atomic_xchg(Count + i_b, 0)


@triton.jit
def _order(u):
    """Order-preserving non-negative int64 of float32 ``u`` (in [0, 2**32))."""
    return score_bits(u).to(tl.int64) + 2 ** 31


@triton.jit
def _choose(key, need):
    """Mask of the ``need`` largest entries of ``key`` (int64 in [0, 2**32); -1 never chosen;
    at least ``need`` entries not -1). The threshold (the ``need``-th largest value) is built
    bit by bit from the top, each bit one count; equal values at the threshold are taken in
    entry order."""
    thr = tl.zeros([], tl.int64)
    for i in tl.static_range(32):
        c = thr | (1 << (31 - i))
        thr = tl.where(tl.sum((key >= c).to(tl.int32), axis=0) >= need, c, thr)
    above = key > thr
    at = key == thr
    room = need - tl.sum(above.to(tl.int32), axis=0)
    return above | (at & (tl.cumsum(at.to(tl.int32), axis=0) <= room))


@triton.jit
def _write_in_order(chosen, score, o_n, Index, Score, n, BLOCK_K: tl.constexpr,
                    BLOCK_J: tl.constexpr):
    """Write the ``n`` chosen pages (and scores) to ``Index[:n]``, ``Score[:n]`` in decreasing
    score: packed first in page order, then each moved to its rank among them (counted
    against the packed row ``BLOCK_J`` entries at a time). -1 where the score is -inf."""
    pos = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(Index + pos, o_n, mask=chosen)
    tl.store(Score + pos, score, mask=chosen)
    tl.debug_barrier()
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < n
    page = tl.load(Index + o_k, mask=m_k, other=0, cache_modifier=".cg")
    val = tl.load(Score + o_k, mask=m_k, other=0.0, cache_modifier=".cg")
    key = score_key(val, page)
    rank = tl.zeros([BLOCK_K], tl.int32)
    o_j = tl.arange(0, BLOCK_J)
    for j0 in range(0, n, BLOCK_J):
        m_j = j0 + o_j < n
        pj = tl.load(Index + j0 + o_j, mask=m_j, other=0, cache_modifier=".cg")
        vj = tl.load(Score + j0 + o_j, mask=m_j, other=0.0, cache_modifier=".cg")
        kj = score_key(vj, pj)
        rank += tl.sum((m_j[None, :] & (kj[None, :] > key[:, None])).to(tl.int32), axis=1)
    tl.debug_barrier()
    tl.store(Index + rank, tl.where(val > float("-inf"), page, -1), mask=m_k)
    tl.store(Score + rank, val, mask=m_k)


@triton.jit
def _choose_row(Scores, stride_s, Index, Score, i_b, N, TOP_K, HALF: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr):
    """The choice of row ``i_b`` from best bounds at ``Scores [B, N]`` and summed bounds
    ``stride_s`` elements after them, into ``Index``/``Score [B, TOP_K]``. Scores are read from
    L2 (``.cg``): in the one-launch form other programs wrote them."""
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    best = tl.load(Scores + i_b * N + o_n, mask=m_n, other=float("-inf"), cache_modifier=".cg")
    first = _choose(tl.where(m_n, _order(best), -1), HALF)
    _write_in_order(first, best, o_n, Index + i_b * TOP_K, Score + i_b * TOP_K, HALF,
                    BLOCK_K, BLOCK_J)
    if TOP_K > HALF:
        total = tl.load(Scores + stride_s + i_b * N + o_n, mask=m_n, other=float("-inf"),
                        cache_modifier=".cg")
        rest = _choose(tl.where(m_n & ~first, _order(total), -1), TOP_K - HALF)
        _write_in_order(rest, total, o_n, Index + i_b * TOP_K + HALF,
                        Score + i_b * TOP_K + HALF, TOP_K - HALF, BLOCK_K, BLOCK_J)


@triton.jit
def _far_page_top_kernel(
    Scores, Index, Score, stride_s, B, N, TOP_K,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr,
):
    _choose_row(Scores, stride_s, Index, Score, tl.program_id(0).to(tl.int64), N, TOP_K, HALF,
                BLOCK_N, BLOCK_K, BLOCK_J)


def default_block_n(D: int) -> int:
    """Pages per program: 64 (a 64 x D tile of each bound), 32 for D above 128."""
    return 64 if D <= 128 else 32


def far_page_scores_fwd(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor,
                        num_far: torch.Tensor, *, block_n: int | None = None,
                        num_warps: int | None = None, out: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Launch the scoring kernel. Inputs are already checked by the op.

    q [B, Hq, D]; k_min, k_max [B, N, Hkv, D] (last dim contiguous); num_far int32 [B].
    Returns scores float32 [2, B, N] (``out`` when given, contiguous): ``[0]`` the best bound
    over query heads, ``[1]`` the bounds summed over them; ``-inf`` past num_far.
    """
    B, N = q.shape[0], k_min.shape[1]
    scores = torch.empty(2, B, N, device=q.device, dtype=torch.float32) if out is None else out
    if B * N == 0:
        return scores
    key = ("scores", sig(q), sig(k_min), sig(k_max), sig(num_far), block_n, num_warps)
    plan = _PLANS.get(key) or keep_plan(_PLANS, key, _scores_plan(q, k_min, k_max, num_far, 0,
                                                                  block_n, num_warps))
    grid, bin_key, ints, meta, copy_q, _ = plan
    q = q.contiguous() if copy_q else q
    # the scores-only kernel writes no choice: index, score and counter get valid pointers
    launch(_far_page_scores_kernel, grid, bin_key,
           (q, k_min, k_max, num_far, scores, scores, scores, num_far, *ints), meta)
    return scores


def far_page_select_fwd(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor,
                        num_far: torch.Tensor, top_k: int,
                        signature=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and choice (rows of at most ``CHOICE_MAX_PAGES`` pages): one launch in eager
    calls, where the last block of each row to finish makes the row's choice (``_splitk.arrive``
    on counters kept per stream), or the scoring and choice kernels one after the other while a
    CUDA graph is captured. The scores live in the stream's scratch. Returns index int32 and
    score float32 [B, top_k], as :func:`far_page_top_fwd`. ``signature``: the op's, of the
    four tensors and ``top_k``, else computed here."""
    B, N = q.shape[0], k_min.shape[1]
    if B * N == 0:
        return far_page_top_fwd(far_page_scores_fwd(q, k_min, k_max, num_far), top_k)
    scores, count = split_scratch(q.device, ((2, B, N),), B)
    if count is None:
        return far_page_top_fwd(far_page_scores_fwd(q, k_min, k_max, num_far, out=scores), top_k)
    key = ("select", signature or (sig(q), sig(k_min), sig(k_max), sig(num_far), top_k))
    plan = _PLANS.get(key) or keep_plan(_PLANS, key, _select_plan(q, k_min, k_max, num_far,
                                                                  top_k))
    chosen, copy_q, ready = plan
    if load_capture_form(ready):   # the kernels a captured call launches, loaded outside it
        far_page_top_fwd(far_page_scores_fwd(q, k_min, k_max, num_far, out=scores), top_k)
    q = q.contiguous() if copy_q else q
    index = torch.empty(B, top_k, device=q.device, dtype=torch.int32)
    score = torch.empty(B, top_k, device=q.device, dtype=torch.float32)
    chosen(q, k_min, k_max, num_far, scores, index, score, count)
    return index, score


_PLANS: dict = {}   # launch plans by signature: the scoring launch's (grid, binary key, runtime
# integers, constants, q copied, ready) and the one-launch form's (Launch, q copied, ready)


def _select_plan(q, k_min, k_max, num_far, top_k):
    """The one-launch form's :class:`~kvops.kernels._launch.Launch`, whether q is copied
    first, and the list ``load_capture_form`` marks."""
    grid, bin_key, ints, meta, copy_q, ready = _scores_plan(q, k_min, k_max, num_far, top_k,
                                                            None, None)
    return Launch(_far_page_scores_kernel, grid, bin_key, ints, meta), copy_q, ready


def _scores_plan(q, k_min, k_max, num_far, top_k, block_n, num_warps):
    """The scoring launch; with ``top_k`` (> 0) the one-launch form that also chooses."""
    B, Hq, D = q.shape
    N, Hkv = k_min.shape[1], k_min.shape[2]
    G = Hq // Hkv
    block_n = block_n or default_block_n(D)
    num_n = triton.cdiv(N, block_n)
    copy_q = q.stride(-1) != 1
    q_strides = (Hq * D, D) if copy_q else (q.stride(0), q.stride(1))
    ints = (*q_strides, k_min.stride(0), k_min.stride(1), k_min.stride(2),
            k_max.stride(0), k_max.stride(1), k_max.stride(2), N, Hkv, num_n, top_k, B * N)
    meta = dict(G=G, D=D, BLOCK_G=max(16, next_pow2(G)), BLOCK_D=next_pow2(D), BLOCK_N=block_n,
                PRECISION=dot_precision(q.dtype), CHOOSE=False, HALF=1, CHOICE_N=1, BLOCK_K=1,
                BLOCK_J=1, num_warps=num_warps or 4)
    if top_k:
        choice = _top_plan_meta(N, top_k)
        meta.update(CHOOSE=True, HALF=choice["HALF"], CHOICE_N=choice["BLOCK_N"],
                    BLOCK_K=choice["BLOCK_K"], BLOCK_J=choice["BLOCK_J"],
                    num_warps=max(meta["num_warps"], choice["num_warps"]))
    # the scores, index and score are fresh or scratch, so always 16-byte aligned
    aligned = (copy_q or q.data_ptr() % 16 == 0, k_min.data_ptr() % 16 == 0,
               k_max.data_ptr() % 16 == 0, num_far.data_ptr() % 16 == 0)
    bin_key = (q.dtype, q.device, ints, tuple(meta.items()), aligned)
    return (B * num_n,), bin_key, ints, meta, copy_q, []


CHOICE_MAX_PAGES = 16384   # rows held in one block up to here (32 keys a thread at 16 warps)


def choice_in_kernel(N: int) -> bool:
    """Whether rows of ``N`` pages take the choice kernel: up to ``CHOICE_MAX_PAGES`` (and so a
    half of at most 8192 entries, whose ranking tile stays within Triton's block limit); longer
    rows take two ``torch.topk``, which have no such limit."""
    return N <= CHOICE_MAX_PAGES


def choice_launch(N: int) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` of the choice kernel for rows of ``N`` pages: the row in one
    block, 8 warps up to 4096 pages, 16 above (docs/tuning.md)."""
    block_n = next_pow2(N)
    return block_n, 8 if block_n <= 4096 else 16


def far_page_top_fwd(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the choice kernel on ``scores [2, B, N]`` (:func:`far_page_scores_fwd`).

    Returns index int32 [B, top_k] (the ``ceil(top_k / 2)`` pages of highest best bound in
    decreasing order, then the highest summed bounds among the others; -1 where the score is
    -inf) and score float32 [B, top_k].
    """
    _, B, N = scores.shape
    index = torch.empty(B, top_k, device=scores.device, dtype=torch.int32)
    score = torch.empty(B, top_k, device=scores.device, dtype=torch.float32)
    if B == 0:
        return index, score
    key = ("top", sig(scores), top_k)
    plan = _PLANS.get(key) or keep_plan(_PLANS, key, _top_plan(scores, top_k))
    bin_key, ints, meta = plan
    launch(_far_page_top_kernel, (B,), bin_key, (scores, index, score, *ints), meta)
    return index, score


def _top_plan(scores, top_k):
    _, B, N = scores.shape
    ints = (scores.stride(0), B, N, top_k)
    meta = _top_plan_meta(N, top_k)
    # index and score are fresh, so always 16-byte aligned
    return (scores.device, scores.dtype, ints, scores.data_ptr() % 16), ints, meta


def _top_plan_meta(N: int, top_k: int) -> dict:
    """The choice kernel's constants for rows of ``N`` pages (``choice_launch``)."""
    block_n, warps = choice_launch(N)
    half = (top_k + 1) // 2
    block_k = next_pow2(half)
    return dict(HALF=half, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_J=min(block_k, 64),
                num_warps=warps)
