"""Float64 oracles for the ElasticKV ops, written from the contract, not from kvops' reference.

BASE bytes are decoded through torch's own float8 dtypes (float16 BASE is the high byte, which
*is* float8 e5m2; bfloat16 BASE is float8 e4m3fn), pages are walked block by block in Python,
and the high/low bytes of a 16-bit value are taken from its little-endian byte view.
"""

from __future__ import annotations

import torch
from torch import Tensor


def high_low_bytes(x: Tensor) -> tuple[Tensor, Tensor]:
    """The high and low byte of every 16-bit value of ``x`` (little-endian byte view)."""
    b = x.contiguous().view(torch.uint8).reshape(*x.shape, 2)
    return b[..., 1], b[..., 0]


def decode_f64(base: Tensor, dtype: torch.dtype) -> Tensor:
    """BASE bytes -> float64 values as the contract defines them."""
    f8 = torch.float8_e5m2 if dtype == torch.float16 else torch.float8_e4m3fn
    return base.contiguous().view(f8).double()


def halves(page: Tensor) -> Tensor:
    """One TARGET page [S, Hkv, D] -> its bytes as [2, S, Hkv, D]."""
    S, Hkv, D = page.shape
    return page.contiguous().view(torch.uint8).reshape(2, S, Hkv, D)


def block_mode_of(j: int, b: int, block_mode, base_span) -> int:
    if block_mode is not None:
        return int(block_mode[b, j])
    if base_span is not None:
        first, end = int(base_span[b, 0]), int(base_span[b, 1])
        if first <= j < end:
            return 1 + (j - first) % 2
    return 0


def elastic_rows(b, k_cache, v_cache, block_table, seq_lens, block_mode=None, base_span=None):
    """K and V rows [n, Hkv, D] float64 of sequence ``b`` (CPU tensors), decoded block by block."""
    S = k_cache.shape[1]
    n = int(seq_lens[b])
    ks, vs = [], []
    for j in range((n + S - 1) // S):
        page = int(block_table[b, j])
        mode = block_mode_of(j, b, block_mode, base_span)
        for cache, rows in ((k_cache, ks), (v_cache, vs)):
            if mode == 0:
                rows.append(cache[page].double())
            else:
                rows.append(decode_f64(halves(cache[page])[mode - 1], cache.dtype))
    if not ks:
        return (torch.zeros(0, *k_cache.shape[2:], dtype=torch.float64),) * 2
    return torch.cat(ks)[:n], torch.cat(vs)[:n]


def elastic_oracle(q, k_cache, v_cache, block_table, seq_lens, block_mode=None, base_span=None,
                   scale=None) -> tuple[Tensor, Tensor]:
    """out [B, Hq, D] float64 and lse [B, Hq] float64 of paged decode over TARGET/BASE blocks."""
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    block_table, seq_lens = block_table.cpu(), seq_lens.cpu()
    block_mode = None if block_mode is None else block_mode.cpu()
    base_span = None if base_span is None else base_span.cpu()
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        if int(seq_lens[b]) == 0:
            continue
        k, v = elastic_rows(b, k_cache, v_cache, block_table, seq_lens, block_mode, base_span)
        for h in range(Hq):
            s = (k[:, h // G] @ q[b, h].double()) * scale
            lse[b, h] = torch.logsumexp(s, 0)
            out[b, h] = torch.softmax(s, 0) @ v[:, h // G]
    return out, lse
