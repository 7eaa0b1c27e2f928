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


def paged_prefill_oracle(q, k_cache, v_cache, block_table, query_start, seq_lens, scale=None,
                         window=0):
    """Chunked prefill from the contract, query by query: query i of sequence b sits at
    ``p = seq_lens[b] - n_b + i`` and sees positions ``j <= p`` (``j > p - window`` when
    window > 0) whose page ``block_table[b, j // S]`` lies in the pool; each visible key is
    fetched from its page and row. Rows outside every sequence get 0 and -inf.
    Returns out [N, Hq, D] and lse [N, Hq], float64."""
    N, Hq, D = q.shape
    P, S, Hkv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    q = q.double().cpu()
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    table, starts, lens = block_table.cpu().tolist(), query_start.tolist(), seq_lens.tolist()
    out = torch.zeros(N, Hq, D, dtype=torch.float64)
    lse = torch.full((N, Hq), -math.inf, dtype=torch.float64)
    for b in range(len(lens)):
        n_b = starts[b + 1] - starts[b]
        for i in range(n_b):
            p = lens[b] - n_b + i
            first = max(0, p - window + 1) if window > 0 else 0
            where = [(table[b][j // S], j % S) for j in range(first, p + 1)]
            where = [(page, row) for page, row in where if 0 <= page < P]
            if not where:
                continue
            pages = [w[0] for w in where]
            rows = [w[1] for w in where]
            keys = k_cache[pages, rows].double()                # [n, Hkv, D]
            values = v_cache[pages, rows].double()
            for h in range(Hq):
                logits = (keys[:, h // G] @ q[starts[b] + i, h]) * scale
                top = logits.max()
                w = torch.exp(logits - top)
                out[starts[b] + i, h] = (w[:, None] * values[:, h // G]).sum(0) / w.sum()
                lse[starts[b] + i, h] = top + torch.log(w.sum())
    return out, lse
