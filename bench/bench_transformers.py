"""transformers ``generate`` tokens/s: kvops SlidingCache and PagedCache against SDPA with a
static cache and against flex attention, compiled and eager.

    python -m bench.bench_transformers --record     # the grid below, one command (GPU)
    python -m bench.bench_transformers --quick      # B 16 x 16k only
    python -m bench.bench_transformers --smoke      # a toy model on the CPU (flex: ~40 s)

The grid: B 1, 16, 64 x context 4k, 16k x {sdpa, flex, sliding, paged} x {compiled, eager}, a
random-weight Llama-3-8B-shaped model (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336,
vocab 128256, bfloat16) with 2 of its 32 layers (``--layers``): every compiled cell compiles
its own decode graph (static shapes) and the compile time grows with the layers; the decode
step's attention and MLP work a layer is the full model's. Each cache starts holding ``ctx``
tokens of random K/V (no 16k-token prefill), so ``generate`` is given the last token and a
mask of ``ctx + 1``. Compiled = transformers' own auto-compile of a static cache
(``CompileConfig()``: inductor, ``reduce-overhead``, so CUDA graphs; on the CPU dynamo with the
eager backend, which checks the graph only); eager = ``disable_compile=True``.

Timing: a warm-up ``generate`` of 3 tokens (it compiles and records the CUDA graph), then
``--repeats`` timed ones each of ``--short`` and ``--new`` tokens on the same cache rewound to
``ctx``; step = the difference of the two lengths' fastest wall times / the difference of their
lengths (the first, eager, step of a ``generate`` and its fixed cost cancel); tokens/s = B /
step. A cell whose long runs are not slower than its short ones (a busy machine) reports no
step and says "timing noise". ``--rounds N`` measures every cell N times with the
implementations in turn (so the machine's drift falls on all of them alike) and reports the
median step, with the spread in the note: an eager step at B 1 is host work and moves by
tens of percent between runs. ``setup s``: the warm-up's wall time (the compile, for a
compiled cell).

Implementations: ``sdpa`` (``StaticCache``, transformers' SDPA), ``flex`` (``StaticCache``,
``flex_attention``), ``sliding`` (kvops ``SlidingCache``, window ctx + new + 1,
``static_sliding_attention``), ``paged`` (kvops ``PagedCache``, pages of 16,
``elastic_attention`` native path); not run by default: ``sliding-far`` (a far view of 64
chunks of 64, whose slots stay empty while the window holds the context) and ``paged-base``
(``PagedCache`` with fidelity, half of every row's context demoted to BASE before the warm-up:
``elastic_attention``'s structured path). Goals: compiled >= 1.0x SDPA, eager step within 1.2x
SDPA's. ``--record`` writes ``bench/results/<date>-<HHMM>-<name>.md`` (after every row, so a run cut
short keeps its rows); the table prints last either way.
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
# --smoke: the tiny shape of the CPU tests (GQA groups of 2)
TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
            tie_word_embeddings=False)
ATTN = {"sdpa": "sdpa", "flex": "flex_attention", "sliding": "kvops", "paged": "kvops",
        "sliding-far": "kvops", "paged-base": "kvops"}
PAGE = 16


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def build_model(layers: int, shape: dict = LLAMA3_8B, dtype=torch.bfloat16, device="cuda"):
    import transformers

    cfg = transformers.LlamaConfig(**shape, num_hidden_layers=layers)
    torch.manual_seed(0)
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
    elif impl in ("paged", "paged-base"):
        cache = kt.PagedCache(model, B, max_tokens=total, page_size=PAGE,
                              fidelity=True if impl == "paged-base" else None)
        cache.state.reserve(torch.zeros(B, dtype=torch.long), ctx)
        i = torch.arange(ctx)
        slots = torch.stack([torch.tensor(cache.pager.pages(b))[i // PAGE] * PAGE + i % PAGE
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
    if impl == "paged-base":         # half of every row's blocks (whole pairs) to BASE
        cache.demote(pages=max(1, B * (ctx // PAGE // 4)))
    return cache


def rewind(impl: str, cache, ctx: int) -> None:
    """Set every row back to ``ctx`` cached tokens (after a warm-up generate)."""
    if impl in ("sdpa", "flex"):
        for layer in cache.layers:
            layer.cumulative_length.fill_(ctx)
        return
    cache.state.pos.fill_(ctx)
    if impl.startswith("paged"):
        cache.state.lens.fill_(ctx)
        cache.state.seq_lens.fill_(ctx)
        cache.state.host_pos = ctx


def compile_config(device):
    """None on CUDA (transformers' default auto-compile); on the CPU dynamo with the eager
    backend (transformers auto-compiles on CUDA only), which checks the decode graph."""
    if torch.device(device).type == "cuda":
        return None
    from transformers.generation.configuration_utils import CompileConfig

    cc = CompileConfig(backend="eager", mode=None, fullgraph=True, dynamic=False)
    cc._compile_all_devices = True
    return cc


def run(model, impl: str, B: int, ctx: int, lengths: tuple[int, int], compiled: bool,
        repeats: int = 3):
    """``(step seconds, setup seconds, tokens)``: a warm-up ``generate`` of 3 tokens, then
    ``repeats`` timed ones of each of ``lengths`` tokens; step = the difference of the two
    lengths' fastest wall times / the length difference (the fastest of a few runs is the one
    least disturbed by other work on the machine)."""
    model.set_attn_implementation(ATTN[impl])
    dev = model.device
    short, new = lengths
    cache = filled_cache(impl, model, B, ctx, new)
    g = torch.Generator(device=dev).manual_seed(7)
    ids = torch.randint(3, model.config.vocab_size, (B, 1), device=dev, generator=g)
    mask = torch.ones(B, ctx + 1, dtype=torch.long, device=dev)
    kw = dict(attention_mask=mask, past_key_values=cache, do_sample=False, pad_token_id=0,
              disable_compile=not compiled)
    if compiled and compile_config(dev) is not None:
        kw["compile_config"] = compile_config(dev)
    try:
        times = {"warm-up": [], short: [], new: []}
        # the warm-up compiles and records the CUDA graph at step 2
        for key, n in [("warm-up", 3)] + [(short, short)] * repeats + [(new, new)] * repeats:
            rewind(impl, cache, ctx)
            sync(dev)
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            sync(dev)
            times[key].append(time.perf_counter() - t0)
            assert out.shape == (B, 1 + n), out.shape
        step = (min(times[new]) - min(times[short])) / (new - short)
        return step, times["warm-up"][0], out[:, 1:].cpu()
    finally:
        del cache
        for attr in ("_compiled_call", "_last_compile_config"):
            if hasattr(model, attr):
                delattr(model, attr)
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


HEADERS = ["mode", "B", "ctx", "impl", "step ms", "tokens/s", "vs SDPA", "setup s", "note"]


def main(argv: list[str] | None = None) -> list[list]:
    """Run the grid; returns the table's rows."""
    import warnings

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="B 16 x 16k only")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model (hidden 64) on the CPU (CUDA with --device cuda): "
                         "B 2 x ctx 64, 8 tokens; checks the plumbing, not speed")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--impls", default="sdpa,sliding,paged,flex")
    ap.add_argument("--modes", default="compiled,eager")
    ap.add_argument("--new", type=int, default=40, help="new tokens a row, the long timed run")
    ap.add_argument("--short", type=int, default=8, help="new tokens a row, the short timed run")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed generates of each length; the fastest counts")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every cell this many times, the impls in turn; the median "
                         "counts and the note gives the spread")
    ap.add_argument("--record", action="store_true",
                    help="write bench/results/<date>-<HHMM>-<name>.md (and a copy under $OUT)")
    ap.add_argument("--name", default="transformers-generate")
    a = ap.parse_args(argv)
    shape = LLAMA3_8B
    if a.quick:
        a.batches, a.contexts = "16", "16384"
        a.name += "-quick"
    if a.smoke:
        shape, a.batches, a.contexts, a.short, a.new = TINY, "2", "64", 4, 8
        a.device = a.device or "cpu"
        a.name += "-smoke"
    if a.repeats < 1:
        ap.error(f"--repeats: expected >= 1, got {a.repeats}")
    if a.rounds < 1:
        ap.error(f"--rounds: expected >= 1, got {a.rounds}")
    if not 0 < a.short < a.new:
        ap.error(f"--short: expected 0 < short < new={a.new}, got {a.short}")
    for impl in a.impls.split(","):
        if impl not in ATTN:
            ap.error(f"--impls: expected some of {','.join(ATTN)}, got {impl!r}")
    a.device = a.device or "cuda"
    import kvops.integrations.transformers  # noqa: F401  (registers attn_implementation="kvops")

    if torch.device(a.device).type == "cpu":
        torch.set_num_threads(1)      # tiny matmuls: more threads on a shared machine are slower
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch._dynamo.config.cache_size_limit = 64
    t_start = time.perf_counter()
    model = build_model(a.layers, shape, device=a.device)
    a.shape = "Llama-3-8B-shaped" if shape is LLAMA3_8B else "tiny (hidden 64, 4/2 heads of 16)"
    impls = a.impls.split(",")
    a.total = (len(a.modes.split(",")) * len(a.batches.split(",")) * len(a.contexts.split(","))
               * len(impls))
    rows, results, tokens = [], {}, {}
    for mode in a.modes.split(","):
        for B in map(int, a.batches.split(",")):
            for ctx in map(int, a.contexts.split(",")):
                cells = {impl: {"steps": [], "setup": None, "note": None} for impl in impls}
                for _ in range(a.rounds):     # the impls in turn, so drift hits all alike
                    for impl in impls:
                        cell = cells[impl]
                        try:
                            dt, setup, toks = run(model, impl, B, ctx, (a.short, a.new),
                                                  mode == "compiled", a.repeats)
                            cell["setup"] = cell["setup"] or setup
                            ref = tokens.setdefault((B, ctx), toks)
                            same = (toks == ref).all(dim=1)
                            cell["note"] = ("tokens = first run's" if bool(same.all()) else
                                            f"tokens = first run's in {int(same.sum())}/{B} rows")
                            cell["steps"].append(dt)
                        except Exception as e:  # a failing peer (e.g. flex) must not end the run
                            traceback.print_exc()
                            cell["note"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
                for impl in impls:
                    cell = cells[impl]
                    steps, note, setup = sorted(cell["steps"]), cell["note"], cell["setup"]
                    dt = steps[len(steps) // 2] if steps else None
                    if dt is not None and dt <= 0:  # the long runs were not slower
                        dt, note = None, f"{note}; timing noise (step {dt * 1e3:.2f} ms)"
                    elif dt is not None:
                        results[mode, B, ctx, impl] = dt
                        if len(steps) > 1:
                            note = (f"{note}; median of {len(steps)} rounds, "
                                    f"{steps[0] * 1e3:.2f}-{steps[-1] * 1e3:.2f} ms")
                    base = results.get((mode, B, ctx, "sdpa"))
                    rows.append([mode, B, ctx, impl,
                                 f"{dt * 1e3:.2f}" if dt else "-",
                                 f"{B / dt:,.0f}" if dt else "-",
                                 f"{base / dt:.3f}x" if dt and base else "-",
                                 f"{setup:.1f}" if setup is not None else "-", note])
                    print(" | ".join(map(str, rows[-1])), flush=True)
                    if a.record:
                        report(a, rows, time.perf_counter() - t_start)
    body, path = report(a, rows, time.perf_counter() - t_start, write=a.record)
    if path:
        print(f"wrote {path}")
    print(body)                       # the table last
    return rows


def report(a, rows, elapsed: float, write: bool = True):
    """``(body, path)``: the header paragraph and the table; the results file when written."""
    import transformers

    rounds = "" if a.rounds == 1 else f" (the median of {a.rounds} rounds, impls in turn)"
    body = "\n".join([
        f"transformers {transformers.__version__}; random-weight {a.shape} model with "
        f"{a.layers} of {'its 32' if a.shape.startswith('Llama') else 'its'} layers, bfloat16, "
        f"on {a.device}; `ctx` cached tokens a row, then generate; step = (wall time of a "
        f"{a.new}-token generate - that of a {a.short}-token one) / {a.new - a.short}; "
        f"tokens/s = B / step{rounds}; "
        f"vs SDPA = SDPA's step / this one's (> 1 is faster); setup s = "
        f"the 3-token warm-up generate (compile included); note: whether the greedy tokens "
        f"equal those of the first run at that (B, ctx) (every cache holds the same K/V; "
        f"random weights make near-ties, so bfloat16 rounding differences flip some). "
        f"{len(rows)} of {a.total} cells in {elapsed / 60:.1f} min.", "",
        table(HEADERS, rows)])
    return body, write_result(a.name, body) if write else None


if __name__ == "__main__":
    main()
