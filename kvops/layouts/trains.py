"""Host-side train planning for ``paged_gather_merged`` (KV-RM merge-staged transport, Reduce).

A move copies one page: ``src_pages[i] -> dst_pages[i]``. :func:`plan_trains` walks the moves
in the order given and greedily merges each move into the previous train when it continues it in
both source and destination (``src = prev_src + 1`` and ``dst = prev_dst + 1``) and the train
stays within ``max_train_bytes`` (the paper's tau, 128 KiB). It is vectorized with numpy (no
Python loop over moves) and pure: the same moves always give the same trains.
"""

from __future__ import annotations

import numpy as np
import torch

INT32_MAX = 2**31 - 1


def _as_index_array(name: str, x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor, got {x.dtype}")
        return x.detach().cpu().numpy().astype(np.int64, copy=False)
    if isinstance(x, np.ndarray) and x.dtype == np.int64 and x.ndim == 1:
        return x
    arr = np.asarray(x)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def plan_trains(src_pages, dst_pages, page_bytes: int, max_train_bytes: int = 131072,
                ) -> tuple[torch.Tensor, dict]:
    """Merge per-page moves into copy trains.

    Parameters
    ----------
    src_pages, dst_pages : sequences of ints or 1-D integer tensors of equal length ``N``
        Move ``i`` copies pool page ``src_pages[i]`` to destination page ``dst_pages[i]``.
    page_bytes : int
        Bytes of one page of one of K or V (``S * Hkv * D * itemsize``).
    max_train_bytes : int
        The cap tau on one train's bytes (of one of K or V). A train holds at most
        ``max(1, max_train_bytes // page_bytes)`` pages, so a page larger than tau still moves,
        alone.

    Returns
    -------
    trains : torch.Tensor
        int32 ``[T, 3]`` on the CPU, rows ``(src_page, dst_page, n_pages)`` in move order.
    stats : dict
        ``groups`` (= T), ``bytes`` (``N * page_bytes``: the bytes of one of K or V moved) and
        ``mean_train_bytes`` (``bytes / groups``, 0.0 without moves).
    """
    if not isinstance(page_bytes, int) or page_bytes < 1:
        raise ValueError(f"page_bytes: expected a positive int, got {page_bytes!r}")
    if not isinstance(max_train_bytes, int) or max_train_bytes < 1:
        raise ValueError(f"max_train_bytes: expected a positive int, got {max_train_bytes!r}")
    src = _as_index_array("src_pages", src_pages)
    dst = _as_index_array("dst_pages", dst_pages)
    if src.shape != dst.shape:
        raise ValueError(f"src_pages/dst_pages: expected equal lengths, got {src.shape[0]} and "
                         f"{dst.shape[0]}")
    n = src.shape[0]
    if n == 0:
        return torch.from_numpy(np.zeros((0, 3), dtype=np.int32)), {
            "groups": 0, "bytes": 0, "mean_train_bytes": 0.0}
    either = src | dst              # negative iff one is negative, >= 2**31 iff one is
    if either.min() < 0 or either.max() > INT32_MAX:
        raise ValueError(f"src_pages/dst_pages: page ids must lie in [0, 2**31), got "
                         f"{min(src.min(), dst.min())}..{max(src.max(), dst.max())}")
    max_pages = max(1, max_train_bytes // page_bytes)

    # A run is a maximal stretch of moves each continuing the previous one in src and dst.
    # (Plain ufuncs and slicing only: numpy's diff/append wrappers cost more than the work.)
    starts_run = np.empty(n, dtype=bool)
    starts_run[0] = True
    np.not_equal(src[1:] - src[:-1], 1, out=starts_run[1:])
    starts_run[1:] |= (dst[1:] - dst[:-1]) != 1
    head = starts_run.nonzero()[0]
    sizes = np.empty_like(head)
    sizes[:-1] = head[1:] - head[:-1]
    sizes[-1] = n - head[-1]
    if sizes.max() > max_pages:
        # Greedy cap: a run splits into trains of max_pages counted from its first move.
        idx = np.arange(n)
        run_first = np.maximum.accumulate(np.where(starts_run, idx, 0))
        head = ((idx - run_first) % max_pages == 0).nonzero()[0]
        sizes = np.empty_like(head)
        sizes[:-1] = head[1:] - head[:-1]
        sizes[-1] = n - head[-1]
    trains = np.empty((head.shape[0], 3), dtype=np.int32)
    trains[:, 0] = src[head]
    trains[:, 1] = dst[head]
    trains[:, 2] = sizes
    groups = int(head.shape[0])
    total = n * page_bytes
    return torch.from_numpy(trains), {"groups": groups, "bytes": total,
                                      "mean_train_bytes": total / groups}
