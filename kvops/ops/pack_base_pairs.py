"""``torch.ops.kvops.pack_base_pairs``: checks, PyTorch reference, registration, fake.

The op's documentation is :func:`pack_base_pairs`'s docstring (``help()`` shows it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.kernels.base_pairs import pack_base_pairs_fwd
from kvops.layouts import codecs
from kvops.layouts.pairs import base_pair_view, check_pair_rows
from kvops.ops._library import CheckedSignatures, register


def check_pair_args(cache, pairs, backing, codec, rows: str) -> str:
    """Input checks shared with refine_base_pairs; returns the resolved codec name."""
    _checks.tensor("cache", cache, rank=4, dtypes=(torch.float16, torch.bfloat16))
    dev = cache.device
    _, S, Hkv, D = cache.shape
    _checks.page_size("cache", S)
    _checks.head_dim("cache", D)
    _checks.pages("cache", cache)
    _checks.tensor("pairs", pairs, rank=2, dtypes=(torch.int32,), device=dev)
    _checks.shape("pairs", pairs, (None, 3), f"N {rows}")
    if codec is not None and not isinstance(codec, str):
        raise TypeError(f"codec: expected a str or None, got {type(codec).__name__}")
    codec = codecs.check_codec(codec, cache.dtype)
    want = codecs.backing_dtype(codec, cache.dtype)
    _checks.tensor("backing", backing, rank=5, dtypes=(want,), device=dev)
    _checks.shape("backing", backing, (pairs.shape[0], 2, S, Hkv, D), "N 2 S Hkv D")
    _checks.contiguous("backing", backing)
    return codec


def pack_base_pairs_ref(cache: Tensor, pairs: Tensor, backing: Tensor,
                        codec: str | None = None) -> None:
    """PyTorch reference; the CPU implementation. Shapes as in the module doc."""
    codec = codecs.check_codec(codec, cache.dtype)
    if pairs.shape[0] == 0:
        return
    rows = pairs.long()
    target = torch.stack([cache[rows[:, 0]], cache[rows[:, 1]]], dim=1)   # [N, 2, S, Hkv, D]
    base, back = codecs.encode(target, codec)
    backing.copy_(back)
    base_pair_view(cache)[rows[:, 2]] = base


ROWS = "(src_a,src_b,dst)"
_checked = CheckedSignatures(lambda *args: check_pair_args(*args, ROWS))


def _impl(cache, pairs, backing, codec=None):
    key, codec = _checked(cache, pairs, backing, codec)
    if validate():
        check_pair_rows("pairs", pairs, cache.shape[0], "pack")
    if use_triton(cache):
        pack_base_pairs_fwd(cache, pairs, backing, codec, signature=key)
        return
    pack_base_pairs_ref(cache, pairs, backing, codec)


def _fake(cache, pairs, backing, codec=None):
    check_pair_args(cache, pairs, backing, codec, ROWS)


_op = register(
    "pack_base_pairs",
    "(Tensor(a!) cache, Tensor pairs, Tensor(b!) backing, str? codec=None) -> ()",
    _impl, _fake)


def pack_base_pairs(cache: Tensor, pairs: Tensor, backing: Tensor, codec: str | None = None):
    """Demote TARGET pairs to BASE in place (``torch.ops.kvops.pack_base_pairs``; ElasticKV
    section 3.1).

    - cache [P, S, Hkv, D] float16 or bfloat16, pages contiguous (the page stride is free);
    - pairs int32 [N, 3], rows (src_a, src_b, dst); dst may equal src_a or src_b (in place) or be a
      third page;
    - backing [N, 2, S, Hkv, D], contiguous: uint8 low bytes (float16 codecs "hi8", "hi8r") or the
      full bfloat16 values (codec "e4m3");
    - codec: None (the dtype's default: "hi8" for float16, "e4m3" for bfloat16), or a name from
      ``kvops.layouts.codecs``. ``refine_base_pairs`` must be called with the same codec.

    Afterwards page dst, viewed as uint8 [2, S, Hkv, D] (``kvops.layouts.pairs.base_pair_view``),
    holds BASE(src_a) in half 0 and BASE(src_b) in half 1, and backing[n] holds what refinement
    needs. Mutates cache and backing; returns None. Rows run concurrently: no page may appear in two
    rows (validation mode checks it, and the page ids, raising ValueError / IndexError).
    """
    return _op(cache, pairs, backing, codec)
