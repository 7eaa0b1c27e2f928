"""Stateful host side: the KV pager (reserve/alias/trim/frame), the merge-staged transport,
the far-view policies (mean summaries, exact retrieval) and the ElasticKV fidelity policy.

The runtime edits host-side mappings; a frame commits them as fixed-shape device tables that
the ops read. It never imports models.
"""

from kvops.runtime.far_retrieval import FarRetrieval
from kvops.runtime.far_view import FarView
from kvops.runtime.fidelity import Fidelity
from kvops.runtime.pager import Commit, Frame, OutOfPages, Pager, SpanAllocator, apply_copies
from kvops.runtime.transport import Transport

__all__ = ["Commit", "FarRetrieval", "FarView", "Fidelity", "Frame", "OutOfPages", "Pager",
           "SpanAllocator", "Transport", "apply_copies"]
