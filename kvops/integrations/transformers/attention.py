"""The ``"kvops"`` attention implementation and its mask function, as transformers calls them.

How a step flows (Llama, Mistral, Qwen2, Qwen3: every model whose attention module calls
``cache.update`` and then ``ALL_ATTENTION_FUNCTIONS[...]`` with what ``update`` returned):

1. ``create_causal_mask`` calls :func:`kvops_mask`. kvops caches report mask sizes of the new
   tokens only (``get_mask_sizes -> (q_length, 0)``), so a prefill gets SDPA's boolean mask over
   the prompt (causal, padding, Mistral's sliding window) and a decode step gets ``None``: the
   cache layers know what each sequence sees, and no mask is built per step.
2. The attention module calls ``cache.update(k, v, layer_idx, ...)``. A kvops layer returns a
   :class:`KVStep` (the layer and the new keys and values) as both "keys" and "values"; it writes
   nothing yet, because only the attention call sees the padding mask.
3. The module calls :func:`kvops_attention_forward` with that step. The layer writes the new K/V
   into its storage and runs the decode op (``static_sliding_attention`` or
   ``elastic_attention``); for a prompt, SDPA over it (sliding) or ``paged_prefill_attention``
   over the paged prefix and the prompt (paged).

Given ordinary tensors (``DynamicCache``, ``StaticCache``, no cache), ``"kvops"`` attention is
SDPA exactly: transformers' ``sdpa_attention_forward`` with the same mask.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask


class KVStep(NamedTuple):
    """What a kvops cache layer's ``update`` returns in place of keys and values."""

    layer: Any                 # the cache layer, which owns the storage and does the attention
    key: torch.Tensor          # new keys [B, Hkv, T, D] (transformers' layout)
    value: torch.Tensor        # new values [B, Hkv, T, D]

    @property
    def shape(self):
        raise TypeError(
            "a kvops cache (SlidingCache, PagedCache) returned its step to an attention function "
            "other than kvops': load the model with attn_implementation=\"kvops\" "
            "(kvops.integrations.transformers registers it)")


def kvops_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | KVStep,
    value: torch.Tensor | KVStep,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``ALL_ATTENTION_FUNCTIONS["kvops"]``: returns ``(out [B, T, Hq, D], None)``."""
    if not isinstance(key, KVStep):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if dropout:
        raise ValueError(f"dropout: kvops attention is for inference, expected 0.0, got {dropout}")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: not supported by kvops attention, got {kwargs[name]!r}")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions: kvops attention returns no attention weights")
    return key.layer.attend(module, query, key.key, key.value, attention_mask,
                            scaling=scaling, sliding_window=sliding_window, **kwargs)


def kvops_mask(batch_size: int, q_length: int, kv_length: int, *args, **kwargs):
    """``ALL_MASK_ATTENTION_FUNCTIONS["kvops"]``: SDPA's mask, and ``None`` for a one-token step
    over one key (a kvops cache's decode step, whose layers track what each sequence sees)."""
    if q_length == 1 and kv_length == 1:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, **kwargs)


def padding_start(mask: torch.Tensor | None, batch_size: int, length: int,
                  device: torch.device) -> torch.Tensor:
    """Leading padding tokens per sequence (int64 [B]) from a prompt's 4D mask ``[B, 1, T, T]``.

    A key column that no query sees is padding. Sequences are left-padded (what ``generate``
    builds), so the padding is a prefix and its length is ``T`` minus the visible columns.
    """
    if mask is None:
        return torch.zeros(batch_size, dtype=torch.long, device=device)
    seen = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    return length - seen.any(dim=-2).sum(-1)
