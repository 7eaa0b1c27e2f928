"""``torch.ops.kvops.refine_base_pairs``: checks, PyTorch reference, registration, fake.

The op's documentation is :func:`refine_base_pairs`'s docstring (``help()`` shows it).
"""

from __future__ import annotations

from torch import Tensor

from kvops._config import use_triton, validate
from kvops.kernels.base_pairs import refine_base_pairs_fwd
from kvops.layouts import codecs
from kvops.layouts.pairs import base_pair_view, check_pair_rows
from kvops.ops._library import CheckedSignatures, register
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


_checked = CheckedSignatures(lambda *args: check_pair_args(*args, ROWS))


def _impl(cache, pairs, backing, codec=None):
    key, codec = _checked(cache, pairs, backing, codec)
    if validate():
        check_pair_rows("pairs", pairs, cache.shape[0], "refine")
    if use_triton(cache):
        refine_base_pairs_fwd(cache, pairs, backing, codec, signature=key)
        return
    refine_base_pairs_ref(cache, pairs, backing, codec)


def _fake(cache, pairs, backing, codec=None):
    check_pair_args(cache, pairs, backing, codec, ROWS)


_op = register(
    "refine_base_pairs",
    "(Tensor(a!) cache, Tensor pairs, Tensor backing, str? codec=None) -> ()",
    _impl, _fake)


def refine_base_pairs(cache: Tensor, pairs: Tensor, backing: Tensor, codec: str | None = None):
    """Promote BASE pairs back to TARGET, bit exact (``torch.ops.kvops.refine_base_pairs``).

    The inverse of ``pack_base_pairs`` (ElasticKV section 3.1):

    - cache [P, S, Hkv, D] float16 or bfloat16, pages contiguous;
    - pairs int32 [N, 3], rows (dst_a, dst_b, base_page); dst_a (or dst_b) may equal base_page;
    - backing [N, 2, S, Hkv, D] as ``pack_base_pairs`` wrote it (row n of the pack);
    - codec: the codec the pack used (None: the dtype's default).

    Afterwards pages dst_a and dst_b hold the original TARGET blocks bit for bit (half 0 of
    base_page -> dst_a, half 1 -> dst_b). Mutates cache; returns None. No page may appear in two
    rows (validation mode checks it, and the page ids).
    """
    return _op(cache, pairs, backing, codec)
