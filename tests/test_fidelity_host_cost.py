"""The host cost of the fidelity policy's transitions at the Llama-3-8B page geometry (32
layers, K and V of each one allocation): a demotion batch is one ``pack_base_pairs`` launch
and a promotion batch one ``refine_base_pairs`` launch over every pair and cache, with a
number of other ops that does not grow with the pairs (but for one host copy a run of backing
slots, 64 a chunk), none of them reading a device value back to the host, and no host memory
allocated (pinned, on CUDA: tens of milliseconds a chunk) inside a step when the pool keeps
chunks ahead. On CUDA, neither step waits for work queued on the current or the side stream.
"""

from __future__ import annotations

import pytest
import torch

from bench.bench_fidelity_host import OpCounter, world

LAYERS, D, HKV = 32, 16, 2


def _steps(pairs: int, device="cpu", layers=LAYERS, **kw):
    pager, fid = world(layers, 16, 256, pairs, D, device, hkv=HKV, **kw)
    fid._host.wait()
    with OpCounter() as dem:
        with pager.frame() as f:
            got = fid.step(f, need=pager.free_pages + pairs)
    assert got["demoted"] == pairs
    runs = len(fid._host.runs(sorted(p.slot for p in fid._pairs.values())))
    with OpCounter() as pro:
        with pager.frame() as f:
            got = fid.step(f, need=0)
    assert got["promoted"] == pairs
    return fid, dem, pro, runs


@pytest.mark.parametrize("pairs", [16, 100])
def test_batch_ops_do_not_grow_with_pairs(pairs):
    fid, dem, pro, runs = _steps(pairs)
    for c in (dem, pro):
        assert c.kvops == 1, dict(c.ops)         # one launch over every pair and cache
        assert c.syncs == 0, dict(c.ops)         # nothing read back to the host
    # the rest: the rows' upload, the device backing, the commit's table copy, and two
    # slices and a copy a run of consecutive host slots (one a chunk of 64 here)
    assert runs <= -(-pairs // 64) + 1
    assert dem.total <= 8 + 3 * runs, dict(dem.ops)
    assert pro.total <= 8 + 3 * runs, dict(pro.ops)


FRAME_CALLS = ("page", "refcount", "remap", "retain", "release", "block_pages", "pages_at",
               "refcounts", "remap_many", "retain_many", "release_many", "hold", "edit",
               "write", "scatter")


def test_batch_frame_calls_do_not_grow_with_pairs(monkeypatch):
    """The policy's calls into the frame in a demotion, a promotion and its settle are the
    same at 16 and 100 pairs over the same sessions: the per-pair work goes through the
    many-block calls (one each a batch), never the per-block verbs."""
    from collections import Counter

    from kvops.runtime.frame import Frame

    calls: Counter = Counter()
    for name in FRAME_CALLS:
        real = getattr(Frame, name)

        def spy(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(Frame, name, spy)
    seen = []
    for pairs in (16, 100):
        pager, fid = world(1, 16, 256, pairs, D, "cpu", hkv=HKV)
        got = []
        for need in (pager.free_pages + pairs, 0, None):
            calls.clear()
            if need is None:
                fid.drain()
                need = pager.free_pages
            with pager.frame() as f:
                fid.step(f, need=need)
            got.append(dict(calls))
        assert fid.stats["demoted"] == fid.stats["promoted"] == pairs
        seen.append(got)
    assert seen[0] == seen[1], seen
    for step in seen[1]:
        assert not {"remap", "retain", "release"} & step.keys(), step
        assert step.get("remap_many", 0) <= 1 and step.get("pages_at", 0) <= 2, step


def test_batch_ops_do_not_grow_with_layers():
    one = _steps(100, layers=1)
    many = _steps(100)
    assert one[3] == many[3]                         # the same host-slot runs
    assert dict(one[1].ops) == dict(many[1].ops) and dict(one[2].ops) == dict(many[2].ops)


def test_demotion_allocates_no_host_chunk_in_the_step():
    """With ``host_ahead`` slots kept ahead (a worker thread allocates them), a batch of up to
    that many pairs takes ready chunks: the step itself allocates no host memory."""
    fid, dem, _, _ = _steps(100, host_ahead=128)
    assert fid._host.inline == 0
    chunk = (fid._host.chunk, *fid._host.slot_shape)
    assert len(fid._host.chunks) >= 2
    assert dem.ops["aten::empty.memory_format"] == 1, dict(dem.ops)   # the device backing only
    fid._host.wait()                                 # the pool refills behind the batch
    assert len(fid._host._ready) == 2 and all(
        tuple(f.result().shape) == chunk for f in fid._host._ready)


def test_host_pool_stock_is_used_before_anything_more_is_pinned():
    """``host_ahead`` beyond the refill (four chunks): the stock pinned from the start is
    used first, and nothing more is allocated while it lasts."""
    fid, _, _, _ = _steps(100, host_ahead=640, host_pairs=1024)
    fid._host.wait()
    assert fid._host.inline == 0
    assert len(fid._host.chunks) + len(fid._host._ready) == 10


def test_host_pool_without_ahead_allocates_when_taken():
    fid, _, _, _ = _steps(16, host_ahead=0)
    assert fid._host.inline == 1 and not fid._host._ready


def test_host_ahead_is_checked():
    with pytest.raises(ValueError, match="host_ahead"):
        world(1, 2, 64, 2, D, "cpu", hkv=HKV, host_ahead=-1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_steps_do_not_wait_for_queued_work():
    """A demotion step returns while the current stream still runs earlier work, and a
    promotion step while the side stream does (a pageable copy of the pair rows would wait)."""
    pager, fid = world(LAYERS, 16, 256, 16, D, "cuda", hkv=HKV)
    fid._host.wait()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)                 # about a second on the current stream
    busy = torch.cuda.Event()
    busy.record()
    with pager.frame() as f:
        assert fid.step(f, need=pager.free_pages + 16)["demoted"] == 16
    assert not busy.query()
    torch.cuda.synchronize()
    with torch.cuda.stream(fid._side):
        torch.cuda._sleep(2_000_000_000)
        busy = torch.cuda.Event()
        busy.record(fid._side)
    with pager.frame() as f:
        assert fid.step(f, need=0)["promoted"] == 16
    assert not busy.query()
    torch.cuda.synchronize()


def test_warm_compiles_what_the_transitions_launch(kernel_device, monkeypatch):
    """The constructor's warm-up (on CUDA) launches the pack and refine kernels with the launch
    keys a demotion, a promotion and an aborted demotion's undo use, so none of them compiles
    inside a step. Checked through the launch keys under the Triton backend."""
    import kvops
    import kvops.kernels.base_pairs as bp
    from kvops.kernels._launch import Launch

    keys = []
    real = Launch.__call__

    def spy(self, *args):
        keys.append((self.kernel, self.key))
        return real(self, *args)

    monkeypatch.setattr(Launch, "__call__", spy)
    with kvops.backend("triton"):
        pager, fid = world(1, 2, 64, 2, D, str(kernel_device), hkv=HKV)
        before = [c.clone() for c in fid.caches]
        fid._warm()
        warm = set(keys)
        assert len(warm) >= 2
        assert all(torch.equal(a, b) for a, b in zip(before, fid.caches))   # scratch only
        keys.clear()
        with pager.frame() as f:
            assert fid.step(f, need=pager.free_pages + 2)["demoted"] == 2
        with pager.frame() as f:
            assert fid.step(f, need=0)["promoted"] == 2
        fid.drain()                     # on CUDA the promotion runs on the side stream
        with pager.frame() as f:
            fid.step(f)                 # settles it: the pairs are TARGET and demotable again
        with pytest.raises(RuntimeError, match="boom"):
            with pager.frame() as f:
                assert fid.step(f, need=pager.num_pages)["demoted"] == 2
                raise RuntimeError("boom")
    kernels = [k for k, _ in keys]
    assert kernels.count(bp._pack_pairs_kernel) == 2          # both demotions
    assert kernels.count(bp._refine_pairs_kernel) == 2        # the promotion and the undo
    assert set(keys) <= warm


def _sorted_picks(fid, frame, pend, want):
    """Promotion order by its definition: every BASE pair not in flight, by BASE share after
    it (largest first), ties in session order then top pair first (a stable sort)."""
    S, picks = fid.pager.page_size, []
    for key in list({**fid._span, **pend.spans}):
        first, end = fid._span_now(key, pend)
        if not frame.has(key) or end <= first:
            continue
        top = end - 2 * len(fid._flight_now(key, pend))
        nb = -(-frame.length(key) // S)
        picks += [(-(j + 2 - first) / nb, key, j) for j in range(top - 2, first - 1, -2)]
    picks.sort(key=lambda t: t[0])
    return [(key, j) for _, key, j in picks[:want]]


@pytest.mark.parametrize("seed", range(3))
def test_promotion_merge_picks_as_the_sorted_order(seed):
    """The promotion planner's heap merge over sessions picks exactly the pairs, in the order,
    that sorting every BASE pair by share gives (ties included: equal-length sessions)."""
    import random

    from kvops.runtime import Pager
    from kvops.runtime.fidelity import Fidelity

    rng = random.Random(seed)
    B, S, L = 10, 16, 40
    pager = Pager(B * L, S, B, L)
    caches = list(torch.zeros(2, B * L, S, 1, 16, dtype=torch.float16).unbind(0))
    fid = Fidelity(pager, caches, min_batch=1, protect_recent=2, reserve_decay=0.0,
                   max_promote=1 << 20)
    with pager.frame() as f:
        for b in range(B):
            f.reserve(b, S * rng.choice([8, 16, 16, 24, 33]))
    for _ in range(4):
        with pager.frame() as f:
            fid.step(f, need=f.free_pages + rng.randint(1, 30))
    assert len(fid._pairs) > 20
    for want in (1, 3, 7, 1 << 20):
        with pytest.raises(RuntimeError, match="undo"):
            with pager.frame() as f:
                pend = fid._now(f)
                expect = _sorted_picks(fid, f, pend, want)
                fid._promote(f, pend, want)
                assert fid._picked == expect
                raise RuntimeError("undo")
    only = next(iter(fid._span))
    with pytest.raises(RuntimeError, match="undo"):
        with pager.frame() as f:
            fid.promote(f, only, limit=2)
            top = fid.span(only)[1]
            assert fid._picked == [(only, top - 2), (only, top - 4)][:len(fid._picked)]
            raise RuntimeError("undo")
