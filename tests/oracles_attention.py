"""Float64 oracles for the decode attention ops, written without the library's references.

They walk the visible slots explicitly (no masks, no logsumexp helper) so that a shared mistake
between a kernel and its reference cannot hide here.
"""

from __future__ import annotations

import math

import torch


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
            biases: list[float], scale: float) -> tuple[torch.Tensor, float]:
    """One query row [D] over explicit (key, value, bias) slots, all float64."""
    logits = [float(q @ k) * scale + b for k, b in zip(keys, biases)]
    finite = [x for x in logits if x != -math.inf]
    if not finite:
        return torch.zeros_like(q), -math.inf
    top = max(finite)
    weights = [math.exp(x - top) if x != -math.inf else 0.0 for x in logits]
    total = sum(weights)
    out = sum(w * v for w, v in zip(weights, values)) / total
    return out, top + math.log(total)


def sliding_window_oracle(q, k, v, win_start, win_len, far_k=None, far_v=None, far_bias=None,
                          scale=None):
    """q [B, Hq, D]; k, v [B, W, Hkv, D]; returns out [B, Hq, D] float64, lse [B, Hq] float64."""
    B, Hq, D = q.shape
    W, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    lse = torch.zeros(B, Hq, dtype=torch.float64)
    for b in range(B):
        start, length = int(win_start[b]), max(0, min(int(win_len[b]), W))
        slots = [(start + i) % W for i in range(length)]
        for h in range(Hq):
            kv = h // G
            keys = [k[b, j, kv] for j in slots]
            vals = [v[b, j, kv] for j in slots]
            biases = [0.0] * len(slots)
            if far_k is not None:
                for c in range(far_k.shape[1]):
                    keys.append(far_k[b, c, kv].double().cpu())
                    vals.append(far_v[b, c, kv].double().cpu())
                    biases.append(float(far_bias[b, c]))
            out[b, h], lse[b, h] = _attend(q[b, h], keys, vals, biases, scale)
    return out, lse
