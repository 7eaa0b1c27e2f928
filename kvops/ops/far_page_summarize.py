"""``torch.ops.kvops.far_page_summarize``: per-page, per-channel key bounds of paged K.

The retrieval far view (``kvops.runtime.FarRetrieval``) keeps, for every page that has left a
session's near window, the per-channel minimum and maximum of the page's ``S`` keys (the Quest
summary). From them :func:`kvops.ops.far_page_select.far_page_select` bounds every query's
logit against the page without reading the page. This op computes the bounds once per page.

- k_cache [P, S, Hkv, D] (NHD pool; float16, bfloat16 or float32); each page's ``[Hkv, D]`` rows
  dense (``stride(3) == 1``, ``stride(2) == D``); page and token strides free.
- pages int32 [B, N]: the pages to summarize; ``-1`` (or any id outside ``[0, P)``) is an empty
  entry, which is not read.
- Returns k_min, k_max [B, N, Hkv, D] in the cache dtype (exact: a min and a max round nothing);
  zeros for an empty entry.

Validation mode (``kvops.validate(True)``) raises IndexError for an id outside ``[0, P)`` other
than ``-1``. Implementations: CUDA tensors run ``kvops.kernels.far_page_summarize`` (Triton);
CPU tensors run :func:`far_page_summarize_ref` (or the interpreted kernel under backend
"triton"). Output shapes depend on input shapes only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.kernels.far_page_summarize import far_page_summarize_fwd, far_page_summarize_into_fwd
from kvops.ops._library import CheckedSignatures, register


def _check(k_cache, pages) -> None:
    _checks.tensor("k_cache", k_cache, rank=4, dtypes=_checks.KV_DTYPES)
    P, S, Hkv, D = k_cache.shape
    if P < 1 or Hkv < 1:
        raise ValueError(f"k_cache: expected at least one page and one KV head, got shape "
                         f"{tuple(k_cache.shape)}")
    _checks.page_size("k_cache", S)
    _checks.head_dim("k_cache", D)
    if k_cache.stride(3) != 1 or k_cache.stride(2) != D:
        raise ValueError(f"k_cache: expected each page's [Hkv, D] rows dense (strides (..., {D}, "
                         f"1)), got strides {k_cache.stride()}")
    _checks.tensor("pages", pages, rank=2, dtypes=(torch.int32,), device=k_cache.device)


def far_page_summarize_ref(k_cache: Tensor, pages: Tensor) -> tuple[Tensor, Tensor]:
    """PyTorch reference; the CPU implementation. Shapes as in the module doc."""
    P, S, Hkv, D = k_cache.shape
    B, N = pages.shape
    idx = pages.long()
    live = (idx >= 0) & (idx < P)
    rows = k_cache.index_select(0, torch.where(live, idx, 0).flatten()).view(B, N, S, Hkv, D)
    keep = live[..., None, None]
    zero = torch.zeros((), dtype=k_cache.dtype, device=k_cache.device)
    return (torch.where(keep, rows.amin(dim=2), zero), torch.where(keep, rows.amax(dim=2), zero))


_checked = CheckedSignatures(_check)


def _impl(k_cache, pages):
    key, _ = _checked(k_cache, pages)
    if validate():
        _checks.index_range("pages", pages, 0, k_cache.shape[0], allow=-1)
    if use_triton(k_cache):
        return far_page_summarize_fwd(k_cache, pages, signature=key)
    return far_page_summarize_ref(k_cache, pages)


def _fake(k_cache, pages):
    _check(k_cache, pages)
    B, N = pages.shape
    _, _, Hkv, D = k_cache.shape
    return k_cache.new_empty((B, N, Hkv, D)), k_cache.new_empty((B, N, Hkv, D))


_op = register("far_page_summarize", "(Tensor k_cache, Tensor pages) -> (Tensor, Tensor)",
               _impl, _fake)


def far_page_summarize(k_cache: Tensor, pages: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel min and max of the keys of each listed page
    (``torch.ops.kvops.far_page_summarize``; the retrieval far view's page summaries).

    - k_cache [P, S, Hkv, D] (NHD pool; float16, bfloat16 or float32); each page's ``[Hkv, D]``
      rows dense (``stride(3) == 1``, ``stride(2) == D``); page and token strides free.
    - pages int32 [B, N]: the pages to summarize; ``-1`` (or any id outside ``[0, P)``) is an
      empty entry, which is not read.
    - Returns k_min, k_max [B, N, Hkv, D] in the cache dtype (exact: a min and a max round
      nothing); zeros for an empty entry.

    Validation mode (``kvops.validate(True)``) raises IndexError for an id outside ``[0, P)``
    other than ``-1``. Implementations: CUDA tensors run ``kvops.kernels.far_page_summarize``
    (Triton); CPU tensors run :func:`far_page_summarize_ref` (or the interpreted kernel under
    backend "triton"). Output shapes depend on input shapes only.
    """
    return _op(k_cache, pages)


def _check_into(k_cache, pages, rows, k_min, k_max) -> None:
    _check(k_cache, pages)
    B, N = pages.shape
    _, _, Hkv, D = k_cache.shape
    _checks.tensor("rows", rows, rank=2, dtypes=(torch.int32, torch.int64),
                   device=k_cache.device)
    _checks.shape("rows", rows, (B, N), "B N")
    for name, t in (("k_min", k_min), ("k_max", k_max)):
        _checks.tensor(name, t, rank=4, device=k_cache.device)
        _checks.same_dtype(name, t, "k_cache", k_cache)
        _checks.shape(name, t, (B, None, Hkv, D), "B R Hkv D")
        if t.numel() and (t.stride(3) != 1 or t.stride(2) != D):
            raise ValueError(f"{name}: expected each row's [Hkv, D] dense (strides (..., {D}, "
                             f"1)), got strides {t.stride()}")
    _checks.shape("k_max", k_max, tuple(k_min.shape), "B R Hkv D")


def far_page_summarize_into_ref(k_cache: Tensor, pages: Tensor, rows: Tensor, k_min: Tensor,
                                k_max: Tensor) -> None:
    """PyTorch reference of :func:`far_page_summarize_into`; the CPU implementation."""
    lo, hi = far_page_summarize_ref(k_cache, pages)
    B, N = pages.shape
    r = rows.long()
    ok = (r >= 0) & (r < k_min.shape[1])
    b = torch.arange(B, device=r.device)[:, None].expand(B, N)[ok]
    k_min[b, r[ok]] = lo[ok]
    k_max[b, r[ok]] = hi[ok]


_checked_into = CheckedSignatures(_check_into)


def _impl_into(k_cache, pages, rows, k_min, k_max):
    key, _ = _checked_into(k_cache, pages, rows, k_min, k_max)
    if validate():
        _checks.index_range("pages", pages, 0, k_cache.shape[0], allow=-1)
        _checks.index_range("rows", rows, 0, k_min.shape[1])
    if use_triton(k_cache):
        far_page_summarize_into_fwd(k_cache, pages, rows, k_min, k_max, signature=key)
        return
    far_page_summarize_into_ref(k_cache, pages, rows, k_min, k_max)


def _fake_into(k_cache, pages, rows, k_min, k_max):
    _check_into(k_cache, pages, rows, k_min, k_max)


_op_into = register(
    "far_page_summarize_into",
    "(Tensor k_cache, Tensor pages, Tensor rows, Tensor(a!) k_min, Tensor(b!) k_max) -> ()",
    _impl_into, _fake_into)


def far_page_summarize_into(k_cache: Tensor, pages: Tensor, rows: Tensor, k_min: Tensor,
                            k_max: Tensor) -> None:
    """:func:`far_page_summarize` stored into rows of persistent tables, in place
    (``torch.ops.kvops.far_page_summarize_into``; the retrieval far view's absorb in one launch,
    where ``far_page_summarize`` and two ``scatter_`` take three).

    - k_cache, pages: as :func:`far_page_summarize` (an empty entry's bounds are zeros).
    - rows int32 or int64 [B, N]: the row of ``k_min[b]``, ``k_max[b]`` that entry ``(b, n)``'s
      bounds go to; an entry whose row is outside ``[0, R)`` stores nothing. Two entries of a
      sequence with one row: which lands is unspecified (equal bounds, such as two empty
      entries' zeros, land alike).
    - k_min, k_max [B, R, Hkv, D] in the cache dtype, each row's ``[Hkv, D]`` dense; the rows
      named are overwritten, every other row is left as it is.

    Validation mode raises IndexError for a page outside ``[0, P)`` other than ``-1`` and for a
    row outside ``[0, R)``. Implementations as :func:`far_page_summarize`'s.
    """
    _op_into(k_cache, pages, rows, k_min, k_max)
