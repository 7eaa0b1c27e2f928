"""GPU benchmark: the decode ops over real models' head configs against the best SDPA backend.

Eight head configs (Hq/Hkv, D 128 unless given): Llama-3-8B 32/8, Qwen2.5-7B 28/4, a 70B model
at TP 8 8/1, MHA 32/32, Qwen3-32B 64/8, 8/2, Gemma-style 8/4 at D 256, Phi-3 32/32 at D 96;
five shapes B x context: 1x8k, 4x32k, 16x4k, 64x2k, 128x1k; bf16, full windows / sequences.
Per cell: ``static_sliding_attention`` and ``elastic_attention`` (native path, pages of 16)
in CUDA-graph replay and eager (wall us a call), the best of SDPA's cuDNN, flash and efficient
backends over the same K/V in [B, Hkv, T, D], and the ratio best-SDPA / ours (>= 1: ours
faster). ``--explore`` also times launch variants of the cells under ``--goal`` and prints the
best, which is how a launch rule is fixed from data (docs/tuning.md).

    python3 -m bench.bench_heads                  # full sweep, writes bench/results/
    python3 -m bench.bench_heads --quick          # the weak-cell subset
    python3 -m bench.bench_heads --explore        # plus launch variants where a cell loses
"""

from __future__ import annotations

import argparse
import time

import torch

import kvops  # noqa: F401
from bench.common import (
    READ_CEILING,
    best_sdpa_decode,
    eager_times,
    rotation,
    table,
    tbps,
    time_graph,
    write_result,
)
from kvops.kernels._common import device_props
from kvops.kernels.elastic_attention import elastic_attention_fwd, elastic_launch
from kvops.kernels.static_sliding_attention import sliding_launch, static_sliding_attention_fwd

HEADS = [("llama3-8b", 32, 8, 128), ("qwen2.5-7b", 28, 4, 128), ("70b-tp8", 8, 1, 128),
         ("mha", 32, 32, 128), ("qwen3-32b", 64, 8, 128), ("8/2", 8, 2, 128),
         ("gemma-d256", 8, 4, 256), ("phi3-d96", 32, 32, 96)]
SHAPES = [(1, 8192), (4, 32768), (16, 4096), (64, 2048), (128, 1024)]
QUICK = [("70b-tp8", 128, 1024), ("8/2", 128, 1024), ("llama3-8b", 128, 1024),
         ("70b-tp8", 64, 2048), ("gemma-d256", 128, 1024), ("phi3-d96", 16, 4096),
         ("mha", 1, 8192), ("qwen2.5-7b", 4, 32768), ("qwen2.5-7b", 16, 4096)]
S = 16
# launch variants (block_n, splits, stages, warps) tried by --explore, likeliest first
STATIC_VARIANTS = [(64, 2, 3, 4), (64, 2, 2, 4), (64, 1, 3, 4), (64, 4, 3, 4), (128, 2, 3, 4),
                   (128, 1, 3, 4), (32, 4, 3, 4), (64, 4, 2, 4), (32, 8, 3, 4)]
ELASTIC_VARIANTS = [(16, 2, 5, 1), (16, 2, 3, 1), (16, 1, 5, 1), (16, 4, 5, 1), (16, 8, 5, 1),
                    (128, 2, 5, 4), (64, 2, 5, 4), (32, 4, 5, 1), (64, 1, 5, 4), (128, 1, 3, 4),
                    (32, 2, 4, 2)]


def make_sets(B, T, Hq, Hkv, D, dtype, n):
    sets = []
    for _ in range(n):
        q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, T, Hkv, D, device="cuda", dtype=dtype)
        v = torch.randn(B, T, Hkv, D, device="cuda", dtype=dtype)
        sets.append((q, k, v))
    return sets


def best_sdpa(sets, Hq):
    """(name, graph us, eager wall us) of the fastest SDPA backend over the sets' K/V."""
    dense = [(q.unsqueeze(2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
             for q, k, v in sets]
    best = best_sdpa_decode(dense)
    if best is None:
        return None
    name, t, run = best
    return name, t, eager_times(lambda: run(*dense[0]), iters=200, warmup=10)[1]


def paged(sets):
    """The same K/V as a paged pool (pages of S, sequence b's blocks contiguous) per set."""
    out = []
    for q, k, v in sets:
        B, T, Hkv, D = k.shape
        L = T // S
        kc, vc = k.reshape(B * L, S, Hkv, D), v.reshape(B * L, S, Hkv, D)
        table_ = torch.arange(B * L, dtype=torch.int32, device="cuda").view(B, L)
        seq = torch.full((B,), T, dtype=torch.int32, device="cuda")
        out.append((q, kc, vc, table_, seq))
    return out


def sliding_fns(sets, **knobs):
    B, T = sets[0][1].shape[:2]
    ws = torch.zeros(B, dtype=torch.int32, device="cuda")
    wl = torch.full((B,), T, dtype=torch.int32, device="cuda")
    if knobs:
        return [lambda s=s: static_sliding_attention_fwd(s[0], s[1], s[2], ws, wl, **knobs)
                for s in sets]
    return [lambda s=s: torch.ops.kvops.static_sliding_attention(s[0], s[1], s[2], ws, wl)
            for s in sets]


def elastic_fns(psets, **knobs):
    if knobs:
        return [lambda p=p: elastic_attention_fwd(*p, **knobs) for p in psets]
    return [lambda p=p: torch.ops.kvops.elastic_attention(*p) for p in psets]


def explore(kind, sets, psets, t_best_sdpa, budget_s):
    """Time launch variants of one op on one cell; returns [(us, knobs)] best first."""
    found, t0 = [], time.perf_counter()
    if kind == "static":
        grid = STATIC_VARIANTS
        make = lambda bn, sp, st, w: sliding_fns(sets, block_n=bn, num_splits=sp, num_stages=st,
                                                 num_warps=w)
    else:
        grid = ELASTIC_VARIANTS
        make = lambda bn, sp, st, w: elastic_fns(psets, block_n=bn, num_splits=sp,
                                                 num_stages=st, num_warps=w)
    for knobs in grid:
        if time.perf_counter() - t0 > budget_s:
            break
        try:
            t = time_graph(make(*knobs), iters=10)[1]
        except Exception as e:  # noqa: BLE001 - a variant that cannot launch is skipped
            print(f"  {kind} {knobs}: {type(e).__name__}", flush=True)
            continue
        found.append((t, knobs))
    found.sort()
    return [(t, k, t_best_sdpa / t) for t, k in found[:3]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the weak-cell subset only")
    ap.add_argument("--explore", action="store_true", help="launch variants of losing cells")
    ap.add_argument("--goal", type=float, default=0.95)
    ap.add_argument("--explore-budget", type=float, default=12.0, help="seconds a cell and op")
    ap.add_argument("--no-elastic", action="store_true")
    args = ap.parse_args()
    dtype = torch.bfloat16
    heads = {h[0]: h for h in HEADS}
    cells = ([(heads[n], B, T) for n, B, T in QUICK] if args.quick
             else [(h, B, T) for h in HEADS for B, T in SHAPES])
    props = device_props(torch.device("cuda"))
    rows, notes = [], []
    for (name, Hq, Hkv, D), B, T in cells:
        t_start = time.perf_counter()
        nbytes = 2 * B * T * Hkv * D * 2
        sets = make_sets(B, T, Hq, Hkv, D, dtype, rotation(nbytes))
        sdpa = best_sdpa(sets, Hq)
        t_sdpa = sdpa[1] if sdpa else float("nan")
        ours = sliding_fns(sets)
        t_s = time_graph(ours)[1]
        e_s = eager_times(ours[0], iters=200, warmup=10)[1]
        lp = sliding_launch(B, Hkv, T, D, 2, 0, props)
        line = [name, Hq, Hkv, D, B, T, sdpa[0] if sdpa else "n/a", t_sdpa,
                sdpa[2] if sdpa else float("nan"), t_s, e_s, t_sdpa / t_s,
                tbps(nbytes, t_s) * 1e12 / READ_CEILING,
                f"{lp.block_n}/{lp.splits}/{lp.stages}/{lp.warps}"]
        psets = None
        if not args.no_elastic:
            psets = paged(sets)
            efns = elastic_fns(psets)
            t_e = time_graph(efns)[1]
            e_e = eager_times(efns[0], iters=200, warmup=10)[1]
            le = elastic_launch(0, B, Hkv, Hq // Hkv, T // S, S, D, 2, props)
            line += [t_e, e_e, t_sdpa / t_e,
                     f"{le.block_n}/{le.splits}/{le.stages}/{le.warps}"]
        rows.append(line)
        print(" | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in line),
              f"({time.perf_counter() - t_start:.1f} s)", flush=True)
        if args.explore and sdpa:
            for kind, ratio in (("static", line[11]),) + ((("elastic", line[16]),)
                                                         if psets else ()):
                if ratio < args.goal:
                    best = explore(kind, sets, psets, t_sdpa, args.explore_budget)
                    note = (f"{name} B{B}x{T} {kind} x{ratio:.2f}: best variants "
                            + "; ".join(f"{k} {t:.1f} us x{r:.2f}" for t, k, r in best))
                    notes.append(note)
                    print("  " + note, flush=True)
        del sets, psets
        torch.cuda.empty_cache()
    headers = ["heads", "Hq", "Hkv", "D", "B", "T", "sdpa", "sdpa us", "sdpa eager us",
               "static us", "static eager us", "static x sdpa", "static of ceil",
               "static bn/sp/st/w"]
    if not args.no_elastic:
        headers += ["elastic us", "elastic eager us", "elastic x sdpa", "elastic bn/sp/st/w"]
    text = table(headers, rows)
    worst = min(r[11] for r in rows)
    body = ("bf16, full windows; graph-replay medians (us), eager = wall us a call; "
            "x sdpa = best SDPA backend / ours.\n\n" + text
            + f"\n\nworst static x sdpa: {worst:.3f}\n")
    if not args.no_elastic:
        body += f"worst elastic x sdpa: {min(r[16] for r in rows):.3f}\n"
    if notes:
        body += "\nLaunch variants (block_n, splits, stages, warps):\n\n" + "\n".join(
            f"- {n}" for n in notes) + "\n"
    path = write_result("heads" + ("-quick" if args.quick else ""), body)
    print(body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
