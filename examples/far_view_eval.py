"""Far-view quality on SmolLM2-135M: perplexity on the King James text and passkey retrieval.

    python -m examples.far_view_eval                                  # 2k/4k/8k perplexity
    python -m examples.far_view_eval --task passkey --contexts 2048 --prompts 50
    python -m examples.far_view_eval --contexts 2048 --configs dense near far64 far64-nobias
    python -m examples.far_view_eval --contexts 2048 --configs far4 far8 --sequential

Configurations (near window W = 512 tokens, 16-token pages, sv_chunk = 128):

- ``dense``: the model's causal forward (SDPA over every earlier token);
- ``near``: near-only truncation: each token attends to its window alone, the transport's
  window (the last W / S pages: from the first window page's first token to itself);
- ``far<cap>`` / ``far<cap>-nobias``: the window plus up to ``cap`` far-chunk summaries with
  ``far_bias = log(128)`` / ``0``;
- ``sink<n>`` and ``<config>+sink<n>`` (diagnostics, not a kvops path): the window (and far
  view) plus the sequence's first ``n`` tokens exact (StreamingLLM's attention sink), to tell
  how much of the near-only loss is the sink alone (in ``far<cap>+sink<n>`` those tokens also
  stay in chunk 0's summary).

How the far view is evaluated. By default, block-parallel: every query position gets the
attention a decode step with :class:`kvops.runtime.FarView` gives it (its window plus the
``torch.ops.kvops.far_view_summarize`` means of every complete 128-token chunk before the
window, keys after RoPE as the pool holds them), computed for a block of queries at once with
one masked SDPA over the contiguous key band plus the summaries. At start the script checks this
against the same attention through ``torch.ops.kvops.static_sliding_attention`` with per-query
window views (:func:`check_paths`), and ``tests/test_far_view_policy.py`` checks it against a
token-by-token Pager + FarView decode. It is exact when every far chunk fits the cap, which at
SmolLM2's 8192 positions always holds for cap 64 and 128 (at most 60 chunks), so those two caps
see the same slots; a smaller cap is refused. ``--sequential`` instead decodes token by token
through Pager + FarView (:func:`sequential_nll`; any cap, the EMA-utility ranking then chooses),
which is how a cap below the chunk count is measured.

Passkey: a 5-digit key in one sentence hidden at a swept depth of repeated filler text, asked
for at the end (chat format). A prompt counts as retrieved when greedy decoding would emit the
key's digits: each digit is the argmax given the prompt and the key's earlier digits, read from
one forward over prompt + key. The prompts share their beginning (chat head and the filler
before the key sentence): per configuration the deepest prompt runs in full and keeps every
layer's K/V, and each other prompt computes only the positions from where it departs from that
prompt (:func:`hidden_states_from`; ``dense`` then goes through :func:`attention_dense`).
Configurations that see the same slots at the prompt length (``far64`` and ``far128`` up to
8192 positions) are computed once and reported for both. The result lists the depths retrieved.

Writes ``bench/results/<date>-far_view-<task>-<contexts>[-sequential][-<tag>].md`` (and ``$OUT``).
Run from the repo root.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvops.evals.perplexity import kjv_tokens, nll_sum
from kvops.evals.records import markdown_table as table
from kvops.evals.records import write_record
from kvops.models import Llama, Tokenizer

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def write_result(name: str, body: str) -> Path:
    return write_record(RESULTS, name, body)

WINDOW, PAGE, CHUNK = 512, 16, 128


def parse_config(name: str) -> tuple[str, int, bool, int]:
    """``"dense" | "near" | "far<cap>[-nobias]"``, optionally ``+sink<n>`` (``"sink<n>"`` alone
    is ``near+sink<n>``) -> (mode, cap, log_count_bias, sink tokens)."""
    base, plus, extra = name.partition("+")
    sink = int(extra[4:]) if extra.startswith("sink") and extra[4:].isdigit() else -1
    if base.startswith("sink") and base[4:].isdigit() and not plus:
        return "near", 0, False, int(base[4:])
    if plus and sink < 0 or base == "dense" and plus:
        raise ValueError(f"config: expected +sink<n> after near or far<cap>, got {name!r}")
    sink = max(sink, 0)
    if base in ("dense", "near"):
        return base, 0, False, sink
    if base.startswith("ret") and not plus:
        top, _, suffix = base[3:].partition("-")
        if top.isdigit() and int(top) > 0 and (suffix == "" or suffix.startswith("every")
                                               and suffix[5:].isdigit() and int(suffix[5:]) > 0):
            return "ret", int(top), False, 0
    if base.startswith("far"):
        cap, _, suffix = base[3:].partition("-")
        if cap.isdigit() and suffix in ("", "nobias"):
            return "far", int(cap), suffix == "", sink
    raise ValueError(f"config: expected dense, near, sink<n>, far<cap> or far<cap>-nobias "
                     f"(+sink<n>), ret<K> or ret<K>-every<N>, got {name!r}")


def retrieval_every(name: str) -> int:
    """``ret<K>-every<N>`` -> N (selection every N positions); 1 for any other config."""
    _, _, suffix = name.partition("-every")
    return int(suffix) if name.startswith("ret") and suffix else 1


def page_bounds(k):
    """Per-channel key min and max of every complete page of ``k [T, Hkv, D]`` through
    ``torch.ops.kvops.far_page_summarize``: ``[1, T // PAGE, Hkv, D]`` each."""
    T, Hkv, D = k.shape
    n = T // PAGE
    pages = torch.arange(n, dtype=torch.int32, device=k.device).view(1, n)
    return torch.ops.kvops.far_page_summarize(k[: n * PAGE].reshape(n, PAGE, Hkv, D), pages)


def retrieval_pages(q, bounds, t, n_pages, top_k: int, every: int = 1):
    """Far pages each query position ``t`` attends to under the retrieval far view: the
    ``top_k`` pages of highest key-bound score (``torch.ops.kvops.far_page_select``) among its
    far pages ``[0, n_pages[t])``, chosen with the query of position ``t - t % every`` (and its
    far pages: selection every ``every`` steps). ``q`` holds the queries of positions ``t``
    (``t - t % every`` must be among them). Returns a bool mask ``[len(t), pages]``."""
    lo, hi = bounds
    N = lo.shape[1]
    at = t - t % every
    row = torch.searchsorted(t, at)
    qs, nf = q[row], n_pages[at].to(torch.int32)
    idx, _ = torch.ops.kvops.far_page_select(qs, lo.expand(len(t), -1, -1, -1),
                                             hi.expand(len(t), -1, -1, -1), nf, min(top_k, N))
    sel = torch.zeros(len(t), N + 1, dtype=torch.bool, device=q.device)
    sel.scatter_(1, torch.where(idx >= 0, idx, N).long(), True)
    return sel[:, :N]


def window_geometry(T: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query position t: (win_start, win_len) into the W keys ending at t, and the number of
    complete far chunks before its window."""
    t = torch.arange(T, device=device)
    blocks = (t + 1 + PAGE - 1) // PAGE
    first = (blocks - WINDOW // PAGE).clamp(min=0) * PAGE         # first window token
    win_start = (first - t + WINDOW - 1).to(torch.int32)
    win_len = (t - first + 1).to(torch.int32)
    return win_start, win_len, first // CHUNK


@torch.no_grad()
def attention_far(q, k, v, mode: str, cap: int, bias: bool, q_block: int = 256, every: int = 1):
    """One layer's attention for every position: q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D]."""
    T, Hkv, D = k.shape
    win_start, win_len, n_far = window_geometry(T, q.device)
    pad = q.new_zeros(WINDOW, Hkv, D)
    kp, vp = torch.cat([pad, k]), torch.cat([pad, v])
    far = None
    if mode == "ret":
        bounds = page_bounds(k)
        n_pages = (torch.arange(T, device=q.device) - win_len + 1) // PAGE
        N = bounds[0].shape[1]
        kpg = k[: N * PAGE].reshape(N, PAGE, Hkv, D)
        vpg = v[: N * PAGE].reshape(N, PAGE, Hkv, D)
    if mode == "far" and T >= CHUNK:
        far = (*far_summaries(k, v), math.log(CHUNK) if bias else 0.0)
    out = torch.empty_like(q)
    row = Hkv * D
    for t0 in range(0, T, q_block):
        n = min(q_block, T - t0)
        kw = kp.as_strided((n, WINDOW, Hkv, D), (row, row, D, 1), (t0 + 1) * row)
        vw = vp.as_strided((n, WINDOW, Hkv, D), (row, row, D, 1), (t0 + 1) * row)
        ws, wl = win_start[t0:t0 + n], win_len[t0:t0 + n]
        args = ()
        if mode == "ret" and N:
            t = torch.arange(t0 - t0 % every, t0 + n, device=q.device)
            sel = retrieval_pages(q[t], bounds, t, n_pages, cap, every)[-n:]     # [n, N]
            K = min(cap, N)
            idx = torch.where(sel, torch.arange(N, device=q.device), N).sort(dim=1).values[:, :K]
            live = idx < N
            rows = idx.clamp(max=N - 1).flatten()
            fk = kpg[rows].view(n, K * PAGE, Hkv, D)
            fv = vpg[rows].view(n, K * PAGE, Hkv, D)
            fb = torch.where(live, 0.0, float("-inf")).repeat_interleave(PAGE, dim=1)
            args = (fk, fv, fb.to(torch.float32))
        elif mode == "far":
            slot = torch.arange(cap, device=q.device)
            live = slot[None, :] < n_far[t0:t0 + n, None]                 # [n, cap]
            if far is None:
                fk = q.new_zeros(n, cap, Hkv, D)
                fv = fk
            else:
                idx = slot.clamp(max=far[0].shape[0] - 1)
                fk = far[0][idx].expand(n, -1, -1, -1)
                fv = far[1][idx].expand(n, -1, -1, -1)
            fb = torch.where(live, far[2] if far else 0.0, float("-inf")).to(torch.float32)
            args = (fk, fv, fb)
        out[t0:t0 + n], _ = torch.ops.kvops.static_sliding_attention(q[t0:t0 + n], kw, vw, ws, wl, *args)
    return out


def far_summaries(k, v):
    """Every complete chunk's mean K and V ([chunks, Hkv, D] each) through the kvops op."""
    T, Hkv, D = k.shape
    chunks, M = T // CHUNK, CHUNK // PAGE
    pages = (t[: chunks * CHUNK].reshape(chunks * M, PAGE, Hkv, D) for t in (k, v))
    table_ = torch.arange(chunks * M, dtype=torch.int32, device=k.device).view(1, chunks, M)
    k_sum, v_sum = torch.ops.kvops.far_view_summarize(*pages, table_)
    return k_sum[0], v_sum[0]


@torch.no_grad()
def attention_banded(q, k, v, mode: str, cap: int, bias: bool, sink: int = 0, q_block: int = 256,
                     q0: int = 0, every: int = 1):
    """The same attention as :func:`attention_far` in one SDPA call per block of queries: the
    block's keys are the contiguous band ``[t0 - W, t0 + n)`` (no per-query copies) plus the
    far summaries, with a mask (window bounds, far chunk counts) carrying the far bias. This is
    what the evaluation runs; :func:`check_paths` compares it with the kvops-op path at start.
    ``sink`` (diagnostic) adds the first ``sink`` tokens exact where the window lacks them.
    ``mode="dense"``: causal attention over every earlier key. ``q0``: ``q`` holds only the
    queries of positions ``[q0, T)`` (``k, v`` all ``T``); the output is theirs.
    ``mode="ret"``: the window plus the exact tokens of the ``cap`` far pages
    :func:`retrieval_pages` picks for each query (bias 0); with ``every > 1``, ``q0`` must be
    a multiple of ``every``."""
    T = k.shape[0]
    win_start, win_len, n_far = window_geometry(T, q.device)
    first = torch.arange(T, device=q.device) - win_len + 1                  # first visible key
    if mode == "dense":
        first = torch.zeros_like(first)
    if mode == "far" and int(n_far.max()) > cap:
        raise ValueError(f"far{cap}: {int(n_far.max())} far chunks at T={T} exceed the cap; "
                         f"the block-parallel evaluation needs every chunk to fit")
    far = far_summaries(k, v) if mode == "far" and T >= CHUNK else None
    if mode == "ret":
        if q0 % every:
            raise ValueError(f"attention_banded: q0={q0} is not a multiple of every={every}")
        bounds = page_bounds(k)
        n_pages = first // PAGE
        q_block = max(every, q_block - q_block % every)
    out = torch.empty_like(q)
    for t0 in range(q0, T, q_block):
        n = min(q_block, T - t0)
        lo = 0 if mode in ("dense", "ret") else max(0, t0 - WINDOW)
        keys = torch.arange(lo, t0 + n, device=q.device)
        t = torch.arange(t0, t0 + n, device=q.device)
        mask = (keys[None, :] >= first[t, None]) & (keys[None, :] <= t[:, None])
        if mode == "ret" and bounds[0].shape[1]:
            sel = retrieval_pages(q[t0 - q0:t0 - q0 + n], bounds, t, n_pages, cap, every)
            tok = sel.repeat_interleave(PAGE, dim=1)                     # [n, pages * PAGE]
            mask[:, : tok.shape[1]] |= tok[:, : mask.shape[1]]
        bias_ = torch.where(mask, 0.0, float("-inf"))
        kb, vb = k[lo:t0 + n], v[lo:t0 + n]
        if sink:                            # the first `sink` tokens, where not in the window
            head = torch.arange(min(sink, T), device=q.device)
            seen = (head[None, :] < first[t, None]) & (head[None, :] <= t[:, None])
            bias_ = torch.cat([torch.where(seen, 0.0, float("-inf")), bias_], dim=1)
            kb, vb = torch.cat([k[head], kb]), torch.cat([v[head], vb])
        if far is not None:
            c = torch.arange(far[0].shape[0], device=q.device)
            live = c[None, :] < n_far[t, None]
            fb = torch.where(live, math.log(CHUNK) if bias else 0.0, float("-inf"))
            bias_ = torch.cat([bias_, fb], dim=1)
            kb, vb = torch.cat([kb, far[0]]), torch.cat([vb, far[1]])
        o = F.scaled_dot_product_attention(q[t0 - q0:t0 - q0 + n].transpose(0, 1),
                                           kb.transpose(0, 1), vb.transpose(0, 1),
                                           attn_mask=bias_.to(q.dtype), enable_gqa=True)
        out[t0 - q0:t0 - q0 + n] = o.transpose(0, 1)
    return out


@torch.no_grad()
def attention_dense(q, k, v, q0: int = 0):
    """Causal attention of the queries of positions ``[q0, T)`` (``q [T - q0, Hq, D]``) over
    ``k, v [T, Hkv, D]``: the keys before ``q0`` unmasked and the keys from ``q0`` causal, two
    calls of PyTorch's CPU flash kernel merged by their log-sum-exp. The same attention as
    ``attention_banded(..., "dense", q0=q0)``, several times faster on the CPU (a masked SDPA
    materializes every score). On CUDA it is the banded path's dense mode."""
    if q.device.type != "cpu":
        return attention_banded(q, k, v, "dense", 0, False, q0=q0)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    g = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]
    kh, vh = (t.repeat_interleave(g, 1).transpose(0, 1)[None] for t in (k, v))
    o, lse = flash(qh, kh[:, :, q0:], vh[:, :, q0:], 0.0, True)[:2]
    if q0:
        o_pre, lse_pre = flash(qh, kh[:, :, :q0], vh[:, :, :q0], 0.0, False)[:2]
        lse_all = torch.logaddexp(lse, lse_pre)
        o = o * (lse - lse_all).exp()[..., None] + o_pre * (lse_pre - lse_all).exp()[..., None]
    return o[0].transpose(0, 1)


def check_paths(model: Llama, ids: torch.Tensor, configs: list[str]) -> float:
    """Largest difference between the banded and the kvops-op attention on layer 0 of ``ids``,
    over the configurations' window and far parts (a ``+sink`` diagnostic is checked without
    its sink tokens, which have no kvops path)."""
    T = ids.shape[0]
    x = model.layers[0].attention_norm(model.tok_embeddings(ids))
    q, k, v = model.layers[0].attention._qkv(x, model.rope_cos[:T], model.rope_sin[:T])
    worst = 0.0
    chunks = int(window_geometry(T, ids.device)[2].max())
    for c in configs:
        mode, cap, bias, _ = parse_config(c)
        if mode == "dense":
            continue
        every = retrieval_every(c)
        if mode == "ret":                 # fewer pages than are far, so the selection binds
            cap = min(cap, 8)
        else:
            cap = max(cap, chunks)        # a --sequential cap may be smaller; check the paths
        a = attention_banded(q, k, v, mode, cap, bias, every=every)
        b = attention_far(q, k, v, mode, cap, bias, q_block=64, every=every)
        worst = max(worst, (a - b).abs().max().item())
    return worst


@torch.no_grad()
def hidden_states(model: Llama, ids: torch.Tensor, config: str) -> torch.Tensor:
    """Final-norm hidden states [T, dim] of ``ids [T]`` under one configuration."""
    mode, cap, bias, sink = parse_config(config)
    if mode == "dense":
        return model.hidden_states(ids[None])[0]
    T = ids.shape[0]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.tok_embeddings(ids)
    for block in model.layers:
        att = block.attention
        q, k, v = att._qkv(block.attention_norm(x), cos, sin)
        o = attention_banded(q, k, v, mode, cap, bias, sink, every=retrieval_every(config))
        x = x + att.wo(o.flatten(-2))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.norm(x)


@torch.no_grad()
def hidden_states_from(model: Llama, ids: torch.Tensor, config: str, start: int = 0,
                       cache: list | None = None) -> tuple[torch.Tensor, list]:
    """Final-norm hidden states ``[T - start, dim]`` of positions ``[start, T)`` of ``ids [T]``
    under one configuration (``dense`` through :func:`attention_dense`), and every layer's
    ``(k, v)`` of all ``T`` positions. Positions before ``start`` are not recomputed: their K/V
    come from ``cache`` (the second result of a call on a sequence whose first ``start`` tokens
    are ``ids[:start]``; causal attention makes them independent of what follows)."""
    mode, cap, bias, sink = parse_config(config)
    T = ids.shape[0]
    cos, sin = model.rope_cos[start:T], model.rope_sin[start:T]
    x = model.tok_embeddings(ids[start:])
    kvs = []
    for layer, block in enumerate(model.layers):
        att = block.attention
        q, k, v = att._qkv(block.attention_norm(x), cos, sin)
        if start:
            k = torch.cat([cache[layer][0][:start], k])
            v = torch.cat([cache[layer][1][:start], v])
        kvs.append((k, v))
        if mode == "dense":
            o = attention_dense(q, k, v, start)
        else:
            o = attention_banded(q, k, v, mode, cap, bias, sink, q0=start,
                                 every=retrieval_every(config))
        x = x + att.wo(o.flatten(-2))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.norm(x), kvs


@torch.no_grad()
def selection_churn(model: Llama, ids: torch.Tensor, top_k: int, lags=(1, 2, 4, 8, 16)):
    """How fast the retrieval far view's choice moves along ``ids`` (under ``ret<top_k>``):
    per lag ``n``, the share of the pages chosen at position ``t`` that were not chosen at
    ``t - n`` (pages that left the window in between count as new), over every layer and every
    pair of positions that both choose ``top_k`` pages. This is the copy work a selection does
    (only new pages are copied) and what a selection every ``n`` steps misses."""
    T = ids.shape[0]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.tok_embeddings(ids)
    new = {n: 0 for n in lags}
    total = {n: 0 for n in lags}
    t_all = torch.arange(T, device=ids.device)
    for block in model.layers:
        att = block.attention
        q, k, v = att._qkv(block.attention_norm(x), cos, sin)
        _, win_len, _ = window_geometry(T, ids.device)
        n_pages = (t_all - win_len + 1) // PAGE
        bounds = page_bounds(k)
        sel = torch.cat([retrieval_pages(q[i:i + 256], bounds, t_all[i:i + 256], n_pages, top_k)
                         for i in range(0, T, 256)])
        full = sel.sum(dim=1) == top_k
        for n in lags:
            both = full[n:] & full[:-n]
            fresh = (sel[n:] & ~sel[:-n]).sum(dim=1)
            new[n] += int(fresh[both].sum())
            total[n] += int(both.sum()) * top_k
        o = attention_banded(q, k, v, "ret", top_k, False)
        x = x + att.wo(o.flatten(-2))
        x = x + block.feed_forward(block.ffn_norm(x))
    return {n: new[n] / max(total[n], 1) for n in lags}


def perplexity(model, ids, config) -> float:
    hidden = hidden_states(model, ids, config)
    return math.exp(nll_sum(model, hidden[:-1], ids[1:]) / (ids.shape[0] - 1))


@torch.no_grad()
def sequential_nll(model: Llama, ids: torch.Tensor, cap: int, bias: bool, ema: float = 0.9) -> float:
    """Summed next-token NLL of ``ids`` decoded one token at a time through the runtime: a
    :class:`kvops.runtime.Pager` maps the sequence's pages, :class:`kvops.runtime.FarView`
    summarizes chunks as they leave the window and picks ``cap`` of them by EMA utility, and
    every layer attends through ``torch.ops.kvops.static_sliding_attention`` over its window
    pages plus the far view. Works for any cap (the utility ranking chooses when chunks
    outnumber it); costs one decode step per token."""
    from kvops.runtime import FarView, Pager

    T, cfg = ids.shape[0], model.cfg
    pages = -(-T // PAGE)
    pager = Pager(pages, PAGE, max_sessions=1, max_blocks=pages, device="cpu")
    far = FarView(pager, window_tokens=WINDOW, chunk_tokens=CHUNK, cap=cap,
                  num_layers=cfg.n_layers, num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                  dtype=torch.float32, ema=ema, log_count_bias=bias)
    pool = torch.zeros(cfg.n_layers, 2, pages, PAGE, cfg.n_kv_heads, cfg.head_dim)
    nw = WINDOW // PAGE
    nll = 0.0
    for t in range(T - 1):
        with pager.frame() as f:
            f.reserve("s", 1)
        table_ = pager.pages("s")
        page, first = table_[t // PAGE], max(0, len(table_) - nw)
        win = torch.tensor(table_[first:])
        ws = torch.zeros(1, dtype=torch.int32)
        wl = torch.tensor([t + 1 - first * PAGE], dtype=torch.int32)
        cos, sin = model.rope_cos[t:t + 1], model.rope_sin[t:t + 1]
        x = model.tok_embeddings(ids[t:t + 1])
        for layer, block in enumerate(model.layers):
            att = block.attention
            q, k, v = att._qkv(block.attention_norm(x), cos, sin)
            kc, vc = pool[layer, 0], pool[layer, 1]
            kc[page, t % PAGE], vc[page, t % PAGE] = k[0], v[0]
            far.absorb(layer, kc, vc)
            far_k, far_v, far_bias = far.view(layer)
            kw = kc[win].reshape(1, -1, cfg.n_kv_heads, cfg.head_dim)
            vw = vc[win].reshape(1, -1, cfg.n_kv_heads, cfg.head_dim)
            out, lse = torch.ops.kvops.static_sliding_attention(q, kw, vw, ws, wl, far_k, far_v,
                                                                far_bias)
            far.observe(layer, q, far_k, far_bias, lse)
            x = x + att.wo(out.flatten(-2))
            x = x + block.feed_forward(block.ffn_norm(x))
        far.pull_scores()
        logits = model.output(model.norm(x)).float()
        nll += F.cross_entropy(logits, ids[t + 1:t + 2], reduction="sum").item()
    return nll


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n\n")


def passkey_prompt(tok: Tokenizer, n_tokens: int, depth: float, key: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of about ``n_tokens`` tokens: the key sentence after
    ``depth`` (0..1) of the filler, the question at the end, in SmolLM2's chat format."""
    head = tok.encode(tok.chat_prompt(INTRO).split(INTRO)[0] + INTRO)
    needle = tok.encode(f"The pass key is {key}. Remember it. {key} is the pass key.\n")
    tail = tok.encode("\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is")
    filler = tok.encode(FILLER)
    answer = tok.encode(" " + key)
    reps = max(1, (n_tokens - len(head) - len(needle) - len(tail) - len(answer)) // len(filler))
    at = round(depth * reps)
    body = filler * at + needle + filler * (reps - at)
    return head + body + tail, answer


def passkey_cases(tok: Tokenizer, n_tokens: int, prompts: int, seed: int = 0):
    """The prompts: (depth, prompt ids, answer ids), depths ``0, 1/(prompts-1), ..., 1``."""
    rng = random.Random(seed)
    cases = []
    for i in range(prompts):
        depth = i / max(1, prompts - 1)
        key = str(rng.randint(10000, 99999))
        cases.append((depth, *passkey_prompt(tok, n_tokens, depth, key)))
    return cases


def same_slots(configs: list[str], T: int) -> dict[str, str]:
    """config -> the first config it computes identically to at length ``T``: ``far<cap>`` and
    ``far<cap'>`` with the same bias and sink when every far chunk fits both caps (the
    block-parallel evaluation then sees the same slots; the cap only bounds them)."""
    chunks = int(window_geometry(T, "cpu")[2].max())
    seen, alias = {}, {}
    for c in configs:
        mode, cap, bias, sink = parse_config(c)
        key = ("far", bias, sink) if mode == "far" and cap >= chunks else c
        alias[c] = seen.setdefault(key, c)
    return alias


def passkey_hits(model, tok, n_tokens, configs, prompts, seed=0) -> tuple[dict, dict, dict]:
    """Per config: the indices of the prompts retrieved, the seconds it took, and which config
    it was computed as (:func:`same_slots`; an alias is not recomputed).

    The prompts share their beginning (the chat head and the filler before the key sentence),
    so per config the deepest prompt runs in full and keeps every layer's K/V; each other prompt
    computes only its positions from where it leaves that prompt, attending to the kept K/V for
    the positions before (exact: causal attention; float rounding may differ from one full
    forward at the 1e-6 level)."""
    cases = passkey_cases(tok, n_tokens, prompts, seed)
    alias = same_slots(configs, max(len(p) + len(a) for _, p, a in cases))
    hits, seconds = {}, {}
    for c in configs:
        if alias[c] != c:
            continue
        t = time.perf_counter()
        order = sorted(range(prompts), key=lambda i: -cases[i][0])   # deepest first
        cache, base, hits[c] = None, None, []
        for i in order:
            depth, prompt, answer = cases[i]
            ids = torch.tensor(prompt + answer, device=model.rope_cos.device)
            n = len(answer)
            start = 0
            if cache is not None:
                m = min(len(base), len(ids) - n - 1)
                same = (base[:m] == ids[:m]).tolist()
                start = same.index(False) if False in same else m
                start -= start % retrieval_every(c)   # a selection step's query is recomputed
            hidden, kvs = hidden_states_from(model, ids, c, start, cache)
            if cache is None:
                cache, base = kvs, ids
            got = model.output(hidden[-n - 1:-1]).argmax(-1).tolist()
            if got == answer:
                hits[c].append(i)
            print(f"{c} prompt {i} depth {depth:.2f} from {start}/{len(ids)}: "
                  f"{'hit' if got == answer else 'miss'} (total {len(hits[c])}, "
                  f"{time.perf_counter() - t:.0f} s)", flush=True)
        hits[c].sort()
        seconds[c] = time.perf_counter() - t
    for c in configs:
        hits[c], seconds[c] = hits[alias[c]], seconds[alias[c]]
    return hits, seconds, alias


COLORS = ["red", "blue", "green", "gold", "silver", "black", "white", "pink"]


def multikey_prompt(tok: Tokenizer, n_tokens: int, depths: list[float], keys: list[str],
                    ask: int) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of about ``n_tokens`` tokens: one key sentence per key, the
    ``i``-th named ``COLORS[i]`` and placed after ``depths[i]`` of the filler, then the question
    for key ``ask`` (chat format)."""
    head = tok.encode(tok.chat_prompt(INTRO).split(INTRO)[0] + INTRO)
    needles = [tok.encode(f"The {COLORS[i]} pass key is {key}. Remember it. {key} is the "
                          f"{COLORS[i]} pass key.\n") for i, key in enumerate(keys)]
    tail = tok.encode(f"\nWhat is the {COLORS[ask]} pass key?<|im_end|>\n<|im_start|>assistant\n"
                      f"The {COLORS[ask]} pass key is")
    filler = tok.encode(FILLER)
    answer = tok.encode(" " + keys[ask])
    used = len(head) + sum(map(len, needles)) + len(tail) + len(answer)
    reps = max(1, (n_tokens - used) // len(filler))
    body, at = [], 0
    for d, needle in sorted(zip(depths, needles), key=lambda p: p[0]):
        upto = round(d * reps)
        body += filler * (upto - at) + needle
        at = upto
    body += filler * (reps - at)
    return head + body + tail, answer


def multikey_cases(tok: Tokenizer, n_tokens: int, trials: int, needles: int, seed: int = 0):
    """Per trial, ``needles`` keys at stratified random depths (key ``i`` in the ``i``-th of
    ``needles`` equal bands of the filler), each asked for once: a list of (trial, key index,
    depth, prompt ids, answer ids), a trial's questions together (they share the context)."""
    if not 1 <= needles <= len(COLORS):
        raise ValueError(f"needles: expected 1..{len(COLORS)}, got {needles}")
    rng = random.Random(seed)
    cases = []
    for r in range(trials):
        depths = [(i + rng.random()) / needles for i in range(needles)]
        keys = [str(rng.randint(10000, 99999)) for _ in range(needles)]
        for i in range(needles):
            cases.append((r, i, depths[i], *multikey_prompt(tok, n_tokens, depths, keys, i)))
    return cases


def multikey_hits(model, tok, n_tokens, configs, trials, needles, seed=0) -> tuple[dict, dict]:
    """Per config: the (trial, key) pairs answered (every digit the argmax, as for passkey)
    and the seconds it took. Each question reuses the K/V of the previous one's common prefix
    (a trial's questions share the whole context; trials share the filler before their first
    key)."""
    cases = multikey_cases(tok, n_tokens, trials, needles, seed)
    hits, seconds = {}, {}
    for c in configs:
        t = time.perf_counter()
        cache, base, hits[c] = None, None, []
        for r, i, depth, prompt, answer in cases:
            ids = torch.tensor(prompt + answer, device=model.rope_cos.device)
            n, start = len(answer), 0
            if cache is not None:
                m = min(len(base), len(ids) - n - 1)
                same = (base[:m] == ids[:m]).tolist()
                start = same.index(False) if False in same else m
                start -= start % retrieval_every(c)
            hidden, cache = hidden_states_from(model, ids, c, start, cache)
            base = ids
            got = model.output(hidden[-n - 1:-1]).argmax(-1).tolist()
            if got == answer:
                hits[c].append((r, i))
            print(f"{c} trial {r} key {i} depth {depth:.2f} from {start}/{len(ids)}: "
                  f"{'hit' if got == answer else 'miss'} (total {len(hits[c])}, "
                  f"{time.perf_counter() - t:.0f} s)", flush=True)
        seconds[c] = time.perf_counter() - t
    return hits, seconds


def depth_ranges(indices: list[int], prompts: int) -> str:
    """Retrieved prompt indices as depth ranges: ``"0.00-0.12, 0.86-1.00"``."""
    runs = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    d = lambda i: f"{i / max(1, prompts - 1):.2f}"
    return ", ".join(d(a) if a == b else f"{d(a)}-{d(b)}" for a, b in runs) or "none"


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return "CPU"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=["perplexity", "passkey", "multikey", "churn"],
                    default="perplexity")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--configs", nargs="+",
                    default=["dense", "near", "far64", "far64-nobias", "far128", "far128-nobias"])
    ap.add_argument("--prompts", type=int, default=50,
                    help="passkey prompts per length; multikey: trials per length")
    ap.add_argument("--needles", type=int, default=4, help="multikey: keys per context")
    ap.add_argument("--sequential", action="store_true",
                    help="perplexity of far configs by token-by-token decode through Pager + "
                         "FarView (any cap; slow)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    args = ap.parse_args(argv)
    for c in args.configs:
        parse_config(c)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = Llama.from_gguf(device=args.device), Tokenizer.from_gguf()
    worst = check_paths(model, kjv_tokens(tok, 1100).to(args.device), args.configs)
    print(f"banded vs kvops-op attention, layer 0, 1100 tokens: max abs diff {worst:.2e}")
    if worst > 1e-4:
        raise AssertionError(f"the banded evaluation disagrees with the kvops ops ({worst:.2e})")
    rows, notes = [], []
    for n in args.contexts:
        if args.task == "perplexity":
            ids = kjv_tokens(tok, n).to(args.device)
            for c in args.configs:
                t = time.perf_counter()
                mode, cap, bias, sink = parse_config(c)
                if args.sequential and mode == "far" and not sink:
                    c += " (sequential)"
                    ppl = math.exp(sequential_nll(model, ids, cap, bias) / (n - 1))
                else:
                    ppl = perplexity(model, ids, c)
                rows.append([n, c, f"{ppl:.3f}", time.perf_counter() - t])
                print(rows[-1], flush=True)
        elif args.task == "churn":
            ids = kjv_tokens(tok, n).to(args.device)
            for c in args.configs:
                mode, cap, _, _ = parse_config(c)
                if mode != "ret":
                    continue
                t = time.perf_counter()
                for lag, share in selection_churn(model, ids, cap).items():
                    rows.append([n, c, lag, f"{share:.3f}", f"{time.perf_counter() - t:.0f}"])
                    print(rows[-1], flush=True)
        elif args.task == "multikey":
            hits, seconds = multikey_hits(model, tok, n, args.configs, args.prompts, args.needles)
            total = args.prompts * args.needles
            for c in args.configs:
                k = len(hits[c])
                full = sum(all((r, i) in hits[c] for i in range(args.needles))
                           for r in range(args.prompts))
                per_key = "/".join(str(sum((r, i) in hits[c] for r in range(args.prompts)))
                                   for i in range(args.needles))
                rows.append([n, c, args.prompts, args.needles, k, f"{k / total:.2f}", full,
                             per_key, f"{seconds[c]:.0f}"])
                print(rows[-1], flush=True)
        else:
            t = time.perf_counter()
            hits, seconds, alias = passkey_hits(model, tok, n, args.configs, args.prompts)
            for c in args.configs:
                k = len(hits[c])
                secs = f"{seconds[c]:.0f}" if alias[c] == c else f"= {alias[c]}"
                rows.append([n, c, args.prompts, k, f"{k / args.prompts:.2f}",
                             depth_ranges(hits[c], args.prompts), secs])
                if alias[c] != c:
                    notes.append(f"{n}: {c} sees exactly the slots of {alias[c]} (every far chunk "
                                 f"fits both caps); computed once, counted for both.")
            print(f"{n}: {time.perf_counter() - t:.0f} s", flush=True)
    head = ["context N", "config", "perplexity", "seconds"] if args.task == "perplexity" else \
        ["context N", "config", "prompts", "retrieved", "accuracy", "retrieved at depths",
         "seconds"]
    if args.task == "churn":
        head = ["context N", "config", "lag (steps)", "share of chosen pages new", "seconds"]
    if args.task == "multikey":
        head = ["context N", "config", "trials", "keys each", "keys answered", "accuracy",
                "trials with every key", "answered per key (shallow to deep)", "seconds"]
    body = "\n".join([
        f"SmolLM2-135M-Instruct (GGUF, float32, {device_name(args.device)}). Near window "
        f"W={WINDOW}, pages of {PAGE}, "
        f"sv_chunk {CHUNK}; far<cap> = window + far-chunk summaries (log-count bias unless "
        "-nobias); near = window only; ret<K> = window + the K far pages (of 16 tokens) of "
        "highest key-bound score for each query, exact, bias 0 (-every<N>: selection every N "
        "positions). See examples/far_view_eval.py for the method.",
        f"Banded evaluation vs the kvops-op path (layer 0, 1100 tokens): max abs diff {worst:.2e}.",
        "",
        table(head, rows),
        *(["", *notes] if notes else []),
    ])
    name = f"far_view-{args.task}-" + "-".join(str(n) for n in args.contexts) + \
        ("-sequential" if args.sequential else "") + (f"-{args.tag}" if args.tag else "")
    print(write_result(name, body))
    print(body)


if __name__ == "__main__":
    main()
