"""The replay kernel's own host cost (``kvops/csrc/replay.cpp``), with its launches dropped.

A replayed call is torch's Python call into the dispatcher, the kernel's signature and recipe
lookup, the output allocations, the parameter packing and ``cuLaunchKernelEx``. This bench
times all of it but the launch, on CPU tensors of two test ops given recipes by hand (the
kernel's dry mode 2 drops each launch): one shaped like static_sliding_attention's call (nine
arguments, two outputs, one launch of 27 parameters), one like pack_base_pairs' (four
arguments, no output, one launch), beside a Python kernel that returns the same two outputs
(the floor of the path the replay replaces) and two one-line aten calls. The GPU adds the
launches and its allocator; ``bench/bench_eager.py`` times the whole call there.

    python3 -m bench.bench_replay_host     # any machine with a C++ compiler; writes a results file
"""

from __future__ import annotations

import torch

from bench.common import eager_times
from kvops.ops import _replay
from kvops.ops._replay import ARG, OUT, VAL

ITERS, ROUNDS = 20000, 5


def _best_us(fn) -> float:
    return min(eager_times(fn, iters=ITERS, warmup=200)[0] for _ in range(ROUNDS))


def rows() -> list:
    _replay.build()
    cxx = _replay.module()
    lib = torch.library.Library("kvops_replay_bench", "DEF")
    attn = ("(Tensor q, Tensor k, Tensor v, Tensor ws, Tensor wl, Tensor? fk=None, "
            "Tensor? fv=None, Tensor? fb=None, float? scale=None) -> (Tensor, Tensor)")
    lib.define("attn" + attn)
    lib.define("python_attn" + attn)
    lib.define("pack(Tensor(a!) c, Tensor p, Tensor(b!) b, str? codec=None) -> ()")

    def python_attn(q, k, v, ws, wl, fk=None, fv=None, fb=None, scale=None):
        return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)

    lib.impl("python_attn", python_attn, "CPU")
    q = torch.randn(4, 32, 128, dtype=torch.bfloat16)
    k = torch.randn(4, 512, 8, 128, dtype=torch.bfloat16)
    ws, wl = torch.zeros(4, dtype=torch.int32), torch.full((4,), 512, dtype=torch.int32)
    pairs, backing = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 16)
    params = ((ARG, 0, 0), (ARG, 1, 0), (ARG, 2, 0), (ARG, 3, 0), (ARG, 4, 0), (OUT, 0, 0),
              (OUT, 1, 0)) + ((VAL, 0, 7),) * 20
    attn_recipe = (-1, (((4, 32, 128), (4096, 128, 1), torch.bfloat16),
                        ((4, 32), (32, 1), torch.float32)),
                   ((1, (8, 4, 1), 128, 0, False, False, params, ()),), ())
    pack_recipe = (-1, (), ((1, (8, 1, 1), 512, 0, False, False,
                             ((ARG, 0, 0), (ARG, 1, 0), (ARG, 2, 0)) + ((VAL, 0, 3),) * 6, ()),),
                   ())

    def miss(name, signature, args):
        return ((python_attn(*args), attn_recipe) if name.endswith("::attn")
                else (None, pack_recipe))

    ops = torch.ops.kvops_replay_bench
    cxx.install("kvops_replay_bench", "CPU", ["attn", "pack"], miss)
    cxx.set_enabled(True)
    cxx.set_dry(2)
    try:
        hits = cxx.stats()[0]
        out = [
            ["replay hit: 9 arguments, 2 outputs, 1 launch of 27 parameters (attention-like)",
             _best_us(lambda: ops.attn(q, k, k, ws, wl))],
            ["replay hit: 4 arguments, no output, 1 launch (pack-like)",
             _best_us(lambda: ops.pack(k, pairs, backing))],
        ]
        if cxx.stats()[0] - hits < 2 * ROUNDS * ITERS:
            raise RuntimeError("the timed calls did not replay")
        out += [
            ["Python kernel returning the attention-like outputs (the replaced path's floor)",
             _best_us(lambda: ops.python_attn(q, k, k, ws, wl))],
            ["torch.empty_like(q)", _best_us(lambda: torch.empty_like(q))],
            ["torch.add(ws, ws)", _best_us(lambda: torch.add(ws, ws))],
        ]
    finally:
        cxx.set_dry(0)
        cxx.uninstall("kvops_replay_bench")
        lib._destroy()
    return out


def main():
    from bench.common import table, write_result

    torch.set_num_threads(1)
    text = table(["call", "host us (best of 5 x 20000)"], rows())
    print(text)
    if not torch.cuda.is_available():
        path = write_result("replay-host-cpu", "The replay kernel's host path with its launches "
                            "dropped, CPU tensors, one thread.\n\n" + text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
