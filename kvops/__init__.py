"""kvops: composable torch ops for serving LLM KV caches (KV-RM and ElasticKV).

Importing kvops registers the ``torch.ops.kvops.*`` ops. Public names:

- ops (each also ``torch.ops.kvops.<name>``): :func:`static_sliding_attention`,
  :func:`paged_gather_merged`, :func:`far_view_summarize`, :func:`pack_base_pairs`,
  :func:`refine_base_pairs`, :func:`elastic_attention`, :func:`paged_kv_write`,
  :func:`paged_prefill_attention`, the far view's utility update :func:`far_view_observe` and
  re-ranking :func:`far_view_rank`, and the
  retrieval far view's :func:`far_page_summarize` (and :func:`far_page_summarize_into`),
  :func:`far_page_select` and :func:`far_slot_update`;
- ``kvops.layouts`` (geometry, train planning, BASE codecs) and ``kvops.runtime`` (pager,
  transport, far-view policy), imported on demand;
- settings: :func:`backend` ("auto" | "torch" | "triton") and :func:`validate`;
- ``kvops.models`` (imported on demand): SmolLM2-135M decoding through these ops,
  ``kvops.models.generate(prompt, max_new_tokens, device)`` (docs/models.md).
"""

from kvops._config import backend, validate
from kvops.ops import (
    elastic_attention,
    far_page_select,
    far_page_summarize,
    far_page_summarize_into,
    far_slot_update,
    far_view_observe,
    far_view_rank,
    far_view_summarize,
    pack_base_pairs,
    paged_gather_merged,
    paged_kv_write,
    paged_prefill_attention,
    refine_base_pairs,
    static_sliding_attention,
)

__all__ = ["backend", "validate", "static_sliding_attention", "paged_gather_merged",
           "pack_base_pairs", "refine_base_pairs", "elastic_attention", "far_view_summarize",
           "paged_kv_write", "paged_prefill_attention", "far_page_summarize",
           "far_page_summarize_into", "far_page_select", "far_slot_update", "far_view_observe",
           "far_view_rank"]
__version__ = "0.1.0"
