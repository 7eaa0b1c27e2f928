"""ElasticKV's pressure comparison (``kvops replay --mode elastic``): the same requests through
``elastic``, ``paged`` (recompute), ``offload`` (swap) and ``reserve`` (worst case) on one KV
budget, at each point of a sweep: the high-pressure synthetic (:func:`~kvops.engine.traces.
pressure_rows`, fixed prompt and output lengths) at rising closed-loop concurrency, or ShareGPT
lengths at rising Poisson request rates. One model serves every point (loaded once).

Defaults by device (:func:`sweep_settings`): on a CPU a tiny random Llama in bfloat16,
prompts of 256 and outputs of 64 tokens (the paper's 4096 / 1024 at lengths / 16), a budget of
2,048 tokens (128 pages of 16), 12 sessions, concurrency 4, 8, 12 with two requests a client; on CUDA random
weights of Llama-3-8B's shape in bfloat16, prompts of 4096 and outputs of 128 tokens (1024 x
0.125, so that the sweep fits in minutes), a 16 GiB budget (131,072 tokens, 31 requests' whole
context), concurrency 8, 24, 40 with one request a client, 64 sessions, 4,096 tokens a step,
chunks of 2,048.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kvops.engine.replay import ReplaySettings, load_model, replay_dtype, run
from kvops.engine.report import write_outputs

PRESSURE_CONFIGS = ("elastic", "paged", "offload", "reserve")


def sweep_settings(device: torch.device, trace: str | None = None, **kw) -> tuple[ReplaySettings, str]:
    """``(settings, axis)``: the device's defaults for the sweep (module doc), ``axis``
    ``"concurrency"`` for the synthetic or ``"rate"`` for a ShareGPT stats ``trace``;
    ``kw`` overrides (None leaves a default)."""
    axis = "rate" if trace else "concurrency"
    if device.type == "cuda":
        base = dict(model="llama3-8b", budget_tokens=131072, max_seqs=64, max_context=8192,
                    max_num_batched_tokens=4096, long_prefill_tokens=2048, input_len=4096,
                    output_len=1024, output_scale=0.125, length_scale=1.0, max_requests=None)
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
    return ReplaySettings(**base), axis


def default_points(device: torch.device, axis: str) -> tuple[float, ...]:
    if axis == "rate":
        return (2.0, 4.0, 8.0) if device.type == "cuda" else (4.0, 8.0, 16.0)
    return (8, 24, 40) if device.type == "cuda" else (4, 8, 12)


def run_sweep(settings: ReplaySettings, axis: str, points, requests_per_client: int | None = None,
              progress: bool = True) -> dict:
    """Every point of the sweep through every configuration; returns ``{"settings", "axis",
    "points": [{"x", "results": {config: metrics}, "steps": {config: [records]}}], "model",
    "device_name", "dtype", "budget_bytes"}``. ``requests_per_client``: requests at a
    concurrency point = clients x this (default 2 on a CPU, 1 on CUDA)."""
    if axis not in ("concurrency", "rate"):
        raise ValueError(f"axis: expected 'concurrency' or 'rate', got {axis!r}")
    points = list(points)
    if not points or any(not p > 0 for p in points):
        raise ValueError(f"points: expected positive numbers, got {points!r}")
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    settings = dataclasses.replace(settings, device=str(device))
    per = requests_per_client or (1 if device.type == "cuda" else 2)
    model = load_model(settings.model, device, replay_dtype(settings, device))
    out = {"settings": dataclasses.asdict(settings), "axis": axis, "points": []}
    for x in points:
        if axis == "concurrency":
            c = int(x)
            s = dataclasses.replace(settings, concurrency=c,
                                    max_requests=settings.max_requests or c * per)
        else:
            s = dataclasses.replace(settings, rate=float(x), concurrency=None)
        print(f"-- {axis} {x:g}", flush=True)
        r = run(s, progress=progress, model=model)
        out["points"].append({"x": x, "results": r["results"], "steps": r["steps"]})
        out.update(model=r["model"], device_name=r["device_name"], dtype=r["dtype"],
                   budget_bytes=r["budget_bytes"])
    return out


def _f(x, nd=1):
    return "-" if x is None or x != x else f"{x:.{nd}f}"


def markdown(result: dict) -> str:
    s, axis = result["settings"], result["axis"]
    work = (f"prompts {round(s['input_len'] * s['length_scale'])}, outputs "
            f"{round(s['output_len'] * s['length_scale'] * s['output_scale'])} tokens, closed loop"
            if s["kind"] == "pressure" else
            f"ShareGPT lengths x{s['length_scale']} ({s['trace']}), Poisson arrivals")
    head = (f"kvops replay --mode elastic: {result['model']}, {result['dtype']} on "
            f"{result['device_name']}; {work}; KV budget {result['budget_bytes'] / 2**30:.3f} GiB "
            f"({s['budget_tokens'] or '-'} tokens), {s['max_seqs']} sessions, "
            f"{s['max_num_batched_tokens']} tokens/step")
    cols = [axis, "config", "done", "preempt", "TTFT mean / P90 ms", "TPOT mean / P90 ms",
            "out tok/s", "BASE exposure mean / max %", "demotion batches (pairs/batch)",
            "demotion steps %", "promotions", "control ms/step", "fidelity ms/step (P90)"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for p in result["points"]:
        for name, r in p["results"].items():
            el = name == "elastic"
            lines.append("| " + " | ".join([
                f"{p['x']:g}", name, f"{r['finished']}/{r['requests']}", str(r["preemptions"]),
                f"{_f(r['ttft_ms']['mean'])} / {_f(r['ttft_ms']['p90'])}",
                f"{_f(r['tpot_ms']['mean'], 2)} / {_f(r['tpot_ms']['p90'], 2)}",
                _f(r["output_tok_s"]),
                f"{_f(100 * r['base_exposure_mean'])} / {_f(100 * r['base_exposure_max'])}"
                if el else "-",
                f"{r['demotion_batches']} ({_f(r['pairs_per_batch'])})" if el else "-",
                _f(100 * r["demotion_step_share"]) if el else "-",
                str(r["promotions"]) if el else "-",
                _f(r["control_ms_per_step"], 3),
                f"{_f(r['fidelity_ms_per_step'], 3)} ({_f(r['fidelity_ms_p90'], 3)})"
                if el else "-"]) + " |")
    return "\n".join(lines) + goals(result)


def goals(result: dict) -> str:
    """Issue 21's goals at the sweep's highest point, as measured, beside the paper's figures;
    empty unless ``elastic`` ran with a baseline."""
    top = max(result["points"], key=lambda p: p["x"])["results"]
    e = top.get("elastic")
    if e is None or len(top) < 2:
        return ""

    def ratio(a, b):
        return a / b if b else float("nan")

    rows = [("elastic preemptions", str(e["preemptions"]), "0", "0", e["preemptions"] == 0)]
    if "paged" in top:
        pg = top["paged"]
        m = ratio(pg["ttft_ms"]["mean"], e["ttft_ms"]["mean"])
        p9 = ratio(pg["ttft_ms"]["p90"], e["ttft_ms"]["p90"])
        rows += [("paged / elastic mean TTFT", _f(m, 2), ">= 3.8", "3.8-4.0", m >= 3.8),
                 ("paged / elastic P90 TTFT", _f(p9, 2), ">= 9", "9.1", p9 >= 9),
                 ("paged preemptions", str(pg["preemptions"]), "-", "> 0", pg["preemptions"] > 0)]
    if "offload" in top:
        of = top["offload"]
        p9 = ratio(of["ttft_ms"]["p90"], e["ttft_ms"]["p90"])
        rows.append(("offload / elastic P90 TTFT", _f(p9, 2), ">= 2", "2.5-4.7", p9 >= 2))
    fid = e["fidelity_ms_per_step"]
    rows.append(("elastic policy host time a step (ms)", _f(fid, 3), "<= 1", "4.37", fid <= 1))
    lines = ["", "", f"At {result['axis']} {max(p['x'] for p in result['points']):g}:", "",
             "| goal | this run | target | paper | met |", "|---|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} | {'yes' if ok else 'no'} |" for a, b, c, d, ok in rows]
    return "\n".join(lines)


def plot(result: dict, out_dir: Path) -> None:
    """``pressure_ttft.png``: mean and P90 TTFT, and preemptions, against the sweep's axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def write(result: dict, out_dir: str | Path, figures: bool = True) -> str:
    """``pressure.json``, ``pressure.md`` and (with matplotlib) ``pressure_ttft.png``;
    returns the Markdown table."""
    return write_outputs(result, out_dir, "pressure", markdown, plot, figures)
