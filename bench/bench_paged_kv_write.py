"""GPU benchmark: paged_kv_write against index_put_ and index_copy_ on the same slots.

N new tokens' K and V (bf16, S 16) go to slots the way an engine maps them: each sequence of
``N / seqs`` tokens fills pages in order, pages drawn at random from a pool 4x larger than the
tokens (and at least 256 MiB a cache, so writes land beyond L2). The peers write the same slots
of a contiguous pool through its flat ``[P * S, Hkv, D]`` view, K then V. Times are medians of
CUDA-graph replays rotating input sets beyond L2; bytes count K and V read and written once
(``4 N Hkv D`` elements), the fraction is of the 4.25 TB/s copy ceiling. Eager host us: what a
call costs the caller's thread (bench.common.eager_times).

    python -m bench.bench_paged_kv_write            # Llama-3-8B and Qwen2.5-7B KV heads
    python -m bench.bench_paged_kv_write --quick    # Llama-3-8B, N 128 and 32768
"""

from __future__ import annotations

import argparse
import itertools

import torch

import kvops  # noqa: F401 - registers torch.ops.kvops
from bench.common import COPY_CEILING, eager_times, rotation, table, tbps, time_graph, write_result

HEADS = {"llama3-8b": 8, "qwen2.5-7b": 4}
D, S, DTYPE = 128, 16, torch.bfloat16


def make_sets(N, Hkv, n_sets, interleaved):
    row_bytes = Hkv * D * DTYPE.itemsize
    tokens = max(4 * N * n_sets, (256 << 20) // row_bytes)
    P = -(-tokens // S)
    if interleaved:
        kv = torch.zeros(P, 2, S, Hkv, D, dtype=DTYPE, device="cuda")
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = torch.zeros(P, S, Hkv, D, dtype=DTYPE, device="cuda")
        v_cache = torch.zeros_like(k_cache)
    seqs = max(1, N // 512) if N > 128 else N        # decode: one token a sequence
    per_seq = N // seqs
    sets = []
    gen = torch.Generator().manual_seed(N)
    for _ in range(n_sets):
        pages = torch.randperm(P, generator=gen)
        slots = []
        for s in range(seqs):
            n = per_seq + (N - per_seq * seqs if s == seqs - 1 else 0)
            first = int(torch.randint(0, S, (1,), generator=gen)) if N <= 128 else 0
            need = -(-(first + n) // S)
            own, pages = pages[:need], pages[need:]
            pos = first + torch.arange(n)
            slots.append(own[pos // S] * S + pos % S)
        slots = torch.cat(slots).cuda()
        k = torch.randn(N, Hkv, D, device="cuda", dtype=DTYPE)
        v = torch.randn(N, Hkv, D, device="cuda", dtype=DTYPE)
        sets.append((k, v, k_cache, v_cache, slots))
    return sets


def check_once(sets):
    k, v, kc, vc, slots = sets[0]
    torch.ops.kvops.paged_kv_write(k, v, kc, vc, slots)
    page, off = slots // S, slots % S
    assert torch.equal(kc[page, off], k) and torch.equal(vc[page, off], v), "write is wrong"


def runners(sets):
    """name -> callables, one per input set."""
    ours = [lambda s=s: torch.ops.kvops.paged_kv_write(*s) for s in sets]
    put, copy = [], []
    for k, v, kc, vc, slots in sets:
        fk, fv = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
        put.append(lambda fk=fk, fv=fv, k=k, v=v, s=slots: (fk.index_put_((s,), k),
                                                           fv.index_put_((s,), v)))
        copy.append(lambda fk=fk, fv=fv, k=k, v=v, s=slots: (fk.index_copy_(0, s, k),
                                                            fv.index_copy_(0, s, v)))
    return {"kvops": ours, "index_put_": put, "index_copy_": copy}


def sweep(models, sizes):
    rows, goals = [], []
    for model, N in itertools.product(models, sizes):
        Hkv = HEADS[model]
        nbytes = 4 * N * Hkv * D * DTYPE.itemsize
        n_sets = rotation(nbytes)
        sets = make_sets(N, Hkv, n_sets, interleaved=False)
        check_once(sets)
        line = [model, N]
        times = {}
        for name, fns in runners(sets).items():
            t = time_graph(fns)[1]
            host, wall = eager_times(fns[0])
            times[name] = t
            line += [t, tbps(nbytes, t)] + ([tbps(nbytes, t) * 1e12 / COPY_CEILING]
                                            if name == "kvops" else []) + [host, wall]
        del sets
        inter = make_sets(N, Hkv, n_sets, interleaved=True)
        check_once(inter)
        t_inter = time_graph([lambda s=s: torch.ops.kvops.paged_kv_write(*s) for s in inter])[1]
        del inter
        torch.cuda.empty_cache()
        best = min(times["index_put_"], times["index_copy_"])
        line += [t_inter, best / times["kvops"]]
        rows.append(line)
        print(" ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in line), flush=True)
        if N == 128:
            goals.append(f"- {model} N 128: {times['kvops']:.2f} us (goal < 5 us)")
        if N >= 8192:
            goals.append(f"- {model} N {N}: {tbps(nbytes, times['kvops']):.2f} TB/s "
                         f"(goal >= 3.5 TB/s)")
    headers = ["model", "N", "kvops us", "TB/s", "of ceil", "host us", "wall us",
               "index_put_ us", "TB/s", "host us", "wall us",
               "index_copy_ us", "TB/s", "host us", "wall us", "interleaved us", "x best peer"]
    return table(headers, rows) + "\n\nGoals:\n" + "\n".join(goals) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="N list, comma separated")
    args = ap.parse_args()
    models = ("llama3-8b",) if args.quick else tuple(HEADS)
    sizes = (128, 32768) if args.quick else (128, 1024, 8192, 32768)
    if args.sizes:
        sizes = tuple(int(x) for x in args.sizes.split(","))
    body = ("bf16, S 16, D 128. us: median graph replay; host/wall us: one eager call "
            "(bench.common.eager_times); interleaved: kvops on k = kv[:, 0] of a "
            "[P, 2, S, Hkv, D] pool.\n\n" + sweep(models, sizes))
    write_result("paged_kv_write" + ("-quick" if args.quick or args.sizes else ""), body)
    print(body)


if __name__ == "__main__":
    main()
