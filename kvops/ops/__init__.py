"""One module per op: its schema, input checks, fake (meta) implementation, PyTorch reference
(the CPU implementation and the semantic source of truth) and the dispatch to its Triton kernel.

Importing this package registers every ``torch.ops.kvops.*`` op.
"""

from kvops.ops.static_sliding_attention import static_sliding_attention

__all__ = ["static_sliding_attention"]
