"""The ``kvops`` command (and ``python -m kvops``): ``kvops replay`` (trace replay through the
engine's configurations), ``kvops generate`` (text from SmolLM2 through the engine) and
``kvops demo`` (the attention-stack demo). A bare ``kvops`` runs the main job: the replay of
the shipped burst, then one ElasticKV pressure comparison at CPU scale (:data:`PRESSURE_POINT`)."""

from __future__ import annotations

import argparse
import sys

import torch


def _replay_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a trace through engine configurations")
    p.add_argument("--mode", choices=["replay", "elastic"], default="replay",
                   help="replay: one trace through the configurations; elastic: ElasticKV's "
                        "pressure comparison, a sweep of concurrency (the 4096/1024 synthetic) "
                        "or of --rate (a ShareGPT --trace) through elastic,paged,offload,reserve")
    p.add_argument("--configs", default=None,
                   help="comma-separated: static, pager, pager+merge, kvrm, paged, elastic, "
                        "elastic-watermark, elastic-eager-promote, elastic-no-promote, "
                        "elastic-general, offload, reserve (default static,paged,kvrm; --mode "
                        "elastic: elastic,paged,offload,reserve)")
    p.add_argument("--sweep", default=None,
                   help="--mode elastic: comma-separated concurrency values (synthetic), "
                        "request rates (ShareGPT) or window indices (a Mooncake --trace: 0,1,2 "
                        "= windows A, B, C); default by device")
    p.add_argument("--requests-per-client", type=int, default=None,
                   help="--mode elastic synthetic: requests a point = concurrency x this")
    p.add_argument("--concurrency", type=int, default=None,
                   help="replay as a closed loop of this many clients")
    p.add_argument("--budget-tokens", type=int, default=None,
                   help="KV budget in tokens of the model (overrides --budget-gib)")
    p.add_argument("--input-len", type=int, default=None, help="--mode elastic synthetic prompt")
    p.add_argument("--output-len", type=int, default=None, help="--mode elastic synthetic output")
    p.add_argument("--output-scale", type=float, default=None,
                   help="--mode elastic synthetic: multiply output lengths")
    p.add_argument("--ablations", action="store_true",
                   help="--mode elastic: also run ElasticKV's ablations (elastic-watermark, "
                        "elastic-eager-promote, elastic-no-promote, elastic-general)")
    p.add_argument("--clock", choices=["wall", "model"], default=None,
                   help="the engine's driving clock: wall time, or modeled step costs (the "
                        "same replay on every machine; kvops/engine/clock.py)")
    p.add_argument("--step-cost", default=None, metavar="A,B,C",
                   help="modeled step cost in seconds: A a step + B a token + C a KV token")
    p.add_argument("--thin", type=int, default=None,
                   help="--mode elastic Mooncake windows: every THIN-th request")
    p.add_argument("--eff-bar", default=None, metavar="EFF|elastic",
                   help="--mode elastic Mooncake windows: stop a target-only configuration's "
                        "replay once its Eff@300 cannot reach EFF (a share, 0-1), or 'elastic': "
                        "the elastic run's own (elastic first in --configs); the row gives the "
                        "bound it stopped under")
    p.add_argument("--fidelity", default=None, metavar="K=V,...",
                   help="elastic: Fidelity's settings, e.g. reserve_decay=0 (eager promotion), "
                        "max_promote=0 (no promotion), min_batch=32, protect_recent=4, "
                        "demote=0 (every block TARGET)")
    p.add_argument("--trace", default=None, help="trace file (default: the shipped synthetic burst)")
    p.add_argument("--kind", choices=["azure", "mooncake", "sharegpt"], default=None)
    p.add_argument("--model", choices=["smollm2", "smollm2-random", "llama3-8b", "tiny"], default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16")
    p.add_argument("--time-scale", type=float, default=None,
                   help="multiply arrival times (the Mooncake windows' dilation: larger is "
                        "lighter)")
    p.add_argument("--length-scale", type=float, default=None, help="multiply lengths")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--window-s", type=float, default=None,
                   help="azure: replay the densest window of this many seconds (default 60)")
    p.add_argument("--rate", type=float, default=None, help="sharegpt: requests/s")
    p.add_argument("--arrival", choices=["poisson", "gamma"], default=None)
    p.add_argument("--cv", type=float, default=None)
    p.add_argument("--budget-gib", type=float, default=None, help="KV budget, every configuration")
    p.add_argument("--max-seqs", type=int, default=None)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens a KV page (16); 64 or more: the paged prefill loads its key "
                        "tiles through tensor descriptors on Hopper")
    p.add_argument("--far-cap", type=int, default=None)
    p.add_argument("--far-chunk", type=int, default=None)
    p.add_argument("--far-rerank", type=int, default=None,
                   help="kvrm: decode steps between re-rankings of the far summaries (8)")
    p.add_argument("--ret-top-k", type=int, default=None,
                   help="kvrm-ret: exact far pages a session and layer (64)")
    p.add_argument("--ret-every", type=int, default=None,
                   help="kvrm-ret: decode steps between choices of the far pages (16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--long-prefill-tokens", type=int, default=None)
    p.add_argument("--preemption", choices=["newest", "longest"], default=None)
    p.add_argument("--no-prefix-sharing", action="store_true")
    p.add_argument("--no-graphs", action="store_true", help="CUDA: decode eagerly")
    p.add_argument("--no-overlap", action="store_true",
                   help="CUDA: schedule and commit after each step's tokens are back, not "
                        "while the step runs")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor parallelism over N ranks (docs/tp.md): under torchrun the "
                        "world size (one process a GPU, NCCL); otherwise N processes spawned "
                        "here (gloo on CPU, NCCL on CUDA, one GPU a rank); --tp 1 runs the "
                        "distributed path in this process")
    p.add_argument("--check-every", type=int, default=16, metavar="STEPS",
                   help="--tp: ranks compare epoch, free pages and plan/table hashes every "
                        "STEPS commits and at the end (default 16)")
    p.add_argument("--out", default="replay-out", help="directory for JSON, Markdown, figures")
    p.add_argument("--record", default=None, metavar="NAME",
                   help="also write bench/results/<date>-<HHMM>-NAME.md (date, device, commit, command, "
                        "table)")
    p.add_argument("--no-figures", action="store_true")
    p.add_argument("--no-progress", action="store_true")


FIDELITY_KEYS = {"min_batch": int, "protect_first": int, "protect_recent": int,
                 "reserve_decay": float, "headroom": int, "max_promote": int, "host_pairs": int,
                 "codec": str, "demote": lambda v: v not in ("0", "false", "False")}


def parse_fidelity(text: str | None) -> dict | None:
    """``"reserve_decay=0,max_promote=0"`` -> ``{"reserve_decay": 0.0, "max_promote": 0}``."""
    if not text:
        return None
    out = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in FIDELITY_KEYS:
            raise SystemExit(f"--fidelity: expected K=V items with K in "
                             f"{', '.join(FIDELITY_KEYS)}, got {item!r}")
        try:
            out[key] = FIDELITY_KEYS[key](value.strip())
        except ValueError:
            kind = "an int" if FIDELITY_KEYS[key] is int else "a float"
            raise SystemExit(f"--fidelity: {key}: expected {kind}, got {value!r}") from None
    return out


def _settings_kw(args, device) -> dict:
    kw = {k: getattr(args, k) for k in (
        "trace", "kind", "model", "dtype", "time_scale", "length_scale", "max_requests",
        "window_s", "rate",
        "arrival", "cv", "budget_gib", "max_seqs", "max_context", "window", "page_size",
        "far_cap", "far_chunk", "far_rerank", "ret_top_k", "ret_every", "max_num_batched_tokens",
        "long_prefill_tokens", "preemption",
        "concurrency", "budget_tokens", "input_len", "output_len", "output_scale", "clock",
        "thin")}
    if args.eff_bar is not None:
        from kvops.engine.replay import check_eff_bar
        bar = args.eff_bar
        try:
            bar = float(bar)
        except ValueError:
            pass                        # "elastic", or what check_eff_bar refuses
        try:
            check_eff_bar("--eff-bar", bar)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        kw["eff_bar"] = bar
    if args.page_size is not None:
        from kvops._checks import page_size
        try:
            page_size("--page-size", args.page_size)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    if args.configs:
        kw["configs"] = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    if args.step_cost:
        from kvops.engine.clock import StepCost

        try:
            c = StepCost.parse(args.step_cost)
        except ValueError as exc:
            raise SystemExit(f"--{exc}".replace("--step_cost", "--step-cost")) from None
        kw["step_cost"] = (c.a, c.b, c.c)
    kw["device"] = str(device)
    kw["graphs"] = False if args.no_graphs else None
    kw["overlap"] = False if args.no_overlap else None
    kw["fidelity"] = parse_fidelity(args.fidelity)
    return kw


def _device(args, tp) -> torch.device:
    """Where this process replays: its rank's device under ``--tp`` (the CPU threads shared
    among the ranks), else ``--device`` or CUDA when present."""
    if tp is None:
        return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(max(1, torch.get_num_threads() // tp.size))
    return tp.device


def elastic(args, tp=None) -> int:
    """``--mode elastic``: the pressure sweep (kvops.engine.pressure); ``tp``: this rank's
    context under ``--tp`` (rank 0 writes the results)."""
    from kvops.engine.pressure import default_points, run_sweep, sweep_settings, write

    device = _device(args, tp)
    kw = _settings_kw(args, device)
    trace = kw.pop("trace")
    kw.pop("device")
    settings, axis = sweep_settings(device, trace, **kw)
    if args.ablations:
        from kvops.engine.elastic_kv import ABLATION_CONFIGS

        settings.configs = tuple(settings.configs) + tuple(
            c for c in ABLATION_CONFIGS if c not in settings.configs)
    if args.sweep:
        try:
            points = [float(x) for x in args.sweep.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"--sweep: expected comma-separated numbers, got {args.sweep!r}") from None
    else:
        points = default_points(device, axis)
    settings.device = str(device)
    result = run_sweep(settings, axis, points, args.requests_per_client,
                       progress=not args.no_progress, tp=tp)
    if tp is not None and not tp.leader:
        return 0
    if tp is not None:
        result["tp"] = tp.size
    table = write(result, args.out, figures=not args.no_figures)
    print(table)
    if args.record:
        print(f"(recorded: {record(args.record, result, table)})")
    figs = "window_<A..>.png" if axis == "window" else "pressure_ttft.png"
    print(f"(written: {args.out}/pressure.json, pressure.md"
          f"{'' if args.no_figures else ', ' + figs})")
    return 0


def replay(args) -> int:
    import os

    if args.tp is None:
        return elastic(args) if args.mode == "elastic" else _replay(args)
    from kvops.engine import distributed
    from kvops.engine.replay import ReplaySettings, model_config
    from kvops.models.tp import check_tp

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = args.model or ReplaySettings.for_device(device).model
    try:                                    # before any process starts
        check_tp(model_config(name), args.tp)
    except ValueError as exc:
        raise SystemExit(f"kvops replay: --{exc} (model {name})") from None
    if args.tp > 1 and args.configs is None and args.mode != "elastic":
        args.configs = "static,paged"       # kvrm is not served under tp > 1 (docs/tp.md)
    if "WORLD_SIZE" in os.environ or args.tp == 1:      # torchrun, or one rank right here
        if "WORLD_SIZE" not in os.environ:                 # a group of one: any free port
            os.environ["MASTER_PORT"] = str(distributed.free_port())
        return _replay_rank(None, args)
    distributed.spawn(_replay_rank, args.tp, args)
    return 0


def _replay_rank(rank, args) -> int:
    from kvops.engine import distributed

    tp = distributed.init(args.tp, rank=rank, device=args.device, check_every=args.check_every)
    try:
        return elastic(args, tp) if args.mode == "elastic" else _replay(args, tp)
    finally:
        if rank is None:                                 # spawn's wrapper destroys its own
            import torch.distributed as dist

            dist.destroy_process_group()


def _replay(args, tp=None) -> int:
    from kvops.engine.replay import ReplaySettings, run, write

    device = _device(args, tp)
    kw = _settings_kw(args, device)
    kw["prefix_sharing"] = not args.no_prefix_sharing
    settings = ReplaySettings.for_device(device, **kw)
    result = run(settings, progress=not args.no_progress, tp=tp)
    if tp is not None and not tp.leader:
        return 0
    if tp is not None:
        result["tp"] = tp.size
    table = write(result, args.out, figures=not args.no_figures)
    print(table)
    for name, r in result["results"].items():
        for e in r["errors"]:
            print(f"{name}: refused: {e}")
    if args.record:
        path = record(args.record, result, table)
        print(f"(recorded: {path})")
    print(f"(written: {args.out}/replay.json, replay.md"
          f"{'' if args.no_figures else ', timeline.png, cdf.png'})")
    return 0


def record(name: str, result: dict, table: str) -> str:
    """``bench/results/<date>-<HHMM>-<name>.md`` (``kvops.evals.records.record_path``: two runs
    are two files): date, device, commit (``commit_id``: ``KVOPS_COMMIT`` wins), command and the
    table."""
    from kvops.evals.records import commit_id, record_path

    commit = commit_id()
    now, path = record_path("bench/results", name)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (f"# kvops replay: {name}\n\n- date: {now:%Y-%m-%d %H:%M} UTC\n"
            f"- device: {result['device_name']} ({result['dtype']}), torch {torch.__version__}\n"
            f"- commit: {commit}\n- command: `python -m kvops {' '.join(sys.argv[1:])}`\n\n"
            f"{table}\n")
    path.write_text(text)
    return str(path)


def generate(args) -> int:
    from kvops.engine.generate import generate_texts
    from kvops.engine.sampling import SamplingParams

    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        raise SystemExit(f"kvops generate: {e}") from None
    texts = generate_texts(args.prompt, args.max_new_tokens, device=args.device,
                           chat=not args.raw, sampling=sampling)
    for prompt, text in zip(args.prompt, texts):
        print(f"> {prompt}\n{text}\n")
    return 0


# The main job's pressure comparison: the CPU sweep's top point (tiny random Llama, prompts of
# 256 and outputs of 64 tokens on 128 pages of 16) through elastic and the two target-only
# managers that preempt, on the modeled clock so that the numbers do not depend on the machine;
# about 15 s on a CPU, on the CPU on any machine.
PRESSURE_POINT = ["--mode", "elastic", "--sweep", "12", "--configs", "elastic,paged,offload",
                  "--clock", "model", "--device", "cpu"]


def build_kernel(argv: list[str]) -> int:
    """``python -m kvops build-kernel [--verbose]``: compile the replay kernel and say where."""
    ap = argparse.ArgumentParser(prog="kvops build-kernel",
                                 description="build the ops' C++ dispatch kernel")
    ap.add_argument("--verbose", action="store_true", help="print the compiler command")
    args = ap.parse_args(argv)
    from kvops.ops import _replay

    path = _replay.build(verbose=args.verbose)
    print(f"replay kernel: {path}")
    print("installed at import" if _replay.wanted() and _replay.install() else
          "not installed here (it needs a CUDA device, no TRITON_INTERPRET and KVOPS_REPLAY "
          "not 0)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:                              # the main job
        rc = main(["replay"])
        if rc == 0:
            print("\nElasticKV under KV pressure, at CPU scale (kvops replay --mode elastic):")
            rc = main(["replay", *PRESSURE_POINT, "--out", "replay-out/pressure"])
        return rc
    if argv[:1] == ["demo"]:
        from kvops.__main__ import demo_main

        return demo_main(argv[1:])
    if argv[:1] == ["build-kernel"]:
        return build_kernel(argv[1:])
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "replay")
    ap = argparse.ArgumentParser(prog="kvops", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="the attention-stack demo (python -m kvops demo --help)")
    sub.add_parser("build-kernel", help="build the ops' C++ dispatch kernel (eager calls "
                   "without Python; kvops/ops/_replay.py)")
    _replay_parser(sub)
    g = sub.add_parser("generate", help="text from SmolLM2 through the engine (greedy unless "
                       "--temperature)")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, help="0: every token")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed (prompt i draws with seed + i; default: from the request "
                        "ids, the same every run)")
    g.add_argument("--device", default=None)
    g.add_argument("--raw", action="store_true", help="no chat template")
    args = ap.parse_args(argv)
    return replay(args) if args.cmd == "replay" else generate(args)


if __name__ == "__main__":
    sys.exit(main())
