"""Split-K scratch kept across eager calls (``kvops.kernels._workspace``): a call's partials are
never overwritten by another call before its merge reads them, on one stream, on two streams,
from two threads, inside and beside a captured graph, under ``torch.compile``'s CUDA graphs
and a private memory pool, and when the buffer grows."""

from __future__ import annotations

import threading

import pytest
import torch

import kvops  # noqa: F401  (registers the ops)
from kvops.kernels import _splitk, _workspace
from kvops.kernels._common import device_props
from kvops.kernels.static_sliding_attention import sliding_launch
from kvops.ops.static_sliding_attention import static_sliding_attention_ref
from tests.conftest import capture_graph, requires_cuda, two_launches


def test_cpu_views_are_fresh_and_shaped():
    kept = dict(_workspace._BUFS)
    a, b, _ = _workspace.split_scratch(torch.device("cpu"), ((2, 3, 4), (5,)), 3)
    assert a.shape == (2, 3, 4) and b.shape == (5,) and a.dtype == torch.float32
    assert _workspace._BUFS == kept                 # nothing kept off CUDA


def _case(B, W, seed, dev, Hkv=2, G=4, D=64):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Hkv * G, D, generator=g).to(dev, torch.float16)
    k = torch.randn(B, W, Hkv, D, generator=g).to(dev, torch.float16)
    v = torch.randn(B, W, Hkv, D, generator=g).to(dev, torch.float16)
    ws = torch.randint(0, W, (B,), generator=g, dtype=torch.int32).to(dev)
    wl = torch.randint(1, W + 1, (B,), generator=g, dtype=torch.int32).to(dev)
    return q, k, v, ws, wl


def _check(args, got):
    want = static_sliding_attention_ref(*args)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[1], want[1], atol=2e-3, rtol=2e-3)


def _split(B, W, dev, Hkv=2, D=64):
    return sliding_launch(B, Hkv, W, D, 2, 0, device_props(dev)).splits


@requires_cuda
def test_back_to_back_split_calls_keep_their_partials():
    dev = torch.device("cuda")
    assert _split(2, 4096, dev) > 1                  # the case really splits
    cases = [_case(2, 4096, s, dev) for s in range(6)]
    outs = [torch.ops.kvops.static_sliding_attention(*c) for c in cases]   # no sync between
    for c, o in zip(cases, outs):
        _check(c, o)


@requires_cuda
def test_two_streams_have_their_own_scratch(monkeypatch):
    """Stream a sleeps between its stage 1 and its merge while stream b runs a whole call: a
    shared buffer would hand a's merge b's partials. Two launches a call, as paged prefill
    makes in eager calls (the decode ops merge in one launch there, which
    tests/test_split_merge.py overlaps across streams)."""
    import kvops.kernels.static_sliding_attention as ssa

    two_launches(ssa, monkeypatch)

    dev = torch.device("cuda")
    a, b = _case(2, 4096, 1, dev), _case(2, 4096, 2, dev)
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    merge = _splitk.merge_split_outputs

    def slow_merge(*args):
        if torch.cuda.current_stream() == sa:
            torch.cuda._sleep(20_000_000)
        merge(*args)

    for c in (a, b):                                 # compiled before the timed interleaving
        torch.ops.kvops.static_sliding_attention(*c)
    monkeypatch.setattr(_splitk, "merge_split_outputs", slow_merge)
    torch.cuda.synchronize()
    outs = {"a": [], "b": []}
    for _ in range(3):
        with torch.cuda.stream(sa):
            outs["a"].append(torch.ops.kvops.static_sliding_attention(*a))
        with torch.cuda.stream(sb):
            outs["b"].append(torch.ops.kvops.static_sliding_attention(*b))
    torch.cuda.synchronize()
    for o in outs["a"]:
        _check(a, o)
    for o in outs["b"]:
        _check(b, o)


@requires_cuda
def test_threads_have_their_own_scratch():
    dev = torch.device("cuda")
    cases = [_case(2, 4096, 10 + i, dev) for i in range(2)]
    outs, errors = [[], []], []

    def work(i):
        try:
            for _ in range(20):
                outs[i].append(torch.ops.kvops.static_sliding_attention(*cases[i]))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors
    for c, got in zip(cases, outs):
        assert len(got) == 20
        for o in got:
            _check(c, o)


@requires_cuda
def test_a_captured_graph_never_shares_scratch_with_eager_calls():
    dev = torch.device("cuda")
    cap = _case(2, 4096, 20, dev)
    other = _case(2, 4096, 21, dev)
    graph, got = capture_graph(lambda: torch.ops.kvops.static_sliding_attention(*cap))
    for _ in range(3):
        eager = torch.ops.kvops.static_sliding_attention(*other)
        graph.replay()
    torch.cuda.synchronize()
    _check(cap, got)
    _check(other, eager)


def _inside_kept(t):
    return any(b[0].data_ptr() <= t.data_ptr() < b[0].data_ptr() + 4 * b[0].numel()
               for b in _workspace._BUFS.values())


@requires_cuda
def test_capture_and_private_pools_never_use_kept_scratch():
    """Views made while capturing, or inside a private memory pool, lie outside every kept
    buffer and add none (a pool may be reset or unmapped under a kept buffer)."""
    dev = torch.device("cuda")
    shapes = ((2, 8, 16, 64), (2, 8, 16))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        eager = _workspace.split_scratch(dev, shapes, 1)[:-1]   # kept for stream s
    assert _inside_kept(eager[0])
    kept = {k: v[0].data_ptr() for k, v in _workspace._BUFS.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        captured = _workspace.split_scratch(dev, shapes, 1)[:-1]
        captured[0].zero_()
    assert not any(_inside_kept(t) for t in captured)
    pool = torch.cuda.MemPool()
    other = torch.cuda.Stream()
    with torch.cuda.stream(other), torch.cuda.use_mem_pool(pool):
        pooled = _workspace.split_scratch(dev, shapes, 1)[:-1]
    assert not any(_inside_kept(t) for t in pooled)
    assert {k: v[0].data_ptr() for k, v in _workspace._BUFS.items()} == kept


@requires_cuda
def test_reduce_overhead_compile_of_a_split_launch():
    """torch.compile's CUDA graphs warm up with every allocation in their pool, check it for
    stray tensors and reset it: a split launch there keeps no scratch and stays exact."""
    dev = torch.device("cuda")
    assert _split(2, 4096, dev) > 1
    fn = torch.compile(lambda *a: torch.ops.kvops.static_sliding_attention(*a),
                       mode="reduce-overhead", fullgraph=True)
    c = _case(2, 4096, 40, dev)
    bufs = [t.clone() for t in c]
    for seed in (41, 42, 43, 44):
        fresh = _case(2, 4096, seed, dev)
        for t, f in zip(bufs, fresh):
            t.copy_(f)
        got = [t.clone() for t in fn(*bufs)]
        _check(fresh, got)


@requires_cuda
def test_scratch_grows_and_serves_smaller_requests():
    dev = torch.device("cuda")
    _workspace.clear()
    small, big = _case(1, 2048, 30, dev), _case(8, 8192, 31, dev)
    for c in (small, big, small, big):
        _check(c, torch.ops.kvops.static_sliding_attention(*c))
    assert len(_workspace._BUFS) == 1


@pytest.mark.parametrize("shapes", [((3, 5, 7), (3, 5)), ((1,), (33,), (2, 2))])
@requires_cuda
def test_views_are_aligned_and_disjoint(shapes):
    views = _workspace.split_scratch(torch.device("cuda"), shapes, 1)[:-1]
    spans = []
    for v, s in zip(views, shapes):
        assert v.shape == s and v.is_contiguous() and v.data_ptr() % 128 == 0
        spans.append((v.data_ptr(), v.data_ptr() + 4 * v.numel()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@requires_cuda
def test_split_scratch_follows_its_counters_when_they_grow():
    """A split request remembered with the old counter buffer is forgotten when the counters
    grow: later calls get the kept buffer's counters, never the replaced ones."""
    dev = torch.device("cuda", torch.cuda.current_device())
    _workspace.clear()
    shapes = ((2, 8, 4, 64), (2, 8, 4))
    first = _workspace.split_scratch(dev, shapes, 16)
    _workspace.split_scratch(dev, shapes, 5000)          # replaces the 1024-entry counters
    again = _workspace.split_scratch(dev, shapes, 16)
    (buf, _), = _workspace._COUNTS.values()
    assert buf.numel() >= 5000 and again[2].data_ptr() == buf.data_ptr()
    assert first[2].data_ptr() != buf.data_ptr() and not again[2].any()
