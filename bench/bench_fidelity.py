"""GPU benchmark: the ElasticKV fidelity policy's transitions (kvops.runtime.fidelity).

Llama-3-8B-shaped pools (32 layers, K and V each: 64 caches of ``[P, 16, 8, 128]`` float16),
B sessions of ``ctx`` tokens; the caches either 64 separate allocations (a pack or refine call
each) or slices of one (one call for all, ``Fidelity``'s one-pool view). A demotion step
(``step`` with a shortage of ``pairs`` pages) packs on the current stream: its critical path
is the host time of ``step`` plus the frame's commit, and the device time of the packs
(events around the step). A promotion step issues ``pairs`` refinements on the side stream;
the host time of that step, and the side stream's time until the last refine is done, are
reported. GB/s: a demotion's device bytes (2 pages read, 1 page and the hi8 backing written,
a pair and cache) over its packs' time; a promotion's backing bytes (one page a pair and
cache, host to device) over the side stream's time, since that copy bounds it.

    python -m bench.bench_fidelity            # writes bench/results/<date>-<HHMM>-fidelity.md
"""

from __future__ import annotations

import itertools
import time

import torch

import kvops  # noqa: F401
from bench.common import table, write_result
from kvops.runtime import Pager
from kvops.runtime.fidelity import Fidelity

LAYERS, S, HKV, D = 32, 16, 8, 128


def run(B: int, ctx: int, pairs: int, one_pool: bool, reps: int = 5) -> list:
    blocks = ctx // S
    P = B * blocks + 2 * pairs + 8
    if one_pool:            # K and V of every layer: slices of one allocation
        caches = list(torch.randn(2 * LAYERS, P, S, HKV, D, device="cuda",
                                  dtype=torch.float16).unbind(0))
    else:
        caches = [torch.randn(P, S, HKV, D, device="cuda", dtype=torch.float16)
                  for _ in range(2 * LAYERS)]
    pager = Pager(P, S, B, blocks, device="cuda")
    fid = Fidelity(pager, caches, min_batch=pairs, protect_recent=2, reserve_decay=0.0,
                   max_promote=pairs)
    with pager.frame() as f:
        for b in range(B):
            f.reserve(b, ctx)
    page = S * HKV * D * 2
    rows = []
    for _ in range(reps):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        with pager.frame() as f:
            n = fid.step(f, need=pager.free_pages + pairs)["demoted"]
        host = (time.perf_counter() - t0) * 1e6
        e1.record()
        torch.cuda.synchronize()
        dev = e0.elapsed_time(e1) * 1e3
        moved = n * len(caches) * page * 4          # 2 pages read, 1 page + 1 page backing
        rows.append(["demote", B, ctx, n, host, dev, moved / dev / 1e3])
        side = fid._side
        s0 = torch.cuda.Event(enable_timing=True)
        s0.record(side)
        t0 = time.perf_counter()
        with pager.frame() as f:
            m = fid.step(f, need=0)["promoted"]
        host = (time.perf_counter() - t0) * 1e6
        s1 = torch.cuda.Event(enable_timing=True)
        s1.record(side)
        torch.cuda.synchronize()
        dev = s0.elapsed_time(s1) * 1e3
        h2d = m * len(caches) * page                # hi8 backing: one page of low bytes a pair
        rows.append(["promote (side stream)", B, ctx, m, host, dev, h2d / dev / 1e3])
        with pager.frame() as f:                     # map the refined pages
            fid.step(f, need=pager.free_pages)
    return rows


def main():
    rows = []
    for (B, ctx, pairs), one_pool in itertools.product(
            [(16, 4096, 16), (16, 4096, 64), (64, 2048, 256)], (False, True)):
        got = run(B, ctx, pairs, one_pool)
        for op in ("demote", "promote (side stream)"):
            sel = [r for r in got if r[0] == op][1:]            # the first is a warm-up
            rows.append([op, "one" if one_pool else "64", B, ctx, sel[0][3],
                         *(sorted(r[i] for r in sel)[len(sel) // 2] for i in (4, 5, 6))])
        del got
        torch.cuda.empty_cache()
    body = "\n".join([
        f"## Fidelity transitions (Llama-3-8B pools: {2 * LAYERS} caches [P, {S}, {HKV}, {D}] "
        "float16, hi8)", "",
        "Medians of 4 timed steps after a warm-up. host us: `step` plus the frame's commit; "
        "allocations: 64 separate caches, or one allocation sliced into them; "
        "device us: the packs (demotion, current stream; the backing's copy to host runs on "
        "the side stream) or the refines (promotion, side stream, after the backing's "
        "host-to-device copy); GB/s: demotion, 4 pages a pair and cache over the packs; "
        "promotion, the host-to-device backing (1 page a pair and cache).", "",
        table(["step", "allocations", "B", "ctx", "pairs", "host us", "device us", "GB/s"],
              rows)])
    write_result("fidelity", body)
    print(body)


if __name__ == "__main__":
    main()
