"""``torch.ops.kvops.paged_gather_merged``: checks, PyTorch reference, registration, fake.

The op's documentation is :func:`paged_gather_merged`'s docstring (``help()`` shows it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.kernels.paged_gather_merged import paged_gather_merged_fwd
from kvops.ops._library import CheckedSignatures, register


def _check(k_cache, v_cache, trains, num_trains, k_out, v_out) -> None:
    P, S, Hkv, D = _checks.kv_pool(k_cache, v_cache)
    dev = k_cache.device
    _checks.tensor("trains", trains, rank=2, dtypes=(torch.int32,), device=dev)
    _checks.shape("trains", trains, (None, 3), "T 3")
    _checks.tensor("num_trains", num_trains, rank=1, dtypes=(torch.int32,), device=dev)
    _checks.shape("num_trains", num_trains, (1,), "1")
    _checks.tensor("k_out", k_out, rank=4, device=dev)
    _checks.same_dtype("k_out", k_out, "k_cache", k_cache)
    Q = k_out.shape[0]
    _checks.shape("k_out", k_out, (Q, S, Hkv, D), "Q S Hkv D")
    _checks.tensor("v_out", v_out, rank=4, device=dev)
    _checks.same_dtype("v_out", v_out, "k_cache", k_cache)
    _checks.shape("v_out", v_out, (Q, S, Hkv, D), "Q S Hkv D")
    _checks.pages("k_out", k_out)
    _checks.pages("v_out", v_out)
    _checks.contiguous("trains", trains)


def _validate_trains(trains: Tensor, num_trains: Tensor, P: int, Q: int) -> None:
    """Validation mode: used rows lie in the pool and arena and their destinations are disjoint."""
    T = trains.shape[0]
    _checks.index_range("num_trains", num_trains, 0, T + 1)
    used = trains[: int(num_trains[0])].long()
    src, dst, n = used.unbind(1)
    _checks.index_range("trains[:, 2] (n_pages)", n, 1, Q + 1)
    _checks.index_range("trains[:, 0] (src_page)", src, 0, P)
    _checks.index_range("trains[:, 0] + n_pages (source end)", src + n, 1, P + 1)
    _checks.index_range("trains[:, 1] (dst_page)", dst, 0, Q)
    _checks.index_range("trains[:, 1] + n_pages (destination end)", dst + n, 1, Q + 1)
    if used.shape[0]:
        cover = torch.zeros(Q + 1, dtype=torch.long, device=trains.device)
        cover.index_add_(0, dst, torch.ones_like(dst))
        cover.index_add_(0, dst + n, -torch.ones_like(dst))
        depth = cover.cumsum(0)
        if bool((depth > 1).any()):
            page = int(torch.nonzero(depth > 1)[0, 0])
            raise IndexError(f"trains: destination ranges overlap, found page {page} written by "
                             f"{int(depth[page])} rows")


def paged_gather_merged_ref(k_cache: Tensor, v_cache: Tensor, trains: Tensor, num_trains: Tensor,
                            k_out: Tensor, v_out: Tensor) -> None:
    """PyTorch reference; the CPU implementation. Fixed shapes, no host sync.

    Each destination page ``q`` finds the used row whose range starts last at or before it
    (a running max over row starts) and copies from that row's source when the range covers ``q``.
    """
    P, Q, T = k_cache.shape[0], k_out.shape[0], trains.shape[0]
    dev = trains.device
    src, dst, n = trains.long().unbind(1)
    rows = torch.arange(T, device=dev)
    used = ((rows < num_trains.long()) & (n >= 1) & (src >= 0) & (src + n <= P)
            & (dst >= 0) & (dst + n <= Q))
    row_at = torch.full((Q + 1,), -1, dtype=torch.long, device=dev)   # row starting at page q
    row_at.index_put_((torch.where(used, dst, Q),), rows)
    q = torch.arange(Q, device=dev)
    last_start = torch.cummax(torch.where(row_at[:Q] >= 0, q, -1), 0).values
    row = row_at[last_start.clamp_min(0)].clamp_min(0)
    covered = (last_start >= 0) & (q < dst[row] + n[row])
    page = torch.where(covered, src[row] + q - dst[row], 0)
    keep = covered[:, None, None, None]
    k_out.copy_(torch.where(keep, k_cache[page], k_out))
    v_out.copy_(torch.where(keep, v_cache[page], v_out))


_checked = CheckedSignatures(_check)


def _impl(k_cache, v_cache, trains, num_trains, k_out, v_out):
    key, _ = _checked(k_cache, v_cache, trains, num_trains, k_out, v_out)
    if validate():
        _validate_trains(trains, num_trains, k_cache.shape[0], k_out.shape[0])
    if use_triton(k_cache):
        paged_gather_merged_fwd(k_cache, v_cache, trains, num_trains, k_out, v_out,
                                signature=key)
        return
    paged_gather_merged_ref(k_cache, v_cache, trains, num_trains, k_out, v_out)


def _fake(k_cache, v_cache, trains, num_trains, k_out, v_out):
    _check(k_cache, v_cache, trains, num_trains, k_out, v_out)


_op = register(
    "paged_gather_merged",
    "(Tensor k_cache, Tensor v_cache, Tensor trains, Tensor num_trains, "
    "Tensor(a!) k_out, Tensor(b!) v_out) -> ()",
    _impl, _fake)


def paged_gather_merged(k_cache: Tensor, v_cache: Tensor, trains: Tensor, num_trains: Tensor,
                        k_out: Tensor, v_out: Tensor):
    """Copy paged KV into a fixed-shape arena by trains of pages
    (``torch.ops.kvops.paged_gather_merged``; KV-RM merge-staged transport, paper section 4.3).

    KV-RM merge-staged transport (paper section 4.3): the host plans trains
    (:func:`kvops.layouts.plan_trains`), the device copies them in one call.

    - k_cache, v_cache [P, S, Hkv, D]; k_out, v_out [Q, S, Hkv, D] (a window arena viewed as pages,
      :func:`kvops.layouts.arena_as_pages`), all four the same dtype, each page a contiguous
      [S, Hkv, D] run with any page stride (``kv[:, 0]`` of a [P, 2, S, Hkv, D] pool works).
    - trains int32 [T, 3], rows (src_page, dst_page, n_pages); num_trains int32 [1] on the device:
      rows [0, num_trains[0]) are used, the rest ignored, so a captured graph replays with any count
      up to T.
    - Row i copies cache[src : src + n] -> out[dst : dst + n] for K and V. Destination ranges must
      not overlap (where they do, which writer wins is unspecified). Mutates k_out and v_out only.

    Values outside the documented ranges are not read or written out of bounds: num_trains is
    clamped to [0, T], and a row whose pages do not lie in the pool / arena (or whose n_pages < 1)
    copies nothing. Validation mode (kvops.validate(True)) raises IndexError for such rows and for
    overlapping destinations instead.

    Implementations: CUDA tensors run ``kvops.kernels.paged_gather_merged`` (Triton); CPU tensors run
    :func:`paged_gather_merged_ref` (or the interpreted kernel under backend "triton").
    """
    return _op(k_cache, v_cache, trains, num_trains, k_out, v_out)
