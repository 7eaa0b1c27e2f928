"""Split-K scratch kept across eager calls (``kvops.kernels._workspace``): a call's partials are
never overwritten by another call before its merge reads them, on one stream, on two streams,
from two threads, inside and beside a captured graph, and when the buffer grows."""

from __future__ import annotations

import threading

import pytest
import torch

import kvops  # noqa: F401  (registers the ops)
from kvops.kernels import _workspace
from kvops.kernels._common import device_props
from kvops.kernels.static_sliding_attention import sliding_launch
from kvops.ops.static_sliding_attention import static_sliding_attention_ref
from tests.conftest import capture_graph, requires_cuda


def test_cpu_views_are_fresh_and_shaped():
    a, b = _workspace.float_views(torch.device("cpu"), ((2, 3, 4), (5,)))
    c, _ = _workspace.float_views(torch.device("cpu"), ((2, 3, 4), (5,)))
    assert a.shape == (2, 3, 4) and b.shape == (5,) and a.dtype == torch.float32
    assert a.data_ptr() != c.data_ptr()            # no reuse off CUDA


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
def test_two_streams_have_their_own_scratch():
    dev = torch.device("cuda")
    a, b = _case(2, 4096, 1, dev), _case(2, 4096, 2, dev)
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    outs = {}
    for _ in range(4):                               # interleaved issue on both streams
        with torch.cuda.stream(sa):
            outs["a"] = torch.ops.kvops.static_sliding_attention(*a)
        with torch.cuda.stream(sb):
            outs["b"] = torch.ops.kvops.static_sliding_attention(*b)
    torch.cuda.synchronize()
    _check(a, outs["a"])
    _check(b, outs["b"])


@requires_cuda
def test_threads_have_their_own_scratch():
    dev = torch.device("cuda")
    cases = [_case(2, 4096, 10 + i, dev) for i in range(2)]
    outs, errors = [None, None], []

    def work(i):
        try:
            for _ in range(20):
                outs[i] = torch.ops.kvops.static_sliding_attention(*cases[i])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors
    for c, o in zip(cases, outs):
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
    views = _workspace.float_views(torch.device("cuda"), shapes)
    spans = []
    for v, s in zip(views, shapes):
        assert v.shape == s and v.is_contiguous() and v.data_ptr() % 128 == 0
        spans.append((v.data_ptr(), v.data_ptr() + 4 * v.numel()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
