"""paged_kv_write: kernel and reference against a loop oracle (every slot of the pool compared,
-1 and out-of-range slots skipped, int32 and int64 slots, interleaved and padded page strides,
strided inputs), the launch rule's table, and the op contract (opcheck, compile without
recompiles and without a pool copy, CUDA graphs, input errors, validation mode)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvops
from kvops.kernels import paged_kv_write as kw
from kvops.kernels.paged_kv_write import paged_kv_write_fwd, write_tile
from kvops.ops.paged_kv_write import paged_kv_write_ref
from tests.conftest import LaunchSpy, capture_graph, counting_backend, requires_cuda
from tests.oracles_kv_rm import kv_write_oracle

LAYOUTS = ("contiguous", "interleaved", "padded")


def make_pool(P, S, Hkv, D, dtype, layout, device, gen):
    """(k_cache, v_cache, base): ``base`` is the whole allocation, so a test can check that
    nothing outside the two caches changed. interleaved: halves of [P, 2, S, Hkv, D];
    padded: each page followed by 8 spare values (an odd page stride in pages)."""
    page = S * Hkv * D
    if layout == "contiguous":
        base = torch.randn(2, P, S, Hkv, D, generator=gen).to(dtype)
        return base[0], base[1], base
    if layout == "interleaved":
        base = torch.randn(P, 2, S, Hkv, D, generator=gen).to(dtype)
        return base[:, 0], base[:, 1], base
    base = torch.randn(2, P, page + 8, generator=gen).to(dtype)
    view = lambda t: t[:, :page].unflatten(1, (S, Hkv, D))
    return view(base[0]), view(base[1]), base


def make_case(N, P, S, Hkv, D, dtype, slot_dtype, layout, strided_input, device, seed):
    """Distinct slots drawn from the pool, about a fifth of them -1 and two out of range
    (P * S and -5: written nowhere). strided_input: k, v are head slices of a fused
    [N, Hq + 2 Hkv, D] projection (head stride D, token stride (Hq + 2 Hkv) D) with an extra
    gap between heads (head stride 2 D) so the kernel moves one run a head."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, base = make_pool(P, S, Hkv, D, dtype, layout, device, gen)
    slots = torch.randperm(P * S, generator=gen)[:N]
    skip = torch.rand(N, generator=gen) < 0.2
    slots = torch.where(skip, -1, slots)
    if N >= 4:
        slots[1], slots[3] = P * S, -5
    if strided_input:
        fused = torch.randn(N, 3, Hkv, 2, D, generator=gen).to(dtype)
        k, v = fused[:, 1, :, 0], fused[:, 2, :, 1]
    else:
        k = torch.randn(N, Hkv, D, generator=gen).to(dtype)
        v = torch.randn(N, Hkv, D, generator=gen).to(dtype)
    return dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache,
                slot_mapping=slots.to(slot_dtype)), base


def to_device(case, base, device):
    """Move a case to ``device``: the caches stay views of one moved allocation, k and v keep
    their strides."""
    moved = base.to(device)
    out = {"slot_mapping": case["slot_mapping"].to(device)}
    for n in ("k_cache", "v_cache"):
        out[n] = _view_like(case[n], base, moved)
    for n in ("k", "v"):
        t = case[n]
        out[n] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        out[n].copy_(t)
    return out, moved


def check(case, before, got_k, got_v, base_before, base_after, name):
    want_k, want_v, _ = kv_write_oracle(case["k"], case["v"], before["k_cache"],
                                        before["v_cache"], case["slot_mapping"].cpu())
    assert torch.equal(got_k.double().cpu(), want_k), f"{name}: k_cache differs"
    assert torch.equal(got_v.double().cpu(), want_v), f"{name}: v_cache differs"
    # nothing outside the caches' elements changed (the other halves, the padding)
    mask = torch.ones(base_after.shape, dtype=torch.bool)
    for n in ("k_cache", "v_cache"):
        t = before[n]
        mask.view(-1).as_strided(t.shape, t.stride(), t.storage_offset() -
                                 base_before.storage_offset()).fill_(False)
    assert torch.equal(base_after.cpu()[mask], base_before[mask]), f"{name}: wrote outside"


shapes = st.tuples(
    st.integers(0, 24),                                   # N
    st.integers(1, 6),                                    # P
    st.sampled_from([8, 16, 64]),                         # S
    st.sampled_from([1, 2, 3, 8]),                        # Hkv
    st.sampled_from([16, 48, 64, 128, 256]),              # D (48: not a power of two)
    st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    st.sampled_from([torch.int32, torch.int64]),
    st.sampled_from(LAYOUTS),
    st.booleans(),                                        # strided input
    st.integers(0, 2**31 - 1),                            # seed
)


def _view_like(t, base_from, base_to):
    """The view of ``base_to`` that ``t`` is of ``base_from``."""
    return base_to.as_strided(t.shape, t.stride(), base_to.storage_offset() + t.storage_offset()
                              - base_from.storage_offset())


def _run(shape, device, fn):
    N, P, S, *rest, seed = shape
    N = min(N, P * S)
    case, base = make_case(N, P, S, *rest, device="cpu", seed=seed)
    base_before = base.clone()
    before = dict(case, k_cache=_view_like(case["k_cache"], base, base_before),
                  v_cache=_view_like(case["v_cache"], base, base_before))
    dev_case, moved = to_device(case, base, device)
    fn(**dev_case)
    check(case, before, dev_case["k_cache"], dev_case["v_cache"], base_before, moved,
          f"N{N}-P{P}-S{S}-" + "-".join(str(r) for r in rest))


@settings(max_examples=8)
@given(shape=shapes, block_t=st.sampled_from([None, 1, 4]))
def test_kernel_matches_oracle(kernel_device, shape, block_t):
    _run(shape, kernel_device, lambda **c: paged_kv_write_fwd(**c, block_t=block_t))


@pytest.mark.parametrize("strided", [False, True], ids=["flat", "per-head"])
def test_rows_cut_into_chunks(kernel_device, strided):
    """Runs longer than BLOCK_C (forced to 32 here) move in several chunks a token."""
    _run((9, 3, 8, 3, 48, torch.float16, torch.int32, "padded", strided, 7), kernel_device,
         lambda **c: paged_kv_write_fwd(**c, block_c=32))


@given(shape=shapes)
def test_reference_matches_oracle(shape):
    _run(shape, "cpu", paged_kv_write_ref)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_op_on_every_layout_and_slot_dtype(kernel_device, layout, slot_dtype):
    """The registered op, both backends: -1 and out-of-range slots skipped, interleaved pool."""
    for backend in ("triton", "torch"):
        with kvops.backend(backend):
            _run((24, 4, 8, 2, 64, torch.float16, slot_dtype, layout, False, 3), kernel_device,
                 torch.ops.kvops.paged_kv_write)


@pytest.mark.parametrize("N,row,parts,sms,want", [
    (128, 1024, 1, 132, (1, 1024, 4)),      # a decode step of Llama-3-8B: a token a program
    (8192, 1024, 1, 132, (4, 1024, 8)),     # a prefill: 4096-value tiles
    (1024, 1024, 1, 132, (2, 1024, 4)),     # 512 programs of 2 tokens fill 2 an SM
    (8192, 512, 1, 132, (8, 512, 8)),       # Qwen2.5-7B's 4 x 128
    (64, 2048, 1, 132, (1, 1024, 4)),       # rows past MAX_BLOCK_C: two chunks
    (4096, 96, 1, 132, (8, 128, 4)),        # one head of D 96: 512 programs
    (4096, 64, 8, 132, (64, 64, 8)),        # strided heads: eight runs of 64
    (0, 1024, 1, 4, (1, 1024, 4)),
    (40, 128, 2, 4, (8, 128, 4)),           # the interpreter's 4 SMs
])
def test_write_tile_table(N, row, parts, sms, want):
    assert write_tile(N, row, parts, sms) == want


def test_flat_rows_when_inputs_are_contiguous(kernel_device, monkeypatch):
    """Contiguous heads move as one run a token; a head stride other than D, a run a head."""
    spy = LaunchSpy(kw._paged_kv_write_kernel)
    monkeypatch.setattr(kw, "_paged_kv_write_kernel", spy)
    for strided in (False, True):
        case, base = make_case(8, 2, 8, 2, 32, torch.float16, torch.int32, "contiguous",
                               strided, "cpu", seed=1)
        paged_kv_write_fwd(**to_device(case, base, kernel_device)[0])
    (g0, k0), (g1, k1) = spy.launches
    assert (k0["ROW"], k0["PARTS"]) == (64, 1)
    assert (k1["ROW"], k1["PARTS"]) == (32, 2)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_write(kernel_device, backend):
    k = torch.zeros(0, 2, 16, device=kernel_device).half()
    cache = torch.randn(2, 8, 2, 16, device=kernel_device).half()
    before = cache.clone()
    with kvops.backend(backend):
        torch.ops.kvops.paged_kv_write(k, k, cache, cache,
                                       torch.zeros(0, dtype=torch.int32, device=kernel_device))
    assert torch.equal(cache, before)


def test_opcheck():
    for slot_dtype in (torch.int32, torch.int64):
        case, _ = make_case(12, 3, 8, 2, 32, torch.float16, slot_dtype, "contiguous", False,
                            "cpu", seed=4)
        case["slot_mapping"] = torch.where(case["slot_mapping"] >= 24, -1, case["slot_mapping"])
        torch.library.opcheck(torch.ops.kvops.paged_kv_write.default, (), case)


def _allocations(code: str) -> list[int]:
    """Element counts of every buffer the generated code allocates."""
    sizes = []
    for m in re.finditer(r"empty_strided_\w+\(\(([^)]*)\)", code):
        dims = [int(x) for x in m.group(1).split(",") if x.strip()]
        n = 1
        for d in dims:
            n *= d
        sizes.append(n)
    return sizes


def _no_pool_copy(codes, pool_elems):
    code = "\n".join(codes)
    assert "paged_kv_write" in code
    assert max(_allocations(code), default=0) < pool_elems, "compiled step allocates a pool"
    assert ".copy_(" not in code and "clone" not in code, "compiled step copies a buffer"


def test_compiled_step_never_recompiles_and_never_copies_the_pool():
    """20 steps with new slots and values (int64 and int32 slots, -1 rows): one compile, the
    pool mutated in place through both interleaved halves, and the generated code allocates
    nothing of the pool's size and copies no buffer (the trap ``index_copy_`` falls into when
    a functionalized mutation is not reinplaced)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    backend, calls = counting_backend()
    P, S, Hkv, D = 16, 8, 2, 32
    kv = torch.zeros(P, 2, S, Hkv, D, dtype=torch.float16)

    @torch.compile(backend=backend, fullgraph=True)
    def step(x, kv, slots):
        k, v = x * 2, x + 1
        torch.ops.kvops.paged_kv_write(k, v, kv[:, 0], kv[:, 1], slots)
        return k.float().sum()

    gen = torch.Generator().manual_seed(0)
    codes = None
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(20):
            x = torch.randn(6, Hkv, D, generator=gen).half()
            slots = torch.randperm(P * S, generator=gen)[:6]
            slots[t % 6] = -1
            want = kv.clone()
            paged_kv_write_ref(x * 2, x + 1, want[:, 0], want[:, 1], slots)
            if codes is None:
                _, codes = run_and_get_code(step, x, kv, slots)
            else:
                step(x, kv, slots)
            assert torch.equal(kv, want), t
    assert len(calls) == 1
    _no_pool_copy(codes, P * S * Hkv * D)


def test_compiled_module_writes_its_own_buffers_in_place():
    """Caches held as module buffers (how transformers-style models keep them), int32 slots:
    written in place, no pool-sized allocation or copy in the compiled code. A control step
    that writes out of place (``index_copy``) is seen to allocate a pool: the check can fail."""
    from torch._inductor.utils import run_and_get_code

    P, S, Hkv, D = 16, 8, 2, 32

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k_cache", torch.zeros(P, S, Hkv, D))
            self.register_buffer("v_cache", torch.zeros(P, S, Hkv, D))

        def forward(self, x, slots):
            torch.ops.kvops.paged_kv_write(x, -x, self.k_cache, self.v_cache, slots)
            return x.sum()

    torch._dynamo.reset()
    layer = Layer()
    step = torch.compile(layer, fullgraph=True)
    x = torch.randn(5, Hkv, D)
    slots = torch.tensor([3, -1, 40, 127, 64], dtype=torch.int32)
    _, codes = run_and_get_code(step, x, slots)
    flat = layer.k_cache.view(-1, Hkv, D)
    assert torch.equal(flat[[3, 40, 127, 64]], x[[0, 2, 3, 4]])
    assert torch.equal(layer.v_cache.view(-1, Hkv, D)[40], -x[2])
    _no_pool_copy(codes, P * S * Hkv * D)

    @torch.compile(fullgraph=True)
    def control(x, k_cache, slots):          # an out-of-place write: a new pool every step
        return k_cache.view(-1, Hkv, D).index_copy(0, slots.long(), x)

    torch._dynamo.reset()
    _, control_codes = run_and_get_code(control, x, layer.k_cache.clone(), slots.clamp_min(0))
    with pytest.raises(AssertionError, match="allocates a pool"):
        _no_pool_copy(control_codes + ["paged_kv_write"], P * S * Hkv * D)


@requires_cuda
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_cuda_graph_replay_with_new_slots(slot_dtype):
    """One captured write, replayed with new tokens and slots (-1 rows included) in place."""
    P, S, Hkv, D, N = 64, 16, 8, 128, 128
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(P, 2, S, Hkv, D, generator=gen).half().cuda()
    k = torch.empty(N, Hkv, D, dtype=torch.float16, device="cuda")
    v = torch.empty_like(k)
    slots = torch.full((N,), -1, dtype=slot_dtype, device="cuda")
    graph, _ = capture_graph(lambda: torch.ops.kvops.paged_kv_write(k, v, kv[:, 0], kv[:, 1],
                                                                    slots))
    for t in range(3):
        new_k, new_v = (torch.randn(N, Hkv, D, generator=gen).half() for _ in range(2))
        new_slots = torch.randperm(P * S, generator=gen)[:N]
        new_slots[:: 7] = -1
        want = kv.cpu()
        paged_kv_write_ref(new_k, new_v, want[:, 0], want[:, 1], new_slots)
        k.copy_(new_k)
        v.copy_(new_v)
        slots.copy_(new_slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kv.cpu(), want), t


@requires_cuda
def test_large_pool_offsets_do_not_overflow():
    """A pool of more than 2**31 elements: slot and page offsets are 64-bit."""
    S, Hkv, D = 16, 8, 128
    P = 2**31 // (S * Hkv * D) + 8
    cache = torch.zeros((P, S, Hkv, D), dtype=torch.float16, device="cuda")
    k = torch.randn(3, Hkv, D, dtype=torch.float16, device="cuda")
    slots = torch.tensor([P * S - 1, (P - 4) * S + 3, 5], dtype=torch.int64, device="cuda")
    torch.ops.kvops.paged_kv_write(k, k, cache, cache, slots)
    assert torch.equal(cache[P - 1, S - 1], k[0]) and torch.equal(cache[P - 4, 3], k[1])
    assert torch.equal(cache[0, 5], k[2])


def _bad_inputs():
    ok, _ = make_case(6, 3, 8, 2, 32, torch.float16, torch.int32, "contiguous", False, "cpu",
                      seed=0)
    P = ok["k_cache"].shape[0]
    yield "k-rank", dict(ok, k=ok["k"][0]), ValueError, "k: expected rank 3"
    yield "k-dtype", dict(ok, k=ok["k"].float()), TypeError, "k: expected dtype torch.float16"
    yield "v-shape", dict(ok, v=ok["v"][:2]), ValueError, r"v: expected shape \[N=6, Hkv=2, D=32\]"
    yield "k-heads", dict(ok, k=ok["k"][:, :1]), ValueError, r"k: expected shape \[N, Hkv=2, D=32\]"
    yield "cache-dtype", dict(ok, v_cache=ok["v_cache"].float()), TypeError, "v_cache: expected"
    yield "page-size", dict(ok, k_cache=ok["k_cache"][:, :6], v_cache=ok["v_cache"][:, :6]), \
        ValueError, "S=6"
    yield "slot-dtype", dict(ok, slot_mapping=ok["slot_mapping"].short()), TypeError, \
        r"slot_mapping: expected dtype in \(int32, int64\)"
    yield "slot-shape", dict(ok, slot_mapping=ok["slot_mapping"][:5]), ValueError, \
        r"slot_mapping: expected shape \[N=6\]"
    yield "k-last-dim", dict(ok, k=torch.zeros(6, 2, 64).half()[:, :, ::2]), ValueError, \
        "k: expected the last dim"
    yield "cache-strided", dict(ok, k_cache=torch.zeros(P, 8, 4, 32).half()[:, :, :2]), \
        ValueError, "k_cache: expected contiguous pages"
    yield "device", dict(ok, slot_mapping=ok["slot_mapping"].to("meta")), ValueError, \
        "slot_mapping: expected a tensor on cpu"


@pytest.mark.parametrize("name,kwargs,exc,msg", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise(name, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        torch.ops.kvops.paged_kv_write(**kwargs)


def test_validation_mode_raises_on_out_of_range():
    case, _ = make_case(6, 3, 8, 2, 32, torch.float16, torch.int64, "contiguous", False, "cpu",
                        seed=2)
    case["slot_mapping"] = torch.tensor([0, -1, 23, 5, -1, 7])
    with kvops.validate(True):
        torch.ops.kvops.paged_kv_write(**case)
    for bad in (24, -2):
        slots = case["slot_mapping"].clone()
        slots[2] = bad
        before = case["k_cache"].clone()
        with kvops.validate(True), pytest.raises(IndexError, match="slot_mapping"):
            torch.ops.kvops.paged_kv_write(**dict(case, slot_mapping=slots))
        assert torch.equal(case["k_cache"], before)        # refused before any write
