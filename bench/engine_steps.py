"""Decode-step times of a replay, per configuration and batch: where one configuration's
steps cost more than another's.

Reads the ``replay.json`` that ``kvops replay`` writes and, for each configuration, takes the
steps that only decode (every computed token a decode) and groups them by the number of
decoding requests (1-8, 9-16, 17-32, 33-64, 65+): median wall time of the step, of its
scheduling and of its frame commit, of its device work and of the stream's gap before it
(CUDA replays; 0 elsewhere), and the steps' count; then the same medians against a
reference configuration's at the same group (``--ref``, default the first).

    python -m bench.engine_steps replay-out/replay.json
    python -m bench.engine_steps replay-out/replay.json --ref paged
    python -m bench.engine_steps replay-out/replay.json --slowest 8

``--slowest N`` adds, for each configuration, where its wall time went (the replay's span, the
steps' wall and device sums, and what the N slowest steps hold) and those N steps: when, what
they computed (tokens, decodes, running and waiting requests) and their wall, device and gap
times.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from bench.common import table

GROUPS = ((1, 8), (9, 16), (17, 32), (33, 64), (65, 1 << 30))


def decode_groups(steps: list[dict]) -> dict:
    """``{(lo, hi): {"n", "step_ms", "schedule_ms", "commit_ms"}}`` over the decode-only
    steps (medians, ms)."""
    out = {}
    for lo, hi in GROUPS:
        sel = [s for s in steps if s["decodes"] and s["tokens"] == s["decodes"]
               and lo <= s["decodes"] <= hi]
        if not sel:
            continue
        med = {f"{k}_ms": float(np.median([s.get(f"{k}_s", 0.0) for s in sel]) * 1e3)
               for k in ("step", "schedule", "commit", "device", "gap")}
        out[(lo, hi)] = {"n": len(sel), **med}
    return out


def report(result: dict, ref: str | None = None) -> str:
    configs = list(result["steps"])
    ref = ref or configs[0]
    if ref not in result["steps"]:
        raise ValueError(f"--ref: expected one of {', '.join(configs)}, got {ref!r}")
    groups = {c: decode_groups(result["steps"][c]) for c in configs}
    rows = []
    for c in configs:
        for g, v in groups[c].items():
            base = groups[ref].get(g)
            rows.append([c, f"{g[0]}-{g[1] if g[1] < 1 << 20 else ''}", v["n"], v["step_ms"],
                         v["schedule_ms"], v["commit_ms"], v["device_ms"], v["gap_ms"],
                         v["step_ms"] - base["step_ms"] if base else "",
                         v["step_ms"] / base["step_ms"] if base else ""])
    return (f"Decode-only steps by decoding requests, medians in ms; against `{ref}` at the "
            "same group; device and gap ms: the stream from the step's first work to its "
            "tokens back, and between the last step's end and its start (CUDA events; 0 on "
            "a CPU).\n\n"
            + table(["config", "decodes", "steps", "step ms", "schedule ms", "commit ms",
                     "device ms", "gap ms", f"step - {ref} ms", f"step / {ref}"], rows))


def slowest(result: dict, n: int) -> str:
    """Each configuration's wall-time account and its ``n`` slowest steps by wall time."""
    acct, rows = [], []
    for c, steps in result["steps"].items():
        if not steps:
            continue
        wall = [s["step_s"] for s in steps]
        top = sorted(range(len(steps)), key=lambda i: -wall[i])[:n]
        span = result["results"][c].get("duration_s", 0.0)
        acct.append([c, len(steps), span, sum(wall), sum(s.get("device_s", 0.0) for s in steps),
                     sum(s.get("gap_s", 0.0) for s in steps), sum(wall[i] for i in top),
                     float(np.median(wall)) * 1e3])
        for i in top:
            s = steps[i]
            rows.append([c, i, s["t"], s["tokens"], s["decodes"], s["running"], s["waiting"],
                         s["step_s"] * 1e3, s.get("device_s", 0.0) * 1e3,
                         s.get("gap_s", 0.0) * 1e3, s.get("path", "")])
    return ("Where the wall time went, seconds (span: the replay's duration; steps: the sum of "
            f"their wall times; device and gap: CUDA events, 0 on a CPU; top {n}: the slowest "
            f"{n} steps' wall):\n\n"
            + table(["config", "steps", "span s", "steps s", "device s", "gap s", f"top {n} s",
                     "median step ms"], acct)
            + f"\n\nThe {n} slowest steps of each configuration:\n\n"
            + table(["config", "step", "t s", "tokens", "decodes", "running", "waiting",
                     "wall ms", "device ms", "gap ms", "path"], rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("replay_json")
    ap.add_argument("--ref", default=None, help="the configuration to compare against")
    ap.add_argument("--slowest", type=int, default=0, metavar="N",
                    help="also the wall-time account and the N slowest steps of each config")
    args = ap.parse_args()
    with open(args.replay_json) as f:
        result = json.load(f)
    print(report(result, args.ref))
    if args.slowest:
        print()
        print(slowest(result, args.slowest))


if __name__ == "__main__":
    main()
