"""``torch.ops.kvops.paged_prefill_attention``: checks, PyTorch reference, registration, fake.

The op's documentation is :func:`paged_prefill_attention`'s docstring (``help()`` shows it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.kernels.paged_prefill_attention import paged_prefill_attention_fwd
from kvops.ops._library import CheckedSignatures, register

# the flash tile's float32 accumulator at D 512 would need a split-D or 8-warp kernel variant
PREFILL_MAX_HEAD_DIM = 256
# the reference attends at most this many (query row x key) logits per head at once
_REF_CHUNK = 1 << 22


def _check(q, k_cache, v_cache, block_table, query_start, seq_lens, scale, window, k=None,
           v=None) -> None:
    _checks.tensor("q", q, rank=3, dtypes=_checks.KV_DTYPES)
    dev = q.device
    N, Hq, D = q.shape
    P, S, Hkv, _ = _checks.kv_pool(k_cache, v_cache)
    _checks.same_dtype("k_cache", k_cache, "q", q)
    if k_cache.device.type != dev.type:
        raise ValueError(f"k_cache: expected a tensor on {dev}, got one on {k_cache.device}")
    _checks.shape("k_cache", k_cache, (None, None, None, D), "P S Hkv D")
    _checks.heads("q", Hq, "k_cache", Hkv)
    if D > PREFILL_MAX_HEAD_DIM:
        raise ValueError(f"q: paged_prefill_attention supports head dims up to "
                         f"{PREFILL_MAX_HEAD_DIM}, got D={D} (docs/tuning.md, Head dims)")
    if q.numel() and q.stride(-1) != 1:
        raise ValueError(f"q: expected the last dim (D) contiguous, got strides {q.stride()}")
    _checks.tensor("block_table", block_table, rank=2, dtypes=(torch.int32,), device=dev)
    B = block_table.shape[0]
    if block_table.numel() and block_table.stride(-1) != 1:
        raise ValueError(f"block_table: expected the last dim contiguous, got strides "
                         f"{block_table.stride()}")
    _checks.tensor("query_start", query_start, rank=1, dtypes=(torch.int32,), device=dev)
    _checks.shape("query_start", query_start, (B + 1,), "B+1")
    _checks.contiguous("query_start", query_start)
    _checks.tensor("seq_lens", seq_lens, rank=1, dtypes=(torch.int32,), device=dev)
    _checks.shape("seq_lens", seq_lens, (B,), "B")
    _checks.contiguous("seq_lens", seq_lens)
    if scale is not None and not isinstance(scale, float):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    if not isinstance(window, int) or isinstance(window, bool):
        raise TypeError(f"window: expected an int, got {type(window).__name__}")
    if window < 0:
        raise ValueError(f"window: expected 0 (no window) or a positive token count, got {window}")
    if (k is None) != (v is None):
        raise ValueError(f"k, v: expected both (the new tokens' rows) or neither, got "
                         f"{'k' if v is None else 'v'} alone")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _checks.tensor(name, t, rank=3, dtypes=_checks.KV_DTYPES, device=dev)
            _checks.same_dtype(name, t, "q", q)
            _checks.shape(name, t, (N, Hkv, D), "N Hkv D")
            if t.numel() and (t.stride(2) != 1 or t.stride(1) != D):
                raise ValueError(f"{name}: expected each row's heads contiguous (strides "
                                 f"[*, {D}, 1]), got strides {t.stride()}")


def _validate(q, k_cache, block_table, query_start, seq_lens, k=None, v=None,
              v_cache=None) -> None:
    N = q.shape[0]
    P, S = k_cache.shape[:2]
    L = block_table.shape[1]
    _checks.index_range("query_start", query_start, 0, N + 1)
    _checks.index_range("query_start (steps)", query_start[1:] - query_start[:-1], 0, N + 1)
    _checks.index_range("seq_lens", seq_lens, 0, L * S + 1)
    _checks.index_range("seq_lens - query count", seq_lens - (query_start[1:] - query_start[:-1]),
                        0, L * S + 1)
    used = torch.arange(L, device=block_table.device)[None, :] * S < seq_lens.long()[:, None]
    _checks.index_range("block_table", block_table[used], 0, P)
    if k is not None:
        _check_new_rows(k, v, k_cache, v_cache, block_table, query_start, seq_lens)


def _check_new_rows(k, v, k_cache, v_cache, block_table, query_start, seq_lens) -> None:
    """Validation mode: ``k``, ``v`` must be what the pool holds at each chunk's positions
    (the kernel may read either)."""
    S = k_cache.shape[1]
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for b in range(block_table.shape[0]):
        n = starts[b + 1] - starts[b]
        pos = torch.arange(lens[b] - n, lens[b], device=k.device)
        pages = block_table[b, pos // S].long()
        ok = pages >= 0
        for name, rows, cache in (("k", k, k_cache), ("v", v, v_cache)):
            got = rows[starts[b]:starts[b + 1]]
            held = cache[pages[ok], pos[ok] % S]
            if not torch.equal(got[ok], held):
                raise ValueError(f"{name}: expected the rows the pool holds at sequence {b}'s "
                                 f"chunk positions [{lens[b] - n}, {lens[b]}) (write them with "
                                 f"paged_kv_write first), got other values")


def paged_prefill_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, query_start: Tensor,
    seq_lens: Tensor, scale: float | None = None, window: int = 0, k: Tensor | None = None,
    v: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """PyTorch reference (float32 math); the CPU implementation. A loop over sequences (it reads
    query_start and seq_lens on the host), each attending its queries over its gathered prefix
    in chunks of at most ``_REF_CHUNK`` logits a head. ``k``, ``v`` hold what the pool holds
    (:func:`paged_prefill_attention`), so the reference reads the pool. Shapes as in
    :func:`paged_prefill_attention`."""
    N, Hq, D = q.shape
    P, S, Hkv, _ = k_cache.shape
    B, L = block_table.shape
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(N, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((N, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    starts = query_start.clamp(0, N).tolist()
    lens = seq_lens.clamp(0, L * S).tolist()
    for b in range(B):
        lo, hi, n_ctx = starts[b], max(starts[b], starts[b + 1]), lens[b]
        if hi <= lo or n_ctx == 0:
            continue
        pages = block_table[b, : -(-n_ctx // S)].long()
        mapped = (pages >= 0) & (pages < P)
        safe = torch.where(mapped, pages, 0)
        k = k_cache[safe].reshape(-1, Hkv, D)[:n_ctx].float()
        v = v_cache[safe].reshape(-1, Hkv, D)[:n_ctx].float()
        key_ok = mapped.repeat_interleave(S)[:n_ctx]
        k = k.masked_fill(~key_ok[:, None, None], 0.0)       # unread rows may hold inf/NaN
        v = v.masked_fill(~key_ok[:, None, None], 0.0)
        j = torch.arange(n_ctx, device=q.device)
        step = max(1, _REF_CHUNK // (n_ctx * Hq))
        for r0 in range(lo, hi, step):
            r1 = min(hi, r0 + step)
            pos = n_ctx - (hi - lo) + torch.arange(r0 - lo, r1 - lo, device=q.device)
            vis = key_ok[None, :] & (j[None, :] <= pos[:, None])
            if window > 0:
                vis &= j[None, :] > pos[:, None] - window
            qf = q[r0:r1].float().view(r1 - r0, Hkv, G, D)
            logits = torch.einsum("nhgd,khd->nhgk", qf, k) * scale
            logits = logits.masked_fill(~vis[:, None, None, :], float("-inf"))
            row_lse = torch.logsumexp(logits, dim=-1)
            empty = torch.isneginf(row_lse)
            p = torch.exp(logits - torch.where(empty, 0.0, row_lse)[..., None])
            v_seen = v.masked_fill(~vis.any(0)[:, None, None], 0.0)   # seen by no row here
            o = torch.einsum("nhgk,khd->nhgd", p, v_seen).masked_fill(empty[..., None], 0.0)
            out[r0:r1] = o.reshape(r1 - r0, Hq, D)
            lse[r0:r1] = row_lse.reshape(r1 - r0, Hq)
    return out.to(q.dtype), lse


_checked = CheckedSignatures(_check)


def _impl(q, k_cache, v_cache, block_table, query_start, seq_lens, scale=None, window=0, k=None,
          v=None):
    key, _ = _checked(q, k_cache, v_cache, block_table, query_start, seq_lens, scale, window, k, v)
    if validate():
        _validate(q, k_cache, block_table, query_start, seq_lens, k, v, v_cache)
    if use_triton(q):
        return paged_prefill_attention_fwd(q, k_cache, v_cache, block_table, query_start,
                                           seq_lens, scale, window, k=k, v=v, signature=key)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_table, query_start, seq_lens,
                                       scale, window)


def _fake(q, k_cache, v_cache, block_table, query_start, seq_lens, scale=None, window=0, k=None,
          v=None):
    _check(q, k_cache, v_cache, block_table, query_start, seq_lens, scale, window, k, v)
    N, Hq, D = q.shape
    return q.new_empty((N, Hq, D)), q.new_empty((N, Hq), dtype=torch.float32)


_op = register(
    "paged_prefill_attention",
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor query_start, "
    "Tensor seq_lens, float? scale=None, int window=0, Tensor? k=None, Tensor? v=None) "
    "-> (Tensor, Tensor)",
    _impl, _fake)


def paged_prefill_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, query_start: Tensor,
    seq_lens: Tensor, scale: float | None = None, window: int = 0, k: Tensor | None = None,
    v: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal attention of packed query chunks of many sequences over their paged prefixes
    (``torch.ops.kvops.paged_prefill_attention``; chunked prefill), as FlashInfer's
    ``BatchPrefillWithPagedKVCache`` and vLLM's varlen paged attention do.

    - q [N, Hq, D] (float16, bfloat16 or float32; the last dim contiguous): the new tokens of B
      sequences packed one after another; sequence b's queries are rows
      ``[query_start[b], query_start[b + 1])``.
    - k_cache, v_cache [P, S, Hkv, D], q's dtype, each page contiguous with any page stride (so
      ``kv[:, 0]``, ``kv[:, 1]`` of an interleaved ``[P, 2, S, Hkv, D]`` pool work). The new
      tokens' K/V are already in the pool (``paged_kv_write`` before the call).
    - block_table int32 [B, L]: logical block j of sequence b (tokens ``[j*S, (j+1)*S)``) is page
      ``block_table[b, j]``. query_start int32 [B + 1]: cumulative query starts, non-decreasing,
      ``query_start[0] >= 0``, ``query_start[B] <= N``. seq_lens int32 [B]: each sequence's total
      context length, its new tokens included.
    - Query i of sequence b sits at position ``p = seq_lens[b] - n_b + i`` (``n_b`` its query
      count) and attends to key positions ``j <= p``, and with ``window > 0`` only to ``j > p -
      window``: the last ``window`` positions, itself included, the rule of the decode ops (a ring
      window of W tokens holds the last W; ``static_sliding_attention``, ``elastic_attention``
      over a W-token table). ``window = 0``: no window.
    - Returns out [N, Hq, D] in q's dtype and lse float32 [N, Hq] (natural log of the sum of exp of
      the scaled logits). A row with nothing visible, and rows ``>= query_start[B]`` (padding),
      get out 0 and lse -inf. GQA: query head h reads KV head ``h // (Hq // Hkv)``. Float32
      accumulation; scale defaults to ``D ** -0.5``.
    - k, v [N, Hkv, D] (optional, both or neither; q's dtype; each row's heads contiguous, any
      row stride): the new tokens' K/V, the rows ``paged_kv_write`` put into the pool at the
      chunks' positions. Given, the kernel may read the chunks' own keys from these contiguous
      rows instead of their pages (through tensor descriptors on Hopper whatever the page
      size); the output is the call's without them. Which keys are read is still the pages'
      rule: a sequence with an unmapped page among its chunk's keys is read from its pages
      alone (that page's keys left out; its rows never read). Validation mode checks that the
      pool holds these rows (it refuses unmapped pages under a sequence's length).

    BASE blocks: this op reads every block as TARGET. ElasticKV's fidelity policy demotes only
    blocks a session has already attended as TARGET, refuses to alias a prefix holding BASE blocks,
    and never demotes a block reserved in the current frame; a caller that prefills over blocks of
    its own that were demoted promotes them first (``Fidelity.promote``, settled by a later step),
    so a prefill never sees a BASE block. A BASE page passed anyway is read as its TARGET bytes
    (tested, as is a prefill after ``promote`` over a demoted prefix), never through the codecs.

    Only positions below ``seq_lens[b]`` whose page id lies in ``[0, P)`` are read; keys on any
    other page (-1 included) are left out of the softmax, so no output depends on an unmapped or
    invisible slot. seq_lens is clamped to ``[0, L * S]``, query_start to ``[0, N]``; validation
    mode (``kvops.validate(True)``) raises IndexError instead for out-of-range lengths, starts that
    decrease, more queries than context (``n_b > seq_lens[b]``) and unmapped pages under a
    sequence's length.

    Implementations: CUDA tensors run ``kvops.kernels.paged_prefill_attention`` (Triton); CPU
    tensors run :func:`paged_prefill_attention_ref` (or the interpreted kernel under backend
    "triton"). Output shapes depend on input shapes only.
    """
    return _op(q, k_cache, v_cache, block_table, query_start, seq_lens, scale, window, k, v)
