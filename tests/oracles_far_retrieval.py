"""Float64 oracles for the retrieval far view, written as plain loops (not the references)."""

from __future__ import annotations

import torch


def far_page_summarize_oracle(k_cache, pages):
    """k_min, k_max [B, N, Hkv, D] in float64: per channel, the min and max over the page's S
    key rows; zeros for an id outside the pool."""
    P, S, Hkv, D = k_cache.shape
    B, N = pages.shape
    k64 = k_cache.double().cpu()
    lo = torch.zeros(B, N, Hkv, D, dtype=torch.float64)
    hi = torch.zeros(B, N, Hkv, D, dtype=torch.float64)
    for b, row in enumerate(pages.tolist()):
        for n, page in enumerate(row):
            if not 0 <= page < P:
                continue
            lo[b, n] = k64[page, 0]
            hi[b, n] = k64[page, 0]
            for s in range(1, S):
                lo[b, n] = torch.minimum(lo[b, n], k64[page, s])
                hi[b, n] = torch.maximum(hi[b, n], k64[page, s])
    return lo, hi


def page_scores_oracle(q, k_min, k_max, num_far):
    """scores [B, N] float64: for page j < num_far[b], max over query heads h (KV head h // G)
    of sum_c max(q_hc * kmin_jc, q_hc * kmax_jc); -inf for the others."""
    B, Hq, D = q.shape
    N, Hkv = k_min.shape[1], k_min.shape[2]
    G = Hq // Hkv
    q64, lo64, hi64 = q.double().cpu(), k_min.double().cpu(), k_max.double().cpu()
    out = torch.full((B, N), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for j in range(min(max(int(num_far[b]), 0), N)):
            best = float("-inf")
            for h in range(Hq):
                kv = h // G
                a, c = q64[b, h] * lo64[b, j, kv], q64[b, h] * hi64[b, j, kv]
                best = max(best, float(torch.maximum(a, c).sum()))
            out[b, j] = best
    return out
