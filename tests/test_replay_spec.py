"""The replay kernel's CPU-checkable parts (kvops/ops/_replay.py, kvops/csrc/replay.cpp).

Recipes are made from fake records (a compiled kernel's launcher facts without a GPU), and the
built C++ kernel runs on CPU tensors of test ops in dry mode, which logs each launch's
configuration and parameter bytes instead of launching. tests/test_replay.py runs the real
thing on CUDA against every op's Python implementation.
"""

from __future__ import annotations

import shutil
import struct
from types import SimpleNamespace

import pytest
import torch

from kvops.kernels import _launch
from kvops.ops import _replay
from kvops.ops._replay import ABS, ARG, OUT, VAL, Refused, make_recipe


def fake_compiled(signature: dict, warps=4, ctas=1, shared=1024, pdl=False, coop=False,
                  function=0xF00D, scratch=0):
    run = SimpleNamespace(launch_pdl=pdl, launch_cooperative_grid=coop,
                          global_scratch_size=scratch, profile_scratch_size=0)
    return SimpleNamespace(run=run, packed_metadata=(warps, ctas, shared), function=function,
                           src=SimpleNamespace(signature=signature), name="fake")


SIG = {"x": "*bf16", "out": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr",
       "flag": "i1", "off": "i64"}


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(_replay, "_DEVICE_TYPES", ("cuda", "cpu"))


def test_recipe_maps_every_parameter(on_cpu):
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    out = torch.empty(4, 8)
    scratch = torch.empty(64)
    s0 = scratch.data_ptr()
    k = fake_compiled(SIG)
    notes = [(k, (3, 1, 1), (x, out, -2, 0.5, 64, True, 2**40), None),
             (k, (1, 2, 1), (x.data_ptr() + 16, out.data_ptr() + 32, 7, -1.0, 64, False, -1), None),
             (k, (1, 1, 1), (x, s0 + 8, 1, 0.0, 64, 0, 0), None)]
    device, outs, launches, held = make_recipe((x, 5, None), out, notes,
                                               ((s0, s0 + 256, scratch),))
    assert device == -1 and outs == (((4, 8), (8, 1), torch.float32),)
    assert len(held) == 1 and held[0] is scratch     # the recipe holds the kept buffer
    fn, grid, block, shared, pdl, coop, params, descs = launches[0]
    assert (fn, grid, block, shared, pdl, coop, descs) == (0xF00D, (3, 1, 1), 128, 1024, False,
                                                          False, ())
    f32 = struct.unpack("<I", struct.pack("<f", 0.5))[0]
    assert params == ((ARG, 0, 0), (OUT, 0, 0), (VAL, 0, 2**32 - 2), (VAL, 0, f32), (VAL, 0, 1),
                      (VAL, 0, 2**40))          # BLOCK (constexpr) is not passed
    assert launches[1][6][:3] == ((ARG, 0, 16), (OUT, 0, 32), (VAL, 0, 7))
    assert launches[1][6][4:] == ((VAL, 0, 0), (VAL, 0, 2**64 - 1))
    assert launches[2][6][1] == (ABS, 0, s0 + 8)


def _tma_map():
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    except ImportError:
        pytest.skip("this triton has no TMA dtype map")
    return TMA_DTYPE_DEVICE_TO_HOST


def test_recipe_encodes_a_descriptor_as_triton_does(on_cpu):
    host = _tma_map()
    pool = torch.zeros(6, 16, 4, 64, dtype=torch.bfloat16)        # [P, S, H, D]
    out = torch.empty(2, 64)
    flat = pool.view(-1, 64)
    desc = SimpleNamespace(base=flat, shape=[384, 64], strides=[64, 1], padding="zero")
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [64, 64],
            "fp4_padded": False}
    k = fake_compiled({"kd": "tensordesc<bf16[64, 64]>", "o": "*fp32", "n": "i32"})
    notes = [(k, (2, 1, 1), (desc, out, 5), (meta,))]
    _, _, launches, _ = make_recipe((flat, 3), out, notes, ())
    params, descs = launches[0][6], launches[0][7]
    assert params == ((4, 0, 0), (VAL, 0, 384), (VAL, 0, 64), (VAL, 0, 64), (VAL, 0, 1),
                      (OUT, 0, 0), (VAL, 0, 5))
    # innermost dimension first; strides in bytes, the outer one then dims * stride as
    # fill_tma_descriptor computes it
    assert descs == ((ARG, 0, 0, host[10], 3, 0, (64, 384), (128, 384 * 128), (64, 64)),)
    with pytest.raises(Refused, match="metadata"):
        make_recipe((flat, 3), out, [(k, (2, 1, 1), (desc, out, 5), None)], ())
    with pytest.raises(Refused, match="TMA map"):
        make_recipe((flat, 3), out, [(k, (2, 1, 1), (desc, out, 5),
                                      (dict(meta, fp4_padded=True),))], ())


def test_a_float_beyond_fp32_packs_as_inf(on_cpu):
    x, out = torch.zeros(4), torch.empty(4)
    k = fake_compiled({"a": "*fp32", "b": "*fp32", "s": "fp32"})
    _, _, launches, _ = make_recipe((x,), out, [(k, (1, 1, 1), (x, out, -1e39), None)], ())
    assert launches[0][6][2] == (VAL, 0, struct.unpack("<I", struct.pack("<f", float("-inf")))[0])


@pytest.mark.parametrize("case", ["jit", "outside", "two_args", "inside_two", "view_out",
                                  "arg_out", "cluster", "scratch", "tuple", "descriptor",
                                  "count", "cpu", "address_int"])
def test_recipe_refusals(on_cpu, monkeypatch, case):
    base = torch.zeros(64)
    x, y = base[:16], base[8:24]             # y starts inside x
    out = torch.empty(4)
    k = fake_compiled({"a": "*fp32", "b": "*fp32"})
    args, result = (x,), out
    notes = [(k, (1, 1, 1), (x, out), None)]
    if case == "jit":
        notes = [None]
    elif case == "outside":
        notes = [(k, (1, 1, 1), (x, torch.empty(4)), None)]
    elif case == "two_args":      # a pointer given as neither argument's object
        args = (x, x.view(4, 4))
        notes = [(k, (1, 1, 1), (x.view(2, 8), out), None)]
    elif case == "inside_two":
        args = (x, y)
        notes = [(k, (1, 1, 1), (base.data_ptr() + 4 * 12, out), None)]   # inside x and y
    elif case == "view_out":
        result = torch.empty(8)[:4]
    elif case == "arg_out":
        result = x
    elif case == "cluster":
        notes = [(fake_compiled({"a": "*fp32", "b": "*fp32"}, ctas=2), (1, 1, 1), (x, out), None)]
    elif case == "scratch":
        notes = [(fake_compiled({"a": "*fp32", "b": "*fp32"}, scratch=64), (1, 1, 1), (x, out), None)]
    elif case == "tuple":
        notes = [(fake_compiled({"a": "*fp32", "b": ("*fp32", "i32")}), (1, 1, 1), (x, out), None)]
    elif case == "descriptor":
        notes = [(fake_compiled({"a": "*fp32", "b": "tensordesc<fp32[16, 16]>"}), (1, 1, 1),
                  (x, out), None)]         # a descriptor without its metadata
    elif case == "count":
        notes = [(k, (1, 1, 1), (x,), None)]
    elif case == "cpu":
        monkeypatch.setattr(_replay, "_DEVICE_TYPES", ("cuda",))
    elif case == "address_int":      # an i64 holding an address inside an argument
        notes = [(fake_compiled({"a": "*fp32", "b": "*fp32", "n": "i64"}), (1, 1, 1),
                  (x, out, x.data_ptr() + 8), None)]
    with pytest.raises(Refused):
        make_recipe(args, result, notes, ())


def test_an_arguments_own_object_maps_to_it_where_another_has_its_address(on_cpu):
    pool = torch.zeros(32)
    k_new, v_new = pool[:8], pool[:8]        # two tensors at one address (the engine's k, v)
    out = torch.empty(4)
    k = fake_compiled({"k": "*fp32", "v": "*fp32", "o": "*fp32"})
    _, _, launches, _ = make_recipe((k_new, v_new), out, [(k, (1, 1, 1), (v_new, k_new, out),
                                                            None)], ())
    assert launches[0][6] == ((ARG, 1, 0), (ARG, 0, 0), (OUT, 0, 0))


def test_recording_notes_only_its_thread_and_nests():
    k = fake_compiled({"a": "i32"})
    assert _launch._RECORDING == 0
    with _launch.recording() as outer:
        _launch._note(k, (1, 1, 1), (1,))
        with _launch.recording() as inner:
            _launch._note(None, (1, 1, 1), (2,))
        _launch._note(k, (2, 1, 1), (3,))
    _launch._note(k, (1, 1, 1), (4,))          # nothing records: dropped
    assert [n and n[2] for n in outer] == [(1,), (3,)] and inner == [None]
    assert _launch._RECORDING == 0


def test_miss_keeps_a_recipe_after_two_agreeing_records(on_cpu, monkeypatch):
    x = torch.zeros(8)
    k = fake_compiled({"a": "*fp32", "b": "*fp32", "n": "i32"})
    calls = []

    def impl(t, n):
        out = torch.empty(8)
        _launch._note(k, (1, 1, 1), (t, out, n if len(calls) != 1 else n + 1))
        calls.append(n)
        return out

    monkeypatch.setitem(_replay._library.IMPLS, "fake_op", impl)
    _replay._PENDING.clear()
    got = [_replay.miss("kvops::fake_op", b"sig", (x, 3))[1] for _ in range(4)]
    # the second record disagrees with the first (its n differs), the third agrees with neither
    # neighbour, the fourth agrees with the third
    assert got[:3] == [None, None, None] and got[3] is not None
    assert got[3][2][0][6] == ((ARG, 0, 0), (OUT, 0, 0), (VAL, 0, 3))
    assert _replay.miss("kvops::fake_op", None, (x, 3))[1] is None     # unrecorded
    _replay._PENDING.clear()


def test_the_watch_lets_allocations_and_views_pass():
    x = torch.zeros(4, 4)
    for make, ok in ((lambda: torch.empty_like(x), True), (lambda: x.new_empty(3), True),
                     (lambda: torch.empty(2, 3, dtype=torch.int32), True),
                     (lambda: x[1:].transpose(0, 1).view(4, 3), True),
                     (lambda: torch.zeros(3), False), (lambda: x.clone(), False),
                     (lambda: x.sum().item(), False)):
        watch = _replay._Watch()
        with watch:
            make()
        assert (watch.work is None) == ok, watch.work


def test_records_agree_with_their_kept_buffers_compared_by_identity():
    a, b = torch.zeros(64), torch.zeros(64)
    spec = (0, (), ((1, (1, 1, 1), 32, 0, False, False, ((ABS, 0, 8),), ()),))
    assert _replay._agree((*spec, (a,)), (*spec, (a,)))
    assert not _replay._agree((*spec, (a,)), (*spec, (b,)))     # no tensor == on the way
    assert not _replay._agree((*spec, (a,)), None) and not _replay._agree(None, None)


def test_miss_refuses_work_and_gives_up(on_cpu, monkeypatch):
    x = torch.zeros(8)
    k = fake_compiled({"a": "*fp32", "b": "*fp32"})

    def impl(t):
        out = torch.empty(8)
        out.zero_()                          # work a recipe would not replay
        _launch._note(k, (1, 1, 1), (t, out))
        return out

    monkeypatch.setitem(_replay._library.IMPLS, "fake_fill", impl)
    _replay._PENDING.clear()
    for _ in range(_replay.MAX_TRIES + 2):
        assert _replay.miss("kvops::fake_fill", b"s", (x,))[1] is None
    assert _replay._PENDING[("kvops::fake_fill", b"s")] == "never"
    _replay._PENDING.clear()


# ---- the C++ kernel on CPU tensors, in dry mode --------------------------------------------

def _compiler():
    return shutil.which("c++") or shutil.which("g++")


@pytest.fixture(scope="module")
def cxx():
    if _compiler() is None:
        pytest.skip("no C++ compiler")
    try:
        _replay.build()
    except RuntimeError as e:    # a toolchain that cannot build against this torch
        pytest.skip(str(e)[:200])
    return _replay.module()


@pytest.fixture(scope="module")
def test_ops(cxx):
    lib = torch.library.Library("kvops_replay_test", "DEF")
    lib.define("pair(Tensor x, Tensor? y, int n, float? s, str? c) -> (Tensor, Tensor)")
    lib.define("scale(Tensor x, float s) -> Tensor")
    lib.define("touch(Tensor(a!) x, int n) -> ()")
    yield lib
    cxx.uninstall("kvops_replay_test")
    lib._destroy()


def _install(cxx, miss):
    cxx.uninstall("kvops_replay_test")
    cxx.install("kvops_replay_test", "CPU", ["pair", "scale", "touch"], miss)
    cxx.clear()
    cxx.set_enabled(True)     # the interpreter's settings disable it (conftest refreshes)


def test_cpp_miss_path_converts_arguments_and_results(cxx, test_ops):
    seen = []

    def miss(name, signature, args):
        seen.append((name, signature is not None, args))
        if name.endswith("pair"):
            x, y, n, s, c = args
            if n < 0:
                raise ValueError(f"n: expected >= 0, got {n}")
            return (x + n, x * (s or 1.0)), None
        if name.endswith("touch"):
            args[0].add_(args[1])
            return None, None
        return args[0] * args[1], None

    _install(cxx, miss)
    x = torch.arange(4.0)
    a, b = torch.ops.kvops_replay_test.pair(x, None, 2, 0.5, "hi")
    assert torch.equal(a, x + 2) and torch.equal(b, x * 0.5)
    name, keyed, args = seen[-1]
    assert name == "kvops_replay_test::pair" and keyed
    assert args[1] is None and args[2] == 2 and args[3] == 0.5 and args[4] == "hi"
    assert torch.equal(torch.ops.kvops_replay_test.scale(x, 3.0), x * 3)
    y = torch.zeros(3)
    assert torch.ops.kvops_replay_test.touch(y, 5) is None and torch.equal(y, torch.full((3,), 5.0))
    with pytest.raises(ValueError, match="n: expected >= 0, got -1"):
        torch.ops.kvops_replay_test.pair(x, None, -1, None, None)
    cxx.set_enabled(False)
    torch.ops.kvops_replay_test.scale(x, 3.0)
    assert seen[-1][1] is False              # disabled: unrecorded
    cxx.set_enabled(True)


def _recipe(launches):
    return (-1, (((2, 3), (1, 2), torch.float32), ((5,), (1,), torch.int32)), launches, ())


def test_cpp_replays_a_recipe_in_dry_mode(cxx, test_ops):
    f32 = struct.unpack("<I", struct.pack("<f", 1.5))[0]
    recipe = _recipe((
        (0xABC, (2, 3, 1), 256, 4096, True, False,
         ((ARG, 0, 8), (OUT, 1, 4), (VAL, 0, 2**32 - 1), (VAL, 0, f32), (ABS, 0, 0x7000)), ()),
        (0xDEF, (1, 1, 1), 32, 0, False, True, ((OUT, 0, 0),), ()),
    ))
    misses = []

    def miss(name, signature, args):
        misses.append(signature)
        return (torch.zeros(2, 3), torch.zeros(5, dtype=torch.int32)), recipe

    _install(cxx, miss)
    cxx.set_dry(True)
    try:
        x = torch.arange(8.0)
        hits0 = cxx.stats()[0]
        torch.ops.kvops_replay_test.pair(x, None, 1, None, None)      # miss: keeps the recipe
        assert len(misses) == 1 and cxx.recipes() == 1
        cxx.take_dry_launches()
        a, b = torch.ops.kvops_replay_test.pair(x, None, 1, None, None)   # hit
        assert cxx.stats()[0] == hits0 + 1 and len(misses) == 1
        assert a.shape == (2, 3) and a.stride() == (1, 2) and a.dtype == torch.float32
        assert b.shape == (5,) and b.dtype == torch.int32
        log = cxx.take_dry_launches()
        assert len(log) == 2
        fn, grid, block, shared, pdl, coop, slots, stream = log[0]
        assert (fn, grid, block, shared, pdl, coop, stream) == (0xABC, (2, 3, 1), 256, 4096,
                                                                 True, False, 0)
        assert slots == [x.data_ptr() + 8, b.data_ptr() + 4, 2**32 - 1, f32, 0x7000, 0, 0]
        assert log[1][6] == [a.data_ptr(), 0, 0] and log[1][5] is True
        # another signature misses: another n, another shape, another address mod 16,
        # requires_grad, a given optional
        torch.ops.kvops_replay_test.pair(x, None, 2, None, None)
        torch.ops.kvops_replay_test.pair(torch.arange(9.0), None, 1, None, None)
        torch.ops.kvops_replay_test.pair(torch.arange(12.0)[1:9], None, 1, None, None)
        torch.ops.kvops_replay_test.pair(x, x, 1, None, None)
        assert len(misses) == 5
        # the same signature from another tensor replays with that tensor's address
        z = torch.arange(8.0) + 1
        torch.ops.kvops_replay_test.pair(z, None, 1, None, None)
        assert len(misses) == 5 and cxx.take_dry_launches()[-2][6][0] == z.data_ptr() + 8
        cxx.set_dry(2)                       # launches dropped: nothing logged, outputs made
        a, _ = torch.ops.kvops_replay_test.pair(x, None, 1, None, None)
        assert a.shape == (2, 3) and cxx.take_dry_launches() == []
        cxx.set_dry(True)
        cxx.clear()
        torch.ops.kvops_replay_test.pair(x, None, 1, None, None)
        assert len(misses) == 6
    finally:
        cxx.set_dry(False)
        cxx.take_dry_launches()


def test_cpp_passes_a_descriptor_address_in_dry_mode(cxx, test_ops):
    desc = (ARG, 0, 128, 10, 3, 0, (64, 384), (128, 49152), (64, 64))
    recipe = (-1, (((3,), (1,), torch.float32),),
              ((0x11, (1, 1, 1), 128, 0, False, False,
                ((4, 0, 0), (VAL, 0, 384), (OUT, 0, 0)), (desc,)),), ())

    def miss(name, signature, args):
        return args[0] * args[1], recipe

    _install(cxx, miss)
    cxx.set_dry(True)
    try:
        x = torch.ones(64)
        torch.ops.kvops_replay_test.scale(x, 2.0)
        cxx.take_dry_launches()
        out = torch.ops.kvops_replay_test.scale(x, 2.0)
        (log,) = cxx.take_dry_launches()
        assert log[6] == [x.data_ptr() + 128, 384, out.data_ptr(), 0, 0]
    finally:
        cxx.set_dry(False)


@pytest.mark.parametrize("bad, why", [
    ((-1, (), ((1, (1, 1, 1), 32, 0, False, False, ((OUT, 3, 0),), ()),), ()), "names output 3 of 0"),
    ((-1, (), ((1, (1, 1, 1), 32, 0, False, False, ((ARG, 1, 0),), ()),), ()), "argument 1, not a tensor"),
    ((-1, (), ((1, (1, 1, 1), 32, 0, False, False, ((9, 0, 0),), ()),), ()), "unknown parameter kind"),
    ((-1, (), ()), "a recipe is"),
])
def test_cpp_drops_a_malformed_recipe_and_keeps_the_result(cxx, test_ops, bad, why):
    def miss(name, signature, args):
        return args[0] * args[1], bad

    _install(cxx, miss)
    count = cxx.bad_recipes()[0]
    got = torch.ops.kvops_replay_test.scale(torch.ones(2), 2.0)    # the op ran: no error
    assert torch.equal(got, torch.full((2,), 2.0)) and cxx.recipes() == 0
    assert cxx.bad_recipes()[0] == count + 1 and why in cxx.bad_recipes()[1]
