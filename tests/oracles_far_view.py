"""Float64 oracle for far-view summarization, written as plain loops (not the reference)."""

from __future__ import annotations

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
