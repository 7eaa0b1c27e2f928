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

``--retrieval``: the retrieval far view's decode step (one layer, Llama-3-8B heads Hq 32, Hkv 8,
D 128, fp16, S 16, W 512, K 64 pages = 1024 far tokens) at B x context, against a dense window of
``W + K * S`` tokens and dense attention over the whole context (kvops' kernel over one window
of the whole context, and SDPA flash, cudnn, efficient). The step with selection is ``absorb``
(the pages that left the window since the last selection, ``max_leave`` 3 a sequence, enough
for selection every 32 steps: ``far_page_summarize_into``) + ``select`` (``far_page_select``
over every far page, then the slot update) + ``static_sliding_attention``; the step without
selection is the attention alone (``begin_step(summarize=False)``: only selection reads the
bounds). The slot update runs two ways on the same
state: fused (one ``far_slot_update`` launch, what ``FarRetrieval.select`` runs) and unfused
(the op's reference bookkeeping as torch ops on the device, ``paged_gather_merged`` for the
copy, ``repeat_interleave`` for the bias). Only pages not chosen the time before are copied:
timed with rotating random queries (pages changing, nearly all new), with queries whose
selections differ by the share measured on SmolLM2 (``CHURN``) and with the same query (no
copy). Every N steps selection amortizes to ``(with + (N - 1) * without) / N``. Each row gives
the graph-replay time, the eager host time per call (the Python and launch cost of one
un-captured call, no sync), the bytes the call must read, TB/s and the fraction of the 4.65
TB/s read ceiling. ``--smoke`` runs every path once on tiny CPU shapes (no timing) to check the
code.

    python -m bench.bench_far_view --retrieval          # B 16 and 32 at 32k; writes bench/results/
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F

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


def host_us(fn, calls: int = 20) -> float:
    """Eager host time of one call in microseconds (launches queued, no sync inside)."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e6
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return host


# share of the chosen pages that are new from one decode step to the next on SmolLM2-135M (KJV,
# 2k tokens, K 64, every layer): `python -m examples.far_view_eval --task churn`,
# bench/results/2026-12-03-far_view-churn-2048-heads.md (the split rule; 0.086 with the
# best-bound rule alone, the case of the GPU tables recorded before it)
CHURN = 0.044


def new_share(ret, qs, k_pool, v_pool):
    """Share of the chosen pages that are new from one query of the rotation ``qs`` to the next
    (as a graph replaying the rotation sees it)."""
    new = []
    for a, b in zip(qs, qs[1:] + qs[:1]):
        ia = ret.select(0, a, k_pool, v_pool).clone()
        ib = ret.select(0, b, k_pool, v_pool)
        new.append((~(ib[:, :, None] == ia[:, None, :]).any(-1)).float().mean().item())
    return sum(new) / len(new)


def churn_queries(ret, q, k_pool, v_pool, target, n=4):
    """``n`` queries near ``q`` whose consecutive selections differ in about ``target`` of
    their pages (the noise scale found by bisection on the device), and the share measured."""
    noise = [torch.randn_like(q) for _ in range(n)]
    lo, hi, best = 0.0, 4.0, None
    for _ in range(14):
        eps = (lo + hi) / 2
        qs = [q + eps * z for z in noise]
        share = new_share(ret, qs, k_pool, v_pool)
        best = (qs, share)
        lo, hi = (eps, hi) if share < target else (lo, eps)
    return best


def unfused_update(ret, layer, new, k_cache, v_cache):
    """The slot update unfused, for comparison: the op's reference bookkeeping as torch ops
    (``far_slot_plan_ref``: the [B, K, K] compare, argsorts, cumsum, scatter, trains) on the
    device, the copy by ``paged_gather_merged``, the bias by ``repeat_interleave``."""
    from kvops.ops.far_slot_update import far_slot_plan_ref, slot_bias_ref

    B, K, S = ret.B, ret.K, ret.S
    bt = ret.pager.device_tables["block_table"]
    slots, trains, num = far_slot_plan_ref(new, bt, ret.index[layer], k_cache.shape[0])
    ret.index[layer].copy_(slots)
    pages = (B * K, S, *k_cache.shape[2:])
    torch.ops.kvops.paged_gather_merged(k_cache, v_cache, trains, num,
                                        ret.far_k[layer].view(pages),
                                        ret.far_v[layer].view(pages))
    ret.far_bias[layer].copy_(slot_bias_ref(slots, S))


def fused_update(ret, layer, new, k_cache, v_cache):
    """The slot update as ``FarRetrieval.select`` runs it: one ``far_slot_update`` launch."""
    torch.ops.kvops.far_slot_update(new, ret.pager.device_tables["block_table"], k_cache,
                                    v_cache, ret.index[layer], ret.far_k[layer],
                                    ret.far_v[layer], ret.far_bias[layer])


def retrieval_setup(B, T, device, *, hq=32, hkv=8, d=128, S=16, W=512, K=64, dtype=DTYPE):
    """A pager of B sessions of T - S + 1 tokens (every far page in the pool and its summary
    absorbed but the one the step's token pushes out of the window), a one-layer FarRetrieval
    on it, a dense window, and the whole-context K/V. Returns the policy, the timed calls
    ``{name: (fn or rotation of fns, bytes the call must read)}``, the far page count and the
    share of pages new a call in each case."""
    from kvops.runtime import FarRetrieval, Pager

    if T % S:
        raise ValueError(f"context: expected a multiple of S={S}, got {T}")
    blocks = T // S
    P = B * blocks + B
    pager = Pager(P, S, max_sessions=B, max_blocks=blocks + 1, device=device)
    ret = FarRetrieval(pager, window_tokens=W, top_k=K, num_layers=1, num_kv_heads=hkv,
                       head_dim=d, dtype=dtype, max_leave=3)
    with pager.frame() as f:
        for b in range(B):
            f.reserve(b, T - S)
    ret.begin_step()                          # adopts the new sessions (resets their slots)
    k_pool = torch.randn(P, S, hkv, d, device=device, dtype=dtype)
    v_pool = torch.randn(P, S, hkv, d, device=device, dtype=dtype)
    bt = pager.device_tables["block_table"]
    nf = int(ret.far_pages()[0])
    lo, hi = torch.ops.kvops.far_page_summarize(k_pool, bt[:, :nf].contiguous())
    ret.k_min[0, :, :nf], ret.k_max[0, :, :nf] = lo, hi
    ret.done.fill_(nf)
    with pager.frame() as f:                  # the decode step's token opens a block: one leaves
        for b in range(B):
            f.reserve(b, 1)
    ret.begin_step()
    q = torch.randn(B, hq, d, device=device, dtype=dtype)
    kw = torch.randn(B, W, hkv, d, device=device, dtype=dtype)
    vw = torch.randn(B, W, hkv, d, device=device, dtype=dtype)
    ws = torch.zeros(B, dtype=torch.int32, device=device)
    wl = torch.full((B,), W, dtype=torch.int32, device=device)
    wide = W + K * S
    kd = torch.randn(B, wide, hkv, d, device=device, dtype=dtype)
    vd = torch.randn(B, wide, hkv, d, device=device, dtype=dtype)
    wld = torch.full((B,), wide, dtype=torch.int32, device=device)
    kf = torch.randn(B, T, hkv, d, device=device, dtype=dtype)
    vf = torch.randn(B, T, hkv, d, device=device, dtype=dtype)
    wlf = torch.full((B,), T, dtype=torch.int32, device=device)
    attn = torch.ops.kvops.static_sliding_attention

    def topk(x):
        return torch.ops.kvops.far_page_select(x, *ret.bounds(0), ret.done, K)[0]

    def select(x, update):
        update(ret, 0, topk(x), k_pool, v_pool)

    def step(x, update):
        ret.absorb(0, k_pool)
        select(x, update)
        return attn(q, kw, vw, ws, wl, *ret.view(0))

    def reuse_step():                          # no summaries between selections
        return attn(q, kw, vw, ws, wl, *ret.view(0))

    qs_new = [torch.randn_like(q) for _ in range(4)]     # rotating queries: new pages each call
    changing = new_share(ret, qs_new, k_pool, v_pool)
    qs_churn, churn = churn_queries(ret, q, k_pool, v_pool, CHURN)
    news = {"pages changing": [topk(x) for x in qs_new],
            f"{churn:.0%} of pages new": [topk(x) for x in qs_churn], "same pages": [topk(q)]}
    queries = {"pages changing": qs_new, f"{churn:.0%} of pages new": qs_churn,
               "same pages": [q]}
    share = {"pages changing": changing, f"{churn:.0%} of pages new": churn, "same pages": 0.0}
    # bytes each part must read
    item, page = k_pool.element_size(), S * hkv * d * k_pool.element_size()
    summaries = 2 * B * nf * hkv * d * item
    absorb = B * page
    attn_far = 2 * B * wide * hkv * d * item
    fresh = {case: 2 * round(B * K * sh) * page + 12 * B * K for case, sh in share.items()}

    fns = {}
    for case, qs in queries.items():
        for tag, update in (("", fused_update), (", unfused", unfused_update)):
            fns[f"step with selection, {case}{tag}"] = (
                [lambda x=x, u=update: step(x, u) for x in qs],
                absorb + summaries + fresh[case] + attn_far)
    fns["step without selection"] = (reuse_step, attn_far)
    fns["  absorb (far_page_summarize_into)"] = (lambda: ret.absorb(0, k_pool), absorb)

    def absorb_unfused():                    # its peer: summaries, then two scatters
        lo, hi = torch.ops.kvops.far_page_summarize(k_pool, ret.leave_pages)
        at = ret.leave_ids[..., None, None].expand_as(lo)
        ret.k_min[0].scatter_(1, at, lo)
        ret.k_max[0].scatter_(1, at, hi)

    fns["  absorb, unfused (far_page_summarize + two scatter_)"] = (absorb_unfused, absorb)
    for case, qs in queries.items():
        for tag, update in (("", fused_update), (", unfused", unfused_update)):
            fns[f"  select, {case}{tag}"] = ([lambda x=x, u=update: select(x, u) for x in qs],
                                             summaries + fresh[case])
    fns["  score + top-k only"] = (lambda: topk(q), summaries)
    if device != "cpu":
        from kvops.kernels.far_page_select import far_page_scores_fwd, far_page_top_fwd
        from kvops.ops.far_page_select import _top

        lo, hi = ret.bounds(0)
        scores = far_page_scores_fwd(q, lo, hi, ret.done)
        fns["    score kernel"] = (lambda: far_page_scores_fwd(q, lo, hi, ret.done), summaries)
        fns["    choice kernel"] = (lambda: far_page_top_fwd(scores, K), scores.nbytes)
        fns["    choice by two torch.topk"] = (lambda: _top(scores, K), scores.nbytes)
    for case, new in news.items():
        for tag, update in (("", fused_update), (", unfused", unfused_update)):
            fns[f"  slot update only, {case}{tag}"] = (
                [lambda n=n, u=update: u(ret, 0, n, k_pool, v_pool) for n in new], fresh[case])
    fns["  attention W + K*S far slots"] = (lambda: attn(q, kw, vw, ws, wl, *ret.view(0)),
                                            attn_far)
    fns[f"dense window {wide}"] = (lambda: attn(q, kd, vd, ws, wld), attn_far)
    full = 2 * B * T * hkv * d * item
    fns[f"dense whole context {T} (kvops)"] = (lambda: attn(q, kf, vf, ws, wlf), full)
    if device != "cpu":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qs, ks, vs = q.unsqueeze(2), kf.transpose(1, 2).contiguous(), vf.transpose(1, 2).contiguous()
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def sdpa(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
            try:
                sdpa()
                torch.cuda.synchronize()
            except RuntimeError as e:
                print(f"SDPA {name}: not available here ({str(e).splitlines()[0][:60]})")
                continue
            fns[f"dense whole context {T} (SDPA {name})"] = (sdpa, full)
    return ret, fns, nf, share


def retrieval(batches, T, smoke=False):
    rows, notes, versus, shares = [], [], [], []
    device = "cpu" if smoke else "cuda"
    for B in batches:
        if smoke:
            ret, fns, nf, share = retrieval_setup(B, T, device, hq=4, hkv=2, d=32, S=16, W=64,
                                                  K=4, dtype=torch.float32)
        else:
            ret, fns, nf, share = retrieval_setup(B, T, device)
        shares.append(f"B {B}: " + ", ".join(f"{c} {v:.1%}" for c, v in share.items()))
        for tag in ("", ", unfused"):         # either path leaves every slot live
            fns[f"step with selection, same pages{tag}"][0][0]()
            live = int((ret.far_bias[0] == 0).sum()) // ret.S
            assert live == B * ret.K, f"expected {B * ret.K} live far pages, got {live}"
        if smoke:
            for name, (fn, _) in fns.items():
                for f in fn if isinstance(fn, list) else [fn]:
                    f()
                print(f"smoke B {B}: {name.strip()} ran", flush=True)
            continue
        times = {}
        for name, (fn, nbytes) in fns.items():
            times[name] = time_graph(fn)[1]
            rate = tbps(nbytes, times[name])
            rows.append([B, T, name, times[name], host_us(fn[0] if isinstance(fn, list) else fn),
                         nbytes / 2**20, rate, rate * 1e12 / READ_CEILING])
            print(rows[-1], flush=True)
        wide = times[[n for n in times if n.startswith("dense window")][0]]
        full = min(t for n, t in times.items() if n.startswith("dense whole"))
        churn = [n for n in times if n.startswith("step") and n.endswith("of pages new")][0]
        without = times["step without selection"]
        for tag in ("", ", unfused"):
            worst, typical = times[f"step with selection, pages changing{tag}"], times[churn + tag]
            for every in (1, 2, 4, 8, 16, 32):
                step = (typical + (every - 1) * without) / every
                step_worst = (worst + (every - 1) * without) / every
                notes.append([B, T, tag.strip(", ") or "fused", every, step, step / wide,
                              full / step, step_worst, step_worst / wide])
        for part in ("step with selection", "  select", "  slot update only"):
            for case in [n[len(part) + 2:] for n in times
                         if n.startswith(part + ",") and not n.endswith("unfused")]:
                old, ours = times[f"{part}, {case}, unfused"], times[f"{part}, {case}"]
                versus.append([B, f"{part.strip()}, {case}", old, ours, old - ours, old / ours])
        del ret, fns
        torch.cuda.empty_cache()
    if smoke:
        return "smoke only"
    body = table(["B", "context", "call", "graph us", "eager host us", "MiB read", "TB/s",
                  "of read ceiling"], rows)
    body += ("\n\nShare of the chosen pages new a call (rotating queries: consecutive selections "
             "differ by this much): " + "; ".join(shares) + ". MiB read: what the call must read "
             "(summaries, the new pages' K and V, the attention's rows), so TB/s is of useful "
             f"bytes; the ceiling is the {READ_CEILING / 1e12:.2f} TB/s streaming read.")
    body += ("\n\nThe slot update fused (one far_slot_update launch, what FarRetrieval.select "
             "runs) against unfused (torch bookkeeping + paged_gather_merged + bias), graph "
             "replay:\n\n")
    body += table(["B", "call", "unfused us", "fused us", "saved us", "x faster"], versus)
    body += ("\n\nAmortized step with selection every N steps: with the measured share of new "
             f"pages ({CHURN:.1%} a step on SmolLM2), and with the rotating random queries "
             "(pages changing, the share above: the worst case):\n\n")
    body += table(["B", "context", "slot update", "select every N", "step us",
                   "x dense window W+K*S", "x faster than dense whole context (best)",
                   "worst-case step us", "worst x dense window"], notes)
    return body


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--retrieval", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="with --retrieval: tiny CPU run")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--context", type=int, default=32768)
    args = ap.parse_args()
    if args.retrieval:
        if args.smoke:
            print(retrieval((2, 3), 400, smoke=True))
            return
        body = retrieval(args.batches, args.context)
        print(write_result("far_retrieval-step", body))
        print(body)
        return
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
