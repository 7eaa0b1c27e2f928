"""ElasticKV's ablations, clocks and Mooncake windows in the engine (CPU, tiny random Llama in
bfloat16): each ablation changes the mechanism it names and nothing else, the step and
modeled clocks count what the engine did, Eff@300 scores hand-made records as the paper
defines it, and the Mooncake windows are picked and replayed from a small hand-made trace."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from kvops.engine import Engine, KVBudget, SchedulerConfig, make_kv
from kvops.engine.clock import H200_8B, StepCost
from kvops.engine.metrics import eff_ratio, effective, tbt
from kvops.engine.request import Request, Status
from kvops.engine.traces import TraceRow, build_requests, pressure_rows, trace_windows
from kvops.ops.elastic_attention import span_modes
from tests import test_engine_elastic as harness

# the tiny model, the budget's units and the serve helper of the elastic engine tests
CFG, DT, S, TOKEN_BYTES, serve = (harness.CFG, harness.DT, harness.S, harness.TOKEN_BYTES,
                                  harness.serve)
model = harness.model          # the same module-scoped fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# 10 requests of 192 + 32 tokens (14 blocks), 8 in flight: 112 blocks of context on 96 pages
ROWS = pressure_rows(10, input_len=192, output_len=32)


@pytest.fixture(scope="module")
def runs(model):
    return {c: serve(model, c, ROWS)
            for c in ("elastic", "elastic-general", "elastic-no-promote")}


def _clean(kv):
    assert kv.free_pages() == kv.total_pages and kv.pager.sessions() == []
    assert kv.fidelity.host_free == kv.total_pages and kv.fidelity.stats["base_blocks"] == 0


def test_no_promotion_never_promotes(runs):
    reqs, kv, engine, m = runs["elastic-no-promote"]
    assert m["finished"] == len(reqs) and m["preemptions"] == 0
    assert m["demotion_batches"] > 0
    assert m["promotions"] == 0 and m["promoted_pairs"] == 0
    assert all(s.promoted == 0 and s.settled == 0 for s in engine.steps)
    assert runs["elastic"][3]["promotions"] > 0            # the same run with promotion does
    # pairs stay BASE until their request ends: exposure never falls while nothing ends
    _clean(kv)


def test_forced_general_path_never_takes_the_structured_path(runs):
    reqs, kv, engine, m = runs["elastic-general"]
    assert m["finished"] == len(reqs) and m["preemptions"] == 0
    assert m["decode_paths"].get("general", 0) > 0 and m["decode_paths"].get("span", 0) == 0
    assert {s.path for s in engine.steps if s.demoted or s.base_blocks} <= {"general", ""}
    ref = runs["elastic"]
    assert ref[3]["decode_paths"].get("span", 0) > 0
    assert ref[3]["decode_paths"].get("general", 0) == 0
    # the same policy decisions; both mixed paths fold the same runs of tiles
    assert m["demoted_pairs"] == ref[3]["demoted_pairs"]
    assert [r.output for r in reqs] == [r.output for r in ref[0]]
    assert m["base_exposure_mean"] == ref[3]["base_exposure_mean"]
    _clean(kv)


def test_span_modes_of_spans():
    span = torch.tensor([[2, 6], [0, 0], [1, 3]], dtype=torch.int32)
    got = span_modes(span, 7)
    assert got.dtype == torch.int8
    assert got.tolist() == [[0, 0, 1, 2, 1, 2, 0], [0] * 7, [0, 1, 2, 0, 0, 0, 0]]


def test_watermark_demotes_before_any_shortage(model):
    rows = pressure_rows(6, input_len=192, output_len=48)     # 90 blocks on 96 pages: no shortage
    plain = serve(model, "elastic", rows)
    assert plain[3]["demotion_batches"] == 0 and plain[3]["preemptions"] == 0
    reqs, kv, engine, m = serve(model, "elastic-watermark", rows)
    assert kv.watermark_pages == 12
    assert m["demotion_batches"] > 0 and m["preemptions"] == 0
    assert m["finished"] == len(reqs)
    _clean(kv)


def _demoted_kv(config):
    kv = make_kv(config, KVBudget(bytes=32 * S * TOKEN_BYTES, max_seqs=4, max_context=256),
                 CFG, DT, torch.device("cpu"),
                 fidelity={"min_batch": 2, "protect_recent": 1, "headroom": 8})
    with kv.pager.frame() as f:
        for i in range(3):
            f.reserve(f"s{i}", 8 * S)                  # 24 of 32 pages
    with kv.pager.frame() as f:                        # short by 6: 6 pairs demoted
        assert kv.fidelity.step(f, need=kv.pager.free_pages + 6)["demoted"] == 6
    assert kv.fidelity.reserve == 6.0 and kv.pager.free_pages == 14
    return kv


def test_eager_promotion_promotes_with_reserve_zero():
    # 14 free pages, the reserve of 6 freed pages, headroom 8: nothing spare for the plain
    # policy; with reserve 0, 6 spare pages pay for 3 promotions
    for config, want in (("elastic", 0), ("elastic-eager-promote", 3)):
        kv = _demoted_kv(config)
        with kv.pager.frame() as f:
            kv._before_reserves(f, [])
        assert kv.last_fidelity["promoted"] == want, config
    assert kv.fidelity.reserve == 0.0


def test_ablation_arguments_and_bad_inputs():
    from kvops.engine.elastic_kv import ElasticKV, elastic_arguments

    assert elastic_arguments("elastic-no-promote", {"max_promote": 5, "demote": True}) == {
        "demote": True, "fidelity": {"max_promote": 0}}
    assert elastic_arguments("elastic-eager-promote")["eager"] is True
    with pytest.raises(ValueError, match="config: expected one of elastic"):
        elastic_arguments("elastic-lazy")
    with pytest.raises(ValueError, match="watermark: expected a fraction"):
        ElasticKV(watermark=1.5, num_pages=8, page_size=S, max_sessions=2, max_blocks=4,
                  prefix_sharing=False, layers=1, kv_heads=1, head_dim=16, dtype=DT,
                  device=torch.device("cpu"))
    with pytest.raises(ValueError, match="step_cost.b: expected a number >= 0"):
        StepCost(0.01, -1.0, 0.0)
    with pytest.raises(ValueError, match="clock: expected one of wall, model"):
        Engine(None, None, "paged", clock="cpu")


# -- clocks ------------------------------------------------------------------------------------
def test_step_and_model_clocks_count_the_engine_steps(model):
    cost = StepCost(0.01, 0.001, 1e-6)
    reqs = build_requests([TraceRow(0.0, 192, 5)], CFG.vocab_size)
    kv = make_kv("paged", KVBudget(bytes=32 * S * TOKEN_BYTES, max_seqs=4, max_context=256),
                 CFG, DT, torch.device("cpu"))
    engine = Engine(model, kv, "paged", SchedulerConfig(128, 4, 64), clock="model",
                    step_cost=cost)
    m = engine.replay(reqs)
    r = reqs[0]
    # three prefill chunks of 64 (the third gives the first token), then a decode a token
    assert r.token_steps == [3, 4, 5, 6, 7] and r.arrival_step == 0
    want = [cost.of(64, 64), cost.of(64, 128), cost.of(64, 192)]
    want += [cost.of(1, 192 + k) for k in range(1, 5)]
    assert np.allclose(np.diff([0.0, *r.token_model]), [sum(want[:3]), *want[3:]])
    assert r.token_times == r.token_model             # the model clock drives
    assert m["clocks"]["steps"]["ttft"]["mean"] == 3 and m["clocks"]["steps"]["tpot"]["mean"] == 1
    assert m["clocks"]["model"]["ttft"]["mean"] == pytest.approx(1e3 * sum(want[:3]))
    assert m["ttft_ms"]["mean"] == pytest.approx(m["clocks"]["model"]["ttft"]["mean"])
    assert m["model_s"] == pytest.approx(sum(want))
    assert len(r.token_walls) == 5 and r.token_walls == sorted(r.token_walls)


def test_model_clock_replays_are_the_same_on_any_machine(model):
    rows = pressure_rows(6, input_len=192, output_len=32, rate=20.0)     # open loop
    a = serve(model, "elastic", rows, pages=64, concurrency=None, clock="model",
              fidelity={"min_batch": 2})
    b = serve(model, "elastic", rows, pages=64, concurrency=None, clock="model",
              fidelity={"min_batch": 2})
    assert a[3]["demotion_batches"] > 0
    assert [r.token_times for r in a[0]] == [r.token_times for r in b[0]]
    assert [s.demoted for s in a[2].steps] == [s.demoted for s in b[2].steps]
    assert H200_8B.scaled(1 / 16).b == pytest.approx(16 * H200_8B.b)


# -- Eff@300 -----------------------------------------------------------------------------------
def _done(arrival, times):
    r = Request(0, arrival, [1, 2], len(times))
    r.status, r.token_times = Status.FINISHED, list(times)
    return r


def test_eff300_scores_hand_made_records():
    # 21 gaps: the slowest 10 % (3) are 0.5, 0.2, 0.2 -> TBT 0.3: not under 300 ms
    gaps = [0.05] * 18 + [0.2, 0.2, 0.5]
    times = 1.0 + np.concatenate([[0.0], np.cumsum(gaps)])
    assert tbt(times) == pytest.approx(0.3)
    assert not effective(0.0, times)
    gaps[-1] = 0.4                                   # TBT 0.2667
    times = 1.0 + np.concatenate([[0.0], np.cumsum(gaps)])
    assert effective(0.0, times)
    assert not effective(0.0, times + 29.5)          # TTFT 30.5 s
    assert tbt([3.0]) == 0.0 and effective(0.0, [3.0])
    assert tbt([0.0, 1.0]) == 1.0                    # one gap: at least one is the slowest
    refused = Request(1, 0.0, [1], 1)
    refused.status = Status.REFUSED
    recs = [_done(0.0, times), _done(0.0, [40.0, 40.1]), _done(0.0, [1.0, 1.1, 2.0]), refused]
    assert eff_ratio(recs) == 0.25
    assert eff_ratio(recs, tbt_s=1.0) == 0.5
    assert eff_ratio(recs, ttft_s=60.0, tbt_s=1.0) == 0.75


# -- Mooncake windows --------------------------------------------------------------------------
def test_windows_are_picked_temporally_separated():
    rows = [TraceRow(float(t), 10 + t, 2) for t in range(0, 100, 5)]   # arrivals 0..95
    w = trace_windows(rows, 3, 20.0)
    # starts at 0, 37.5, 75: [0, 20), [37.5, 57.5), [75, 95)
    assert [[r.input_len - 10 for r in x] for x in w] == [[0, 5, 10, 15], [40, 45, 50, 55],
                                                          [75, 80, 85, 90]]
    assert [r.arrival for r in w[1]] == [2.5, 7.5, 12.5, 17.5]
    assert len(trace_windows(rows, 1, 500.0)[0]) == 20
    with pytest.raises(ValueError, match="too short for 3 separate windows of 40 s"):
        trace_windows(rows, 3, 40.0)
    with pytest.raises(ValueError, match="sorted by arrival"):
        trace_windows(rows[::-1], 2, 10.0)


def test_eff_upper_counts_only_final_failures():
    """A request has failed for good once it is refused, finishes with every token stamped and
    ineffective, or has been sent and waited the TTFT bound without a first token; a finished
    request whose token is not collected yet, one not sent yet, or one still inside the bound
    has not."""
    from kvops.engine.metrics import eff_upper

    reqs = build_requests(pressure_rows(6, input_len=16, output_len=1), CFG.vocab_size)
    refused, uncollected, unsent, waited, fresh, slow = reqs
    refused.status = Status.REFUSED
    uncollected.status, uncollected.output = Status.FINISHED, [None]     # overlap: a step late
    slow.status, slow.output, slow.token_times = Status.FINISHED, [7], [1.0]   # TTFT 1 s
    fresh.arrival = 9.9
    for r in (unsent, waited, fresh):
        r.status = Status.WAITING
    assert eff_upper(reqs, 10.0, 0.25, 0.3, unsent=[unsent]) == pytest.approx(3 / 6)
    assert eff_upper(reqs, 10.0, 0.25, 0.3) == pytest.approx(2 / 6)
    assert eff_upper([], 10.0) != eff_upper([], 10.0)                    # NaN


def _bar_replay(model, config, bar, *, overlap=False, concurrency=None, ttft_s=0.25, n=12,
                output_len=48):
    """``n`` pressure requests (192 + ``output_len`` tokens, arriving at once) through
    ``config`` on the modeled clock, Eff@300's TTFT bound at ``ttft_s`` of it."""
    from kvops.engine.configs import decode_kind

    reqs = build_requests(pressure_rows(n, input_len=192, output_len=output_len),
                          CFG.vocab_size)
    kv = make_kv(config, KVBudget(bytes=96 * S * TOKEN_BYTES, max_seqs=8, max_context=256),
                 CFG, DT, torch.device("cpu"))
    engine = Engine(model, kv, decode_kind(config), SchedulerConfig(128, 8, 64), clock="model",
                    overlap=overlap)
    engine.eff = (ttft_s, 0.3)
    return reqs, kv, engine, engine.replay(reqs, concurrency=concurrency, eff_bar=bar)


def _failed_by_hand(reqs, now, ttft_s=0.25):
    """Requests failed for good at ``now``: finished ineffective, or without a first token
    ``ttft_s`` after arrival."""
    return sum(effective(r.arrival, r.token_times, ttft_s, 0.3) is False
               if r.status is Status.FINISHED else
               (not r.token_times and now - r.arrival >= ttft_s) for r in reqs)


@pytest.mark.parametrize("overlap,concurrency,ttft_s,output_len",
                         [(False, None, 0.25, 48), (True, None, 0.25, 48), (True, None, 0.25, 1),
                          (False, 3, 0.05, 48)],
                         ids=["sync", "overlap", "overlap-one-token", "closed-loop"])
def test_a_bar_at_a_replays_own_eff300_never_stops_it(model, overlap, concurrency, ttft_s,
                                                     output_len):
    """The bound is an upper bound in every mode: a bar equal to the replay's own Eff@300
    (reached only at its end) never stops it, and it gives the metrics of no bar. The queue
    (12 requests at once, 8 sessions; a closed loop of 3 clients, whose requests arrive when
    sent, at a bound of 0.05 s) and a TTFT bound of 0.25 s make the no-first-token rule the
    one that could fire; with overlap, finished requests' last tokens come a step late (a
    one-token request finishes with no token stamped)."""
    kw = dict(overlap=overlap, concurrency=concurrency, ttft_s=ttft_s, output_len=output_len)
    *_, free = _bar_replay(model, "paged", None, **kw)
    assert 0.0 < free["eff"] < 1.0
    *_, barred = _bar_replay(model, "paged", free["eff"], **kw)
    assert barred["stopped_s"] is None and barred["eff_upper"] is None
    for key in ("eff", "finished", "ttft_ms", "tpot_ms", "steps", "preemptions"):
        assert repr(barred[key]) == repr(free[key]), key     # NaN TPOT of one-token outputs


@pytest.mark.parametrize("config,ttft_s", [("paged", 0.05), ("offload", 0.25)])
def test_eff_bar_stops_a_replay_that_can_no_longer_reach_it(model, config, ttft_s):
    """A bar above what the replay can reach stops it: the bound it reports is the share of
    requests not failed for good then (counted by hand), at least the Eff@300 of the same
    replay run to its end (the modeled clock replays it step for step) and below the bar;
    fewer requests finish, and no page or swapped-out host copy is left. At a TTFT bound of
    0.05 s the stop comes before any request finishes (waiting without a first token alone);
    at 0.25 s ``offload`` has swapped requests out by then. A bar outside [0, 1] is refused."""
    reqs, _, _, full = _bar_replay(model, config, None, ttft_s=ttft_s)
    assert full["finished"] == 12 and full["stopped_s"] is None and full["eff_upper"] is None
    reqs, kv, engine, cut = _bar_replay(model, config, 1.0, ttft_s=ttft_s)
    assert cut["stopped_s"] is not None and cut["finished"] < 12
    if ttft_s == 0.05:
        assert cut["finished"] == 0
    assert cut["eff_upper"] == pytest.approx(
        1 - _failed_by_hand(reqs, cut["stopped_s"], ttft_s) / 12)
    if config == "offload":
        assert kv.swap_outs > 0
    assert full["eff"] <= cut["eff_upper"] < 1.0
    assert cut["eff"] <= full["eff"]               # what it had served: a lower bound
    assert kv.free_pages() == kv.total_pages and not engine.scheduler.running
    assert not engine.scheduler.waiting and kv.held_host_bytes() == 0 if config == "offload" \
        else True
    with pytest.raises(ValueError, match=r"eff_bar: expected a share in \[0, 1\]"):
        engine.replay(build_requests(pressure_rows(1, input_len=16, output_len=4),
                                     CFG.vocab_size), eff_bar=1.5)


def test_the_elastic_bar_goes_to_each_baseline_and_only_there(monkeypatch, tmp_path):
    """``eff_bar="elastic"``: the elastic replay runs without a bar, each later configuration
    with elastic's Eff@300; a bar outside Mooncake windows, or before elastic has run, is
    refused."""
    from kvops.engine import replay as replay_mod
    from kvops.engine.pressure import run_sweep, sweep_settings

    trace = tmp_path / "mooncake_small.jsonl"
    with open(trace, "w") as f:
        for i in range(92):
            f.write(json.dumps({"timestamp": 10000 * i, "input_length": 3000,
                                "output_length": 100, "hash_ids": []}) + "\n")
    seen = []
    real = Engine.replay

    def spy(self, requests, progress=None, concurrency=None, eff_bar=None):
        seen.append((len(requests), eff_bar))      # warm-ups replay a few requests of their own
        return real(self, requests, progress, concurrency, eff_bar)

    monkeypatch.setattr(Engine, "replay", spy)
    settings, axis = sweep_settings(torch.device("cpu"), str(trace),
                                    configs=("elastic", "paged", "offload"), thin=5,
                                    eff_bar="elastic")
    result = run_sweep(settings, axis, [0], progress=False)
    res = result["points"][0]["results"]
    n = res["elastic"]["requests"]
    assert [b for k, b in seen if k == n] == [None, res["elastic"]["eff"], res["elastic"]["eff"]]
    assert res["elastic"]["stopped_s"] is None
    assert all("eff_upper" in r and "stopped_s" in r for r in res.values())
    with pytest.raises(ValueError, match="eff_bar: 'elastic' needs the elastic configuration"):
        run_sweep(dataclasses.replace(settings, configs=("paged", "elastic")), axis, [0],
                  progress=False)
    with pytest.raises(ValueError, match="eff_bar: Eff@300 scores Mooncake windows"):
        replay_mod.run(dataclasses.replace(settings, trace_window=None), progress=False)


def test_mooncake_window_sweep_scores_eff300_and_draws_figure6(tmp_path):
    from kvops.engine.pressure import markdown, run_sweep, sweep_settings, write

    trace = tmp_path / "mooncake_small.jsonl"
    rng = np.random.default_rng(0)
    with open(trace, "w") as f:
        for i in range(92):                           # 910 s, a request every 10 s
            f.write(json.dumps({"timestamp": 10000 * i, "input_length": int(rng.integers(
                2000, 9000)), "output_length": int(rng.integers(60, 300)),
                "hash_ids": []}) + "\n")
    settings, axis = sweep_settings(torch.device("cpu"), str(trace),
                                    configs=("elastic", "paged"), thin=5)
    assert axis == "window" and settings.clock == "model"
    result = run_sweep(settings, axis, [2], progress=False)
    assert [p["x"] for p in result["points"]] == [2]
    for p in result["points"]:
        for r in p["results"].values():
            assert r["requests"] == 6 and r["finished"] == 6
            assert 0.0 <= r["eff"] <= 1.0 and r["clock"] == "model"
    table = write(result, tmp_path / "out")
    assert "| window | config |" in table and "| C | elastic | 6/6 |" in table
    assert "window C: elastic Eff@300 above every baseline" in table
    assert (tmp_path / "out" / "window_C.png").is_file()
    assert markdown(result) == table
    with pytest.raises(ValueError, match="points: expected window indices in 0..2"):
        run_sweep(settings, axis, [3], progress=False)
    # a baseline stopped under a bar shows the bound it stopped under, and the goal compares
    # elastic with that bound
    paged = result["points"][0]["results"]["paged"]
    elastic = result["points"][0]["results"]["elastic"]["eff"]
    paged.update(stopped_s=12.34, eff_upper=elastic / 2, eff=0.0)
    table = markdown(result)
    assert "| C | paged (stopped at 12.3 s) |" in table
    assert f"| 0.0-{100 * elastic / 2:.1f} |" in table and "a stopped replay" in table.lower()
    assert f"vs paged <= {100 * elastic / 2:.1f} % | higher | higher in A, B, C | yes |" in table

