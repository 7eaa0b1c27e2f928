"""Serving metrics with vLLM ``bench serve``'s definitions, and the per-step record.

Per request: TTFT = first token - arrival; TPOT = (last token - first token) / (output - 1),
requests with one output token left out; ITL = gaps between consecutive tokens, pooled over
requests; E2EL = last token - arrival. Each as mean, median, p90, p99 in milliseconds. Output
throughput = output tokens / duration, duration from the trace's start to the last token.
Per step: wall time, the control plane (scheduling, the frame commit, the table upload, the
copy-on-write copies) and its part on the critical path (all of it, unless the engine's
overlap ran the last step's device work under it), running and waiting requests, reserved
and used KV bytes, DMA groups (the transport's copy trains and the far view's summaries) and
the sessions that moved pages;
for ``elastic`` the fidelity policy's BASE blocks, exposure, demotions, promotions and host time
(:func:`fidelity_metrics`).

Clocks (:mod:`kvops.engine.clock`): ``ttft_ms`` and the rest above are on the engine's driving
clock; ``clocks`` holds TTFT and TPOT on each clock: ``wall`` and ``model`` in milliseconds,
``steps`` in engine steps (TTFT: steps from the request's arrival to the step of its first
token, inclusive; TPOT: steps between its first and last token a token), beside Eff@300 on the
wall and modeled clocks.

Eff@300 (ElasticKV C.3.2, the Mooncake effective-request ratio): the share of a replay's
requests that finish with TTFT under 30 s and a TBT under 300 ms, TBT being the mean of the
slowest 10 % (at least one) of the request's inter-token gaps (:func:`tbt`); a request with
one output token has no gap (TBT 0); one that does not finish is not effective.
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
    kv_tokens: int = 0       # context the step's tokens attend to (sum of start + n)
    model_s: float = 0.0     # the step's modeled cost (kvops.engine.clock.StepCost)
    path: str = ""           # decode attention: native | span | general ("" without decodes)
    control_exposed_s: float = 0.0  # schedule + commit on the critical path (0 when the last
                                    # step's device work ran under them: engine overlap)
    device_s: float = 0.0    # CUDA: the stream from the step's first work to its tokens back
    gap_s: float = 0.0       # CUDA: the stream between the last step's end and this one's start
                             # (host time with nothing queued, and the commit's own copies)
    # elastic: the fidelity policy after the step's commit
    base_blocks: int = 0     # BASE blocks mapped
    exposure: float = 0.0    # BASE blocks / live blocks
    demoted: int = 0         # pairs demoted in the step (one batch)
    promoted: int = 0        # promotions issued
    settled: int = 0         # promotions mapped back
    fidelity_s: float = 0.0  # host time of Fidelity.step (plan, demotion packs, promotion issue)
    settle_s: float = 0.0    # ... of it: mapping finished promotions back
    demote_s: float = 0.0    # ... the demotion's packs and copies down (launched)
    promote_s: float = 0.0   # ... the promotions' issue (holds, copies up and refines launched)


def _stats(values, unit: float = 1e3) -> dict:
    a = np.asarray(values, dtype=np.float64) * unit
    if a.size == 0:
        return {"mean": float("nan"), "median": float("nan"), "p90": float("nan"),
                "p99": float("nan"), "n": 0}
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "n": int(a.size)}


EFF_TTFT_S, EFF_TBT_S = 30.0, 0.3


def tbt(times) -> float:
    """Mean of the slowest 10 % (at least one) of the gaps between consecutive token times;
    0 without a gap."""
    gaps = np.diff(np.asarray(times, dtype=np.float64))
    if gaps.size == 0:
        return 0.0
    k = max(1, int(np.ceil(0.1 * gaps.size)))
    return float(np.sort(gaps)[-k:].mean())


def effective(arrival: float, times, ttft_s: float = EFF_TTFT_S, tbt_s: float = EFF_TBT_S) -> bool:
    """A finished request's Eff@300 test: TTFT under ``ttft_s`` and :func:`tbt` under ``tbt_s``."""
    return len(times) > 0 and times[0] - arrival < ttft_s and tbt(times) < tbt_s


def eff_upper(requests: list[Request], now: float, ttft_s: float = EFF_TTFT_S,
              tbt_s: float = EFF_TBT_S, unsent=()) -> float:
    """The highest Eff@300 ``requests`` can still reach at ``now`` on the engine clock: the
    share not yet failed for good. Failed: refused; finished with every token stamped and not
    :func:`effective`; or sent without a first token for ``ttft_s``. ``unsent``: requests a
    closed loop has not sent yet (their arrival is reset when sent), never failed here; a
    finished request whose last tokens are not collected yet (overlap) is not judged. A
    failure is final, so this bound only falls."""
    if not requests:
        return float("nan")
    skip = {id(r) for r in unsent}
    failed = 0
    for r in requests:
        if r.status is Status.REFUSED:
            failed += 1
        elif r.status is Status.FINISHED:
            failed += (len(r.token_times) == len(r.output)
                       and not effective(r.arrival, r.token_times, ttft_s, tbt_s))
        elif (not r.token_times and id(r) not in skip and r.arrival <= now
              and now - r.arrival >= ttft_s):
            failed += 1
    return (len(requests) - failed) / len(requests)


def eff_ratio(requests: list[Request], clock: str = "engine", ttft_s: float = EFF_TTFT_S,
              tbt_s: float = EFF_TBT_S) -> float:
    """Eff@300 of ``requests`` (effective / all) on ``clock``: ``"engine"`` (the driving
    clock), ``"wall"`` or ``"model"``."""
    if not requests:
        return float("nan")
    ok = 0
    for r in requests:
        if r.status is not Status.FINISHED:
            continue
        a, t = _times(r, clock)
        ok += t is not None and effective(a, t, ttft_s, tbt_s)
    return ok / len(requests)


def _times(r: Request, clock: str):
    """``(arrival, token times)`` of ``r`` on ``clock``; times None where this process did
    not stamp that clock (a tensor-parallel follower stamps its engine clock only)."""
    a, t = {"engine": (r.arrival, r.token_times), "wall": (r.arrival_wall, r.token_walls),
            "model": (r.arrival_model, r.token_model),
            "steps": (r.arrival_step, r.token_steps)}[clock]
    return a, (t if len(t) == len(r.token_times) else None)


def clock_metrics(done: list[Request], eff: tuple[float, float] = (EFF_TTFT_S, EFF_TBT_S),
                  total: int | None = None) -> dict:
    """TTFT and TPOT of the finished requests on each clock (ms; steps for ``steps``) and
    Eff@300 on the wall and modeled clocks over ``total`` requests (default: ``done``)."""
    out = {}
    total = len(done) if total is None else total
    for clock in ("wall", "model", "steps"):
        ttft, tpot, ok = [], [], 0
        for r in done:
            a, t = _times(r, clock)
            if t is None or not t:
                continue
            ttft.append(t[0] - a)
            if len(t) > 1:
                tpot.append((t[-1] - t[0]) / (len(t) - 1))
            ok += effective(a, t, *eff)
        unit = 1.0 if clock == "steps" else 1e3
        out[clock] = {"ttft": _stats(ttft, unit), "tpot": _stats(tpot, unit)}
        if clock != "steps":
            out[clock]["eff"] = ok / total if total else float("nan")
    return out


def summarize(requests: list[Request], steps: list[StepRecord], extra: dict | None = None,
              eff: tuple[float, float] = (EFF_TTFT_S, EFF_TBT_S)) -> dict:
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
    timed = [s for s in steps if s.device_s]        # CUDA steps with device timings
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
        "commit_share": (float(sum(s.commit_s for s in steps) / step_s.sum())
                         if step_s.sum() > 0 else 0.0),
        "control_exposed_share": (float(sum(s.control_exposed_s for s in steps) / step_s.sum())
                                  if step_s.sum() > 0 else 0.0),
        "device_ms": _stats([s.device_s for s in timed]),
        "device_gap_share": _gap_share(timed),
        "gap_ms": _stats([s.gap_s for s in timed[1:]]),   # the first has no step before it
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
        "eff": eff_ratio(requests, "engine", *eff), "eff_thresholds_s": list(eff),
        "clocks": clock_metrics(done, eff, total=len(requests)),
        "model_s": float(sum(s.model_s for s in steps)),
        "waiting_mean": float(np.mean([s.waiting for s in steps])) if steps else 0.0,
        **fidelity_metrics(steps),
    }
    res.update(extra or {})
    return res


def _gap_share(steps: list[StepRecord]) -> float:
    """The stream's time between steps as a share of it and the steps' own (timed CUDA
    steps; 0 without any)."""
    busy = sum(s.device_s for s in steps)
    gap = sum(s.gap_s for s in steps)
    return gap / (busy + gap) if busy > 0 else 0.0


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
        "policy_ms": policy_breakdown(steps),
    }


def policy_breakdown(steps: list[StepRecord]) -> dict:
    """The policy's critical-path host time a step in ElasticKV's breakdown (ms, means over
    the steps): ``control`` the decisions (``Fidelity.step`` less its phases below),
    ``demotion`` launching the demotions' packs and copies down, ``promotion`` issuing
    promotions and mapping finished ones back, ``metadata`` the rest of the frame commit (the
    pager's tables, their upload, the other policies). Host time: the packs' device time is in
    the step's."""
    if not steps:
        return {"control": 0.0, "demotion": 0.0, "promotion": 0.0, "metadata": 0.0}
    mean = lambda f: float(np.mean([f(s) for s in steps]) * 1e3)     # noqa: E731
    return {"control": mean(lambda s: s.fidelity_s - s.settle_s - s.demote_s - s.promote_s),
            "demotion": mean(lambda s: s.demote_s),
            "promotion": mean(lambda s: s.promote_s + s.settle_s),
            "metadata": mean(lambda s: s.commit_s - s.fidelity_s)}


def steps_as_dict(steps: list[StepRecord]) -> list[dict]:
    return [asdict(s) for s in steps]
