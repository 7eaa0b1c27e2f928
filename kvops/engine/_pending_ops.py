"""Private stand-ins for ``torch.ops.kvops.paged_kv_write`` and
``paged_prefill_attention`` with the contract's semantics, used only while those ops are not
registered (they are being written on another branch). Deleted once they land."""

from __future__ import annotations

import torch
from torch import Tensor


def paged_kv_write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slot_mapping: Tensor) -> None:
    if hasattr(torch.ops.kvops, "paged_kv_write"):
        return torch.ops.kvops.paged_kv_write(k, v, k_cache, v_cache, slot_mapping)
    P, S = k_cache.shape[:2]
    keep = slot_mapping >= 0
    idx = slot_mapping[keep].long()
    k_cache.view(P * S, *k_cache.shape[2:])[idx] = k[keep].to(k_cache.dtype)
    v_cache.view(P * S, *v_cache.shape[2:])[idx] = v[keep].to(v_cache.dtype)


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                            query_start: Tensor, seq_lens: Tensor, scale: float | None = None,
                            window: int = 0) -> tuple[Tensor, Tensor]:
    if hasattr(torch.ops.kvops, "paged_prefill_attention"):
        return torch.ops.kvops.paged_prefill_attention(q, k_cache, v_cache, block_table,
                                                       query_start, seq_lens, scale, window)
    N, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(N, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.full((N, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    qs, sl = query_start.tolist(), seq_lens.tolist()
    for b in range(len(sl)):
        a, e, n = qs[b], qs[b + 1], sl[b]
        if e == a:
            continue
        pos = torch.arange(n, device=q.device)
        pages = block_table[b].long()[pos // S]
        kk = k_cache[pages, pos % S].float()                    # [n, Hkv, D]
        vv = v_cache[pages, pos % S].float()
        qq = q[a:e].float().view(e - a, Hkv, G, D)
        s = torch.einsum("qhgd,khd->hgqk", qq, kk) * scale
        qpos = n - (e - a) + torch.arange(e - a, device=q.device)
        mask = pos[None, :] <= qpos[:, None]
        if window:
            mask &= pos[None, :] > qpos[:, None] - window
        s = s.masked_fill(~mask, float("-inf"))
        m = torch.logsumexp(s, dim=-1)                          # [Hkv, G, q]
        o = torch.einsum("hgqk,khd->qhgd", torch.exp(s - m[..., None]), vv)
        out[a:e] = o.reshape(e - a, Hq, D).to(q.dtype)
        lse[a:e] = m.permute(2, 0, 1).reshape(e - a, Hq)
    return out, lse
