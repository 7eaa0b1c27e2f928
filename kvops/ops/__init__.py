"""One module per op: its schema, input checks, fake (meta) implementation, PyTorch reference
(the CPU implementation and the semantic source of truth) and the dispatch to its Triton kernel.

Importing this package registers every ``torch.ops.kvops.*`` op.
"""

from kvops.ops import _replay
from kvops.ops.elastic_attention import elastic_attention
from kvops.ops.far_page_select import far_page_select
from kvops.ops.far_page_summarize import far_page_summarize, far_page_summarize_into
from kvops.ops.far_slot_update import far_slot_update
from kvops.ops.far_view_observe import far_view_observe
from kvops.ops.far_view_rank import far_view_rank
from kvops.ops.far_view_summarize import far_view_summarize
from kvops.ops.pack_base_pairs import pack_base_pairs
from kvops.ops.paged_gather_merged import paged_gather_merged
from kvops.ops.paged_kv_write import paged_kv_write
from kvops.ops.paged_prefill_attention import paged_prefill_attention
from kvops.ops.refine_base_pairs import refine_base_pairs
from kvops.ops.static_sliding_attention import static_sliding_attention

_replay.install_at_import()   # after every op is registered

__all__ = ["elastic_attention", "far_page_select", "far_page_summarize",
           "far_page_summarize_into", "far_slot_update",
           "far_view_observe", "far_view_rank", "far_view_summarize", "pack_base_pairs",
           "paged_gather_merged", "paged_kv_write",
           "paged_prefill_attention", "refine_base_pairs", "static_sliding_attention"]
