"""ElasticKV quality on SmolLM2-135M: perplexity on the King James text and passkey retrieval
with a share of the KV blocks in BASE.

    python -m examples.elastic_quality_eval                        # 2048 tokens, both tasks
    python -m examples.elastic_quality_eval --contexts 1024 --caps 0 0.2 --cases bfloat16:e4m3
    python -m examples.elastic_quality_eval --tasks passkey --prompts 20

Cases: float16 with ``hi8`` and ``hi8r``, bfloat16 with ``e4m3``; BASE-exposure caps 0
(TARGET), 5, 10, 20 % and 1 (all-BASE). For a cap below 1 the BASE blocks are the ones
``kvops.runtime.Fidelity`` demotes when asked for pairs one token at a time (its oldest
unprotected pairs; ``--protect-first`` sink blocks and the last ``--protect-recent`` blocks stay
TARGET), as many as keep the BASE share of the live blocks at or below the cap; cap 1 makes
every block BASE. Attention over the mixed cache is evaluated block-parallel with the codec's
decoded BASE values (``kvops.evals.elastic``); at start the script compares it with
``torch.ops.kvops.elastic_attention`` over pools packed by ``torch.ops.kvops.pack_base_pairs``
at sampled positions of every layer, for every case at the largest cap below 1 and at cap 1.
Cap 0 has no BASE block, so it is computed once a dtype and is the TARGET row.

Perplexity: exp of the mean next-token NLL over the first N tokens of the KJV text.
Passkey: ``kvops.evals.passkey``'s prompts (a 5-digit key at depths 0..1 of filler text, chat
format), retrieved when every digit of the key is the argmax.

Writes ``bench/results/<date>-<HHMM>-elastic-quality[-<tag>].md`` (and ``$OUT``). Run from the repo root.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvops.evals import elastic as ev
from kvops.evals.passkey import depth_ranges
from kvops.evals.perplexity import kjv_tokens
from kvops.evals.records import markdown_table as table
from kvops.evals.records import write_record
from kvops.models import Llama, Tokenizer

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def parse_case(text: str) -> tuple[str, str]:
    dtype, _, codec = text.partition(":")
    ev.check_case(dtype, codec, 0.0)
    return dtype, codec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", choices=["perplexity", "passkey"],
                    default=["perplexity", "passkey"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048])
    ap.add_argument("--caps", type=float, nargs="+", default=list(ev.CAPS))
    ap.add_argument("--cases", type=parse_case, nargs="+",
                    default=[parse_case(f"{d}:{c}") for d, c in ev.CASES],
                    help="dtype:codec, e.g. float16:hi8r")
    ap.add_argument("--passkey-contexts", type=int, nargs="+", default=None,
                    help="passkey prompt lengths (default: --contexts)")
    ap.add_argument("--prompts", type=int, default=10, help="passkey prompts per context")
    ap.add_argument("--protect-first", type=int, default=1, help="sink blocks never demoted")
    ap.add_argument("--protect-recent", type=int, default=2, help="recent blocks never demoted")
    ap.add_argument("--check-positions", type=int, default=4,
                    help="positions a layer compared with elastic_attention (0: no check)")
    ap.add_argument("--check-context", type=int, default=0,
                    help="tokens of the check (0: the smallest context)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    args = ap.parse_args(argv)
    for d, c in args.cases:
        for cap in args.caps:
            ev.check_case(d, c, cap)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = Llama.from_gguf(), Tokenizer.from_gguf()
    protect = dict(protect_first=args.protect_first, protect_recent=args.protect_recent)

    checks = []
    if args.check_positions:
        n = args.check_context or min(args.contexts + (args.passkey_contexts or []))
        ids = kjv_tokens(tok, n)
        below = [c for c in args.caps if 0 < c < 1]
        for d, c in args.cases:
            for cap in ([max(below)] if below else []) + ([1.0] if 1.0 in args.caps else []):
                spans = ev.base_spans(n, cap, ev.PAGE, **protect)
                err = ev.check_op(model, ids, spans, ev.DTYPES[d], c, args.check_positions)
                checks.append([n, d, c, cap, err])
                print("check", checks[-1], flush=True)
                if err > 2 ** -7:
                    raise AssertionError(f"the block-parallel evaluation disagrees with "
                                         f"elastic_attention ({d} {c} cap {cap}: {err:.2e})")

    def cases():
        for d, c in args.cases:
            for cap in args.caps:
                if cap == 0 and (d, c) != next(x for x in args.cases if x[0] == d):
                    continue                        # TARGET: once a dtype
                yield d, c, cap, ("TARGET" if cap == 0 else c)   # cap 0 reads no BASE

    ppl_rows, key_rows = [], []

    def record() -> Path:
        """Write the record of the rows so far; called after every row, so a stopped run
        keeps what it measured."""
        parts = [
            f"SmolLM2-135M-Instruct (GGUF, float32 weights, CPU, {torch.get_num_threads()} "
            f"threads); pages of {ev.PAGE} tokens; K/V stored in the TARGET dtype, BASE by the "
            f"codec. Caps below 1: the blocks kvops.runtime.Fidelity demotes (protect_first="
            f"{args.protect_first}, protect_recent={args.protect_recent}), as many pairs as keep "
            "BASE blocks <= cap x live blocks; cap 1: every block BASE. Exposure = BASE blocks / "
            "live blocks (at the last position, and the mean over positions). See "
            "examples/elastic_quality_eval.py for the method.",
        ]
        if checks:
            parts += ["", "Block-parallel evaluation vs torch.ops.kvops.elastic_attention over "
                      "pack_base_pairs pools (every layer, "
                      f"{args.check_positions} positions; max abs diff / max |out|):", "",
                      table(["context N", "dtype", "codec", "cap", "rel diff"],
                            [[a, b, c, f"{x:.2f}", f"{e:.2e}"] for a, b, c, x, e in checks])]
        if ppl_rows:
            parts += ["", "## Perplexity (KJV)", "",
                      table(["context N", "TARGET", "BASE codec", "cap", "exposure (last)",
                             "exposure (mean)", "perplexity", "vs TARGET (%)", "seconds"],
                            ppl_rows)]
        if key_rows:
            parts += ["", "## Passkey", "",
                      table(["context N", "TARGET", "BASE codec", "cap", "exposure (last)",
                             "prompts", "retrieved", "accuracy", "retrieved at depths", "seconds"],
                            key_rows)]
        record.body = "\n".join(parts)
        name = "elastic-quality" + (f"-{args.tag}" if args.tag else "")
        return write_record(RESULTS, name, record.body)

    for n in args.contexts:
        if "perplexity" in args.tasks:
            ids = kjv_tokens(tok, n)
            target = {}
            for d, c, cap, label in cases():
                t = time.perf_counter()
                spans = ev.base_spans(n, cap, ev.PAGE, **protect)
                ppl = ev.perplexity(model, ids, spans, ev.DTYPES[d], c)
                target.setdefault(d, ppl)
                last, mean = ev.exposure(spans)
                ppl_rows.append([n, d, label, f"{cap:.2f}", f"{last:.3f}", f"{mean:.3f}",
                                 f"{ppl:.4f}", f"{100 * (ppl / target[d] - 1):+.2f}",
                                 f"{time.perf_counter() - t:.0f}"])
                print(ppl_rows[-1], flush=True)
                record()
    for n in args.passkey_contexts or args.contexts:
        if "passkey" in args.tasks:
            for d, c, cap, label in cases():
                hits, last, secs = ev.passkey_hits(model, tok, n, args.prompts, d, c, cap,
                                                   **protect)
                key_rows.append([n, d, label, f"{cap:.2f}", f"{last:.3f}", args.prompts,
                                 len(hits), f"{len(hits) / args.prompts:.2f}",
                                 depth_ranges(hits, args.prompts), f"{secs:.0f}"])
                print(key_rows[-1], flush=True)
                record()

    print(record())
    print(record.body)


if __name__ == "__main__":
    main()
