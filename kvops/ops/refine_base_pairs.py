"""``torch.ops.kvops.refine_base_pairs``: promote BASE pairs back to TARGET, bit exact.

The inverse of ``pack_base_pairs`` (ElasticKV section 3.1):

- cache [P, S, Hkv, D] float16 or bfloat16, pages contiguous;
- pairs int32 [N, 3], rows (dst_a, dst_b, base_page); dst_a (or dst_b) may equal base_page;
- backing [N, 2, S, Hkv, D] as ``pack_base_pairs`` wrote it (row n of the pack);
- codec: the codec the pack used (None: the dtype's default).

Afterwards pages dst_a and dst_b hold the original TARGET blocks bit for bit (half 0 of
base_page -> dst_a, half 1 -> dst_b). Mutates cache; returns None. No page may appear in two
rows (validation mode checks it, and the page ids).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops._config import use_triton, validate
from kvops.layouts import codecs
from kvops.layouts.pairs import base_pair_view, check_pair_rows
from kvops.ops.pack_base_pairs import check_pair_args

ROWS = "(dst_a,dst_b,base_page)"


def refine_base_pairs_ref(cache: Tensor, pairs: Tensor, backing: Tensor,
                          codec: str | None = None) -> None:
    """PyTorch reference; the CPU implementation. Shapes as in the module doc."""
    codec = codecs.check_codec(codec, cache.dtype)
    if pairs.shape[0] == 0:
        return
    rows = pairs.long()
    base = base_pair_view(cache)[rows[:, 2]]                                # [N, 2, S, Hkv, D]
    target = codecs.refine(base, backing, codec, cache.dtype)
    cache[rows[:, 0]] = target[:, 0]
    cache[rows[:, 1]] = target[:, 1]


@torch.library.custom_op("kvops::refine_base_pairs", mutates_args=("cache",))
def refine_base_pairs(cache: Tensor, pairs: Tensor, backing: Tensor,
                      codec: str | None = None) -> None:
    """Refine BASE pages back to TARGET pairs in place; see the module doc."""
    codec = check_pair_args(cache, pairs, backing, codec, ROWS)
    if validate():
        check_pair_rows("pairs", pairs, cache.shape[0], "refine")
    if use_triton(cache.device):
        from kvops.kernels.base_pairs import refine_base_pairs_fwd

        refine_base_pairs_fwd(cache, pairs, backing, codec)
        return
    refine_base_pairs_ref(cache, pairs, backing, codec)


@refine_base_pairs.register_fake
def _(cache, pairs, backing, codec=None):
    check_pair_args(cache, pairs, backing, codec, ROWS)
