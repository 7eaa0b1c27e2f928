"""Replay one trace through several configurations of the engine: the main job and
``kvops replay``. Every configuration gets the same model, the same requests (same tokens),
the same KV budget in bytes and the same scheduler settings; on CUDA each is warmed up first
(two short requests and a capture of every decode bucket), so compiles and captures during the
measured replay are counted as re-captures.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

import torch

from kvops.engine.clock import StepCost, check_clock
from kvops.engine.configs import CONFIGS, KVBudget, decode_kind, is_elastic, make_kv
from kvops.engine.engine import Engine
from kvops.engine.metrics import effective, steps_as_dict, tbt
from kvops.engine.request import Request, Status
from kvops.engine.scheduler import SchedulerConfig
from kvops.engine.traces import build_requests, load_rows, pressure_rows, trace_windows

MODELS = ("smollm2", "smollm2-random", "llama3-8b", "tiny")


def model_config(name: str):
    """The :class:`~kvops.models.LlamaConfig` of a model name (its shape, before loading)."""
    from kvops.models import SMOLLM2_135M, LlamaConfig
    from kvops.models.paged import LLAMA3_8B

    if name in ("smollm2", "smollm2-random"):
        return SMOLLM2_135M
    if name == "llama3-8b":
        return LLAMA3_8B
    if name == "tiny":
        return LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=16, hidden_dim=128, max_seq_len=16384)
    raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {name!r}")


def load_model(name: str, device: torch.device, dtype: torch.dtype):
    """``(model, note)``: SmolLM2-135M from its GGUF, or random weights of SmolLM2's,
    Llama-3-8B's or a tiny shape."""
    from kvops.models import SMOLLM2_135M, Llama, ModelUnavailable
    from kvops.models.paged import LLAMA3_8B, random_llama

    if name == "smollm2":
        try:
            return Llama.from_gguf(dtype=dtype, device=device), "SmolLM2-135M-Instruct (GGUF)"
        except ModelUnavailable as exc:
            print(f"(SmolLM2 weights unavailable, random weights of its shape instead: {exc})")
            name = "smollm2-random"
    if name == "smollm2-random":
        return random_llama(SMOLLM2_135M, dtype=dtype, device=device), "SmolLM2-135M shape, random weights"
    if name == "llama3-8b":
        return random_llama(LLAMA3_8B, dtype=dtype, device=device), "Llama-3-8B shape, random weights"
    if name == "tiny":
        return (random_llama(model_config(name), dtype=dtype, device=device, std=0.5),
                "tiny random Llama")
    raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {name!r}")


@dataclasses.dataclass
class ReplaySettings:
    configs: tuple[str, ...] = ("static", "paged", "kvrm")
    model: str = "smollm2"
    trace: str | None = None             # path; None: the shipped synthetic burst
    kind: str | None = None              # azure | mooncake | sharegpt (default: from the name)
    time_scale: float = 1.0
    length_scale: float = 1.0
    max_requests: int | None = None
    rate: float = 4.0                    # sharegpt: requests/s
    arrival: str = "poisson"             # sharegpt: poisson | gamma
    cv: float = 1.0                      # sharegpt gamma: coefficient of variation
    window_s: float = 60.0               # azure: densest window
    budget_gib: float = 0.25             # KV bytes, every configuration
    max_seqs: int = 16
    max_context: int = 512
    window: int = 128
    page_size: int = 16
    far_chunk: int = 64
    far_cap: int = 8
    far_rerank: int = 8
    ret_top_k: int = 64
    ret_every: int = 16
    max_num_batched_tokens: int = 256
    long_prefill_tokens: int = 128
    preemption: str = "newest"
    prefix_sharing: bool = True
    graphs: bool | None = None           # default: on CUDA
    thorough_warmup: bool | None = None  # walk the launch rules' classes before each replay
                                         # (warmup_requests); default: on CUDA
    overlap: bool | None = None          # schedule and commit under the last step's device
                                         # work (kvops.engine.engine); default: on CUDA
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    concurrency: int | None = None       # a closed loop of this many clients (None: open loop)
    budget_tokens: int | None = None     # KV budget in tokens of the model (overrides budget_gib)
    input_len: int = 4096                # kind "pressure": ElasticKV's synthetic (lengths x
    output_len: int = 1024               #   length_scale, outputs also x output_scale)
    output_scale: float = 1.0
    fidelity: dict | None = None         # elastic: Fidelity's keyword arguments
    clock: str = "wall"                  # the engine's driving clock: wall | model
    step_cost: tuple[float, float, float] | None = None   # model clock (a, b, c) s; None: H200_8B
    trace_window: int | None = None      # mooncake: replay window i of trace_windows (None: all)
    trace_windows: int = 3               #   windows, temporally separated
    trace_window_s: float = 300.0        #   seconds a window
    thin: int = 1                        #   every thin-th request of the window
    eff_ttft_s: float = 30.0             # Eff@300: TTFT under this
    eff_tbt_s: float = 0.3               #   and the slowest-10 % gap mean under this
    eff_bar: float | str | None = None   # stop a target-only configuration's replay once its
    #   Eff@300 cannot reach this (Engine.replay); "elastic": the elastic run's own Eff@300

    @classmethod
    def for_device(cls, dev: torch.device, **kw) -> ReplaySettings:
        """Defaults at the device's scale: SmolLM2 on a CPU (the first 16 requests, lengths / 8,
        a 0.135 GiB budget: 6 static rows of 512 tokens; 12 sessions, W 128),
        a random Llama-3-8B in bf16 on a GPU (full lengths, a 16 GiB budget: 16 static rows of
        8k tokens; 64 sessions, W 1024)."""
        if dev.type == "cuda":
            base = dict(model="llama3-8b", length_scale=1.0, budget_gib=16.0, max_seqs=64,
                        max_context=8192, window=1024, far_chunk=128, far_cap=16,
                        max_num_batched_tokens=2048, long_prefill_tokens=512)
        else:
            base = dict(model="smollm2", length_scale=0.125, max_requests=16, budget_gib=0.135,
                        max_seqs=12,
                        max_context=512, window=128, far_chunk=64, far_cap=8,
                        max_num_batched_tokens=256, long_prefill_tokens=128)
        base.update({k: v for k, v in kw.items() if v is not None})
        return cls(**base)


def _requests(s: ReplaySettings, vocab: int, max_seq_len: int) -> list[Request]:
    if s.kind == "pressure":
        rows = pressure_rows(s.max_requests or 64, input_len=s.input_len,
                             output_len=s.output_len, output_scale=s.output_scale,
                             rate=None if s.concurrency else s.rate, seed=s.seed)
    elif s.trace_window is not None:
        if not isinstance(s.thin, int) or s.thin < 1:
            raise ValueError(f"thin: expected an int >= 1, got {s.thin!r}")
        rows = load_rows(s.trace, kind="mooncake")
        windows = trace_windows(rows, s.trace_windows, s.trace_window_s)
        if not 0 <= s.trace_window < len(windows):
            raise ValueError(f"trace_window: expected 0..{len(windows) - 1}, got "
                             f"{s.trace_window!r}")
        rows = windows[s.trace_window][::s.thin]
        # long prompts are clipped to the replay's context rather than refused
        return build_requests(rows, vocab, time_scale=s.time_scale, length_scale=s.length_scale,
                              output_scale=s.output_scale, max_requests=s.max_requests,
                              max_context=s.max_context, seed=s.seed)
    else:
        rows = load_rows(s.trace, kind=s.kind, window_s=s.window_s,
                         num_requests=s.max_requests or 64, rate=s.rate, arrival=s.arrival,
                         cv=s.cv, seed=s.seed)
    return build_requests(rows, vocab, time_scale=s.time_scale, length_scale=s.length_scale,
                          max_requests=s.max_requests, max_context=max_seq_len, seed=s.seed)


def warmup_requests(vocab: int, max_context: int, long: int, rows: int,
                    thorough: bool) -> list[Request]:
    """The warm-up's requests (negative ids; prompts that share no prefix unless said; all fit
    ``max_context``). ``thorough``: Triton compiles a kernel for each class of its launch rules'
    answers (tile rows by the step's tokens and the mean chunk a sequence, splits by the
    programs, write tiles by the tokens), and those answers step at powers of two of the
    step's sizes, so the requests walk them, two output tokens each: one prompt a step of 1,
    2, 4, ... ``long`` tokens and a few between (3, 17, 100), chunked prompts (``long + 37``,
    ``2 * long``), packs of 2, 4, 8, ... and ``rows`` prompts arriving together of 1, 3 and
    ``long`` tokens (steps up to the token budget), then two prompts sharing their first
    ``long`` tokens (a prefix hit and its copy-on-write). Else two prompts of 40 tokens and
    four output tokens."""
    fit = lambda n: max(1, min(n, max_context - 8))
    if not thorough:
        return [Request(-1 - i, 0.0, [(7 * i + j) % vocab for j in range(fit(40))], 4)
                for i in range(2)]
    alone = sorted({*(2 ** i for i in range(long.bit_length()) if 2 ** i <= long), 3, 17,
                    100, long, long + 37, 2 * long})
    groups = [[n] for n in alone]
    packs = sorted({*(2 ** i for i in range(1, rows.bit_length()) if 2 ** i <= rows), rows} - {1})
    for b in packs:
        groups += [[n] * b for n in (1, 3, long)]
    reqs = []
    for t, group in enumerate(groups):
        for n in group:
            i = len(reqs)
            reqs.append(Request(-1 - i, 1e3 * t, [(7 * i + j + 1) % vocab for j in range(fit(n))],
                                2))
    total = fit(long + 37)
    head = max(1, total - 37)
    shared = [(5 + j) % vocab for j in range(head)]
    reqs += [Request(-1 - len(reqs) - i, 1e3 * (len(groups) + i),
                     shared + [i + 1] * (total - head), 2) for i in range(2)]
    return reqs


def _warmup(engine: Engine, vocab: int, max_context: int, thorough: bool | None = None) -> None:
    """:func:`warmup_requests` through the engine, so that the kernels compile before the
    measured replay, then every decode bucket once (captured on CUDA, and with a far view its
    absorb and copy trains); the engine's records start again after. ``thorough`` (default: on
    CUDA, where a kernel met first in the replay compiles inside it) walks the launch rules'
    classes; else two short prompts."""
    if thorough is None:
        thorough = engine.runner.device.type == "cuda"
    reqs = warmup_requests(vocab, max_context, engine.scheduler.cfg.long_prefill_tokens,
                           engine.runner.rows, thorough)
    engine.replay(reqs)
    runner = engine.runner
    if runner.graphs or thorough:
        runner.warm_buckets()
    engine.steps.clear()
    runner.paths.clear()
    engine.kv.prefix_hit_tokens = 0
    engine.kv.reset_counters()
    runner.buckets_used.clear()
    runner.selections = 0
    engine.warm_captures = runner.captures


def replay_dtype(settings: ReplaySettings, device: torch.device) -> torch.dtype:
    """``settings.dtype``, else bfloat16 on CUDA or when ``elastic`` runs (its BASE form needs
    a 16-bit cache), float32 otherwise."""
    if settings.dtype:
        return getattr(torch, settings.dtype)
    if device.type == "cuda" or any(is_elastic(c) for c in settings.configs):
        return torch.bfloat16
    return torch.float32


def check_eff_bar(name: str, bar) -> None:
    """``bar``: None, ``"elastic"`` or a share in [0, 1]; else ValueError naming ``name``."""
    if bar not in (None, "elastic") and (isinstance(bar, bool) or not (
            isinstance(bar, (int, float)) and 0.0 <= bar <= 1.0)):
        raise ValueError(f"{name}: expected a share in [0, 1] or 'elastic', got {bar!r}")


def run(settings: ReplaySettings, progress: bool = True, tp=None, model=None) -> dict:
    """Replay ``settings.trace`` through each configuration; returns ``{"settings", "model",
    "device", "results": {config: metrics}, "steps": {config: [step records]}, "tokens":
    {config: [outputs]}}``. ``tp``: this process's
    :class:`~kvops.engine.distributed.TPContext`; every rank calls ``run`` with the same
    settings, shards the model, and rank 0's scheduler drives (the results are rank 0's).
    ``model``: ``(model, note)`` already loaded (a sweep loads once; not with ``tp``)."""
    for c in settings.configs:
        if c not in CONFIGS:
            raise ValueError(f"configs: expected names from {', '.join(CONFIGS)}, got {c!r}")
    check_clock(settings.clock)
    want = settings.eff_bar
    if want == "elastic" and list(settings.configs[:1]) != ["elastic"]:
        raise ValueError(f"eff_bar: 'elastic' needs the elastic configuration first, got "
                         f"configs {list(settings.configs)}")
    if want is not None and tp is not None:
        raise ValueError("eff_bar: a replay under tensor parallelism runs to its end (the "
                         "ranks step in lockstep); leave eff_bar None with tp")
    if want is not None and settings.trace_window is None:
        raise ValueError("eff_bar: Eff@300 scores Mooncake windows; expected a trace_window "
                         "(kvops replay --mode elastic --trace <mooncake JSONL>), got none")
    check_eff_bar("eff_bar", want)
    step_cost = StepCost.parse(settings.step_cost) if settings.step_cost is not None else None
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if tp is not None:
        device = tp.device
        if tp.size > 1 and {"kvrm", "kvrm-ret"} & set(settings.configs):
            raise ValueError("configs: 'kvrm' and 'kvrm-ret' are not served under tensor "
                             "parallelism (tp > 1): their far views choose by attention "
                             "scores or queries, which each rank has for its own heads only; "
                             "use static, pager, pager+merge or paged")
        if model is not None:
            raise ValueError("model: a loaded model is not taken with tp (each rank shards "
                             "its own)")
    say = print if tp is None or tp.leader else (lambda *a, **k: None)
    progress = progress and (tp is None or tp.leader)
    dtype = replay_dtype(settings, device)
    positions = (model[0].cfg if model is not None else model_config(settings.model)).max_seq_len
    if settings.max_context > positions:        # prompts are clipped to max_context
        raise ValueError(f"max_context: expected at most the {settings.model} model's "
                         f"{positions} positions, got {settings.max_context}")
    model, note = model if model is not None else load_model(settings.model, device, dtype)
    whole = model.cfg                   # budgets count tokens of the whole model's heads
    if tp is not None:
        tp.check_model(model.cfg)
        model = tp.shard(model)
        note += f", tensor-parallel over {tp.size} ranks"
    cfg = model.cfg
    tok = 2 * whole.n_layers * whole.n_kv_heads * whole.head_dim \
        * torch.empty(0, dtype=dtype).element_size()
    budget_bytes = (settings.budget_tokens * tok if settings.budget_tokens
                    else int(settings.budget_gib * 2**30))
    budget = KVBudget(bytes=budget_bytes, max_seqs=settings.max_seqs,
                      max_context=settings.max_context,
                      window=settings.window, page_size=settings.page_size,
                      far_chunk=settings.far_chunk, far_cap=settings.far_cap,
                      far_rerank=settings.far_rerank, ret_top_k=settings.ret_top_k,
                      ret_every=settings.ret_every)
    sched = SchedulerConfig(settings.max_num_batched_tokens, settings.max_seqs,
                            settings.long_prefill_tokens, settings.preemption)
    out = {"settings": dataclasses.asdict(settings), "model": note, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "dtype": str(dtype).replace("torch.", ""), "budget_bytes": budget_bytes,
           "results": {}, "steps": {}, "tokens": {}, "arrivals": []}
    for name in settings.configs:
        kv = make_kv(name, budget if tp is None else tp.kv_budget(budget), cfg, dtype, device,
                     prefix_sharing=settings.prefix_sharing,
                     fidelity=settings.fidelity if is_elastic(name) else None)
        if tp is None:
            engine = Engine(model, kv, decode_kind(name), sched, graphs=settings.graphs,
                            clock=settings.clock, step_cost=step_cost, overlap=settings.overlap)
        else:                               # the ranks step in lockstep, synchronously
            engine = tp.engine(model, kv, decode_kind(name), sched, graphs=settings.graphs,
                               clock=settings.clock, step_cost=step_cost)
        engine.eff = (settings.eff_ttft_s, settings.eff_tbt_s)
        _warmup(engine, cfg.vocab_size, budget.max_context, settings.thorough_warmup)
        reqs = _requests(settings, cfg.vocab_size, cfg.max_seq_len)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=sum(r.output_len for r in reqs), desc=f"{name:12s}", unit="tok",
                       leave=False)
        t0 = time.perf_counter()
        eff_bar = None if is_elastic(name) else (
            out["results"]["elastic"]["eff"] if settings.eff_bar == "elastic" else settings.eff_bar)
        res = engine.replay(reqs, progress=bar, concurrency=settings.concurrency,
                            **({} if eff_bar is None else {"eff_bar": eff_bar}))
        if bar is not None:
            bar.close()
        res["wall_s"] = time.perf_counter() - t0
        res["config"] = name
        res["kv_slots"] = kv.max_sessions
        res["kv_pages"] = kv.total_pages if kv.kind == "paged" else None
        res["warmup_captures"] = engine.warm_captures
        res["recaptures"] = engine.runner.captures - engine.warm_captures
        res["errors"] = sorted({r.error for r in reqs if r.status is Status.REFUSED})[:3]
        say(f"{name}: {res['finished']}/{len(reqs)} done, {res['output_tok_s']:.1f} out tok/s, "
              f"TTFT p99 {res['ttft_ms']['p99']:.1f} ms, TPOT p50/p99 "
              f"{res['tpot_ms']['median']:.2f}/{res['tpot_ms']['p99']:.2f} ms, reserved "
              f"{res['reserved_gib_mean']:.3f} GiB, {res['wall_s']:.1f} s"
              + ("" if not res.get("compiles") else
                 f"; {res['compiles']} Triton compiles after warm-up: "
                 + ", ".join(f"{k} x{n}" for k, n in sorted(res["compiled"].items())))
              + ("" if res.get("stopped_s") is None else
                 f"; stopped at {res['stopped_s']:.1f} s: Eff@300 <= "
                 f"{100 * res['eff_upper']:.1f} % < the bar {100 * eff_bar:.1f} %"), flush=True)
        out["results"][name] = res
        out["steps"][name] = steps_as_dict(engine.steps)
        out["tokens"][name] = [r.output for r in reqs]
        out["arrivals"] = [r.arrival for r in reqs]
        out.setdefault("requests", {})[name] = [
            {"rid": r.rid, "arrival": r.arrival, "prompt": len(r.prompt), "output": len(r.output),
             "ttft": r.token_times[0] - r.arrival if r.token_times else None,
             "tpot": ((r.token_times[-1] - r.token_times[0]) / (len(r.output) - 1)
                      if len(r.output) > 1 else None),
             "ttft_steps": (r.token_steps[0] - r.arrival_step) if r.token_steps else None,
             "tbt": tbt(r.token_times),
             "effective": r.status is Status.FINISHED and effective(r.arrival, r.token_times,
                                                                    *engine.eff),
             "preemptions": r.preemptions, "prefix_hit": r.prefix_hit,
             "status": r.status.value} for r in reqs]
        del engine, kv
        if device.type == "cuda":                  # the next configuration gets the memory
            gc.collect()
            torch.cuda.empty_cache()
    return out


def write(result: dict, out_dir: str | Path, figures: bool = True) -> str:
    """``replay.json``, ``replay.md`` and (with matplotlib) ``timeline.png``, ``cdf.png`` in
    ``out_dir``; returns the Markdown table."""
    from kvops.engine.report import markdown, plot, write_outputs

    return write_outputs(result, out_dir, "replay", markdown, plot, figures)
