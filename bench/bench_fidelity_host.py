"""Host cost of the fidelity policy's transitions at the Llama-3-8B page geometry, on any
device (kvops.runtime.fidelity; issue 21's "fidelity ms/step").

K and V of ``layers`` layers as one allocation sliced into ``2 * layers`` caches of
``[P, 16, 8, D]`` bfloat16 (the e4m3 codec, as the elastic replay runs), ``B`` sessions of
``ctx`` tokens. A demotion step (``Fidelity.step`` with a shortage of ``pairs`` pages) and a
promotion step of the same pairs, each timed as ``step`` plus the frame's commit, under a
dispatch counter that records every torch op the policy issues (each one at least a launch or
a copy on a GPU; a ``kvops`` op is one kernel launch over every pair and cache of the batch)
and the ops that read a value back to the host (``aten._local_scalar_dense`` and friends: a
device sync on a GPU). ``python ms``: the step's CPU time on this thread less the CPU time
inside the ops, the policy's own host work (thread CPU time, so other processes on a shared
machine do not count); ``op ms``: the CPU time inside the ops (on the CPU the PyTorch
reference doing the byte work a GPU does asynchronously; on a GPU the launches); ``step wall
ms``: the step's wall time (on a GPU the critical path: a host sync or a pinning shows here);
``first wall ms``: the first step's, whose host slots are new (``--host-ahead 0``: the chunks
are pinned in it; later steps reuse the slots).
Each the fastest of its repetitions after a warm-up: ops and python ms from steps under the
counter, wall from steps without it (its Python per op is not the policy's).

    python -m bench.bench_fidelity_host                 # CPU: writes nothing, prints a table
    python -m bench.bench_fidelity_host --device cuda   # also writes a record in bench/results/
    python -m bench.bench_fidelity_host --device cuda --host-ahead 0   # first steps pin
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvops  # noqa: F401  (registers the ops)
from kvops.runtime import Pager
from kvops.runtime.fidelity import Fidelity

S, HKV = 16, 8
SYNC_OPS = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal", "allclose", "item")


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while active (by name), the ones that read a device value
    back to the host, and the seconds spent inside them."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.op_s = 0.0           # this thread's CPU time inside the ops
        self.op_wall = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        self.ops[name] += 1
        t0, w0 = time.thread_time(), time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.op_s += time.thread_time() - t0
        self.op_wall += time.perf_counter() - w0
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> int:
        return sum(n for name, n in self.ops.items()
                   if name.split("::")[-1].split(".")[0] in SYNC_OPS)

    @property
    def kvops(self) -> int:
        return sum(n for name, n in self.ops.items() if name.startswith("kvops::"))


def world(layers: int, B: int, ctx: int, pairs: int, D: int, device: str, hkv: int = HKV,
          **kw):
    """A pager of ``B`` sessions of ``ctx`` tokens (committed) and a Fidelity over ``layers``
    layers' K and V as one allocation; ``kw`` go to Fidelity."""
    blocks = ctx // S
    P = B * blocks + 2 * pairs + 8
    both = torch.zeros((2, layers, P, S, hkv, D), dtype=torch.bfloat16, device=device)
    caches = [*both[0].unbind(0), *both[1].unbind(0)]
    pager = Pager(P, S, B, blocks, device=device)
    fid = Fidelity(pager, caches, min_batch=pairs, protect_recent=2, reserve_decay=0.0,
                   max_promote=pairs, **{"host_ahead": 2 * pairs, **kw})
    assert fid._pool is not None
    with pager.frame() as f:
        for b in range(B):
            f.reserve(b, ctx)
    both.normal_()
    return pager, fid


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(pager, fid, need, device, count: bool):
    """One step of ``fid`` in a frame of its own: (the step's counts, the OpCounter with its
    ``cpu`` and ``wall`` seconds set); ``count=False`` runs it without the counter (whose
    Python per op would be in the wall time), leaving the op counts empty."""
    _sync(device)
    c = OpCounter()
    with c if count else contextlib.nullcontext():
        t0, w0 = time.thread_time(), time.perf_counter()
        with pager.frame() as f:
            got = fid.step(f, need=need)
        cpu, wall = time.thread_time() - t0, time.perf_counter() - w0
    _sync(device)
    c.cpu, c.wall = cpu, wall
    return got, c


def run(layers: int, B: int, ctx: int, pairs: int, D: int, device: str, reps: int = 7,
        host_ahead: int | None = None):
    """Demotion and promotion steps, ``reps`` of each: the first warms up, then counted ones
    (ops, Python) alternate with uncounted ones (wall). Returns the table rows and the steps."""
    kw = {} if host_ahead is None else {"host_ahead": host_ahead}
    pager, fid = world(layers, B, ctx, pairs, D, device, **kw)
    fid._host.wait()
    rows = {"demote": [], "promote": []}
    for rep in range(reps):
        count = rep % 2 == 1
        got, c = timed(pager, fid, pager.free_pages + pairs, device, count)
        rows["demote"].append((got["demoted"], c, count))
        got, c = timed(pager, fid, 0, device, count)
        rows["promote"].append((got["promoted"], c, count))
        fid.drain()
        with pager.frame() as f:                        # map the refined pages
            fid.step(f, need=pager.free_pages)
    out = []
    for kind, rs in rows.items():
        counted = [r for r in rs[1:] if r[2]]
        plain = [r for r in rs[1:] if not r[2]]
        n, c, _ = min(counted, key=lambda r: r[1].cpu - r[1].op_s)
        out.append([kind, layers, n, c.total, c.kvops, c.syncs,
                    min((r[1].cpu - r[1].op_s) * 1e3 for r in counted),
                    min(r[1].op_s * 1e3 for r in counted), min(r[1].wall * 1e3 for r in plain),
                    rs[0][1].wall * 1e3])
    return out, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--ops", action="store_true", help="print the ops of each step")
    ap.add_argument("--host-ahead", type=int, default=None,
                    help="Fidelity's host_ahead (default: twice the pairs; 0 pins inside the "
                         "steps that first use a chunk)")
    a = ap.parse_args(argv)
    cells = [(32, 16, 256, 16), (32, 16, 256, 100), (32, 32, 256, 200), (8, 16, 256, 100),
             (1, 16, 256, 100)]
    table = []
    for layers, B, ctx, pairs in cells:
        got, rows = run(layers, B, ctx, pairs, a.D, a.device, host_ahead=a.host_ahead)
        table += got
        if a.ops:
            for kind, rs in rows.items():
                print(kind, layers, pairs, dict(rs[1][1].ops))
    head = ["step", "layers", "pairs", "ops", "kvops ops", "host reads", "python ms",
            "op ms", "step wall ms", "first wall ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        lines.append("| " + " | ".join([*(str(x) for x in r[:6]),
                                        *(f"{x:.2f}" for x in r[6:])]) + " |")
    body = "\n".join(lines)
    if torch.device(a.device).type == "cuda":
        from bench.common import write_result
        ahead = "twice the pairs" if a.host_ahead is None else a.host_ahead
        write_result("fidelity-host", "## Fidelity host cost (bfloat16 e4m3, 2 caches a layer "
                     f"[P, {S}, {HKV}, {a.D}], host_ahead {ahead})\n\n" + body)
    print(body)


if __name__ == "__main__":
    main()
