"""kvops inside transformers: ``attn_implementation="kvops"`` and kvops caches for ``generate``.

Importing this module registers ``"kvops"`` in transformers' ``AttentionInterface`` and
``AttentionMaskInterface`` (:mod:`.attention`), so that

    import kvops.integrations.transformers as kt
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvops")
    out = model.generate(ids, attention_mask=mask, past_key_values=kt.SlidingCache(model, 2, 512))

decodes every layer through ``torch.ops.kvops``. Caches (transformers ``Cache`` subclasses):

- :class:`SlidingCache`: KV-RM's fixed ring window per layer, ``static_sliding_attention``;
- :class:`PagedCache`: a KV pool mapped by :class:`kvops.runtime.Pager`, ``paged_kv_write`` and
  ``elastic_attention`` (native path; with ``fidelity=`` ElasticKV's BASE blocks, ``demote`` and
  ``promote`` between steps).

Supported: the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM2), transformers 5.17-5.24
(:mod:`._compat`). docs/transformers.md.
"""

from __future__ import annotations

from kvops.integrations.transformers._compat import check_version

check_version()

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from kvops.integrations.transformers.attention import (  # noqa: E402
    KVStep,
    kvops_attention_forward,
    kvops_mask,
)
from kvops.integrations.transformers.paged_cache import PagedCache, PagedLayer  # noqa: E402
from kvops.integrations.transformers.sliding_cache import SlidingCache, SlidingLayer  # noqa: E402

NAME = "kvops"


def register(name: str = NAME) -> None:
    """Register the attention function and its mask function under ``name`` (done on import)."""
    AttentionInterface.register(name, kvops_attention_forward)
    AttentionMaskInterface.register(name, kvops_mask)


register()

__all__ = ["NAME", "KVStep", "PagedCache", "PagedLayer", "SlidingCache", "SlidingLayer",
           "kvops_attention_forward", "kvops_mask", "register"]
