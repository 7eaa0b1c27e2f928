"""Float64 oracles for the far view's ops (summarization, the utility update), written as plain
loops (not the references)."""

from __future__ import annotations

import math

import torch


def far_view_summarize_oracle(k_cache, v_cache, chunk_table):
    """k_sum, v_sum [B, C, Hkv, D] in float64: for each chunk whose first page is a page id,
    the mean of K and of V over its M * S token rows (a page id outside the pool adds zero rows);
    zeros for a chunk whose first page is -1."""
    P, S, Hkv, D = k_cache.shape
    B, C, M = chunk_table.shape
    k64, v64 = k_cache.double().cpu(), v_cache.double().cpu()
    k_sum = torch.zeros(B, C, Hkv, D, dtype=torch.float64)
    v_sum = torch.zeros(B, C, Hkv, D, dtype=torch.float64)
    table = chunk_table.tolist()
    for b in range(B):
        for c in range(C):
            pages = table[b][c]
            if pages[0] == -1:
                continue
            for page in pages:
                if not 0 <= page < P:
                    continue
                for s in range(S):
                    k_sum[b, c] += k64[page, s]
                    v_sum[b, c] += v64[page, s]
            k_sum[b, c] /= M * S
            v_sum[b, c] /= M * S
    return k_sum, v_sum


def far_view_observe_oracle(q, far_k, far_bias, lse, sel, scores, live, ema):
    """far_view_observe's (mass, new scores) by loops in float64: a visible slot's mass summed
    over the query heads, then the EMA of each live row's in-range entries."""
    R, Hq, D = q.shape
    C, Hkv = far_k.shape[1], far_k.shape[2]
    G = Hq // Hkv
    N = scores.shape[1]
    mass = torch.zeros(R, C, dtype=torch.float64)
    out = scores.double().clone()
    for r in range(R):
        for c in range(C):
            b = float(far_bias[r, c])
            if b == -math.inf:
                continue
            for h in range(Hq):
                s = float(q[r, h].double() @ far_k[r, c, h // G].double()) * D ** -0.5
                norm = float(lse[r, h]) if float(lse[r, h]) > -math.inf else 0.0
                mass[r, c] += math.exp(s + b - norm)
        if live is not None and not bool(live[r]):
            continue
        for c in range(C):
            j = int(sel[r, c])
            if 0 <= j < N:
                out[r, j] = ema * float(scores[r, j]) + (1 - ema) * mass[r, c]
    return mass, out
