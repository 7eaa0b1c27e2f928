"""GPU benchmark: far_view_summarize against torch (index_select of the pages, then mean).

Llama-3-8B KV heads (Hkv 8, D 128), fp16 pool of 16-token pages, sv_chunk 128 (M = 8 pages per
chunk), C in {64, 128} chunks per sequence, B in {1, 16, 64}. Every chunk's pages are distinct
pages of the pool in random order (the pool is a random permutation, so no chunk is contiguous).
Times are medians of CUDA-graph replays with inputs rotated beyond L2; TB/s counts the K+V bytes
the op must read once, the fraction is of the 4.65 TB/s streaming-read ceiling.

The torch peer is ``cache.index_select(0, pages).view(B, C, M*S, Hkv, D).mean(2, dtype=float32)``
for K and for V. It does not mask empty slots (the tables here have none), so it is the cheapest
torch form of the op.

    python -m bench.bench_far_view            # the sweep, writes bench/results/
    python -m bench.bench_far_view --tune     # kernel tile sweep on two shapes
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench.common import READ_CEILING, rotation, table, tbps, time_graph, write_result
from kvops.kernels.far_view_summarize import default_blocks, far_view_summarize_fwd
from kvops.ops.far_view_summarize import far_view_summarize_ref

HKV, D, S, M = 8, 128, 16, 8
DTYPE = torch.float16


def make_sets(B, C, n):
    """n independent (k_cache, v_cache, chunk_table) sets of B*C*M distinct random pages."""
    sets = []
    for _ in range(n):
        P = B * C * M
        k_cache = torch.randn(P, S, HKV, D, device="cuda", dtype=DTYPE)
        v_cache = torch.randn(P, S, HKV, D, device="cuda", dtype=DTYPE)
        pages = torch.randperm(P, device="cuda").to(torch.int32).view(B, C, M)
        sets.append((k_cache, v_cache, pages))
    return sets


def torch_peer(k_cache, v_cache, pages):
    B, C, _ = pages.shape
    idx = pages.flatten()
    out = []
    for cache in (k_cache, v_cache):
        rows = cache.index_select(0, idx).view(B, C, M * S, HKV, D)
        out.append(rows.mean(2, dtype=torch.float32).to(cache.dtype))
    return out


def check_once(sets):
    k_cache, v_cache, pages = sets[0]
    k_sum, v_sum = torch.ops.kvops.far_view_summarize(k_cache, v_cache, pages)
    want_k, want_v = far_view_summarize_ref(k_cache, v_cache, pages[:1])
    err = max((k_sum[:1].float() - want_k.float()).abs().max().item(),
              (v_sum[:1].float() - want_v.float()).abs().max().item())
    assert err < 1e-3, f"kernel disagrees with reference: max err {err}"


def sweep(batches, caps):
    rows = []
    for B, C in itertools.product(batches, caps):
        nbytes = 2 * B * C * M * S * HKV * D * DTYPE.itemsize
        sets = make_sets(B, C, rotation(nbytes))
        check_once(sets)
        ours = [lambda s=s: torch.ops.kvops.far_view_summarize(*s) for s in sets]
        peer = [lambda s=s: torch_peer(*s) for s in sets]
        t_ours, t_peer = time_graph(ours)[1], time_graph(peer)[1]
        bt, bf = default_blocks(B * C, HKV * D, S, torch.device("cuda"))
        line = [B, C, nbytes / 2**20, f"{bt}x{bf}", t_ours, tbps(nbytes, t_ours),
                tbps(nbytes, t_ours) * 1e12 / READ_CEILING, t_peer, tbps(nbytes, t_peer),
                t_peer / t_ours]
        rows.append(line)
        print(" ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in line), flush=True)
        del sets
        torch.cuda.empty_cache()
    headers = ["B", "C", "MiB read", "tile", "kvops us", "kvops TB/s", "of ceil", "torch us",
               "torch TB/s", "x torch"]
    return table(headers, rows)


def tune():
    rows = []
    for B, C in ((1, 64), (16, 64), (16, 128), (64, 128)):
        nbytes = 2 * B * C * M * S * HKV * D * DTYPE.itemsize
        sets = make_sets(B, C, rotation(nbytes))
        for bt, bf, nw in itertools.product((1, 2, 4, 8), (128, 256, 512, 1024), (4, 8)):
            if bt * bf > 8192:
                continue
            fns = [lambda s=s, bt=bt, bf=bf, nw=nw: far_view_summarize_fwd(
                *s, block_t=bt, block_f=bf, num_warps=nw) for s in sets]
            t = time_graph(fns, iters=10)[1]
            rows.append([B, C, bt, bf, nw, t, tbps(nbytes, t)])
        del sets
        torch.cuda.empty_cache()
    rows.sort(key=lambda r: (r[0], r[1], r[5]))
    return table(["B", "C", "block_t", "block_f", "warps", "us", "TB/s"], rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true")
    args = ap.parse_args()
    if args.tune:
        body = tune()
        write_result("far_view_summarize-tune", body)
        print(body)
        return
    body = sweep((1, 16, 64), (64, 128))
    write_result("far_view_summarize", body)
    print(body)


if __name__ == "__main__":
    main()
