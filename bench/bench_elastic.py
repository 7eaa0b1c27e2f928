"""GPU benchmark: ElasticKV kernels (pack/refine_base_pairs, elastic_attention) on an H200.

Part 1, pack/refine: N pairs of Llama-3-8B pages (Hkv 8, D 128; S 16 and 64), in place
(dst == src_a, base_page == dst_a), each codec, Triton kernel against the PyTorch reference
(gather + index_put, the "torch slicing" equivalent). TB/s counts bytes read plus written:
pack reads two TARGET pages and writes one page plus the backing; refine reads the BASE page and
the backing and writes two pages. Fraction of the 4.25 TB/s copy ceiling; beside it, a kernel
that moves a pack's bytes and does nothing else (the ceiling of that mix of reads and writes).

Part 2, elastic_attention: Llama-3-8B heads (Hq 32, Hkv 8, D 128), fp16 (``--dtype bfloat16``:
bf16 with e4m3 BASE), random block tables,
full-length sequences, S 16 and 64. Native path; structured path with a centered BASE span of
0/25/50/75/100 % of the blocks (packed by pack_base_pairs, two blocks per page); general path on
the 50 % layout. Beside it, static_sliding_attention over the same tokens as a dense window
(win_start 0, win_len = context) and the best SDPA backend on the gathered dense K/V. TB/s counts
the K/V bytes the kernel must read (TARGET rows 2 bytes a value, BASE rows 1); fraction of the
4.65 TB/s read ceiling; beside it the time of a kernel that only reads as many bytes
(``read_floor_us``), which the goal summary also reports for the BASE speedup and the TB/s spread.
Every time is the median of CUDA-graph replays with inputs rotated past L2.

    python -m bench.bench_elastic            # full sweep (about 3 minutes), writes bench/results/
    python -m bench.bench_elastic --quick    # a smoke pass
    python -m bench.bench_elastic --tune     # kernel config sweeps (pack/refine, attention)
    python -m bench.bench_elastic --dtype bfloat16 --no-pack   # bf16 attention only
    python -m bench.bench_elastic --fixed-cost   # a step's cost apart from streaming K/V
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import triton
import triton.language as tl

import kvops
from bench.common import (
    COPY_CEILING,
    READ_CEILING,
    best_sdpa_decode,
    read_floor_us,
    rotation,
    table,
    tbps,
    time_graph,
    write_result,
)
from kvops.kernels.base_pairs import pack_base_pairs_fwd, refine_base_pairs_fwd
from kvops.layouts import codecs
from kvops.ops.elastic_attention import elastic_attention_ref, span_modes
from kvops.ops.pack_base_pairs import pack_base_pairs_ref
from kvops.ops.refine_base_pairs import refine_base_pairs_ref

HQ, HKV, D = 32, 8, 128
CODECS = [(torch.float16, "hi8"), (torch.float16, "hi8r"), (torch.bfloat16, "e4m3")]


# ----------------------------------------------------------------------------------- pack/refine

def pair_sets(N, S, dtype, codec, n_sets):
    """Per set: a pool of 2N pages, in-place rows (2i, 2i+1, 2i) and a backing."""
    sets = []
    for _ in range(n_sets):
        cache = torch.randn(2 * N, S, HKV, D, device="cuda").to(dtype)
        a = torch.arange(0, 2 * N, 2, device="cuda", dtype=torch.int32)
        pairs = torch.stack([a, a + 1, a], 1)
        backing = torch.empty((N, 2, S, HKV, D), device="cuda",
                              dtype=codecs.backing_dtype(codec, dtype))
        sets.append((cache, pairs, backing))
    return sets


def check_pack(sets, codec):
    cache, pairs, backing = sets[0]
    ref_cache, ref_back = cache[:8].clone(), backing[:4].clone()
    pack_base_pairs_ref(ref_cache, pairs[:4], ref_back, codec)
    pack_base_pairs_fwd(cache, pairs, backing, codec)
    assert torch.equal(cache[:8].view(torch.uint8), ref_cache.view(torch.uint8)), "pack differs"
    refine_base_pairs_fwd(cache, pairs, backing, codec)
    refine_base_pairs_ref(ref_cache, pairs[:4], ref_back, codec)
    assert torch.equal(cache[:8].view(torch.uint8), ref_cache.view(torch.uint8)), "refine differs"


def pair_bytes(op, codec, page):
    """Bytes one pair moves (read + written); ``page`` = bytes of one TARGET page. Pack reads 2
    pages and writes 1 plus the backing (1 page of low bytes for hi8/hi8r, 2 full pages for
    e4m3). Refine writes 2 pages and reads the BASE page plus the low bytes (hi8/hi8r) or the 2
    backing pages alone (e4m3): 4 pages either way."""
    return page * ((5 if codec == "e4m3" else 4) if op == "pack" else 4)


def pack_rows(N_pairs, pages, quick):
    rows = []
    for (dtype, codec), S in itertools.product(CODECS[:1] if quick else CODECS, pages):
        page = S * HKV * D * 2
        nbytes = {op: N_pairs * pair_bytes(op, codec, page) for op in ("pack", "refine")}
        sets = pair_sets(N_pairs, S, dtype, codec, rotation(N_pairs * 4 * page))
        check_pack(sets, codec)
        for op, kernel, ref in (("pack", pack_base_pairs_fwd, pack_base_pairs_ref),
                                ("refine", refine_base_pairs_fwd, refine_base_pairs_ref)):
            t_k = time_graph([lambda s=s, f=kernel, c=codec: f(*s, c) for s in sets])[1]
            t_r = time_graph([lambda s=s, f=ref, c=codec: f(*s, c) for s in sets])[1]
            b = nbytes[op]
            rows.append([op, str(dtype).replace("torch.", ""), codec, S, N_pairs, t_k, tbps(b, t_k),
                         tbps(b, t_k) * 1e12 / COPY_CEILING, t_r, tbps(b, t_r), t_r / t_k])
            print(" ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in rows[-1]),
                  flush=True)
        del sets
        torch.cuda.empty_cache()
    headers = ["op", "dtype", "codec", "S", "pairs", "kernel us", "TB/s", "of copy ceil",
               "torch us", "torch TB/s", "speedup"]
    return headers, rows


@triton.jit
def _pack_traffic_kernel(Src, Base, Back, n, BACK16: tl.constexpr, BLOCK: tl.constexpr):
    """A pack's bytes and nothing else: read 16-bit values, write one byte each and a backing
    of one (hi8) or two (e4m3) bytes each; contiguous, no encoding, no in-place ordering."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(Src + o, mask=m, other=0)
    tl.store(Base + o, (x >> 8).to(tl.uint8), mask=m)
    if BACK16:
        tl.store(Back + o, x, mask=m)
    else:
        tl.store(Back + o, x.to(tl.uint8), mask=m)


def time_pack_traffic(n: int, back16: bool) -> float:
    """Best median us of ``_pack_traffic_kernel`` over ``n`` values and 4 launch shapes."""
    src = torch.randint(-2**15, 2**15, (n,), device="cuda", dtype=torch.int16)
    base = torch.empty(n, device="cuda", dtype=torch.uint8)
    back = torch.empty(n, device="cuda", dtype=torch.int16 if back16 else torch.uint8)
    launch = lambda block, warps: _pack_traffic_kernel[(triton.cdiv(n, block),)](
        src, base, back, n, BACK16=back16, BLOCK=block, num_warps=warps)
    return min(time_graph(lambda b=b, w=w: launch(b, w))[1]
               for b, w in itertools.product((1024, 4096), (4, 8)))


def pack_traffic_rows(N_pairs, pages):
    """The TB/s (read + written, as ``pair_bytes`` counts) of ``time_pack_traffic``: what a
    pack's mix of reads and writes allows on this GPU (e4m3 packs write 3 bytes for every 2
    read; the copy ceiling is 1 for 1)."""
    rows = []
    for back16, S in itertools.product((False, True), pages):
        t = time_pack_traffic(2 * N_pairs * S * HKV * D, back16)
        nbytes = N_pairs * pair_bytes("pack", "e4m3" if back16 else "hi8", S * HKV * D * 2)
        rows.append(["e4m3" if back16 else "hi8/hi8r", S, N_pairs, t, tbps(nbytes, t),
                     tbps(nbytes, t) * 1e12 / COPY_CEILING])
        torch.cuda.empty_cache()
    return ["pack bytes of", "S", "pairs", "us", "TB/s", "of copy ceil"], rows


def tune_pack(N_pairs=2048, S=16):
    rows = []
    for dtype, codec in CODECS:
        page = S * HKV * D * 2
        sets = pair_sets(N_pairs, S, dtype, codec, rotation(N_pairs * 4 * page))
        for op, kernel in (("pack", pack_base_pairs_fwd), ("refine", refine_base_pairs_fwd)):
            for block, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
                t = time_graph([lambda s=s, f=kernel, c=codec, b=block, w=warps:
                                f(*s, c, block=b, num_warps=w) for s in sets], iters=10)[1]
                b = N_pairs * pair_bytes(op, codec, page)
                rows.append([op, codec, block, warps, t, tbps(b, t)])
        del sets
        torch.cuda.empty_cache()
    return table(["op", "codec", "block", "warps", "us", "TB/s"], rows)


# ------------------------------------------------------------------------------ elastic attention

def attention_set(B, ctx, S, share, dtype=torch.float16):
    """A pool and tables for B full sequences of ``ctx`` tokens, ``share`` of the blocks BASE in a
    centered span, packed two per page. Returns the tensors and the bytes the kernel must read."""
    L = ctx // S
    nbase = round(share * L)
    first = (L - nbase) // 2
    n_pages = B * (L - nbase + (nbase + 1) // 2)
    perm = torch.randperm(n_pages, device="cuda").int()
    k = torch.randn(n_pages, S, HKV, D, device="cuda").to(dtype)
    v = torch.randn(n_pages, S, HKV, D, device="cuda").to(dtype)
    table_ = torch.empty(B, L, dtype=torch.int32, device="cuda")
    used = 0
    for j in range(L):            # a span pair (first + 2i, first + 2i + 1) shares one page
        if first <= j < first + nbase and (j - first) % 2 == 1:
            table_[:, j] = table_[:, j - 1]
            continue
        table_[:, j] = perm[used:used + B]
        used += B
    if nbase:
        span_pages = table_[:, first:first + nbase:2].flatten()
        for c in (k, v):                  # BASE bytes from real values in both halves
            halves = torch.randn(span_pages.numel(), 2, S, HKV, D, device="cuda").to(dtype)
            base, _ = codecs.encode(halves, codecs.default_codec(dtype))
            c.view(torch.uint8).view(n_pages, 2, S, HKV, D)[span_pages.long()] = base
    q = torch.randn(B, HQ, D, device="cuda").to(dtype)
    seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    span = torch.tensor([[first, first + nbase]] * B, dtype=torch.int32, device="cuda")
    nbytes = 2 * B * HKV * D * S * ((L - nbase) * 2 + nbase)
    return dict(q=q, k_cache=k, v_cache=v, block_table=table_, seq_lens=seq), span, nbytes


def path_kwargs(label, span, L):
    """elastic_attention keyword arguments of a row: native, structured or general."""
    if label == "native":
        return {}
    if label.startswith("struct"):
        return {"base_span": span}
    return {"block_mode": span_modes(span, L)}


def attention_calls(B, ctx, S, label, share, dtype=torch.float16):
    """A row's elastic_attention keyword sets (``attention_set`` plus ``path_kwargs``), enough
    of them to rotate the dense K/V bytes past L2, and the bytes the kernel must read."""
    calls = []
    for _ in range(rotation(2 * B * ctx * HKV * D * 2)):
        case, span, nbytes = attention_set(B, ctx, S, share, dtype)
        calls.append({**case, **path_kwargs(label, span, ctx // S)})
    return calls, nbytes


def time_calls(calls, fn=None, iters=20, **knobs) -> float:
    """Median us of ``fn`` (default the op) over the rotated keyword sets ``calls``."""
    fn = fn or torch.ops.kvops.elastic_attention
    return time_graph([lambda c=c: fn(**c, **knobs) for c in calls], iters=iters)[1]


def check_attention(call):
    out, _ = torch.ops.kvops.elastic_attention(**call)
    per_seq = ("q", "block_table", "seq_lens", "block_mode", "base_span")
    want, _ = elastic_attention_ref(**{n: t[:2] if n in per_seq else t for n, t in call.items()})
    err = (out[:2].float() - want.float()).abs().max().item()
    assert err < 2e-2, f"kernel disagrees with reference: max err {err}"


def dense_peers(B, ctx, dtype, n_sets):
    """static_sliding_attention and SDPA over dense K/V: name -> median us (or a reason)."""
    sets = []
    for _ in range(n_sets):
        q = torch.randn(B, HQ, D, device="cuda", dtype=dtype)
        k = torch.randn(B, ctx, HKV, D, device="cuda", dtype=dtype)
        v = torch.randn(B, ctx, HKV, D, device="cuda", dtype=dtype)
        sets.append((q, k, v))
    zero = torch.zeros(B, dtype=torch.int32, device="cuda")
    full = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    result = {"static": time_graph([lambda s=s: torch.ops.kvops.static_sliding_attention(
        s[0], s[1], s[2], zero, full) for s in sets])[1]}
    dense = [(q.unsqueeze(2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
             for q, k, v in sets]
    del sets
    best = best_sdpa_decode(dense)
    result["sdpa"] = None if best is None else best[:2]
    return result


def tune_attention(shapes=((16, 4096), (1, 16384)), S=16, dtype=torch.float16):
    """Kernel configs (block_n, num_warps, num_stages) per path on representative shapes."""
    from kvops.kernels.elastic_attention import elastic_attention_fwd

    rows = []
    for (B, ctx), (label, share) in itertools.product(
            shapes, (("native", 0.0), ("struct 50%", 0.5), ("struct 100%", 1.0),
                     ("general 50%", 0.5))):
        calls, nbytes = attention_calls(B, ctx, S, label, share, dtype)
        results = []
        want = torch.ops.kvops.elastic_attention(**calls[0])[0].float()
        for bn, nw, ns in itertools.product((16, 32, 64), (1, 2, 4), (3, 4, 5)):
            knobs = dict(block_n=bn, num_warps=nw, num_stages=ns)
            try:
                got = elastic_attention_fwd(**calls[0], **knobs)[0].float()
                err = (got - want).abs().max().item()
                t = time_calls(calls, elastic_attention_fwd, iters=10, **knobs)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
                print("skip", bn, nw, ns, type(e).__name__)
                continue
            if not err < 2e-2:      # a config is timed only if it agrees with the default launch
                print("WRONG", label, bn, nw, ns, f"max err {err:.3g}")
                continue
            results.append((t, bn, nw, ns))
        results.sort()
        for t, bn, nw, ns in results[:3]:
            rows.append([B, ctx, label, bn, nw, ns, t, tbps(nbytes, t)])
        del calls
        torch.cuda.empty_cache()
    return table(["B", "ctx", "path", "block_n", "warps", "stages", "us", "TB/s"], rows)


def fixed_cost_rows(cases=((1, 16384, 16), (16, 4096, 16), (128, 4096, 64)),
                    dtype=torch.float16):
    """What a step costs apart from streaming K/V: the same launch (shapes, splits, tables) with
    every sequence cut to 32 tokens, beside the full step, native and structured 0 / 100 %
    BASE. ``(full - fixed)`` is the part BASE can halve."""
    rows = []
    for B, ctx, S in cases:
        for label, share in (("native", 0.0), ("struct 0%", 0.0), ("struct 100%", 1.0)):
            calls, _ = attention_calls(B, ctx, S, label, share, dtype)
            t_full = time_calls(calls)
            t_fixed = time_calls([dict(c, seq_lens=torch.full_like(c["seq_lens"], 32))
                                  for c in calls])
            rows.append([B, ctx, S, label, t_full, t_fixed, t_full - t_fixed])
            del calls
            torch.cuda.empty_cache()
    for r in rows:      # all-TARGET / all-BASE, whole step and streaming part
        if r[3] == "struct 100%":
            t0 = next(x for x in rows if x[:3] == r[:3] and x[3] == "struct 0%")
            r += [t0[4] / r[4], t0[6] / r[6]]
        else:
            r += ["", ""]
    return table(["B", "ctx", "S", "path", "step us", "32-token step us", "streaming us",
                  "0 % / 100 % step", "0 % / 100 % streaming"], rows)


def share_goals(timed):
    """All-BASE over all-TARGET speed and the TB/s spread (max / min - 1) across the structured
    rows of ``timed`` {label: (us, bytes)}."""
    bw = [tbps(nb, t) for lab, (t, nb) in timed.items() if lab.startswith("struct")]
    return timed["struct 0%"][0] / timed["struct 100%"][0], max(bw) / min(bw) - 1


def overhead_budget(floors, speedup_goal=1.7, spread_goal=0.10):
    """The largest cost ``x >= 0`` (us), the same at every BASE share, that a step may add to
    the read floor and still meet each share goal: ``floors`` {label: (floor us, bytes)} holds
    the structured rows' read floors (other labels are ignored). Returns ``(x for the all-BASE
    speedup, x for the TB/s spread)``, each ``None`` when no ``x >= 0`` meets the goal.

    Speedup: ``(F0 + x) / (F100 + x) >= g`` holds for ``x <= (F0 - g F100) / (g - 1)``. Spread:
    every pair of shares ``i, j`` must keep ``N_i / (F_i + x) <= (1 + s) N_j / (F_j + x)``,
    linear in ``x``: ``x (N_i - (1 + s) N_j) <= (1 + s) N_j F_i - N_i F_j``, an upper or a lower
    bound on ``x``. All of them together leave one interval; its upper end is returned
    (``inf`` if unbounded; where the interval starts above 0, a smaller cost misses too)."""
    struct = [v for lab, v in floors.items() if lab.startswith("struct")]
    f0, f100 = floors["struct 0%"][0], floors["struct 100%"][0]
    x_speedup = (f0 - speedup_goal * f100) / (speedup_goal - 1)
    lo, hi = 0.0, float("inf")
    for (fi, ni), (fj, nj) in itertools.permutations(struct, 2):
        a = ni - (1 + spread_goal) * nj
        b = (1 + spread_goal) * nj * fi - ni * fj
        if a > 0:
            hi = min(hi, b / a)
        elif a < 0:
            lo = max(lo, b / a)
        elif b < 0:                              # this pair misses at every x
            hi = -math.inf
    return (x_speedup if x_speedup >= 0 else None), (hi if lo <= hi else None)


def attention_rows(shapes, pages, shares, dtype=torch.float16):
    rows, goals = [], {"native/static": [], "base100 speedup": [], "general/structured": [],
                       "TB/s spread": [], "floor base100 speedup": [], "floor TB/s spread": [],
                       "budget": []}
    floors = {}                                  # bytes -> read_floor_us
    for B, ctx in shapes:
        dense_bytes = 2 * B * ctx * HKV * D * 2
        peers = dense_peers(B, ctx, dtype, rotation(dense_bytes))
        t_static = peers["static"]
        sdpa_name, t_sdpa = peers["sdpa"] or ("n/a", float("nan"))
        for S in pages:
            timings = {}
            for label, share in [("native", 0.0)] + [(f"struct {int(s * 100)}%", s) for s in shares] \
                    + [("general 50%", 0.5)]:
                calls, nbytes = attention_calls(B, ctx, S, label, share, dtype)
                check_attention(calls[0])
                t = time_calls(calls)
                del calls
                if nbytes not in floors:
                    floors[nbytes] = read_floor_us(nbytes)
                timings[label] = (t, nbytes)
                rows.append([B, ctx, S, label, t, tbps(nbytes, t), tbps(nbytes, t) * 1e12 /
                             READ_CEILING, floors[nbytes], t / floors[nbytes], t_static,
                             tbps(dense_bytes, t_static), sdpa_name, t_sdpa, t_sdpa / t])
                print(" ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in rows[-1]),
                      flush=True)
                torch.cuda.empty_cache()
            goals["native/static"].append(t_static / timings["native"][0])
            if "struct 50%" in timings:
                goals["general/structured"].append(timings["general 50%"][0] /
                                                   timings["struct 50%"][0])
            floor_timings = {lab: (floors[nb], nb) for lab, (_, nb) in timings.items()}
            for prefix, timed in (("", timings), ("floor ", floor_timings)):
                speedup, spread = share_goals(timed)
                goals[prefix + "base100 speedup"].append(speedup)
                goals[prefix + "TB/s spread"].append(spread)
            over = [t - floors[nb] for lab, (t, nb) in timings.items() if lab.startswith("struct")]
            budget = ["none" if x is None else x for x in overhead_budget(floor_timings)]
            goals["budget"].append([B, ctx, S, *budget, min(over), max(over)])
    headers = ["B", "ctx", "S", "path", "us", "TB/s", "of read ceil", "floor us", "x floor",
               "static us", "static TB/s", "sdpa", "sdpa us", "x sdpa"]
    return headers, rows, goals


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes (smoke pass)")
    ap.add_argument("--tune", action="store_true", help="kernel config sweeps")
    ap.add_argument("--shapes", default="1x16384,16x4096,16x16384,64x4096,128x1024,128x4096",
                    help="attention shapes as BxCTX, comma separated")
    ap.add_argument("--pages", default="16,64", help="page sizes, comma separated")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"],
                    help="attention cache dtype (bfloat16: e4m3 BASE); pack/refine run all codecs")
    ap.add_argument("--no-pack", action="store_true", help="skip pack/refine")
    ap.add_argument("--fixed-cost", action="store_true",
                    help="per-step cost apart from streaming (32-token sequences)")
    args = ap.parse_args()
    if args.fixed_cost:
        torch.manual_seed(0)
        with kvops.validate(False):
            body = "## elastic_attention: fixed cost a step\n\n" + fixed_cost_rows(
                dtype=getattr(torch, args.dtype))
        write_result("elastic-fixed-cost" + ("-bf16" if args.dtype == "bfloat16" else ""), body)
        print(body)
        return
    if args.tune:
        body = "\n\n".join(["## pack/refine", tune_pack(),
                            f"## elastic_attention ({args.dtype}, S 16, top 3)",
                            tune_attention(dtype=getattr(torch, args.dtype))])
        write_result("elastic-tune", body)
        print(body)
        return
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    with kvops.validate(False):
        if args.no_pack:
            ph, prow, traffic = None, [], None
        else:
            n_pairs, pack_pages = (512, (16,)) if args.quick else (2048, (16, 64))
            ph, prow = pack_rows(n_pairs, pack_pages, quick=args.quick)
            traffic = pack_traffic_rows(n_pairs, pack_pages)
        if args.quick:
            ah, arow, goals = attention_rows([(16, 4096)], (16,), (0.0, 0.5, 1.0), dtype)
        else:
            shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]
            pages = tuple(int(x) for x in args.pages.split(","))
            ah, arow, goals = attention_rows(shapes, pages, (0.0, 0.25, 0.5, 0.75, 1.0), dtype)
    fmt = lambda xs: f"min {min(xs):.2f}, max {max(xs):.2f}" if xs else "n/a"
    goal_lines = [
        f"- native path / static_sliding_attention on the dense window (speed ratio, goal >= 0.95): "
        f"{fmt(goals['native/static'])}",
        f"- all-BASE speedup over all-TARGET (structured 100 % vs 0 %, goal >= 1.7): "
        f"{fmt(goals['base100 speedup'])}; reading the same bytes alone: "
        f"{fmt(goals['floor base100 speedup'])}",
        f"- general / structured time at 50 % BASE (goal <= 1.10): {fmt(goals['general/structured'])}",
        f"- TB/s spread across BASE shares, max/min - 1 (goal <= 0.10): {fmt(goals['TB/s spread'])}"
        f"; reading the same bytes alone: {fmt(goals['floor TB/s spread'])}",
    ]
    pack = [] if ph is None else [
        "## pack_base_pairs / refine_base_pairs (in place, Hkv 8, D 128)", "",
        table(ph, prow), "",
        f"Pack/refine TB/s (read + written): {fmt([r[6] for r in prow])} (goal >= 3.6).", "",
        "A pack's mix of reads and writes alone (`_pack_traffic_kernel`: contiguous, no "
        "encoding, no in-place order; best of 4 launch shapes):", "",
        table(*traffic), ""]
    body = "\n".join([
        *pack,
        f"## elastic_attention (Hq 32, Hkv 8, D 128, {args.dtype}, full sequences)", "",
        "TB/s: bytes the kernel must read (TARGET 2 B a value, BASE 1 B); floor: a kernel that "
        "only reads as many bytes (`read_floor_us`), x floor = ours / floor; static: dense window "
        "of the same tokens; sdpa: best backend on gathered dense K/V; x sdpa = sdpa us / ours.",
        "",
        table(ah, arow), "", "Goals:", *goal_lines, "",
        "What the share goals leave a step beyond reading its bytes (`overhead_budget`): the "
        "largest cost, the same at every share, that a step may add to the read floor and still "
        "meet the goal (none: not even a launch that only reads meets it), beside what the "
        "structured rows add (us minus floor us):", "",
        table(["B", "ctx", "S", "1.7x allows us", "spread allows us", "added min us",
               "added max us"], goals["budget"]),
    ])
    name = "elastic" + ("-bf16" if dtype == torch.bfloat16 else "") + ("-quick" if args.quick else "")
    write_result(name, body)
    print(body)


if __name__ == "__main__":
    main()
