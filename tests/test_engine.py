"""The serving engine (kvops.engine) on CPU: a tiny random Llama (its logits are peaked, so
greedy tokens are stable across attention paths), the trace loaders, and the replay CLI.
SmolLM2 against transformers lives in tests/test_engine_smollm2.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvops.engine import CONFIGS, Engine, KVBudget, Request, SchedulerConfig, Status, make_kv
from kvops.engine.configs import decode_kind, is_elastic
from kvops.engine.kv import PagedKV
from kvops.engine.runner import bucket_of
from kvops.engine.traces import (
    TraceRow,
    build_requests,
    densest_window,
    load_rows,
    parse_azure_time,
    repeated_block_tokens,
)
from kvops.models.config import LlamaConfig
from kvops.models.paged import random_llama
from kvops.runtime.far_view import FarView
from tests.conftest import requires_cuda

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"
CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  hidden_dim=128, max_seq_len=1024)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return random_llama(CFG, dtype=torch.float32, std=0.5)


def serve(model, rows, config="paged", *, budget_tokens=4096, max_seqs=8, max_context=192,
          window=192, length_scale=0.125, sched=None, prefix=True, clock="wall", engine=False,
          page_size=16, **budget):
    reqs = build_requests(rows, CFG.vocab_size, length_scale=length_scale)
    tok = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4
    kv = make_kv(config, KVBudget(bytes=budget_tokens * tok, max_seqs=max_seqs,
                                  max_context=max_context, window=window, page_size=page_size,
                                  **budget),
                 CFG, torch.float32, torch.device("cpu"), prefix_sharing=prefix)
    eng = Engine(model, kv, decode_kind(config),
                 sched or SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs,
                                          long_prefill_tokens=32), clock=clock)
    metrics = eng.replay(reqs)
    return (reqs, kv, metrics, eng) if engine else (reqs, kv, metrics)


def burst(n=8):
    # lengths / 8: prompts 75-118 tokens, outputs 5-12; hash blocks of 64 tokens
    return [TraceRow(0.001 * i, 600 + 50 * i, 40 + 8 * i, (1, 2 + i % 2) if i % 3 else ())
            for i in range(n)]


@pytest.mark.parametrize("config", [c for c in CONFIGS if not is_elastic(c)])
def test_replay_finishes_every_request_with_its_length_and_leaks_no_page(model, config):
    # the elastic configurations need a 16-bit KV cache: tests/test_engine_elastic.py and
    # tests/test_engine_elastic_ablations.py serve them in bfloat16
    reqs, kv, m = serve(model, burst(), config)
    assert m["finished"] == len(reqs) and m["refused"] == 0
    assert 0 < m["commit_share"] < m["control_share"] < 1
    assert [len(r.output) for r in reqs] == [r.output_len for r in reqs]
    assert all(len(r.token_times) == r.output_len for r in reqs)
    if kv.kind == "paged":
        assert kv.free_pages() == kv.total_pages and kv.pager.sessions() == []


def test_prefix_hits_equal_the_traces_repeated_blocks(model):
    # one request at a time (arrivals far apart): every repeated chain is cached when it comes
    rows = [TraceRow(100.0 * i, 1100 + 50 * i, 24, (1, 2 + i % 2, 10 + i)) for i in range(6)]
    reqs, kv, m = serve(model, rows)
    want = repeated_block_tokens(reqs)
    assert want == 5 * 64 + 4 * 64          # block 1 five times, (1, 2) and (1, 3) twice each
    assert m["prefix_hit_tokens"] == want == sum(r.prefix_hit for r in reqs)
    # sharing changes no token
    plain, _, _ = serve(model, rows, prefix=False)
    assert [r.output for r in reqs] == [r.output for r in plain]
    assert kv.free_pages() == kv.total_pages


def test_prefix_sharing_mid_page_copies_on_write(model):
    # hash blocks of 77 tokens (lengths x 0.15): an alias ends inside a page, whose first write
    # copies it; tokens stay those of unshared serving, every page comes back
    rows = [TraceRow(100.0 * i, 1100 + 50 * i, 60, (1, 2 + i % 2, 10 + i)) for i in range(6)]
    reqs, kv, m = serve(model, rows, length_scale=0.15, max_context=256)
    assert m["finished"] == 6
    assert reqs[0].hash_block == 77 and m["prefix_hit_tokens"] == repeated_block_tokens(reqs) > 0
    assert m["cow_copies"] > 0 and kv.free_pages() == kv.total_pages
    plain, _, _ = serve(model, rows, length_scale=0.15, max_context=256, prefix=False)
    assert [r.output for r in reqs] == [r.output for r in plain]


@pytest.mark.parametrize("page_size", [16, 64])
def test_static_paged_and_pager_merge_give_identical_tokens(model, page_size):
    outs = {}
    for config in ("static", "paged", "pager+merge", "pager"):
        reqs, _, _ = serve(model, burst(), config, prefix=False, page_size=page_size)
        outs[config] = [r.output for r in reqs]
    assert outs["paged"] == outs["static"] == outs["pager+merge"] == outs["pager"]


def test_staged_prefix_copies_give_the_tokens_of_moving_every_block(model):
    # W 32 under shared prefixes and chunked prefill: pager+merge writes through and stages an
    # aliased prefix's window blocks until each session's first decode, dropping those its
    # later chunks push out; pager moves every block each step; the arenas they decode from,
    # and so the tokens, are the same
    # prompts of 68-94 tokens (lengths / 8) that alias one 64-token hash block, some in two
    # chunks of at most 32 (the tests' scheduler)
    rows = [TraceRow(0.02 * i, 544 + 40 * i, 120, (1, 2 + i)) for i in range(6)]
    outs, stats = {}, {}
    for config in ("pager", "pager+merge"):
        reqs, kv, m = serve(model, rows, config, window=32, max_context=256, clock="model")
        outs[config] = [r.output for r in reqs]
        stats[config] = m
    assert outs["pager"] == outs["pager+merge"]
    assert stats["pager+merge"]["prefix_hit_tokens"] > 0


def test_kvrm_gives_far_pages_back_once_summarized(model):
    # W 32 and far chunks of 32 tokens: long decodes leave the window; their summarized
    # chunks' pages return, so kvrm maps fewer pages than pager+merge at the same tokens in view
    rows = [TraceRow(0.001 * i, 600 + 50 * i, 400, (1, 2 + i % 2) if i % 3 else ())
            for i in range(6)]
    kw = dict(window=32, max_context=192)
    (_, kv_m, m), (reqs, kv_k, k) = (serve(model, rows, c, **kw) for c in ("pager+merge", "kvrm"))
    assert k["finished"] == m["finished"] == 6 and all(len(r.output) == 50 for r in reqs)
    assert k["reserved_gib_mean"] < m["reserved_gib_mean"]
    assert kv_k.free_pages() == kv_k.total_pages and kv_m.free_pages() == kv_m.total_pages


def test_kvrm_ret_choosing_every_far_page_every_step_gives_the_tokens_of_paged(model):
    # W 32: decodes of 50 tokens leave the window; with top-K at least a session's far pages
    # and a choice every step the far slots hold every far page exact, so the window and the
    # far slots are the whole context: paged's tokens (under shared prefixes, whose far pages
    # are aliased)
    rows = [TraceRow(0.001 * i, 600 + 50 * i, 400, (1, 2 + i % 2) if i % 3 else ())
            for i in range(6)]
    kw = dict(window=32, max_context=192)
    reqs, kv, m, eng = serve(model, rows, "kvrm-ret", ret_top_k=12, ret_every=1, engine=True,
                             **kw)
    paged, _, _ = serve(model, rows, "paged", **kw)
    assert m["finished"] == 6 and all(len(r.output) == 50 for r in reqs)
    assert [r.output for r in reqs] == [r.output for r in paged]
    assert m["prefix_hit_tokens"] > 0 and kv.free_pages() == kv.total_pages
    far = max(-(-(len(r.prompt) + 50) // 16) - 2 for r in reqs)
    assert kv.retrieval.K == 12 >= far > 0
    assert m["far_choices"] == eng.runner.selections == sum(s.decodes > 0 for s in eng.steps) > 0


def test_kvrm_ret_chooses_at_a_sessions_first_decode_and_every_n_steps(model):
    """``_select_plan``: a step chooses when a row's session decodes in its slot for the first
    time (after the bounds of every far page are drained) or ``select_every`` steps after the
    last choice; a choice overwrites the pages of the bucket's rows that do not decode, so
    they choose again when they next decode; a session reopened after preemption (a new key)
    is new."""
    _, kv, _, eng = serve(model, burst(2), "kvrm-ret", window=32, ret_every=3, engine=True)
    runner = eng.runner
    a, b = (Request(100 + i, 0.0, [1, 2, 3], 4) for i in range(2))
    both = [(a, 3, 1), (b, 3, 1)]
    plan = [runner._select_plan(both, [0, 1], 2) for _ in range(7)]
    assert plan == [True, False, False, True, False, False, True]
    assert runner._select_plan([(a, 3, 1)], [0], 2) is False
    assert runner._select_plan([(a, 3, 1)], [0], 2) is False
    assert runner._select_plan([(a, 3, 1)], [0], 2) is True    # b's row chose with a junk query
    assert runner._select_plan(both, [0, 1], 2) is True        # so b chooses again
    assert runner._select_plan(both, [0, 1], 2) is False
    b.reset_for_recompute()                                    # preempted: a new session key
    assert runner._select_plan(both, [0, 1], 2) is True
    assert runner._select_plan(both, [0, 2], 4) is True        # b in another slot
    with pytest.raises(ValueError, match="retrieval: select_every: expected >= 1 steps, got 0"):
        serve(model, burst(1), "kvrm-ret", ret_every=0)


def test_kvrm_sessions_keep_serving_their_prefix_after_far_trims(model):
    # later arrivals find earlier sessions already trimmed: a session keeps the blocks of its
    # hash chains, so kvrm hits every prefix pager+merge hits, and still maps less
    rows = [TraceRow(0.05 * i, 900 + 40 * i, 300, (1, 2, 3 + i)) for i in range(8)]
    kw = dict(window=32, max_context=192, clock="model")
    (_, _, m), (_, kv, k) = (serve(model, rows, c, **kw) for c in ("pager+merge", "kvrm"))
    assert k["prefix_hit_tokens"] == m["prefix_hit_tokens"] > 0
    assert k["reserved_gib_mean"] < m["reserved_gib_mean"]
    assert kv.free_pages() == kv.total_pages


def serve_on_cuda(rows, config, graphs, *, window=32, max_context=192, clock="wall"):
    """``rows`` served by ``config`` on CUDA with the tests' tiny model, decode steps captured
    or eager; with graphs the copy-train and absorb graphs count their replays."""
    dev, tok = torch.device("cuda"), 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4
    cuda_model = random_llama(CFG, dtype=torch.float32, std=0.5, device=dev)
    reqs = build_requests(rows, CFG.vocab_size, length_scale=0.125)
    kv = make_kv(config, KVBudget(bytes=4096 * tok, max_seqs=8, max_context=max_context,
                                  window=window), CFG, torch.float32, dev)
    engine = Engine(cuda_model, kv, decode_kind(config),
                    SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                    long_prefill_tokens=32), graphs=graphs, clock=clock)
    if graphs:
        r = engine.runner
        r.capture_transfers()
        r._absorb_graph, r._gather_graph = (g if g is None else CountedReplays(g)
                                            for g in (r._absorb_graph, r._gather_graph))
    engine.replay(reqs)
    assert kv.free_pages() == kv.total_pages
    return [r.output for r in reqs], engine


# six sessions sharing prefixes; one session whose last prefill chunk (4 of 100 tokens) makes
# no chunk far, so its held-back trim is due in a commit that summarizes nothing
TRIM_ROWS = {"six": [TraceRow(0.001 * i, 600 + 50 * i, 400, (1, 2 + i % 2) if i % 3 else ())
                     for i in range(6)],
             "held": [TraceRow(0.0, 800, 400, ())]}


@pytest.mark.parametrize("rows", TRIM_ROWS.values(), ids=TRIM_ROWS.keys())
def test_kvrm_far_trims_looked_at_only_when_the_summarized_lead_moved(model, monkeypatch, rows):
    """kvrm looks for summarized far blocks to give back only after a commit that moved the far
    view's summarized lead, or while a candidate is held back (in prefill, or aliased from):
    the pages mapped at every step and the tokens equal those of a look at every commit, and
    most commits skip the look."""
    kw = dict(window=32, max_context=192, engine=True)
    looks = []
    real = PagedKV._trim_far

    def every_commit(self, keep):
        self._trim_waiting = True                   # as if a candidate were always held back
        real(self, keep)

    monkeypatch.setattr(PagedKV, "_trim_far", every_commit)
    reqs_all, _, _, eng_all = serve(model, rows, "kvrm", **kw)
    monkeypatch.undo()
    far_real = FarView.leading_summarized_all
    monkeypatch.setattr(FarView, "leading_summarized_all",
                        lambda self: looks.append(1) or far_real(self))
    reqs, kv, _, eng = serve(model, rows, "kvrm", **kw)
    assert [s.reserved_bytes for s in eng.steps] == [s.reserved_bytes for s in eng_all.steps]
    assert [r.output for r in reqs] == [r.output for r in reqs_all]
    assert kv.free_pages() == kv.total_pages
    assert 0 < len(looks) < len(eng.steps) / 2


def test_dma_groups_count_each_moving_session_once(model):
    """A step's moving sessions are the sessions with a near-window train or a far-view
    summary (the paper's two trains are both a session's): a step whose only copies are far
    summaries has as many moving sessions as summaries (one leave row a session), and no
    session counts more than once however many trains it has."""
    # prompts of 68-94 tokens aliasing one 64-token hash block (near trains at each session's
    # first decode) and 50-token outputs past a 32-token window (far summaries)
    rows = [TraceRow(0.02 * i, 544 + 40 * i, 400, (1, 2 + i)) for i in range(6)]
    kw = dict(window=32, max_context=192, engine=True, clock="model")
    _, kv, m, eng = serve(model, rows, "kvrm", **kw)
    far_only = [s for s in eng.steps if s.far_groups and not s.groups]
    assert far_only and any(s.groups for s in eng.steps)
    assert all(s.moving_sessions == s.far_groups for s in far_only)
    for s in eng.steps:
        assert (s.moving_sessions > 0) == bool(s.groups or s.far_groups)
        assert max(s.far_groups, 1 if s.groups else 0) <= s.moving_sessions
        assert s.moving_sessions <= s.groups + s.far_groups
    moving = [s for s in eng.steps if s.moving_sessions]
    want = (sum(s.groups + s.far_groups for s in moving)
            / sum(s.moving_sessions for s in moving))
    assert m["dma_groups_per_moving_session"] == pytest.approx(want)


def test_dma_counts_a_session_with_near_trains_and_a_far_summary_once():
    """``PagedKV.dma`` on a commit of known tables: slot 0 moves two near trains and has a far
    summary, slot 1 one near train, slot 2 only a far summary: 3 near groups, 2 far groups,
    3 moving sessions."""
    from types import SimpleNamespace

    tok = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4
    kv = make_kv("kvrm", KVBudget(bytes=4096 * tok, max_seqs=4, max_context=192, window=32),
                 CFG, torch.float32, torch.device("cpu"))
    nw = kv.window // kv.S                                  # arena pages a slot
    tables = kv.pager.host_tables
    tables["trains"][:3] = [[7, 0, 1], [9, 1, 1], [11, nw, 2]]   # (source, arena page, pages)
    ids = tables["far_leave_ids"]
    ids[:] = kv.far.J
    ids[0 * kv.far.max_leave] = 3
    ids[2 * kv.far.max_leave] = 5
    kv.last_commit = SimpleNamespace(stats={"transport": {"groups": 3, "bytes": 4096},
                                            "far_view": {"summaries": 2}})
    assert kv.dma() == {"groups": 3, "sessions": 3, "bytes": 4096, "far_groups": 2}


@requires_cuda
def test_kvrm_on_cuda_replays_captured_steps_and_absorbs_as_eager_does():
    """On CUDA the decode buckets, the copy trains and the far view's absorb run as captured
    graphs: the tokens equal the eager engine's, the absorb graph replays in the steps where
    chunks leave the window, the gather graph in the steps whose commit moved blocks (none
    here: every prefix block is out of the window), and nothing is captured after the first
    use."""
    rows = [TraceRow(0.001 * i, 600 + 50 * i, 400, (1, 2 + i % 2) if i % 3 else ())
            for i in range(6)]
    (eager, _), (outs, engine) = (serve_on_cuda(rows, "kvrm", g) for g in (False, True))
    assert outs == eager and all(len(o) == 50 for o in outs)
    runner = engine.runner
    assert runner._absorb_graph.replays and runner.captures == 2 + len(runner._graphs)
    assert runner._gather_graph.replays == sum(s.groups > 0 for s in engine.steps)


@requires_cuda
def test_kvrm_ret_on_cuda_replays_a_choosing_and_a_reusing_graph_as_eager_does():
    """kvrm-ret captures two decode graphs a bucket, one that chooses the far pages and one
    that reuses them; the tokens and the choosing steps equal the eager engine's."""
    rows = [TraceRow(0.001 * i, 600 + 50 * i, 400, (1, 2 + i % 2) if i % 3 else ())
            for i in range(6)]
    (eager, plain), (outs, engine) = (serve_on_cuda(rows, "kvrm-ret", g) for g in (False, True))
    assert outs == eager and all(len(o) == 50 for o in outs)
    assert engine.runner.selections == plain.runner.selections > 0
    assert {selecting for _, selecting in engine.runner._graphs} == {False, True}


@requires_cuda
@pytest.mark.parametrize("config", ["pager+merge", "kvrm"])
def test_copy_train_graph_replays_where_blocks_move_and_decodes_as_eager_does(config):
    """The staged-prefix workload on CUDA: aliased window blocks move at the first decodes,
    through the captured gather graph in exactly those steps, and the tokens equal the eager
    engine's (which launches each layer's gather)."""
    rows = [TraceRow(0.02 * i, 544 + 40 * i, 120, (1, 2 + i)) for i in range(6)]
    kw = dict(window=32, max_context=256, clock="model")
    (eager, _), (outs, engine) = (serve_on_cuda(rows, config, g, **kw) for g in (False, True))
    assert outs == eager
    moved = sum(s.groups > 0 for s in engine.steps)
    assert engine.runner._gather_graph.replays == moved > 0


class CountedReplays:
    """A captured graph that counts its replays."""

    def __init__(self, graph):
        self.graph, self.replays = graph, 0

    def replay(self):
        self.replays += 1
        self.graph.replay()


@pytest.mark.parametrize("config", ["pager+merge", "kvrm"])
def test_copy_trains_run_only_in_steps_whose_commit_moved_blocks(model, config, monkeypatch):
    """The runner launches the transport's gathers in exactly the steps whose commit queued
    copy trains (a layer's launch each), and skipping the others changes no token: the tokens
    equal those of a runner that gathers every step."""
    # the staged-prefix workload above: aliased window blocks move at the first decodes
    rows = [TraceRow(0.02 * i, 544 + 40 * i, 120, (1, 2 + i)) for i in range(6)]
    kw = dict(window=32, max_context=256, clock="model")
    calls = []
    real = torch.ops.kvops.paged_gather_merged
    monkeypatch.setattr(torch.ops.kvops, "paged_gather_merged",
                        lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(PagedKV, "trains_due", lambda self: True)
    reqs_all, _, _, eng_all = serve(model, rows, config, engine=True, **kw)
    assert len(calls) == CFG.n_layers * len(eng_all.steps)
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(torch.ops.kvops, "paged_gather_merged",
                        lambda *a: calls.append(1) or real(*a))
    reqs, _, _, eng = serve(model, rows, config, engine=True, **kw)
    moved = sum(s.groups > 0 for s in eng.steps)
    assert 0 < moved < len(eng.steps) and len(calls) == CFG.n_layers * moved
    assert [r.output for r in reqs] == [r.output for r in reqs_all]


def test_kvrm_pulls_far_utilities_every_rerank_steps(model, monkeypatch):
    """The host ranks the far summaries again only every ``far_rerank`` steps (a pull syncs the
    device); a bad interval is refused."""
    from kvops.runtime import FarView

    pulls = []
    real = FarView.pull_scores
    monkeypatch.setattr(FarView, "pull_scores", lambda self, values=None: (
        pulls.append(1), real(self, values)))
    tok = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4
    for every in (1, 3):
        pulls.clear()
        kv = make_kv("kvrm", KVBudget(bytes=4096 * tok, max_seqs=4, max_context=192, window=32,
                                      far_rerank=every), CFG, torch.float32, torch.device("cpu"))
        engine = Engine(model, kv, "arena", SchedulerConfig(64, 4, 32))
        engine.replay(build_requests([TraceRow(0.0, 400, 160, ())], CFG.vocab_size,
                                     length_scale=0.125))
        steps = engine.runner.steps
        assert steps > 6 and len(pulls) == steps // every
    with pytest.raises(ValueError, match="rerank_every"):
        make_kv("kvrm", KVBudget(bytes=4096 * tok, max_seqs=4, max_context=192, window=32,
                                 far_rerank=0), CFG, torch.float32, torch.device("cpu"))


def test_a_prefix_aliased_in_a_step_is_not_evicted_for_a_later_admission():
    """Admissions alias cached prefixes while later ones in the same step need pages: the
    eviction skips the prefixes the step aliases (the commit trims before it aliases), and
    every request finishes with no page lost."""
    cfg = LlamaConfig(vocab_size=255, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      hidden_dim=96, max_seq_len=1024)
    rows = [TraceRow(0.0, 600 + 50 * i, 40 + 8 * i, (1, 2 + i % 2) if i % 3 else ())
            for i in range(8)]
    reqs = build_requests(rows, cfg.vocab_size, length_scale=0.125)
    tok = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    kv = make_kv("pager+merge", KVBudget(bytes=(8 * 64 + 160) * tok, max_seqs=8,
                                         max_context=192, window=64),
                 cfg, torch.float32, torch.device("cpu"))
    engine = Engine(random_llama(cfg, dtype=torch.float32, std=0.5, seed=3), kv, "arena",
                    SchedulerConfig(64, 8, 32))
    metrics = engine.replay(reqs)
    assert metrics["finished"] == 8 and metrics["prefix_hit_tokens"] > 0
    assert kv.free_pages() == kv.total_pages


def test_cached_prefixes_give_their_slots_to_one_steps_admissions(model):
    """Four finished requests leave four cached prefixes in all four session slots; three new
    requests arriving together take slots from the least recently used ones and are admitted
    in one step (a slot a frame frees is reusable in that frame), not one a step; the first
    of them aliases the least recently used prefix, which the evictions pass over."""
    rows = ([TraceRow(0.0, 800, 24, (10 + i,)) for i in range(4)]
            + [TraceRow(100.0, 800, 24, (10, 30))]
            + [TraceRow(100.0, 800, 24, (20 + i,)) for i in range(2)])
    sched = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, long_prefill_tokens=256)
    reqs, kv, m, eng = serve(model, rows, max_seqs=4, sched=sched, clock="model", engine=True)
    assert m["finished"] == 7 and kv.free_pages() == kv.total_pages
    later = reqs[4:]
    assert len({r.token_steps[0] for r in later}) == 1
    assert all(r.token_steps[0] - r.arrival_step == 1 for r in later)
    assert later[0].prefix_hit == later[0].hash_block > 0


def test_one_slot_held_by_the_prefix_an_admission_would_alias_gives_way(model):
    """One session slot, held by the cached prefix the next request shares: the prefix is
    ended (the request runs without its hit) rather than held forever with nothing running."""
    rows = [TraceRow(0.0, 800, 24, (10,)), TraceRow(100.0, 800, 24, (10, 30))]
    reqs = build_requests(rows, CFG.vocab_size, length_scale=0.125)
    tok = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4
    kv = make_kv("paged", KVBudget(bytes=4096 * tok, max_seqs=1, max_context=192), CFG,
                 torch.float32, torch.device("cpu"))
    eng = Engine(model, kv, "paged", SchedulerConfig(512, 1, 256), clock="model")
    step = eng.step

    def bounded():
        assert len(eng.steps) < 200, "the replay does not end"
        return step()

    eng.step = bounded
    m = eng.replay(reqs)
    assert m["finished"] == 2 and reqs[1].prefix_hit == 0
    assert kv.free_pages() == kv.total_pages


def test_a_request_that_can_never_fit_is_refused_and_the_rest_finish(model):
    rows = burst(4) + [TraceRow(0.002, 8000, 80)]           # 1000 + 10 tokens > context 192
    reqs, kv, m = serve(model, rows)
    big = reqs[-1]
    assert big.status is Status.REFUSED and m["refused"] == 1 and m["finished"] == 4
    assert "needs 1009 tokens of context" in big.error and "at most 12 blocks" in big.error
    assert big.output == []
    _, _, ms = serve(model, rows, "static")
    assert ms["refused"] == 1 and ms["finished"] == 4


def test_preemption_by_recompute_under_a_small_budget_keeps_tokens_exact(model):
    free, _, _ = serve(model, burst(), prefix=False)
    sched = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, long_prefill_tokens=32)
    tight, kv, m = serve(model, burst(), budget_tokens=160, prefix=False, sched=sched)
    assert m["preemptions"] > 0 and m["finished"] == 8
    assert [r.output for r in tight] == [r.output for r in free]
    assert kv.free_pages() == kv.total_pages
    sched.preemption = "longest"
    tight2, _, m2 = serve(model, burst(), budget_tokens=160, prefix=False, sched=sched)
    assert m2["preemptions"] > 0 and [r.output for r in tight2] == [r.output for r in free]


def test_metrics_follow_vllm_definitions(model):
    reqs, _, m = serve(model, burst())
    r = reqs[0]
    assert m["ttft_ms"]["n"] == 8 and m["itl_ms"]["n"] == sum(x.output_len - 1 for x in reqs)
    ttft = sorted((x.token_times[0] - x.arrival) * 1e3 for x in reqs)
    assert m["ttft_ms"]["median"] == pytest.approx((ttft[3] + ttft[4]) / 2)
    tpot = (r.token_times[-1] - r.token_times[0]) / (len(r.output) - 1)
    assert min(x * 1e3 for x in [tpot]) >= 0
    assert m["output_tokens"] == sum(x.output_len for x in reqs)
    assert m["output_tok_s"] == pytest.approx(m["output_tokens"] / m["duration_s"])


def test_single_token_outputs_are_left_out_of_tpot(model):
    rows = [TraceRow(0.0, 400, 8), TraceRow(0.0, 400, 1)]
    reqs, _, m = serve(model, rows)
    assert [len(r.output) for r in reqs] == [1, 1] or m["tpot_ms"]["n"] == 1


def test_eos_stops_a_request_unless_ignored(model):
    reqs = [Request(0, 0.0, list(range(20)), 16)]
    tok = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4
    kv = make_kv("paged", KVBudget(bytes=1024 * tok, max_seqs=2, max_context=64), CFG,
                 torch.float32, torch.device("cpu"))
    Engine(model, kv, "paged").replay(reqs)
    first = reqs[0].output
    eos = first[3]
    again = [Request(0, 0.0, list(range(20)), 16, ignore_eos=False, eos_id=eos)]
    kv = make_kv("paged", KVBudget(bytes=1024 * tok, max_seqs=2, max_context=64), CFG,
                 torch.float32, torch.device("cpu"))
    Engine(model, kv, "paged").replay(again)
    assert again[0].output == first[:first.index(eos) + 1]


def test_bucket_table():
    got = [bucket_of(n, 128) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65, 80, 81, 128)]
    assert got == [1, 2, 4, 4, 8, 8, 16, 16, 24, 64, 80, 80, 96, 128]
    assert bucket_of(7, 6) == 6


def test_trace_scaling_and_hash_prefixes():
    rows = [TraceRow(1.0, 1100, 10, (5, 6, 7)), TraceRow(2.0, 700, 3, (5, 8))]
    a, b = build_requests(rows, 1000, time_scale=2.0, length_scale=0.5)
    assert (a.arrival, len(a.prompt), a.output_len, a.hash_block) == (2.0, 550, 5, 256)
    assert a.prompt[:256] == b.prompt[:256] and a.prompt[256:350] != b.prompt[256:350]
    assert repeated_block_tokens([a, b]) == 256


def test_azure_timestamps_and_densest_window():
    assert parse_azure_time("2023-11-16 18:17:03.9799600") % 60 == pytest.approx(3.97996)
    assert densest_window(torch.tensor([0.0, 0.5, 10.0, 10.1, 10.2, 30.0]).numpy(), 1.0) == (2, 5)


@pytest.mark.skipif(not (DATA / "AzureLLMInferenceTrace_code.csv").is_file(),
                    reason="../shared/data/traces not present")
def test_real_traces_load():
    code = load_rows(DATA / "AzureLLMInferenceTrace_code.csv")
    assert len(code) == 723 and code[0].arrival == 0.0 and code[-1].arrival < 60.0
    moon = load_rows(DATA / "mooncake_conversation_trace.jsonl")
    assert len(moon) == 12031 and moon[0].hash_ids[:2] == (0, 1)
    share = load_rows(DATA / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv", num_requests=50,
                      rate=2.0, arrival="gamma", cv=2.0)
    assert len(share) == 50 and share[0].arrival == 0.0


def test_replay_cli_writes_table_json_and_figures(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from kvops.cli import main

    rc = main(["replay", "--model", "tiny", "--configs", "static,paged,kvrm", "--max-requests", "6",
               "--length-scale", "0.0625", "--budget-gib", "0.002", "--max-context", "256",
               "--window", "64", "--far-chunk", "32", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| static |" in out and "| kvrm |" in out
    res = json.loads((tmp_path / "replay.json").read_text())
    assert set(res["results"]) == {"static", "paged", "kvrm"}
    assert all(r["finished"] == 6 for r in res["results"].values())
    assert (tmp_path / "timeline.png").stat().st_size > 0 and (tmp_path / "cdf.png").is_file()


def test_replay_cli_takes_a_page_size_and_refuses_a_bad_one(tmp_path, capsys):
    from kvops.cli import main

    args = ["replay", "--model", "tiny", "--configs", "paged,kvrm", "--max-requests", "4",
            "--length-scale", "0.0625", "--budget-gib", "0.002", "--max-context", "256",
            "--window", "64", "--far-chunk", "64", "--out", str(tmp_path), "--no-progress",
            "--no-figures"]
    assert main(args + ["--page-size", "64"]) == 0
    res = json.loads((tmp_path / "replay.json").read_text())
    assert all(r["finished"] == 4 for r in res["results"].values())
    with pytest.raises(SystemExit, match=r"--page-size: page size S must be a power of two in "
                                         r"\[8, 256\], got S=12"):
        main(args + ["--page-size", "12"])


def test_replay_refuses_a_context_past_the_models_positions():
    """Prompts are clipped to max_context: a clip past the model's positions is refused, not
    silently taken at the positions."""
    from kvops.engine.replay import ReplaySettings, run

    s = ReplaySettings(model="tiny", max_context=16385, device="cpu", max_requests=2)
    with pytest.raises(ValueError, match=r"max_context: expected at most the tiny model's "
                                         r"16384 positions, got 16385"):
        run(s, progress=False)


def test_record_names_its_file_by_date_and_time_of_day(tmp_path, monkeypatch):
    import re

    from kvops.cli import record

    monkeypatch.chdir(tmp_path)
    path = record("probe", {"device_name": "cpu", "dtype": "float32"}, "| a |\n|---|\n| 1 |")
    name = path.rsplit("/", 1)[-1]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-\d{4}-probe\.md", name), name
    text = (tmp_path / path).read_text()
    assert "- commit: " in text and "- command: `python -m kvops" in text and "| 1 |" in text
    monkeypatch.setenv("KVOPS_COMMIT", "abc1234 (the tree sent to the device)")
    path = record("probe2", {"device_name": "cpu", "dtype": "float32"}, "| a |")
    assert "- commit: abc1234 (the tree sent to the device)\n" in (tmp_path / path).read_text()


def test_kvrm_with_shared_prefixes_and_far_trims(model):
    # hash prefixes aliased from sessions whose far blocks go back in the same steps; on the
    # modeled clock, so which requests overlap does not depend on this machine's speed
    rows = [TraceRow(0.05 * i, 900 + 40 * i, 300, (1, 2, 3 + i)) for i in range(8)]
    reqs, kv, m = serve(model, rows, "kvrm", window=32, max_context=192, clock="model")
    assert m["finished"] == 8 and all(len(r.output) == r.output_len for r in reqs)
    assert m["prefix_hit_tokens"] > 0 and kv.free_pages() == kv.total_pages


def test_kvrm_trims_every_decoding_requests_summarized_far_blocks(model, monkeypatch):
    # after each commit, a decoding request (not an alias source of that step) has given back
    # exactly the blocks of its leading summarized chunks as they stood before the commit,
    # but for those of its registered hash chains (the prefix it serves), which stay mapped,
    # and a request still in prefill none of them: the per-slot candidates agree with
    # checking every request
    from kvops.engine.kv import PagedKV
    from kvops.engine.request import Status

    checked = []
    commit = PagedKV.commit_step

    def checking(self, admits, grows):
        keep = {src for _, src, hit, _ in admits if hit}
        want = {}
        for key in self.pager.sessions():
            req = self._slot_req.get(self.pager.slot(key))
            if req is None or req.key != key or req.status is not Status.RUNNING:
                continue
            lead = self.far.leading_summarized(self.pager.slot(key)) * self.far.M
            had = self._far_trimmed.get(key, 0)
            decoding = req.num_computed >= len(req.prompt) and key not in keep
            pb = self._prefix_blocks(req)
            want[key] = (pb, max(lead, had) if decoding and lead > pb else had)
        out = commit(self, admits, grows)
        for key, (pb, n) in want.items():
            if key in self.pager.sessions():
                pages = self.pager.pages(key)
                assert self._far_trimmed.get(key, 0) == n, key
                assert all(p < 0 for p in pages[pb:n]), key
                assert all(p >= 0 for p in pages[:pb]), key
                checked.append((pb, n))
        return out

    monkeypatch.setattr(PagedKV, "commit_step", checking)
    rows = [TraceRow(0.05 * i, 900 + 40 * i, 300, (1, 2, 3 + i)) for i in range(8)]
    reqs, kv, m = serve(model, rows, "kvrm", window=32, max_context=192, clock="model")
    assert m["finished"] == 8 and kv.free_pages() == kv.total_pages
    assert max(n - pb for pb, n in checked) > 0   # far blocks did go back
    assert max(pb for pb, n in checked if n) > 0  # and prefixes stayed while others did


def test_bare_kvops_runs_the_replay_then_one_pressure_comparison(monkeypatch, tmp_path):
    from kvops import cli

    seen = []
    monkeypatch.setattr(cli, "replay", lambda args: seen.append(args) or 0)
    assert cli.main([]) == 0
    first, second = seen
    assert first.mode == "replay" and first.configs is None         # the replay's defaults
    assert second.mode == "elastic" and second.clock == "model" and second.device == "cpu"
    assert second.configs == "elastic,paged,offload" and second.out == "replay-out/pressure"
    seen.clear()
    monkeypatch.setattr(cli, "replay", lambda args: seen.append(args) or 3)
    assert cli.main([]) == 3 and len(seen) == 1                     # a failed replay stops it


def test_model_clock_stamps_agree_with_the_driving_clock_across_idle_jumps(model):
    """On the modeled clock the engine jumps over idle time to the next arrival; the modeled
    stamps (``arrival_model``, ``token_model``) include the jumps, so they equal the driving
    clock's and the modeled TTFT of a request after a gap is its real wait, not negative."""
    rows = [TraceRow(100.0 * i, 600, 8) for i in range(3)]
    reqs, _, m = serve(model, rows, clock="model")
    assert m["finished"] == 3
    for r in reqs:
        assert r.arrival_model == r.arrival
        assert r.token_model == r.token_times
    assert reqs[2].token_model[0] - reqs[2].arrival_model > 0
