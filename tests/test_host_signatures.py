"""An eager op call computes each tensor argument's signature (``kvops._checks.signature``:
shape, strides, dtype, device, alignment; about 0.5 us of host time each) at most once: the
key its checks are cached by is the key its launch plan is kept by. The kernels' launches are
stubbed out; what is counted is the host path of the bench's eager calls (bench/bench_eager.py)."""

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


def test_the_table_names_every_eager_case(calls):
    assert set(calls) == set(CALLS)
