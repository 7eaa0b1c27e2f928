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
    """scores [2, B, N] float64: for page j < num_far[b], with u_h = sum_c max(q_hc * kmin_jc,
    q_hc * kmax_jc) for query head h (KV head h // G), [0] the max of u_h over the heads and [1]
    their sum; -inf for the others."""
    B, Hq, D = q.shape
    N, Hkv = k_min.shape[1], k_min.shape[2]
    G = Hq // Hkv
    q64, lo64, hi64 = q.double().cpu(), k_min.double().cpu(), k_max.double().cpu()
    out = torch.full((2, B, N), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for j in range(min(max(int(num_far[b]), 0), N)):
            u = []
            for h in range(Hq):
                kv = h // G
                a, c = q64[b, h] * lo64[b, j, kv], q64[b, h] * hi64[b, j, kv]
                u.append(float(torch.maximum(a, c).sum()))
            out[0, b, j], out[1, b, j] = max(u), sum(u)
    return out


def select_oracle(scores, num_far, top_k):
    """The pages ``far_page_select`` chooses, per row a list: the ``ceil(top_k / 2)`` candidates
    of highest best bound (``scores[0]``), then the candidates of highest summed bound
    (``scores[1]``) among the rest, up to ``top_k`` in all (fewer where the row has fewer)."""
    out = []
    for b in range(scores.shape[1]):
        cand = list(range(min(max(int(num_far[b]), 0), scores.shape[2])))
        first = sorted(cand, key=lambda j: -float(scores[0, b, j]))[: (top_k + 1) // 2]
        rest = sorted((j for j in cand if j not in first), key=lambda j: -float(scores[1, b, j]))
        out.append(first + rest[: top_k - len(first)])
    return out


def far_slot_update_oracle(new, block_table, k_cache, v_cache, index, far_k, far_v, far_bias):
    """The far slots after a new page choice, as plain loops (float64 copies of the buffers):
    ``(index, far_k, far_v, far_bias)``. Per sequence: a chosen block outside the table or with
    an unmapped page (-1 or outside the pool) is no choice; a slot whose block is chosen again
    keeps it; the other chosen blocks, in their order, take the other slots in slot order and
    their pages are copied; the slots left over are empty; bias 0 over a held slot, -inf over
    an empty one. Rows of slots that are not refilled keep what they held."""
    P, S = k_cache.shape[:2]
    B, K = new.shape
    L = block_table.shape[1]
    kc, vc = k_cache.double().cpu(), v_cache.double().cpu()
    out_k, out_v = far_k.double().cpu().clone(), far_v.double().cpu().clone()
    out_i = torch.full((B, K), -1, dtype=torch.int32)
    bias = torch.full((B, K * S), float("-inf"), dtype=torch.float64)
    table, olds = block_table.cpu().tolist(), index.cpu().tolist()
    for b, row in enumerate(new.cpu().tolist()):
        chosen = [j for j in row if 0 <= j < L and 0 <= table[b][j] < P]
        old = olds[b]
        fresh = [j for j in chosen if j not in old]
        free = [slot for slot in range(K) if old[slot] < 0 or old[slot] not in chosen]
        for slot in range(K):
            if slot not in free:
                out_i[b, slot] = old[slot]
        for j, slot in zip(fresh, free):
            out_i[b, slot] = j
            page = table[b][j]
            out_k[b, slot * S:(slot + 1) * S] = kc[page]
            out_v[b, slot * S:(slot + 1) * S] = vc[page]
        for slot in range(K):
            if out_i[b, slot] >= 0:
                bias[b, slot * S:(slot + 1) * S] = 0.0
    return out_i, out_k, out_v, bias
