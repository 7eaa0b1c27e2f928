"""paged_gather_merged: kernel and reference against a loop oracle, plus the op contract
(opcheck, compile without recompiles, CUDA graph replay with a new count, input errors,
validation mode)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvops
from kvops.kernels.paged_gather_merged import FUSE_MAX_TRAINS, paged_gather_merged_fwd
from kvops.layouts import arena_as_pages, plan_trains
from kvops.ops.paged_gather_merged import paged_gather_merged_ref
from tests.conftest import capture_graph, counting_backend, requires_cuda
from tests.oracles_kv_rm import gather_oracle

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=[FUSE_MAX_TRAINS, 0], ids=["one-launch", "two-launch"])
def launch(request):
    """Kernel keyword arguments for each way of finding a program's first train: the rows summed
    in every program (few trains) or the train-ends kernel and its search (many)."""
    return {"fuse_max_trains": request.param}


def random_trains(P, Q, gen, *, max_len=5, ignored=2):
    """Rows with disjoint destination ranges covering part of [0, Q), random (often overlapping)
    source runs, in random order; then ``ignored`` rows past the count that would overwrite
    everything if read. Returns (trains int32 [T, 3], num_trains)."""
    rows, q = [], 0
    while q < Q:
        n = int(torch.randint(1, max_len + 1, (1,), generator=gen))
        n = min(n, Q - q, P)
        if torch.rand((), generator=gen) < 0.7:
            rows.append([int(torch.randint(0, P - n + 1, (1,), generator=gen)), q, n])
        q += n
    rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
    num = len(rows)
    rows += [[0, 0, min(P, Q)]] * ignored
    return torch.tensor(rows, dtype=torch.int32).view(-1, 3), num


def make_case(P, Q, S, Hkv, D, dtype, device, seed, **kw):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(P, S, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(P, S, Hkv, D, generator=gen).to(dtype)
    trains, num = random_trains(P, Q, gen, **kw)
    return (k.to(device), v.to(device), trains.to(device),
            torch.tensor([num], dtype=torch.int32, device=device)), num


def poisoned(Q, S, Hkv, D, dtype, device):
    return (torch.full((Q, S, Hkv, D), float("nan"), dtype=dtype, device=device),
            torch.full((Q, S, Hkv, D), float("nan"), dtype=dtype, device=device))


def check(k_out, v_out, k, v, trains, num, name):
    """Written pages equal the oracle bit for bit; every other page still holds the poison."""
    k_in = torch.full(k_out.shape, float("nan"), dtype=torch.float64)
    k_want, v_want, written = gather_oracle(k.cpu(), v.cpu(), trains.cpu(), num, k_in, k_in)
    for got, want, label in ((k_out, k_want, "k_out"), (v_out, v_want, "v_out")):
        got = got.cpu().double()
        assert not got[written].isnan().any(), f"{name} {label}: a copied page has unwritten NaN"
        assert got[~written].isnan().all(), f"{name} {label}: a page outside every train changed"
        assert torch.equal(got[written], want[written]), f"{name} {label}: wrong bytes"


def case_id(P, Q, S, Hkv, D, dtype):
    return f"P{P}-Q{Q}-S{S}-Hkv{Hkv}-D{D}-{str(dtype).replace('torch.', '')}"


shapes = st.tuples(
    st.integers(1, 23),                    # P (pool pages)
    st.integers(1, 19),                    # Q (arena pages)
    st.sampled_from([8, 16, 64]),          # S
    st.sampled_from([1, 2, 3]),            # Hkv
    st.sampled_from([16, 48]),             # D
    st.sampled_from(DTYPES),
    st.integers(0, 2**16),                 # seed
)


@given(shapes)
def test_kernel_matches_oracle(kernel_device, launch, shape):
    P, Q, S, Hkv, D, dtype, seed = shape
    (k, v, trains, num_t), num = make_case(P, Q, S, Hkv, D, dtype, kernel_device, seed)
    k_out, v_out = poisoned(Q, S, Hkv, D, dtype, kernel_device)
    paged_gather_merged_fwd(k, v, trains, num_t, k_out, v_out, **launch)
    check(k_out, v_out, k, v, trains, num, case_id(P, Q, S, Hkv, D, dtype))


@given(shapes, st.integers(0, 4))
def test_reference_matches_oracle(shape, drop):
    """Also with num_trains below the planned count: later rows are ignored."""
    P, Q, S, Hkv, D, dtype, seed = shape
    (k, v, trains, _), num = make_case(P, Q, S, Hkv, D, dtype, "cpu", seed)
    num = max(0, num - drop)
    k_out, v_out = poisoned(Q, S, Hkv, D, dtype, "cpu")
    paged_gather_merged_ref(k, v, trains, torch.tensor([num], dtype=torch.int32), k_out, v_out)
    check(k_out, v_out, k, v, trains, num, case_id(P, Q, S, Hkv, D, dtype))


@pytest.mark.parametrize("layout", ["one-train", "one-page-trains", "mixed"])
def test_long_and_short_trains(kernel_device, launch, layout):
    """One train spanning the whole arena, one train per page, and both in one call."""
    P, Q, S, Hkv, D = 40, 30, 16, 2, 32
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(P, S, Hkv, D, generator=gen).half().to(kernel_device)
    v = torch.randn(P, S, Hkv, D, generator=gen).half().to(kernel_device)
    src = {"one-train": list(range(5, 35)),
           "one-page-trains": torch.randperm(P, generator=gen)[:Q].tolist(),
           "mixed": list(range(20)) + torch.randperm(20, generator=gen)[:10].add(20).tolist()}[layout]
    trains, _ = plan_trains(src, list(range(Q)), S * Hkv * D * 2, max_train_bytes=2**30)
    trains = trains.to(kernel_device)
    num = trains.shape[0]
    k_out, v_out = poisoned(Q, S, Hkv, D, torch.float16, kernel_device)
    paged_gather_merged_fwd(k, v, trains, torch.tensor([num], dtype=torch.int32,
                                                       device=kernel_device), k_out, v_out,
                            **launch)
    check(k_out, v_out, k, v, trains, num, layout)


@pytest.mark.parametrize("num", [1, 64, 65, 299, 300], ids=lambda n: f"num{n}")
def test_many_trains_search(kernel_device, launch, num):
    """300 rows (one-page trains, every fifth row moving nothing) under few programs: the search
    over the train ends takes more than one 64-wide round, and programs start mid-range."""
    n = torch.ones(300, dtype=torch.int64)
    n[::5] = 0
    gather_one_page_trains(kernel_device, n, num, seed=num, num_programs=7, block=32, **launch)


def test_train_ends_over_several_scan_chunks(kernel_device):
    """4,500 rows (more than the 4,096 the train-ends scan sums at once), with a run of 100 rows
    that move nothing: the scan carries across chunks and the search (three rounds) lands on
    the right train around the empty run."""
    n = torch.ones(4500, dtype=torch.int64)
    n[4000:4100] = 0
    gather_one_page_trains(kernel_device, n, 4500, seed=11, num_programs=13, fuse_max_trains=0)


def gather_one_page_trains(device, n, num, seed, **kw):
    """Row t moves ``n[t]`` (0 or 1) pages from a random distinct page to arena page t; the
    kernel runs the first ``num`` rows with knobs ``kw`` and is checked against the oracle."""
    T = n.numel()
    P, S, Hkv, D = T + 20, 8, 1, 16
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(P, S, Hkv, D, generator=gen).to(device)
    v = torch.randn(P, S, Hkv, D, generator=gen).to(device)
    trains = torch.stack([torch.randperm(P, generator=gen)[:T], torch.arange(T), n], 1).int()
    trains = trains.to(device)
    k_out, v_out = poisoned(T, S, Hkv, D, torch.float32, device)
    paged_gather_merged_fwd(k, v, trains, torch.tensor([num], dtype=torch.int32, device=device),
                            k_out, v_out, **kw)
    check(k_out, v_out, k, v, trains, num, f"T{T}-num{num}")


@pytest.mark.parametrize("num", [0, 1, 3, 7, 99], ids=lambda n: f"num{n}")
def test_num_trains_clamped_and_bad_rows_skipped(kernel_device, launch, num):
    """Counts beyond [0, T] clamp; rows outside the pool or arena, or with n < 1, copy nothing."""
    P, Q, S, Hkv, D = 10, 8, 8, 1, 16
    k = torch.randn(P, S, Hkv, D).to(kernel_device)
    v = torch.randn(P, S, Hkv, D).to(kernel_device)
    rows = [[0, 0, 2], [9, 2, 2], [3, 2, 0], [-1, 3, 1], [2, 7, 2], [1, 4, 1], [4, 5, 3]]
    trains = torch.tensor(rows, dtype=torch.int32, device=kernel_device)
    num_t = torch.tensor([num], dtype=torch.int32, device=kernel_device)
    for fn, label in ((lambda *a: paged_gather_merged_fwd(*a, **launch), "kernel"),
                      (paged_gather_merged_ref, "ref")):
        k_out, v_out = poisoned(Q, S, Hkv, D, torch.float32, kernel_device)
        fn(k, v, trains, num_t, k_out, v_out)
        check(k_out, v_out, k, v, trains, num, f"{label}-num{num}")


def test_arena_view_round_trip(kernel_device):
    """Gathering into a [B, N, Hkv, D] arena viewed as pages fills the dense window in place."""
    B, N, S, Hkv, D, P = 3, 24, 8, 2, 16, 12
    k = torch.randn(P, S, Hkv, D).to(kernel_device)
    v = torch.randn(P, S, Hkv, D).to(kernel_device)
    k_arena = torch.zeros(B, N, Hkv, D, device=kernel_device)
    v_arena = torch.zeros(B, N, Hkv, D, device=kernel_device)
    src = [7, 8, 9, 0, 1, 2, 11, 3, 5]
    trains, stats = plan_trains(src, list(range(9)), S * Hkv * D * 4)
    assert stats["groups"] == 5
    paged_gather_merged_fwd(k, v, trains.to(kernel_device),
                            torch.tensor([5], dtype=torch.int32, device=kernel_device),
                            arena_as_pages(k_arena, S), arena_as_pages(v_arena, S))
    want = k[src].reshape(B, N, Hkv, D)
    assert torch.equal(k_arena, want)
    assert torch.equal(v_arena, v[src].reshape(B, N, Hkv, D))


def test_op_dispatches_to_kernel_under_triton_backend(kernel_device):
    (k, v, trains, num_t), num = make_case(9, 7, 8, 2, 16, torch.bfloat16, kernel_device, 5)
    k_out, v_out = poisoned(7, 8, 2, 16, torch.bfloat16, kernel_device)
    with kvops.backend("triton"):
        assert torch.ops.kvops.paged_gather_merged(k, v, trains, num_t, k_out, v_out) is None
    check(k_out, v_out, k, v, trains, num, "op-triton")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    (k, v, trains, num_t), _ = make_case(11, 9, 8, 2, 16, torch.float32, device, 6)
    k_out = torch.zeros(9, 8, 2, 16, device=device)
    v_out = torch.zeros(9, 8, 2, 16, device=device)
    torch.library.opcheck(torch.ops.kvops.paged_gather_merged.default,
                          (k, v, trains, num_t, k_out, v_out))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_step_never_recompiles(device):
    """10 steps with new trains values and counts: one compile, zero recompiles."""
    torch._dynamo.reset()
    backend, calls = counting_backend()
    P, Q, S, Hkv, D = 16, 12, 8, 2, 16
    k, v = torch.randn(P, S, Hkv, D, device=device), torch.randn(P, S, Hkv, D, device=device)
    k_out = torch.zeros(Q, S, Hkv, D, device=device)
    v_out = torch.zeros(Q, S, Hkv, D, device=device)

    @torch.compile(backend=backend, fullgraph=True)
    def step(trains, num_t):
        torch.ops.kvops.paged_gather_merged(k, v, trains, num_t, k_out, v_out)
        return k_out.sum(dim=(1, 2, 3)) + v_out.sum(dim=(1, 2, 3))

    gen = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(10):
            trains, num = random_trains(P, Q, gen, ignored=0)
            trains = torch.cat([trains, torch.zeros(Q - trains.shape[0], 3, dtype=torch.int32)])
            k_want, v_want, _ = gather_oracle(k.cpu(), v.cpu(), trains, num, k_out.cpu(),
                                              v_out.cpu())
            got = step(trains.to(device), torch.tensor([num], dtype=torch.int32, device=device))
            torch.testing.assert_close(got.cpu(), (k_want.sum(dim=(1, 2, 3))
                                                   + v_want.sum(dim=(1, 2, 3))).float())
    assert len(calls) == 1


@requires_cuda
def test_cuda_graph_replay_with_new_count():
    """One capture, replayed with new trains and a new device-side count each time."""
    P, Q, S, Hkv, D = 300, 256, 16, 8, 128
    gen = torch.Generator().manual_seed(9)
    k = torch.randn(P, S, Hkv, D, generator=gen).half().cuda()
    v = torch.randn(P, S, Hkv, D, generator=gen).half().cuda()
    trains = torch.zeros(Q, 3, dtype=torch.int32, device="cuda")
    num_t = torch.zeros(1, dtype=torch.int32, device="cuda")
    k_out, v_out = poisoned(Q, S, Hkv, D, torch.float16, "cuda")
    graph, _ = capture_graph(
        lambda: torch.ops.kvops.paged_gather_merged(k, v, trains, num_t, k_out, v_out))
    for max_len in (1, 4, 64):
        new, num = random_trains(P, Q, gen, max_len=max_len, ignored=0)
        trains.zero_()
        trains[: new.shape[0]].copy_(new)
        num_t.fill_(num)
        k_out.fill_(float("nan"))
        v_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(k_out, v_out, k, v, trains, num, f"graph-max{max_len}")


@requires_cuda
def test_large_pool_offsets_do_not_overflow():
    """A pool with more than 2**31 elements per tensor: page offsets must be 64-bit."""
    S, Hkv, D = 16, 8, 128
    P = 2**31 // (S * Hkv * D) + 64                     # 4.3 GB per tensor in fp16
    k = torch.empty(P, S, Hkv, D, dtype=torch.float16, device="cuda")
    v = torch.empty_like(k)
    k[-40:].normal_()
    v[-40:].normal_()
    trains = torch.tensor([[P - 40, 0, 30], [P - 5, 30, 5]], dtype=torch.int32, device="cuda")
    num_t = torch.tensor([2], dtype=torch.int32, device="cuda")
    k_out, v_out = poisoned(35, S, Hkv, D, torch.float16, "cuda")
    torch.ops.kvops.paged_gather_merged(k, v, trains, num_t, k_out, v_out)
    assert torch.equal(k_out[:30], k[P - 40: P - 10]) and torch.equal(k_out[30:], k[P - 5:])
    assert torch.equal(v_out[:30], v[P - 40: P - 10]) and torch.equal(v_out[30:], v[P - 5:])


def _bad_inputs():
    (k, v, trains, num_t), _ = make_case(6, 5, 8, 2, 16, torch.float16, "cpu", 0)
    k_out, v_out = torch.zeros(5, 8, 2, 16).half(), torch.zeros(5, 8, 2, 16).half()
    ok = dict(k_cache=k, v_cache=v, trains=trains, num_trains=num_t, k_out=k_out, v_out=v_out)
    yield "cache-rank", dict(ok, k_cache=k[0]), ValueError, "k_cache: expected rank 4"
    yield "cache-dtype", dict(ok, k_cache=k.double(), v_cache=v.double()), TypeError, \
        "k_cache: expected dtype"
    yield "v-dtype", dict(ok, v_cache=v.float()), TypeError, "v_cache: expected dtype"
    yield "v-shape", dict(ok, v_cache=v[:3]), ValueError, "v_cache: expected shape"
    yield "page-size", dict(ok, k_cache=k[:, :6].contiguous(), v_cache=v[:, :6].contiguous()), \
        ValueError, "S=6"
    yield "head-dim", dict(ok, k_cache=torch.zeros(6, 8, 2, 20).half(),
                           v_cache=torch.zeros(6, 8, 2, 20).half()), ValueError, "D=20"
    yield "trains-dtype", dict(ok, trains=trains.long()), TypeError, "trains: expected dtype"
    yield "trains-shape", dict(ok, trains=trains[:, :2].contiguous()), ValueError, \
        "trains: expected shape"
    yield "num-shape", dict(ok, num_trains=torch.zeros(2, dtype=torch.int32)), ValueError, \
        "num_trains: expected shape"
    yield "num-dtype", dict(ok, num_trains=num_t.long()), TypeError, "num_trains: expected dtype"
    yield "out-dtype", dict(ok, k_out=k_out.float()), TypeError, "k_out: expected dtype"
    yield "out-shape", dict(ok, v_out=v_out[:4]), ValueError, "v_out: expected shape"
    yield "out-strided", dict(ok, k_out=torch.zeros(5, 8, 4, 16).half()[:, :, ::2]), ValueError, \
        r"k_out: expected contiguous pages \[S, Hkv, D\]"
    yield "cache-strided", dict(ok, v_cache=torch.zeros(6, 8, 4, 16).half()[:, :, :2]), ValueError, \
        r"v_cache: expected contiguous pages \[S, Hkv, D\]"
    yield "empty-pool", dict(ok, k_cache=k[:0], v_cache=v[:0]), ValueError, "P=0"


@pytest.mark.parametrize("name,kwargs,exc,msg", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise(name, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        torch.ops.kvops.paged_gather_merged(**kwargs)


@pytest.mark.parametrize("row,num,msg", [
    ([0, 0, 2], 4, "num_trains"),
    ([5, 0, 2], 1, "source end"),
    ([-1, 0, 1], 1, r"trains\[:, 0\] \(src_page\)"),
    ([0, 4, 2], 1, "destination end"),
    ([0, 0, 0], 1, "n_pages"),
], ids=["count", "src-end", "src-negative", "dst-end", "zero-pages"])
def test_validation_mode_raises_on_out_of_range(row, num, msg):
    k, v = torch.randn(6, 8, 1, 16), torch.randn(6, 8, 1, 16)
    k_out, v_out = torch.zeros(5, 8, 1, 16), torch.zeros(5, 8, 1, 16)
    trains = torch.tensor([row, [0, 0, 5]], dtype=torch.int32)
    num_t = torch.tensor([num], dtype=torch.int32)
    torch.ops.kvops.paged_gather_merged(k, v, trains, num_t, k_out, v_out)  # skipped silently
    with kvops.validate(True), pytest.raises(IndexError, match=msg):
        torch.ops.kvops.paged_gather_merged(k, v, trains, num_t, k_out, v_out)
    assert kvops.validate() is False


def test_validation_mode_rejects_overlapping_destinations():
    k, v = torch.randn(6, 8, 1, 16), torch.randn(6, 8, 1, 16)
    k_out, v_out = torch.zeros(5, 8, 1, 16), torch.zeros(5, 8, 1, 16)
    trains = torch.tensor([[0, 0, 3], [3, 2, 2]], dtype=torch.int32)
    with kvops.validate(True), pytest.raises(IndexError, match="destination ranges overlap"):
        torch.ops.kvops.paged_gather_merged(k, v, trains, torch.tensor([2], dtype=torch.int32),
                                            k_out, v_out)
    trains[1, 1] = 3
    with kvops.validate(True):
        torch.ops.kvops.paged_gather_merged(k, v, trains, torch.tensor([2], dtype=torch.int32),
                                            k_out, v_out)
    assert torch.equal(k_out, k[:5])
