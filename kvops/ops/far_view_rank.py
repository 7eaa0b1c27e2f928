"""``torch.ops.kvops.far_view_rank``: checks, PyTorch reference, registration, fake.

The op's documentation is :func:`far_view_rank`'s docstring (``help()`` shows it).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.kernels.far_view_rank import far_view_rank_fwd
from kvops.ops._library import CheckedSignatures, register

# an empty entry's key: below every utility's key (-inf's included), and its low 32 bits are
# -1, so keys.astype(int32) are selection entries (chunk ids, -1 for empty)
EMPTY_KEY = -(2 ** 63) | 0xFFFFFFFF
_LOW31 = np.int32(0x7FFFFFFF)


def _check(scores, summarized, select) -> None:
    _checks.tensor("scores", scores, rank=3, dtypes=(torch.float32,))
    dev = scores.device
    L, B, J1 = scores.shape
    if J1 < 2:
        raise ValueError(f"scores: expected [L, B, J + 1] with J >= 1 chunks, got shape "
                         f"{tuple(scores.shape)}")
    if scores.numel() and scores.stride(2) != 1:
        raise ValueError(f"scores: expected the last dim contiguous, got strides "
                         f"{scores.stride()}")
    _checks.tensor("summarized", summarized, rank=2, dtypes=(torch.bool,), device=dev)
    _checks.shape("summarized", summarized, (B, J1 - 1), "B J")
    _checks.contiguous("summarized", summarized)
    _checks.tensor("select", select, rank=3, dtypes=(torch.int32,), device=dev)
    _checks.shape("select", select, (L, B, None), "L B C")
    if select.shape[2] < 1:
        raise ValueError(f"select: expected at least one entry a row (C >= 1), got shape "
                         f"{tuple(select.shape)}")
    _checks.contiguous("select", select)


def rank_keys(utility, ids):
    """int64 ranking keys ordered as ``(utility, id)`` (float32 utilities, ids in
    ``[0, 2**31)``; numpy arrays or tensors alike): a higher utility ranks higher, and of
    equal ones the higher id (the newer chunk); the id is the key's low 32 bits. The float's
    bits mapped to an order-preserving int32 (negative ones with their magnitude bits
    flipped), shifted up, plus the id."""
    if isinstance(utility, Tensor):
        bits = utility.to(torch.float32).contiguous().view(torch.int32)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
    else:
        bits = np.ascontiguousarray(utility, dtype=np.float32).view(np.int32)
        key = (bits ^ ((bits >> 31) & _LOW31)).astype(np.int64)
    key <<= 32
    key |= ids
    return key


def far_view_rank_ref(scores: Tensor, summarized: Tensor, select: Tensor) -> tuple[Tensor, Tensor]:
    """PyTorch reference; the CPU implementation. Shapes as in :func:`far_view_rank`."""
    L, B, C = select.shape
    J = summarized.shape[1]
    empty = torch.full((), EMPTY_KEY, dtype=torch.int64, device=scores.device)
    ids = torch.arange(J, dtype=torch.int64, device=scores.device)
    key = torch.where(summarized, rank_keys(scores[..., :J], ids), empty)  # [L, B, J]
    k = min(C, J)
    top = key.topk(k, dim=2).values
    if k < C:
        top = torch.cat([top, empty.expand(L, B, C - k)], dim=2)
    cur = select.to(torch.int64)
    has = cur >= 0
    cur_key = torch.where(has, rank_keys(scores.gather(2, cur.clamp(min=0)), cur), empty)
    moved = ((cur_key.amin(dim=2) < top[..., C - 1])
             | (has.sum(dim=2) != (top != empty).sum(dim=2)))
    return torch.where(moved[..., None], top, cur_key), moved


_checked = CheckedSignatures(_check)


def _impl(scores, summarized, select):
    key, _ = _checked(scores, summarized, select)
    if validate():
        _checks.index_range("select", select, -1, summarized.shape[1])
    if use_triton(scores):
        return far_view_rank_fwd(scores, summarized, select, EMPTY_KEY, key)
    return far_view_rank_ref(scores, summarized, select)


def _fake(scores, summarized, select):
    _check(scores, summarized, select)
    L, B, C = select.shape
    return (scores.new_empty((L, B, C), dtype=torch.int64),
            scores.new_empty((L, B), dtype=torch.bool))


_op = register("far_view_rank", "(Tensor scores, Tensor summarized, Tensor select) -> (Tensor, Tensor)",
               _impl, _fake)


def far_view_rank(scores: Tensor, summarized: Tensor,
                  select: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's top ``C`` summaries by utility, against the committed selection
    (``torch.ops.kvops.far_view_rank``; the far view's re-ranking on the device).

    A chunk's ranking key is ``(utility, chunk id)`` as one int64: the float32 utility's bits
    mapped to an order-preserving int32 in the high word, the id in the low word. So keys are
    unique, a higher utility ranks higher, and of equal utilities the newer (higher) chunk.

    - scores float32 [L, B, J + 1]: utilities per layer, slot and chunk (column ``J`` is the
      far view's sink and is not ranked); last dim contiguous.
    - summarized bool [B, J]: the chunks each slot has a summary of (the candidates).
    - select int32 [L, B, C]: the committed selection rows (chunk ids, ``-1`` empty).
    - Returns ``keys`` int64 [L, B, C] and ``changed`` bool [L, B]. A row changes where the
      committed row does not hold the top ``C`` summarized chunks (its lowest key is below
      the ``C``-th largest, or it holds a different number of entries); its keys are then the
      top ``C`` (in no particular order), else the committed row's keys in its own order. An
      empty entry's key is ``-2**63 | 0xFFFFFFFF`` (its low 32 bits are -1, so
      ``keys.to(int32)`` are the selection entries).

    Implementations: CUDA tensors run ``kvops.kernels.far_view_rank`` (one program a row);
    CPU tensors run :func:`far_view_rank_ref` (or the interpreted kernel under backend
    "triton"). Output shape depends on input shapes only; nothing syncs the host.
    """
    return _op(scores, summarized, select)
