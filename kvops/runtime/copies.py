"""Page copies a commit returns (copy-on-write), and running them on the pool.

A commit's ``copies`` are ``(src_page, dst_page)`` pairs in the order the frame made them; each
one means "``dst`` receives the bytes ``src`` holds at that point of the list". A fork of a
fork in one frame gives a chain ``[(X, Y), (Y, Z)]`` (Z must receive X's bytes), and a page a
trim freed can be a later copy's destination after an earlier copy read it. :func:`copy_stages`
cuts the list into the fewest consecutive stages in which no copy reads or writes a page an
earlier copy of the same stage wrote, and none writes a page an earlier copy of the stage
read; each stage is one gather of all its sources followed by one scatter, so the result is
the list applied one copy at a time, in one stage for the usual step.
"""

from __future__ import annotations

import torch


def copy_stages(copies: list[tuple[int, int]]) -> list[tuple[list[int], list[int]]]:
    """``[(srcs, dsts), ...]``: consecutive runs of ``copies`` safe to run as one gather and
    one scatter each, in order."""
    stages: list[tuple[list[int], list[int]]] = []
    read: set[int] = set()
    wrote: set[int] = set()
    src: list[int] = []
    dst: list[int] = []
    for s, d in copies:
        if s in wrote or d in wrote or d in read:
            stages.append((src, dst))
            src, dst, read, wrote = [], [], set(), set()
        src.append(s)
        dst.append(d)
        read.add(s)
        wrote.add(d)
    if src:
        stages.append((src, dst))
    return stages


def apply_copies(k_cache: torch.Tensor, v_cache: torch.Tensor,
                 copies: list[tuple[int, int]]) -> None:
    """Run a commit's copies ``(src_page, dst_page)`` on the pool, K and V, as if one at a time
    in list order (:func:`copy_stages`). Run them before the step writes its new tokens."""
    for src, dst in copy_stages(list(copies)):
        src_t = torch.tensor(src, dtype=torch.long).to(k_cache.device, non_blocking=True)
        dst_t = torch.tensor(dst, dtype=torch.long).to(k_cache.device, non_blocking=True)
        k_cache.index_copy_(0, dst_t, k_cache.index_select(0, src_t))
        v_cache.index_copy_(0, dst_t, v_cache.index_select(0, src_t))
