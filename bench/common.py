"""Shared benchmark plumbing: graph-replay timing, byte accounting, result files.

Every GPU benchmark times CUDA-graph replays (launch overhead out of the number, as a serving
engine runs a decode step), reports p20/p50/p80 in microseconds, the achieved TB/s of the bytes
the op must move and the fraction of the measured ceiling, and writes one result file per run
to ``bench/results/`` (and to ``$OUT`` when set, for the device tool).
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

# Ceilings measured on the H200 here (see DEVELOPERS.md): bytes per second.
READ_CEILING = 4.65e12   # streaming read (a Triton sum)
COPY_CEILING = 4.25e12   # device-to-device copy, read + write counted
RESULTS = Path(__file__).resolve().parent / "results"


def time_graph(fn, *, warmup: int = 3, iters: int = 20, inner: int | None = None,
               target_ms: float = 2.0) -> tuple[float, float, float]:
    """p20, p50, p80 of one call in microseconds, from CUDA-graph replays.

    ``fn`` is a callable or a list of callables (one per rotating input set, so data larger than
    L2 is streamed from memory as in a real step); the graph holds ``inner`` calls cycling
    through them (chosen so a replay lasts about ``target_ms``), each replay is timed with
    events, and the per-call time is replay / inner.
    """
    fns = fn if isinstance(fn, (list, tuple)) else [fn]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if inner is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(10):
            fns[i % len(fns)]()
        end.record()
        torch.cuda.synchronize()
        per_call_ms = max(start.elapsed_time(end) / 10, 1e-3)
        inner = int(min(max(target_ms / per_call_ms, len(fns)), 400))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(inner):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    del graph
    times.sort()
    pick = lambda f: times[min(int(f * len(times)), len(times) - 1)]
    return pick(0.2), pick(0.5), pick(0.8)


def rotation(nbytes: int, l2_multiple: float = 4.0, l2_bytes: int = 50 * 2**20) -> int:
    """How many input sets to rotate through so that one pass over them exceeds the L2 cache
    several times (the H200 has 50 MiB of L2)."""
    return max(1, min(32, int(-(-l2_multiple * l2_bytes // max(nbytes, 1)))))


@triton.jit
def _read_kernel(X, Out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Sum ``ITERS`` blocks of int32 a program: reads its bytes, writes one word."""
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in tl.range(0, ITERS, num_stages=3):
        o = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(X + o, mask=o < n, other=0)
    tl.store(Out + pid, tl.sum(acc, 0))


def read_floor_us(nbytes: int) -> float:
    """Median us of a kernel that only reads ``nbytes`` (contiguous, summed; best of four launch
    shapes), timed as every benchmark here is: what any op that must read those bytes takes at
    least, a launch's fixed cost included. At small sizes the fixed cost is a visible share:
    B 1 x 16k of Llama-3-8B K/V (64 MiB) reads in 16.8 us, half of it in 9.2 (1.82x)."""
    n = -(-nbytes // 4)
    bufs = [torch.ones(n, dtype=torch.int32, device="cuda") for _ in range(rotation(nbytes))]
    best = float("inf")
    for block, iters, warps in ((2048, 1, 4), (4096, 1, 4), (2048, 8, 4), (4096, 4, 8)):
        grid = triton.cdiv(n, block * iters)
        out = torch.empty(grid, dtype=torch.int32, device="cuda")
        launch = functools.partial(_read_kernel[(grid,)], Out=out, n=n, BLOCK=block,
                                   ITERS=iters, num_warps=warps)
        best = min(best, time_graph([functools.partial(launch, b) for b in bufs])[1])
    return best


def tbps(nbytes: float, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e12


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table with right-aligned columns."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)


def _commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=RESULTS.parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=RESULTS.parent).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("KVOPS_COMMIT", "unknown")


def write_result(name: str, body: str) -> Path:
    """Write ``bench/results/<date>-<name>.md`` (and a copy under $OUT) with the run's header."""
    gpu = (torch.cuda.get_device_name() if torch.cuda.is_available()
           else f"none (CPU run, {platform.machine()}, {os.cpu_count()} cores)")
    header = "\n".join([
        f"# {name}",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- gpu: {gpu}",
        f"- commit: {os.environ.get('KVOPS_COMMIT') or _commit()}",
        f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}",
        f"- command: `{' '.join(shlex.quote(a) for a in getattr(sys, 'orig_argv', sys.argv))}`",
        "",
    ])
    text = header + body.rstrip() + "\n"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    path = RESULTS / f"{stamp}-{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / path.name).write_text(text)
    return path


def eager_times(fn, *, iters: int = 200, warmup: int = 10) -> tuple[float, float]:
    """``(host us, wall us)`` per eager call of ``fn``: host, the time a call takes to return
    (``iters`` calls back to back, no sync between them: the Python, dispatch and launch cost
    an eager caller pays); wall, the same loop up to the device finishing it."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6 / iters, (t2 - t0) * 1e6 / iters
