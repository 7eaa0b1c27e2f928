"""``torch.ops.kvops.far_view_observe``: checks, PyTorch reference, registration, fake.

The op's documentation is :func:`far_view_observe`'s docstring (``help()`` shows it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.kernels.far_view_observe import far_view_observe_fwd
from kvops.ops._library import CheckedSignatures, register

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# far slots times head dim of one KV head's keys, which the kernel holds as one tile (cap 64 at
# D 512, 256 at D 128)
MAX_SLOT_ELEMS = 32768


def _check(q, far_k, far_bias, lse, select, scores, live, ema, scale=None) -> None:
    _checks.tensor("q", q, rank=3, dtypes=DTYPES)
    dev = q.device
    R, Hq, D = q.shape
    _checks.tensor("far_k", far_k, rank=4, device=dev)
    _checks.same_dtype("far_k", far_k, "q", q)
    _checks.shape("far_k", far_k, (R, None, None, D), "R C Hkv D")
    C, Hkv = far_k.shape[1], far_k.shape[2]
    if C < 1:
        raise ValueError(f"far_k: expected at least one far slot (C >= 1), got shape "
                         f"{tuple(far_k.shape)}")
    _checks.heads("q", Hq, "far_k", Hkv)
    _checks.head_dim("q", D)
    if C * D > MAX_SLOT_ELEMS:
        raise ValueError(f"far_k: expected C * D <= {MAX_SLOT_ELEMS} (a KV head's far keys are "
                         f"one tile), got C={C}, D={D}")
    for name, t in (("q", q), ("far_k", far_k)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected the head dim contiguous, got strides {t.stride()}")
    _checks.tensor("far_bias", far_bias, rank=2, dtypes=(torch.float32,), device=dev)
    _checks.shape("far_bias", far_bias, (R, C), "R C")
    _checks.contiguous("far_bias", far_bias)
    _checks.tensor("lse", lse, rank=2, dtypes=(torch.float32,), device=dev)
    _checks.shape("lse", lse, (R, Hq), "R Hq")
    if lse.numel() and lse.stride(1) != 1:
        raise ValueError(f"lse: expected the head dim contiguous, got strides {lse.stride()}")
    _checks.tensor("select", select, rank=2, dtypes=(torch.int32,), device=dev)
    _checks.shape("select", select, (R, C), "R C")
    _checks.contiguous("select", select)
    _checks.tensor("scores", scores, rank=2, dtypes=(torch.float32,), device=dev)
    if scores.shape[0] < R or scores.shape[1] < 1:
        raise ValueError(f"scores: expected [B, N] with B >= R={R} rows and N >= 1 columns, "
                         f"got shape {tuple(scores.shape)}")
    if scores.numel() and scores.stride(1) != 1:
        raise ValueError(f"scores: expected the last dim contiguous, got strides "
                         f"{scores.stride()}")
    if live is not None:
        _checks.tensor("live", live, rank=1, dtypes=(torch.bool,), device=dev)
        _checks.shape("live", live, (R,), "R")
        _checks.contiguous("live", live)
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"ema: expected a value in [0, 1), got {ema}")


def far_view_observe_ref(q: Tensor, far_k: Tensor, far_bias: Tensor, lse: Tensor,
                         select: Tensor, scores: Tensor, live: Tensor | None = None,
                         ema: float = 0.9, scale: float | None = None) -> Tensor:
    """PyTorch reference; the CPU implementation. Shapes as in :func:`far_view_observe`."""
    R, Hq, D = q.shape
    Hkv = far_k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    vis = far_bias > float("-inf")                                       # [R, C]
    kf = torch.where(vis[:, :, None, None], far_k.float(), 0.0)
    logits = torch.einsum("rhgd,rchd->rhgc", q.float().view(R, Hkv, G, D), kf) * scale
    norm = lse.view(R, Hkv, G, 1)
    norm = torch.where(norm > float("-inf"), norm, 0.0)
    bias = torch.where(vis, far_bias, 0.0)[:, None, None, :]
    p = torch.exp(logits + bias - norm)
    mass = torch.where(vis[:, None, None, :], p, 0.0).sum(dim=(1, 2))      # [R, C]
    N = scores.shape[1]
    sel = select.long()
    upd = (sel >= 0) & (sel < N)
    if live is not None:
        upd &= live[:, None]
    rows = scores[:R]
    old = rows.gather(1, torch.where(upd, sel, 0))
    ext = F.pad(rows, (0, 1))                     # column N takes the entries that update none
    ext.scatter_(1, torch.where(upd, sel, N), ema * old + (1.0 - ema) * mass)
    rows.copy_(ext[:, :N])
    return mass


_checked = CheckedSignatures(_check)


def _impl(q, far_k, far_bias, lse, select, scores, live=None, ema=0.9, scale=None):
    # scale is part of the signature, so its int names the launch plan alone
    key, _ = _checked(q, far_k, far_bias, lse, select, scores, live, ema, scale)
    if validate():
        _checks.index_range("select", select, 0, scores.shape[1], allow=-1)
    if use_triton(q):
        return far_view_observe_fwd(q, far_k, far_bias, lse, select, scores, live, ema,
                                    q.shape[2] ** -0.5 if scale is None else scale,
                                    signature=key)
    return far_view_observe_ref(q, far_k, far_bias, lse, select, scores, live, ema, scale)


def _fake(q, far_k, far_bias, lse, select, scores, live=None, ema=0.9, scale=None):
    _check(q, far_k, far_bias, lse, select, scores, live, ema)
    return q.new_empty((q.shape[0], far_k.shape[1]), dtype=torch.float32)


_op = register(
    "far_view_observe",
    "(Tensor q, Tensor far_k, Tensor far_bias, Tensor lse, Tensor select, Tensor(a!) scores, "
    "Tensor? live=None, float ema=0.9, float? scale=None) -> Tensor",
    _impl, _fake)


def far_view_observe(q: Tensor, far_k: Tensor, far_bias: Tensor, lse: Tensor, select: Tensor,
                     scores: Tensor, live: Tensor | None = None, ema: float = 0.9,
                     scale: float | None = None) -> Tensor:
    """The far view's utility update from one attention call, in place
    (``torch.ops.kvops.far_view_observe``; :meth:`kvops.runtime.FarView.observe`).

    A far slot's mass is the attention probability the call gave it, summed over the query
    heads: ``mass[r, c] = sum_h exp(scale * q[r, h] . far_k[r, c, h // G] + far_bias[r, c]
    - lse[r, h])`` (an ``lse`` of ``-inf``, a row with nothing visible, counts as 0). Each
    selection entry ``select[r, c]`` in ``[0, N)`` of a live row then moves its utility
    ``scores[r, select[r, c]]`` to ``ema * old + (1 - ema) * mass[r, c]``; entries of ``-1``
    (empty slots) and rows that are not live change nothing.

    - q [R, Hq, D] float16, bfloat16 or float32 (the query the attention saw; head dim
      contiguous, D a multiple of 16 up to 512); far_k [R, C, Hkv, D], q's dtype (the far
      keys it saw; ``C * D`` at most 32768: one KV head's keys are one tile); far_bias float32
      [R, C] (its far bias: a slot of ``-inf`` is invisible, its key never read, its mass 0);
      lse float32 [R, Hq] (the attention's natural-log ``lse``).
    - select int32 [R, C]: the column of ``scores`` each slot's summary owns, ``-1`` none.
      A row's entries ``>= 0`` should be distinct (with a repeat, which update lands is
      unspecified). Validation mode raises IndexError for entries outside ``[0, N)`` other
      than ``-1``; otherwise such entries update nothing.
    - scores float32 [B, N] with ``B >= R`` (rows ``[0, R)`` are the call's; last dim
      contiguous): updated in place. live bool [R] (optional): rows whose query is real.
    - ema in ``[0, 1)``; scale defaults to ``D ** -0.5``.
    - Returns ``mass`` float32 [R, C] (0 for an invisible slot).

    Implementations: CUDA tensors run ``kvops.kernels.far_view_observe`` (Triton, one program a
    row: one launch where the torch path takes about twenty); CPU tensors run
    :func:`far_view_observe_ref` (or the interpreted kernel under backend "triton"). Fixed
    shapes, no host sync: it runs inside a captured decode step.
    """
    return _op(q, far_k, far_bias, lse, select, scores, live, ema, scale)
