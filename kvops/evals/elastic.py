"""ElasticKV's quality on a real model: perplexity and passkey retrieval when a share of the KV
blocks is BASE (the paper's section 4.2 and appendix C.1, on SmolLM2-135M instead of LongBench).

A case is a TARGET dtype, a codec and a BASE-exposure cap (:func:`check_case`): float16 with
``hi8`` or ``hi8r``, bfloat16 with ``e4m3`` (:mod:`kvops.layouts.codecs`), and a cap in
``[0, 1]``, the largest share of a sequence's live blocks that may be BASE.

Which blocks are BASE (:func:`base_spans`). For a cap below 1 the selection is the fidelity
policy's own: a :class:`kvops.runtime.Pager` with a :class:`kvops.runtime.Fidelity` reserves
the sequence one token a frame, and before each token the policy is asked to demote (by a page
shortage, ``min_batch=1``) as many pairs as keep ``BASE blocks <= cap * live blocks``. So the
BASE blocks are the ones Fidelity demotes first: its oldest unprotected pairs, after
``protect_first`` sink blocks and never the last ``protect_recent`` blocks nor a partly
filled one. Query position ``t`` sees the span the policy holds after reserving token ``t``.
The cap is an upper bound (as in the paper): a pair is the unit, so exposure sits at or below
the cap (:func:`exposure` measures it). Cap 1 is all-BASE: every block, the one being written
and the protected ones included, as if each token's K/V were stored in BASE when written
(not a state the policy reaches; the paper's "all-BASE" row).

How attention reads the mixed cache. Teacher-forced, block-parallel (:func:`attention_mixed`):
for a block of queries at once, attention over the TARGET keys (K/V rounded to the TARGET
dtype, as the pool holds them) and the BASE keys (``codecs.decode(codecs.encode(x))``, the
values ``elastic_attention`` decodes from a pair page), each query seeing a key in the form its
span gives (and only keys up to itself); the query is rounded to the TARGET dtype and the
output too, as ``torch.ops.kvops.elastic_attention`` takes and returns them, with float32 math
in between. The decode op itself is not what this pass runs: it is one call a token and a layer
(61,440 calls for 2048 tokens of SmolLM2), and its CPU reference decodes every page of the
sequence each call (about 0.1 s a call at 2048 tokens on the shared 2-core CPU), over an hour a
case. :func:`check_op` compares the block-parallel attention, at sampled positions of every
layer, with ``torch.ops.kvops.elastic_attention`` (structured path, ``base_span``) over a pool
whose pairs ``torch.ops.kvops.pack_base_pairs`` packed in Fidelity's layout.

Cap 0 runs the same path with no BASE block: it is the TARGET result exactly.
"""

from __future__ import annotations

import math
import numbers
import time

import torch

from kvops.evals.passkey import passkey_cases, reusable_prefix
from kvops.evals.perplexity import hidden_states_with, nll_sum
from kvops.layouts import codecs
from kvops.models import Llama

PAGE = 16
CAPS = (0.0, 0.05, 0.10, 0.20, 1.0)
CASES = (("float16", "hi8"), ("float16", "hi8r"), ("bfloat16", "e4m3"))
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def check_case(dtype, codec: str, cap) -> tuple[torch.dtype, str, float]:
    """``(dtype, codec, cap)`` resolved: dtype float16 / bfloat16 (or its name), ``codec`` one
    of that dtype's codecs, ``cap`` a number in ``[0, 1]``. Raises ``TypeError`` or
    ``ValueError`` naming the argument."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise TypeError(f"dtype: BASE codecs need float16 or bfloat16, got {dtype}")
    if not isinstance(codec, str):
        raise TypeError(f"codec: expected a codec name (str), got {type(codec).__name__}")
    codec = codecs.check_codec(codec, dtype)
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not 0.0 <= cap <= 1.0:
        raise ValueError(f"cap: expected a number in [0, 1] (the largest BASE share of the "
                         f"live blocks), got {cap!r}")
    return dtype, codec, float(cap)


def base_spans(T: int, cap: float, page_size: int = PAGE, protect_first: int = 1,
               protect_recent: int = 2) -> torch.Tensor:
    """int32 ``[T, 2]``: the BASE span ``[first, end)`` of logical blocks that query position
    ``t`` sees (the sequence then holds ``t + 1`` tokens), under exposure cap ``cap``.

    ``cap < 1``: the blocks :class:`kvops.runtime.Fidelity` demotes (module doc), driven one
    token a frame over a pager of the sequence's pages; ``cap == 1``: every block."""
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not 0.0 <= cap <= 1.0:
        raise ValueError(f"cap: expected a number in [0, 1], got {cap!r}")
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T: expected an int >= 1 (tokens), got {T!r}")
    live = (torch.arange(T) + page_size) // page_size            # ceil((t + 1) / S)
    if cap == 1.0:
        return torch.stack([torch.zeros_like(live), live], dim=1).to(torch.int32)
    from kvops.runtime import Fidelity, Pager

    blocks = -(-T // page_size)
    pager = Pager(blocks + 1, page_size, 1, blocks, device="cpu")
    pool = torch.zeros(blocks + 1, page_size, 1, 16, dtype=torch.float16)   # contents unused
    fid = Fidelity(pager, [pool], min_batch=1, protect_first=protect_first,
                   protect_recent=protect_recent)
    spans = torch.zeros(T, 2, dtype=torch.int32)
    base = 0
    for t in range(T):
        want = 2 * math.floor(cap * int(live[t]) / 2 + 1e-9) - base     # blocks to demote
        with pager.frame() as f:
            if want > 0 and t:
                fid.step(f, need=f.free_pages + want // 2)
            f.reserve("s", 1)
        first, end = fid.span("s")
        base = end - first
        spans[t] = torch.tensor([first, end])
    return spans


def exposure(spans: torch.Tensor, page_size: int = PAGE) -> tuple[float, float]:
    """(BASE share of the live blocks at the last position, its mean over positions)."""
    T = spans.shape[0]
    live = ((torch.arange(T) + page_size) // page_size).double()
    share = (spans[:, 1] - spans[:, 0]).double() / live
    return float(share[-1]), float(share.mean())


def base_values(x: torch.Tensor, dtype: torch.dtype, codec: str) -> torch.Tensor:
    """``x`` stored as TARGET ``dtype`` and read back from BASE: ``decode(encode(x))``, float32."""
    base, _ = codecs.encode(x.to(dtype), codec)
    return codecs.decode(base, dtype).float()


def _attend(q, k, v, mask=None):
    """``q [n, Hq, D]`` over ``k, v [m, Hkv, D]`` (float32): ``(out [n, Hq, D], lse [n, Hq])``.
    ``mask [n, m]`` (True: visible; every row needs one) through explicit scores; ``None``:
    every key visible, through PyTorch's CPU flash kernel where the tensors are on the CPU."""
    g = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)
    kh, vh = (x.repeat_interleave(g, 1).transpose(0, 1) for x in (k, v))
    if mask is None and q.device.type == "cpu":
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o, lse = flash(qh[None], kh[None], vh[None], 0.0, False)[:2]
        return o[0].transpose(0, 1), lse[0].transpose(0, 1)
    scores = qh @ kh.transpose(1, 2) * q.shape[-1] ** -0.5                  # [Hq, n, m]
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = scores.logsumexp(-1)
    o = torch.exp(scores - lse[..., None]) @ vh
    return o.transpose(0, 1), lse.transpose(0, 1)


@torch.no_grad()
def attention_mixed(q, k, v, spans, dtype, codec: str, q0: int = 0, q_block: int = 256,
                    page_size: int = PAGE):
    """Causal attention of the queries of positions ``[q0, T)`` (``q [T - q0, Hq, D]``, float32)
    over ``k, v [T, Hkv, D]`` where, for query ``t``, the keys of blocks
    ``spans[t, 0] <= j < spans[t, 1]`` are read as BASE and the others as TARGET (module doc).
    Returns float32 ``[T - q0, Hq, D]`` holding TARGET-dtype values.

    Per block of queries, the keys before the block whose form is the same for every query of
    the block (the span moves slowly) go through one unmasked flash call; the rest (keys whose
    form differs between the block's queries, and the block's own causal keys) through masked
    scores over their TARGET and BASE forms; the two parts merge by their log-sum-exp."""
    T = k.shape[0]
    kt, vt = k.to(dtype).float(), v.to(dtype).float()
    spans = spans.to(k.device).long()
    blk = torch.arange(T, device=k.device) // page_size
    kb = vb = None
    if bool((spans[q0:, 1] > spans[q0:, 0]).any()):
        kb, vb = base_values(k, dtype, codec), base_values(v, dtype, codec)
    qd = q.to(dtype).float()
    out = torch.empty_like(q)
    for t0 in range(q0, T, q_block):
        n = min(q_block, T - t0)
        qb = qd[t0 - q0:t0 - q0 + n]
        t = torch.arange(t0, t0 + n, device=k.device)
        keys = torch.arange(t0 + n, device=k.device)
        is_base = (blk[None, :t0 + n] >= spans[t, :1]) & (blk[None, :t0 + n] < spans[t, 1:])
        mixed = (is_base[:, :t0] != is_base[:1, :t0]).any(0).nonzero()
        c = int(mixed[0]) if len(mixed) else t0          # keys [0, c): one form for all queries
        causal = keys[None, c:] <= t[:, None]
        masks, ks, vs = [causal & ~is_base[:, c:]], [kt[c:t0 + n]], [vt[c:t0 + n]]
        if kb is not None and bool(is_base[:, c:].any()):
            masks.append(causal & is_base[:, c:])
            ks.append(kb[c:t0 + n])
            vs.append(vb[c:t0 + n])
        o, lse = _attend(qb, torch.cat(ks), torch.cat(vs), torch.cat(masks, dim=1))
        if c:
            use_base = is_base[0, :c, None, None]
            kc = torch.where(use_base, kb[:c], kt[:c]) if kb is not None else kt[:c]
            vc = torch.where(use_base, vb[:c], vt[:c]) if kb is not None else vt[:c]
            o1, lse1 = _attend(qb, kc, vc)
            both = torch.logaddexp(lse, lse1)
            o = o * (lse - both).exp()[..., None] + o1 * (lse1 - both).exp()[..., None]
        out[t0 - q0:t0 - q0 + n] = o.to(dtype).float()
    return out


def mixed_pool(k, v, spans_t, dtype, codec: str, page_size: int = PAGE):
    """The paged cache a decode step of a sequence holding ``k, v [n, Hkv, D]`` reads, with
    blocks ``spans_t = (first, end)`` packed into BASE pairs by
    ``torch.ops.kvops.pack_base_pairs`` in Fidelity's layout (block ``j`` of the span in half
    ``(j - first) % 2`` of the pair's page, both blocks mapping it; an odd last block of the
    span pairs with a spare page). Returns ``(k_cache, v_cache, block_table, seq_lens,
    base_span)`` for ``torch.ops.kvops.elastic_attention``."""
    n, Hkv, D = k.shape
    nb = -(-n // page_size)
    first, end = (int(x) for x in spans_t)
    caches = []
    for x in (k, v):
        c = torch.zeros(nb + 1, page_size, Hkv, D, dtype=dtype, device=k.device)
        c.view(-1, Hkv, D)[:n] = x.to(dtype)
        caches.append(c)
    table = torch.arange(nb, dtype=torch.int32, device=k.device)
    rows = [(j, j + 1 if j + 1 < end else nb, j) for j in range(first, end, 2)]
    if rows:
        pairs = torch.tensor(rows, dtype=torch.int32, device=k.device)
        for c in caches:
            backing = torch.empty(len(rows), 2, page_size, Hkv, D, device=k.device,
                                  dtype=codecs.backing_dtype(codec, dtype))
            torch.ops.kvops.pack_base_pairs(c, pairs, backing, codec)
        for j in range(first + 1, end, 2):
            table[j] = j - 1
    span = torch.tensor([[first, end]], dtype=torch.int32, device=k.device)
    seq_lens = torch.tensor([n], dtype=torch.int32, device=k.device)
    return caches[0], caches[1], table[None], seq_lens, span


@torch.no_grad()
def hidden_states_from(model: Llama, ids: torch.Tensor, spans, dtype, codec: str,
                       start: int = 0, cache: list | None = None, check=None):
    """Final-norm hidden states ``[T - start, dim]`` of positions ``[start, T)`` of ``ids [T]``
    with the mixed cache of ``spans`` (``None``: all TARGET), and every layer's ``(k, v)``.
    Positions before ``start`` take their K/V from ``cache`` (the second result of a call on a
    sequence starting with ``ids[:start]``): the BASE set of a query depends on its position
    only, so they are what a full pass computes. ``check(layer, q, k, v, out)``: called with
    each layer's tensors (:func:`check_op`)."""
    if spans is None:
        spans = torch.zeros(ids.shape[0], 2, dtype=torch.int32)

    def attend(layer, q, k, v):
        o = attention_mixed(q, k, v, spans, dtype, codec, q0=start)
        if check is not None:
            check(layer, q, k, v, o)
        return o

    return hidden_states_with(model, ids, attend, start, cache)


def logits(model: Llama, ids: torch.Tensor, spans, dtype, codec: str) -> torch.Tensor:
    """Next-token logits ``[T, vocab]`` (float32) of ``ids [T]`` with the mixed cache."""
    hidden, _ = hidden_states_from(model, ids, spans, dtype, codec)
    return model.output(hidden).float()


def perplexity(model: Llama, ids: torch.Tensor, spans, dtype, codec: str) -> float:
    """Perplexity of ``ids [N]`` (exp of the mean next-token NLL over tokens 2..N)."""
    hidden, _ = hidden_states_from(model, ids, spans, dtype, codec)
    return math.exp(nll_sum(model, hidden[:-1], ids[1:]) / (ids.shape[0] - 1))


def check_op(model: Llama, ids: torch.Tensor, spans, dtype, codec: str,
             positions: int = 8, device=None) -> float:
    """Largest difference, relative to the output's largest magnitude, between
    :func:`attention_mixed` and ``torch.ops.kvops.elastic_attention`` over :func:`mixed_pool`,
    at ``positions`` evenly spaced query positions (the last included) of every layer. The op
    runs on ``device`` (default: the model's), its query and pool copied there."""
    T = ids.shape[0]
    at = sorted({round(i * (T - 1) / max(1, positions - 1)) for i in range(positions)})
    worst = [0.0]

    def check(layer, q, k, v, out):
        for t in at:
            pool = [x.to(device or x.device)
                    for x in mixed_pool(k[:t + 1], v[:t + 1], spans[t], dtype, codec)]
            got, _ = torch.ops.kvops.elastic_attention(q[t:t + 1].to(pool[0].device, dtype),
                                                       pool[0], pool[1], pool[2], pool[3],
                                                       base_span=pool[4])
            err = (got.float().cpu()[0] - out[t]).abs().max() / out[t].abs().max().clamp(min=1e-30)
            worst[0] = max(worst[0], float(err))

    hidden_states_from(model, ids, spans, dtype, codec, check=check)
    return worst[0]


@torch.no_grad()
def passkey_hits(model: Llama, tok, n_tokens: int, prompts: int, dtype, codec: str, cap: float,
                 protect_first: int = 1, protect_recent: int = 2,
                 seed: int = 0) -> tuple[list[int], float, float]:
    """Passkey retrieval (:func:`kvops.evals.passkey.passkey_cases`: ``prompts`` prompts of
    about ``n_tokens`` tokens, the key at depths 0..1) with the mixed cache of cap ``cap``:
    the indices of the prompts retrieved (every digit of the key the argmax, read from one
    forward over prompt + key), the BASE share of the live blocks at the last position of the
    longest prompt, and the seconds taken. The deepest prompt runs in full; the others reuse its
    K/V up to where they depart from it (a position's BASE set depends on the position only)."""
    dtype, codec, cap = check_case(dtype, codec, cap)
    t0 = time.perf_counter()
    cases = passkey_cases(tok, n_tokens, prompts, seed)
    T = max(len(p) + len(a) for _, p, a in cases)
    spans = base_spans(T, cap, PAGE, protect_first, protect_recent)
    cache, base, hits = None, None, []
    for i in sorted(range(prompts), key=lambda i: -cases[i][0]):       # deepest first
        _, prompt, answer = cases[i]
        ids = torch.tensor(prompt + answer, device=model.rope_cos.device)
        n = len(answer)
        start = reusable_prefix(base, ids, n)
        hidden, kvs = hidden_states_from(model, ids, spans, dtype, codec, start, cache)
        if cache is None:
            cache, base = kvs, ids
        if model.output(hidden[-n - 1:-1]).argmax(-1).tolist() == answer:
            hits.append(i)
    return sorted(hits), exposure(spans)[0], time.perf_counter() - t0
