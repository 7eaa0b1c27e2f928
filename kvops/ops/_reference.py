"""Pieces shared by the PyTorch references of the decode attention ops."""

from __future__ import annotations

import torch


def softmax_attend(logits: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of ``logits`` and the weighted sum of ``values``, in float32.

    logits [B, Hkv, G, N] (``-inf`` for slots not visible), values [B, N, Hkv, D].
    Returns out [B, Hkv, G, D] and lse [B, Hkv, G] (natural log); a row with nothing visible gets
    out = 0 and lse = -inf.
    """
    lse = torch.logsumexp(logits, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(logits - torch.where(empty, 0.0, lse)[..., None])
    out = torch.einsum("bhgn,bnhd->bhgd", p, values).masked_fill(empty[..., None], 0.0)
    return out, lse
