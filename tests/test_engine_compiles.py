"""The engine's count of Triton compiles (kvops.engine.compiles.TritonCompiles)."""

import pytest
import torch

from kvops._config import interpreting
from kvops.engine.compiles import TritonCompiles, _runtime_knobs

knobs = _runtime_knobs()
requires_hook = pytest.mark.skipif(knobs is None or not hasattr(knobs, "jit_post_compile_hook"),
                                   reason="this Triton has no jit_post_compile_hook")


@requires_hook
def test_counts_each_compile_by_name_calls_the_hook_it_found_and_puts_it_back(monkeypatch):
    import kvops.engine.compiles as compiles

    monkeypatch.setattr(compiles, "interpreting", lambda: False)   # the compiling JIT's path
    seen = []

    def before(**kw):
        seen.append(kw["fn"].name)

    knobs.jit_post_compile_hook = before
    try:
        with TritonCompiles() as jit:
            hook = knobs.jit_post_compile_hook
            assert hook is not before
            for name in ("a", "b", "a"):
                hook(key=None, repr="", fn=type("F", (), {"name": name})(), compile={},
                     is_manual_warmup=False, already_compiled=False)
        assert knobs.jit_post_compile_hook is before
        assert jit.count == 3 and jit.names == {"a": 2, "b": 1}
        assert seen == ["a", "b", "a"]
    finally:
        knobs.jit_post_compile_hook = None


@requires_hook
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton compiles there)")
def test_counts_a_fresh_specialization_once_on_cuda():
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(X, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(X + o, tl.load(X + o, mask=o < n) + 1, mask=o < n)

    x = torch.zeros(8, device="cuda")
    with TritonCompiles() as jit:
        _add_one[(1,)](x, 8, BLOCK=8)
        _add_one[(1,)](x, 8, BLOCK=8)       # the same specialization: no compile
        _add_one[(1,)](x, 8, BLOCK=16)      # a new constexpr: one more
    torch.cuda.synchronize()
    assert x.tolist() == [3.0] * 8
    assert jit.names == {"_add_one": 2}, jit.names


def test_without_the_hook_or_triton_the_count_is_zero(monkeypatch):
    import kvops.engine.compiles as compiles

    monkeypatch.setattr(compiles, "_runtime_knobs", lambda: None)
    with compiles.TritonCompiles() as jit:
        pass
    assert jit.count == 0 and jit.names == {}


interpreted = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


@interpreted
def test_under_the_interpreter_counts_each_specialization_the_jit_would_compile_once(monkeypatch):
    import triton

    import kvops.engine.compiles as compiles

    monkeypatch.setattr(compiles, "_MET", set())     # a fresh process's JIT cache
    import triton.language as tl

    @triton.jit
    def _bump(X, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(X + o, tl.load(X + o, mask=o < n) + 1, mask=o < n)

    @triton.jit(do_not_specialize=["n"])
    def _bump_any_n(X, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(X + o, tl.load(X + o, mask=o < n) + 1, mask=o < n)

    x = torch.zeros(64)
    with TritonCompiles() as jit:
        _bump[(1,)](x, 8, BLOCK=8)
        _bump[(1,)](x, 9, BLOCK=8)          # 8 and 9: neither 1 nor a multiple of 16
        _bump[(1,)](x, 8, BLOCK=16)         # a new constexpr
        _bump[(1,)](x, 16, BLOCK=16)        # n a multiple of 16
        _bump[(1,)](x, 1, BLOCK=16)         # n == 1: a constant
        _bump[(1,)](x[1:], 8, BLOCK=16)     # a pointer off 16-byte alignment
        _bump[(1,)](x, 8, BLOCK=16, num_warps=8)   # another launch option
        for n in (3, 16, 1):
            _bump_any_n[(1,)](x, n, BLOCK=16)       # not specialized on n: one binary
    assert jit.names == {"_bump": 6, "_bump_any_n": 1}, jit.names
    with TritonCompiles() as again:                 # met in this process already
        _bump[(1,)](x, 8, BLOCK=8)
    assert again.count == 0


@pytest.mark.parametrize("source", ["triton", "python"])
def test_the_interpreters_keys_are_the_jits_rules(source):
    pytest.importorskip("triton")
    from kvops.engine.compiles import _python_rules, _specialize_impl

    rules = _specialize_impl() if source == "triton" else _python_rules
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert rules(x, True) != rules(x[1:], True)
    assert rules(x[1:], False) == rules(x, False)
    assert rules(16, True) != rules(17, True) != rules(1, True)
    assert rules(16, False) == rules(17, False)
    assert rules(2**40, False) != rules(17, False)      # 64-bit


@interpreted
def test_the_thorough_warmup_leaves_a_replay_nothing_to_compile(monkeypatch):
    """The engine's warm-up walks the launch rules' classes (``warmup_requests``), so a replay
    after it meets no specialization Triton would compile inside a measured step; the short
    warm-up does leave some (the counter sees them)."""
    import kvops
    import kvops.engine.compiles as compiles
    from kvops.engine.replay import ReplaySettings, run

    def replay(thorough):
        monkeypatch.setattr(compiles, "_MET", set())     # a fresh process's JIT cache
        settings = ReplaySettings(configs=("static",), model="tiny", max_requests=4,
                                  length_scale=0.125, budget_gib=0.01, max_seqs=4,
                                  max_context=512, window=128, graphs=False, overlap=False,
                                  thorough_warmup=thorough)
        with kvops.backend("triton"):
            return run(settings, progress=False)["results"]["static"]

    res = replay(True)
    assert res["finished"] == 4 and res["compiles"] == 0, res["compiled"]
    short = replay(False)
    assert short["compiles"] > 0 and "_paged_kv_write_kernel" in short["compiled"]
