"""Tensor parallelism at world size 1: the replay through the distributed path (the model sharded
over one rank with its collectives, rank 0's engine broadcasting its step plans, the ranks'
checks) against the plain replay, on the same requests; NCCL on CUDA, gloo on a CPU.

The distributed path must give the same tokens (a group of one sums nothing, so the logits
are the plain ones bit for bit), and costs what its collectives and plan broadcasts cost per
step. The table gives, per configuration: whether the tokens are equal, the requests whose
outputs are equal and the earliest and median first differing position among the others (a
wrong computation differs at the first tokens; a rounding difference under random weights
flips a near-tie somewhere later), the median wall time of a decode-only step in both, and the
re-captures of the distributed run (zero: its CUDA graphs hold the NCCL collectives). Both runs are driven
by the modeled clock by default (``--clock model``), so they schedule the same steps however
fast each runs: on the wall clock the slower distributed path admits arrivals into other
batches, and another batch shape is another GEMM, whose bf16 rounding flips near-ties of
random weights.

    python -m bench.bench_tp                  # CUDA: random Llama-3-8B (bf16), 16 requests
    python -m bench.bench_tp --model smollm2-random --max-requests 32
"""

from __future__ import annotations

import argparse
import gc
import os

import numpy as np
import torch
import torch.distributed as dist

from bench.common import table, write_result
from kvops.engine import distributed
from kvops.engine.replay import ReplaySettings, run


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two token lists differ (the shorter length if one is the
    other's prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def decode_step_ms(steps: list[dict]) -> float:
    """Median wall time (ms) of the steps that computed only decodes (one token a request):
    what the distributed path's collectives and plan broadcasts add to, on either clock."""
    ms = [1e3 * s["step_s"] for s in steps if s["tokens"] and s["tokens"] == s["decodes"]]
    return round(float(np.median(ms)), 2) if ms else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: llama3-8b on CUDA, tiny on a CPU")
    ap.add_argument("--configs", default="static,pager+merge,kvrm,paged")
    ap.add_argument("--max-requests", type=int, default=16)
    ap.add_argument("--length-scale", type=float, default=None,
                    help="default: 0.25 on CUDA, 0.03 on a CPU")
    ap.add_argument("--name", default="tp1-distributed-path")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    ap.add_argument("--no-graphs", action="store_true", help="CUDA: decode eagerly in both runs")
    ap.add_argument("--clock", choices=["model", "wall"], default="model",
                    help="the replays' driving clock (model: the same steps in both runs)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    kw = dict(model=args.model or ("llama3-8b" if cuda else "tiny"),
              configs=tuple(c for c in args.configs.split(",") if c),
              max_requests=args.max_requests,
              length_scale=args.length_scale or (0.25 if cuda else 0.03), device=str(device),
              dtype=args.dtype, graphs=False if args.no_graphs else None, clock=args.clock)
    settings = ReplaySettings.for_device(device, **kw)
    plain = run(settings, progress=False)
    _free(device)
    os.environ["MASTER_PORT"] = str(distributed.free_port())
    tp = distributed.init(1, rank=0, device=str(device))
    try:
        dist_res = run(settings, progress=False, tp=tp)
    finally:
        dist.destroy_process_group()
    rows, same_all = [], True
    for name in settings.configs:
        a, b = plain["results"][name], dist_res["results"][name]
        same = plain["tokens"][name] == dist_res["tokens"][name]
        same_all &= same
        firsts = sorted(first_difference(x, y) for x, y in
                        zip(plain["tokens"][name], dist_res["tokens"][name]) if x != y)
        where = f"{firsts[0]} / {firsts[len(firsts) // 2]}" if firsts else "-"
        rows.append([name, a["finished"], "yes" if same else "NO",
                     f"{len(plain['tokens'][name]) - len(firsts)}/{len(plain['tokens'][name])}",
                     where, decode_step_ms(plain["steps"][name]),
                     decode_step_ms(dist_res["steps"][name]), b["recaptures"]])
    body = (f"{plain['model']}, {plain['dtype']}, {settings.max_requests} requests at lengths x "
            f"{settings.length_scale}, {args.clock} clock; distributed path: tp=1 over "
            f"{'NCCL' if cuda else 'gloo'} (plans on gloo)\n\n" + table(
                ["config", "finished", "same tokens", "equal requests",
                 "first difference min / median", "plain decode step p50 ms (wall)",
                 "tp=1 decode step p50 ms (wall)", "tp=1 recaptures"], rows))
    print(body)
    if cuda:                                  # results files hold GPU runs only
        print(f"(written: {write_result(args.name, body)})")
    return 0 if same_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
