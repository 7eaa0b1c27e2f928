"""``kvops.kernels._launch``'s dispatch, with a stand-in for triton's compiled kernel (no GPU
needed): the first call of a key goes through the JIT and keeps the compiled kernel; the next
tries the compiled launcher's calling conventions and keeps the first that takes the
arguments; a binary that none takes keeps the JIT path alone, and every other key keeps its
direct launches."""

from __future__ import annotations

import sys

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

    def compile_(kernel, args):
        log.append("jit")
        return FakeCompiled(accepts.get(kernel.fn.__name__.removesuffix("_fn"), ()), log)

    _fake_jit(monkeypatch, compile_)
    return log, accepts


def _fake_jit(monkeypatch, compile_, stream=0):
    """JIT launches answered by ``compile_(kernel, args)`` (the compiled kernel they return);
    launch state fresh; the CUDA stream queries answer ``stream`` and device 0."""
    monkeypatch.setattr(JITFunction, "__getitem__",
                        lambda kernel, grid: lambda *args, **meta: compile_(kernel, args))
    monkeypatch.setattr(_launch, "_BINS", {})
    monkeypatch.setattr(_launch, "_STATE", {"direct": True, "mode": None})
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: stream, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)


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


# A compiled launcher of triton 3.6's form for kernels with tensor descriptors: the Python
# wrapper (``wrap_handle_tensordesc``) holds the C entry in its closure and encodes every
# descriptor on every call through this module's ``make_tensordesc_arg``.
ENCODED: list = []
_BASE_ARGS_FORMAT_LEN = 13      # the C entry's leading arguments, as the 3.6 driver counts them


def make_tensordesc_arg(desc, metadata):
    ENCODED.append((desc.base.data_ptr(), tuple(desc.shape), metadata))
    return [("map", desc.base.data_ptr(), tuple(desc.block)), *desc.shape, *desc.strides]


def _wrapper(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):
        head, rest = list(args[:13]), args[13:]
        for i, a in enumerate(rest):
            head.extend(make_tensordesc_arg(a, tensordesc_meta[i]) if i in tensordesc_indices
                        else [a])
        return launcher(*head)
    return inner


def _desc_fn(A, B, X, N, BLOCK: tl.constexpr):
    pass


_desc_kernel = JITFunction(_desc_fn)


@pytest.fixture
def fake_described(monkeypatch):
    """JIT launches of ``_desc_kernel`` logged as "jit", answered by a compiled kernel whose
    C-convention launcher is ``_wrapper``'s closure over a C entry logging what it gets."""
    log = []
    run = type("Run", (), dict(launch_cooperative_grid=False, launch_pdl=False,
                               global_scratch_size=0, profile_scratch_size=0))()
    run.launch = _wrapper(lambda *a: log.append(("c", a)), {0, 1}, [{"box": 1}, {"box": 2}])
    compiled = type("Compiled", (), dict(function=7, packed_metadata="pm", run=run))()
    _fake_jit(monkeypatch, lambda kernel, args: log.append(("jit", args)) or compiled, stream=5)
    ENCODED.clear()
    return log


def _described():
    make = lambda t, shape, strides, box, layout: type("D", (), dict(
        base=t, shape=shape, strides=strides, block=box, layout=layout))()
    rows = lambda t: ([t.shape[0], 4], [4, 1])
    return _launch.DescribedLaunch(_desc_kernel, (3,), "k", (9,), {"BLOCK": 16},
                                   ((rows, [2, 4], "la"), (rows, [1, 4], "lb")), make)


def test_a_described_launch_encodes_each_descriptor_once_per_address(fake_described):
    log = fake_described
    run = _described()
    a, b, x = torch.zeros(8, 4), torch.zeros(6, 4), torch.zeros(2)
    run((a, b), x)                          # the JIT compiles; launch() keeps the binary
    run((a, b), x)                          # the C convention through the wrapper: it encodes
    assert [e[0] for e in log] == ["jit", "c"] and run._c is not None
    assert log[0][1][0].base is a and log[0][1][1].layout == "lb"
    assert len(ENCODED) == 2
    for _ in range(3):                      # the C entry itself: two encodings, kept
        run((a, b), x)
    assert len(ENCODED) == 4 and [e[0] for e in log] == ["jit"] + ["c"] * 4
    # what the C entry gets: grid, stream, function, flags, metadata, the encodings with their
    # shapes and strides, the other arguments, the ints and the constexpr tail
    want = (3, 1, 1, 5, 7, False, False, None, None, "pm", None, None, None,
            ("map", a.data_ptr(), (2, 4)), 8, 4, 4, 1, ("map", b.data_ptr(), (1, 4)), 6, 4, 4, 1,
            x, 9, 16)
    assert log[-1][1] == want == log[1][1]
    assert [m for _, _, m in ENCODED] == [{"box": 1}, {"box": 2}] * 2
    c = torch.zeros(8, 4)                   # another address at the first position
    run((c, b), x)
    assert len(ENCODED) == 5 and ENCODED[-1][0] == c.data_ptr()
    run((c, c[:6]), x)                      # an address seen at the other position only
    assert len(ENCODED) == 6 and ENCODED[-1][2] == {"box": 2}
    _launch._STATE["direct"] = False        # KVOPS_DIRECT_LAUNCH=0: the JIT again
    run((a, b), x)
    assert log[-1][0] == "jit"


def test_a_described_launch_keeps_address_combinations_within_bounds(fake_described,
                                                                      monkeypatch):
    """Combinations of addresses are kept whole up to MAX_DESCRIPTORS; a combination made of
    addresses each position has seen encodes nothing again, after the whole ones were dropped
    too, and every call hands the C entry the encodings of its own addresses."""
    log = fake_described
    monkeypatch.setattr(_launch, "MAX_DESCRIPTORS", 3)
    run = _described()
    a, b, c, x = torch.zeros(8, 4), torch.zeros(6, 4), torch.zeros(8, 4), torch.zeros(2)
    run((a, b), x)
    run((a, b), x)                          # the wrapper encodes; the launch keeps nothing yet
    base = len(ENCODED)
    # the direct calls: two addresses a position, four combinations (one clear of the whole ones)
    for pair in ((c, b), (a, c[:6]), (c, c[:6]), (a, b), (c, b), (a, c[:6])):
        run(pair, x)
        got = log[-1][1]
        assert got[13][1] == pair[0].data_ptr() and got[18][1] == pair[1].data_ptr()
    assert len(ENCODED) == base + 4 and len(run._flat) <= 3
    assert all(len(m) <= 3 for m in run._maps)


def test_a_described_launch_keeps_the_wrapper_where_its_form_is_unknown(fake_described,
                                                                          monkeypatch):
    """A launcher whose wrapper is not triton 3.6's (another triton) keeps encoding through
    launch(): the descriptors' objects go to it on every call."""
    log, probes = fake_described, []
    monkeypatch.setattr(_launch, "_descriptor_entry",
                        lambda compiled, count: probes.append(count))
    run = _described()
    a, x = torch.zeros(8, 4), torch.zeros(2)
    for _ in range(4):
        run((a, a), x)
    assert run._c is False and probes == [2]          # probed once, after the C convention
    assert [e[0] for e in log] == ["jit", "c", "c", "c"] and len(ENCODED) == 6


def test_a_described_launch_the_c_entry_refuses_goes_back_to_the_wrapper(fake_described):
    """A C entry that refuses the encoded arguments (it launches nothing then) leaves the launch
    on the wrapper's way for good, this call included."""
    log = fake_described
    run = _described()
    a, x = torch.zeros(8, 4), torch.zeros(2)
    run((a, a), x)
    run((a, a), x)
    raw = run._c[0]

    def refusing(*args):
        raise TypeError("refused")
    run._c = (refusing, *run._c[1:])
    run((a, a), x)                           # refused, then launched through the wrapper
    assert run._c is False and [e[0] for e in log] == ["jit", "c", "c"]
    run((a, a), x)
    assert [e[0] for e in log] == ["jit", "c", "c", "c"] and raw is not None


def test_a_described_launch_needs_the_3_6_argument_count(fake_described, monkeypatch):
    """A driver whose C entry takes another number of leading arguments is not 3.6's form: the
    launch keeps triton's wrapper."""
    monkeypatch.setattr(sys.modules[__name__], "_BASE_ARGS_FORMAT_LEN", 12)
    run = _described()
    a, x = torch.zeros(8, 4), torch.zeros(2)
    for _ in range(3):
        run((a, a), x)
    assert run._c is False
