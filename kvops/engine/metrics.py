"""Serving metrics with vLLM ``bench serve``'s definitions, and the per-step record.

Per request: TTFT = first token - arrival; TPOT = (last token - first token) / (output - 1),
requests with one output token left out; ITL = gaps between consecutive tokens, pooled over
requests; E2EL = last token - arrival. Each as mean, median, p90, p99 in milliseconds. Output
throughput = output tokens / duration, duration from the trace's start to the last token.
Per step: wall time, the control plane (scheduling, the frame commit, the table upload, the
copy-on-write copies), running and waiting requests, reserved and used KV bytes, DMA groups
(the transport's copy trains and the far view's summaries) and the sessions that moved pages;
for ``elastic`` the fidelity policy's BASE blocks, exposure, demotions, promotions and host time
(:func:`fidelity_metrics`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from kvops.engine.request import Request, Status


@dataclass
class StepRecord:
    t: float                 # replay clock at the step's end (s)
    step_s: float            # wall time of the whole step
    schedule_s: float
    commit_s: float          # frame commit (trims, aliases, reserves, upload, COW copies)
    running: int
    waiting: int
    tokens: int              # tokens computed
    decodes: int
    reserved_bytes: int
    used_bytes: int
    groups: int              # transport copy trains
    moving_sessions: int
    train_bytes: int         # one of K or V, one layer
    far_groups: int
    preempted: int = 0       # requests preempted in the step
    # elastic: the fidelity policy after the step's commit
    base_blocks: int = 0     # BASE blocks mapped
    exposure: float = 0.0    # BASE blocks / live blocks
    demoted: int = 0         # pairs demoted in the step (one batch)
    promoted: int = 0        # promotions issued
    settled: int = 0         # promotions mapped back
    fidelity_s: float = 0.0  # host time of Fidelity.step (plan, demotion packs, promotion issue)


def _stats(values) -> dict:
    a = np.asarray(values, dtype=np.float64) * 1e3
    if a.size == 0:
        return {"mean": float("nan"), "median": float("nan"), "p90": float("nan"),
                "p99": float("nan"), "n": 0}
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "n": int(a.size)}


def summarize(requests: list[Request], steps: list[StepRecord], extra: dict | None = None) -> dict:
    done = [r for r in requests if r.status is Status.FINISHED]
    ttft = [r.token_times[0] - r.arrival for r in done]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.output) - 1)
            for r in done if len(r.output) > 1]
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    e2el = [r.token_times[-1] - r.arrival for r in done]
    duration = max((r.token_times[-1] for r in done), default=0.0)
    out_tokens = sum(len(r.output) for r in done)
    step_s = np.array([s.step_s for s in steps]) if steps else np.zeros(1)
    control = np.array([s.schedule_s + s.commit_s for s in steps]) if steps else np.zeros(1)
    moving = [s for s in steps if s.moving_sessions]
    groups_all = sum(s.groups + s.far_groups for s in moving)
    res = {
        "requests": len(requests), "finished": len(done),
        "refused": sum(r.status is Status.REFUSED for r in requests),
        "output_tokens": out_tokens, "duration_s": duration,
        "output_tok_s": out_tokens / duration if duration > 0 else 0.0,
        "ttft_ms": _stats(ttft), "tpot_ms": _stats(tpot), "itl_ms": _stats(itl),
        "e2el_ms": _stats(e2el),
        "steps": len(steps),
        "step_ms": _stats(step_s),
        "commit_ms": _stats([s.commit_s for s in steps]),
        "control_share": float(control.sum() / step_s.sum()) if step_s.sum() > 0 else 0.0,
        "reserved_gib_mean": float(np.mean([s.reserved_bytes for s in steps]) / 2**30) if steps else 0.0,
        "reserved_gib_max": float(max((s.reserved_bytes for s in steps), default=0) / 2**30),
        "used_gib_mean": float(np.mean([s.used_bytes for s in steps]) / 2**30) if steps else 0.0,
        "dma_groups_per_step": float(np.mean([s.groups + s.far_groups for s in steps])) if steps else 0.0,
        "dma_groups_per_moving_session": (groups_all / sum(s.moving_sessions for s in moving)
                                          if moving else 0.0),
        "mean_train_kib": (sum(s.train_bytes for s in steps) / max(sum(s.groups for s in steps), 1)
                           / 1024),
        "preemptions": sum(r.preemptions for r in requests),
        "prefix_hit_tokens": sum(r.prefix_hit for r in requests),
        "control_ms_per_step": float(control.mean() * 1e3),
        **fidelity_metrics(steps),
    }
    res.update(extra or {})
    return res


def fidelity_metrics(steps: list[StepRecord]) -> dict:
    """ElasticKV's serving counters over the steps: BASE exposure (mean and max over steps),
    demotion batches and pairs a batch, the share of steps that demote, promotions, and the
    critical-path host time a step (scheduling + the frame commit, which holds the policy's
    plan, demotion packs and promotion issue; ``fidelity_ms_per_step`` is the policy's part).
    Zeros for configurations without the policy."""
    n = max(len(steps), 1)
    batches = [s.demoted for s in steps if s.demoted]
    fid = np.array([s.fidelity_s for s in steps]) if steps else np.zeros(1)
    return {
        "base_exposure_mean": float(np.mean([s.exposure for s in steps])) if steps else 0.0,
        "base_exposure_max": float(max((s.exposure for s in steps), default=0.0)),
        "base_blocks_max": int(max((s.base_blocks for s in steps), default=0)),
        "demotion_batches": len(batches),
        "pairs_per_batch": float(np.mean(batches)) if batches else 0.0,
        "demotion_step_share": len(batches) / n,
        "promotions": int(sum(s.settled for s in steps)),
        "fidelity_ms_per_step": float(fid.mean() * 1e3),
        "fidelity_ms_p90": float(np.percentile(fid, 90) * 1e3),
        "demotion_step_ms": float(np.mean([s.fidelity_s for s in steps if s.demoted]) * 1e3)
        if batches else 0.0,
    }


def steps_as_dict(steps: list[StepRecord]) -> list[dict]:
    return [asdict(s) for s in steps]
