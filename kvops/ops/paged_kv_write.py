"""``torch.ops.kvops.paged_kv_write``: checks, PyTorch reference, registration, fake.

The op's documentation is :func:`paged_kv_write`'s docstring (``help()`` shows it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.kernels.paged_kv_write import paged_kv_write_fwd
from kvops.ops._library import CheckedSignatures, register

SLOT_DTYPES = (torch.int32, torch.int64)


def _check(k, v, k_cache, v_cache, slot_mapping) -> None:
    P, S, Hkv, D = _checks.kv_pool(k_cache, v_cache)
    dev = k_cache.device
    _checks.tensor("k", k, rank=3, device=dev)
    _checks.same_dtype("k", k, "k_cache", k_cache)
    N = k.shape[0]
    _checks.shape("k", k, (None, Hkv, D), "N Hkv D")
    _checks.tensor("v", v, rank=3, device=dev)
    _checks.same_dtype("v", v, "k_cache", k_cache)
    _checks.shape("v", v, (N, Hkv, D), "N Hkv D")
    for name, t in (("k", k), ("v", v)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected the last dim (D) contiguous, got strides "
                             f"{t.stride()}")
    _checks.tensor("slot_mapping", slot_mapping, rank=1, dtypes=SLOT_DTYPES, device=dev)
    _checks.shape("slot_mapping", slot_mapping, (N,), "N")


def _validate(k_cache, slot_mapping) -> None:
    P, S = k_cache.shape[:2]
    _checks.index_range("slot_mapping", slot_mapping, 0, P * S, allow=-1)


def paged_kv_write_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                       slot_mapping: Tensor) -> None:
    """PyTorch reference; the CPU implementation. Writes only the rows whose slot lies in the
    pool (an indexed put of the selected rows: it finds them with ``nonzero``, which syncs a
    CUDA device, so the CUDA path is the kernel)."""
    P, S = k_cache.shape[:2]
    slots = slot_mapping.long()
    rows = ((slots >= 0) & (slots < P * S)).nonzero().squeeze(1)
    sel = slots[rows]
    page, offset = sel // S, sel % S
    k_cache[page, offset] = k[rows]
    v_cache[page, offset] = v[rows]


_checked = CheckedSignatures(_check)


def _impl(k, v, k_cache, v_cache, slot_mapping):
    key, _ = _checked(k, v, k_cache, v_cache, slot_mapping)
    if validate():
        _validate(k_cache, slot_mapping)
    if use_triton(k_cache):
        paged_kv_write_fwd(k, v, k_cache, v_cache, slot_mapping, signature=key)
        return
    paged_kv_write_ref(k, v, k_cache, v_cache, slot_mapping)


def _fake(k, v, k_cache, v_cache, slot_mapping):
    _check(k, v, k_cache, v_cache, slot_mapping)


_op = register(
    "paged_kv_write",
    "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
    _impl, _fake)


def paged_kv_write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor):
    """Scatter new tokens' K/V into the paged pool (``torch.ops.kvops.paged_kv_write``).

    What vLLM's ``reshape_and_cache_flash`` and FlashInfer's ``append_paged_kv_cache`` do, as one
    graph-safe op:

    - k, v [N, Hkv, D] (the new tokens; the last dim contiguous, other strides free, so slices of a
      fused QKV projection work without a copy); k_cache, v_cache [P, S, Hkv, D], the same dtype,
      each page contiguous with any page stride (``kv[:, 0]``, ``kv[:, 1]`` of an interleaved
      ``[P, 2, S, Hkv, D]`` pool work).
    - slot_mapping int32 or int64 [N]: token i goes to flat slot ``slot_mapping[i] = page * S +
      offset``, i.e. ``k_cache[page, offset] = k[i]`` and the same for v. ``-1`` skips the token
      (padding rows of a captured batch).
    - Mutates k_cache and v_cache in place, nothing else; returns None. Two tokens mapped to one
      slot: which one lands is unspecified.

    Slots outside ``[0, P * S)`` write nothing (never out of bounds); validation mode
    (``kvops.validate(True)``) raises IndexError for any slot other than -1 outside that range.
    No host sync and no data-dependent shapes, so it compiles with ``fullgraph=True`` and replays in
    a CUDA graph. Under ``torch.compile`` the caches are mutated in place: the compiled graph does
    not copy the pool (tests/test_paged_kv_write.py checks the generated code).

    Implementations: CUDA tensors run ``kvops.kernels.paged_kv_write`` (Triton); CPU tensors run
    :func:`paged_kv_write_ref` (or the interpreted kernel under backend "triton").
    """
    return _op(k, v, k_cache, v_cache, slot_mapping)
