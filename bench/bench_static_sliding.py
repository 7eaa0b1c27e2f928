"""GPU benchmark: static_sliding_attention against SDPA (cuDNN, flash) and compiled flex_attention.

Llama-3-8B heads (Hq 32, Hkv 8, D 128), fp16 and bf16, B x W sweep, full windows. Every time is
the median of CUDA-graph replays with inputs rotated beyond L2; TB/s counts the K+V bytes that
decode attention must read once, the fraction is of the 4.65 TB/s streaming-read ceiling.

    python -m bench.bench_static_sliding            # full sweep, writes bench/results/
    python -m bench.bench_static_sliding --quick    # a few shapes
    python -m bench.bench_static_sliding --tune     # kernel config sweep on representative shapes
    python -m bench.bench_static_sliding --heads 9,3,64 --quick   # other heads (SmolLM2's here)
    python -m bench.bench_static_sliding --waves    # tile rows where the grid fills waves partly
    python -m bench.bench_static_sliding --far      # far slots against a dense window as wide
    python -m bench.bench_static_sliding --far-tiles  # tile rules at the short-window edge
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kvops
from bench.common import READ_CEILING, rotation, table, tbps, time_graph, write_result
from kvops.kernels._common import device_props, grid_waves, kv_tile_bytes, sm_count
from kvops.kernels._splitk import default_num_splits
from kvops.kernels.static_sliding_attention import sliding_launch, static_sliding_attention_fwd

HQ, HKV, D = 32, 8, 128


def make_sets(B, W, dtype, n):
    sets = []
    for _ in range(n):
        q = torch.randn(B, HQ, D, device="cuda", dtype=dtype)
        k = torch.randn(B, W, HKV, D, device="cuda", dtype=dtype)
        v = torch.randn(B, W, HKV, D, device="cuda", dtype=dtype)
        ws = torch.randint(0, W, (B,), device="cuda", dtype=torch.int32)
        wl = torch.full((B,), W, device="cuda", dtype=torch.int32)
        sets.append((q, k, v, ws, wl))
    return sets


def sdpa_sets(sets):
    """The same data in SDPA's preferred layout: q [B, Hq, 1, D], k/v [B, Hkv, W, D] contiguous.
    Windows are full, so ring order does not change the result."""
    out = []
    for q, k, v, _, _ in sets:
        out.append((q.unsqueeze(2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()))
    return out


def peers(sets, B, W, flex_cache):
    """name -> list of callables (one per input set) for each peer that runs on this shape."""
    dense = sdpa_sets(sets)
    result = {}
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def make(q, k, v, backend=backend):
            def run():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            return run
        fns = [make(*d) for d in dense]
        try:
            fns[0]()
            torch.cuda.synchronize()
            result[name] = fns
        except RuntimeError as e:
            result[name] = f"n/a ({str(e).splitlines()[0][:40]})"
    if flex_cache is not None:
        from torch.nn.attention.flex_attention import flex_attention

        if "fn" not in flex_cache:
            # dynamic shapes: one compile serves every (B, W) of a dtype, so the sweep fits a
            # device session; flex's own kernels still specialize what they need
            flex_cache["fn"] = torch.compile(flex_attention, dynamic=True)
        flex = flex_cache["fn"]
        fns = [lambda q=q, k=k, v=v: flex(q, k, v, enable_gqa=True) for q, k, v in dense]
        try:
            fns[0]()
            torch.cuda.synchronize()
            result["flex"] = fns
        except Exception as e:  # noqa: BLE001 - any compile failure is reported, not fatal
            result["flex"] = f"n/a ({type(e).__name__})"
    return result


def check_once(sets):
    q, k, v, ws, wl = sets[0]
    out, lse = torch.ops.kvops.static_sliding_attention(q, k, v, ws, wl)
    with kvops.backend("torch"):
        ref, ref_lse = torch.ops.kvops.static_sliding_attention(q[:2], k[:2], v[:2], ws[:2], wl[:2])
    err = (out[:2].float() - ref.float()).abs().max().item()
    assert err < 2e-2, f"kernel disagrees with reference: max err {err}"


def sweep(batches, widths, dtypes, with_flex):
    rows, ratios = [], []
    flex_cache = {} if with_flex else None
    for dtype, B, W in itertools.product(dtypes, batches, widths):
        t_start = time.perf_counter()
        nbytes = 2 * B * W * HKV * D * torch.tensor([], dtype=dtype).element_size()
        sets = make_sets(B, W, dtype, rotation(nbytes))
        check_once(sets)
        ours = [lambda s=s: torch.ops.kvops.static_sliding_attention(*s) for s in sets]
        t_ours = time_graph(ours)[1]
        no_pdl = [lambda s=s: static_sliding_attention_fwd(*s, pdl=False) for s in sets]
        t_no_pdl = time_graph(no_pdl)[1]
        line = [str(dtype).replace("torch.", ""), B, W, t_ours, tbps(nbytes, t_ours),
                tbps(nbytes, t_ours) * 1e12 / READ_CEILING, t_no_pdl]
        best = None
        for name, fns in peers(sets, B, W, flex_cache).items():
            if isinstance(fns, str):
                line += [fns, ""]
                continue
            t = time_graph(fns)[1]
            line += [t, tbps(nbytes, t)]
            if name.startswith("sdpa") and (best is None or t < best):
                best = t
        ratio = best / t_ours if best else float("nan")
        ratios.append((B, W, ratio))
        rows.append(line + [ratio])
        print(" ".join(str(c) if not isinstance(c, float) else f"{c:.2f}" for c in line + [ratio]),
              f"({time.perf_counter() - t_start:.1f} s)", flush=True)
        del sets
        torch.cuda.empty_cache()
    headers = ["dtype", "B", "W", "kvops us", "kvops TB/s", "of ceil", "no-PDL us", "cudnn us",
               "cudnn TB/s",
               "flash us", "flash TB/s"] + (["flex us", "flex TB/s"] if with_flex else []) + \
              ["x best sdpa"]
    return headers, rows, ratios


def tune(shapes):
    configs = [dict(block_n=bn, num_warps=nw, num_stages=ns)
               for bn, nw, ns in itertools.product((32, 64, 128), (4, 8), (2, 3))]
    rows = []
    for B, W in shapes:
        nbytes = 2 * B * W * HKV * D * 2
        sets = make_sets(B, W, torch.float16, rotation(nbytes))
        base = default_num_splits(B * HKV, W, 64, kv_tile_bytes(64, D, torch.float16),
                                  sm_count(torch.device("cuda")))
        split_opts = [None] + sorted({max(1, base // 2), base * 2, base * 4})
        results = []
        for cfg in configs:
            for ns in split_opts:
                fns = [lambda s=s, c=cfg, n=ns: static_sliding_attention_fwd(*s, num_splits=n, **c)
                       for s in sets]
                try:
                    t = time_graph(fns, iters=10)[1]
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
                    print("skip", cfg, ns, type(e).__name__)
                    continue
                results.append((t, cfg, ns))
        results.sort(key=lambda r: r[0])
        default = [r for r in results if r[2] is None and r[1] == dict(block_n=64, num_warps=4,
                                                                        num_stages=3)]
        for t, cfg, ns in results[:3] + default:
            rows.append([B, W, str(cfg), str(ns), t, tbps(nbytes, t)])
        del sets
        torch.cuda.empty_cache()
    return table(["B", "W", "config", "splits", "us", "TB/s"], rows)


def waves(batches, widths):
    """``wave_tile`` against both tile sizes forced (fp16, unsplit or split as the launcher
    splits that tile): where a (sequence, KV head) grid of 128-row programs fills the GPU's
    waves partly, the default should match the faster of the two."""
    rows = []
    for B, W in itertools.product(batches, widths):
        nbytes = 2 * B * W * HKV * D * 2
        sets = make_sets(B, W, torch.float16, rotation(nbytes))
        check_once(sets)
        pairs = B * HKV
        n_waves, fill = grid_waves(pairs, sm_count(torch.device("cuda")))
        times = [time_graph([lambda s=s, k=knobs: static_sliding_attention_fwd(*s, **k)
                             for s in sets])[1]
                 for knobs in ({}, {"block_n": 128}, {"block_n": 64})]
        rows.append([B, W, pairs, f"{fill:.2f} of {n_waves}", *times,
                     tbps(nbytes, times[0]), times[1] / times[2]])
        print(" ".join(str(c) if not isinstance(c, float) else f"{c:.2f}" for c in rows[-1]),
              flush=True)
        del sets
        torch.cuda.empty_cache()
    return table(["B", "W", "programs", "wave fill (128 rows)", "default us", "128 rows us",
                  "64 rows us", "default TB/s", "128 / 64"], rows)


FAR_SHAPES = ((16, 512, 1024), (32, 512, 1024), (1, 4096, 64), (4, 2048, 64),
              (64, 1024, 128), (128, 1024, 64), (16, 2048, 256))


def far(heads=((32, 8), (8, 1)), shapes=FAR_SHAPES, d=128, dtype=torch.float16):
    """A window of W with C live far slots against a dense window of W + C rows (the far view's
    cost over a window as wide); three rotating K/V sets. TB/s counts the K+V bytes of W + C
    rows."""
    attn = torch.ops.kvops.static_sliding_attention
    rows = []
    for hq, hkv in heads:
        for B, W, C in shapes:
            q = torch.randn(B, hq, d, device="cuda", dtype=dtype)
            sets = []
            for _ in range(3):
                k = torch.randn(B, W, hkv, d, device="cuda", dtype=dtype)
                fk = torch.randn(B, C, hkv, d, device="cuda", dtype=dtype)
                kd = torch.randn(B, W + C, hkv, d, device="cuda", dtype=dtype)
                sets.append((k, torch.randn_like(k), fk, torch.randn_like(fk), kd,
                             torch.randn_like(kd)))
            fb = torch.zeros(B, C, device="cuda")
            ws = torch.zeros(B, dtype=torch.int32, device="cuda")
            wl = torch.full((B,), W, dtype=torch.int32, device="cuda")
            wld = torch.full((B,), W + C, dtype=torch.int32, device="cuda")
            far_args = [(q, s[0], s[1], ws, wl, s[2], s[3], fb) for s in sets]
            dense_args = [(q, s[4], s[5], ws, wld) for s in sets]
            t_far = time_graph([lambda a=a: attn(*a) for a in far_args])[1]
            dense = time_graph([lambda a=a: attn(*a) for a in dense_args])[1]
            tb = tbps(2 * B * (W + C) * hkv * d * dtype.itemsize, t_far)
            rows.append([f"{hq}/{hkv}", B, W, C, t_far, dense, t_far / dense, tb,
                         tb * 1e12 / READ_CEILING])
            print(rows[-1], flush=True)
            del sets, far_args, dense_args
    return table(["Hq/Hkv", "B", "W", "C", "far view us", "dense W+C us", "far / dense",
                  "TB/s (far)", "of read ceiling"], rows)


TILE_HEADS = ((32, 8), (28, 4), (8, 1))
TILE_BATCHES = (32, 64, 128)
TILE_ROWS = ((1024, 0), (1024, 16), (1024, 64), (1152, 0), (1536, 0), (2048, 0))


def far_tiles(heads=TILE_HEADS, batches=TILE_BATCHES, rows=TILE_ROWS, d=128,
              dtype=torch.bfloat16):
    """The tile rules at the short-window edge: windows of W rows with C live far slots (the
    mean far view's 16 summaries beside a 1k window) under the launch rule, forced 64-row and
    128-row window tiles, and (with far slots) the far slots in one window-sized tile
    (``far_block_n=128``, against ``far_tile``'s); plus dense windows of 1024-2048 rows, where
    the short-window rule's edge lies. Three rotating K/V sets; TB/s counts the K+V bytes of W + C rows."""
    attn = static_sliding_attention_fwd
    rows_out = []
    for (hq, hkv), B, (W, C) in itertools.product(heads, batches, rows):
        q = torch.randn(B, hq, d, device="cuda", dtype=dtype)
        sets = []
        for _ in range(3):
            k = torch.randn(B, W, hkv, d, device="cuda", dtype=dtype)
            far = (torch.randn(B, C, hkv, d, device="cuda", dtype=dtype),
                   torch.randn(B, C, hkv, d, device="cuda", dtype=dtype),
                   torch.zeros(B, C, device="cuda")) if C else (None, None, None)
            sets.append((k, torch.randn_like(k), *far))
        ws = torch.randint(0, W, (B,), dtype=torch.int32, device="cuda")
        wl = torch.full((B,), W, dtype=torch.int32, device="cuda")
        variants = [("rule", {}), ("64 rows", dict(block_n=64)), ("128 rows", dict(block_n=128))]
        if C:
            variants.append(("128 rows, far tile 128", dict(block_n=128, far_block_n=128)))
        times = {}
        for name, kw in variants:
            fns = [lambda a=(q, s[0], s[1], ws, wl, *s[2:]), kw=kw: attn(*a, **kw) for s in sets]
            times[name] = time_graph(fns)[1]
        lp = sliding_launch(B, hkv, W, d, 2, C, device_props(q.device))
        nbytes = 2 * B * (W + C) * hkv * d * dtype.itemsize
        best = min(times.values())
        rows_out.append([f"{hq}/{hkv}", B, W, C, f"{lp.block_n}/{lp.splits}",
                         *(times.get(n, "") for n in ("rule", "64 rows", "128 rows",
                                                       "128 rows, far tile 128")),
                         times["rule"] / best, tbps(nbytes, times["rule"])])
        print(rows_out[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    return table(["Hq/Hkv", "B", "W", "C", "rule tile/splits", "rule us", "64 rows us",
                  "128 rows us", "128 + far 128 us", "rule / best", "TB/s (rule)"], rows_out)


def main():
    global HQ, HKV, D
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-shapes", default="1x4096,4x16384,16x4096,64x1024,128x4096",
                    help="BxW list for --tune")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--batches", default=None, help="B list, comma separated (sweep)")
    ap.add_argument("--widths", default=None, help="W list, comma separated (sweep)")
    ap.add_argument("--heads", default=f"{HQ},{HKV},{D}", help="Hq,Hkv,D (default Llama-3-8B's)")
    ap.add_argument("--waves", action="store_true",
                    help="wave_tile against forced 128- and 64-row tiles (fp16; --batches, "
                         "--widths override the shapes)")
    ap.add_argument("--far", action="store_true",
                    help="a window with far slots against a dense window as wide (fp16)")
    ap.add_argument("--far-tiles", action="store_true",
                    help="the tile rules at the short-window edge, far slots included (bf16)")
    args = ap.parse_args()
    if args.far_tiles:
        body = far_tiles()
        write_result("static_sliding_attention-far-tiles", body)
        print(body)
        return
    if args.far:
        body = far()
        write_result("static_sliding_attention-far", body)
        print(body)
        return
    HQ, HKV, D = (int(x) for x in args.heads.split(","))
    suffix = "" if (HQ, HKV, D) == (32, 8, 128) else f"-heads{HQ}-{HKV}-{D}"
    if args.waves:
        body = waves(tuple(int(x) for x in (args.batches or
                                            "9,10,11,12,17,20,24,28,34,40,44,56").split(",")),
                     tuple(int(x) for x in (args.widths or "4096,16384").split(",")))
        write_result("static_sliding_attention-waves-sweep" + suffix, body)
        print(body)
        return
    if args.tune:
        body = tune([tuple(int(x) for x in s.split("x")) for s in args.tune_shapes.split(",")])
        write_result("static_sliding_attention-tune" + suffix, body)
        print(body)
        return
    if args.quick:
        batches, widths, dtypes = (1, 16), (4096,), (torch.float16,)
    else:
        batches, widths, dtypes = (1, 4, 16, 64, 128), (512, 1024, 4096, 16384), \
            (torch.float16, torch.bfloat16)
    if args.batches:
        batches = tuple(int(x) for x in args.batches.split(","))
    if args.widths:
        widths = tuple(int(x) for x in args.widths.split(","))
    partial = args.quick or args.batches or args.widths
    headers, rows, ratios = sweep(batches, widths, dtypes, not args.no_flex)
    goals = []
    big = [r for b, w, r in ratios if b >= 16]
    b1 = [r for b, w, r in ratios if b == 1 and w == 4096]
    goals.append(f"- B >= 16: min ratio to best SDPA {min(big):.2f} (goal 0.95)" if big else "")
    goals.append(f"- B = 1, W = 4096: ratio {min(b1):.2f} (goal 1.5)" if b1 else "")
    goals.append(f"- worst shape: {min(r for _, _, r in ratios):.2f} (goal 0.8)")
    body = table(headers, rows) + "\n\nGoals:\n" + "\n".join(g for g in goals if g) + "\n"
    write_result("static_sliding_attention" + suffix + ("-partial" if partial else ""), body)
    print(body)


if __name__ == "__main__":
    main()
