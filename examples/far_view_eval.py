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
- ``ret<K>+dense<n>[@<S>]`` (diagnostic): the retrieval far view with the first ``n`` layers
  dense, to tell whether the early layers' choice is what a retrieval misses.
- ``ret<K>[-every<N>]+decode[@<S>]`` (passkey and multikey): the retrieval far view as a serving
  engine runs it: the prompt prefilled densely, the answer decoded with the far view (the
  first decode step selecting); ``near+decode``, its control, decodes the answer over the
  window alone. Every other config attends its way at every position, the prompt's included.

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
which is how a cap below the chunk count is measured; for ``ret<K>[@<S>]`` it decodes through
Pager + FarRetrieval (:func:`sequential_nll_retrieval`: the runtime's summaries, selection and
far slots, which ``tests/test_far_view_policy.py`` checks equal to the block-parallel path).

Passkey: a 5-digit key in one sentence hidden at a swept depth of repeated filler text, asked
for at the end (chat format). A prompt counts as retrieved when greedy decoding would emit the
key's digits: each digit is the argmax given the prompt and the key's earlier digits, read from
one forward over prompt + key. The prompts share their beginning (chat head and the filler
before the key sentence): per configuration the deepest prompt runs in full and keeps every
layer's K/V, and each other prompt computes only the positions from where it departs from that
prompt (:func:`hidden_states_from`; ``dense`` then goes through :func:`attention_dense`).
Configurations that see the same slots at the prompt length (``far64`` and ``far128`` up to
8192 positions) are computed once and reported for both. The result lists the depths retrieved.

The evaluation itself lives in :mod:`kvops.evals.far_view` (configurations, attention paths,
perplexity, churn) and :mod:`kvops.evals.passkey` (passkey, multikey); this script is its
command line. Writes ``bench/results/<date>-<HHMM>-far_view-<task>-<contexts>[-sequential][-<tag>].md``
(and ``$OUT``). Run from the repo root.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from kvops.evals import far_view as ev
from kvops.evals.passkey import depth_ranges, multikey_hits, passkey_cases, passkey_hits
from kvops.evals.perplexity import kjv_tokens
from kvops.evals.records import markdown_table as table
from kvops.evals.records import write_record
from kvops.models import Llama, Tokenizer

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def write_result(name: str, body: str) -> Path:
    return write_record(RESULTS, name, body)


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return "CPU"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=["perplexity", "passkey", "multikey", "churn", "ranks"],
                    default="perplexity")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--configs", nargs="+",
                    default=["dense", "near", "far64", "far64-nobias", "far128", "far128-nobias"])
    ap.add_argument("--prompts", type=int, default=50,
                    help="passkey prompts per length; multikey: trials per length")
    ap.add_argument("--needles", type=int, default=4, help="multikey: keys per context")
    ap.add_argument("--prompt-ids", type=int, nargs="+", default=None,
                    help="ranks: which of the passkey prompts (0: depth 0; default all)")
    ap.add_argument("--sequential", action="store_true",
                    help="perplexity of far and ret configs by token-by-token decode through "
                         "Pager + FarView or FarRetrieval (any cap; slow)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    args = ap.parse_args(argv)
    for c in args.configs:
        ev.parse_config(c)
        if ev.decode_only(c) and args.task not in ("passkey", "multikey"):
            ap.error(f"--configs {c}: a +decode config decodes a prompt's answer; it runs on "
                     f"--task passkey or multikey only")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = Llama.from_gguf(device=args.device), Tokenizer.from_gguf()
    worst = ev.check_paths(model, kjv_tokens(tok, 1100).to(args.device), args.configs)
    print(f"banded vs kvops-op attention, layer 0, 1100 tokens: max abs diff {worst:.2e}")
    if worst > 1e-4:
        raise AssertionError(f"the banded evaluation disagrees with the kvops ops ({worst:.2e})")
    rows, notes = [], []
    for n in args.contexts:
        if args.task == "perplexity":
            ids = kjv_tokens(tok, n).to(args.device)
            for c in args.configs:
                t = time.perf_counter()
                mode, cap, bias, sink = ev.parse_config(c)
                if args.sequential and mode == "far" and not sink:
                    c += " (sequential)"
                    ppl = math.exp(ev.sequential_nll(model, ids, cap, bias) / (n - 1))
                elif args.sequential and mode == "ret" and ev.retrieval_every(c) == 1:
                    page = ev.retrieval_page(c)
                    c += " (sequential)"
                    nll = ev.sequential_nll_retrieval(model, ids, cap, page=page)
                    ppl = math.exp(nll / (n - 1))
                else:
                    ppl = ev.perplexity(model, ids, c)
                rows.append([n, c, f"{ppl:.3f}", time.perf_counter() - t])
                print(rows[-1], flush=True)
        elif args.task == "churn":
            ids = kjv_tokens(tok, n).to(args.device)
            for c in args.configs:
                mode, cap, _, _ = ev.parse_config(c)
                if mode != "ret":
                    continue
                t = time.perf_counter()
                for lag, share in ev.selection_churn(model, ids, cap,
                                                     page=ev.retrieval_page(c)).items():
                    rows.append([n, c, lag, f"{share:.3f}", f"{time.perf_counter() - t:.0f}"])
                    print(rows[-1], flush=True)
        elif args.task == "ranks":
            cases = passkey_cases(tok, n, args.prompts, spans=True)
            for c in args.configs:
                mode, cap, _, _ = ev.parse_config(c)
                if mode != "ret":
                    continue
                for i in args.prompt_ids if args.prompt_ids is not None else range(len(cases)):
                    depth, prompt, answer, span = cases[i]
                    ids = torch.tensor(prompt + answer, device=args.device)
                    at = range(len(prompt) - 1, len(prompt) + len(answer) - 1)
                    r = ev.needle_page_ranks(model, ids, span, at, cap, ev.retrieval_page(c))
                    far = r[0]["far_pages"]
                    ranks = [x["best_bound_rank"] for x in r]
                    summed = [x["summed_rank"] for x in r]
                    shown = lambda v, far=far: " ".join("w" if x >= far else str(x)  # noqa: E731
                                                        for x in v)
                    rows.append([n, c, f"{depth:.2f}", far,
                                 f"{sum(x['chosen'] > 0 for x in r)}/{len(r)}",
                                 f"{sum(x['span_far'] > 0 and x['chosen'] == x['span_far'] for x in r)}"
                                 f"/{len(r)}",
                                 " ".join(f"{x['chosen']}/{x['span_far']}" for x in r),
                                 int(torch.tensor(ranks).median()),
                                 int(torch.tensor(summed).median()),
                                 shown(ranks), shown(summed)])
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
    if args.task == "ranks":
        notes.append("ranks: 0 is the top page; w: the key sentence is inside every answer "
                     "position's window (not far).")
        head = ["context N", "config", "depth", "far pages", "layers choosing a key page",
                "layers choosing every key page", "key pages chosen / far by layer",
                "median rank (best bound)", "median rank (summed)",
                "best-bound rank by layer", "summed rank by layer"]
    if args.task == "multikey":
        head = ["context N", "config", "trials", "keys each", "keys answered", "accuracy",
                "trials with every key", "answered per key (shallow to deep)", "seconds"]
    body = "\n".join([
        f"SmolLM2-135M-Instruct (GGUF, float32, {device_name(args.device)}). Near window "
        f"W={ev.WINDOW}, pages of {ev.PAGE}, "
        f"sv_chunk {ev.CHUNK}; far<cap> = window + far-chunk summaries (log-count bias unless "
        "-nobias); near = window only; ret<K> = window + the K far pages (of 16 tokens) "
        "far_page_select chooses for each query (half by the best key bound over the heads, "
        "half by the bounds summed over them), exact, bias 0 (-every<N>: selection every N "
        "positions; @<S>: window, bounds and pages of S tokens instead; +decode: the prompt "
        "prefilled densely and only the answer decoded with the far view, as an engine serves "
        "it). See "
        "examples/far_view_eval.py for the method.",
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
