"""Independent oracles for the KV-RM substrate, written as plain loops (not the references).

- :func:`gather_oracle`: what ``paged_gather_merged`` must leave in the arena, in float64.
- :func:`plan_trains_oracle`: the greedy train merge of the contract, one move at a time.
"""

from __future__ import annotations

import torch


def gather_oracle(k_cache, v_cache, trains, num_trains: int, k_out, v_out):
    """Expected (k_out, v_out) as float64 copies, plus a bool [Q] of pages written.

    Rows [0, num_trains) that lie in the pool and arena with n >= 1 copy page by page;
    other rows are skipped (the op's documented behaviour for out-of-range rows).
    """
    P, Q = k_cache.shape[0], k_out.shape[0]
    k_want, v_want = k_out.double().clone(), v_out.double().clone()
    written = torch.zeros(Q, dtype=torch.bool)
    for src, dst, n in trains[: max(0, min(num_trains, trains.shape[0]))].tolist():
        if n < 1 or src < 0 or src + n > P or dst < 0 or dst + n > Q:
            continue
        for i in range(n):
            k_want[dst + i] = k_cache[src + i].double()
            v_want[dst + i] = v_cache[src + i].double()
            written[dst + i] = True
    return k_want, v_want, written


def plan_trains_oracle(src_pages, dst_pages, page_bytes: int, max_train_bytes: int):
    """Rows (src, dst, n) of the greedy merge, as a list of lists."""
    cap = max(1, max_train_bytes // page_bytes)
    rows: list[list[int]] = []
    for s, d in zip(src_pages, dst_pages):
        if rows and rows[-1][2] < cap and s == rows[-1][0] + rows[-1][2] \
                and d == rows[-1][1] + rows[-1][2]:
            rows[-1][2] += 1
        else:
            rows.append([int(s), int(d), 1])
    return rows


def kv_write_oracle(k, v, k_cache, v_cache, slot_mapping):
    """Expected (k_cache, v_cache) after ``paged_kv_write``, token by token: slot ``s`` in
    ``[0, P * S)`` is page ``s // S``, row ``s % S``; any other slot writes nothing. Returns
    float64 copies and a bool [P, S] of the slots written."""
    P, S = k_cache.shape[:2]
    k_want, v_want = k_cache.double().cpu().clone(), v_cache.double().cpu().clone()
    written = torch.zeros(P, S, dtype=torch.bool)
    k, v = k.double().cpu(), v.double().cpu()
    for i, s in enumerate(slot_mapping.tolist()):
        if 0 <= s < P * S:
            k_want[s // S, s % S] = k[i]
            v_want[s // S, s % S] = v[i]
            written[s // S, s % S] = True
    return k_want, v_want, written
