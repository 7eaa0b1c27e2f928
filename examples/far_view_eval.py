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

The evaluation itself lives in :mod:`kvops.evals.far_view`: block-parallel by default (every
query position gets the attention a decode step with :class:`kvops.runtime.FarView` gives it,
one masked SDPA per block of queries, checked at start against the same attention through
``torch.ops.kvops.static_sliding_attention``; exact when every far chunk fits the cap, so at
SmolLM2's 8192 positions cap 64 and 128 see the same slots and a smaller cap is refused);
``--sequential`` decodes token by token through Pager + FarView instead (any cap: the
EMA-utility ranking chooses). Passkey: a 5-digit key hidden at a swept depth of filler text,
retrieved when greedy decoding would emit its digits; the result lists the depths retrieved.

Writes ``bench/results/<date>-far_view-<task>-<contexts>[-sequential][-<tag>].md`` (and ``$OUT``).
Run from the repo root.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from kvops.evals.far_view import (
    CHUNK,
    PAGE,
    WINDOW,
    check_paths,
    parse_config,
    passkey_hits,
    perplexity,
    sequential_nll,
)
from kvops.evals.perplexity import kjv_tokens
from kvops.evals.records import markdown_table, write_record
from kvops.models import Llama, Tokenizer

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=["perplexity", "passkey"], default="perplexity")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--configs", nargs="+",
                    default=["dense", "near", "far64", "far64-nobias", "far128", "far128-nobias"])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--sequential", action="store_true",
                    help="perplexity of far configs by token-by-token decode through Pager + "
                         "FarView (any cap; slow)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    args = ap.parse_args(argv)
    for c in args.configs:
        parse_config(c)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = Llama.from_gguf(), Tokenizer.from_gguf()
    worst = check_paths(model, kjv_tokens(tok, 1100), args.configs)
    print(f"banded vs kvops-op attention, layer 0, 1100 tokens: max abs diff {worst:.2e}")
    if worst > 1e-4:
        raise AssertionError(f"the banded evaluation disagrees with the kvops ops ({worst:.2e})")
    rows, notes = [], []
    for n in args.contexts:
        if args.task == "perplexity":
            ids = kjv_tokens(tok, n)
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
    body = "\n".join([
        f"SmolLM2-135M-Instruct (GGUF, float32, CPU). Near window W={WINDOW}, pages of {PAGE}, "
        f"sv_chunk {CHUNK}; far<cap> = window + far-chunk summaries (log-count bias unless "
        "-nobias); near = window only. See examples/far_view_eval.py for the method.",
        f"Banded evaluation vs the kvops-op path (layer 0, 1100 tokens): max abs diff {worst:.2e}.",
        "",
        markdown_table(head, rows),
        *(["", *notes] if notes else []),
    ])
    name = f"far_view-{args.task}-" + "-".join(str(n) for n in args.contexts) + \
        ("-sequential" if args.sequential else "") + (f"-{args.tag}" if args.tag else "")
    print(write_record(RESULTS, name, body))
    print(body)


if __name__ == "__main__":
    main()
