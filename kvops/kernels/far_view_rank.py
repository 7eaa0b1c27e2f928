"""Triton kernel for ``kvops.far_view_rank``: every (layer, slot) row's top ``C`` summaries.

One program owns one row (layer ``l``, slot ``b``). It loads the row's ``J`` utilities and
``summarized[b]`` once, turns each summarized chunk's utility into its int64 ranking key
(``(utility, chunk id)``: the float's bits mapped to an order-preserving int32 in the high
word, the id in the low word, so keys are unique) and takes the ``C`` largest keys by ``C``
max-reductions over the row (``C`` is small: the far view's cap). It then reads the committed
row (``select``), keys its entries the same way, and writes the committed keys when the row
already holds the top ``C`` (its lowest key is at least the ``C``-th largest and it holds as
many entries), else the new top ``C``, and whether the row changes. No host sync, fixed grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._common import next_pow2
from kvops.kernels._keys import score_key
from kvops.kernels._launch import Launch, keep_plan

_TAKEN = -(2 ** 63)             # a key already taken into the top: below any empty key
_ABOVE = 2 ** 63 - 1


@triton.jit
def _far_view_rank_kernel(
    Scores, Summ, Select, Keys, Changed,
    stride_sl, stride_sb, B, J,
    C: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr,
    EMPTY: tl.constexpr, TAKEN: tl.constexpr, ABOVE: tl.constexpr,
):
    i_pid = tl.program_id(0).to(tl.int64)          # layer * B + slot
    i_l = i_pid // B
    i_b = i_pid % B
    row = Scores + i_l * stride_sl + i_b * stride_sb
    o_j = tl.arange(0, BLOCK_J)
    m_j = o_j < J
    u = tl.load(row + o_j, mask=m_j, other=0.0)
    s = tl.load(Summ + i_b * J + o_j, mask=m_j, other=0)
    key = tl.where(m_j & (s != 0), score_key(u, o_j), EMPTY)

    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < C
    top = tl.full([BLOCK_C], EMPTY, tl.int64)
    for c in tl.static_range(C):
        best = tl.max(key, axis=0)
        top = tl.where(o_c == c, best, top)
        key = tl.where(key == best, TAKEN, key)
    top = tl.maximum(top, EMPTY)                   # a taken empty is empty
    kth = tl.max(tl.where(o_c == C - 1, top, TAKEN), axis=0)

    cur = tl.load(Select + i_pid * C + o_c, mask=m_c, other=-1)
    has = cur >= 0
    cu = tl.load(row + tl.maximum(cur, 0), mask=m_c, other=0.0)
    cur_key = tl.where(has, score_key(cu, cur), EMPTY)
    low = tl.min(tl.where(m_c, cur_key, ABOVE), axis=0)
    n_has = tl.sum(has.to(tl.int32), axis=0)
    n_top = tl.sum((m_c & (top != EMPTY)).to(tl.int32), axis=0)
    moved = (low < kth) | (n_has != n_top)
    tl.store(Keys + i_pid * C + o_c, tl.where(moved, top, cur_key), mask=m_c)
    tl.store(Changed + i_pid, moved.to(tl.int8))


def rank_launch(J: int) -> tuple[int, int]:
    """``(BLOCK_J, num_warps)`` for rows of ``J`` chunks: the whole row in one block, 4 warps
    up to 1024 chunks and 8 above (docs/tuning.md)."""
    block_j = next_pow2(J)
    return block_j, 4 if block_j <= 1024 else 8


def far_view_rank_fwd(scores: torch.Tensor, summarized: torch.Tensor, select: torch.Tensor,
                      empty_key: int, signature=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the ranking kernel. Inputs are already checked by the op.

    scores float32 [L, B, J + 1] (last dim contiguous); summarized bool [B, J] (contiguous);
    select int32 [L, B, C] (contiguous); ``empty_key``: the key of an empty entry (above
    ``-2**63``). Returns keys int64 [L, B, C] and changed bool [L, B]. ``signature``: the
    op's, of the three tensors, else computed here.
    """
    L, B, C = select.shape
    keys = torch.empty(L, B, C, device=scores.device, dtype=torch.int64)
    changed = torch.empty(L, B, device=scores.device, dtype=torch.bool)
    if L * B == 0:
        return keys, changed
    key = (signature or (sig(scores), sig(summarized), sig(select)), empty_key)
    plan = _PLANS.get(key) or keep_plan(_PLANS, key, _plan(scores, summarized, select,
                                                           empty_key))
    plan(scores, summarized.view(torch.uint8), select, keys, changed.view(torch.int8))
    return keys, changed


_PLANS: dict = {}   # launches (``_launch.Launch``) by signature


def _plan(scores, summarized, select, empty_key):
    L, B, C = select.shape
    J = summarized.shape[1]
    ints = (scores.stride(0), scores.stride(1), B, J)
    block_j, warps = rank_launch(J)
    meta = dict(C=C, BLOCK_J=block_j, BLOCK_C=next_pow2(C), EMPTY=empty_key, TAKEN=_TAKEN,
                ABOVE=_ABOVE, num_warps=warps)
    # keys and changed are fresh, so always 16-byte aligned
    bin_key = (scores.device, ints, C, empty_key,
               tuple(t.data_ptr() % 16 for t in (scores, summarized, select)))
    return Launch(_far_view_rank_kernel, (L * B,), bin_key, ints, meta)
