"""kvops.layouts.paged: pool geometry, page bytes, window arenas viewed as pages."""

from __future__ import annotations

import pytest
import torch

from kvops.layouts import PagedGeometry, arena_as_pages, arena_page, page_bytes, pages_as_arena


@pytest.mark.parametrize("S,Hkv,D,dtype,want", [
    (16, 8, 128, torch.float16, 32768),
    (64, 8, 128, torch.bfloat16, 131072),
    (8, 3, 64, torch.float32, 6144),
], ids=["S16-Hkv8-D128-fp16", "S64-Hkv8-D128-bf16", "S8-Hkv3-D64-fp32"])
def test_geometry_and_page_bytes(S, Hkv, D, dtype, want):
    geo = PagedGeometry(5, S, Hkv, D, dtype)
    assert geo.page_bytes == want and geo.pool_shape == (5, S, Hkv, D)
    k, v = geo.empty_pool()
    assert k.shape == geo.pool_shape and v.dtype == dtype
    assert page_bytes(k) == want == k[0].numel() * k.element_size()
    assert PagedGeometry.of(k) == geo


def test_arena_views_share_memory_and_ring_order():
    B, N, S, Hkv, D = 3, 24, 8, 2, 16
    arena = torch.arange(B * N * Hkv * D, dtype=torch.float32).view(B, N, Hkv, D)
    pages = arena_as_pages(arena, S)
    assert pages.shape == (B * N // S, S, Hkv, D)
    assert pages.data_ptr() == arena.data_ptr()
    pages[4].fill_(-1)                                   # sequence 1, tokens 8..15
    assert (arena[1, 8:16] == -1).all() and (arena[1, :8] >= 0).all()
    assert pages_as_arena(pages, B).data_ptr() == arena.data_ptr()
    assert torch.equal(pages_as_arena(pages, B), arena)
    # ring order: block j of sequence b sits in page b * N/S + j % (N/S)
    assert [arena_page(1, j, N // S) for j in range(7)] == [3, 4, 5, 3, 4, 5, 3]


@pytest.mark.parametrize("make,err,msg", [
    (lambda: PagedGeometry(0, 16, 8, 128), ValueError, "num_pages"),
    (lambda: PagedGeometry(4, 12, 8, 128), ValueError, "S=12"),
    (lambda: PagedGeometry(4, 16, 0, 128), ValueError, "num_kv_heads"),
    (lambda: PagedGeometry(4, 16, 8, 100), ValueError, "D=100"),
    (lambda: arena_as_pages(torch.zeros(2, 20, 1, 16), 8), ValueError, "multiple of the page"),
    (lambda: arena_as_pages(torch.zeros(2, 16, 2, 16)[:, :, :1], 8), ValueError, "contiguous"),
    (lambda: pages_as_arena(torch.zeros(6, 8, 1, 16), 4), ValueError, "divisor"),
    (lambda: page_bytes(torch.zeros(3, 8)), ValueError, "rank 4"),
], ids=["pages", "page-size", "heads", "head-dim", "arena-width", "arena-strided",
        "batch", "cache-rank"])
def test_bad_geometry_raises(make, err, msg):
    with pytest.raises(err, match=msg):
        make()
