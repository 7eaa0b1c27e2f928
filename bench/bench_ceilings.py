"""GPU benchmark: the card's memory ceilings the other benches quote, measured on it.

Streaming read: a Triton kernel summing a 4 GiB bf16 buffer (each program reduces its blocks in
registers and adds one float32 to the output), best of the block sizes; device copy:
``torch.Tensor.copy_`` of 2 GiB (read and write counted: 4 GiB moved). Both as CUDA-graph
replays, median. The other benches quote the H200's (``bench.common.READ_CEILING``,
``COPY_CEILING``); this gives another card's own (bench/results/<date>-<HHMM>-ceilings-<card>.md), to
read their fractions against.

    python -m bench.bench_ceilings
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bench.common import table, time_graph, write_result


@triton.jit
def _sum_kernel(X, Out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        o = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(X + o, mask=o < n, other=0.0).to(tl.float32)
    tl.atomic_add(Out, tl.sum(acc))


def main():
    n = 2 * 2**30                                   # 4 GiB of bf16
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(1, dtype=torch.float32, device="cuda")
    rows = []
    best = 0.0
    for block, iters, warps in ((4096, 16, 8), (8192, 8, 8), (2048, 32, 4), (4096, 64, 8)):
        grid = (triton.cdiv(n, block * iters),)
        t = time_graph(lambda g=grid, b=block, i=iters, w=warps, x=x: _sum_kernel[g](
            x, out, n, BLOCK=b, ITERS=i, num_warps=w), inner=4)[1]
        tb = x.nbytes / t / 1e6
        best = max(best, tb)
        rows.append([f"streaming read, block {block} x {iters}, {warps} warps", t,
                     x.nbytes / 2**30, round(tb, 3)])
    out.zero_()
    _sum_kernel[(triton.cdiv(n, 4096 * 16),)](x, out, n, BLOCK=4096, ITERS=16, num_warps=8)
    assert out.item() == n, f"sum: expected {n}, got {out.item()}"
    x = None                                        # frees the 4 GiB
    a = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    t = time_graph(lambda: b.copy_(a), inner=4)[1]
    copy = 2 * a.nbytes / t / 1e6
    rows.append(["device copy (copy_, read + write)", t, 2 * a.nbytes / 2**30, round(copy, 3)])
    body = (f"{torch.cuda.get_device_name()}: streaming read {best:.2f} TB/s (the best block), "
            f"device copy {copy:.2f} TB/s.\n\n"
            + table(["call", "graph us", "GiB moved", "TB/s"], rows))
    print(write_result(f"ceilings-{torch.cuda.get_device_name().split()[1]}", body))


if __name__ == "__main__":
    main()
