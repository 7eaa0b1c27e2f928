"""The engine's overlap (kvops.engine.engine): the next step is scheduled and committed while
the launched one runs, and its tokens are collected before the next launch. On the CPU the
launch computes everything, so overlap changes only the order of the host's work; these tests
check that order gives every configuration the same schedule and tokens as a synchronous
engine, that EOS steps collect at once, and that a closed loop's client waits for its last
token. On CUDA the tokens equal a synchronous engine's and part of the control plane runs
under the device's work."""

from __future__ import annotations

import pytest
import torch

from kvops.engine import CONFIGS, Engine, KVBudget, Request, SchedulerConfig, make_kv
from kvops.engine.configs import decode_kind, is_elastic
from kvops.engine.metrics import StepRecord, summarize
from kvops.engine.request import Status
from kvops.engine.traces import TraceRow, build_requests, pressure_rows
from kvops.models.config import LlamaConfig
from kvops.models.paged import random_llama
from tests.conftest import requires_cuda

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  hidden_dim=128, max_seq_len=1024)
S = 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models():
    return {dt: random_llama(CFG, dtype=dt, std=0.5) for dt in (torch.float32, torch.bfloat16)}


def tok_bytes(dtype):
    return 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * dtype.itemsize


def engine_for(model, config, dtype, *, pages, overlap, window=64, max_context=256,
               clock="model", device="cpu", graphs=None):
    kv = make_kv(config, KVBudget(bytes=pages * S * tok_bytes(dtype), max_seqs=8,
                                  max_context=max_context, window=window),
                 CFG, dtype, torch.device(device))
    return Engine(model, kv, decode_kind(config), SchedulerConfig(128, 8, 64), clock=clock,
                  overlap=overlap, graphs=graphs)


def trace(config):
    """Prefix-sharing bursts for the window configurations (their arenas move aliased
    blocks); the pressure workload, arriving at once, for the managers built for it."""
    if is_elastic(config) or config in ("offload", "reserve"):
        return pressure_rows(10, input_len=160, output_len=40), torch.bfloat16, 64
    return ([TraceRow(0.002 * i, 560 + 40 * i, 320, (1, 2 + i % 2) if i % 3 else ())
             for i in range(8)], torch.float32, 256)


def served(model, config, dtype, rows, pages, overlap):
    eng = engine_for(model, config, dtype, pages=pages, overlap=overlap)
    reqs = build_requests(rows, CFG.vocab_size, length_scale=0.125)
    m = eng.replay(reqs)
    return reqs, eng, m


@pytest.mark.parametrize("config", CONFIGS)
def test_overlap_gives_every_configuration_the_synchronous_schedule_and_tokens(models, config):
    rows, dtype, pages = trace(config)
    (sync, e0, m0), (over, e1, m1) = (served(models[dtype], config, dtype, rows, pages, o)
                                      for o in (False, True))
    assert e1.overlap and not e0.overlap
    assert m1["finished"] == m0["finished"] == len(rows)
    assert [r.output for r in over] == [r.output for r in sync]
    assert all(None not in r.output for r in over)
    for field in ("token_steps", "token_model", "preemptions", "prefix_hit", "finish_time"):
        assert [getattr(r, field) for r in over] == [getattr(r, field) for r in sync], field
    assert ([(s.tokens, s.decodes, s.kv_tokens, s.reserved_bytes, s.groups, s.demoted)
             for s in e1.steps]
            == [(s.tokens, s.decodes, s.kv_tokens, s.reserved_bytes, s.groups, s.demoted)
                for s in e0.steps])
    if e1.kv.kind == "paged":
        assert e1.kv.free_pages() == e1.kv.total_pages
    # the CPU's launch computes the step, so no control plane runs under device work
    assert m1["control_exposed_share"] == pytest.approx(m1["control_share"])


def test_a_step_whose_requests_stop_on_eos_collects_at_once(models):
    """A request that may stop on EOS ends on the token's value, so its steps collect before
    the next schedule: with an EOS that the synchronous engine's greedy tokens reach, both
    engines stop that request at it and produce the same tokens."""
    model = models[torch.float32]
    rows = [TraceRow(0.001 * i, 560 + 40 * i, 320, ()) for i in range(4)]

    def run(overlap, eos=None):
        eng = engine_for(model, "paged", torch.float32, pages=256, overlap=overlap)
        reqs = build_requests(rows, CFG.vocab_size, length_scale=0.125)
        if eos is not None:
            reqs[1].ignore_eos, reqs[1].eos_id = False, eos
        collects, real = [], eng.collect
        eng.collect = lambda: collects.append(eng._pending is not None) or real()
        eng.replay(reqs)
        return reqs, collects

    free, _ = run(False)
    eos = free[1].output[3]                     # request 1 stops after its fourth token
    (sync, _), (over, calls) = run(False, eos), run(True, eos)
    assert [r.output for r in over] == [r.output for r in sync]
    assert over[1].output == free[1].output[:free[1].output.index(eos) + 1]
    assert len(over[1].output) < over[1].output_len and over[1].status is Status.FINISHED
    assert [r.output for i, r in enumerate(over) if i != 1] == \
        [r.output for i, r in enumerate(free) if i != 1]
    assert sum(calls) > 0


def test_a_closed_loop_client_sends_after_its_last_token_is_collected(models):
    """Under overlap a request ends at its last launch, but its client has no token until the
    collect: no request arrives while ``concurrency`` others are in flight on the wall
    clock."""
    model, conc = models[torch.float32], 3
    eng = engine_for(model, "paged", torch.float32, pages=256, overlap=True, clock="wall")
    reqs = [Request(i, 0.0, list(range(1 + i, 41 + i)), 6 + 3 * (i % 4)) for i in range(12)]
    eng.replay(reqs, concurrency=conc)
    assert all(r.status is Status.FINISHED and None not in r.output for r in reqs)
    for r in reqs:
        live = sum(q.arrival <= r.arrival < q.finish_time for q in reqs)
        assert live <= conc, (r.rid, live)


def test_a_closed_loop_on_the_modeled_clock_is_the_synchronous_one(models):
    """The modeled clock has no overlap: a client sends its next request at the modeled time
    of its last token's step under either engine, so arrivals, tokens and their modeled times
    are the synchronous engine's."""
    model = models[torch.float32]
    runs = []
    for overlap in (False, True):
        eng = engine_for(model, "paged", torch.float32, pages=256, overlap=overlap)
        reqs = [Request(i, 0.0, list(range(1 + i, 41 + i)), 6 + 3 * (i % 4)) for i in range(12)]
        eng.replay(reqs, concurrency=3)
        runs.append([(r.arrival, r.output, r.token_model, r.token_steps) for r in reqs])
    assert runs[1] == runs[0]


class FakeEvent:
    """A timing event at a fixed stream time (ms), as CUDA's elapsed_time reads two."""

    def __init__(self, at_ms):
        self.at = at_ms

    def elapsed_time(self, other):
        return other.at - self.at

    def synchronize(self):
        pass


def test_settled_timings_are_each_steps_span_and_the_gap_before_it(models):
    """``settle_timings`` turns each step's (start, end) events into its stream span and the
    gap since the previous step's end (the first step has none), then forgets them."""
    eng = engine_for(models[torch.float32], "paged", torch.float32, pages=64, overlap=False)
    recs = [StepRecord(t=0, step_s=0, schedule_s=0, commit_s=0, running=0, waiting=0, tokens=1,
                       decodes=1, reserved_bytes=0, used_bytes=0, groups=0, moving_sessions=0,
                       train_bytes=0, far_groups=0) for _ in range(3)]
    spans = [(0.0, 10.0), (10.5, 20.5), (22.5, 30.0)]
    eng._timed = [(r, FakeEvent(a), FakeEvent(b)) for r, (a, b) in zip(recs, spans)]
    eng.settle_timings()
    assert [r.device_s for r in recs] == pytest.approx([0.010, 0.010, 0.0075])
    assert [r.gap_s for r in recs] == pytest.approx([0.0, 0.0005, 0.002])
    assert eng._timed == []
    m = summarize([], recs)
    assert m["device_gap_share"] == pytest.approx(0.0025 / (0.0275 + 0.0025))
    assert m["gap_ms"]["n"] == 2 and m["gap_ms"]["median"] == pytest.approx(1.25)


def test_overlap_is_checked():
    with pytest.raises(ValueError, match="overlap: expected a bool"):
        engine_for(random_llama(CFG, dtype=torch.float32), "paged", torch.float32, pages=64,
                   overlap="yes")


def spun(part):
    """``part`` with about 10 ms of GPU time queued ahead of its own work."""
    def slow(items):
        torch.cuda._sleep(20_000_000)
        return part(items)
    return slow


@requires_cuda
@pytest.mark.parametrize("config", ["kvrm", "paged"])
def test_cuda_overlap_decodes_as_the_synchronous_engine_and_hides_control(config):
    """On CUDA with captured decode steps: the same tokens as the synchronous engine, and,
    with each step's device work made longer than the host's (a spin kernel ahead of it),
    the control plane of most steps runs while the previous step is still on the GPU (the
    synchronous engine exposes all of it) and the device idles less between steps; every
    step's device time is recorded."""
    dev = torch.device("cuda")
    model = random_llama(CFG, dtype=torch.float32, std=0.5, device=dev)
    rows = [TraceRow(0.002 * i, 560 + 40 * i, 320, (1, 2 + i % 2) if i % 3 else ())
            for i in range(8)]
    outs, shares = [], []
    for overlap in (False, True):
        eng = engine_for(model, config, torch.float32, pages=256, overlap=overlap, device="cuda",
                         window=32, graphs=True)
        eng.runner.capture_transfers()
        runner = eng.runner
        for name in ("_prefill", "_decode"):   # about 10 ms of GPU time inside each part
            setattr(runner, name, spun(getattr(runner, name)))
        reqs = build_requests(rows, CFG.vocab_size, length_scale=0.125)
        m = eng.replay(reqs)
        outs.append([r.output for r in reqs])
        shares.append((m["control_exposed_share"], m["control_share"], m["gap_ms"]["median"]))
        assert eng.kv.free_pages() == eng.kv.total_pages
        # every step is timed on the device: the spin and the step's own work
        assert m["device_ms"]["n"] == len(eng.steps) and m["device_ms"]["median"] > 5
    assert outs[1] == outs[0] and all(len(o) == 40 for o in outs[1])
    assert shares[0][0] == pytest.approx(shares[0][1])
    assert shares[1][0] < 0.5 * shares[1][1]
    # the stream waits less between steps: per step, not as a share of the device time, which
    # the first engine's Triton compiles and both engines' captures inflate unevenly
    assert shares[1][2] < 0.75 * shares[0][2]
