"""``torch.ops.kvops.elastic_attention``: checks, PyTorch reference, registration, fake.

The op's documentation is :func:`elastic_attention`'s docstring (``help()`` shows it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.kernels.elastic_attention import elastic_attention_fwd
from kvops.layouts import codecs
from kvops.layouts.pairs import base_pair_view
from kvops.ops._library import CheckedSignatures, register
from kvops.ops._reference import softmax_attend


def _check_args(q, k_cache, v_cache, block_table, seq_lens, block_mode, base_span,
                scale) -> None:
    _checks.tensor("q", q, rank=3, dtypes=_checks.KV_DTYPES)
    dev = q.device
    B, Hq, D = q.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _checks.tensor(name, c, rank=4, device=dev)
        _checks.same_dtype(name, c, "q", q)
    P, S, Hkv, _ = k_cache.shape
    _checks.shape("k_cache", k_cache, (None, None, None, D), "P S Hkv D")
    _checks.shape("v_cache", v_cache, (P, S, Hkv, D), "P S Hkv D")
    _checks.heads("q", Hq, "k_cache", Hkv)
    _checks.head_dim("q", D)
    _checks.page_size("k_cache", S)
    _checks.pages("k_cache", k_cache)
    _checks.pages("v_cache", v_cache)
    if q.numel() and q.stride(-1) != 1:
        raise ValueError(f"q: expected the last dim (D) contiguous, got strides {q.stride()}")
    _checks.tensor("block_table", block_table, rank=2, dtypes=(torch.int32,), device=dev)
    _checks.shape("block_table", block_table, (B, None), "B L")
    L = block_table.shape[1]
    _checks.tensor("seq_lens", seq_lens, rank=1, dtypes=(torch.int32,), device=dev)
    _checks.shape("seq_lens", seq_lens, (B,), "B")
    _checks.contiguous("seq_lens", seq_lens)
    if block_mode is not None and base_span is not None:
        raise ValueError("block_mode/base_span: give at most one, got both")
    if block_mode is not None:
        _checks.tensor("block_mode", block_mode, rank=2, dtypes=(torch.int8,), device=dev)
        _checks.shape("block_mode", block_mode, (B, L), "B L")
    if base_span is not None:
        _checks.tensor("base_span", base_span, rank=2, dtypes=(torch.int32,), device=dev)
        _checks.shape("base_span", base_span, (B, 2), "B 2")
    for name, t in (("block_table", block_table), ("block_mode", block_mode),
                    ("base_span", base_span)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected the last dim contiguous, got strides {t.stride()}")
    if (block_mode is not None or base_span is not None) and q.dtype == torch.float32:
        raise TypeError("k_cache: BASE blocks need a float16 or bfloat16 cache, got float32 "
                        "(float32 runs the native path only)")
    if block_mode is not None and P >= 2**30:
        raise ValueError(f"k_cache: the general path packs 2 * page + half into int32: expected "
                         f"fewer than 2**30 pages, got {P}")
    if block_mode is not None or base_span is not None:
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.stride(0) % 2:
                raise ValueError(f"{name}: BASE rows are read as 32-bit words: expected an even "
                                 f"page stride, got {c.stride(0)}")
    if scale is not None and not isinstance(scale, float):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")


def _check(q, k_cache, v_cache, block_table, seq_lens, block_mode, base_span, scale) -> bool:
    """The checks of a real call, and whether a call of this signature checks the pools' 4-byte
    alignment (BASE rows are read as 32-bit words): a signature holds whether each tensor is
    16-byte aligned, so pools that are need no per-call check."""
    _check_args(q, k_cache, v_cache, block_table, seq_lens, block_mode, base_span, scale)
    return ((block_mode is not None or base_span is not None)
            and bool((k_cache.data_ptr() | v_cache.data_ptr()) & 15))


def _validate(k_cache, block_table, seq_lens, block_mode, base_span) -> None:
    P, S = k_cache.shape[:2]
    L = block_table.shape[1]
    _checks.index_range("seq_lens", seq_lens, 0, L * S + 1)
    used = torch.arange(L, device=block_table.device)[None, :] * S < seq_lens.long()[:, None]
    _checks.index_range("block_table", block_table[used], 0, P)
    if block_mode is not None:
        _checks.index_range("block_mode", block_mode[used], 0, 3)
    if base_span is not None:
        _checks.index_range("base_span", base_span, 0, L + 1)
        _checks.index_range("base_span (end - first)", base_span[:, 1] - base_span[:, 0], 0,
                            L + 1)


def block_values(cache: Tensor, block_table: Tensor, modes: Tensor | None) -> Tensor:
    """Decoded K or V of every logical block: ``[B, L, S, Hkv, D]`` in the cache dtype.

    ``modes`` int [B, L]: 0 TARGET, 1 BASE half 0, 2 BASE half 1 (None: all TARGET). Entries
    outside ``[0, P)`` (-1, or anything past a sequence's end) read page 0; callers mask those
    tokens.
    """
    pages = block_table.long()
    pages = torch.where((pages >= 0) & (pages < cache.shape[0]), pages, 0)
    target = cache[pages]
    if cache.dtype == torch.float32 or modes is None:      # float32 / the native path: TARGET
        return target
    halves = base_pair_view(cache)[pages]                                  # [B, L, 2, S, Hkv, D]
    half = (modes == 2).long()[:, :, None, None, None, None].expand_as(halves[:, :, :1])
    base = codecs.decode(halves.gather(2, half).squeeze(2), cache.dtype)
    return torch.where((modes != 0)[:, :, None, None, None], base, target)


def span_modes(base_span: Tensor, L: int) -> Tensor:
    """The general-path modes [B, L] equivalent to a structured ``base_span [B, 2]``."""
    j = torch.arange(L, device=base_span.device)[None, :]
    first, end = base_span[:, :1].long(), base_span[:, 1:].long()
    inside = (j >= first) & (j < end)
    return torch.where(inside, 1 + (j - first) % 2, 0).to(torch.int8)


def elastic_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
    block_mode: Tensor | None = None, base_span: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PyTorch reference (float32 math); the CPU implementation. Shapes as in the module doc."""
    B, Hq, D = q.shape
    _, S, Hkv, _ = k_cache.shape
    L = block_table.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    if block_mode is not None:
        modes = block_mode
    elif base_span is not None:
        modes = span_modes(base_span, L)
    else:
        modes = None                                       # native: no BASE decode
    k = block_values(k_cache, block_table, modes).reshape(B, L * S, Hkv, D).float()
    v = block_values(v_cache, block_table, modes).reshape(B, L * S, Hkv, D).float()
    qf = q.float().view(B, Hkv, G, D)
    logits = torch.einsum("bhgd,bnhd->bhgn", qf, k) * scale
    visible = torch.arange(L * S, device=q.device)[None, :] < seq_lens.long()[:, None]
    visible &= (block_table >= 0).repeat_interleave(S, dim=1)     # -1 blocks: never read
    logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
    v = v.masked_fill(~visible[:, :, None, None], 0.0)     # unread rows may hold inf/NaN
    out, lse = softmax_attend(logits, v)
    return out.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq)


_checked = CheckedSignatures(_check)


def _impl(q, k_cache, v_cache, block_table, seq_lens, block_mode=None, base_span=None,
          scale=None):
    key, word_check = _checked(q, k_cache, v_cache, block_table, seq_lens, block_mode, base_span,
                               scale)
    if validate():
        _validate(k_cache, block_table, seq_lens, block_mode, base_span)
    if use_triton(q):
        if word_check and (k_cache.data_ptr() | v_cache.data_ptr()) & 3:
            for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
                if c.numel() and c.data_ptr() % 4:
                    raise ValueError(f"{name}: BASE rows are read as 32-bit words: expected a "
                                     f"4-byte aligned pool, got address % 4 = {c.data_ptr() % 4}")

        return elastic_attention_fwd(q, k_cache, v_cache, block_table, seq_lens, block_mode,
                                     base_span, scale, signature=key)
    return elastic_attention_ref(q, k_cache, v_cache, block_table, seq_lens, block_mode,
                                 base_span, scale)


def _fake(q, k_cache, v_cache, block_table, seq_lens, block_mode=None, base_span=None,
          scale=None):
    _check_args(q, k_cache, v_cache, block_table, seq_lens, block_mode, base_span, scale)
    B, Hq, D = q.shape
    return q.new_empty((B, Hq, D)), q.new_empty((B, Hq), dtype=torch.float32)


_op = register(
    "elastic_attention",
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
    "Tensor? block_mode=None, Tensor? base_span=None, float? scale=None) -> (Tensor, Tensor)",
    _impl, _fake)


def elastic_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
    block_mode: Tensor | None = None, base_span: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Paged decode attention over TARGET and BASE blocks
    (``torch.ops.kvops.elastic_attention``; ElasticKV section 3.2).

    - q [B, Hq, D]; k_cache, v_cache [P, S, Hkv, D] as TARGET (float16 or bfloat16; float32 on the
      native path only), each page contiguous (the page stride is free, e.g. halves of a
      [P, 2, S, Hkv, D] pool, but even on the BASE paths, which read BASE rows as 32-bit words from
      a 4-byte aligned pool; the general path needs fewer than 2**30 pages); block_table int32
      [B, L]: logical block j of sequence b holds tokens [j*S, (j+1)*S) in page
      block_table[b, j]; seq_lens int32 [B].
    - Native path (block_mode and base_span None): every block TARGET.
    - General path: block_mode int8 [B, L], 0 TARGET, 1 BASE in half 0, 2 BASE in half 1 of page
      block_table[b, j] (the page viewed as uint8 [2, S, Hkv, D]).
    - Structured path: base_span int32 [B, 2] = [first, end) logical blocks in BASE, TARGET before
      and after; block j of the span sits in half (j - first) % 2 of page block_table[b, j].
      Give at most one of block_mode and base_span.
    - A BASE value decodes as ``kvops.layouts.codecs.decode`` defines: float16, the byte as the high
      byte with a zero low byte (hi8 and hi8r); bfloat16, the byte as float8 e4m3fn.
    - Returns out [B, Hq, D] in q's dtype and lse float32 [B, Hq] (natural log of the sum of exp of
      the scaled logits); a sequence with seq_lens 0 gets out = 0, lse = -inf. Float32 accumulation;
      scale defaults to D ** -0.5.

    Only blocks j < ceil(seq_lens[b] / S) are read: table entries (and modes) past the end may hold
    anything, -1 included. seq_lens is clamped to [0, L*S]; validation mode (kvops.validate(True))
    raises IndexError for out-of-range lengths, page ids, modes and spans instead.

    CUDA tensors run the Triton kernel (``kvops.kernels.elastic_attention``); CPU tensors run
    :func:`~kvops.ops.elastic_attention.elastic_attention_ref` (or the interpreted kernel under
    backend "triton"). Output shapes depend on input shapes only.
    """
    return _op(q, k_cache, v_cache, block_table, seq_lens, block_mode, base_span, scale)
