"""GPU benchmark: paged_prefill_attention against SDPA (flash, cuDNN) over the gathered dense K/V
and compiled flex_attention with a paged block mask.

One sequence prefills ``new`` tokens over a ``prefix`` already in the pool (bf16, pages of
``--page`` tokens, 16 by default; pages of 64 or more take the op's descriptor (TMA) path on
Hopper; its pages come in runs of 8 consecutive pages placed at random in the pool, as a pager
preferring contiguous spans leaves them, so flex's 128-key blocks map to whole runs). The SDPA
peers get the same K/V gathered into dense ``[1, Hkv, prefix + new, D]`` tensors (the gather
not timed) with a bottom-right causal mask; flex reads the pool itself, through a block mask
mapping each physical key block to its logical position. Times: medians of CUDA-graph
replays; eager host/wall us per call (bench.common.eager_times). TFLOP/s counts ``4 Hq D`` a
visible (query, key) pair, against the H200's 989 TFLOP/s dense bf16; TB/s the K/V, q and out
bytes once, against the 4.65 TB/s read ceiling.

    python -m bench.bench_paged_prefill            # Llama-3-8B and Qwen2.5-7B heads, full sweep
    python -m bench.bench_paged_prefill --quick    # four shapes and the chunked 8k
    python -m bench.bench_paged_prefill --no-flex  # without flex (its compiles take a while)
    python -m bench.bench_paged_prefill --quick --page 64   # pages of 64 tokens
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kvops  # noqa: F401 - registers torch.ops.kvops
import kvops.kernels.paged_prefill_attention as prefill_kernel
from bench.common import READ_CEILING, eager_times, table, tbps, time_graph, write_result
from kvops.kernels.paged_prefill_attention import prefill_tile, prefill_tma, prefill_tma_rows

HEADS = {"llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128)}
S, RUN, DTYPE = 16, 8, torch.bfloat16
NEW_ROWS = False   # --new-rows: calls take the chunk's own K/V rows (k=, v=)
FLOP_CEILING = 989e12
# (BLOCK_M, BLOCK_N, num_warps, num_stages) the --tune sweep forces, around the rule's
# (128, 64, 8, 3) for D 128 bf16
TUNE_CONFIGS = ((128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
                (128, 32, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 4, 3))


def make_case(Hq, Hkv, D, prefix, new, seed=0):
    """Pool, table and q for one sequence of ``prefix + new`` tokens (the new ones included)."""
    gen = torch.Generator().manual_seed(seed)
    n_ctx = prefix + new
    blocks = -(-n_ctx // S)
    runs = -(-blocks // RUN)
    P = (2 * runs + 1) * RUN                         # half the pool is other sequences' pages
    order = torch.randperm(P // RUN, generator=gen)[:runs]
    pages = (order[:, None] * RUN + torch.arange(RUN)[None, :]).flatten()[:blocks]
    k_cache = torch.randn(P, S, Hkv, D, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(P, S, Hkv, D, dtype=DTYPE, device="cuda")
    q = torch.randn(new, Hq, D, dtype=DTYPE, device="cuda")
    table = pages.int().cuda()[None, :]
    qs = torch.tensor([0, new], dtype=torch.int32, device="cuda")
    lens = torch.tensor([n_ctx], dtype=torch.int32, device="cuda")
    case = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, query_start=qs,
                seq_lens=lens)
    if NEW_ROWS:       # the new tokens' rows the pool holds, as an engine passes them
        at = table[0].long()
        case["k"], case["v"] = (c[at].flatten(0, 1)[prefix:n_ctx].contiguous()
                                for c in (k_cache, v_cache))
    return case


def dense(case):
    """q [1, Hq, new, D] and the gathered K/V [1, Hkv, ctx, D], contiguous (SDPA's layout)."""
    n_ctx = int(case["seq_lens"][0])
    pages = case["block_table"][0].long()
    k = case["k_cache"][pages].flatten(0, 1)[:n_ctx]
    v = case["v_cache"][pages].flatten(0, 1)[:n_ctx]
    return (case["q"].transpose(0, 1)[None].contiguous(), k.transpose(0, 1)[None].contiguous(),
            v.transpose(0, 1)[None].contiguous())


def sdpa_peer(q, k, v, backend):
    """SDPA under one backend: causal when there is no prefix, else a bottom-right causal
    bias (flash; cuDNN gets a boolean mask), GQA native or, where a path refuses it, over KV
    heads expanded to Hq. Raises if the backend refuses the inputs."""
    from torch.nn.attention.bias import causal_lower_right

    new, n_ctx = q.shape[2], k.shape[2]
    if new == n_ctx:
        kwargs = dict(is_causal=True)
    elif backend == SDPBackend.FLASH_ATTENTION:
        kwargs = dict(attn_mask=causal_lower_right(new, n_ctx))
    else:
        j = torch.arange(n_ctx, device=q.device)
        kwargs = dict(attn_mask=j[None, :] <= (n_ctx - new + torch.arange(new, device=q.device)
                                              )[:, None])

    def make(k, v, gqa):
        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kwargs)
        return run

    try:
        run = make(k, v, True)
        run()
    except Exception:  # noqa: BLE001 - some mask paths take no GQA: expand the KV heads
        group = q.shape[1] // k.shape[1]
        run = make(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False)
        run()
    torch.cuda.synchronize()
    return run


def flex_peer(case, cache):
    """Compiled flex_attention over the pool as one long key sequence [1, Hkv, P * S, D] with a
    block mask from the block table: key slot ``x`` is logical position ``inv[x // S] * S + x %
    S`` (``inv`` the page -> logical block map, -1 for other pages)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in cache:
        cache["fn"] = torch.compile(flex_attention)
    q, kc, vc = case["q"], case["k_cache"], case["v_cache"]
    P, _, Hkv, D = kc.shape
    new, n_ctx = q.shape[0], int(case["seq_lens"][0])
    pages = case["block_table"][0].long()
    inv = torch.full((P,), -1, dtype=torch.long, device="cuda")
    inv[pages] = torch.arange(pages.numel(), device="cuda")
    prefix = n_ctx - new

    def mask_mod(b, h, q_idx, kv_idx):
        block = inv[kv_idx // S]
        pos = block * S + kv_idx % S
        return (block >= 0) & (pos < n_ctx) & (pos <= prefix + q_idx)

    mask = create_block_mask(mask_mod, 1, None, new, P * S, device="cuda", BLOCK_SIZE=128)
    qf = q.transpose(0, 1)[None].contiguous()
    kf = kc.view(P * S, Hkv, D).transpose(0, 1)[None].contiguous()
    vf = vc.view(P * S, Hkv, D).transpose(0, 1)[None].contiguous()
    fn = cache["fn"]

    def run():
        return fn(qf, kf, vf, block_mask=mask, enable_gqa=True)
    out = run()
    torch.cuda.synchronize()
    return run, out


def visible_pairs(prefix, new):
    return new * prefix + new * (new + 1) // 2


def check_once(case, out):
    """Compare with SDPA's math backend over the dense K/V on the last 64 queries."""
    q, k, v = dense(case)
    tail, n_ctx = min(64, q.shape[2]), k.shape[2]
    pos = n_ctx - tail + torch.arange(tail, device=q.device)
    mask = torch.arange(n_ctx, device=q.device)[None, :] <= pos[:, None]
    with sdpa_kernel([SDPBackend.MATH]):
        want = F.scaled_dot_product_attention(q[:, :, -tail:].float(), k.float(), v.float(),
                                              attn_mask=mask, enable_gqa=True)
    err = (out[-tail:].float() - want[0].transpose(0, 1)).abs().max().item()
    assert err < 3e-2, f"kernel disagrees with SDPA math: max err {err}"


def sweep(models, news, prefixes, with_flex):
    rows, ratios = [], []
    flex_cache = {}
    for model, new, prefix in itertools.product(models, news, prefixes):
        t_start = time.perf_counter()
        Hq, Hkv, D = HEADS[model]
        case = make_case(Hq, Hkv, D, prefix, new)
        ours = lambda c=case: torch.ops.kvops.paged_prefill_attention(**c)
        prefill_kernel._PLANS.clear()
        check_once(case, ours()[0])
        gluon = any(p.gluon for p in prefill_kernel._PLANS.values())
        t_ours = time_graph(ours)[1]
        host, wall = eager_times(ours, iters=20)
        flops = 4 * Hq * D * visible_pairs(prefix, new)
        nbytes = (2 * (prefix + new) * Hkv + 2 * new * Hq) * D * DTYPE.itemsize
        cap = torch.cuda.get_device_capability()
        tma = prefill_tma(S, D, DTYPE, cap, True)
        rows_tma = NEW_ROWS and prefill_tma_rows(D, DTYPE, cap, True)
        label = ("gluon (128, 128, 4+4+1)" if gluon else
                 str(prefill_tile(new, 1, Hq // Hkv, D, DTYPE, tma)[:3])
                 + (" tma" if tma else "") + (" rows-tma" if rows_tma else ""))
        line = [model, new, prefix, label,
                t_ours,
                flops / t_ours / 1e6, flops / (t_ours * 1e-6) / FLOP_CEILING,
                tbps(nbytes, t_ours) * 1e12 / READ_CEILING, host, wall]
        q, k, v = dense(case)
        peers = {}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                peers[name] = sdpa_peer(q, k, v, backend)
            except Exception as e:  # noqa: BLE001 - a backend refusing the shape is reported
                peers[name] = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:30]})"
        if with_flex:
            try:
                peers["flex"] = flex_peer(case, flex_cache)[0]
            except Exception as e:  # noqa: BLE001 - a compile failure is reported, not fatal
                peers["flex"] = f"n/a ({type(e).__name__})"
        best = None
        for fn in peers.values():
            if isinstance(fn, str):
                line += [fn, ""]
                continue
            t = time_graph(fn)[1]
            h, _ = eager_times(fn, iters=20)
            line += [t, h]
            best = t if best is None else min(best, t)
        ratio = best / t_ours if best else float("nan")
        line.append(ratio)
        ratios.append((model, new, prefix, ratio))
        rows.append(line)
        print(" ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in line),
              f"({time.perf_counter() - t_start:.1f} s)", flush=True)
        del case, q, k, v, peers
        torch.cuda.empty_cache()
    headers = ["model", "new", "prefix", "tile (M, N, warps)", "kvops us", "TFLOP/s", "of peak",
               "of read ceil", "host us", "wall us", "flash us", "flash host", "cudnn us",
               "cudnn host"] + (["flex us", "flex host"] if with_flex else []) + ["x best peer"]
    return table(headers, rows), ratios


CHUNK_ROUNDS = 7   # interleaved rounds of (whole, chunks): the GPU's speed drifts within a run


def chunked(model="llama3-8b", total=8192, chunk=512):
    """One ``total``-token prefill against the same sequence in ``chunk``-token calls, each over
    the K/V the earlier chunks left (all calls replayed in one graph), timed in CHUNK_ROUNDS
    interleaved rounds: the medians of the whole's and the chunks' times and of each round's
    ratio, with the ratio's range; then the chunks with their key ranges split in 2 and 4."""
    Hq, Hkv, D = HEADS[model]
    case = make_case(Hq, Hkv, D, 0, total)
    whole = lambda: torch.ops.kvops.paged_prefill_attention(**case)
    parts = []
    for start in range(0, total, chunk):
        part = dict(case, q=case["q"][start:start + chunk].contiguous(),
                    query_start=torch.tensor([0, chunk], dtype=torch.int32, device="cuda"),
                    seq_lens=torch.tensor([start + chunk], dtype=torch.int32, device="cuda"))
        if NEW_ROWS:
            part["k"], part["v"] = (case[n][start:start + chunk] for n in ("k", "v"))
        parts.append(part)
    got = torch.cat([torch.ops.kvops.paged_prefill_attention(**p)[0] for p in parts])
    err = (got.float() - whole()[0].float()).abs().max().item()
    assert err < 2e-2, f"chunked prefill differs from the whole: {err}"
    all_parts = lambda: [torch.ops.kvops.paged_prefill_attention(**p) for p in parts]
    t_whole, t_parts = [], []
    for _ in range(CHUNK_ROUNDS):
        t_whole.append(time_graph(whole)[1])
        t_parts.append(time_graph(all_parts)[1])
    ratios = sorted(p / w for p, w in zip(t_parts, t_whole))
    # the chunks' key ranges split as the rule does not (a chunk's 128 programs fill the SMs
    # once, one program an SM): what the split rule leaves on the table
    from kvops.kernels.paged_prefill_attention import paged_prefill_attention_fwd
    t_split = {n: time_graph(lambda n=n: [paged_prefill_attention_fwd(**p, num_splits=n)
                                          for p in parts])[1] for n in (2, 4)}
    return (statistics.median(t_whole), statistics.median(t_parts),
            (statistics.median(ratios), ratios[0], ratios[-1]), t_split)


def tune(shapes):
    """Tile configurations forced on ``shapes`` (model, new, prefix): per shape the rule's tile
    at 1, 2, 4 and 8 key splits, with page ids prefetched a tile ahead (two tiles), the three
    fastest tiles (splits by the rule), and the rules' own choice."""
    from kvops.kernels.paged_prefill_attention import paged_prefill_attention_fwd

    rows = []
    for model, new, prefix in shapes:
        Hq, Hkv, D = HEADS[model]
        case = make_case(Hq, Hkv, D, prefix, new)
        flops = 4 * Hq * D * visible_pairs(prefix, new)
        results = []
        default = time_graph(lambda c=case: torch.ops.kvops.paged_prefill_attention(**c),
                             iters=10)[1]
        for bm, bn, nw, ns in TUNE_CONFIGS:
            fn = lambda c=case, bm=bm, bn=bn, nw=nw, ns=ns: paged_prefill_attention_fwd(
                **c, block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
            try:
                t = time_graph(fn, iters=10)[1]
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
                print("skip", bm, bn, nw, ns, type(e).__name__, flush=True)
                continue
            results.append((t, bm, bn, nw, ns))
        results.sort()
        rule = prefill_tile(new, 1, Hq // Hkv, D, DTYPE,
                            prefill_tma(S, D, DTYPE, torch.cuda.get_device_capability(), True))
        for nsp in (1, 2, 4, 8):
            fn = lambda c=case, n=nsp: paged_prefill_attention_fwd(**c, num_splits=n)
            t = time_graph(fn, iters=10)[1]
            rows.append([model, new, prefix, "rule, splits " + str(nsp), t, flops / t / 1e6])
        for bm, bn, nw, ns in ((rule[0], rule[1], rule[2], rule[3]), (128, 128, 8, 2)):
            fn = lambda c=case, bm=bm, bn=bn, nw=nw, ns=ns: paged_prefill_attention_fwd(
                **c, block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, prefetch=True)
            try:
                t = time_graph(fn, iters=10)[1]
            except ValueError as e:   # a tile wider than a page on the descriptor path
                print("skip", bm, bn, nw, ns, e, flush=True)
                continue
            rows.append([model, new, prefix, f"{bm}/{bn}/{nw}/{ns} prefetch", t, flops / t / 1e6])
        off = time_graph(lambda c=case: paged_prefill_attention_fwd(**c, tma=False), iters=10)[1]
        rows.append([model, new, prefix, "rule without descriptors", off, flops / off / 1e6])
        for t, bm, bn, nw, ns in results[:3]:
            rows.append([model, new, prefix, f"{bm}/{bn}/{nw}/{ns}", t, flops / t / 1e6])
        rows.append([model, new, prefix, "rule " + "/".join(map(str, rule)), default,
                     flops / default / 1e6])
        print("\n".join(" ".join(str(c) for c in r) for r in rows[-10:]), flush=True)
        del case
        torch.cuda.empty_cache()
    return table(["model", "new", "prefix", "BM/BN/warps/stages", "us", "TFLOP/s"], rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--tune", default=None,
                    help="tile sweep on model:new:prefix shapes, comma separated")
    ap.add_argument("--news", default=None, help="new-token counts, comma separated")
    ap.add_argument("--prefixes", default=None, help="prefix lengths, comma separated")
    ap.add_argument("--page", type=int, default=16, help="tokens a page (S)")
    ap.add_argument("--jit-descriptors", action="store_true",
                    help="descriptor plans launch through the JIT, not the compiled launcher")
    ap.add_argument("--no-gluon", action="store_true",
                    help="the Triton kernel where the rule would take the Gluon one")
    ap.add_argument("--no-chunked", action="store_true",
                    help="skip the chunked-prefill goal (a sweep run in parts measures it once)")
    ap.add_argument("--new-rows", action="store_true",
                    help="calls take the chunk's own K/V rows (k=, v=), as the engine's do")
    args = ap.parse_args()
    global S, NEW_ROWS
    S, NEW_ROWS = args.page, args.new_rows
    prefill_kernel.TMA_DIRECT = not args.jit_descriptors
    prefill_kernel.GLUON = not args.no_gluon
    if args.tune:
        shapes = [(m, int(n), int(p)) for m, n, p in (x.split(":") for x in args.tune.split(","))]
        body = tune(shapes)
        write_result("paged_prefill_attention-tune", body)
        print(body)
        return
    if args.quick:
        shapes = [("llama3-8b", 512, 0), ("llama3-8b", 2048, 4096), ("llama3-8b", 8192, 0),
                  ("qwen2.5-7b", 512, 16384)]
    else:
        news = (512, 2048, 8192)
        prefixes = (0, 4096, 16384)
        if args.news:
            news = tuple(int(x) for x in args.news.split(","))
        if args.prefixes:
            prefixes = tuple(int(x) for x in args.prefixes.split(","))
        shapes = list(itertools.product(HEADS, news, prefixes))
    bodies, ratios = [], []
    for model, new, prefix in shapes:
        body, r = sweep((model,), (new,), (prefix,), not args.no_flex)
        bodies.append(body)
        ratios += r
    rows = [b.splitlines()[2] for b in bodies]
    body = "\n".join(bodies[0].splitlines()[:2] + rows)
    goals = [f"- worst shape against the best peer: {min(r[3] for r in ratios):.2f}x "
             f"(goal >= 0.9x)"]
    if not args.no_chunked:
        t_whole, t_parts, (ratio, lo, hi), t_split = chunked()
        goals += [f"- 8k prefill in 512-token chunks: {t_parts:.1f} us against {t_whole:.1f} us "
                  f"whole (medians of {CHUNK_ROUNDS} interleaved rounds), {ratio:.3f}x "
                  f"(rounds {lo:.3f}-{hi:.3f}; goal <= 1.15x)",
                  "- the chunks with their key ranges split in "
                  + ", ".join(f"{n}: {t:.1f} us ({t / t_whole:.2f}x)" for n, t in t_split.items())]
    how = ("; descriptor plans launched through the JIT" if args.jit_descriptors else "") + (
        "; the chunk's own K/V rows given (k=, v=)" if args.new_rows else "") + (
        "; the Triton kernel only" if args.no_gluon else "")
    text = (f"bf16, S {S}, one sequence{how}; pages in runs of {RUN}. us: median graph replay; host: "
            f"eager host us per call.\n\n" + body + "\n\nGoals:\n" + "\n".join(goals) + "\n")
    partial = args.quick or args.news or args.prefixes or args.no_flex or args.no_chunked
    write_result("paged_prefill_attention" + ("-partial" if partial else "")
                 + (f"-S{S}" if S != 16 else "") + ("-jit-descriptors" if args.jit_descriptors else "")
                 + ("-new-rows" if args.new_rows else "") + ("-no-gluon" if args.no_gluon else ""),
                 text)
    print(text)


if __name__ == "__main__":
    main()
