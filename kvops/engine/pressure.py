"""ElasticKV's pressure comparison (``kvops replay --mode elastic``): the same requests through
``elastic``, ``paged`` (recompute), ``offload`` (swap) and ``reserve`` (worst case) on one KV
budget, and with ``--ablations`` ElasticKV's four ablations
(:data:`kvops.engine.elastic_kv.ABLATION_CONFIGS`), at each
point of a sweep: the high-pressure synthetic (:func:`~kvops.engine.traces.pressure_rows`,
fixed prompt and output lengths) at rising closed-loop concurrency, ShareGPT lengths at rising
Poisson request rates, or the three temporally separated 300 s windows of a Mooncake trace
(:func:`window_settings`, scored by Eff@300). One model serves every point (loaded once).
Latencies are reported on the wall clock, the modeled clock and in engine steps
(:mod:`kvops.engine.clock`).

Synthetic defaults by device (:func:`sweep_settings`): on a CPU a tiny random Llama in
bfloat16, prompts of 256 and outputs of 64 tokens (the paper's 4096 / 1024 at lengths / 16), a
budget of 2,048 tokens (128 pages of 16; 6.4 whole contexts), 12 sessions, concurrency 4, 8, 12
with two requests a client; on CUDA random weights of Llama-3-8B's shape in bfloat16, prompts
of 1024 and outputs of 256 tokens (the paper's 4:1, at a quarter of its lengths), a 5 GiB
budget (40,960 tokens: 32 whole contexts of 1,280), concurrency 8, 24, 40 with four requests
a client (later waves arrive while the budget is full: the KV-bound regime the paper
measures; at 40 the clients need 1.25x the budget's whole contexts), 64 sessions, 4,096 tokens
a step, chunks of 2,048.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from kvops.engine.clock import H200_8B
from kvops.engine.configs import is_elastic
from kvops.engine.replay import ReplaySettings, load_model, replay_dtype, run
from kvops.engine.report import write_outputs

PRESSURE_CONFIGS = ("elastic", "paged", "offload", "reserve")
WINDOW_NAMES = "ABCDEFGH"


def is_mooncake(trace: str | None) -> bool:
    return bool(trace) and (Path(trace).suffix == ".jsonl" or "mooncake" in Path(trace).name)


def sweep_settings(device: torch.device, trace: str | None = None, **kw) -> tuple[ReplaySettings, str]:
    """``(settings, axis)``: the device's defaults for the sweep (module doc), ``axis``
    ``"concurrency"`` for the synthetic, ``"rate"`` for a ShareGPT stats ``trace`` or
    ``"window"`` for a Mooncake JSONL ``trace``; ``kw`` overrides (None leaves a default)."""
    if is_mooncake(trace):
        return window_settings(device, trace, **kw), "window"
    axis = "rate" if trace else "concurrency"
    if device.type == "cuda":
        base = dict(model="llama3-8b", budget_tokens=40960, max_seqs=64, max_context=8192,
                    max_num_batched_tokens=4096, long_prefill_tokens=2048, input_len=1024,
                    output_len=256, output_scale=1.0, length_scale=1.0, max_requests=None)
        if trace:
            base.update(max_requests=100)
    else:
        base = dict(model="tiny", budget_tokens=2048, max_seqs=12, max_context=320,
                    max_num_batched_tokens=128, long_prefill_tokens=64, input_len=4096,
                    output_len=1024, output_scale=1.0, length_scale=1 / 16,
                    max_requests=None)
        if trace:
            base.update(length_scale=0.125, max_requests=24, max_context=1024)
    base.update(configs=PRESSURE_CONFIGS, kind="sharegpt" if trace else "pressure", trace=trace,
                dtype="bfloat16", prefix_sharing=False)
    base.update({k: v for k, v in kw.items() if v is not None})
    if base.get("step_cost") is None:
        base["step_cost"] = _cost(base["length_scale"])
    return ReplaySettings(**base), axis


def _cost(length_scale: float) -> tuple[float, float, float]:
    c = H200_8B.scaled(length_scale)
    return (c.a, c.b, c.c)


def window_settings(device: torch.device, trace: str, **kw) -> ReplaySettings:
    """Mooncake windows (module doc): on CUDA every 32nd request of each 300 s window at full
    length (prompts clipped so that prompt and output fit Llama-3-8B's 8,192 positions), time
    x 0.1, a 4 GiB budget (32,768 tokens, 5.6-5.9 of the windows' mean requests), on the wall
    clock; on a CPU every 64th request, prompts x 1/32 and outputs x 1/8, time x 0.02, on the
    modeled clock with :data:`~kvops.engine.clock.H200_8B` scaled to the lengths (a prompt
    costs what the full-length prompt would)."""
    if device.type == "cuda":
        base = dict(model="llama3-8b", budget_tokens=32768, max_seqs=64, max_context=8192,
                    max_num_batched_tokens=4096, long_prefill_tokens=2048, length_scale=1.0,
                    output_scale=1.0, time_scale=0.1, thin=32, clock="wall")
    else:
        base = dict(model="tiny", budget_tokens=1024, max_seqs=12, max_context=512,
                    max_num_batched_tokens=128, long_prefill_tokens=64, length_scale=1 / 32,
                    output_scale=4.0, time_scale=0.02, thin=64, clock="model")
    base.update(configs=PRESSURE_CONFIGS, kind="mooncake", trace=trace, dtype="bfloat16",
                prefix_sharing=False, trace_window=0, trace_windows=3, trace_window_s=300.0,
                max_requests=None)
    base.update({k: v for k, v in kw.items() if v is not None})
    if base.get("step_cost") is None:
        base["step_cost"] = _cost(base["length_scale"])
    return ReplaySettings(**base)


def default_points(device: torch.device, axis: str) -> tuple[float, ...]:
    if axis == "window":
        return (0, 1, 2)
    if axis == "rate":
        return (2.0, 4.0, 8.0) if device.type == "cuda" else (4.0, 8.0, 16.0)
    return (8, 24, 40) if device.type == "cuda" else (4, 8, 12)


def run_sweep(settings: ReplaySettings, axis: str, points, requests_per_client: int | None = None,
              progress: bool = True, tp=None) -> dict:
    """Every point of the sweep through every configuration; returns ``{"settings", "axis",
    "points": [{"x", "results": {config: metrics}, "steps": {config: [records]}}], "model",
    "device_name", "dtype", "budget_bytes"}``. ``requests_per_client``: requests at a
    concurrency point = clients x this (default 4 on CUDA, 2 on a CPU). ``tp``: this
    process's :class:`~kvops.engine.distributed.TPContext` (every rank calls with the same
    arguments; each point shards the model anew; the results are rank 0's)."""
    if axis not in ("concurrency", "rate", "window"):
        raise ValueError(f"axis: expected 'concurrency', 'rate' or 'window', got {axis!r}")
    points = list(points)
    if axis == "window":
        if not points or any(p != int(p) or not 0 <= p < settings.trace_windows for p in points):
            raise ValueError(f"points: expected window indices in 0..{settings.trace_windows - 1}"
                             f", got {points!r}")
    elif not points or any(not p > 0 for p in points):
        raise ValueError(f"points: expected positive numbers, got {points!r}")
    device = tp.device if tp is not None else torch.device(
        settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    settings = dataclasses.replace(settings, device=str(device))
    per = requests_per_client or (4 if device.type == "cuda" else 2)
    model = None if tp is not None else load_model(settings.model, device,
                                                   replay_dtype(settings, device))
    say = print if tp is None or tp.leader else (lambda *a, **k: None)
    out = {"settings": dataclasses.asdict(settings), "axis": axis, "points": []}
    for x in points:
        if axis == "concurrency":
            c = int(x)
            s = dataclasses.replace(settings, concurrency=c,
                                    max_requests=settings.max_requests or c * per)
        elif axis == "window":
            s = dataclasses.replace(settings, trace_window=int(x), concurrency=None)
        else:
            s = dataclasses.replace(settings, rate=float(x), concurrency=None)
        say(f"-- {axis} {_label(axis, x)}", flush=True)
        r = run(s, progress=progress, model=model, tp=tp)
        point = {"x": x, "results": r["results"], "steps": r["steps"]}
        if axis == "window":            # the offered load of Figure 6
            first = next(iter(r["requests"].values()))
            point["offered"] = [(q["arrival"], q["prompt"]) for q in first]
        out["points"].append(point)
        out.update(model=r["model"], device_name=r["device_name"], dtype=r["dtype"],
                   budget_bytes=r["budget_bytes"])
    return out


def _f(x, nd=1):
    return "-" if x is None or x != x else f"{x:.{nd}f}"


def _label(axis: str, x) -> str:
    return WINDOW_NAMES[int(x)] if axis == "window" else f"{x:g}"


def _mp(st: dict, nd: int = 1) -> str:
    return f"{_f(st['mean'], nd)} / {_f(st['p90'], nd)}"


def markdown(result: dict) -> str:
    s, axis = result["settings"], result["axis"]
    if s["kind"] == "pressure":
        work = (f"prompts {round(s['input_len'] * s['length_scale'])}, outputs "
                f"{round(s['output_len'] * s['length_scale'] * s['output_scale'])} tokens, "
                f"closed loop")
    elif axis == "window":
        work = (f"Mooncake windows ({Path(s['trace']).name}): {s['trace_windows']} of "
                f"{s['trace_window_s']:g} s, every {s['thin']}. request, prompts x"
                f"{s['length_scale']:g}, outputs x{s['length_scale'] * s['output_scale']:g} "
                f"(clipped to {s['max_context']} tokens), arrivals x{s['time_scale']:g} "
                f"(dilation)")
    else:
        work = f"ShareGPT lengths x{s['length_scale']} ({s['trace']}), Poisson arrivals"
    a, b, c = s["step_cost"]
    head = (f"kvops replay --mode elastic: {result['model']}, {result['dtype']} on "
            f"{result['device_name']}; {work}; KV budget {result['budget_bytes'] / 2**30:.3f} GiB "
            f"({s['budget_tokens'] or '-'} tokens), {s['max_seqs']} sessions, pages of "
            f"{s['page_size']}, {s['max_num_batched_tokens']} tokens/step. Engine clock: "
            f"{s['clock']}; modeled "
            f"step cost {a * 1e3:g} ms + {b * 1e3:.4g} ms a token + {c * 1e6:.4g} us a KV token "
            f"(kvops/engine/clock.py); steps: engine steps"
            + ("; Eff@300 on the engine clock" if axis == "window" else ""))
    cols = [axis, "config", "done", "preempt", "TTFT wall ms", "TTFT model ms", "TTFT steps",
            "TPOT wall ms", "TPOT model ms", "TPOT steps"]
    cols += ["Eff@300 %", "waiting mean"] if axis == "window" else ["out tok/s"]
    cols += ["BASE exposure mean / max %", "demotion batches (pairs/batch)", "demotion steps %",
             "promotions", "decode paths (native/span/general)", "control ms/step",
             "fidelity ms/step (P90)", "policy ms/step: control / demotion / promotion / metadata"]
    stopped = any(r.get("stopped_s") is not None for p in result["points"]
                  for r in p["results"].values())
    lines = [head, "", "TTFT and TPOT as mean / P90." + (
        " A stopped replay (`--eff-bar`) ended once its Eff@300 could no longer reach the bar: "
        "its Eff@300 lies between what it had served (every request left counted ineffective) "
        "and the bound it stopped under, and its other columns cover the requests served by "
        "then." if stopped else ""), "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for p in result["points"]:
        for name, r in p["results"].items():
            el = is_elastic(name)
            ck = r["clocks"]
            paths = r.get("decode_paths", {})
            stop = r.get("stopped_s")
            row = [_label(axis, p["x"]),
                   name if stop is None else f"{name} (stopped at {_f(stop)} s)",
                   f"{r['finished']}/{r['requests']}",
                   str(r["preemptions"]), _mp(ck["wall"]["ttft"]), _mp(ck["model"]["ttft"]),
                   _mp(ck["steps"]["ttft"]), _mp(ck["wall"]["tpot"], 2),
                   _mp(ck["model"]["tpot"], 2), _mp(ck["steps"]["tpot"], 2)]
            row += ([_eff_cell(r), _f(r["waiting_mean"])] if axis == "window"
                    else [_f(r["output_tok_s"])])
            row += [f"{_f(100 * r['base_exposure_mean'])} / {_f(100 * r['base_exposure_max'])}"
                    if el else "-",
                    f"{r['demotion_batches']} ({_f(r['pairs_per_batch'])})" if el else "-",
                    _f(100 * r["demotion_step_share"]) if el else "-",
                    str(r["promotions"]) if el else "-",
                    "/".join(str(paths.get(k, 0)) for k in ("native", "span", "general")),
                    _f(r["control_ms_per_step"], 3),
                    f"{_f(r['fidelity_ms_per_step'], 3)} ({_f(r['fidelity_ms_p90'], 3)})"
                    if el else "-",
                    " / ".join(_f(r["policy_ms"][k], 3) for k in
                               ("control", "demotion", "promotion", "metadata"))
                    if el else "-"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + goals(result)


def _eff(r: dict) -> float:
    """A configuration's Eff@300, or for a replay stopped under a bar the bound it can reach."""
    return r["eff"] if r.get("stopped_s") is None else r["eff_upper"]


def _eff_cell(r: dict) -> str:
    """Eff@300 in %; a stopped replay's between what it had served by then (every request left
    counted ineffective) and the bound it stopped under."""
    if r.get("stopped_s") is None:
        return _f(100 * r["eff"])
    return f"{_f(100 * r['eff'])}-{_f(100 * r['eff_upper'])}"


def _goal_eff(r: dict) -> str:
    return _f(100 * r["eff"]) if r.get("stopped_s") is None else f"<= {_f(100 * r['eff_upper'])}"


def goals(result: dict) -> str:
    """Issue 21's goals, as measured, beside the paper's figures: at the sweep's highest point
    (TTFT ratios on the wall and the modeled clock), or for Mooncake windows, Eff@300 of
    ``elastic`` against every baseline in each window; empty unless ``elastic`` ran with a
    baseline."""
    if result["axis"] == "window":
        return _window_goals(result)
    top = max(result["points"], key=lambda p: p["x"])["results"]
    e = top.get("elastic")
    if e is None or len(top) < 2:
        return ""

    def ratio(a, b):
        return a / b if b else float("nan")

    def ttft(r, clock, stat):
        return r["clocks"][clock]["ttft"][stat]

    rows = [("elastic preemptions", str(e["preemptions"]), "0", "0", e["preemptions"] == 0)]
    for clock in ("wall", "model"):
        if "paged" in top:
            pg = top["paged"]
            m = ratio(ttft(pg, clock, "mean"), ttft(e, clock, "mean"))
            p9 = ratio(ttft(pg, clock, "p90"), ttft(e, clock, "p90"))
            rows += [(f"paged / elastic mean TTFT ({clock})", _f(m, 2), ">= 3.8", "3.8-4.0",
                      m >= 3.8),
                     (f"paged / elastic P90 TTFT ({clock})", _f(p9, 2), ">= 9", "9.1", p9 >= 9)]
        if "offload" in top:
            of = top["offload"]
            p9 = ratio(ttft(of, clock, "p90"), ttft(e, clock, "p90"))
            rows.append((f"offload / elastic P90 TTFT ({clock})", _f(p9, 2), ">= 2", "2.5-4.7",
                         p9 >= 2))
    if "paged" in top:
        pg = top["paged"]
        rows.append(("paged preemptions", str(pg["preemptions"]), "-", "> 0",
                     pg["preemptions"] > 0))
    fid = e["fidelity_ms_per_step"]
    rows.append(("elastic policy host time a step (ms)", _f(fid, 3), "<= 1", "4.37", fid <= 1))
    head = f"At {result['axis']} {max(p['x'] for p in result['points']):g}:"
    return _goal_table(head, rows)


def _window_goals(result: dict) -> str:
    rows = []
    for p in result["points"]:
        res = p["results"]
        e = res.get("elastic")
        base = {n: r for n, r in res.items() if not is_elastic(n)}
        if e is None or not base:
            continue
        best = max(base, key=lambda n: _eff(base[n]))
        w = _label("window", p["x"])
        rows.append((f"window {w}: elastic Eff@300 above every baseline",
                     f"{_f(100 * e['eff'])} % vs {best} {_goal_eff(base[best])} %",
                     "higher", "higher in A, B, C", e["eff"] > _eff(base[best])))
        rows.append((f"window {w}: elastic preemptions", str(e["preemptions"]), "0", "0",
                     e["preemptions"] == 0))
    return _goal_table("Mooncake windows (Eff@300 on the engine clock):", rows) if rows else ""


def _goal_table(head: str, rows) -> str:
    lines = ["", "", head, "", "| goal | this run | target | paper | met |",
             "|---|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} | {'yes' if ok else 'no'} |" for a, b, c, d, ok in rows]
    return "\n".join(lines)


def plot(result: dict, out_dir: Path) -> None:
    """``pressure_ttft.png``: mean and P90 TTFT, and preemptions, against the sweep's axis;
    for Mooncake windows :func:`plot_windows` instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result["axis"] == "window":
        plot_windows(result, out_dir, plt)
        return

    xs = [p["x"] for p in result["points"]]
    names = list(result["points"][0]["results"])
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    for name in names:
        rs = [p["results"][name] for p in result["points"]]
        ax[0].plot(xs, [r["ttft_ms"]["mean"] for r in rs], "o-", label=name)
        ax[1].plot(xs, [r["ttft_ms"]["p90"] for r in rs], "o-", label=name)
        ax[2].plot(xs, [r["preemptions"] for r in rs], "o-", label=name)
    for a, t in zip(ax, ("mean TTFT (ms)", "P90 TTFT (ms)", "preemptions")):
        a.set_xlabel(result["axis"])
        a.set_ylabel(t)
        a.legend(fontsize=8)
    fig.suptitle(f"{result['model']} on {result['device_name']}, "
                 f"KV budget {result['budget_bytes'] / 2**30:.3f} GiB")
    fig.tight_layout()
    fig.savefig(out_dir / "pressure_ttft.png", dpi=110)
    plt.close(fig)


def plot_windows(result: dict, out_dir: Path, plt) -> None:
    """ElasticKV's Figure 6 for each Mooncake window, ``window_<A..>.png``: the offered input
    load (prompt tokens arriving a second of the engine clock), the waiting requests of every
    configuration, and the resident BASE ratio (BASE blocks / live blocks) of the elastic
    ones, against the engine clock."""
    clock = result["settings"]["clock"]
    for p in result["points"]:
        w = _label("window", p["x"])
        fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        arr = np.array([a for a, _ in p["offered"]])
        tok = np.array([n for _, n in p["offered"]])
        if arr.size:
            width = max(arr.max() / 60, 1e-3)
            edges = np.arange(0.0, arr.max() + 2 * width, width)
            hist, _ = np.histogram(arr, bins=edges, weights=tok)
            ax[0].step(edges[:-1], hist / width, where="post", color="0.4")
        ax[0].set_ylabel("offered prompt tok/s")
        for name, st in p["steps"].items():
            t = np.array([x["t"] for x in st])
            ax[1].plot(t, [x["waiting"] for x in st], label=name, lw=1)
            if is_elastic(name):
                ax[2].plot(t, 100 * np.array([x["exposure"] for x in st]), label=name, lw=1)
        ax[1].set_ylabel("waiting requests")
        ax[2].set_ylabel("resident BASE %")
        ax[2].set_xlabel(f"replay time (s, {clock} clock)")
        for a in ax[1:]:
            a.legend(fontsize=7)
        fig.suptitle(f"Mooncake window {w}: {result['model']} on {result['device_name']}")
        fig.tight_layout()
        fig.savefig(out_dir / f"window_{w}.png", dpi=110)
        plt.close(fig)


def write(result: dict, out_dir: str | Path, figures: bool = True) -> str:
    """``pressure.json``, ``pressure.md`` and (with matplotlib) ``pressure_ttft.png`` or the
    windows' ``window_<A..>.png``; returns the Markdown table."""
    return write_outputs(result, out_dir, "pressure", markdown, plot, figures)
