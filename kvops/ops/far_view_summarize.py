"""``torch.ops.kvops.far_view_summarize``: checks, PyTorch reference, registration, fake.

The op's documentation is :func:`far_view_summarize`'s docstring (``help()`` shows it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.kernels.far_view_summarize import far_view_summarize_fwd
from kvops.ops._library import CheckedSignatures, register


def _check(k_cache, v_cache, chunk_table) -> None:
    P, S, Hkv, D = _checks.kv_pool(k_cache, v_cache)
    dev = k_cache.device
    _checks.tensor("chunk_table", chunk_table, rank=3, dtypes=(torch.int32,), device=dev)
    if chunk_table.shape[2] < 1:
        raise ValueError(f"chunk_table: expected at least one page per chunk (M >= 1), got shape "
                         f"{tuple(chunk_table.shape)}")


def far_view_summarize_ref(k_cache: Tensor, v_cache: Tensor, chunk_table: Tensor) -> tuple[Tensor, Tensor]:
    """PyTorch reference (float32 sums); the CPU implementation. Shapes as in the module doc."""
    P, S, Hkv, D = k_cache.shape
    B, C, M = chunk_table.shape
    pages = chunk_table.long()
    live = (pages[..., :1] >= 0) & (pages >= 0) & (pages < P)              # [B, C, M]
    safe = torch.where(live, pages, 0).flatten()
    keep = live.flatten()[:, None, None, None]
    sums = []
    for cache in (k_cache, v_cache):
        # where, not a 0/1 weight: a page not read must not bring its NaN or inf (0 * inf)
        rows = torch.where(keep, cache.index_select(0, safe).float(), 0.0)  # [B*C*M, S, Hkv, D]
        total = rows.view(B, C, M * S, Hkv, D).sum(dim=2)
        sums.append((total / (M * S)).to(cache.dtype))
    return sums[0], sums[1]


_checked = CheckedSignatures(_check)


def _impl(k_cache, v_cache, chunk_table):
    key, _ = _checked(k_cache, v_cache, chunk_table)
    if validate():
        P = k_cache.shape[0]
        _checks.index_range("chunk_table[..., 0] (first page)", chunk_table[..., 0], 0, P, allow=-1)
        live = chunk_table[chunk_table[..., 0] >= 0]
        _checks.index_range("chunk_table (pages of a non-empty chunk)", live, 0, P)
    if use_triton(k_cache):
        return far_view_summarize_fwd(k_cache, v_cache, chunk_table, signature=key)
    return far_view_summarize_ref(k_cache, v_cache, chunk_table)


def _fake(k_cache, v_cache, chunk_table):
    _check(k_cache, v_cache, chunk_table)
    B, C, _ = chunk_table.shape
    _, _, Hkv, D = k_cache.shape
    return k_cache.new_empty((B, C, Hkv, D)), v_cache.new_empty((B, C, Hkv, D))


_op = register(
    "far_view_summarize",
    "(Tensor k_cache, Tensor v_cache, Tensor chunk_table) -> (Tensor, Tensor)",
    _impl, _fake)


def far_view_summarize(k_cache: Tensor, v_cache: Tensor, chunk_table: Tensor):
    """Uniform summaries of far chunks of paged KV (``torch.ops.kvops.far_view_summarize``;
    KV-RM far-view summarization, paper section 4.4).

    KV-RM far-view summarization (paper section 4.4): a far chunk of ``sv_chunk = M * S`` tokens is
    represented by the mean of its keys and the mean of its values, which the decode kernel then
    sees as one far slot (``static_sliding_attention``'s ``far_k``/``far_v``, with
    ``far_bias = log(M * S)``).

    - k_cache, v_cache [P, S, Hkv, D] (NHD pool), the same dtype (float16, bfloat16 or float32);
      each page's ``[Hkv, D]`` rows dense (``stride(3) == 1``, ``stride(2) == D``); other strides free.
    - chunk_table int32 [B, C, M]: the M pages of far chunk c of sequence b, in token order. A chunk
      whose first page is -1 is an empty slot. All pages of a chunk are full (S tokens each).
    - Returns k_sum, v_sum [B, C, Hkv, D] in the cache dtype: the mean over the chunk's M * S tokens,
      accumulated in float32; zeros for an empty slot.

    Values outside the documented ranges are not read out of bounds: in a non-empty chunk, a page
    id outside ``[0, P)`` contributes zeros (the divisor stays M * S). Validation mode
    (kvops.validate(True)) raises IndexError for such ids instead.

    Implementations: CUDA tensors run ``kvops.kernels.far_view_summarize`` (Triton); CPU tensors run
    :func:`far_view_summarize_ref` (or the interpreted kernel under backend "triton"). Output shapes
    depend on input shapes only.
    """
    return _op(k_cache, v_cache, chunk_table)
