"""The replay's Markdown table and figures (a timeline per configuration: offered load,
running and waiting requests, reserved KV, step latency; CDFs of TTFT and TPOT)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_outputs(result: dict, out_dir: str | Path, stem: str, markdown, plot,
                  figures: bool = True) -> str:
    """``<stem>.json`` and ``<stem>.md`` (the table ``markdown(result)`` gives) in ``out_dir``,
    and with ``figures`` (and matplotlib) ``plot(result, out_dir)``; returns the table."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    table = markdown(result)
    (out_dir / f"{stem}.md").write_text(table + "\n")
    if figures:
        try:
            plot(result, out_dir)
        except ImportError as exc:
            print(f"(figures skipped: {exc}; pip install matplotlib)")
    return table


def _f(x, nd=1):
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.{nd}f}"


def markdown(result: dict) -> str:
    s = result["settings"]
    head = (f"kvops replay: {result['model']}, {result['dtype']} on {result['device_name']}; "
            f"trace {s['trace'] or 'synthetic burst (shipped)'}, time x{s['time_scale']}, "
            f"lengths x{s['length_scale']}; KV budget "
            f"{result.get('budget_bytes', s['budget_gib'] * 2**30) / 2**30:.3f} GiB, "
            f"{s['max_seqs']} sessions, context {s['max_context']}, W {s['window']}, "
            f"pages of {s['page_size']}, {s['max_num_batched_tokens']} tokens/step")
    cols = ["config", "done/refused", "out tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms",
            "ITL p99 ms", "E2EL p50 ms", "reserved GiB (mean)", "DMA groups/step",
            "groups/moving session", "train KiB", "commit ms p50", "control % (exposed)", "GPU gap %",
            "preempt", "prefix hit tok", "captures (re-)", "compiles"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, r in result["results"].items():
        lines.append("| " + " | ".join([
            name, f"{r['finished']}/{r['refused']}", _f(r["output_tok_s"]),
            f"{_f(r['ttft_ms']['median'])} / {_f(r['ttft_ms']['p99'])}",
            f"{_f(r['tpot_ms']['median'], 2)} / {_f(r['tpot_ms']['p99'], 2)}",
            _f(r["itl_ms"]["p99"], 2), _f(r["e2el_ms"]["median"]),
            _f(r["reserved_gib_mean"], 3), _f(r["dma_groups_per_step"], 2),
            _f(r["dma_groups_per_moving_session"], 2), _f(r["mean_train_kib"]),
            _f(r["commit_ms"]["median"], 3),
            f"{_f(100 * r['control_share'], 2)} ({_f(100 * r['control_exposed_share'], 2)})",
            _f(100 * r["device_gap_share"], 2) if r["device_ms"]["n"] else "-",
            str(r["preemptions"]), str(r["prefix_hit_tokens"]),
            f"{r['warmup_captures']} ({r['recaptures']})", str(r.get("compiles", "-"))]) + " |")
    return "\n".join(lines) + goals(result)


def goals(result: dict) -> str:
    """The issue's goals (KV-RM's claims) as ratios of this replay, beside the paper's figures;
    empty unless ``kvrm`` ran with ``static`` or ``paged``. A goal the replay cannot measure
    (the train size where no train moved) is marked ``-``, neither met nor missed."""
    r = result["results"]
    k = r.get("kvrm")
    if k is None or not ({"static", "paged"} & set(r)):
        return ""
    rows = []

    def ratio(a, b):
        return a / b if b else float("nan")

    if "static" in r:
        st = r["static"]
        t = ratio(k["output_tok_s"], st["output_tok_s"])
        p = ratio(k["tpot_ms"]["p99"], st["tpot_ms"]["p99"])
        m = ratio(k["reserved_gib_mean"], st["reserved_gib_mean"])
        rows += [("kvrm / static output tok/s", _f(t, 2), ">= 1.25", "552 / 420 = 1.31", t >= 1.25),
                 ("kvrm / static p99 TPOT", _f(p, 2), "<= 0.5", "18.8 / 82 = 0.23", p <= 0.5),
                 ("kvrm / static reserved KV", _f(m, 2), "<= 0.75", "27.0 / 36.9 = 0.73", m <= 0.75)]
    if "paged" in r:
        pg = r["paged"]
        t = ratio(k["output_tok_s"], pg["output_tok_s"])
        rows.append(("kvrm / paged output tok/s", _f(t, 2), ">= 0.95", "552 / 565 = 0.98", t >= 0.95))
        lower = k["tpot_ms"]["p99"] < pg["tpot_ms"]["p99"]
        rows.append(("kvrm p99 TPOT below paged's", f"{_f(k['tpot_ms']['p99'], 2)} vs "
                     f"{_f(pg['tpot_ms']['p99'], 2)} ms", "lower", "18.8 ms, vLLM higher", lower))
    g, kib = k["dma_groups_per_moving_session"], k["mean_train_kib"]
    moved = kib > 0     # a replay that shares no prefix moves no near-window train
    rows += [("kvrm DMA groups per moving session", _f(g, 2), "<= 2.1", "2.0", g <= 2.1),
             ("kvrm mean train KiB", _f(kib) if moved else "- (no train moved)", ">= 110", "132",
              kib >= 110 if moved else None),
             ("kvrm control plane share of step on the critical path (host time: schedule + "
              "commit; the commit alone)",
              f"{_f(100 * k['control_exposed_share'], 2)} % ({_f(100 * k['control_share'], 2)} "
              f"%; {_f(100 * k['commit_share'], 2)} %)", "< 2 %", "< 1.9 % (submit + commit)",
              k["control_exposed_share"] < 0.02),
             ("re-captures after warm-up (all configs)",
              str(sum(x["recaptures"] for x in r.values())), "0", "-",
              all(x["recaptures"] == 0 for x in r.values())),
             ("Triton compiles after warm-up (all configs)",
              str(sum(x.get("compiles", 0) for x in r.values())), "0", "-",
              all(x.get("compiles", 0) == 0 for x in r.values()))]
    lines = ["", "", "| goal | this run | target | paper | met |", "|---|---|---|---|---|"]
    met = {True: "yes", False: "no", None: "-"}
    lines += [f"| {a} | {b} | {c} | {d} | {met[e]} |" for a, b, c, d, e in rows]
    return "\n".join(lines)


def plot(result: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["results"])
    fig, ax = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    arr = np.asarray(result["arrivals"])
    if arr.size:
        edges = np.arange(0, max(arr.max(), 1e-3) + 1.0, 1.0)
        ax[0].hist(arr, bins=edges, color="0.6")
    ax[0].set_ylabel("arrivals / s")
    for name in names:
        st = result["steps"][name]
        t = np.array([x["t"] for x in st])
        ax[1].plot(t, [x["running"] for x in st], label=f"{name} running")
        ax[1].plot(t, [x["waiting"] for x in st], "--", label=f"{name} waiting")
        line, = ax[2].plot(t, np.array([x["reserved_bytes"] for x in st]) / 2**30,
                           label=f"{name} reserved")
        ax[2].plot(t, np.array([x["used_bytes"] for x in st]) / 2**30, ":",
                   color=line.get_color(), label=f"{name} used")
        ax[3].plot(t, np.array([x["step_s"] for x in st]) * 1e3, ".", ms=2, label=name)
    ax[1].set_ylabel("requests")
    ax[2].set_ylabel("KV GiB")
    ax[3].set_ylabel("step ms")
    ax[3].set_xlabel("replay time (s)")
    for a in ax[1:]:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "timeline.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        reqs = result["requests"][name]
        for a, key in zip(ax, ("ttft", "tpot")):
            v = np.sort([r[key] * 1e3 for r in reqs if r[key] is not None])
            if v.size:
                a.plot(v, np.arange(1, v.size + 1) / v.size, label=name)
    ax[0].set_xlabel("TTFT ms")
    ax[1].set_xlabel("TPOT ms")
    for a in ax:
        a.set_ylabel("CDF")
        a.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "cdf.png", dpi=110)
    plt.close(fig)
