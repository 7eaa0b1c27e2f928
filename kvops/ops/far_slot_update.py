"""``torch.ops.kvops.far_slot_update``: checks, PyTorch reference, registration, fake.

The op's documentation is :func:`far_slot_update`'s docstring (``help()`` shows it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.kernels.far_slot_update import far_slot_update_fwd
from kvops.ops._library import CheckedSignatures, register
from kvops.ops.paged_gather_merged import paged_gather_merged_ref


def _check(new, block_table, k_cache, v_cache, index, far_k, far_v, far_bias) -> None:
    P, S, Hkv, D = _checks.kv_pool(k_cache, v_cache)
    dev = k_cache.device
    _checks.tensor("new", new, rank=2, dtypes=(torch.int32,), device=dev)
    B, K = new.shape
    if K < 1:
        raise ValueError(f"new: expected at least one slot (K >= 1), got shape {tuple(new.shape)}")
    _checks.tensor("block_table", block_table, rank=2, dtypes=(torch.int32,), device=dev)
    _checks.shape("block_table", block_table, (B, None), "B L")
    if block_table.shape[1] < 1:
        raise ValueError(f"block_table: expected at least one block (L >= 1), got shape "
                         f"{tuple(block_table.shape)}")
    _checks.tensor("index", index, rank=2, dtypes=(torch.int32,), device=dev)
    _checks.shape("index", index, (B, K), "B K")
    for name, t in (("far_k", far_k), ("far_v", far_v)):
        _checks.tensor(name, t, rank=4, device=dev)
        _checks.same_dtype(name, t, "k_cache", k_cache)
        _checks.shape(name, t, (B, K * S, Hkv, D), "B K*S Hkv D")
    _checks.tensor("far_bias", far_bias, rank=2, dtypes=(torch.float32,), device=dev)
    _checks.shape("far_bias", far_bias, (B, K * S), "B K*S")
    for name, t in (("index", index), ("far_k", far_k), ("far_v", far_v),
                    ("far_bias", far_bias)):
        _checks.contiguous(name, t)


def _distinct(name: str, t: Tensor) -> None:
    """Validation mode: the blocks (entries >= 0) of each row of ``t`` are distinct."""
    if t.shape[1] < 2:
        return
    s = t.sort(dim=1).values
    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
    if bool(dup.any()):
        b, j = (int(x) for x in torch.nonzero(dup)[0])
        raise ValueError(f"{name}: expected the blocks (entries >= 0) of each row distinct, "
                         f"found block {int(s[b, j + 1])} twice in row {b}")


def _validate(new, block_table, index, P) -> None:
    L = block_table.shape[1]
    _checks.index_range("new", new, 0, L, allow=-1)
    _checks.index_range("index", index, 0, L, allow=-1)
    _checks.index_range("block_table", block_table, 0, P, allow=-1)
    _distinct("new", new)
    _distinct("index", index)


def far_slot_plan_ref(new: Tensor, block_table: Tensor, index: Tensor,
                      num_pages: int) -> tuple[Tensor, Tensor, Tensor]:
    """The bookkeeping half of the reference: the slots' new blocks and the copies to make.

    Returns ``slots int32 [B, K]`` (the new ``index``; a view) and the copies as
    :func:`~kvops.ops.paged_gather_merged.paged_gather_merged` trains over the far buffers
    viewed as ``B * K`` pages: ``trains int32 [B * K, 3]`` (one one-page row per fresh block,
    those first) and ``num_trains int32 [1]`` (their count), all on the device, fixed shapes.
    """
    B, K = new.shape
    L = block_table.shape[1]
    inb = (new >= 0) & (new < L)
    page = block_table.gather(1, torch.where(inb, new, 0).long())
    new = torch.where(inb & (page >= 0) & (page < num_pages), new, -1)   # unmapped: no choice
    old = index
    same = (new[:, :, None] == old[:, None, :]) & (new >= 0)[:, :, None]     # [B, K, K]
    fresh = (new >= 0) & ~same.any(dim=2)                           # new pages to copy
    kept = same.any(dim=1)                                          # old slots still chosen
    # the r-th fresh page goes to the r-th slot not kept
    free = torch.argsort(kept.to(torch.int8), dim=1, stable=True)   # free slots first
    rank = (torch.cumsum(fresh.to(torch.int32), dim=1) - 1).clamp(min=0)
    dest = torch.where(fresh, free.gather(1, rank.long()), K)       # K: no slot
    slots = torch.cat([torch.where(kept, old, -1), old.new_full((B, 1), -1)], dim=1)
    slots.scatter_(1, dest, torch.where(fresh, new, -1))
    # copies: slot dest of sequence b <- page; zero pages where nothing changes
    dst = torch.arange(B, device=new.device)[:, None] * K + dest.clamp(max=K - 1)
    trains = torch.stack([torch.where(fresh, page, 0), dst.to(page.dtype),
                          fresh.to(page.dtype)], dim=-1).view(B * K, 3).to(torch.int32)
    flat = fresh.flatten()                    # the copies first, their count on the device
    trains = trains[torch.argsort((~flat).to(torch.int8), stable=True)]
    return slots[:, :K], trains, flat.sum(dtype=torch.int32).view(1)


def slot_bias_ref(slots: Tensor, S: int) -> Tensor:
    """far_bias float32 [B, K * S]: 0 over a slot holding a block, ``-inf`` over an empty one."""
    live = torch.where(slots >= 0, 0.0, float("-inf")).to(torch.float32)
    return live.repeat_interleave(S, dim=1)


def far_slot_update_ref(new: Tensor, block_table: Tensor, k_cache: Tensor, v_cache: Tensor,
                        index: Tensor, far_k: Tensor, far_v: Tensor, far_bias: Tensor) -> None:
    """PyTorch reference; the CPU implementation. Fixed shapes, no host sync."""
    B, K = new.shape
    S, Hkv, D = k_cache.shape[1:]
    slots, trains, num_trains = far_slot_plan_ref(new, block_table, index, k_cache.shape[0])
    paged_gather_merged_ref(k_cache, v_cache, trains, num_trains, far_k.view(B * K, S, Hkv, D),
                            far_v.view(B * K, S, Hkv, D))
    index.copy_(slots)
    far_bias.copy_(slot_bias_ref(slots, S))


_checked = CheckedSignatures(_check)


def _impl(new, block_table, k_cache, v_cache, index, far_k, far_v, far_bias):
    args = (new, block_table, k_cache, v_cache, index, far_k, far_v, far_bias)
    key, _ = _checked(*args)
    if validate():
        _validate(new, block_table, index, k_cache.shape[0])
    if use_triton(k_cache):
        far_slot_update_fwd(*args, signature=key)
        return
    far_slot_update_ref(*args)


def _fake(new, block_table, k_cache, v_cache, index, far_k, far_v, far_bias):
    _check(new, block_table, k_cache, v_cache, index, far_k, far_v, far_bias)


_op = register(
    "far_slot_update",
    "(Tensor new, Tensor block_table, Tensor k_cache, Tensor v_cache, Tensor(a!) index, "
    "Tensor(b!) far_k, Tensor(c!) far_v, Tensor(d!) far_bias) -> ()",
    _impl, _fake)


def far_slot_update(new: Tensor, block_table: Tensor, k_cache: Tensor, v_cache: Tensor,
                    index: Tensor, far_k: Tensor, far_v: Tensor, far_bias: Tensor):
    """Bring a new choice of far pages into fixed far slots, in place, in one launch
    (``torch.ops.kvops.far_slot_update``; the retrieval far view's per-step slot update,
    :class:`kvops.runtime.FarRetrieval`).

    Per sequence ``b``, ``index[b]`` names the logical far block each of the ``K`` slots holds
    (``-1`` empty) and ``new[b]`` the blocks chosen now (``far_page_select``'s indices). A slot
    whose block is chosen again keeps it (nothing is copied); the chosen blocks in no slot
    (fresh) go to the other slots, the ``r``-th fresh block in ``new``'s order to the ``r``-th
    such slot in slot order; the slots left over become empty. A fresh block's page
    ``block_table[b, block]`` is copied from the pool into the slot's ``S`` rows of ``far_k,
    far_v``; ``far_bias`` is 0 over a slot holding a block and ``-inf`` over an empty one, so
    attention never reads an empty slot's rows (they keep stale data).

    - new int32 [B, K]: chosen logical blocks, ``-1`` none. An entry outside ``[0, L)``, or whose
      page is unmapped (``block_table`` ``-1``, or outside ``[0, P)``: a trimmed block) is no
      choice: it is never gathered, and a slot that held it becomes empty. The blocks of a row
      must be distinct (``torch.topk`` indices are).
    - block_table int32 [B, L]: page of logical block ``j`` of sequence ``b`` (any strides).
    - k_cache, v_cache [P, S, Hkv, D]: the pool (contiguous pages, any page stride).
    - index int32 [B, K] (in/out): the slots' blocks before, then after; entries ``>= 0`` of a
      row distinct (what the op writes, given a distinct ``new``).
    - far_k, far_v [B, K * S, Hkv, D] in the pool dtype; far_bias float32 [B, K * S]: written
      in place. ``index``, ``far_k``, ``far_v``, ``far_bias`` must be contiguous.

    With repeated blocks in a row of ``new``, which slots hold the repeat is unspecified; every
    slot still holds exactly the page its ``index`` entry names, or is empty. Validation mode
    (``kvops.validate(True)``) raises IndexError for ``new`` or ``index`` outside ``[0, L)``
    (other than ``-1``) or a page outside ``[0, P)`` (other than ``-1``), and ValueError for a
    repeated block in a row of ``new`` or ``index``.

    Implementations: CUDA tensors run ``kvops.kernels.far_slot_update`` (Triton, one launch of
    ``B * K`` programs); CPU tensors run :func:`far_slot_update_ref` (or the interpreted kernel
    under backend "triton"). Nothing syncs the host, shapes are fixed: one captured graph serves
    every step.
    """
    return _op(new, block_table, k_cache, v_cache, index, far_k, far_v, far_bias)
