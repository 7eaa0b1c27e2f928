"""The far view's quality on a real model: perplexity and passkey retrieval on SmolLM2-135M.

Configurations (near window ``WINDOW = 512`` tokens, ``PAGE = 16``-token pages, far chunks of
``CHUNK = 128`` tokens), named as :func:`parse_config` reads them:

- ``dense``: the model's causal forward (SDPA over every earlier token);
- ``near``: each token attends to its window alone, the transport's window (the last W / S
  pages: from the first window page's first token to itself);
- ``far<cap>`` / ``far<cap>-nobias``: the window plus up to ``cap`` far-chunk summaries with
  ``far_bias = log(128)`` / ``0``;
- ``sink<n>`` and ``<config>+sink<n>`` (diagnostics, not a kvops path): the window (and far
  view) plus the sequence's first ``n`` tokens exact (StreamingLLM's attention sink).

Block-parallel evaluation (:func:`attention_banded`, :func:`hidden_states`,
:func:`perplexity`): every query position gets the attention a decode step with
:class:`kvops.runtime.FarView` gives it (its window plus the ``torch.ops.kvops.far_view_summarize``
means of every complete chunk before the window, keys after RoPE as the pool holds them),
computed for a block of queries at once with one masked SDPA over the contiguous key band plus
the summaries. :func:`check_paths` compares it with the same attention through
``torch.ops.kvops.static_sliding_attention`` (:func:`attention_far`). It is exact when every far
chunk fits the cap (at SmolLM2's 8192 positions, at most 60 chunks); a smaller cap is refused.
:func:`sequential_nll` decodes token by token through ``Pager`` + ``FarView`` instead (any cap:
the EMA-utility ranking then chooses).

Passkey (:func:`passkey_hits`): a 5-digit key in one sentence hidden at a swept depth of
repeated filler text, asked for at the end (chat format); a prompt counts as retrieved when
greedy decoding would emit the key's digits, read from one forward over prompt + key. The
prompts share their beginning, so per configuration the deepest prompt runs in full and keeps
every layer's K/V, and each other prompt computes only the positions from where it departs
(:func:`hidden_states_from`; ``dense`` goes through :func:`attention_dense`).
"""

from __future__ import annotations

import math
import random
import time

import torch
import torch.nn.functional as F

from kvops.evals.perplexity import nll_sum
from kvops.models import Llama, Tokenizer

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
    if base.startswith("far"):
        cap, _, suffix = base[3:].partition("-")
        if cap.isdigit() and suffix in ("", "nobias"):
            return "far", int(cap), suffix == "", sink
    raise ValueError(f"config: expected dense, near, sink<n>, far<cap> or far<cap>-nobias "
                     f"(+sink<n>), got {name!r}")


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
def attention_far(q, k, v, mode: str, cap: int, bias: bool, q_block: int = 256):
    """One layer's attention for every position: q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D]."""
    T, Hkv, D = k.shape
    win_start, win_len, n_far = window_geometry(T, q.device)
    pad = q.new_zeros(WINDOW, Hkv, D)
    kp, vp = torch.cat([pad, k]), torch.cat([pad, v])
    far = None
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
        if mode == "far":
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
                     q0: int = 0):
    """The same attention as :func:`attention_far` in one SDPA call per block of queries: the
    block's keys are the contiguous band ``[t0 - W, t0 + n)`` (no per-query copies) plus the
    far summaries, with a mask (window bounds, far chunk counts) carrying the far bias. This is
    what the evaluation runs; :func:`check_paths` compares it with the kvops-op path at start.
    ``sink`` (diagnostic) adds the first ``sink`` tokens exact where the window lacks them.
    ``mode="dense"``: causal attention over every earlier key. ``q0``: ``q`` holds only the
    queries of positions ``[q0, T)`` (``k, v`` all ``T``); the output is theirs."""
    T = k.shape[0]
    win_start, win_len, n_far = window_geometry(T, q.device)
    first = torch.arange(T, device=q.device) - win_len + 1                  # first visible key
    if mode == "dense":
        first = torch.zeros_like(first)
    if mode == "far" and int(n_far.max()) > cap:
        raise ValueError(f"far{cap}: {int(n_far.max())} far chunks at T={T} exceed the cap; "
                         f"the block-parallel evaluation needs every chunk to fit")
    far = far_summaries(k, v) if mode == "far" and T >= CHUNK else None
    out = torch.empty_like(q)
    for t0 in range(q0, T, q_block):
        n = min(q_block, T - t0)
        lo = 0 if mode == "dense" else max(0, t0 - WINDOW)
        keys = torch.arange(lo, t0 + n, device=q.device)
        t = torch.arange(t0, t0 + n, device=q.device)
        mask = (keys[None, :] >= first[t, None]) & (keys[None, :] <= t[:, None])
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
    materializes every score)."""
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
        cap = max(cap, chunks)            # a --sequential cap may be smaller; check the paths
        a = attention_banded(q, k, v, mode, cap, bias)
        b = attention_far(q, k, v, mode, cap, bias)
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
        x = x + att.wo(attention_banded(q, k, v, mode, cap, bias, sink).flatten(-2))
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
            o = attention_banded(q, k, v, mode, cap, bias, sink, q0=start)
        x = x + att.wo(o.flatten(-2))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.norm(x), kvs


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
            ids = torch.tensor(prompt + answer)
            n = len(answer)
            start = 0
            if cache is not None:
                m = min(len(base), len(ids) - n - 1)
                same = (base[:m] == ids[:m]).tolist()
                start = same.index(False) if False in same else m
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
