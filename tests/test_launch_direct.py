"""``kvops.kernels._launch``'s dispatch, with a stand-in for triton's compiled kernel (no GPU
needed): the first call of a key goes through the JIT and keeps the compiled kernel; the next
tries the compiled launcher's calling conventions and keeps the first that takes the
arguments; a binary that none takes keeps the JIT path alone, and every other key keeps its
direct launches."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from kvops.kernels import _launch


def _noop_fn(X, N, BLOCK: tl.constexpr):
    pass


def _other_fn(X, N, BLOCK: tl.constexpr):
    pass


# JITFunction itself, also under TRITON_INTERPRET (whose @triton.jit makes interpreted ones,
# which ``_launch`` always hands to the interpreter)
_noop, _other = JITFunction(_noop_fn), JITFunction(_other_fn)


class FakeRun:
    """A compiled launcher taking only the conventions in ``accepts``."""

    launch_cooperative_grid = False
    launch_pdl = False
    global_scratch_size = 0
    profile_scratch_size = 0

    def __init__(self, accepts, log):
        self.accepts, self.log = accepts, log

    def launch(self, *a):
        if "c" not in self.accepts:
            raise TypeError("c refused")
        self.log.append("c")

    def __call__(self, *a):
        mode = "tail" if len(a) == 9 + 3 else "plain"      # args (X, N) and the tail (BLOCK,)
        if mode not in self.accepts:
            raise TypeError(f"{mode} refused")
        self.log.append(mode)


class FakeCompiled:
    function = 0
    packed_metadata = None

    def __init__(self, accepts, log):
        self.run = FakeRun(accepts, log)


@pytest.fixture
def fake_triton(monkeypatch):
    """JIT launches logged as "jit" and answered by a FakeCompiled per kernel (its accepted
    conventions set by the test); launch state fresh; CUDA stream queries stubbed."""
    log, accepts = [], {}

    def jit_launch(kernel, grid):
        def run(*args, **meta):
            log.append("jit")
            return FakeCompiled(accepts.get(kernel.fn.__name__.removesuffix("_fn"), ()), log)
        return run

    monkeypatch.setattr(JITFunction, "__getitem__", jit_launch)
    monkeypatch.setattr(_launch, "_BINS", {})
    monkeypatch.setattr(_launch, "_STATE", {"direct": True, "mode": None})
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    return log, accepts


def call(kernel, key="k"):
    _launch.launch(kernel, (1,), key, (torch.zeros(1), 1), {"BLOCK": 16})


@pytest.mark.parametrize("accepts,mode", [(("c",), "c"), (("tail",), "tail"),
                                          (("plain",), "plain")])
def test_the_first_convention_that_takes_the_arguments_is_kept(fake_triton, accepts, mode):
    log, acc = fake_triton
    acc["_noop"] = accepts
    call(_noop)
    assert log == ["jit"]
    call(_noop)
    call(_noop)
    assert log[1:] == [mode, mode] and _launch._STATE["mode"] == mode


def test_a_binary_no_convention_takes_keeps_the_jit_alone(fake_triton):
    log, acc = fake_triton
    acc["_noop"] = ()
    acc["_other"] = ("c",)
    call(_noop)
    call(_noop)                       # probes c, tail and plain, all refused: the JIT launches
    assert log == ["jit", "jit"]
    call(_noop)                       # no second probe
    assert log == ["jit", "jit", "jit"]
    assert _launch._STATE["direct"]
    call(_other)
    call(_other)
    assert log[3:] == ["jit", "c"]    # another kernel still launches directly


def test_no_key_always_takes_the_jit(fake_triton):
    log, acc = fake_triton
    acc["_noop"] = ("c",)
    for _ in range(3):
        call(_noop, key=None)
    assert log == ["jit"] * 3 and not _launch._BINS


def test_a_plans_launch_goes_straight_to_the_c_entry_once_it_took_the_arguments(fake_triton):
    log, acc = fake_triton
    acc["_noop"] = ("c",)
    run = _launch.Launch(_noop, (1,), "k", (1,), {"BLOCK": 16})
    x = torch.zeros(1)
    run(x)                            # the JIT compiles; launch() keeps the binary
    run(x)                            # launch() probes the conventions; the C entry takes it
    assert log == ["jit", "c"] and run._c is not None
    _launch._BINS.clear()             # no key lookup any more
    run(x)
    assert log == ["jit", "c", "c"]
    _launch._STATE["direct"] = False  # KVOPS_DIRECT_LAUNCH=0's state: the JIT again
    run(x)
    assert log[-1] == "jit"


def test_a_plans_launch_takes_the_jit_while_a_launch_hook_is_installed(fake_triton, monkeypatch):
    log, acc = fake_triton
    acc["_noop"] = ("c",)
    run = _launch.Launch(_noop, (1,), "k", (1,), {"BLOCK": 16})
    run(torch.zeros(1))
    run(torch.zeros(1))
    monkeypatch.setattr(_launch, "_no_hooks", lambda: False)
    run(torch.zeros(1))
    assert log == ["jit", "c", "jit"]


def test_a_plans_launch_without_a_key_always_takes_the_jit(fake_triton):
    log, acc = fake_triton
    acc["_noop"] = ("c",)
    run = _launch.Launch(_noop, (1,), None, (1,), {"BLOCK": 16})
    for _ in range(3):
        run(torch.zeros(1))
    assert log == ["jit"] * 3 and run._c is None


@pytest.mark.parametrize("mode", ["tail", "plain"])
def test_a_plans_launch_keeps_a_wrapper_convention_too(fake_triton, mode):
    """Where the C entry refuses (another triton), the convention probed is kept the same way."""
    log, acc = fake_triton
    acc["_noop"] = (mode,)
    run = _launch.Launch(_noop, (1,), "k", (1,), {"BLOCK": 16})
    x = torch.zeros(1)
    run(x)
    run(x)
    _launch._BINS.clear()
    run(x)
    assert log == ["jit", mode, mode] and run._c is not None
