"""Stateful host side: the KV pager (reserve/alias/trim/frame) and the policies that follow
its commits through one protocol (:mod:`kvops.runtime.policy`): the merge-staged transport, the
far-view policies (mean summaries, exact retrieval) and the ElasticKV fidelity policy.

The runtime edits host-side mappings; a frame commits them as fixed-shape device tables that
the ops read. It never imports models.
"""

from kvops.runtime.allocator import OutOfPages, SpanAllocator
from kvops.runtime.copies import apply_copies
from kvops.runtime.far_retrieval import FarRetrieval
from kvops.runtime.far_view import FarView
from kvops.runtime.fidelity import Fidelity, FidelityPlan
from kvops.runtime.frame import Frame
from kvops.runtime.pager import Commit, Pager
from kvops.runtime.policy import Staged
from kvops.runtime.transport import Transport

__all__ = ["Commit", "FarRetrieval", "FarView", "Fidelity", "FidelityPlan", "Frame", "OutOfPages",
           "Pager", "SpanAllocator", "Staged", "Transport", "apply_copies"]
