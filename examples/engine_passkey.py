"""Passkey through the serving engine: SmolLM2-135M-Instruct prompts (a 5-digit key hidden at a
swept depth of filler, asked for at the end; :func:`kvops.evals.passkey.passkey_cases`) served
by engine configurations, greedy; a prompt is retrieved when the first tokens the engine emits
are the key's. This is the far view as it is served: the prompt prefilled exactly through
``paged_prefill_attention``, the answer decoded by the configuration's decode step
(``kvrm-ret``: the window plus the far pages its queries choose, chosen at the first decode step
after the prefill; ``pager+merge``: the window alone; ``paged``: the whole context).

    python -m examples.engine_passkey --contexts 2048 4096 --prompts 20

Writes ``bench/results/<date>-<HHMM>-engine-passkey-<contexts>[-<tag>].md`` (and ``$OUT``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvops.engine.generate import generate_ids
from kvops.evals.passkey import depth_ranges, passkey_cases
from kvops.evals.records import markdown_table, write_record
from kvops.models import Llama, Tokenizer

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def engine_passkey(model, tok, n_tokens: int, config: str, prompts: int, *, window: int,
                   page_size: int, top_k: int, every: int, group: int) -> list[int]:
    """The indices of the prompts whose key ``config`` emits, served ``group`` at a time."""
    cases = passkey_cases(tok, n_tokens, prompts)
    options = {"window": window, "ret_top_k": top_k, "ret_every": every}
    hits = []
    for lo in range(0, prompts, group):
        batch = cases[lo:lo + group]
        width = max(len(a) for _, _, a in batch)
        outs = generate_ids(model, [p for _, p, _ in batch], width, config=config,
                            page_size=page_size, budget_options=options)
        hits += [lo + i for i, ((_, _, a), o) in enumerate(zip(batch, outs)) if o[:len(a)] == a]
    return hits


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--configs", nargs="+", default=["paged", "kvrm-ret", "pager+merge"])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=64, help="kvrm-ret: far pages chosen")
    ap.add_argument("--every", type=int, default=16, help="kvrm-ret: steps between choices")
    ap.add_argument("--group", type=int, default=10, help="prompts served together")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = Llama.from_gguf(), Tokenizer.from_gguf()
    rows = []
    for n in args.contexts:
        for config in args.configs:
            t = time.perf_counter()
            hits = engine_passkey(model, tok, n, config, args.prompts, window=args.window,
                                  page_size=args.page_size, top_k=args.top_k, every=args.every,
                                  group=args.group)
            rows.append([n, config, args.prompts, len(hits), f"{len(hits) / args.prompts:.2f}",
                         depth_ranges(hits, args.prompts), f"{time.perf_counter() - t:.0f}"])
            print(rows[-1], flush=True)
    body = (f"SmolLM2-135M-Instruct (GGUF, float32, CPU) served by the kvops engine, greedy; W "
            f"{args.window} (the arena configurations), pages of {args.page_size}; kvrm-ret: "
            f"{args.top_k} far pages ({args.top_k * args.page_size} tokens) chosen at the first "
            f"decode step and every {args.every} steps; {args.group} prompts served together. "
            "See examples/engine_passkey.py.\n\n"
            + markdown_table(["context N", "config", "prompts", "retrieved", "accuracy",
                              "retrieved at depths", "seconds"], rows))
    name = "engine-passkey-" + "-".join(map(str, args.contexts)) + \
        (f"-{args.tag}" if args.tag else "")
    print(write_record(RESULTS, name, body))
    print(body)


if __name__ == "__main__":
    main()
