"""Shared benchmark plumbing: graph-replay timing, byte accounting, result files.

Every GPU benchmark times CUDA-graph replays (launch overhead out of the number, as a serving
engine runs a decode step), reports p20/p50/p80 in microseconds, the achieved TB/s of the bytes
the op must move and the fraction of the measured ceiling, and writes one result file per run
to ``bench/results/`` (and to ``$OUT`` when set, for the device tool).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvops.evals.records import markdown_table as table  # noqa: F401  (the benchmarks' tables)
from kvops.evals.records import write_record

# Ceilings measured on the H200 here (a Triton streaming sum and a device copy): bytes per second.
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


def write_result(name: str, body: str) -> Path:
    """Write ``bench/results/<date>-<HHMM>-<name>.md`` (and a copy under $OUT) with the run's header."""
    return write_record(RESULTS, name, body)


def eager_times(fn, *, iters: int = 200, warmup: int = 10) -> tuple[float, float]:
    """``(host us, wall us)`` per eager call of ``fn``: host, the time a call takes to return
    (``iters`` calls back to back, no sync between them: the Python, dispatch and launch cost
    an eager caller pays); wall, the same loop up to the device finishing it (equal to host on a
    machine without CUDA)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6 / iters, (t2 - t0) * 1e6 / iters


SDPA_DECODE_BACKENDS = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                        ("efficient", SDPBackend.EFFICIENT_ATTENTION))


def best_sdpa_decode(dense):
    """The fastest SDPA backend on decode sets ``[(q [B, Hq, 1, D], k [B, Hkv, T, D], v)]``:
    ``(name, graph-replay us, run)`` with ``run(q, k, v)`` calling it, or None when no backend
    takes these tensors."""
    best = None
    for name, backend in SDPA_DECODE_BACKENDS:
        def run(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            run(*dense[0])
            torch.cuda.synchronize()
            t = time_graph([lambda d=d: run(*d) for d in dense])[1]
        except RuntimeError:
            continue
        if best is None or t < best[1]:
            best = (name, t, run)
    return best
