"""``torch.ops.kvops.far_page_select``: the far pages a query may attend to most (Quest scoring).

Given the per-channel key bounds of a sequence's far pages (``far_page_summarize``), the logit
of query head ``q`` against any key of page ``j`` is at most

    u_j(q) = sum_c max(q_c * kmin_jc, q_c * kmax_jc)

(each channel's product is largest at one end of its interval). A sequence keeps ONE page list
for all its heads (with GQA each head is bounded by its KV head's summaries), chosen by two
scores of each page: its BEST bound over the query heads (a page one head needs, such as the
one holding a passkey) and its bounds SUMMED over the heads (what the heads together may read
there). The first ``ceil(top_k / 2)`` entries are the pages of highest best bound, the rest
the pages of highest summed bound among the others. Either score alone loses on SmolLM2
(docs/far_view.md): the best bound lets the loosest head choose for all and leaves +2.1 % of
dense perplexity at 8k (+8.8 % with 16-token pages), the sum loses the passkeys at 8k; the
halves keep both (+0.5 % at 8k; passkey against dense there: docs/far_view.md).

- q [B, Hq, D] (float16, bfloat16 or float32); k_min, k_max [B, N, Hkv, D] in q's dtype, last
  dim contiguous, other strides free (a table shared by every row may be expanded with stride 0);
  ``Hq`` a multiple of ``Hkv``.
- num_far int32 [B]: candidates are entries ``[0, num_far[b])`` (clamped to ``[0, N]``).
- top_k: 1 <= top_k <= N.
- Returns index int32 [B, top_k] (distinct pages: the best-bound half in decreasing best bound,
  then the summed half in decreasing summed bound; ``-1`` past the candidates, once a row has
  fewer than ``top_k``) and score float32 [B, top_k] (each entry's score by the rule that chose
  it; ``-inf`` where index is -1). Scores accumulate in float32; the order of equal scores is
  unspecified. No scale: the ranking does not depend on it.

Implementations: CUDA tensors run the two kernels of ``kvops.kernels.far_page_select``: the
scores (both in one read of the summaries), then the choice (one program a row: each half's
threshold, then its entries ranked; rows of more than 16384 pages take two ``torch.topk``
instead); CPU tensors run
:func:`far_page_select_ref` (or the interpreted kernel under backend "triton"). Output shapes
depend on input shapes only, and nothing syncs the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton
from kvops.kernels.far_page_select import (
    choice_in_kernel,
    far_page_scores_fwd,
    far_page_select_fwd,
)
from kvops.ops._library import CheckedSignatures, register


def _check(q, k_min, k_max, num_far, top_k) -> None:
    _checks.tensor("q", q, rank=3, dtypes=_checks.KV_DTYPES)
    dev = q.device
    B, Hq, D = q.shape
    _checks.head_dim("q", D)
    for name, t in (("k_min", k_min), ("k_max", k_max)):
        _checks.tensor(name, t, rank=4, device=dev)
        _checks.same_dtype(name, t, "q", q)
        _checks.shape(name, t, (B, None, None, D), "B N Hkv D")
        if t.numel() and t.stride(3) != 1:
            raise ValueError(f"{name}: expected the last dim (D) contiguous, got strides "
                             f"{t.stride()}")
    _checks.shape("k_max", k_max, tuple(k_min.shape), "B N Hkv D")
    N, Hkv = k_min.shape[1], k_min.shape[2]
    _checks.heads("q", Hq, "k_min", Hkv)
    _checks.tensor("num_far", num_far, rank=1, dtypes=(torch.int32,), device=dev)
    _checks.shape("num_far", num_far, (B,), "B")
    if not isinstance(top_k, int) or not 1 <= top_k <= N:
        raise ValueError(f"top_k: expected an int in [1, N={N}], got {top_k!r}")


def head_bounds_ref(q: Tensor, k_min: Tensor, k_max: Tensor) -> Tensor:
    """Each query head's upper bound on its logit over each page, float32 [B, Hkv, G, N]:
    ``sum_d max(q_d * k_min_d, q_d * k_max_d)`` against its KV head's page bounds."""
    B, Hq, D = q.shape
    Hkv = k_min.shape[2]
    qf = q.float().view(B, Hkv, Hq // Hkv, D)
    pos, neg = qf.clamp(min=0), qf.clamp(max=0)
    if B > 1 and k_min.stride(0) == 0 and k_max.stride(0) == 0:
        # one table expanded over the rows: contract against it once, not B copies
        return (torch.einsum("bhgd,nhd->bhgn", pos, k_max[0].float())
                + torch.einsum("bhgd,nhd->bhgn", neg, k_min[0].float()))
    return (torch.einsum("bhgd,bnhd->bhgn", pos, k_max.float())
            + torch.einsum("bhgd,bnhd->bhgn", neg, k_min.float()))


def page_scores_ref(q: Tensor, k_min: Tensor, k_max: Tensor, num_far: Tensor) -> Tensor:
    """Scores float32 [2, B, N]: ``[0]`` the best bound over query heads, ``[1]`` the bounds
    summed over them (:func:`head_bounds_ref`); ``-inf`` past ``num_far``."""
    N = k_min.shape[1]
    bound = head_bounds_ref(q, k_min, k_max)
    score = torch.stack((bound.amax(dim=(1, 2)), bound.sum(dim=(1, 2))))
    cand = torch.arange(N, device=q.device)[None, :] < num_far.long()[:, None]
    return torch.where(cand, score, float("-inf"))


def _top(scores: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """The choice from ``scores [2, B, N]`` (:func:`page_scores_ref`): ``ceil(top_k / 2)``
    pages by best bound, the rest by summed bound among the others. The entries of a row with
    fewer candidates end in ``-1`` as they come: a first half with an empty entry holds every
    candidate, so its second half is empty too. Fixed shapes, no host sync."""
    half = (top_k + 1) // 2
    val, idx = torch.topk(scores[0], half, dim=1)
    if top_k > half:
        rest = scores[1].scatter(1, idx, float("-inf"))
        v2, i2 = torch.topk(rest, top_k - half, dim=1)
        val, idx = torch.cat((val, v2), dim=1), torch.cat((idx, i2), dim=1)
    idx = torch.where(val > float("-inf"), idx, -1).to(torch.int32)
    return idx, val


def far_page_select_ref(q: Tensor, k_min: Tensor, k_max: Tensor, num_far: Tensor,
                        top_k: int) -> tuple[Tensor, Tensor]:
    """PyTorch reference; the CPU implementation. Shapes as in the module doc."""
    return _top(page_scores_ref(q, k_min, k_max, num_far), top_k)


_checked = CheckedSignatures(_check)


def _impl(q, k_min, k_max, num_far, top_k):
    key, _ = _checked(q, k_min, k_max, num_far, top_k)
    if use_triton(q):
        if choice_in_kernel(k_min.shape[1]):
            return far_page_select_fwd(q, k_min, k_max, num_far, top_k, key)
        return _top(far_page_scores_fwd(q, k_min, k_max, num_far), top_k)
    return far_page_select_ref(q, k_min, k_max, num_far, top_k)


def _fake(q, k_min, k_max, num_far, top_k):
    _check(q, k_min, k_max, num_far, top_k)
    B = q.shape[0]
    return (q.new_empty((B, top_k), dtype=torch.int32),
            q.new_empty((B, top_k), dtype=torch.float32))


_op = register(
    "far_page_select",
    "(Tensor q, Tensor k_min, Tensor k_max, Tensor num_far, int top_k) -> (Tensor, Tensor)",
    _impl, _fake)


def far_page_select(q: Tensor, k_min: Tensor, k_max: Tensor, num_far: Tensor,
                    top_k: int) -> tuple[Tensor, Tensor]:
    """The ``top_k`` far pages of highest key-bound score per sequence
    (``torch.ops.kvops.far_page_select``; the retrieval far view's selection).

    For query head ``q`` the logit against any key of far page ``j`` is at most
    ``u_j(q) = sum_c max(q_c * kmin_jc, q_c * kmax_jc)``. One page list a sequence: the first
    ``ceil(top_k / 2)`` pages by their best bound over the query heads (a page one head needs),
    the rest by their bounds summed over the heads (what the heads together may read there).

    - q [B, Hq, D] (float16, bfloat16 or float32); k_min, k_max [B, N, Hkv, D] in q's dtype
      (``far_page_summarize``'s bounds), last dim contiguous, other strides free; ``Hq`` a
      multiple of ``Hkv``.
    - num_far int32 [B]: candidates are entries ``[0, num_far[b])`` (clamped to ``[0, N]``).
    - top_k: 1 <= top_k <= N.
    - Returns index int32 [B, top_k] (distinct pages: the best-bound half in decreasing best
      bound, then the summed half in decreasing summed bound; ``-1`` past the candidates) and
      score float32 [B, top_k] (each entry's score by the rule that chose it; ``-inf`` where
      index is -1: two scales in one row, not one ranking). Scores accumulate in float32; the
      order of equal scores is unspecified.

    Implementations: CUDA tensors run the scoring kernel ``kvops.kernels.far_page_select`` (both
    scores in one read) then its choice kernel (one program a row; rows of more than 16384
    pages take two ``torch.topk``); CPU tensors run
    :func:`far_page_select_ref` (or the interpreted kernel under backend "triton"). Output
    shapes depend on input shapes only; nothing syncs the host.
    """
    return _op(q, k_min, k_max, num_far, top_k)
