"""transformers ``generate`` tokens/s: kvops SlidingCache and PagedCache against SDPA with a
static cache and against flex attention, compiled and eager (GPU).

    python -m bench.bench_transformers --quick      # B 16 x 16k, 2 layers: about 3 minutes
    python -m bench.bench_transformers              # B 1, 16, 64 x 4k, 16k (run in parts:
    python -m bench.bench_transformers --batches 64 --contexts 16384 --impls sdpa,sliding

A random-weight Llama-3-8B-shaped model (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336,
vocab 128256, bfloat16) with fewer layers than 32 (``--layers``, default 4): 32 layers of K/V
at B 64 x 16k do not fit beside a second cache, and every compile is per layer. Each cache
starts holding ``ctx`` tokens of random K/V (no 16k-token prefill), so ``generate`` is given
the last token and a mask of ``ctx + 1``: its first step runs eagerly (transformers never
compiles the prompt step), the other ``new - 1`` steps through the compiled call when compiled.
Compiled = transformers' own auto-compile of a static cache (``CompileConfig()``: inductor,
``reduce-overhead``, so CUDA graphs); eager = ``disable_compile=True``. One warm-up
``generate`` before the timed one. tokens/s = B * new / wall time of the timed ``generate``.

Implementations: ``sdpa`` (``StaticCache``, transformers' SDPA), ``flex`` (``StaticCache``,
``flex_attention``), ``sliding`` (kvops ``SlidingCache``, window ctx + new + 1,
``static_sliding_attention``; ``sliding-far``, not run by default: with a far view of 64
chunks of 64, whose slots stay empty while the window holds the context), ``paged`` (kvops
``PagedCache``, pages of 16, ``elastic_attention``). Goals: compiled >= 1.0x SDPA, eager step
within 1.2x SDPA's.
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback

import torch

from bench.common import table, write_result

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False)
ATTN = {"sdpa": "sdpa", "flex": "flex_attention", "sliding": "kvops", "paged": "kvops",
        "sliding-far": "kvops"}


def build_model(layers: int, dtype=torch.bfloat16, device="cuda"):
    import transformers

    cfg = transformers.LlamaConfig(**LLAMA3_8B, num_hidden_layers=layers)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype,
                                                              attn_implementation="sdpa")
    return model.eval()


def context_kv(layer: int, B: int, ctx: int, cfg, dtype, device) -> tuple[torch.Tensor, ...]:
    """The same random K/V ``[B, ctx, Hkv, D]`` for layer ``layer`` in every cache (seeded), so
    that every implementation continues the same context and their tokens can be compared."""
    g = torch.Generator(device=device).manual_seed(1000 + layer)
    shape = (B, ctx, cfg.num_key_value_heads, cfg.head_dim)
    return tuple(torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(2))


def filled_cache(impl: str, model, B: int, ctx: int, new: int):
    """A cache of ``impl`` holding ``ctx`` tokens of random K/V in every row, room for ``new``."""
    import transformers

    import kvops.integrations.transformers as kt

    cfg, dev, dtype = model.config, model.device, model.dtype
    total = ctx + new + 1
    if impl in ("sdpa", "flex"):
        cache = transformers.StaticCache(config=cfg, max_cache_len=total)
        cache.early_initialization(B, cfg.num_key_value_heads, cfg.head_dim, dtype, dev)
    elif impl == "sliding":
        cache = kt.SlidingCache(model, B, window=total)
    elif impl == "sliding-far":      # the far view's work every step (its slots stay empty here)
        cache = kt.SlidingCache(model, B, window=total, far_chunks=64, far_chunk_size=64)
    elif impl == "paged":
        cache = kt.PagedCache(model, B, max_tokens=total, page_size=16)
        cache.state.reserve(torch.zeros(B, dtype=torch.long), ctx)
        S = cache.state.page_size
        i = torch.arange(ctx)
        slots = torch.stack([torch.tensor(cache.pager.pages(b))[i // S] * S + i % S
                             for b in range(B)]).to(dev)
    else:
        raise ValueError(f"impl: expected one of {list(ATTN)}, got {impl!r}")
    for n, layer in enumerate(cache.layers):
        k, v = context_kv(n, B, ctx, cfg, dtype, dev)
        if impl in ("sdpa", "flex"):
            layer.keys[:, :, :ctx] = k.transpose(1, 2)
            layer.values[:, :, :ctx] = v.transpose(1, 2)
        elif impl.startswith("sliding"):
            layer.keys[:, :ctx], layer.values[:, :ctx] = k, v
        else:
            layer.keys.view(-1, *k.shape[2:])[slots] = k
            layer.values.view(-1, *v.shape[2:])[slots] = v
        del k, v
    if ATTN[impl] == "kvops":
        cache.state.filled = True
    rewind(impl, cache, ctx)
    return cache


def rewind(impl: str, cache, ctx: int) -> None:
    """Set every row back to ``ctx`` cached tokens (after a warm-up generate)."""
    if impl in ("sdpa", "flex"):
        for layer in cache.layers:
            layer.cumulative_length.fill_(ctx)
        return
    cache.state.pos.fill_(ctx)
    if impl == "paged":
        cache.state.lens.fill_(ctx)
        cache.state.seq_lens.fill_(ctx)
        cache.state.host_pos = ctx


def run(model, impl: str, B: int, ctx: int, new: int, compiled: bool):
    """``(seconds, tokens)`` of one timed ``generate`` of ``new`` tokens a row (after a warm-up)."""
    model.set_attn_implementation(ATTN[impl])
    cache = filled_cache(impl, model, B, ctx, new)
    g = torch.Generator(device=model.device).manual_seed(7)
    ids = torch.randint(3, model.config.vocab_size, (B, 1), device=model.device, generator=g)
    mask = torch.ones(B, ctx + 1, dtype=torch.long, device=model.device)
    kw = dict(attention_mask=mask, past_key_values=cache, do_sample=False, pad_token_id=0,
              disable_compile=not compiled)
    try:
        for n in (3, new):            # warm-up: compiles and records the CUDA graph at step 2
            rewind(impl, cache, ctx)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            assert out.shape == (B, 1 + n), out.shape
        return dt, out[:, 1:].cpu()
    finally:
        del cache
        for attr in ("_compiled_call", "_last_compile_config"):
            if hasattr(model, attr):
                delattr(model, attr)
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    import warnings

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="B 16 x 16k, 2 layers, 32 new tokens (about 3 minutes on the H200)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--impls", default="sdpa,sliding,paged,flex")
    ap.add_argument("--modes", default="compiled,eager")
    ap.add_argument("--new", type=int, default=64, help="new tokens a row")
    ap.add_argument("--name", default="transformers-generate")
    a = ap.parse_args(argv)
    if a.quick:
        a.layers, a.batches, a.contexts, a.new = 2, "16", "16384", 32
        a.name += "-quick"
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch._dynamo.config.cache_size_limit = 64
    model = build_model(a.layers)
    impls = a.impls.split(",")
    a.total = (len(a.modes.split(",")) * len(a.batches.split(",")) * len(a.contexts.split(","))
               * len(impls))
    rows, results, tokens = [], {}, {}
    for mode in a.modes.split(","):
        for B in map(int, a.batches.split(",")):
            for ctx in map(int, a.contexts.split(",")):
                for impl in impls:
                    try:
                        dt, toks = run(model, impl, B, ctx, a.new, mode == "compiled")
                        results[mode, B, ctx, impl] = dt
                        ref = tokens.setdefault((B, ctx), toks)
                        same = (toks == ref).all(dim=1)
                        note = ("tokens = first run's" if bool(same.all())
                                else f"tokens = first run's in {int(same.sum())}/{B} rows")
                    except Exception as e:  # a failing peer (e.g. flex) must not end the run
                        traceback.print_exc()
                        dt, note = None, f"failed: {type(e).__name__}: {str(e)[:80]}"
                    base = results.get((mode, B, ctx, "sdpa"))
                    rows.append([mode, B, ctx, impl,
                                 f"{dt / a.new * 1e3:.2f}" if dt else "-",
                                 f"{B * a.new / dt:,.0f}" if dt else "-",
                                 f"{base / dt:.3f}x" if dt and base else "-", note])
                    print(" | ".join(map(str, rows[-1])), flush=True)
                    report(a, rows)         # after every row: a run cut short keeps its rows


def report(a, rows) -> None:
    import transformers

    body = "\n".join([
        f"transformers {transformers.__version__}; random-weight Llama-3-8B-shaped model with "
        f"{a.layers} of its 32 layers, bfloat16; {a.new} new tokens a row after `ctx` cached "
        "tokens; step = wall time of the timed generate / new tokens (its first step eager); "
        "vs SDPA = SDPA's time / this one's (> 1 is faster); note: whether the greedy tokens equal "
        "those of the first run at that (B, ctx) (every cache holds the same K/V).", "",
        table(["mode", "B", "ctx", "impl", "step ms", "tokens/s", "vs SDPA", "note"], rows)])
    path = write_result(a.name, body)
    if len(rows) == a.total:
        print(body)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
