"""``python -m kvops`` (or ``kvops-demo``): the main job. Runs the attention-stack demo on the GPU
when present, else on the CPU, and fails loudly if kvops disagrees with dense attention."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvops", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps (default per device)")
    args = ap.parse_args(argv)
    from kvops.demo import run_demo

    result = run_demo(args.device, args.steps)
    tol = 2e-2 if result["dtype"] in ("bfloat16", "float16") else 1e-4
    if not result["max_rel_err"] <= tol:
        print(f"FAILED: kvops output differs from dense attention by {result['max_rel_err']:.2e} "
              f"(tolerance {tol:.0e})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
