"""Paged KV geometry: the pool ``[P, S, Hkv, D]``, page bytes, and window arenas viewed as pages.

Layout (NHD, as vLLM and FlashInfer call it): one ``k_cache`` and one ``v_cache`` per layer, each
``[P, S, Hkv, D]``; page ``p`` holds tokens ``S`` consecutive tokens of one sequence, every KV
head, every channel, contiguous in memory (``S * Hkv * D`` elements). A page id is an int32 index
into dim 0 and ``-1`` means "no page".

A window arena is a dense per-sequence buffer ``[B, N, Hkv, D]`` (``N`` a multiple of ``S``).
Viewed as pages it is ``[B * N / S, S, Hkv, D]`` without a copy: arena page ``b * (N / S) + i``
holds the sequence's tokens ``[i * S, (i + 1) * S)`` of its ``N`` slots. That view is the
destination of ``paged_gather_merged``; the dense view is what ``static_sliding_attention`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvops import _checks


@dataclass(frozen=True)
class PagedGeometry:
    """Shape of one layer's paged pool: ``P`` pages of ``S`` tokens, ``Hkv`` heads of dim ``D``."""

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self):
        if self.num_pages < 1:
            raise ValueError(f"num_pages: expected at least 1, got {self.num_pages}")
        _checks.page_size("page_size", self.page_size)
        if self.num_kv_heads < 1:
            raise ValueError(f"num_kv_heads: expected at least 1, got {self.num_kv_heads}")
        _checks.head_dim("head_dim", self.head_dim)

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """``(S, Hkv, D)``: one page of one of K or V."""
        return (self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def pool_shape(self) -> tuple[int, int, int, int]:
        """``(P, S, Hkv, D)``."""
        return (self.num_pages,) + self.page_shape

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one of K or V (what ``plan_trains`` takes as ``page_bytes``)."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def empty_pool(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialized ``(k_cache, v_cache)``, each ``[P, S, Hkv, D]``."""
        return (torch.empty(self.pool_shape, dtype=self.dtype, device=device),
                torch.empty(self.pool_shape, dtype=self.dtype, device=device))

    @classmethod
    def of(cls, cache: torch.Tensor) -> PagedGeometry:
        """The geometry of an existing ``[P, S, Hkv, D]`` cache tensor."""
        _checks.tensor("cache", cache, rank=4)
        P, S, Hkv, D = cache.shape
        return cls(P, S, Hkv, D, cache.dtype)


def page_bytes(cache: torch.Tensor) -> int:
    """Bytes of one page of a ``[P, S, Hkv, D]`` cache (``S * Hkv * D * itemsize``)."""
    _checks.tensor("cache", cache, rank=4)
    return cache.shape[1] * cache.shape[2] * cache.shape[3] * cache.element_size()


def arena_as_pages(arena: torch.Tensor, page_size: int) -> torch.Tensor:
    """View a window arena ``[B, N, Hkv, D]`` as pages ``[B * N / S, S, Hkv, D]`` (no copy).

    Raises ``ValueError`` when ``N`` is not a multiple of ``S`` or the arena is not contiguous
    (a copy would silently drop the gather's writes).
    """
    _checks.tensor("arena", arena, rank=4)
    _checks.page_size("page_size", page_size)
    B, N, Hkv, D = arena.shape
    if N % page_size:
        raise ValueError(f"arena: window width N={N} must be a multiple of the page size "
                         f"S={page_size}")
    _checks.contiguous("arena", arena)
    return arena.view(B * (N // page_size), page_size, Hkv, D)


def pages_as_arena(pages: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of :func:`arena_as_pages`: ``[Q, S, Hkv, D]`` -> ``[B, Q / B * S, Hkv, D]``."""
    _checks.tensor("pages", pages, rank=4)
    Q, S, Hkv, D = pages.shape
    if batch < 1 or Q % batch:
        raise ValueError(f"batch: expected a positive divisor of the page count Q={Q}, "
                         f"got {batch}")
    _checks.contiguous("pages", pages)
    return pages.view(batch, Q // batch * S, Hkv, D)


def arena_page(seq: int, block: int, pages_per_seq: int) -> int:
    """Arena page of logical block ``block`` of sequence slot ``seq`` in ring order.

    A window of ``pages_per_seq = N / S`` pages holds block ``j`` in its page ``j mod (N / S)``,
    so as the window slides only the newest block's page changes.
    """
    return seq * pages_per_seq + block % pages_per_seq
