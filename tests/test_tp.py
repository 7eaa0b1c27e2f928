"""Tensor parallelism on CPU: two ranks over gloo (kvops.models.tp, kvops.engine.distributed).

One spawn of two ranks runs every two-rank check (a spawn costs seconds) and each rank writes
what it saw; the tests below read it. Each rank also replays one scenario in a single process
(the tp=1 reference), so the references cost no extra time. Tiny shapes, one thread a rank.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from kvops.engine import Engine, KVBudget, SchedulerConfig, make_kv
from kvops.engine.configs import decode_kind
from kvops.engine.traces import TraceRow, build_requests
from kvops.models.config import LlamaConfig
from kvops.models.paged import forward_packed, random_llama
from tests.conftest import requires_cuda

# vocabulary 255: odd, so the vocab-parallel rows are padded on two ranks
CFG = LlamaConfig(vocab_size=255, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  hidden_dim=96, max_seq_len=1024)
TOK = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4      # float32 K+V bytes a token


def model(dtype=torch.float32):
    return random_llama(CFG, dtype=dtype, std=0.5, seed=3)


def scenario(name: str):
    """(config, rows, budget tokens, scheduler): prefix sharing with trims (finished requests
    keep only their hashed blocks, later ones alias them), or preemption under a tight budget;
    arrivals at 0 or far apart, so the schedule does not depend on wall time."""
    if name == "prefix":
        rows = [TraceRow(0.0 if i < 3 else 1000.0, 1100 + 50 * i, 24, (1, 2 + i % 2, 10 + i))
                for i in range(6)]
        return "paged", rows, 4096, SchedulerConfig(64, 8, 32)
    if name == "elastic":        # 40 pages: paged preempts 3 times, elastic demotes instead
        rows = [TraceRow(0.0, 600 + 50 * i, 120 + 8 * i) for i in range(8)]
        return "elastic", rows, 40 * 16 // 2, SchedulerConfig(64, 8, 32)   # bf16: half TOK
    rows = [TraceRow(0.0, 600 + 50 * i, 40 + 8 * i) for i in range(8)]
    return "pager+merge", rows, 8 * 64 + 160, SchedulerConfig(64, 8, 32)   # arenas + 10 pages


def replay(name: str, m, tp=None, record=None, tamper=None):
    """Serve ``scenario(name)``; returns (tokens, [kv_state after each commit], kv)."""
    from kvops.engine.distributed import kv_state

    config, rows, budget_tokens, sched = scenario(name)
    reqs = build_requests(rows, CFG.vocab_size, length_scale=0.125)
    cfg = m.cfg
    budget = KVBudget(bytes=budget_tokens * TOK, max_seqs=8, max_context=192, window=64)
    elastic = config == "elastic"
    kv = make_kv(config, budget if tp is None else tp.kv_budget(budget), cfg,
                 torch.bfloat16 if elastic else torch.float32, torch.device("cpu"),
                 fidelity={"min_batch": 2, "protect_recent": 1} if elastic else None)
    states = []
    commit = kv.commit_step

    def recorded(admits, grows):
        out = commit(admits, grows)
        states.append(kv_state(kv))
        if tamper is not None:
            tamper(kv, len(states))
        return out

    kv.commit_step = recorded
    make = Engine if tp is None else tp.engine
    engine = make(m, kv, decode_kind(config), sched)
    metrics = engine.replay(reqs)
    return [r.output for r in reqs], states, kv, metrics


def _rank(rank: int, out: str) -> None:
    from kvops.engine import distributed
    from kvops.models.tp import shard_llama

    torch.set_num_threads(1)
    tp = distributed.init(2, rank=rank, device="cpu", check_every=2, timeout_s=120)
    res = {}
    # logits: the dense forward and the packed forward of the engine, float32 and bfloat16
    tokens = torch.randint(0, CFG.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        full = model(dtype)
        want = full(tokens)
        want_packed = _packed(full, tokens[0])
        sharded = shard_llama(model(dtype))
        res[f"logits_{dtype}"] = (want, sharded(tokens), want_packed, _packed(sharded, tokens[0]))
    res["local_kv_heads"] = sharded.cfg.n_kv_heads
    # compiled: the sharded decode step traces whole (fullgraph) with its collectives
    dm = shard_llama(model())
    tok, pos = torch.tensor([3, 5]), torch.tensor([0, 0])
    dm.setup_cache(2, 32, 16)
    compiled = torch.compile(dm.decode_step, backend="eager", fullgraph=True)(tok, pos)
    dm.setup_cache(2, 32, 16)
    res["compiled"] = (dm.decode_step(tok, pos), compiled)
    # replays: both ranks serve both scenarios; rank r also serves scenario r in one process
    mine = ("prefix", "preempt")[rank]
    res["plain"] = replay(mine, model())[:2]
    res["plain_name"] = mine
    sm = tp.shard(model())
    try:                                             # rank 1 draws other weights
        tp.shard(random_llama(CFG, dtype=torch.float32, std=0.5, seed=3 + rank))
        res["other_weights"] = None
    except distributed.TPDivergence as exc:
        res["other_weights"] = str(exc)
    for name in ("prefix", "preempt"):
        toks, states, kv, metrics = replay(name, sm, tp)
        res[name] = (toks, states, kv.free_pages(), kv.total_pages, metrics["preemptions"],
                     metrics["prefix_hit_tokens"])

    # the elastic configuration: rank 1's policy would demote in other batches (min_batch
    # 64); through FidelitySync it applies rank 0's decisions in the same frames
    def other_batches(kv, n):
        if rank == 1 and n == 1:
            kv.fidelity.min_batch = 64
    toks, states, kv, metrics = replay("elastic", tp.shard(model(torch.bfloat16)), tp,
                                       tamper=other_batches)
    res["elastic"] = (toks, states, kv.free_pages(), kv.total_pages, metrics["preemptions"],
                      dict(kv.fidelity.stats), kv.fidelity.min_batch)
    # fidelity on a pager: rank 1's own policy would decide otherwise (min_batch 16, and its
    # promotions finish only when waited for); with rank 0's plans it applies rank 0's
    res["fidelity_tp"] = fidelity_script(rank, tp)
    res["fidelity_alone"] = fidelity_script(rank, None)
    # a forced divergence: rank 1's pager takes one page more after its third commit
    def extra_page(kv, n):
        if rank == 1 and n == 3:
            with kv.pager.frame() as f:
                f.reserve("not-from-rank-0", 1)
    try:
        replay("preempt", sm, tp, tamper=extra_page)
        res["divergence"] = None
    except distributed.TPDivergence as exc:
        res["divergence"] = str(exc)
    with open(f"{out}/rank{rank}.pkl", "wb") as fh:
        pickle.dump(res, fh)


def fidelity_script(rank: int, tp):
    """Frames on a pager with a fidelity policy (rank 0's, or through FidelitySync from rank
    0's plans): grow three sessions, demote on a shortage, promote, settle, grow and end one.
    Returns each frame's (block_table, seq_lens, base_span, free pages, stats, plan) and
    whether every TARGET block came back bit for bit."""
    from kvops.engine.distributed import FidelitySync
    from kvops.runtime import Fidelity, Pager
    from tests.test_fidelity import _SlowFidelity

    S, P = 8, 40
    pager = Pager(P, S, 4, 16)
    g = torch.Generator().manual_seed(10 + rank)        # each rank its own heads' bytes
    k, v = (torch.randn(P, S, 1, 16, generator=g).half() for _ in range(2))
    k0, v0 = k.clone(), v.clone()
    fid = (Fidelity if rank == 0 else _SlowFidelity)(
        pager, [k, v], min_batch=4 if rank == 0 else 16, protect_recent=1)
    sync = FidelitySync(fid, rank == 0) if tp is not None else None
    script = [({"a": 9 * S + 3, "b": 6 * S, "c": 2 * S + 1}, None, 0),
              ({}, None, "short5"), ({}, None, 0), ({}, None, 0), ({"a": 2}, "c", 0), ({}, None, 0)]
    out = []
    for grows, end, need in script:
        if sync is not None and rank != 0:
            sync.exchange(tp)
        with pager.frame() as f:
            n = f.free_pages + 5 if need == "short5" else need
            (sync or fid).step(f, n)
            for key, t in grows.items():
                f.reserve(key, t)
            if end:
                f.trim(end)
        if sync is not None and rank == 0:
            sync.exchange(tp)
        t = pager.host_tables
        out.append((t["block_table"].copy(), t["seq_lens"].copy(), t["base_span"].copy(),
                    pager.free_pages, dict(fid.stats), fid.last_plan))
    first, last = out[0][0], out[-1][0]            # block tables after growth and at the end
    same = all(torch.equal(k[last[s, j]], k0[first[s, j]]) and
               torch.equal(v[last[s, j]], v0[first[s, j]])
               for s in range(first.shape[0]) for j in range(first.shape[1])
               if first[s, j] >= 0 and last[s, j] >= 0)
    return out, same, fid.stats["demoted"], fid.stats["promoted"]


def _packed(m, tokens):
    """Logits of one sequence through forward_packed with dense causal attention."""
    from kvops.models.paged import logits

    def attend(i, q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1)

    pos = torch.arange(tokens.shape[0])
    return logits(m, forward_packed(m, tokens, pos, attend))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from kvops.engine import distributed

    out = tmp_path_factory.mktemp("tp")
    distributed.spawn(_rank, 2, str(out))
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp_logits_equal_the_single_process_model(ranks, dtype):
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    for res in ranks:
        want, got, want_packed, got_packed = res[f"logits_{dtype}"]
        assert got.shape == want.shape == (2, 21, CFG.vocab_size)
        scale = want.abs().max()
        assert (got - want).abs().max() <= tol * scale
        assert (got_packed - want_packed).abs().max() <= tol * scale
    # every rank gathers the same logits
    assert torch.equal(ranks[0][f"logits_{dtype}"][1], ranks[1][f"logits_{dtype}"][1])
    assert ranks[0]["local_kv_heads"] == CFG.n_kv_heads // 2


def test_tp_decode_step_compiles_fullgraph_with_its_collectives(ranks):
    for res in ranks:
        eager, compiled = res["compiled"]
        torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("name", ["prefix", "preempt"])
def test_tp_replay_pager_states_and_tokens_equal_on_every_rank_and_to_tp1(ranks, name):
    r0, r1 = ranks[0][name], ranks[1][name]
    toks, states, free, total, preemptions, hits = r0
    assert r0[:2] == r1[:2]                        # tokens, every commit's (epoch, free, tables)
    assert free == total == r1[2] == r1[3]         # every page came back on both ranks
    plain = next(res["plain"] for res in ranks if res["plain_name"] == name)
    assert toks == plain[0] and states == plain[1]
    assert all(len(t) > 0 for t in toks)
    if name == "prefix":
        assert hits > 0                            # aliases of cached (trimmed) prefixes
    else:
        assert preemptions > 0


def test_tp_forced_divergence_is_detected_on_every_rank(ranks):
    for res in ranks:
        msg = res["divergence"]
        assert msg is not None, "an extra page on rank 1 went unnoticed"
        assert "diverged after commit 4" in msg and "rank 1 differs in epoch, free_pages" in msg
        assert "table_hash" in msg


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(p, q))
        for p, q in zip(a, b))


def test_tp_fidelity_applies_rank0s_demotions_and_promotions_in_the_same_frame(ranks):
    (f0, ok0, dem0, pro0), (f1, ok1, dem1, pro1) = (res["fidelity_tp"] for res in ranks)
    assert dem0 == 5 and pro0 == 5 and (dem1, pro1) == (dem0, pro0)
    assert _same(f0, f1)                         # tables, spans, free pages, stats, plans
    assert ok0 and ok1                           # promotion restored TARGET bit for bit
    # rank 0 alone decides the same; rank 1 alone would not (min_batch 16, slow promotions)
    assert _same(ranks[0]["fidelity_alone"][0], f0)
    assert not _same(ranks[1]["fidelity_alone"][0], f0)


def test_tp_elastic_replay_demotes_in_the_same_frames_on_every_rank(ranks):
    """The engine's elastic configuration under TP: rank 0 decides every demotion and
    promotion, rank 1 (whose own policy would batch otherwise) applies them in the same
    frames: the same tokens, the same (epoch, free pages, tables) after every commit, zero
    preemptions where paged preempts, every page back. (In bfloat16 the sharded sums round
    otherwise than one process's, so its tokens may part from the single-process replay's;
    the float32 scenarios above compare those.)"""
    (t0, s0, free0, total0, pre0, st0, mb0), (t1, s1, free1, total1, pre1, st1, mb1) = (
        res["elastic"] for res in ranks)
    assert mb0 == 2 and mb1 == 64                # rank 1's policy really was set otherwise
    assert st0["demoted"] > 0 and st0["promoted"] > 0 and pre0 == pre1 == 0
    assert (st1["demoted"], st1["promoted"]) == (st0["demoted"], st0["promoted"])
    assert t0 == t1 and s0 == s1 and len(s0) > 10
    assert free0 == total0 and free1 == total1


def test_tp_shard_refuses_ranks_with_other_full_weights(ranks):
    for res in ranks:
        assert res["other_weights"] is not None
        assert "shard: ranks [1] hold other full weights than rank 0" in res["other_weights"]


def test_bad_tp_is_refused_naming_the_argument():
    from kvops.models.tp import check_tp, shard_llama

    with pytest.raises(ValueError, match=r"tp: expected a divisor of the model's n_kv_heads "
                                         r"\(Hkv\)=2 .*got tp=4"):
        check_tp(CFG, 4)
    with pytest.raises(ValueError, match=r"n_heads \(Hq\)=4.*got tp=3"):
        shard_llama(model(), rank=0, tp=3)
    with pytest.raises(ValueError, match="tp: expected a positive int"):
        check_tp(CFG, 0)


def test_replay_cli_tp1_runs_the_distributed_path_with_the_same_tokens(tmp_path):
    import json

    from kvops.cli import main

    common = ["replay", "--model", "tiny", "--max-requests", "2", "--configs", "paged",
              "--length-scale", "0.03", "--no-figures", "--no-progress", "--device", "cpu"]
    assert main(common + ["--out", str(tmp_path / "a")]) == 0
    assert main(common + ["--tp", "1", "--out", str(tmp_path / "b")]) == 0
    assert main(common + ["--tp", "1", "--clock", "model", "--out", str(tmp_path / "c")]) == 0
    assert main(common + ["--clock", "model", "--out", str(tmp_path / "d")]) == 0
    a, b, c, d = (json.loads((tmp_path / d / "replay.json").read_text()) for d in "abcd")
    assert b["tp"] == 1 and "tensor-parallel over 1 ranks" in b["model"]
    assert a["tokens"] == b["tokens"] and sum(map(len, a["tokens"]["paged"])) > 0
    # on the modeled clock rank 0 schedules the very steps of the plain replay
    assert c["tokens"] == d["tokens"] == a["tokens"]
    assert ([s["tokens"] for s in c["steps"]["paged"]]
            == [s["tokens"] for s in d["steps"]["paged"]])
    with pytest.raises(SystemExit, match=r"--tp: expected a divisor of the model's n_heads "
                                         r"\(Hq\)=4 .*got tp=3 \(model tiny\)"):
        main(common + ["--tp", "3"])            # refused before any process starts
    from kvops.engine.distributed import TPContext
    from kvops.engine.replay import ReplaySettings, run

    fake = TPContext(0, 2, None, None, torch.device("cpu"))
    for config in ("kvrm", "kvrm-ret"):
        with pytest.raises(ValueError, match="'kvrm' and 'kvrm-ret' are not served under tensor "
                                             "parallelism"):
            run(ReplaySettings(configs=(config,), model="tiny"), progress=False, tp=fake)


@requires_cuda
def test_cuda_replay_tp1_over_nccl_gives_the_plain_replays_tokens():
    # the path a multi-GPU run takes, on one GPU: NCCL world of one, CUDA graphs holding its
    # collectives, plans on gloo; SmolLM2's shape (random weights, bf16), a short replay
    import torch.distributed as dist

    from kvops.engine import distributed
    from kvops.engine.replay import ReplaySettings, run

    dev = torch.device("cuda")
    # the modeled clock: both runs schedule the same steps (on the wall clock the slower
    # distributed path batches arrivals otherwise, and other GEMM shapes round otherwise)
    settings = ReplaySettings.for_device(dev, model="smollm2-random", max_requests=6,
                                         length_scale=0.1, configs=("static", "pager+merge",
                                                                    "paged"), device="cuda",
                                         clock="model")
    plain = run(settings, progress=False)
    os.environ["MASTER_PORT"] = str(distributed.free_port())
    tp = distributed.init(1, rank=0, device="cuda")
    try:
        got = run(settings, progress=False, tp=tp)
    finally:
        dist.destroy_process_group()
    for name in settings.configs:
        assert got["tokens"][name] == plain["tokens"][name], name
        assert got["results"][name]["recaptures"] == 0


def test_kvlog_replays_a_kv_managers_own_editing_methods_by_request_id():
    from types import SimpleNamespace

    from kvops.engine.distributed import FollowerEngine, KVLog, StepPlan, TPDivergence

    class Manager:
        tp_edits = ("touch",)

        def __init__(self):
            self.seen = []

        def touch(self, req, blocks=()):
            self.seen.append((req.rid, tuple(blocks)))

        def read(self):
            return len(self.seen)

    rows = [TraceRow(0.0, 80, 4), TraceRow(0.0, 96, 4)]
    mine, theirs = (build_requests(rows, CFG.vocab_size, length_scale=0.125) for _ in range(2))
    log = KVLog(Manager(), tp=None, checker=None)
    log.touch(mine[1], blocks=[2, 3])
    assert log.read() == 1 and log._edits == [("call", "touch", (log._edits[0][2][0],),
                                               {"blocks": [2, 3]})]
    follower = SimpleNamespace(kv=Manager(), checker=SimpleNamespace(commits=0))
    FollowerEngine.apply(follower, StepPlan(log._edits), {r.rid: r for r in theirs})
    assert follower.kv.seen == [(1, (2, 3))]
    follower.kv.tp_edits = ()
    with pytest.raises(TPDivergence, match="'touch' .* does not name in tp_edits"):
        FollowerEngine.apply(follower, StepPlan(log._edits), {r.rid: r for r in theirs})


def test_replay_cli_elastic_sweep_under_tp2_schedules_what_one_process_does(tmp_path):
    """``kvops replay --mode elastic --tp 2`` (two gloo ranks, the modeled clock): the pressure
    point's four configurations serve every request with the preemptions, demotion batches,
    promotions and KV pages of the single-process sweep (the ranks' consistency checks on);
    elastic demotes where paged preempts."""
    import json

    from kvops.cli import main

    common = ["replay", "--mode", "elastic", "--model", "tiny", "--sweep", "12", "--clock",
              "model", "--device", "cpu", "--no-progress", "--no-figures"]
    assert main(common + ["--out", str(tmp_path / "one")]) == 0
    assert main(common + ["--tp", "2", "--check-every", "4", "--out", str(tmp_path / "tp")]) == 0
    one, tp = (json.loads((tmp_path / d / "pressure.json").read_text())["points"][0]["results"]
               for d in ("one", "tp"))
    keys = ("finished", "preemptions", "demotion_batches", "promotions", "demoted_pairs",
            "kv_pages", "kv_free_pages_end", "steps")
    for config in ("elastic", "paged", "offload", "reserve"):
        assert {k: tp[config].get(k) for k in keys} == {k: one[config].get(k) for k in keys}
        assert tp[config]["finished"] == 24
    assert one["elastic"]["preemptions"] == 0 and one["elastic"]["demotion_batches"] > 0
    assert one["paged"]["preemptions"] > 0 and one["offload"]["preemptions"] > 0
