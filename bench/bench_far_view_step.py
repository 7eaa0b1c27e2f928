"""GPU benchmark: the mean far view's device work in one decode step of the engine's `kvrm`
configuration, over every layer.

The engine's shapes (Llama-3-8B heads Hq 32, Hkv 8, D 128, bf16, 32 layers, B 64 sessions,
W 1024, 128-token chunks, cap 16, pages of 16): per layer the far view gives the attention its
far slots (``FarView.prepare`` once a step: every layer's gather rows and bias; then
``FarView.view`` a layer: two index_selects of the store), the attention reads
W + cap slots (``static_sliding_attention``), and ``FarView.observe`` moves the utilities from
the call's ``lse`` (one ``far_view_observe`` launch; its torch reference, about twenty kernels,
is the peer). ``absorb`` (``far_view_summarize`` of the chunks a commit made far, then the
store and utility scatters) runs in the steps where a chunk leaves the window. Each row is the
whole step's share over 32 layers: CUDA-graph replay us (what a captured decode step pays) and
eager host us per call (what an un-captured step's host pays), and the replay time per layer.

    python -m bench.bench_far_view_step           # writes bench/results/<date>-<HHMM>-far_view-step.md
    python -m bench.bench_far_view_step --smoke   # tiny CPU shapes, no timing: the code runs
"""

from __future__ import annotations

import argparse

import torch

import kvops  # noqa: F401 - registers torch.ops.kvops
from bench.common import eager_times, table, time_graph, write_result
from kvops.ops.far_view_observe import far_view_observe_ref
from kvops.runtime import Pager
from kvops.runtime.far_view import FarView

ENGINE = dict(L=32, B=64, Hq=32, Hkv=8, D=128, W=1024, S=16, chunk=128, cap=16, context=8192)
SMOKE = dict(L=2, B=3, Hq=4, Hkv=2, D=16, W=32, S=8, chunk=16, cap=2, context=128)


def make_state(L, B, Hq, Hkv, D, W, S, chunk, cap, context, device, dtype, seed=0):
    """A FarView on a pager of the engine's geometry, with every slot's selection full of
    random chunks and one chunk a slot leaving the window, and one layer's decode inputs."""
    gen = torch.Generator().manual_seed(seed)
    pages = B * context // S
    pager = Pager(pages, S, max_sessions=B, max_blocks=context // S, device=device)
    far = FarView(pager, window_tokens=W, chunk_tokens=chunk, cap=cap, num_layers=L,
                  num_kv_heads=Hkv, head_dim=D, dtype=dtype, device=device)
    with pager.frame():
        pass
    t = pager.device_tables
    t["far_select"].copy_(torch.randint(0, far.J, t["far_select"].shape, generator=gen,
                                        dtype=torch.int32))
    t["far_leave_pages"].copy_(torch.randint(0, pages, t["far_leave_pages"].shape,
                                             generator=gen, dtype=torch.int32))
    t["far_leave_ids"].copy_(torch.randint(0, far.J, t["far_leave_ids"].shape, generator=gen,
                                           dtype=torch.int32))
    far.k_store.normal_(generator=None)
    far.v_store.normal_(generator=None)
    k_pool = torch.randn(pages, S, Hkv, D, generator=gen).to(device, dtype)
    v_pool = torch.randn(pages, S, Hkv, D, generator=gen).to(device, dtype)
    q = torch.randn(B, Hq, D, generator=gen).to(device, dtype)
    ka = torch.randn(B, W, Hkv, D, generator=gen).to(device, dtype)
    va = torch.randn(B, W, Hkv, D, generator=gen).to(device, dtype)
    ws = torch.zeros(B, dtype=torch.int32, device=device)
    wl = torch.full((B,), W, dtype=torch.int32, device=device)
    return far, (k_pool, v_pool), (q, ka, va, ws, wl)


def step_parts(far, pool, dec):
    """The step's far-view pieces as callables over every layer, attention alone as the base."""
    q, ka, va, ws, wl = dec
    L, B = far.layers, far.B
    live = torch.ones(B, dtype=torch.bool, device=q.device)
    fk, fv, fb = far.view(0, B)
    _, lse = torch.ops.kvops.static_sliding_attention(q, ka, va, ws, wl, fk, fv, fb)
    sel = far._tables()["far_select"].view(L, B, far.C)

    def attention():
        for _ in range(L):
            torch.ops.kvops.static_sliding_attention(q, ka, va, ws, wl)

    def attention_far():
        prep = far.prepare(B)
        for i in range(L):
            fk, fv, fb = far.view(i, B, prep)
            _, lse = torch.ops.kvops.static_sliding_attention(q, ka, va, ws, wl, fk, fv, fb)
            far.observe(i, q, fk, fb, lse, live=live)

    def view():
        prep = far.prepare(B)
        for i in range(L):
            far.view(i, B, prep)

    def observe():
        for i in range(L):
            far.observe(i, q, fk, fb, lse, live=live)

    def observe_torch():
        for i in range(L):
            far_view_observe_ref(q, fk, fb, lse, sel[i], far.scores[i], live, far.ema)

    def absorb():
        for i in range(L):
            far.absorb(i, *pool)

    return [("attention over W (no far slots)", attention),
             ("attention + view + observe (the kvrm step)", attention_far),
             ("view", view), ("observe (far_view_observe)", observe),
             ("observe, torch reference", observe_torch), ("absorb (steps a chunk leaves)", absorb)]


def run(shape, smoke=False):
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    far, pool, dec = make_state(**shape, device=device, dtype=dtype)
    rows = []
    for name, fn in step_parts(far, pool, dec):
        if smoke:
            fn()
            rows.append([name, "-", "-", "-"])
            continue
        replay = time_graph(fn, iters=20)[1]
        host = eager_times(fn, iters=20, warmup=3)[0]
        rows.append([name, replay, replay / shape["L"], host])
        print(rows[-1], flush=True)
    head = (f"Mean far view in the engine's decode step: {shape['L']} layers, B {shape['B']}, "
            f"Hq/Hkv {shape['Hq']}/{shape['Hkv']}, D {shape['D']}, W {shape['W']}, chunk "
            f"{shape['chunk']}, cap {shape['cap']}, {dtype}. replay: one CUDA-graph replay of "
            f"all layers (median); host: eager host us per call of all layers.\n\n")
    return head + table(["part (all layers)", "replay us", "replay us a layer", "eager host us"],
                        rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        print(run(SMOKE, smoke=True))
        return
    body = run(ENGINE)
    print(write_result("far_view-step", body))
    print(body)


if __name__ == "__main__":
    main()
