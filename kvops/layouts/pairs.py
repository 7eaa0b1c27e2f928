"""The BASE pair layout: one TARGET page viewed as two BASE halves (ElasticKV section 3.1).

A TARGET page ``[S, Hkv, D]`` of a 16-bit dtype holds ``2 * S * Hkv * D`` bytes; viewed as
``uint8 [2, S, Hkv, D]`` it holds two logical blocks in BASE form, half 0 and half 1, each laid
out like a TARGET block (token, head, channel) with one byte per value. The view needs each page
to be contiguous; the page stride may be anything (a K half of an interleaved KV pool works).
"""

from __future__ import annotations

import torch
from torch import Tensor


def page_contiguous(t: Tensor) -> bool:
    """True when every page ``t[p]`` of a ``[P, S, Hkv, D]`` pool is one contiguous run."""
    _, S, Hkv, D = t.shape
    return (t.stride(3) == 1 or D == 1) and (t.stride(2) == D or Hkv == 1) and (
        t.stride(1) == Hkv * D or S == 1)


def base_pair_view(cache: Tensor) -> Tensor:
    """``cache [P, S, Hkv, D]`` (16-bit, page-contiguous) -> ``uint8 [P, 2, S, Hkv, D]``, no copy."""
    P, S, Hkv, D = cache.shape
    if cache.element_size() != 2:
        raise TypeError(f"cache: the pair view needs a 16-bit dtype, got {cache.dtype}")
    if not page_contiguous(cache):
        raise ValueError(f"cache: expected contiguous pages [S, Hkv, D], got strides {cache.stride()}")
    return torch.as_strided(cache.view(torch.uint8), (P, 2, S, Hkv, D),
                            (2 * cache.stride(0), S * Hkv * D, Hkv * D, D, 1))


def check_pair_rows(name: str, pairs: Tensor, num_pages: int, kind: str) -> None:
    """Validation mode: host checks of a ``[N, 3]`` pair table (syncs the device).

    ``kind`` "pack": rows ``(src_a, src_b, dst)``, ``dst`` may equal one source;
    ``kind`` "refine": rows ``(dst_a, dst_b, base_page)``, ``base_page`` may equal one
    destination. Page ids must lie in ``[0, num_pages)`` (``IndexError``); the two
    pages of a row must differ, and no page may appear in two rows (``ValueError``), since rows
    run concurrently.
    """
    if pairs.numel() == 0:
        return
    rows = pairs.to("cpu", torch.int64)
    bad = (rows < 0) | (rows >= num_pages)
    if bool(bad.any()):
        raise IndexError(f"{name}: page ids must lie in [0, {num_pages}), found "
                         f"{rows[bad][0].item()}")
    one, two, third = rows[:, 0], rows[:, 1], rows[:, 2]
    same = one == two
    if bool(same.any()):
        i = int(same.nonzero()[0])
        cols = "src_a == src_b" if kind == "pack" else "dst_a == dst_b"
        raise ValueError(f"{name}: row {i} has {cols} = {one[i].item()}")
    shared = (third == one) | (third == two)
    pages = torch.cat([one, two, third[~shared]])
    uniq, counts = pages.unique(return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"{name}: page {uniq[counts > 1][0].item()} appears in more than one row")
