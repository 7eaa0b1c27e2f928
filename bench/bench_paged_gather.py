"""KV-RM substrate benchmark: the merged gather on the GPU, and the pager's host side anywhere.

Three parts (``--parts``, all by default; ``gather`` needs CUDA and is skipped without it):

- ``gather``: ``paged_gather_merged`` against ``torch.index_select`` (K and V, same pages, same
  run) for trains of 1, 4 and 16 pages and one contiguous train, page sizes 16 and 64,
  Llama-3-8B KV heads (Hkv 8, D 128, fp16), moving 128 MiB per tensor per call; plus a
  decode-sized step (64 sessions x one page). TB/s counts read + write of K and V; the fraction
  is of the 4.25 TB/s copy ceiling. Times are CUDA-graph replays (p50, p20-p80 beside it).
- ``dma``: DMA regularity on a replayed step stream (the paper's Figure 6 a-b): requests from a
  trace (Azure CSV ``ContextTokens,GeneratedTokens`` or Mooncake JSONL ``input_length,
  output_length``, given with ``--trace``; a seeded synthetic stream by default) admitted into
  64 slots, prefilled, decoded one token per step and trimmed at EOS through Pager frames; each
  step's moves planned with and without merging. Reports groups per step and mean bytes per
  group.
- ``diagnose`` (not in the default set; CUDA): 1,024 trains of 128 KiB at random places, side by
  side, and one contiguous train, to split the 128 KiB trains' shortfall into the search and
  the access pattern (``bench_diagnose``); beside each, torch moving the same trains as whole
  rows (``index_select`` of 128 KiB rows, or one ``copy_``), what the layout allows torch.
- ``control``: host time per step of the frame's verbs, of the commit (transport hook with
  planning, table writes, the single upload) and of planning alone (timed in a second run),
  for 64 and 256 sessions with one new token each, median and p99 over 1,000 steps.

    python -m bench.bench_paged_gather                 # everything available here
    python -m bench.bench_paged_gather --quick         # smaller sizes, fewer steps
    python -m bench.bench_paged_gather --tune          # GPU: kernel launch-knob sweep
    python -m bench.bench_paged_gather --parts dma,control --trace AzureLLMInferenceTrace_conv.csv
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

import kvops  # noqa: F401  (registers torch.ops.kvops.*)
import kvops.runtime.transport as transport_mod
from bench.common import COPY_CEILING, rotation, table, tbps, time_graph, write_result
from kvops.runtime import Pager, Transport
from kvops.runtime.far_view import FarView

HKV, D = 8, 128
DTYPE = torch.float16


# -- gather ----------------------------------------------------------------------------------
def _train_sets(P: int, Q: int, n: int | None, gen: torch.Generator, sets: int,
                adjacent: bool = False):
    """``sets`` random train layouts moving Q pages: trains of n pages (None: one train), at
    random places in the pool or (``adjacent``) side by side from a random start."""
    out = []
    for _ in range(sets):
        if n is None:
            start = int(torch.randint(0, P - Q + 1, (1,), generator=gen))
            trains = torch.tensor([[start, 0, Q]], dtype=torch.int32)
        else:
            T = Q // n
            if adjacent:
                slots = int(torch.randint(0, P // n - T + 1, (1,), generator=gen)) + \
                    torch.arange(T)
            else:
                slots = torch.randperm(P // n, generator=gen)[:T]
            trains = torch.stack([slots * n, torch.arange(T) * n, torch.full((T,), n)], 1)
        src = torch.cat([torch.arange(s, s + c) for s, _, c in trains.tolist()])
        out.append((trains.to(torch.int32).cuda(), src.cuda()))
    return out


class _Pool:
    """A 1 GiB pool per tensor (at least 4x the move), output arenas for ``move_bytes`` per
    tensor, and the bytes a call moves (K and V, read and written)."""

    def __init__(self, S: int, move_bytes: int):
        self.S, self.page_bytes = S, S * HKV * D * 2
        self.Q = move_bytes // self.page_bytes
        self.P = max(4 * self.Q, (1 << 30) // self.page_bytes)
        self.k_cache = torch.randn(self.P, S, HKV, D, device="cuda", dtype=DTYPE)
        self.v_cache = torch.randn_like(self.k_cache)
        self.k_out = torch.empty(self.Q, S, HKV, D, device="cuda", dtype=DTYPE)
        self.v_out = torch.empty_like(self.k_out)
        self.nbytes = 4 * self.Q * self.page_bytes

    def sets(self, n: int | None, gen: torch.Generator, adjacent: bool = False):
        """Rotating train layouts (``_train_sets``) and their device ``num_trains``."""
        sets = _train_sets(self.P, self.Q, n, gen, rotation(2 * self.Q * self.page_bytes),
                           adjacent)
        return sets, torch.tensor([sets[0][0].shape[0]], dtype=torch.int32, device="cuda")

    def time_kernel(self, sets, num, **kw) -> tuple[float, float, float]:
        """p20/p50/p80 us of ``paged_gather_merged_fwd`` with launch knobs ``kw``, after
        checking one call's output."""
        from kvops.kernels.paged_gather_merged import paged_gather_merged_fwd

        fns = [lambda t=t: paged_gather_merged_fwd(self.k_cache, self.v_cache, t, num,
                                                   self.k_out, self.v_out, **kw)
               for t, _ in sets]
        return self._time(fns, sets)

    def time_op(self, sets, num) -> tuple[float, float, float]:
        """As :meth:`time_kernel`, through ``torch.ops.kvops.paged_gather_merged``."""
        fns = [lambda t=t: torch.ops.kvops.paged_gather_merged(
            self.k_cache, self.v_cache, t, num, self.k_out, self.v_out) for t, _ in sets]
        return self._time(fns, sets)

    def time_index_select(self, sets) -> tuple[float, float, float]:
        """The same pages through ``torch.index_select`` into the same arenas."""
        return self._time([lambda i=i: (torch.index_select(self.k_cache, 0, i, out=self.k_out),
                                        torch.index_select(self.v_cache, 0, i, out=self.v_out))
                           for _, i in sets], sets)

    def time_whole_trains(self, sets, n: int | None) -> tuple[float, float, float]:
        """The same trains moved by torch as whole rows: ``index_select`` over the pools viewed
        as rows of ``n`` pages (a train a row), or ``copy_`` of the one train (``n`` None)."""
        if n is None:
            starts = [int(t[0, 0]) for t, _ in sets]
            fns = [lambda a=a: (self.k_out.copy_(self.k_cache[a:a + self.Q]),
                                self.v_out.copy_(self.v_cache[a:a + self.Q])) for a in starts]
        else:
            rows = lambda c: c.view(c.shape[0] // n, -1)      # a train of n pages a row
            slots = [(t[:, 0] // n).long() for t, _ in sets]
            fns = [lambda i=i: (
                torch.index_select(rows(self.k_cache), 0, i, out=rows(self.k_out)),
                torch.index_select(rows(self.v_cache), 0, i, out=rows(self.v_out)))
                for i in slots]
        return self._time(fns, sets)

    def _time(self, fns, sets):
        fns[0]()
        src = sets[0][1]
        assert torch.equal(self.k_out, self.k_cache[src])
        assert torch.equal(self.v_out, self.v_cache[src])
        return time_graph(fns)


def _gather_rows(label: str, S: int, move_bytes: int, gen: torch.Generator) -> list[list]:
    pool = _Pool(S, move_bytes)
    rows = []
    for n in ((1,) if label == "step" else (1, 4, 16, None)):
        sets, num = pool.sets(n, gen)
        o20, o50, o80 = pool.time_op(sets, num)
        b20, b50, b80 = pool.time_index_select(sets)
        train_kib = (pool.Q if n is None else n) * pool.page_bytes // 1024
        rows.append([label, S, "all" if n is None else str(n), train_kib, pool.Q,
                     f"{o50:.1f} ({o20:.1f}-{o80:.1f})", tbps(pool.nbytes, o50),
                     tbps(pool.nbytes, o50) * 1e12 / COPY_CEILING,
                     f"{b50:.1f} ({b20:.1f}-{b80:.1f})", tbps(pool.nbytes, b50),
                     tbps(pool.nbytes, b50) * 1e12 / COPY_CEILING, b50 / o50])
    return rows


def bench_gather(quick: bool) -> str:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for S in (16, 64):
        rows += _gather_rows("bulk", S, (16 if quick else 128) << 20, gen)
        rows += _gather_rows("step", S, 64 * S * HKV * D * 2, gen)
        torch.cuda.empty_cache()
    headers = ["size", "S", "train pages", "train KiB", "pages", "merged us p50 (p20-p80)",
               "TB/s", "of ceiling", "index_select us p50 (p20-p80)", "TB/s", "of ceiling",
               "speedup"]
    return ("## Gather: paged_gather_merged vs torch.index_select\n\n"
            f"Hkv={HKV}, D={D}, fp16; bulk moves {(16 if quick else 128)} MiB per tensor, step "
            "moves 64 one-page trains; TB/s = K+V read+write bytes / p50; ceiling = "
            f"{COPY_CEILING / 1e12:.2f} TB/s copy.\n\n" + table(headers, rows) + "\n")


def bench_diagnose() -> str:
    """Where 128 KiB trains lose against one contiguous train: 1,024 trains of 4 pages (S 16,
    128 MiB per tensor) at random places and side by side (the same rows to search), and one
    train, each at the default grid and at 128 programs an SM (the default for 1,024 trains)."""
    from kvops.kernels._common import sm_count

    gen = torch.Generator().manual_seed(0)
    pool = _Pool(16, 128 << 20)
    grid = min(pool.Q * (pool.page_bytes // 4096), 128 * sm_count(pool.k_cache.device))
    rows = []
    for n, adjacent, label in ((4, False, "random"), (4, True, "adjacent"), (None, False, "one")):
        sets, num = pool.sets(n, gen, adjacent)
        for grid_label, kw in (("default", {}), ("128/SM", {"num_programs": grid})):
            t20, t50, t80 = pool.time_kernel(sets, num, **kw)
            rows.append([label, len(sets[0][0]), grid_label, f"{t50:.1f} ({t20:.1f}-{t80:.1f})",
                         tbps(pool.nbytes, t50)])
        t50 = pool.time_index_select(sets)[1]
        rows.append([label, len(sets[0][0]), "index_select", f"{t50:.1f}",
                     tbps(pool.nbytes, t50)])
        t20, t50, t80 = pool.time_whole_trains(sets, n)
        rows.append([label, len(sets[0][0]), "torch, a train a row" if n else "torch copy_",
                     f"{t50:.1f} ({t20:.1f}-{t80:.1f})", tbps(pool.nbytes, t50)])
    return ("## Where 128 KiB trains lose (S 16, 128 MiB per tensor)\n\n"
            + table(["trains", "rows", "launch", "us p50 (p20-p80)", "TB/s"], rows) + "\n")


def _tune_rows(S: int, ns: tuple, gen: torch.Generator) -> list[list]:
    from kvops.kernels._common import sm_count

    pool = _Pool(S, 128 << 20)
    units = pool.page_bytes // 4096
    sms = sm_count(pool.k_cache.device)
    rows = []
    for n in ns:
        sets, num = pool.sets(n, gen)
        for per_sm in (64, 128, 256):
            for fuse in (True, False):
                us = pool.time_kernel(sets, num, num_programs=min(pool.Q * units, per_sm * sms),
                                      fuse_max_trains=1 << 30 if fuse else 0)[1]
                rows.append([S, "all" if n is None else n, len(sets[0][0]), per_sm,
                             "one" if fuse else "two", us, tbps(pool.nbytes, us),
                             tbps(pool.nbytes, us) * 1e12 / COPY_CEILING])
    return rows


def bench_tune() -> str:
    """Sweep programs per SM and one launch vs two (fuse_max_trains) on 128 MiB of one-page,
    4-page (128 KiB at S 16) and one contiguous train; 4 KiB blocks and 8 warps (the settings
    of bench/results/2026-11-30-paged_gather-tune.md)."""
    gen = torch.Generator().manual_seed(1)
    rows = _tune_rows(16, (1, 4, None), gen)
    torch.cuda.empty_cache()
    rows += _tune_rows(64, (1, None), gen)
    return ("## Launch sweep (128 MiB per tensor, 4 KiB blocks, 8 warps)\n\n"
            "Defaults (default_programs_per_sm): one launch up to 1,024 trains, with 256 "
            "programs an SM up to 512 trains and 128 at 1,024; two launches with 64 beyond.\n\n"
            + table(["S", "train pages", "trains", "programs/SM", "launches", "us p50", "TB/s",
                     "of ceiling"], rows) + "\n")


# -- request streams -------------------------------------------------------------------------
def load_requests(path: str | None, limit: int, seed: int = 0) -> tuple[list[tuple[int, int]],
                                                                          str]:
    """(context tokens, generated tokens) per request, in arrival order."""
    if path is None:
        rng = np.random.default_rng(seed)
        ctx = np.clip(rng.lognormal(np.log(1000), 0.8, limit), 16, 8000).astype(int)
        gen = np.clip(rng.lognormal(np.log(128), 0.9, limit), 1, 1000).astype(int)
        return list(zip(ctx.tolist(), gen.tolist())), f"synthetic (seed {seed})"
    reqs = []
    with open(path) as fh:
        if path.endswith(".jsonl"):
            for line in fh:
                r = json.loads(line)
                reqs.append((int(r["input_length"]), int(r["output_length"])))
                if len(reqs) == limit:
                    break
        else:
            for r in csv.DictReader(fh):
                reqs.append((int(r["ContextTokens"]), int(r["GeneratedTokens"])))
                if len(reqs) == limit:
                    break
    return reqs, Path(path).name


def _replay(reqs, steps: int, copy_tail: bool, S: int, W: int, slots: int, max_ctx: int):
    """Drive a Pager + Transport through the request stream; per-step transport stats."""
    L = (max_ctx + 1024) // S
    pager = Pager(slots * L, S, slots, L)
    tr = Transport(pager, W, S * HKV * D * 2, copy_tail=copy_tail)
    queue = list(reversed(reqs))
    remaining: dict[int, int] = {}
    per_step = []
    admitted = 0
    for _ in range(steps):
        with pager.frame() as f:
            done = [k for k, left in remaining.items() if left == 0]
            for key in done:                    # EOS: the slot frees at this commit
                f.trim(key)
                del remaining[key]
            for key in remaining:
                f.reserve(key, 1)
                remaining[key] -= 1
            while queue and len(remaining) + len(done) < slots:
                ctx, out = queue.pop()
                f.reserve(admitted, min(ctx, max_ctx))
                remaining[admitted] = min(out, 1024)
                admitted += 1
        per_step.append(tr.last)
    return per_step, admitted


def bench_dma(trace: str | None, quick: bool) -> str:
    S, W, slots, max_ctx = 16, 1024, 64, 8192
    kib = S * HKV * D * 2 / 1024
    steps = 300 if quick else 2000
    reqs, source = load_requests(trace, 10000)
    rows = []
    for copy_tail, mode in ((True, "transport copies the tail"),
                            (False, "model writes new tokens through")):
        per_step, admitted = _replay(reqs, steps, copy_tail, S, W, slots, max_ctx)
        moves = np.array([s["moves"] for s in per_step], dtype=np.float64)
        groups = np.array([s["groups"] for s in per_step], dtype=np.float64)
        busy = moves > 0
        for name, g in (("unmerged", moves), ("merged", groups)):
            rows.append([mode, name, g.mean(), g[busy].mean() if busy.any() else 0.0,
                         int(busy.sum()), moves.sum() * kib / max(g.sum(), 1)])
    return ("## DMA regularity on a replayed step stream\n\n"
            f"Requests: {source}; {slots} slots, {steps} steps, {admitted} requests admitted, "
            f"context capped at {max_ctx}, outputs at 1024; S={S}, W={W} (a {W // S}-page ring "
            f"window per slot), page {kib:.0f} KiB per tensor, tau = 128 KiB. Unmerged is one "
            "descriptor per page; merged is paged_gather_merged's trains. When the transport "
            "copies the tail, each decode step moves every session's tail page; when the model "
            "writes new tokens through to the arena, only arrivals (whole windows) and "
            "copy-on-write remaps move.\n\n"
            + table(["mode", "descriptors", "groups per step", "per step that moved",
                     "steps that moved", "mean KiB per group"], rows) + "\n")


# -- control plane ---------------------------------------------------------------------------
def bench_control(quick: bool) -> str:
    """Wall time and thread CPU time (which leaves out preemption by other processes, the
    honest number on a shared host) per step; median and p99. Planning is timed in a second
    run of the same steps, so its timer does not add to the commit's numbers."""
    S, W = 16, 2048
    device = "cuda" if torch.cuda.is_available() else None
    steps = 200 if quick else 1000
    rows = []
    plan_times: list[float] = []
    plan = transport_mod.plan_packed        # the transport's planner (plan_trains semantics)

    def timed_plan(*args, **kwargs):
        t0 = time.thread_time()
        out = plan(*args, **kwargs)
        plan_times.append(time.thread_time() - t0)
        return out

    def q(xs, p):
        return float(np.quantile(np.array(xs) * 1e6, p)) if xs else "-"   # "-": nothing planned

    def run(pager, sessions, verbs, commits, commits_cpu):
        for _ in range(steps):
            t0 = time.perf_counter()
            f = pager.frame()
            for s in range(sessions):
                f.reserve(s, 1)
            c1 = time.thread_time()
            t1 = time.perf_counter()
            f.commit()
            t2 = time.perf_counter()
            c2 = time.thread_time()
            verbs.append(t1 - t0)
            commits.append(t2 - t1)
            commits_cpu.append(c2 - c1)

    for sessions, copy_tail, far in ((64, True, False), (256, True, False), (64, False, False),
                                     (256, False, False), (64, False, True), (256, False, True)):
        L = 512
        pager = Pager(sessions * 300, S, sessions, L, device=device)
        Transport(pager, W, S * HKV * D * 2, copy_tail=copy_tail)
        if far:                 # its hook edits new far chunks and 32 layers' selections
            FarView(pager, window_tokens=W, chunk_tokens=8 * S, cap=8, num_layers=32,
                    num_kv_heads=HKV, head_dim=D, device=device or "cpu")
        with pager.frame() as f:
            for s in range(sessions):
                f.reserve(s, 1000 + (s * 97) % 3000)
        verbs, commits, commits_cpu = [], [], []
        gc.collect()
        run(pager, sessions, verbs, commits, commits_cpu)
        plan_times.clear()
        transport_mod.plan_packed = timed_plan
        try:
            run(pager, sessions, [], [], [])
        finally:
            transport_mod.plan_packed = plan
        rows.append([sessions, ("copy tail" if copy_tail else "write-through")
                     + (" + far view" if far else ""),
                     q(verbs, 0.5), q(commits, 0.5), q(commits, 0.99),
                     q(commits_cpu, 0.5), q(commits_cpu, 0.99),
                     q(plan_times, 0.5), q(plan_times, 0.99)])
    load = os.getloadavg()
    return ("## Control plane: host time per step\n\n"
            f"One new token per session per step, {steps} steps; upload to "
            f"{device or 'none (host tables only)'}; S={S}, W={W}. The commit includes the "
            "transport hook (moves, planning, window bounds) and the single table upload. "
            "Planning is the transport's plan_packed (a merge check; plan_trains when moves "
            "continue one another), thread CPU time measured in a second run of as many "
            "steps; '-' when no step had moves to plan (write-through decode moves nothing). "
            "'+ far view': a FarView hook (32 layers, chunks of 8 pages, cap 8) attached. "
            f"Host load average at the end: {load[0]:.1f} (1 min) on {os.cpu_count()} CPUs; "
            "wall p99 shows preemption.\n\n"
            + table(["sessions", "transport", "verbs wall us p50", "commit wall p50",
                     "commit wall p99", "commit CPU p50", "commit CPU p99", "planning CPU p50",
                     "planning CPU p99"], rows) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, fewer steps")
    ap.add_argument("--parts", default="gather,dma,control")
    ap.add_argument("--trace", default=None, help="Azure CSV or Mooncake JSONL request trace")
    ap.add_argument("--tune", action="store_true", help="GPU: sweep the kernel's launch knobs")
    args = ap.parse_args()
    if args.tune:
        body = bench_tune()
        print(f"wrote {write_result('paged_gather-tune', body)}\n")
        print(body)
        return
    parts = args.parts.split(",")
    sections = []
    if "control" in parts:
        sections.append(bench_control(args.quick))
    if "dma" in parts:
        sections.append(bench_dma(args.trace, args.quick))
    for part, bench in (("gather", lambda: bench_gather(args.quick)),
                        ("diagnose", bench_diagnose)):
        if part in parts:
            if torch.cuda.is_available():
                sections.append(bench())
            else:
                print(f"{part}: skipped (needs CUDA)")
    if not sections:
        return
    body = "\n".join(sections)
    name = "paged_gather" + ("-diagnose" if parts == ["diagnose"] else "") + \
        ("" if torch.cuda.is_available() else "-cpu") + \
        (f"-{Path(args.trace).stem}" if args.trace else "") + ("-quick" if args.quick else "")
    path = write_result(name, body)
    print(f"wrote {path}\n")
    print(body)


if __name__ == "__main__":
    main()
