"""ElasticKV in the engine (kvops.engine: ``elastic``, ``offload``, ``reserve``) on CPU with a tiny
random Llama in bfloat16: under KV pressure ``elastic`` serves every request without a
preemption, a request that never had a BASE block gets exactly the tokens of the exact
``reserve`` run, ``offload`` swaps and keeps every token, demotion then promotion gives the
bytes back bit for bit, no page or host slot is lost, and bad inputs name themselves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvops.engine import Engine, KVBudget, SchedulerConfig, elastic_kv, make_kv
from kvops.engine.configs import decode_kind
from kvops.engine.elastic_kv import ElasticKV
from kvops.engine.traces import TraceRow, build_requests, pressure_rows
from kvops.models.config import LlamaConfig
from kvops.models.paged import random_llama
from kvops.runtime.fidelity import TARGET
from tests.test_fidelity import _SlowFidelity

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  hidden_dim=128, max_seq_len=1024)
DT = torch.bfloat16
TOKEN_BYTES = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 2
S = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return random_llama(CFG, dtype=DT, std=0.5)


def serve(model, config, rows, *, pages=96, concurrency=8, fidelity=None, clock="wall"):
    reqs = build_requests(rows, CFG.vocab_size)
    kv = make_kv(config, KVBudget(bytes=pages * S * TOKEN_BYTES, max_seqs=8, max_context=256),
                 CFG, DT, torch.device("cpu"), fidelity=fidelity)
    engine = Engine(model, kv, decode_kind(config), SchedulerConfig(128, 8, 64), clock=clock)
    m = engine.replay(reqs, concurrency=concurrency)
    return reqs, kv, engine, m


# 12 requests of 192 + 48 tokens (15 blocks), 8 in flight: 120 blocks of context on 96 pages
ROWS = pressure_rows(12, input_len=192, output_len=48)


@pytest.fixture(scope="module")
def runs(model):
    return {c: serve(model, c, ROWS) for c in ("reserve", "paged", "offload", "elastic")}


def test_elastic_serves_the_pressure_replay_without_preemption(runs):
    reqs, kv, engine, m = runs["elastic"]
    assert runs["paged"][3]["preemptions"] > 0           # the budget is under pressure
    assert m["finished"] == len(reqs) and [len(r.output) for r in reqs] == [48] * len(reqs)
    assert m["preemptions"] == 0 and all(r.preemptions == 0 for r in reqs)
    assert m["demotion_batches"] > 0 and m["base_exposure_max"] > 0
    assert m["promotions"] > 0 and m["fidelity_ms_per_step"] > 0
    assert 0 < m["demotion_step_share"] < 1
    # every page and host slot back, nothing BASE, no session left
    assert kv.free_pages() == kv.total_pages and kv.pager.sessions() == []
    assert kv.fidelity.host_free == kv.total_pages and kv.fidelity.stats["base_blocks"] == 0
    # the closed loop keeps at most 8 requests in flight
    assert max(s.running + s.waiting for s in engine.steps) <= 8


def test_policy_time_breaks_down_into_the_papers_phases(runs):
    """Each step's policy host time splits into its phases: demotion time exactly in the steps
    that demote, promotion-issue time exactly in the steps that issue promotions, the phases
    within the policy's time, the policy within the commit's; the replay's means add up to
    the policy's and commit's time a step."""
    _, _, engine, m = runs["elastic"]
    steps = engine.steps
    assert all((s.demote_s > 0) == (s.demoted > 0) for s in steps)
    assert all((s.promote_s > 0) == (s.promoted > 0) for s in steps)
    assert all(s.settle_s + s.demote_s + s.promote_s <= s.fidelity_s <= s.commit_s
               for s in steps)
    br = m["policy_ms"]
    assert set(br) == {"control", "demotion", "promotion", "metadata"}
    assert br["demotion"] > 0 and br["promotion"] > 0 and br["control"] > 0
    assert br["control"] + br["demotion"] + br["promotion"] == pytest.approx(
        m["fidelity_ms_per_step"])
    commit_ms = sum(s.commit_s for s in steps) / len(steps) * 1e3
    assert sum(br.values()) == pytest.approx(commit_ms)
    paged = runs["paged"][3]["policy_ms"]                # no policy: the commit is metadata
    assert paged["control"] == paged["demotion"] == paged["promotion"] == 0


def test_requests_that_never_had_a_base_block_get_the_exact_tokens(runs):
    reqs, kv, _, _ = runs["elastic"]
    exact = [r.output for r in runs["reserve"][0]]
    touched = kv.base_touched
    assert 0 < len(touched) < len(reqs)
    for r, want in zip(reqs, exact):
        if r.rid not in touched:
            assert r.output == want, f"request {r.rid} had no BASE block, its tokens differ"


def test_offload_swaps_and_keeps_every_token_and_reserve_never_preempts(runs):
    exact = [r.output for r in runs["reserve"][0]]
    assert runs["reserve"][3]["preemptions"] == 0
    reqs, kv, _, m = runs["offload"]
    assert m["preemptions"] > 0 and m["swap_outs"] == m["swap_ins"] == m["preemptions"]
    assert [r.output for r in reqs] == exact
    assert [r.output for r in runs["paged"][0]] == exact      # recompute is exact too
    for c in ("reserve", "offload", "paged"):
        kv = runs[c][1]
        assert kv.free_pages() == kv.total_pages and kv.pager.sessions() == []


def test_elastic_without_demotion_is_the_paged_run(model, runs):
    reqs, kv, _, m = serve(model, "elastic", ROWS, fidelity={"demote": False})
    assert m["demotion_batches"] == 0 and not kv.base_touched
    assert m["preemptions"] == runs["paged"][3]["preemptions"]
    assert [r.output for r in reqs] == [r.output for r in runs["paged"][0]]


def _filled_kv(sessions=3, blocks=8):
    kv = make_kv("elastic", KVBudget(bytes=32 * S * TOKEN_BYTES, max_seqs=4, max_context=256),
                 CFG, DT, torch.device("cpu"), fidelity={"min_batch": 2, "protect_recent": 1})
    with kv.pager.frame() as f:
        for i in range(sessions):
            f.reserve(f"s{i}", blocks * S)
    g = torch.Generator().manual_seed(0)
    kv.k_pool.copy_(torch.randn(kv.k_pool.shape, generator=g).to(DT))
    kv.v_pool.copy_(torch.randn(kv.v_pool.shape, generator=g).to(DT))
    return kv


def _blocks_of(kv, key):
    pages = torch.tensor(kv.pager.pages(key))
    return kv.k_pool[:, pages].clone(), kv.v_pool[:, pages].clone()


def test_promotions_running_at_the_next_schedule_change_nothing(model, monkeypatch):
    """On CUDA a promotion runs on a side stream while the host schedules the next step (the
    overlapped engine), and is done by that step's commit. The pages the scheduler counts as
    demotable must not depend on it: the replay is the one whose promotions finish at once,
    step for step and token for token, without a preemption."""
    rows = pressure_rows(16, input_len=192, output_len=48)
    plain = serve(model, "elastic", rows, clock="model")
    before_reserves = ElasticKV._before_reserves

    def done_by_the_commit(self, f, reserves):
        fid = self.fidelity
        for pr in [*fid._orphans, *(pr for prs in fid._flight.values() for pr in prs)]:
            pr.done.synchronize()
        return before_reserves(self, f, reserves)

    monkeypatch.setattr(elastic_kv, "Fidelity", _SlowFidelity)   # done only when flagged
    monkeypatch.setattr(ElasticKV, "_before_reserves", done_by_the_commit)
    lagged = serve(model, "elastic", rows, clock="model")
    assert isinstance(lagged[1].fidelity, _SlowFidelity)
    assert lagged[3]["promotions"] == plain[3]["promotions"] > 0
    assert lagged[3]["preemptions"] == plain[3]["preemptions"] == 0
    assert len(lagged[2].steps) == len(plain[2].steps)
    assert [r.output for r in lagged[0]] == [r.output for r in plain[0]]


def test_demoted_then_promoted_blocks_are_bit_exact():
    kv = _filled_kv()
    before = {k: _blocks_of(kv, k) for k in kv.pager.sessions()}
    with kv.pager.frame() as f:                  # 24 of 32 pages used: short by 6
        got = kv.fidelity.step(f, need=kv.pager.free_pages + 6)
    assert got["demoted"] >= 6
    assert any((kv.fidelity.block_states(k) != TARGET).any() for k in before)
    for _ in range(20):                          # spare pages: promotions, then their settles
        with kv.pager.frame() as f:
            kv.fidelity.step(f, need=0)
        if kv.fidelity.stats["base_blocks"] == 0 and kv.fidelity.stats["in_flight"] == 0:
            break
    assert kv.fidelity.stats["promoted"] == got["demoted"]
    for k, (kb, vb) in before.items():
        ka, va = _blocks_of(kv, k)
        assert torch.equal(ka.view(torch.int16), kb.view(torch.int16)), k
        assert torch.equal(va.view(torch.int16), vb.view(torch.int16)), k


def test_excluded_sessions_are_never_demoted():
    kv = _filled_kv()
    with kv.pager.frame() as f:
        kv.fidelity.step(f, need=kv.pager.free_pages + 30, exclude={"s1"})
    assert (kv.fidelity.block_states("s1") == TARGET).all()
    assert (kv.fidelity.block_states("s0") != TARGET).any()
    assert kv.fidelity.demotable("s1") == 3 and kv.fidelity.demotable("s0") == 0   # 8 blocks, 1 protected
    assert kv.fidelity._pool is not None      # every layer's K and V as one pool: one call a batch


def test_a_prefill_over_base_blocks_is_refused(model):
    kv = make_kv("elastic", KVBudget(bytes=32 * S * TOKEN_BYTES, max_seqs=4, max_context=256),
                 CFG, DT, torch.device("cpu"), fidelity={"min_batch": 1})
    engine = Engine(model, kv, "elastic")
    req = build_requests([TraceRow(0.0, 100, 4)], CFG.vocab_size)[0]
    with kv.pager.frame() as f:
        f.reserve(req.key, 80)
    with kv.pager.frame() as f:
        kv.fidelity.step(f, need=kv.pager.free_pages + 1)
    assert kv.fidelity.span(req.key) != (0, 0)
    with pytest.raises(RuntimeError, match="holds BASE blocks"):
        engine.runner.run([(req, 80, 20)])


def test_bad_inputs_name_themselves(model):
    budget = KVBudget(bytes=32 * S * TOKEN_BYTES, max_seqs=4, max_context=256)
    with pytest.raises(TypeError, match="dtype: .*float16 or bfloat16"):
        make_kv("elastic", budget, CFG, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="fidelity: only the elastic"):
        make_kv("paged", budget, CFG, DT, torch.device("cpu"), fidelity={"min_batch": 2})
    with pytest.raises(ValueError, match="min_batch"):
        make_kv("elastic", budget, CFG, DT, torch.device("cpu"), fidelity={"min_batch": 0})
    kv = make_kv("paged", budget, CFG, DT, torch.device("cpu"))
    with pytest.raises(ValueError, match="decode: 'elastic' needs"):
        Engine(model, kv, "elastic")
    with pytest.raises(ValueError, match="concurrency: expected an int >= 1"):
        Engine(model, kv, "paged").replay([], concurrency=0)
    ekv = make_kv("elastic", budget, CFG, DT, torch.device("cpu"))
    with ekv.pager.frame() as f, pytest.raises(TypeError, match="exclude: expected a collection"):
        ekv.fidelity.step(f, need=0, exclude="s0")
    with pytest.raises(ValueError, match="input_len: expected"):
        pressure_rows(4, input_len=0)


def test_pressure_rows():
    rows = pressure_rows(5, input_len=4096, output_len=1024, output_scale=0.25)
    assert [(r.arrival, r.input_len, r.output_len) for r in rows] == [(0.0, 4096, 256)] * 5
    assert np.all(np.diff([r.arrival for r in pressure_rows(3, rate=2.0, seed=1)]) > 0)


def test_replay_mode_elastic_writes_table_json_and_figure(tmp_path, capsys):
    from kvops.cli import main

    out = tmp_path / "out"
    rc = main(["replay", "--mode", "elastic", "--configs", "elastic,paged", "--sweep", "2",
               "--input-len", "512", "--output-len", "128", "--requests-per-client", "1",
               "--max-seqs", "4", "--out", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| concurrency | config |" in text and "| 2 | elastic | 2/2 | 0 |" in text
    assert any(line.startswith("| elastic preemptions | 0 |") for line in text.splitlines())
    data = __import__("json").loads((out / "pressure.json").read_text())
    assert [p["x"] for p in data["points"]] == [2.0]
    assert set(data["points"][0]["results"]) == {"elastic", "paged"}
    assert (out / "pressure.md").is_file() and (out / "pressure_ttft.png").is_file()
    with pytest.raises(SystemExit, match="--sweep: expected comma-separated numbers"):
        main(["replay", "--mode", "elastic", "--sweep", "a,b", "--out", str(out)])
    with pytest.raises(SystemExit, match="--eff-bar: expected a share in \\[0, 1\\] or 'elastic'"):
        main(["replay", "--mode", "elastic", "--eff-bar", "most", "--out", str(out)])


def test_fidelity_settings_parse():
    from kvops.cli import parse_fidelity

    assert parse_fidelity("reserve_decay=0,max_promote=0,demote=0") == {
        "reserve_decay": 0.0, "max_promote": 0, "demote": False}
    assert parse_fidelity(None) is None
    with pytest.raises(SystemExit, match="--fidelity: expected K=V"):
        parse_fidelity("watermark=3")
    with pytest.raises(SystemExit, match="--fidelity: min_batch: expected an int"):
        parse_fidelity("min_batch=x")


def test_sweep_over_sharegpt_rates(tmp_path):
    from kvops.engine.pressure import markdown, run_sweep, sweep_settings

    csv = tmp_path / "sharegpt_stats.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{200 + 37 * i},{24 + 8 * i}\n" for i in range(8)))
    settings, axis = sweep_settings(torch.device("cpu"), str(csv), configs=("elastic", "reserve"),
                                    max_requests=3, max_seqs=4)
    assert axis == "rate" and settings.kind == "sharegpt"
    result = run_sweep(settings, axis, [50.0, 100.0], progress=False)
    assert [p["x"] for p in result["points"]] == [50.0, 100.0]
    for p in result["points"]:
        assert {r["finished"] for r in p["results"].values()} == {3}
    table = markdown(result)
    assert "| rate | config |" in table and "At rate 100:" in table
    with pytest.raises(ValueError, match="points: expected positive numbers"):
        run_sweep(settings, axis, [0.0], progress=False)
