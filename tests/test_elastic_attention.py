"""elastic_attention: kernel and reference against a float64 oracle on all three paths (native,
structured, general), random block tables with shared BASE pages, and the op contract (opcheck,
compile without recompiles, CUDA graphs, input errors, validation mode)."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

import kvops
from kvops.kernels import _splitk
from kvops.kernels import elastic_attention as ea
from kvops.kernels._common import device_props
from kvops.kernels.elastic_attention import (
    _float16_query,
    _planes,
    elastic_attention_fwd,
    native_dense_tile,
)
from kvops.layouts import codecs
from kvops.layouts.pairs import base_pair_view
from kvops.ops.elastic_attention import elastic_attention_ref, span_modes
from tests.conftest import (
    LaunchSpy,
    capture_graph,
    counting_backend,
    requires_cuda,
    two_launches,
)
from tests.oracles_elastic import block_mode_of, elastic_oracle, elastic_rows
from tests.tolerances import ATTN_TOL, LSE_TOL, assert_close

CPU_PROPS = device_props(torch.device("cpu"))   # the interpreter's 4 SMs

PATHS = ("native", "structured", "general")


def make_case(B, L, S, Hkv, G, D, dtype, path, device, seed, zero_row=False, pool_pages=None):
    """A paged pool and tables for one decode step.

    Pages are a random permutation (not arange). TARGET blocks own a page; BASE blocks are
    paired into shared pages the way pack_base_pairs leaves them: structured spans put blocks
    first+2i and first+2i+1 in halves 0 and 1 of one page, the general path pairs BASE blocks
    picked at random (across sequences too) and gives each its half. BASE bytes are encoded from
    fresh values, so they are what a pack would write. Lengths end mid-page; one row may be 0;
    table entries past a sequence's end are -1 and their modes garbage. ``pool_pages`` fixes
    the pool size (at least B * L + 2) so steps of a compiled or captured loop share shapes.
    """
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)
    seq_lens = torch.randint(0, L * S + 1, (B,), generator=gen, dtype=torch.int32)
    seq_lens[-1] = L * S - S // 2 - 1 if L * S > S // 2 + 1 else L * S     # ends mid-page
    if zero_row:
        seq_lens[0] = 0
    used = [(int(n) + S - 1) // S for n in seq_lens]
    modes = torch.zeros(B, L, dtype=torch.int8)
    span = torch.zeros(B, 2, dtype=torch.int32)
    groups = []                                     # lists of (b, j) sharing one page
    if path == "structured":
        for b in range(B):
            first = int(torch.randint(0, L + 1, (1,), generator=gen))
            end = int(torch.randint(first, L + 1, (1,), generator=gen))
            span[b] = torch.tensor([first, end])
            modes[b] = span_modes(span[b:b + 1], L)[0]
            for j in range(first, end, 2):
                groups.append([(b, jj) for jj in (j, j + 1) if jj < end])
    elif path == "general":
        base_blocks = [(b, j) for b in range(B) for j in range(L)
                       if torch.rand(1, generator=gen).item() < 0.5]
        order = torch.randperm(len(base_blocks), generator=gen).tolist()
        base_blocks = [base_blocks[i] for i in order]
        for i in range(0, len(base_blocks), 2):
            groups.append(base_blocks[i:i + 2])
    target = [(b, j) for b in range(B) for j in range(L) if modes[b, j] == 0 and
              not any((b, j) in g for g in groups)]
    P = pool_pages or len(target) + len(groups) + 2
    perm = torch.randperm(P, generator=gen).tolist()
    block_table = torch.full((B, L), -1, dtype=torch.int32)
    k_cache, v_cache = rnd(P, S, Hkv, D), rnd(P, S, Hkv, D)
    codec = codecs.default_codec(dtype) if dtype != torch.float32 else None
    for b, j in target:
        block_table[b, j] = perm.pop()
    for g in groups:
        page = perm.pop()
        halves = [0, 1] if len(g) == 2 or path == "structured" else \
            [int(torch.randint(0, 2, (1,), generator=gen))]
        for (b, j), h in zip(g, halves):
            block_table[b, j] = page
            if path == "general":
                modes[b, j] = 1 + h
            for cache in (k_cache, v_cache):
                base_pair_view(cache)[page, h] = codecs.encode(rnd(S, Hkv, D), codec)[0]
    for b in range(B):                              # past the end: nothing may be read
        block_table[b, used[b]:] = -1
        modes[b, used[b]:] = torch.randint(0, 3, (L - used[b],), generator=gen).to(torch.int8)
    q = rnd(B, Hkv * G, D)
    case = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                seq_lens=seq_lens)
    if path == "structured":
        case["base_span"] = span
    elif path == "general":
        case["block_mode"] = modes
    return {n: t.to(device) for n, t in case.items()}


def case_id(B, L, S, Hkv, G, D, dtype, path):
    return f"B{B}-L{L}-S{S}-Hkv{Hkv}-G{G}-D{D}-{str(dtype).replace('torch.', '')}-{path}"


def check_against_oracle(out, lse, case, name):
    dtype = case["q"].dtype
    want_out, want_lse = elastic_oracle(**case)
    atol, rtol = ATTN_TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == case["q"].shape and lse.shape == case["q"].shape[:2]
    assert_close("out", out, want_out, atol, rtol, name)
    assert_close("lse", lse, want_lse, LSE_TOL[dtype], LSE_TOL[dtype], name)


shapes = st.tuples(
    st.integers(1, 4),                                 # B
    st.integers(1, 5),                                 # L blocks per sequence
    st.sampled_from([8, 16, 32, 64]),                  # S (32: 64-row pair tiles at block_n 64)
    st.sampled_from([1, 2]),                           # Hkv
    st.sampled_from([1, 2, 4, 8]),                     # G
    st.sampled_from([16, 48, 64, 128, 256]),           # D (48: not a power of two)
    st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    st.sampled_from(PATHS),
    st.integers(0, 2**31 - 1),                         # seed
)


def _draw(shape):
    *dims, seed = shape
    if dims[6] == torch.float32:                       # BASE needs a 16-bit cache
        dims[7] = "native"
    return dims, seed


@given(shape=shapes, num_splits=st.sampled_from([None, 1, 3]),
       block_n=st.sampled_from([None, 16, 32, 64]))
def test_kernel_matches_oracle(kernel_device, poison, shape, num_splits, block_n):
    dims, seed = _draw(shape)
    case = make_case(*dims, device=kernel_device, seed=seed, zero_row=seed % 3 == 0)
    out, lse = elastic_attention_fwd(**case, num_splits=num_splits, block_n=block_n)
    check_against_oracle(out, lse, case, case_id(*dims) + f"-splits{num_splits}-bn{block_n}")


@pytest.mark.parametrize("B,splits,forced", [(2, 1, False), (1, 2, False), (2, 2, True)])
@pytest.mark.parametrize("S", [16, 64, 128])
def test_native_dense_shape_matches_oracle(kernel_device, S, B, splits, forced, monkeypatch):
    """The native path's dense launch shape (``native_dense_tile``: 128-row tiles, 4 warps,
    ``DENSE_STAGES``, unsplit or in two splits) against the oracle: a page id a row at S 16, two
    one-page halves a tile at S 64, one page a tile at S 128; sequences ending mid-tile and, with
    two sequences, one of length 0 (a split of it sees nothing). On the interpreter's 4 SMs,
    4 (sequence, KV head) programs fill one wave, so the launcher picks the shape itself (2
    sequences unsplit, 1 in two splits); on a GPU, and for 2 sequences in two splits, it is
    forced. A split launch's first eager call also runs the two-launch form."""
    dims = (B, 768 // S, S, 2, 4, 128, torch.float16, "native")
    case = make_case(*dims, device=kernel_device, seed=S, zero_row=B > 1)
    spy = LaunchSpy(ea._elastic_decode_kernel)
    monkeypatch.setattr(ea, "_elastic_decode_kernel", spy)
    knobs = ({} if kernel_device.type == "cpu" and not forced else
             dict(block_n=128, num_warps=4, num_splits=splits, num_stages=ea.DENSE_STAGES))
    out, lse = elastic_attention_fwd(**case, **knobs)
    check_against_oracle(out, lse, case, case_id(*dims) + f"-dense-splits{splits}")
    assert len(spy.launches) == (1 if splits == 1 else 2)
    grid, kwargs = spy.launches[-1]
    assert grid == (2 * B, splits)
    assert (kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]) == (128, 4, 5)


@pytest.mark.parametrize("pairs,G,D,dtype,want", [
    (4, 4, 128, torch.float16, (128, 1)),             # one full wave of the 4 SMs
    (4, 16, 96, torch.bfloat16, (128, 1)),            # D 65-128 pad to 128-row tiles
    (2, 4, 128, torch.float16, (128, 2)),             # two splits fill the wave
    (3, 4, 128, torch.float16, None),                 # 75 % of a wave
    (5, 4, 128, torch.float16, None),                 # more than one wave
    (4, 32, 128, torch.float16, None),                # query groups over 16 heads
    (4, 4, 64, torch.float16, None),                  # 32 KiB tiles: never measured
    (4, 4, 256, torch.float16, None),                 # 64-row tiles: never measured
    (4, 4, 128, torch.float32, None),                 # float32: never measured
])
def test_native_dense_shape_only_where_it_was_measured_to_win(pairs, G, D, dtype, want):
    """``native_dense_tile`` on the interpreter's 4 SMs (``sm_count``)."""
    assert native_dense_tile(pairs, G, D, dtype.itemsize, CPU_PROPS, 1024) == want


@requires_cuda
def test_max_shared_memory_reads_the_device():
    """torch reports the shared memory a program may use (without it ``native_dense_tile``
    would never take the dense shape): at least the 48 KiB every CUDA GPU allows, and on a
    Hopper-class GPU enough for that shape."""
    dev = torch.device("cuda")
    smem = device_props(dev).smem
    assert smem >= 48 * 1024
    if torch.cuda.get_device_capability() in ((9, 0), (10, 0)):
        assert smem >= ea.DENSE_SMEM


def test_native_dense_shape_needs_a_hopper_class_shared_memory(monkeypatch):
    """A GPU that lets a program use less than ``DENSE_SMEM`` (A100: 163 KiB, Ada: 99 KiB)
    keeps the split programs, whose stages fit there."""
    assert native_dense_tile(4, 4, 128, 2, CPU_PROPS._replace(smem=163 * 1024)) is None


@given(shape=shapes)
def test_reference_matches_oracle(shape):
    dims, seed = _draw(shape)
    case = make_case(*dims, device="cpu", seed=seed, zero_row=seed % 2 == 0)
    out, lse = elastic_attention_ref(**case)
    check_against_oracle(out, lse, case, case_id(*dims))


@pytest.mark.parametrize("S", [8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("long_split", [None, 1], ids=["default", "weighted"])
def test_structured_and_general_agree_bit_for_bit(kernel_device, S, dtype, long_split,
                                                  monkeypatch):
    """Same layout, both mixed paths: the same runs and split edges, so bit-identical results
    (``weighted``: every split edge cut at equal cost, ``weighted_from``)."""
    if long_split is not None:
        monkeypatch.setattr(ea, "LONG_SPLIT", long_split)
    case = make_case(3, 6, S, 2, 4, 64, dtype, "structured", kernel_device, seed=S)
    span = case.pop("base_span")
    for num_splits in (1, 3):
        a = elastic_attention_fwd(**case, base_span=span, num_splits=num_splits)
        b = elastic_attention_fwd(**case, block_mode=span_modes(span, 6), num_splits=num_splits)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("weighted", [None, 1024, 64], ids=["equal-rows", "weighted",
                                                         "weighted-64-modes-a-load"])
def test_general_path_scans_long_mode_tables(kernel_device, weighted, monkeypatch):
    """Runs longer than one 128-mode scan load, run edges at and around its bounds, and one
    edge two loads into a run (2, 258): the general path cuts the same runs as the structured
    one (bit for bit) on 300-block tables. ``weighted``: split edges at equal cost, cut from
    ``weighted`` modes a load on the general path (64: five loads a scan; patched on the
    interpreter only, since compiled kernels keep their constants)."""
    if weighted is not None:
        monkeypatch.setattr(ea, "LONG_SPLIT", 1)
        if weighted != ea.MODE_CHUNK:
            if kernel_device.type != "cpu":
                pytest.skip("module constants are patched on the interpreter only")
            monkeypatch.setattr(ea, "MODE_CHUNK", tl.constexpr(weighted))
    case = make_case(6, 300, 8, 1, 2, 32, torch.float16, "structured", kernel_device, seed=3,
                     pool_pages=6 * 300 + 2)
    case["seq_lens"].fill_(300 * 8 - 3)
    gen = torch.Generator().manual_seed(3)
    P = case["k_cache"].shape[0]
    case["block_table"] = torch.randperm(P, generator=gen)[:6 * 300].view(6, 300).int().to(
        kernel_device)                        # every block mapped
    for name in ("k_cache", "v_cache"):      # bytes < 0x40: finite read as TARGET or as BASE
        c = case[name].view(torch.uint8)
        c.copy_(torch.randint(0, 0x40, c.shape, generator=gen, dtype=torch.uint8))
    spans = [(1, 299), (130, 270), (0, 300), (127, 129), (128, 256), (2, 258)]
    span = torch.tensor(spans, dtype=torch.int32, device=kernel_device)
    for num_splits in (1, 3):
        a = elastic_attention_fwd(**case | {"base_span": span}, num_splits=num_splits)
        b = elastic_attention_fwd(**case | {"base_span": None,
                                            "block_mode": span_modes(span, 300)},
                                  num_splits=num_splits)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), num_splits


def split_edges(n, is_base, S, nsp, block_n, weighted):
    """Split edges of a mixed-path launch, by brute force from the rule: equal rows (``lo = i *
    chunk``, ``chunk`` the per-split rows rounded up to ``block_n``), or, ``weighted``, the last
    multiple of ``lcm(block_n, S)`` whose rows cost at most ``i / nsp`` of all rows (TARGET row
    5, BASE row 4); the last split ends at ``n``."""
    if not weighted:
        per_split = -(-n // nsp)
        chunk = -(-per_split // block_n) * block_n
        return [min(i * chunk, n) for i in range(nsp)] + [n]
    unit = math.lcm(block_n, S)
    cost = [0]
    for x in range(n):
        cost.append(cost[-1] + (4 if is_base(x // S) else 5))
    return [max(x for x in range(0, n + 1, unit) if cost[x] * nsp <= i * cost[n])
            for i in range(nsp)] + [n]


@pytest.mark.parametrize("long_split", [1, 24, 10 ** 6], ids=["weighted", "mixed", "equal-rows"])
@pytest.mark.parametrize("path", ["structured", "general"])
@pytest.mark.parametrize("S", [16, 64])
def test_mixed_split_edges(kernel_device, path, S, long_split, monkeypatch):
    """Each split's partial lse (caught on its way to the merge) is the oracle's over the rows
    ``split_edges`` gives it: weighted edges where a sequence has at least ``nsp * LONG_SPLIT``
    rows, equal rows below (``mixed``: both within one launch), over random layouts and lengths
    ending mid-page, one sequence empty."""
    monkeypatch.setattr(ea, "LONG_SPLIT", long_split)
    nsp, B = 4, 4
    case = make_case(B, 24, S, 2, 2, 64, torch.float16, path, kernel_device, seed=S + len(path),
                     zero_row=True)
    case["seq_lens"][1] = min(int(case["seq_lens"][1]), nsp * 24 - 1)   # equal rows at "mixed"
    case["seq_lens"][2] = nsp * 24                                       # weighted from here
    caught = []
    merge = _splitk.merge_split_outputs
    two_launches(ea, monkeypatch)                   # the merge kernel sees the partials
    monkeypatch.setattr(_splitk, "merge_split_outputs", lambda plan, part_o, part_l, *a: (
        caught.append(part_l.clone()), merge(plan, part_o, part_l, *a)))
    elastic_attention_fwd(**case, num_splits=nsp)
    part_l = caught[0].view(B, 4, nsp).double().cpu()
    cpu = {name: t.cpu() for name, t in case.items()}
    weighted_rows = set()
    for b in range(B):
        n = int(cpu["seq_lens"][b])
        modes = {j: block_mode_of(j, b, cpu.get("block_mode"), cpu.get("base_span"))
                 for j in range(24)}
        weighted = n >= nsp * long_split
        edges = split_edges(n, lambda j, m=modes: m[j] != 0, S, nsp, ea.BLOCK_N_MIXED,
                            weighted)
        if n:
            weighted_rows.add(weighted)
        k, _ = elastic_rows(b, *(cpu[name] for name in ("k_cache", "v_cache", "block_table",
                                                         "seq_lens")),
                            cpu.get("block_mode"), cpu.get("base_span"))
        for h in range(4):
            s = (k[:, h // 2] @ cpu["q"][b, h].double()) * 64 ** -0.5
            want = torch.stack([torch.logsumexp(s[lo:hi], 0) for lo, hi in
                                zip(edges[:-1], edges[1:])])
            assert_close("split lse", part_l[b, h], want, LSE_TOL[torch.float16],
                         LSE_TOL[torch.float16], f"{path}-S{S}-b{b}-h{h}-edges{edges}")
    assert weighted_rows == ({True} if long_split == 1 else {False} if long_split > 10 ** 5
                             else {True, False})


def test_weighted_from_only_for_split_mixed_launches():
    """Weighted split edges are a mixed-path rule for split launches, from LONG_SPLIT rows a
    split, and for at most WEIGHTED_MAX_SPLITS splits (the int32 edge arithmetic)."""
    assert ea.weighted_from(1, 4) == ea.weighted_from(2, 4) == 4 * ea.LONG_SPLIT
    assert ea.weighted_from(2, ea.WEIGHTED_MAX_SPLITS) == ea.WEIGHTED_MAX_SPLITS * ea.LONG_SPLIT
    assert ea.weighted_from(0, 4) == ea.weighted_from(1, 1) == ea.NO_WEIGHTS
    assert ea.weighted_from(1, ea.WEIGHTED_MAX_SPLITS + 1) == ea.NO_WEIGHTS


@triton.jit
def _split_edges_kernel(Mode, Span, N, Out, L, NUM_SPLITS, MODE: tl.constexpr, S: tl.constexpr,
                        UNIT: tl.constexpr, CHUNK: tl.constexpr):
    """``_weighted_split`` alone: program (b, i) writes split i's ``[lo, hi)`` of row b."""
    b = tl.program_id(0)
    i_s = tl.program_id(1)
    lo, hi = ea._weighted_split(Mode + b * L, tl.load(Span + 2 * b), tl.load(Span + 2 * b + 1),
                                tl.load(N + b), i_s, NUM_SPLITS, MODE, S, ea.SPLIT_WT,
                                ea.SPLIT_WB, UNIT, CHUNK)
    tl.store(Out + (b * NUM_SPLITS + i_s) * 2, lo)
    tl.store(Out + (b * NUM_SPLITS + i_s) * 2 + 1, hi)


@pytest.mark.parametrize("S", [8, 16, 64, 128])
@pytest.mark.parametrize("nsp", [2, 3, 7])
def test_weighted_edges_against_brute_force(kernel_device, S, nsp):
    """Both mixed paths' weighted edges, split by split, against ``split_edges``: ties (all
    TARGET and all BASE at multiples of ``nsp * UNIT``), partial last blocks in and out of the
    span, spans ending at the sequence's end, empty spans, sequences under one UNIT, and two
    mode scan loads (CHUNK 4 on the interpreter) on 60-block tables."""
    unit, L = math.lcm(ea.BLOCK_N_MIXED, S), 60
    n_max = L * S
    rows = [(k * nsp * unit, 0, 0) for k in (1, 2)] + [(k * nsp * unit, 0, L) for k in (1, 2)]
    rows += [(n_max - S // 2 - 1, 3, L), (n_max - S // 2 - 1, 3, 40), (n_max - 1, 0, L),
             (unit - 1, 0, 1), (5 * S + 1, 2, 6), (n_max, 13, 29), (n_max, 1, 59)]
    gen = torch.Generator().manual_seed(S * nsp)
    rows += [(int(torch.randint(1, n_max + 1, (1,), generator=gen)),) + tuple(
        sorted(torch.randint(0, L + 1, (2,), generator=gen).tolist())) for _ in range(6)]
    n = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    spans = torch.tensor([r[1:] for r in rows], dtype=torch.int32)
    kernel_span = torch.where((spans[:, :1] == spans[:, 1:]), L, spans)   # the kernel's empty span
    modes = span_modes(spans, L)
    chunk = 4 if kernel_device.type == "cpu" else 1024
    for mode in (1, 2):
        out = torch.empty(len(rows), nsp, 2, dtype=torch.int32, device=kernel_device)
        _split_edges_kernel[(len(rows), nsp)](
            modes.to(kernel_device), kernel_span.to(kernel_device), n.to(kernel_device), out, L,
            nsp, MODE=mode, S=S, UNIT=unit, CHUNK=chunk)
        for b, (nb, first, end) in enumerate(rows):
            want = split_edges(nb, lambda j, f=first, e=end: f <= j < e, S, nsp,
                               ea.BLOCK_N_MIXED, True)
            got = out[b].cpu()
            assert got[:, 0].tolist() == want[:-1] and got[:, 1].tolist() == want[1:], (
                mode, rows[b], got.tolist(), want)


@pytest.mark.parametrize("path", PATHS)
def test_empty_sequences_give_zero_and_neg_inf(kernel_device, poison, path):
    case = make_case(3, 4, 16, 2, 4, 64, torch.float16, path, kernel_device, seed=7)
    case["seq_lens"].zero_()
    for num_splits in (1, 4):
        out, lse = elastic_attention_fwd(**case, num_splits=num_splits)
        assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))
        assert torch.isneginf(lse).all()


@pytest.mark.parametrize("path", PATHS)
def test_table_entries_past_the_end_may_hold_anything(path):
    """Entries past a sequence's end are never read: the reference gives the same numbers with
    -1 there as with page ids past the pool."""
    case = make_case(3, 4, 16, 2, 4, 32, torch.float16, path, "cpu", seed=11)
    want = torch.ops.kvops.elastic_attention(**case)
    S, P = case["k_cache"].shape[1], case["k_cache"].shape[0]
    used = (case["seq_lens"].long() + S - 1) // S
    past = torch.arange(case["block_table"].shape[1])[None, :] >= used[:, None]
    case["block_table"] = torch.where(past, P + 7, case["block_table"]).to(torch.int32)
    got = torch.ops.kvops.elastic_attention(**case)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("path", PATHS)
def test_trimmed_blocks_inside_the_sequence_are_never_read(kernel_device, path):
    """A -1 block inside ``seq_lens`` (a trimmed block) contributes nothing, on the kernel and
    the reference: the pool sits one NaN page past the start of its allocation, so a read of
    page -1 would reach it, and a page no table entry names is NaN for the reference."""
    case = make_case(3, 4, 16, 2, 4, 32, torch.float16, path, "cpu", seed=5)
    S = case["k_cache"].shape[1]
    lens = case["seq_lens"].long()
    rows = [b for b in range(3) if int(lens[b]) > S]            # rows with a block 0 to trim
    assert rows
    table = case["block_table"].clone()
    for b in rows:
        table[b, 0] = -1
    def padded(c):                                  # [1 + P, S, Hkv, D], row 0 NaN
        return torch.cat([torch.full_like(c[:1], float("nan")), c]).to(kernel_device)
    kc, vc = padded(case["k_cache"]), padded(case["v_cache"])
    mv = lambda t: None if t is None else t.to(kernel_device)
    args = dict(q=case["q"].to(kernel_device), k_cache=kc[1:], v_cache=vc[1:],
                block_table=table.to(kernel_device), seq_lens=case["seq_lens"].to(kernel_device),
                block_mode=mv(case.get("block_mode")), base_span=mv(case.get("base_span")))
    used = set(table[table >= 0].tolist())
    free = [p for p in range(case["k_cache"].shape[0]) if p not in used]
    got_out, got_lse = elastic_attention_fwd(**args)
    assert torch.isfinite(got_out).all() and torch.isfinite(got_lse[lens > 0]).all()
    if free:                                        # an unread page may hold anything
        kc[1 + free[0]] = float("nan")
    want_out, want_lse = elastic_attention_ref(**{k: (v.cpu() if torch.is_tensor(v) else v)
                                                  for k, v in args.items()})
    assert torch.isfinite(want_out).all()
    torch.testing.assert_close(got_out.float().cpu(), want_out.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_lse.cpu(), want_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("B,L", [(0, 3), (2, 0)], ids=["B0", "L0"])
def test_degenerate_shapes(kernel_device, backend, B, L):
    """No sequences, or a table with no blocks (seq_lens clamp to 0): empty or zero / -inf."""
    q = torch.randn(B, 4, 32, device=kernel_device).half()
    k = torch.randn(5, 8, 2, 32, device=kernel_device).half()
    table = torch.zeros(B, L, dtype=torch.int32, device=kernel_device)
    seq = torch.ones(B, dtype=torch.int32, device=kernel_device)
    modes = torch.zeros(B, L, dtype=torch.int8, device=kernel_device)
    with kvops.backend(backend):
        for kw in ({}, {"block_mode": modes}):
            out, lse = torch.ops.kvops.elastic_attention(q, k, k, table, seq, **kw)
            assert out.shape == (B, 4, 32) and lse.shape == (B, 4)
            assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


def test_pack_then_attend_reads_the_packed_halves(kernel_device):
    """pack_base_pairs then elastic_attention on the packed page equals attention over the
    decoded BASE values placed as TARGET: the two ops agree on the pair layout."""
    S, Hkv, D = 16, 2, 64
    for dtype in (torch.float16, torch.bfloat16):
        gen = torch.Generator().manual_seed(8)
        k = torch.randn(4, S, Hkv, D, generator=gen).to(dtype).to(kernel_device)
        v = torch.randn(4, S, Hkv, D, generator=gen).to(dtype).to(kernel_device)
        q = torch.randn(1, 4 * Hkv, D, generator=gen).to(dtype).to(kernel_device)
        dense_k, dense_v = k.clone(), v.clone()
        for c in (dense_k, dense_v):
            c[1:3] = codecs.decode(codecs.encode(c[1:3].cpu(), codecs.default_codec(dtype))[0],
                                   dtype).to(kernel_device)
        pairs = torch.tensor([[1, 2, 1]], dtype=torch.int32, device=kernel_device)
        codec = codecs.default_codec(dtype)
        with kvops.backend("triton"):
            for c in (k, v):
                back = torch.empty((1, 2, S, Hkv, D), dtype=codecs.backing_dtype(codec, dtype),
                                   device=kernel_device)
                torch.ops.kvops.pack_base_pairs(c, pairs, back)
            seq = torch.tensor([3 * S + 5], dtype=torch.int32, device=kernel_device)
            table = torch.tensor([[0, 1, 1, 3]], dtype=torch.int32, device=kernel_device)
            span = torch.tensor([[1, 3]], dtype=torch.int32, device=kernel_device)
            got = torch.ops.kvops.elastic_attention(q, k, v, table, seq, base_span=span)
            want = torch.ops.kvops.elastic_attention(
                q, dense_k, dense_v, torch.tensor([[0, 1, 2, 3]], dtype=torch.int32,
                                                  device=kernel_device), seq)
        # same values, different tiles (the mixed path starts a tile at each run of one form,
        # and tiles are 32 rows there, 16 on the native path). The probabilities are rounded to
        # the cache dtype before the P @ V product, relative to each tile's running max, so the
        # tiling moves that rounding: up to ~2^-9 of |V| in bfloat16 (2^-12 in float16), seen
        # as 1e-3 on CPU and 4e-3 on the H200. A wrong half or page differs at O(1).
        tol = 2e-3 if dtype == torch.float16 else 1e-2
        torch.testing.assert_close(got[0], want[0], atol=tol, rtol=tol)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_kv_interleaved_pool(kernel_device, path):
    """k_cache, v_cache as the two halves of one [P, 2, S, Hkv, D] pool (page stride 2 pages)."""
    case = make_case(2, 3, 16, 2, 2, 64, torch.float16, path, kernel_device, seed=9)
    pool = torch.stack([case["k_cache"], case["v_cache"]], dim=1)
    strided = dict(case, k_cache=pool[:, 0], v_cache=pool[:, 1])
    with kvops.backend("triton"):
        got = torch.ops.kvops.elastic_attention(**strided)
    check_against_oracle(*got, case, f"interleaved-{path}")


@pytest.mark.parametrize("path", PATHS)
def test_op_dispatch_and_opcheck(kernel_device, path):
    case = make_case(3, 3, 8, 2, 2, 32, torch.float16, path, "cpu", seed=10)
    torch.library.opcheck(torch.ops.kvops.elastic_attention.default, (), dict(case, scale=0.2))
    dev_case = {n: t.to(kernel_device) for n, t in case.items()}
    with kvops.backend("triton"):
        out, lse = torch.ops.kvops.elastic_attention(**dev_case, scale=0.2)
    want, want_lse = elastic_attention_ref(**case, scale=0.2)
    assert_close("out", out, want, *ATTN_TOL[torch.float16], f"op-{path}")
    assert_close("lse", lse, want_lse, LSE_TOL[torch.float16], LSE_TOL[torch.float16], f"op-{path}")


def test_compiled_decode_steps_never_recompile():
    """Steps with new lengths, tables, modes and spans: one compile per path, no recompiles."""
    torch._dynamo.reset()
    backend, calls = counting_backend()

    @torch.compile(backend=backend, fullgraph=True)
    def step(x, k_cache, v_cache, block_table, seq_lens, block_mode, base_span):
        q = x * 0.5
        a, _ = torch.ops.kvops.elastic_attention(q, k_cache, v_cache, block_table, seq_lens)
        b, _ = torch.ops.kvops.elastic_attention(q, k_cache, v_cache, block_table, seq_lens,
                                                 block_mode=block_mode)
        c, lse = torch.ops.kvops.elastic_attention(q, k_cache, v_cache, block_table, seq_lens,
                                                   base_span=base_span)
        return a + b + c, lse

    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(6):
            case = make_case(2, 4, 8, 2, 2, 32, torch.float16, "structured", "cpu", seed=t,
                             pool_pages=10)
            span = case.pop("base_span")
            modes = span_modes(span, 4)
            x = case.pop("q") * 2
            got, lse = step(x, **case, block_mode=modes, base_span=span)
            want = [elastic_attention_ref(x * 0.5, **case, **kw) for kw in
                    ({}, {"block_mode": modes}, {"base_span": span})]
            torch.testing.assert_close(got, want[0][0] + want[1][0] + want[2][0], atol=4e-3,
                                       rtol=4e-3)
            torch.testing.assert_close(lse, want[2][1])
    assert len(calls) == 1


@requires_cuda
@pytest.mark.parametrize("S", [8, 16])     # 8: the general path's table kernel runs first
@pytest.mark.parametrize("path", PATHS)
def test_cuda_graph_replay_with_new_tables(path, S):
    dims = (8, 32, S, 8, 4, 128, torch.float16, path)
    case = make_case(*dims, "cuda", seed=11, pool_pages=8 * 32 + 2)
    static = {n: t.clone() for n, t in case.items()}
    graph, (out, lse) = capture_graph(lambda: torch.ops.kvops.elastic_attention(**static))
    for seed in range(12, 15):
        fresh = make_case(*dims, "cuda", seed=seed, pool_pages=8 * 32 + 2)
        for n, t in fresh.items():
            static[n].copy_(t)
        graph.replay()
        check_against_oracle(out, lse, fresh, case_id(*dims) + f"-graph{seed}")


@requires_cuda
@pytest.mark.parametrize("S", [8, 16, 64])
@pytest.mark.parametrize("path", ["structured", "general"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_pipeline_depths_agree_with_oracle(dtype, path, S):
    """TARGET and BASE runs pipelined to their own depths (``num_stages``, ``base_stages``):
    every pair gives the oracle's result on sequences of many tiles and several runs."""
    dims = (4, 512 // S, S, 2, 4, 128, dtype, path)
    case = make_case(*dims, "cuda", seed=S)
    for num_stages, base_stages in ((3, 3), (4, 5), (5, 7), (5, 9), (4, 2)):
        out, lse = elastic_attention_fwd(**case, num_splits=2, num_stages=num_stages,
                                         base_stages=base_stages)
        check_against_oracle(out, lse, case, case_id(*dims) + f"-s{num_stages}/{base_stages}")


@requires_cuda
def test_large_pool_offsets_do_not_overflow():
    """A pool of more than 2**31 elements: page offsets must be 64-bit (TARGET and BASE)."""
    S, Hkv, D = 16, 8, 128
    P = 2**31 // (S * Hkv * D) + 8
    k = torch.empty((P, S, Hkv, D), dtype=torch.float16, device="cuda")
    v = torch.empty_like(k)
    small = make_case(1, 4, S, Hkv, 4, D, torch.float16, "general", "cuda", seed=15)
    n = small["k_cache"].shape[0]
    k[P - n:], v[P - n:] = small["k_cache"], small["v_cache"]
    table = torch.where(small["block_table"] >= 0, small["block_table"] + P - n, -1)
    got = torch.ops.kvops.elastic_attention(small["q"], k, v, table.int(), small["seq_lens"],
                                            block_mode=small["block_mode"])
    check_against_oracle(*got, small, "int64-offsets")


def _bad_inputs():
    ok = make_case(2, 3, 8, 2, 2, 32, torch.float16, "general", "cpu", seed=0)
    span = torch.zeros(2, 2, dtype=torch.int32)
    yield "q-rank", dict(ok, q=ok["q"][0]), ValueError, "q: expected rank 3"
    yield "q-dtype", dict(ok, q=ok["q"].double()), TypeError, "q: expected dtype"
    yield "cache-dtype", dict(ok, k_cache=ok["k_cache"].bfloat16()), TypeError, "k_cache: expected"
    yield "v-shape", dict(ok, v_cache=ok["v_cache"][:1]), ValueError, "v_cache: expected shape"
    yield "heads", dict(ok, q=torch.randn(2, 3, 32).half()), ValueError, "Hq=3 must be a multiple"
    yield "page-size", dict(ok, k_cache=ok["k_cache"][:, :6], v_cache=ok["v_cache"][:, :6]), \
        ValueError, "S=6"
    yield "table-dtype", dict(ok, block_table=ok["block_table"].long()), TypeError, "block_table"
    yield "table-batch", dict(ok, block_table=ok["block_table"][:1]), ValueError, "block_table"
    yield "seq-dtype", dict(ok, seq_lens=ok["seq_lens"].long()), TypeError, "seq_lens"
    yield "mode-dtype", dict(ok, block_mode=ok["block_mode"].int()), TypeError, "block_mode"
    yield "mode-shape", dict(ok, block_mode=ok["block_mode"][:, :2]), ValueError, "block_mode"
    yield "span-shape", dict(ok, block_mode=None, base_span=span[:, :1]), ValueError, "base_span"
    yield "both", dict(ok, base_span=span), ValueError, "give at most one"
    yield "fp32-base", dict(ok, q=ok["q"].float(), k_cache=ok["k_cache"].float(),
                            v_cache=ok["v_cache"].float()), TypeError, "float32 runs the native"
    P = ok["k_cache"].shape[0]
    yield "cache-strided", dict(ok, k_cache=torch.zeros(P, 8, 4, 32).half()[:, :, :2]), ValueError, \
        "k_cache: expected contiguous pages"
    yield "seq-strided", dict(ok, seq_lens=torch.zeros(2, 2, dtype=torch.int32)[:, 0]), ValueError, \
        "seq_lens: expected a contiguous"
    yield "table-strided", dict(ok, block_table=ok["block_table"].t().contiguous().t()), \
        ValueError, "block_table: expected the last dim contiguous"
    page = 8 * 2 * 32
    odd = torch.zeros(P * (page + 1)).half().as_strided((P, 8, 2, 32), (page + 1, 64, 32, 1))
    yield "odd-page-stride", dict(ok, k_cache=odd), ValueError, \
        "k_cache: BASE rows are read as 32-bit words: expected an even page stride, got 513"
    huge = ok["k_cache"][:1].expand(2**30, -1, -1, -1)
    yield "too-many-pages", dict(ok, k_cache=huge, v_cache=huge), ValueError, \
        r"k_cache: the general path .* fewer than 2\*\*30 pages, got 1073741824"


@pytest.mark.parametrize("name,kwargs,exc,msg", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise(name, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        torch.ops.kvops.elastic_attention(**kwargs)


def test_unaligned_pool_raises_on_the_kernel_path(kernel_device):
    """BASE rows are read as 32-bit words: a pool two bytes off a 4-byte boundary is refused
    by name, not read misaligned."""
    ok = make_case(2, 3, 8, 2, 2, 32, torch.float16, "structured", kernel_device, seed=2)
    for name in ("k_cache", "v_cache"):
        c = ok[name]
        shifted = torch.empty(c.numel() + 1, dtype=c.dtype, device=c.device)[1:].view(c.shape)
        shifted.copy_(c)
        with kvops.backend("triton"), pytest.raises(ValueError, match=f"{name}: .*4-byte aligned"):
            torch.ops.kvops.elastic_attention(**dict(ok, **{name: shifted}))


def test_pool_alignment_is_checked_every_call_of_an_unaligned_signature(kernel_device):
    """A signature records whether each tensor is 16-byte aligned, not 4-byte: a pool four bytes
    off a 16-byte boundary is read, and one of the same signature two bytes off is refused on
    its own call, after the first one's checks were kept."""
    ok = make_case(2, 3, 8, 2, 2, 32, torch.float16, "structured", kernel_device, seed=2)
    c = ok["k_cache"]
    buf = torch.empty(c.numel() + 8, dtype=c.dtype, device=c.device)
    four = buf[2:2 + c.numel()].view(c.shape)          # 4 bytes past the 16-byte boundary
    four.copy_(c)
    two = buf[1:1 + c.numel()].view(c.shape)           # 2 bytes past it
    with kvops.backend("triton"):
        out, lse = torch.ops.kvops.elastic_attention(**dict(ok, k_cache=four))
        check_against_oracle(out, lse, dict(ok, k_cache=four), "pool-4-bytes-off")
        two.copy_(c)
        with pytest.raises(ValueError, match="k_cache: .*4-byte aligned"):
            torch.ops.kvops.elastic_attention(**dict(ok, k_cache=two))


@requires_cuda
@pytest.mark.parametrize("S", [8, 16, 64])
def test_general_path_16_row_tiles_on_cuda(S):
    """16-row general-path tiles on the GPU: at 16 rows the general path agrees bit for bit with
    the structured path on the same layout, and with the oracle (a kernel that read a mode byte a
    row gave max error 0.09-0.24 here at 953a96a, bench/results/2026-11-30-elastic-variants.md)."""
    case = make_case(3, 8, S, 2, 4, 64, torch.float16, "structured", "cuda", seed=3)
    span = case.pop("base_span")
    out, lse = elastic_attention_fwd(**case, block_mode=span_modes(span, 8), block_n=16)
    want = elastic_attention_fwd(**case, base_span=span, block_n=16)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    check_against_oracle(out, lse, dict(case, base_span=span), f"general-S{S}-bn16")


@triton.jit
def _planes_kernel(W, Out, R: tl.constexpr, C: tl.constexpr, CODEC: tl.constexpr,
                   PTX: tl.constexpr):
    """Decode words ``W [R, C]`` into planes and store them back in byte order: ``Out[r, 4j + k]``
    is plane ``k`` at ``[r, j]``, so ``Out`` is the decode of ``W``'s bytes as they lie."""
    o_r = tl.arange(0, R)[:, None]
    o_c = tl.arange(0, C)[None, :]
    p0, p1, p2, p3 = _planes(tl.load(W + o_r * C + o_c), CODEC, PTX)
    o = o_r * (4 * C) + 4 * o_c
    tl.store(Out + o, p0)
    tl.store(Out + o + 1, p1)
    tl.store(Out + o + 2, p2)
    tl.store(Out + o + 3, p3)


@pytest.mark.parametrize("ptx", [False, pytest.param(True, marks=requires_cuda)],
                         ids=["integer", "ptx"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["hi8", "e4m3"])
def test_planes_decode_every_byte_in_every_position(kernel_device, dtype, ptx):
    """Both BASE decodes (integer, into the TARGET dtype; inline PTX: byte permutes, for e4m3
    the sm_89 float8 -> float16 conversion) give the codec's value of every byte value in every
    byte of a word, in even and odd rows and columns of words (byte k of word [r, c] is
    ``16 (r // 2) + c // 2 + 37 k`` mod 256), compared as float32 bit patterns (NaN as NaN)."""
    if ptx and torch.version.hip is not None:
        pytest.skip("the PTX decode is NVIDIA code")
    if dtype == torch.bfloat16 and ptx and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the e4m3 PTX decode needs sm_89+")
    device = torch.device("cuda") if ptx else kernel_device
    r, c, k = torch.meshgrid(torch.arange(32), torch.arange(32), torch.arange(4), indexing="ij")
    b = ((r // 2) * 16 + c // 2 + 37 * k).remainder(256).to(torch.uint8).flatten()
    w = b.to(device).view(torch.int32).view(32, 32)
    out = torch.empty(32, 128, dtype=torch.float32, device=device)
    _planes_kernel[(1,)](w, out, R=32, C=32, CODEC=0 if dtype == torch.float16 else 2, PTX=ptx)
    if dtype == torch.float16:
        want = (b.to(torch.int16) << 8).view(torch.float16).float()
    else:
        want = b.view(torch.float8_e4m3fn).float()
    got = out.flatten().cpu()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))


@triton.jit
def _float16_query_kernel(Q, QH, Scale, G: tl.constexpr, D: tl.constexpr):
    o = tl.arange(0, G)[:, None] * D + tl.arange(0, D)[None, :]
    b_qh, b_s = _float16_query(tl.load(Q + o))
    tl.store(QH + o, b_qh.to(tl.float32))
    tl.store(Scale + tl.arange(0, G), b_s)


def test_float16_query_scales_each_row_exactly(kernel_device):
    """``_float16_query``, which bf16 BASE runs use on CUDA: every row gets a power-of-two
    scale with ``max |q s| in [2^13, 2^14)`` (at most 2^127 for tiny rows), ``q s`` is exact in
    float16, and a row that is zero, subnormal, huge (2^120), infinite or NaN leaves the other
    rows alone."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(8, 32, generator=gen)
    mags = [1.0, 2.0 ** 120, 2.0 ** -130, 0.0, 2.0 ** -60, 3.0e4]
    for i, m in enumerate(mags):
        q[i] *= m
    q[6, 3] = float("inf")
    q[7, 5] = float("nan")
    # bfloat16 values, passed as float32: the interpreter converts bfloat16 subnormals wrongly
    q = q.to(torch.bfloat16).float()
    qh = torch.empty(8, 32, device=kernel_device)
    scale = torch.empty(8, device=kernel_device)
    _float16_query_kernel[(1,)](q.to(kernel_device), qh, scale, G=8, D=32)
    qh, scale = qh.cpu(), scale.cpu()
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))      # powers of two
    for i in (0, 1, 2, 4, 5, 7):                 # finite rows (NaN elements aside) are exact
        row, want = qh[i], q[i].double() * scale[i].double()
        ok = ~q[i].isnan()
        assert torch.equal(row[ok].double(), want[ok]), i
        assert row[ok].abs().max() < 2.0 ** 14, i
        if i != 2:          # row 2 (below 2^-114) takes the largest scale, 2^127
            assert row[ok].abs().max() >= 2.0 ** 13, i
    assert scale[3] == 2.0 ** 127 and torch.equal(qh[3], torch.zeros(32))
    assert qh[6, 3] == float("inf") and torch.isfinite(qh[6, torch.arange(32) != 3]).all()
    assert qh[7, 5].isnan()


def test_forced_ptx_decode_is_refused_where_it_cannot_compile(kernel_device):
    if kernel_device.type == "cuda" and torch.version.hip is None \
            and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("the PTX decode compiles here")
    case = make_case(1, 2, 16, 1, 2, 64, torch.bfloat16, "structured", kernel_device, seed=2)
    with pytest.raises(ValueError, match="ptx_decode"):
        elastic_attention_fwd(**case, ptx_decode=True)


@pytest.mark.parametrize("k", [-40, 24], ids=["tiny-q", "huge-q"])
def test_bf16_base_runs_keep_the_query_range(kernel_device, k):
    """On CUDA, BASE runs of a bfloat16 cache take the query group to float16 under a power of
    two (``_float16_query``). A query 2^24 times larger (past float16's 65504) or 2^-40 times
    smaller (under its smallest subnormal), with the scale undoing it, still attends as the
    oracle says."""
    case = make_case(2, 6, 16, 2, 4, 64, torch.bfloat16, "structured", kernel_device, seed=5)
    case["q"] = case["q"] * 2.0 ** k
    scale = 64 ** -0.5 * 2.0 ** -k
    out, lse = torch.ops.kvops.elastic_attention(**case, scale=scale)
    check_against_oracle(out, lse, dict(case, scale=scale), f"q*2^{k}")


def test_validation_mode_raises_on_out_of_range():
    ok = make_case(2, 3, 8, 2, 2, 32, torch.float16, "general", "cpu", seed=1)
    ok["seq_lens"] = torch.tensor([24, 9], dtype=torch.int32)
    ok["block_table"] = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32)
    ok["block_mode"] = torch.tensor([[0, 1, 2], [0, 0, 7]], dtype=torch.int8)   # 7: unused
    ok["k_cache"], ok["v_cache"] = ok["k_cache"][:5].contiguous(), ok["v_cache"][:5].contiguous()
    with kvops.validate(True):
        torch.ops.kvops.elastic_attention(**ok)
    bad = [("seq_lens", torch.tensor([25, 9], dtype=torch.int32), r"seq_lens: values must lie in"),
           ("block_table", torch.tensor([[0, 1, 5], [3, 4, -1]], dtype=torch.int32), "block_table"),
           ("block_table", torch.tensor([[0, 1, 2], [3, -1, -1]], dtype=torch.int32), "block_table"),
           ("block_mode", torch.tensor([[0, 3, 2], [0, 0, 0]], dtype=torch.int8), "block_mode")]
    for name, value, msg in bad:
        with kvops.validate(True), pytest.raises(IndexError, match=msg):
            torch.ops.kvops.elastic_attention(**dict(ok, **{name: value}))
    structured = dict(ok, block_mode=None)
    for span, msg in (([[0, 4], [0, 0]], "base_span"), ([[2, 1], [0, 0]], "end - first")):
        with kvops.validate(True), pytest.raises(IndexError, match=msg):
            torch.ops.kvops.elastic_attention(**structured, base_span=torch.tensor(
                span, dtype=torch.int32))
    assert kvops.validate() is False
