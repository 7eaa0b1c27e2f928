"""Triton kernel for ``kvops.far_slot_update``: a new far-page choice into the far slots, one launch.

One program owns one slot ``(b, j)`` (grid ``[B, K]``). It loads sequence ``b``'s rows of
``new`` and ``index`` (``K`` int32 each) and the block table entries of the new blocks, and
works out the whole row's bookkeeping in registers: ``same [K, K] = new[:, None] == old[None,
:]``, the fresh blocks (chosen, mapped, in no slot), the kept slots (their block chosen again),
the free slots' ranks and the fresh blocks' ranks (cumulative sums). Then it does its own
slot's part: keep the block, or take the fresh block of the slot's free rank (the ``r``-th
fresh block in ``new``'s order goes to the ``r``-th free slot in slot order), or become empty;
write ``index[b, j]`` and the slot's ``S`` entries of ``far_bias`` (0 live, ``-inf`` empty),
and, when the block is fresh, copy its page's K and V (``S * Hkv * D`` contiguous elements
each) from the pool into the slot's rows of ``far_k, far_v`` in ``BLOCK_E``-element vectors.
Every slot's row bookkeeping is recomputed by each of the row's ``K`` programs (a few hundred
register operations, far below one page copy), which is what lets the copy spread over ``B *
K`` programs instead of ``B``.

``index`` is updated in place while other programs of the row read it. That is safe: a
program reads its own slot before it writes it, and a neighbour slot it reads already
rewritten is either unchanged (kept), ``-1`` (freed, not refilled: still a free slot, same
rank) or the fresh block ``f`` the neighbour took (then ``f`` reads as kept in that slot
instead of fresh, which removes the pair ``(f, its free slot)`` of the same rank ``r`` from
both rank lists and leaves every other pairing as it was). So whatever mix of old and new
values a program sees, its own slot's outcome is the same. This needs the valid blocks of a
row of ``new`` distinct (``torch.topk`` indices are); with repeats, which slots hold a repeated
block is unspecified, but every slot still holds exactly the page its index names. The
interpreter runs programs one after another, so CPU tests see the rewritten values.

Why the copy is fused rather than planned as trains for ``paged_gather_merged``: the slot a
fresh page goes to is known only inside this bookkeeping, so trains would have to be written
out, compacted (an argsort) and counted, and the gather's grid is sized by the arena (``B *
K`` pages times ``UNITS`` programs, each re-reading every train row) even when nothing moves.
Fused, a step that keeps every page costs one launch of ``B * K`` short programs, and a fresh
page is read once and written once, with no intermediate table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._common import check_copy_block, next_pow2, page_copy_block
from kvops.kernels._launch import Launch, keep_plan


@triton.jit
def _far_slot_update_kernel(
    New, Table, K, V, Index, FarK, FarV, FarBias,
    stride_nb, stride_nk, stride_tb, stride_tl, stride_kp, stride_vp,
    NUM_K, L, P,
    S: tl.constexpr, E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_j = tl.program_id(1)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < NUM_K
    # the row's new choice: a block outside the table or unmapped in it is no choice
    b_new = tl.load(New + i_b * stride_nb + o_k * stride_nk, mask=m_k, other=-1)
    m_in = m_k & (b_new >= 0) & (b_new < L)
    b_page = tl.load(Table + i_b * stride_tb + b_new.to(tl.int64) * stride_tl, mask=m_in,
                     other=-1)
    m_new = m_in & (b_page >= 0) & (b_page < P)
    b_new = tl.where(m_new, b_new, -1)
    b_old = tl.load(Index + i_b * NUM_K + o_k, mask=m_k, other=-1)
    b_same = ((b_new[:, None] == b_old[None, :]) & m_new[:, None]).to(tl.int32)   # [new, slot]
    m_fresh = m_new & (tl.max(b_same, axis=1) == 0)
    m_kept = tl.max(b_same, axis=0) > 0
    # this slot: kept, or the fresh block whose rank among fresh blocks is the slot's rank
    # among free slots, or empty
    m_self = o_k == i_j
    old_j = tl.sum(tl.where(m_self, b_old, 0), axis=0)
    kept_j = tl.sum((m_self & m_kept).to(tl.int32), axis=0) > 0
    free_rank = tl.sum((m_k & ~m_kept & (o_k < i_j)).to(tl.int32), axis=0)
    fresh_rank = tl.cumsum(m_fresh.to(tl.int32), axis=0) - 1
    m_take = m_fresh & (fresh_rank == free_rank) & ~kept_j
    take = tl.sum(m_take.to(tl.int32), axis=0) > 0
    blk = tl.where(kept_j, old_j, tl.where(take, tl.sum(tl.where(m_take, b_new, 0), axis=0), -1))
    slot = i_b * NUM_K + i_j
    tl.store(Index + slot, blk)
    o_s = tl.arange(0, S)
    b_bias = tl.zeros([S], tl.float32) + tl.where(blk >= 0, 0.0, float("-inf"))
    tl.store(FarBias + slot * S + o_s, b_bias)
    if take:
        page = tl.sum(tl.where(m_take, b_page, 0), axis=0).to(tl.int64)
        o_e = tl.arange(0, BLOCK_E)
        for e0 in range(0, E, BLOCK_E):
            b_k = tl.load(K + page * stride_kp + e0 + o_e)
            b_v = tl.load(V + page * stride_vp + e0 + o_e)
            tl.store(FarK + slot * E + e0 + o_e, b_k)
            tl.store(FarV + slot * E + e0 + o_e, b_v)


def slot_update_launch(S: int, Hkv: int, D: int, itemsize: int) -> tuple[int, int]:
    """``(BLOCK_E, num_warps)``: page elements a copy step moves, the largest power of two that
    divides the page ``S * Hkv * D`` and holds at most 8 KiB (16 bytes, one vector, for each
    lane of 4 warps, four times over), and 4 warps (the bookkeeping is ``K``-wide, the copy one
    page)."""
    return page_copy_block(S * Hkv * D, itemsize, 8192), 4


_PLANS: dict = {}


def _plan(new, block_table, k_cache, v_cache, block_e, num_warps):
    B, K = new.shape
    P, S, Hkv, D = k_cache.shape
    L = block_table.shape[1]
    rule_e, rule_warps = slot_update_launch(S, Hkv, D, k_cache.element_size())
    block_e = block_e or rule_e
    E = S * Hkv * D
    check_copy_block("block_e", block_e, E)
    ints = (new.stride(0), new.stride(1), block_table.stride(0), block_table.stride(1),
            k_cache.stride(0), v_cache.stride(0), K, L, P)
    meta = dict(S=S, E=E, BLOCK_K=next_pow2(K), BLOCK_E=block_e,
                num_warps=num_warps or rule_warps)
    # the plan's own token keys its compiled kernel (see static_sliding_attention._plan)
    return Launch(_far_slot_update_kernel, (B, K), object(), ints, meta)


def far_slot_update_fwd(new: torch.Tensor, block_table: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, index: torch.Tensor, far_k: torch.Tensor,
                        far_v: torch.Tensor, far_bias: torch.Tensor, *,
                        block_e: int | None = None, num_warps: int | None = None,
                        signature=None) -> None:
    """Launch the kernel. Inputs are already checked by the op.

    new int32 [B, K]; block_table int32 [B, L] (any strides); k_cache, v_cache [P, S, Hkv, D]
    (contiguous pages, any page stride); index int32 [B, K], far_k, far_v [B, K * S, Hkv, D],
    far_bias float32 [B, K * S] (contiguous, written in place). A launch's plan is kept per
    argument signature (``signature``: the op's, else one is computed here) and knobs.
    """
    if new.shape[0] == 0:
        return
    tensors = (new, block_table, k_cache, v_cache, index, far_k, far_v, far_bias)
    if signature is None:
        signature = tuple(sig(t) for t in tensors)
    key = (signature, block_e, num_warps)
    plan = _PLANS.get(key) or keep_plan(
        _PLANS, key, _plan(new, block_table, k_cache, v_cache, block_e, num_warps))
    plan(*tensors)
