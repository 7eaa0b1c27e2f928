"""The replay kernel on CUDA (kvops/ops/_replay.py): every op's calls from the eager bench,
replayed from recipes, give the bytes the Python implementation gives, on another stream, under
graph capture, inference mode and torch.compile; settings that must run Python do.

Builds the kernel where it is not built (about a minute on a fresh machine).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvops
from kvops.ops import _replay
from tests.conftest import requires_cuda, same_bits

pytestmark = requires_cuda

@pytest.fixture(scope="module")
def cxx():
    _replay.build()
    if not _replay.install():
        pytest.skip("the replay kernel is not installed (KVOPS_REPLAY=0?)")
    return _replay.module()


class _Calls(TorchDispatchMode):
    """The kvops op calls made inside the block, with their arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "kvops":
            self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _bench_calls():
    from bench.bench_eager import cases

    calls = []
    for name, (op, _, _) in cases(torch.device("cuda")).items():
        with _Calls() as rec:
            op()
        calls += [(name, *c) for c in rec.calls]
    return calls


CALLS = _bench_calls() if torch.cuda.is_available() else []


def _written(func) -> list[int]:
    return [i for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _run(func, args, kwargs, init):
    """Restore the written arguments to ``init`` and call; returns (outputs, written)."""
    written = _written(func)
    for i, t in zip(written, init):
        args[i].copy_(t)
    out = func(*args, **kwargs)
    torch.cuda.synchronize()
    outs = () if out is None else (out,) if isinstance(out, torch.Tensor) else tuple(out)
    return [o.clone() for o in outs], [args[i].clone() for i in written]


def _check(func, args, kwargs, cxx):
    """Python's result, then five calls through the kernel: equal bytes, the last call a
    replay."""
    init = [args[i].clone() for i in _written(func)]
    cxx.set_enabled(False)
    want = _run(func, args, kwargs, init)
    _replay.refresh()
    for _ in range(5):
        hits = cxx.stats()[0]
        got = _run(func, args, kwargs, init)
    hit = cxx.stats()[0] - hits == 1
    for w, g in zip(want[0] + want[1], got[0] + got[1]):
        assert same_bits(w, g), f"{func}: the replayed call's bytes differ from Python's"
    assert hit, f"{func}: no recipe after five calls ({_replay.REFUSED.get(func._schema.name)})"


@pytest.mark.parametrize("case", range(len(CALLS)), ids=[c[0] for c in CALLS])
def test_every_op_replays_bit_exact(cxx, case):
    name, func, args, kwargs = CALLS[case]
    _check(func, list(args), kwargs, cxx)


def _first(name):
    return next(c for c in CALLS if c[0] == name)


def test_a_second_stream_keeps_its_own_recipe(cxx):
    _, func, args, kwargs = _first("static_sliding_attention")
    want = func(*args, **kwargs)
    for _ in range(3):
        func(*args, **kwargs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(4):
            hits = cxx.stats()[0]
            got = func(*args, **kwargs)
        assert cxx.stats()[0] - hits == 1
    torch.cuda.current_stream().wait_stream(side)
    assert all(same_bits(w, g) for w, g in zip(want, got))


def _captured(func, args, kwargs):
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        func(*args, **kwargs)        # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=side):
            got = func(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    return got


def test_capture_runs_python(cxx):
    """A capture with recipes at hand runs Python: the same bytes as a capture without the
    kernel (a captured split merges by a kernel of its own, so not the eager call's bytes)."""
    _, func, args, kwargs = _first("elastic_attention (native)")
    for _ in range(4):
        func(*args, **kwargs)        # a recipe exists; capture must not use it
    misses = cxx.stats()[1]
    got = _captured(func, args, kwargs)
    assert cxx.stats()[1] > misses
    cxx.set_enabled(False)
    want = _captured(func, args, kwargs)
    cxx.set_enabled(True)
    assert all(same_bits(w, g) for w, g in zip(want, got))


def test_inference_mode_and_compile(cxx):
    _, func, args, kwargs = _first("static_sliding_attention")
    want = func(*args, **kwargs)
    with torch.inference_mode():
        for _ in range(4):
            got = func(*args, **kwargs)
        assert got[0].is_inference()
    assert all(same_bits(w, g) for w, g in zip(want, got))
    compiled = torch.compile(lambda *a: func(*a, **kwargs), fullgraph=True)
    for _ in range(4):
        got = compiled(*args)
    assert all(same_bits(w, g) for w, g in zip(want, got))


def test_settings_that_run_python(cxx):
    _, func, args, kwargs = _first("static_sliding_attention")
    for _ in range(4):
        func(*args, **kwargs)
    hits = cxx.stats()[0]
    with kvops.validate(True):
        func(*args, **kwargs)
    with kvops.backend("torch"):
        ref = func(*args, **kwargs)
    assert cxx.stats()[0] == hits
    assert ref[0].dtype == args[0].dtype
    for _ in range(4):
        func(*args, **kwargs)
    assert cxx.stats()[0] > hits      # back to replaying after the settings are restored


def test_bad_input_still_raises_its_error(cxx):
    _, func, args, kwargs = _first("static_sliding_attention")
    bad = list(args)
    bad[3] = bad[3].to(torch.int64)
    for _ in range(2):
        with pytest.raises(TypeError, match="win_start"):
            func(*bad, **kwargs)
