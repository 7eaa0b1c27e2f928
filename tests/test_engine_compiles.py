"""The engine's count of Triton compiles (kvops.engine.compiles.TritonCompiles)."""

import pytest
import torch

from kvops.engine.compiles import TritonCompiles, _runtime_knobs

knobs = _runtime_knobs()
requires_hook = pytest.mark.skipif(knobs is None or not hasattr(knobs, "jit_post_compile_hook"),
                                   reason="this Triton has no jit_post_compile_hook")


@requires_hook
def test_counts_each_compile_by_name_calls_the_hook_it_found_and_puts_it_back():
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
