"""An eager op call computes each tensor argument's signature (``kvops._checks.signature``:
shape, strides, dtype, device, alignment; about 0.5 us of host time each) at most once, and
none when its arguments match a recent call's (``CheckedSignatures``' C++ check): the key
its checks are cached by is the key its launch plan is kept by. The kernels' launches are
stubbed out; what is counted is the host path of the bench's eager calls (bench/bench_eager.py).
Then the signature cache itself: every difference a signature holds gives another key."""

from __future__ import annotations

import sys

import pytest
import torch

import kvops
from kvops import _checks
from kvops._config import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")

# bench_eager's calls: the op each makes, and how many calls of it
CALLS = {
    "static_sliding_attention": ("static_sliding_attention", 1),
    "elastic_attention (native)": ("elastic_attention", 1),
    "elastic_attention (structured)": ("elastic_attention", 1),
    "paged_gather_merged": ("paged_gather_merged", 1),
    "far_view_summarize": ("far_view_summarize", 1),
    "pack_base_pairs": ("pack_base_pairs", 1),
    "refine_base_pairs": ("refine_base_pairs", 1),
    "paged_kv_write": ("paged_kv_write", 1),
    "paged_prefill_attention": ("paged_prefill_attention", 1),
    "paged_prefill_attention (chunk rows)": ("paged_prefill_attention", 1),
    "far_page_summarize": ("far_page_summarize", 1),
    "far_page_select": ("far_page_select", 1),
    "far_slot_update (two calls)": ("far_slot_update", 2),
    "far_view_rank": ("far_view_rank", 1),
    "far_view_observe": ("far_view_observe", 1),
}


@pytest.fixture(scope="module")
def calls():
    from bench.bench_eager import cases

    return cases("cpu")


@pytest.fixture
def counted(monkeypatch):
    """The signatures computed, in order (every module's ``sig``/``signature`` counts)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for cls in (JITFunction, InterpretedFunction):
        monkeypatch.setattr(cls, "run", lambda self, *args, **kwargs: None)
    real = _checks.signature
    made = []

    def counting(t):
        made.append(t)
        return real(t)

    for name, mod in list(sys.modules.items()):
        if name.startswith("kvops"):
            for attr in ("sig", "signature"):
                if getattr(mod, attr, None) is real:
                    monkeypatch.setattr(mod, attr, counting)
    return made


def tensor_arguments(op: str) -> int:
    schema = getattr(torch.ops.kvops, op).default._schema
    return sum("Tensor" in str(a.type) for a in schema.arguments)


@pytest.mark.parametrize("case", sorted(CALLS))
def test_an_eager_call_signs_each_argument_once(calls, counted, case):
    op, n = CALLS[case]
    call = calls[case][0]
    with kvops.backend("triton"):
        call()                       # the first call makes the checks' and the plan's entries
        counted.clear()
        call()
    assert len(counted) <= n * tensor_arguments(op), (
        f"{case}: {len(counted)} signatures for {n} call(s) of {tensor_arguments(op)} "
        "tensor arguments")
    if n == 1:        # the same signature again: recognized without computing one
        counted.clear()
        call()
        assert not counted, f"{case}: a repeated call signed {len(counted)} tensors"


def test_the_table_names_every_eager_case(calls):
    assert set(calls) == set(CALLS)


def test_checked_signatures_key_every_difference_and_check_each_signature_once():
    from kvops.ops._library import CheckedSignatures

    checked = []

    def check(a, b, x, y):
        checked.append((a.shape, None if b is None else b.dtype, x, y))
        return len(checked)

    sign = CheckedSignatures(check)
    a = torch.zeros(4, 8)
    b = torch.zeros(3, dtype=torch.int32)
    key, value = sign(a, b, 2.0, None)
    assert value == 1
    assert sign(torch.ones(4, 8), b.clone(), 2.0, None) == (key, 1)     # other tensors, same signature
    assert len(checked) == 1
    buf = torch.zeros(40)
    variants = [
        (torch.zeros(4, 9), b, 2.0, None),                    # shape
        (torch.zeros(8, 4).t(), b, 2.0, None),                # strides
        (torch.zeros(4, 8, dtype=torch.float64), b, 2.0, None),   # dtype
        (buf[1:33].view(4, 8), b, 2.0, None),                 # 4-byte offset: not 16-byte aligned
        (a, None, 2.0, None),                                 # an optional tensor left out
        (a, b, 3.0, None),                                    # another scalar
        (a, b, 2.0, 5),                                       # an optional scalar given
        (a.requires_grad_(False).unsqueeze(0)[0], b, 2.0, None),  # the same signature as a view
    ]
    keys = [sign(*args)[0] for args in variants]
    assert len(set(keys[:-1])) == len(keys) - 1 and key not in keys[:-1]
    assert keys[-1] == key
    assert len(checked) == len(variants)                      # the view matched: no check
    for args, k in zip(variants, keys):                       # each seen once: no check again
        assert sign(*args)[0] == k
    assert len(checked) == len(variants)


def test_a_failed_check_keeps_nothing():
    from kvops.ops._library import CheckedSignatures

    def check(a):
        if a.dim() != 2:
            raise ValueError("a: expected 2 dims")

    sign = CheckedSignatures(check)
    key, _ = sign(torch.zeros(2, 2))
    with pytest.raises(ValueError):
        sign(torch.zeros(2))
    with pytest.raises(ValueError):
        sign(torch.zeros(2))
    assert sign(torch.ones(2, 2))[0] == key


def test_the_cuda_host_path_runs_on_cpu_and_leaves_nothing_behind():
    """bench_eager's CPU mode: every call takes its CUDA host path to a faked C launch, and the
    plans, kept binaries and launch state made inside are gone afterwards."""
    from bench import bench_eager
    from kvops.kernels import _launch
    from kvops.kernels import static_sliding_attention as ssa

    ops_mod = sys.modules["kvops.ops.static_sliding_attention"]
    state, bins, plans, rule = dict(_launch._STATE), _launch._BINS, ssa._PLANS, ops_mod.use_triton
    with bench_eager.cuda_path_on_cpu():
        for op, _, _ in bench_eager.cases(torch.device("cpu")).values():
            for _ in range(3):       # the JIT, the conventions' probe, the C entry
                op()
        assert _launch._STATE["mode"] == "c" and ssa._PLANS
        fused = [p.fused for p in ssa._PLANS.values() if p.fused is not None]
        assert fused and all(f._c is not None for f in fused)
    assert (_launch._STATE, _launch._BINS, ssa._PLANS, ops_mod.use_triton) == (
        state, bins, plans, rule)
    headers, rows = bench_eager.cpu_rows()
    assert len(rows) == len(CALLS) and all(r[1] > 0 for r in rows)


def test_two_alternating_signatures_and_an_unaligned_call_sign_nothing_again(monkeypatch):
    """An engine writing the pool and then a transport arena alternates two signatures: after
    their first calls neither is signed again, and a call with an unaligned tensor between them
    (signed in full every time) evicts neither."""
    from kvops.ops import _library

    signed = []
    real = _library.sig
    monkeypatch.setattr(_library, "sig", lambda t: signed.append(t) or real(t))
    sign = _library.CheckedSignatures(lambda a, b: None)
    pool, arena = torch.zeros(8, 4), torch.zeros(2, 4)
    rows = torch.zeros(3)
    odd = torch.zeros(13)[1:4]                        # 4 bytes past an aligned start
    k_pool, k_arena = sign(pool, rows)[0], sign(arena, rows)[0]
    k_odd = sign(pool, odd)[0]
    signed.clear()
    for _ in range(3):
        assert sign(pool, rows)[0] == k_pool and sign(arena, rows)[0] == k_arena
    assert not signed
    assert sign(pool, odd)[0] == k_odd and len(signed) == 2      # unaligned: signed in full
    signed.clear()
    assert sign(arena, rows)[0] == k_arena and sign(pool, rows)[0] == k_pool
    assert not signed
