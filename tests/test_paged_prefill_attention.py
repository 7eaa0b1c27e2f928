"""paged_prefill_attention: kernel and reference against a float64 oracle (random tables with a
shared prefix, chunk lengths 1..N, empty prefixes, page-boundary starts, sliding windows,
padding rows, unmapped holes, every invisible slot poisoned with NaN), agreement with the
decode ops' visibility rule, the BASE rule, the launch rule's table, and the op contract
(opcheck, compile without recompiles, CUDA graphs, input errors, validation mode)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvops
import kvops.kernels.paged_prefill_attention as prefill_kernel
from kvops.kernels.paged_prefill_attention import (
    paged_prefill_attention_fwd,
    prefill_off64,
    prefill_splits,
    prefill_tile,
    prefill_tma,
    prefill_tma_rows,
)
from kvops.kernels.paged_prefill_gluon import HAVE_GLUON, prefill_gluon
from kvops.ops.paged_prefill_attention import paged_prefill_attention_ref
from tests.conftest import capture_graph, counting_backend, requires_cuda
from tests.oracles_attention import paged_prefill_oracle
from tests.tolerances import ATTN_TOL, LSE_TOL, assert_close


def make_case(chunks, S, Hkv, G, D, dtype, device, seed, window=0, interleaved=False, pad=0,
              hole=False, spare_blocks=1, pool_pages=None):
    """One prefill call. ``chunks``: (prefix, new) tokens per sequence. Pages are a random
    permutation; sequence 1 shares sequence 0's first full prefix pages (an alias) where both
    have them. Table entries past a sequence's blocks hold garbage (huge ids, -1). ``hole``:
    one block under some sequence's length is -1 (its keys must be skipped). Every slot no
    query may see (unmapped pages, rows past a sequence's end, positions outside every window)
    holds NaN. ``pad`` extra query rows follow the last sequence."""
    gen = torch.Generator().manual_seed(seed)
    B = len(chunks)
    lens = [p + n for p, n in chunks]
    blocks = [-(-n // S) for n in lens]
    L = max(blocks + [1]) + spare_blocks
    shared = 0
    if B >= 2:
        shared = min(chunks[0][0], chunks[1][0]) // S
    need = sum(blocks) - shared
    P = pool_pages or need + 2
    perm = torch.randperm(P, generator=gen).tolist()
    table = torch.randint(10**6, 2 * 10**6, (B, L), generator=gen, dtype=torch.int32)
    table[:, -1] = -1
    for b in range(B):
        for j in range(blocks[b]):
            table[b, j] = table[0, j] if b == 1 and j < shared else perm.pop()
    if hole:
        b = max(range(B), key=lambda i: blocks[i])
        if blocks[b] >= 2:
            table[b, int(torch.randint(0, blocks[b], (1,), generator=gen))] = -1
    shape = (P, S, Hkv, D)
    if interleaved:
        pool = torch.randn(P, 2, S, Hkv, D, generator=gen).to(dtype)
        k_cache, v_cache = pool[:, 0], pool[:, 1]
    else:
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
    seen = torch.zeros(P, S, dtype=torch.bool)
    for b, (prefix, _) in enumerate(chunks):
        first = max(0, prefix - window + 1) if window > 0 else 0
        for j in range(first, lens[b]):
            page = int(table[b, j // S])
            if 0 <= page < P:
                seen[page, j % S] = True
    for c in (k_cache, v_cache):
        c[~seen] = float("nan")
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    N = starts[-1] + pad
    q = torch.randn(N, Hkv * G, D, generator=gen).to(dtype)
    case = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table,
                query_start=torch.tensor(starts, dtype=torch.int32),
                seq_lens=torch.tensor(lens, dtype=torch.int32))
    if interleaved:
        moved = pool.to(device)
        out = {n: t.to(device) for n, t in case.items() if n not in ("k_cache", "v_cache")}
        return dict(out, k_cache=moved[:, 0], v_cache=moved[:, 1])
    return {n: t.to(device) for n, t in case.items()}


def check_against_oracle(out, lse, case, name, window=0, scale=None):
    dtype = case["q"].dtype
    # the oracle loops over tokens and heads in Python: on host copies (on a GPU its per-element
    # indexing would sync the device thousands of times)
    host = {n: t.cpu() for n, t in case.items()}
    want_out, want_lse = paged_prefill_oracle(**host, window=window, scale=scale)
    out, lse = out.cpu(), lse.cpu()
    atol, rtol = ATTN_TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32, name
    assert out.shape == case["q"].shape and lse.shape == case["q"].shape[:2], name
    assert_close("out", out, want_out, atol, rtol, name)
    assert_close("lse", lse, want_lse, LSE_TOL[dtype], LSE_TOL[dtype], name)


def prefixes(S):
    """Prefix lengths: empty, page boundaries and one off them, anything."""
    return st.one_of(st.just(0), st.sampled_from([S, 2 * S, S - 1, S + 1]),
                     st.integers(0, 2 * S + 8))


@st.composite
def cases(draw, reference=False):
    S = draw(st.sampled_from([8, 16, 64]))
    B = draw(st.integers(1, 3))
    chunks = [(draw(prefixes(S)), draw(st.integers(1, 24))) for _ in range(B)]
    G = draw(st.sampled_from([1, 2, 3, 4, 7, 8]))
    Hkv = draw(st.sampled_from([1, 2]))
    D = draw(st.sampled_from([64, 96, 128, 256] if reference else [16, 64, 96, 128, 256]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    window = draw(st.sampled_from([0, 0, 1, 5, 2 * S + 3]))
    extra = dict(interleaved=draw(st.booleans()), pad=draw(st.sampled_from([0, 3])),
                 hole=draw(st.booleans()))
    return (chunks, S, Hkv, G, D, dtype), window, extra, draw(st.integers(0, 2**31 - 1))


def case_id(chunks, S, Hkv, G, D, dtype, window, extra):
    return (f"chunks{chunks}-S{S}-Hkv{Hkv}-G{G}-D{D}-{str(dtype).replace('torch.', '')}"
            f"-win{window}-{extra}")


@settings(max_examples=8)
@given(drawn=cases(), block_m=st.sampled_from([None, 16, 32]), block_n=st.sampled_from([None, 16]),
       num_splits=st.sampled_from([None, 1, 3]), prefetch=st.booleans(),
       off64=st.sampled_from([None, True]))
def test_kernel_matches_oracle(kernel_device, poison, drawn, block_m, block_n, num_splits,
                               prefetch, off64):
    """Random cases at forced and ruled tiles, splits and page-id prefetch, with 32-bit element
    offsets (the rule's at these sizes) or 64-bit ones (forced)."""
    dims, window, extra, seed = drawn
    G = dims[3]
    if block_m is not None and block_m < G:
        block_m = None
    case = make_case(*dims, device=kernel_device, seed=seed, window=window, **extra)
    out, lse = paged_prefill_attention_fwd(**case, window=window, block_m=block_m,
                                           block_n=block_n, num_splits=num_splits,
                                           prefetch=prefetch, off64=off64)
    check_against_oracle(out, lse, case, case_id(*dims, window, extra)
                         + f"-bm{block_m}-bn{block_n}-splits{num_splits}-pf{prefetch}-off{off64}",
                         window)


@pytest.mark.parametrize("prefetch", [False, True], ids=["own-pages", "prefetch"])
@pytest.mark.parametrize("window", [0, 21])
def test_split_key_ranges_match_oracle(kernel_device, poison, window, prefetch):
    """Tiles whose key ranges are cut in 1, 2, 5 and 16 splits (more splits than key tiles
    leave some empty) give the oracle's rows, padding rows and a hole included, with page ids
    loaded by each tile or a tile ahead."""
    case = make_case([(70, 9), (0, 5), (33, 17)], 16, 2, 4, 64, torch.float16, kernel_device,
                     seed=11, window=window, pad=2, hole=True)
    for nsp in (1, 2, 5, 16):
        out, lse = paged_prefill_attention_fwd(**case, window=window, num_splits=nsp,
                                               block_n=16, prefetch=prefetch)
        check_against_oracle(out, lse, case, f"splits{nsp}-win{window}-pf{prefetch}", window)


@pytest.fixture
def descriptors(monkeypatch):
    """Counts the pool descriptors a call makes (two a TMA launch), so a test knows the
    descriptor path ran."""
    made = []
    real = prefill_kernel._pool_descriptor

    def spy(cache, block_n):
        made.append(block_n)
        return real(cache, block_n)

    monkeypatch.setattr(prefill_kernel, "_pool_descriptor", spy)
    return made


@settings(max_examples=6)
@given(S=st.sampled_from([64, 128]), G=st.sampled_from([1, 2, 3, 4, 7, 8]),
       D=st.sampled_from([16, 64, 128]), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       window=st.sampled_from([0, 1, 37, 150]), interleaved=st.booleans(),
       hole=st.booleans(), num_splits=st.sampled_from([None, 1, 3]), prefetch=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_tma_tiles_match_oracle(kernel_device, poison, descriptors, S, G, D, dtype, window,
                                interleaved, hole, num_splits, prefetch, seed):
    """K/V tiles through pool descriptors (forced: the interpreter has no Hopper to pick them):
    prefixes ending mid-page and on page boundaries, a shared prefix, holes (page -1 inside a
    sequence: out of the descriptor's bounds, read as zeros and masked), a page's invisible
    rows poisoned with NaN (read whole by the descriptor, zeroed before the PV product),
    windows, splits and interleaved pools all give the oracle's rows."""
    chunks = [(S + 3, 20), (S, 9), (0, 2 * S + 5)]
    case = make_case(chunks, S, 2, G, D, dtype, kernel_device, seed=seed, window=window,
                     interleaved=interleaved, pad=2, hole=hole)
    descriptors.clear()
    out, lse = paged_prefill_attention_fwd(**case, window=window, tma=True,
                                           num_splits=num_splits, prefetch=prefetch,
                                           block_m=max(32, 1 << (G - 1).bit_length()))
    assert len(descriptors) == 2
    check_against_oracle(out, lse, case, f"tma-S{S}-G{G}-D{D}-win{window}-{interleaved}-"
                                         f"{hole}-splits{num_splits}-pf{prefetch}", window)


def new_rows(case, garbage=float("nan")):
    """``k, v [N, Hkv, D]``: the rows the case's pool holds at each chunk's positions (what
    ``paged_kv_write`` put there); ``garbage`` where the page is unmapped (never read: such a
    sequence reads its chunk from its pages) and in padding rows."""
    k_cache, v_cache = case["k_cache"], case["v_cache"]
    P, S, Hkv, D = k_cache.shape
    N = case["q"].shape[0]
    starts = case["query_start"].tolist()
    lens = case["seq_lens"].tolist()
    k = torch.full((N, Hkv, D), garbage, dtype=k_cache.dtype, device=k_cache.device)
    v = torch.full_like(k, garbage)
    for b in range(len(lens)):
        n = starts[b + 1] - starts[b]
        pos = torch.arange(lens[b] - n, lens[b])
        pages = case["block_table"][b, pos // S].long().cpu()
        ok = (pages >= 0) & (pages < P)
        rows = torch.arange(starts[b], starts[b + 1])
        k[rows[ok]] = k_cache[pages[ok], pos[ok] % S]
        v[rows[ok]] = v_cache[pages[ok], pos[ok] % S]
    return k, v


def poison_chunk_tiles(case, block_n):
    """A copy of ``case`` whose pool holds NaN at every chunk position from the chunk's first
    ``block_n``-aligned key on, the tiles a call given the new rows reads from them, in the
    sequences whose pages there are all mapped (the others read those keys from their pages),
    and the number of sequences poisoned."""
    poisoned = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    P, S = case["k_cache"].shape[:2]
    starts = case["query_start"].tolist()
    lens = case["seq_lens"].tolist()
    count = 0
    for b in range(len(lens)):
        pos0 = lens[b] - (starts[b + 1] - starts[b])
        run = range(-(-pos0 // block_n) * block_n, lens[b])
        pages = [int(case["block_table"][b, p // S]) for p in run]
        if not all(0 <= page < P for page in pages):
            continue
        count += bool(pages)
        for p, page in zip(run, pages):
            poisoned["k_cache"][page, p % S] = float("nan")
            poisoned["v_cache"][page, p % S] = float("nan")
    return poisoned, count


@settings(max_examples=10)
@given(drawn=cases(), new_tma=st.booleans(), tma=st.booleans(),
       num_splits=st.sampled_from([None, 1, 3]), prefetch=st.booleans(),
       off64=st.sampled_from([None, True]))
def test_new_rows_match_oracle(kernel_device, poison, drawn, new_tma, tma, num_splits,
                               prefetch, off64):
    """Given the new tokens' rows (``k``, ``v``), the tiles of the chunks' own keys come from
    them, by pointer loads or through descriptors over ``[N, Hkv * D]`` (forced), beside prefix
    tiles gathered or through pool descriptors: the pool's chunk rows in those tiles are NaN,
    so are the padding rows of ``k``, ``v``, chunk keys on unmapped pages are left out (their
    rows finite), and the rows are the oracle's over the clean pool."""
    (chunks, S, Hkv, G, D, dtype), window, extra, seed = drawn
    new_tma = new_tma and dtype != torch.float32 and D == 1 << (D - 1).bit_length()
    tma = tma and new_tma and S >= 64 and not extra["interleaved"]
    case = make_case(chunks, S, Hkv, G, D, dtype, kernel_device, seed=seed, window=window,
                     **extra)
    k, v = new_rows(case)
    block_n = 64 if D <= 128 and dtype != torch.float32 else 32
    block_m = max(16, 1 << (G - 1).bit_length())
    out, lse = paged_prefill_attention_fwd(**poison_chunk_tiles(case, block_n)[0], window=window,
                                           k=k, v=v, new_tma=new_tma, tma=tma, block_m=block_m,
                                           block_n=block_n, num_splits=num_splits,
                                           prefetch=prefetch, off64=off64)
    check_against_oracle(out, lse, case, "new-" + case_id(chunks, S, Hkv, G, D, dtype, window,
                                                           extra) + f"-{new_tma}-{tma}-{off64}",
                         window)


@pytest.mark.parametrize("new_tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("window,num_splits", [(0, None), (0, 3), (5, 2), (37, None)])
def test_new_rows_around_the_first_chunk_tile(kernel_device, poison, new_tma, window,
                                              num_splits):
    """Chunks starting mid-tile (63, 100), on a tile boundary (128) and from nothing, with a
    hole among one chunk's own keys and padding: the tile holding a chunk's first position from
    the pages, the row tiles after it (split boundaries among them), the chunk with the hole
    from its pages alone, the oracle's rows."""
    case = make_case([(100, 150), (63, 70), (128, 40), (0, 5)], 16, 2, 4, 64, torch.float16,
                     kernel_device, seed=11, window=window, hole=True, pad=2)
    k, v = new_rows(case)
    # the hole lies among (100, 150)'s own keys: that sequence reads them from its pages, so
    # its rows are never read (NaN here) and its pool is not poisoned
    poisoned, count = poison_chunk_tiles(case, 64)
    assert count == 3 and int((case["block_table"][0, 8:16] < 0).sum()) == 1
    k[:150], v[:150] = float("nan"), float("nan")
    out, lse = paged_prefill_attention_fwd(**poisoned, window=window, k=k,
                                           v=v, new_tma=new_tma, block_m=16, block_n=64,
                                           num_splits=num_splits)
    check_against_oracle(out, lse, case, f"first-tile-{new_tma}-{window}-{num_splits}", window)



@pytest.mark.parametrize("window,num_splits", [(0, None), (0, 3), (5, 2), (37, None)])
def test_first_chunk_tile_in_two_halves_through_descriptors(kernel_device, poison, window,
                                                            num_splits):
    """Pool and rows both through descriptors (pages of 64): the tile holding a chunk's first
    position mid-tile is read as its pages' half, then its rows' half; chunks starting mid-tile
    (63, 100), on a tile boundary (128) and from nothing give the oracle's rows."""
    case = make_case([(100, 150), (63, 70), (128, 40), (0, 5)], 64, 2, 4, 64, torch.float16,
                     kernel_device, seed=12, window=window, pad=2)
    k, v = new_rows(case)
    out, lse = paged_prefill_attention_fwd(**case, window=window, k=k, v=v, tma=True,
                                           new_tma=True, block_m=16, block_n=64,
                                           num_splits=num_splits)
    check_against_oracle(out, lse, case, f"halves-{window}-{num_splits}", window)


@pytest.mark.parametrize("new_tma", [None, False, True])
def test_fwd_refuses_rows_whose_heads_are_not_contiguous(new_tma):
    """The kernel reads a row's heads ``D`` apart, so the launcher refuses other rows whatever
    loads them (the op's checks refuse them first)."""
    case = make_case([(3, 20)], 16, 2, 2, 64, torch.float16, "cpu", seed=4)
    k, v = new_rows(case)
    wide = torch.zeros(k.shape[0], 2, 2 * 64, dtype=k.dtype)[:, :, :64]
    with pytest.raises(ValueError, match=r"k, v: expected each row's heads contiguous"):
        paged_prefill_attention_fwd(**case, k=wide, v=v, new_tma=new_tma)


def test_op_reads_new_rows_and_validation_checks_them(kernel_device):
    """Through the op (``k=``, ``v=``): the reference's rows; validation mode accepts the rows
    the pool holds and refuses others by name."""
    case = make_case([(21, 30), (0, 17)], 8, 2, 2, 32, torch.float16, "cpu", seed=6, pad=1)
    k, v = new_rows(case, garbage=0.0)
    dev = {n: t.to(kernel_device) for n, t in case.items()}
    want, want_lse = paged_prefill_attention_ref(**case)
    with kvops.backend("triton"), kvops.validate(True):
        out, lse = torch.ops.kvops.paged_prefill_attention(**dev, k=k.to(kernel_device),
                                                           v=v.to(kernel_device))
    assert_close("out", out, want, *ATTN_TOL[torch.float16], "op-new")
    assert_close("lse", lse, want_lse, LSE_TOL[torch.float16], LSE_TOL[torch.float16], "op-new")
    bad = v.clone()
    bad[3] += 1
    with kvops.validate(True), pytest.raises(ValueError, match=r"v: expected the rows the pool"):
        torch.ops.kvops.paged_prefill_attention(**case, k=k, v=bad)
    torch.library.opcheck(torch.ops.kvops.paged_prefill_attention.default, (),
                          dict({n: t.nan_to_num(0.0) if t.is_floating_point() else t
                                for n, t in case.items()}, k=k, v=v))


@pytest.mark.parametrize("bad", [-1, 10**6], ids=["unmapped", "past-the-pool"])
def test_tma_interior_tiles_leave_out_keys_on_bad_pages(kernel_device, bad):
    """Keys on a page id outside ``[0, P)`` inside every row's causal range (an interior tile,
    no position mask) are left out, as on the gathered path: the descriptor reads zeros there,
    and the page test still masks their scores."""
    case = make_case([(256, 40)], 64, 2, 4, 64, torch.float16, kernel_device, seed=2)
    case["block_table"][0, 1] = bad
    out, lse = paged_prefill_attention_fwd(**case, tma=True, block_m=32)
    check_against_oracle(out, lse, case, f"tma-interior-{bad}")


def test_tma_refuses_tiles_that_cross_pages():
    case = make_case([(5, 3)], 16, 1, 2, 64, torch.float16, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"tma: expected a key tile inside a page \(block_n 64"):
        paged_prefill_attention_fwd(**case, tma=True)
    case = make_case([(5, 3)], 64, 1, 2, 96, torch.float16, "cpu", seed=0)
    with pytest.raises(ValueError, match="D a power of two, got D 96"):
        paged_prefill_attention_fwd(**case, tma=True, block_n=32)


@pytest.mark.parametrize("S,D,dtype,capability,aligned,want", [
    (64, 128, torch.bfloat16, (9, 0), True, True),       # Hopper, pages of 64
    (256, 256, torch.float16, (10, 0), True, True),      # Blackwell, D 256
    (16, 128, torch.bfloat16, (9, 0), True, False),      # a 64-key tile spans 4 pages
    (32, 128, torch.bfloat16, (9, 0), True, False),
    (64, 128, torch.bfloat16, (8, 0), True, False),      # Ampere: no tensor copy engine
    (64, 96, torch.bfloat16, (9, 0), True, False),       # a tile row is not a box of D
    (64, 512, torch.bfloat16, (9, 0), True, False),      # a box is at most 256 wide
    (64, 128, torch.float32, (9, 0), True, False),
    (64, 128, torch.bfloat16, (9, 0), False, False),     # page stride not 16-byte aligned
    (64, 128, torch.bfloat16, (0, 0), True, False),      # CPU
])
def test_prefill_tma_table(S, D, dtype, capability, aligned, want):
    assert prefill_tma(S, D, dtype, capability, aligned) == want


@pytest.mark.parametrize("D,dtype,capability,aligned,want", [
    (128, torch.bfloat16, (9, 0), True, True),       # Hopper: any page size
    (64, torch.float16, (10, 0), True, True),
    (96, torch.bfloat16, (9, 0), True, False),       # a tile row is not a box of D
    (128, torch.float32, (9, 0), True, False),
    (128, torch.bfloat16, (8, 0), True, False),      # Ampere
    (128, torch.bfloat16, (9, 0), False, False),     # rows not 16-byte aligned
])
def test_prefill_tma_rows_table(D, dtype, capability, aligned, want):
    assert prefill_tma_rows(D, dtype, capability, aligned) == want


@pytest.mark.parametrize("P,page_stride,S,F,N,row_stride,want", [
    (8192, 16 * 1024, 16, 1024, 8192, 1024, False),           # Llama-3-8B, one layer's pool
    (131073, 16 * 1024, 16, 1024, 8192, 1024, True),          # pages past 2**31 elements
    (131072, 16 * 1024, 16, 1024, 0, 0, False),               # the last page ends at 2**31
    (131072, 16 * 1024 + 1, 16, 1024, 0, 0, True),
    (8192, 2 * 16 * 1024, 16, 1024, 0, 0, False),             # an interleaved pool
    (8, 16 * 1024, 16, 1024, 2**21 + 1, 1024, True),          # new rows past 2**31 elements
    (8, 16 * 1024, 16, 1024, 2**21, 1024, False),
])
def test_prefill_off64_table(P, page_stride, S, F, N, row_stride, want):
    assert prefill_off64(P, page_stride, S, F, N, row_stride) == want


@pytest.mark.parametrize("programs,max_ctx,block_n,sms,want", [
    (128, 8192, 64, 132, 1),        # Llama-3-8B, 512-token chunks: a wave already
    (116, 16896, 64, 132, 1),       # Qwen2.5-7B, 512 over 16k: 0.88 of a wave
    (32, 16896, 64, 132, 4),        # a 128-token chunk over 16k: 4 splits fill one wave
    (8, 16896, 64, 132, 8),         # at most MAX_SPLITS
    (8, 1024, 64, 132, 2),          # short contexts: 8 key tiles a split at least
    (8, 256, 64, 132, 1),
    (0, 4096, 64, 4, 4),            # the interpreter's 4 SMs
])
def test_prefill_splits_table(programs, max_ctx, block_n, sms, want):
    assert prefill_splits(programs, max_ctx, block_n, sms) == want


@settings(max_examples=8)
@given(drawn=cases(reference=True))
def test_reference_matches_oracle(poison, drawn):
    dims, window, extra, seed = drawn
    case = make_case(*dims, device="cpu", seed=seed, window=window, **extra)
    out, lse = paged_prefill_attention_ref(**case, window=window)
    check_against_oracle(out, lse, case, case_id(*dims, window, extra), window)


# every G, D and S of the issue at least once, on the default launch rule
@pytest.mark.parametrize("G,D,S,window", [
    (1, 64, 8, 0), (2, 96, 16, 0), (3, 128, 64, 20), (4, 256, 8, 1), (7, 64, 64, 9),
    (8, 128, 16, 0),
])
def test_every_group_and_head_dim(kernel_device, poison, G, D, S, window):
    """Chunk lengths 1, 2, 3, 4, 6 over an empty prefix, a page-boundary prefix, one off it
    either way and one inside the second page; bfloat16 (float16 at D 96), a padding row."""
    chunks = [(0, 1), (S, 2), (S - 1, 3), (S + 1, 4), (S + 5, 6)]
    dtype = torch.float16 if D == 96 else torch.bfloat16
    case = make_case(chunks, S, 2 if G < 7 else 1, G, D, dtype, kernel_device, seed=G * D + S,
                     window=window, pad=1)
    with kvops.backend("triton"):
        out, lse = torch.ops.kvops.paged_prefill_attention(**case, window=window)
    check_against_oracle(out, lse, case, f"G{G}-D{D}-S{S}-win{window}", window)


def test_chunk_lengths_one_to_n(kernel_device):
    """One call whose sequences take chunk lengths 1..8 over one prefix length each, and one
    whole prefill (no prefix) of 24 tokens split across tile edges."""
    S = 16
    chunks = [(b * 7 % 40, b + 1) for b in range(8)] + [(0, 24)]
    case = make_case(chunks, S, 2, 4, 64, torch.float16, kernel_device, seed=12)
    with kvops.backend("triton"):
        out, lse = torch.ops.kvops.paged_prefill_attention(**case)
    check_against_oracle(out, lse, case, "chunks-1..8")


def test_chunked_equals_whole_prefill(kernel_device):
    """A 48-token sequence prefilled in chunks of 16 (each over the prefix written before)
    gives the rows of one 48-token prefill."""
    S = 8
    whole = make_case([(0, 48)], S, 2, 2, 64, torch.float32, kernel_device, seed=3)
    with kvops.backend("triton"):
        want, want_lse = torch.ops.kvops.paged_prefill_attention(**whole)
        for start in range(0, 48, 16):
            part = dict(whole, q=whole["q"][start:start + 16],
                        query_start=torch.tensor([0, 16], dtype=torch.int32, device=kernel_device),
                        seq_lens=torch.tensor([start + 16], dtype=torch.int32,
                                              device=kernel_device))
            got, lse = torch.ops.kvops.paged_prefill_attention(**part)
            torch.testing.assert_close(got, want[start:start + 16], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, want_lse[start:start + 16], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 24])
def test_same_visibility_as_the_decode_ops(kernel_device, window):
    """A one-token chunk at position p is a decode step: equal to elastic_attention over the
    table (no window), and, with a window W, to static_sliding_attention over a ring arena
    holding the last W tokens (win_len = min(W, p + 1))."""
    S, Hkv, G, D = 8, 2, 4, 64
    chunks = [(0, 1), (5, 1), (23, 1), (24, 1), (61, 1)]
    case = make_case(chunks, S, Hkv, G, D, torch.float32, "cpu", seed=window, window=window)
    for c in (case["k_cache"], case["v_cache"]):
        c.nan_to_num_(0.0)
    P = case["k_cache"].shape[0]        # elastic_attention's reference gathers the whole table
    case["block_table"].masked_fill_(case["block_table"] >= P, -1)
    with kvops.backend("triton"):
        dev = {n: t.to(kernel_device) for n, t in case.items()}
        got, got_lse = torch.ops.kvops.paged_prefill_attention(**dev, window=window)
    if window == 0:
        want, want_lse = torch.ops.kvops.elastic_attention(
            case["q"], case["k_cache"], case["v_cache"], case["block_table"], case["seq_lens"])
    else:
        B, W = len(chunks), window
        k = torch.zeros(B, W, Hkv, D)
        v = torch.zeros(B, W, Hkv, D)
        win_len = torch.zeros(B, dtype=torch.int32)
        win_start = torch.zeros(B, dtype=torch.int32)
        for b, (prefix, _) in enumerate(chunks):
            p = prefix
            first = max(0, p - W + 1)
            for j in range(first, p + 1):             # ring slot j % W
                page = int(case["block_table"][b, j // S])
                k[b, j % W], v[b, j % W] = case["k_cache"][page, j % S], case["v_cache"][page,
                                                                                          j % S]
            win_len[b] = p + 1 - first
            win_start[b] = first % W
        want, want_lse = torch.ops.kvops.static_sliding_attention(case["q"], k, v, win_start,
                                                                  win_len)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse.cpu(), want_lse, atol=1e-5, rtol=1e-5)


def test_base_pages_are_read_as_target_bytes(kernel_device):
    """The BASE rule: prefill reads every page as TARGET. A page packed by pack_base_pairs is
    read as the TARGET-dtype values its bytes spell (the oracle over the packed pool), not
    through the codec; so a caller promotes a prefix's BASE blocks before prefilling it."""
    S, Hkv, G, D = 16, 2, 2, 64
    case = make_case([(2 * S, S)], S, Hkv, G, D, torch.float16, "cpu", seed=4)
    pages = case["block_table"][0, :2].tolist()
    for c in (case["k_cache"], case["v_cache"]):
        c.nan_to_num_(0.0)
        back = torch.empty((1, 2, S, Hkv, D), dtype=torch.uint8)
        torch.ops.kvops.pack_base_pairs(c, torch.tensor([[pages[0], pages[1], pages[0]]],
                                                        dtype=torch.int32), back)
    dev = {n: t.to(kernel_device) for n, t in case.items()}
    with kvops.backend("triton"):
        out, lse = torch.ops.kvops.paged_prefill_attention(**dev)
    check_against_oracle(out, lse, case, "base-as-target")


def test_fidelity_promotes_before_a_prefill_reads_the_prefix():
    """The BASE rule with the policy: after a demotion the session's span is BASE and a prefill
    over it would read BASE bytes as TARGET (wrong); promoted and settled (the caller's step
    before prefilling), the next chunk's prefill over the whole prefix equals the float64
    oracle over the session's true K/V."""
    from tests.test_fidelity import World, start

    torch.manual_seed(3)
    w = World(dtype=torch.float16, min_batch=4, protect_recent=1)
    S, Hkv, D = w.S, w.k.shape[2], w.k.shape[3]
    start(w, {"a": 9 * S + 3, "b": 4 * S})
    with w.pager.frame() as f:
        w.fid.step(f, need=w.pager.free_pages + 4)
    assert w.fid.span("a")[1] > w.fid.span("a")[0]

    def prefill(q):
        slot = w.pager.slot("a")
        t = w.pager.device_tables
        case = dict(q=q, k_cache=w.k, v_cache=w.v, block_table=t["block_table"][slot:slot + 1],
                    query_start=torch.tensor([0, q.shape[0]], dtype=torch.int32),
                    seq_lens=t["seq_lens"][slot:slot + 1].clone())
        tk, tv = w.truth["a"]
        n = tk.shape[0]
        blocks = -(-n // S)
        dense_k = torch.zeros(blocks * S, Hkv, D, dtype=w.dtype)
        dense_v = torch.zeros_like(dense_k)
        dense_k[:n], dense_v[:n] = tk, tv
        want = paged_prefill_oracle(q, dense_k.view(blocks, S, Hkv, D),
                                    dense_v.view(blocks, S, Hkv, D),
                                    torch.arange(blocks, dtype=torch.int32)[None],
                                    case["query_start"], case["seq_lens"])
        return torch.ops.kvops.paged_prefill_attention(**case), want

    q = torch.randn(4, 2 * Hkv, D).half()
    (out, _), (want, _) = prefill(q)            # the last 4 tokens, BASE blocks in the prefix
    assert (out.double() - want).abs().max() > 0.05
    with w.pager.frame() as f:
        w.fid.promote(f, "a")
    with w.pager.frame() as f:
        w.fid.step(f, need=0)
    assert w.fid.span("a") == (0, 0)
    with w.pager.frame() as f:
        grown = w.grow(f, "a", 5)
    w.write(*grown, f.result.copies)
    q = torch.randn(5, 2 * Hkv, D).half()
    (out, lse), (want, want_lse) = prefill(q)
    assert_close("out", out, want, *ATTN_TOL[torch.float16], "promoted")
    assert_close("lse", lse, want_lse, LSE_TOL[torch.float16], LSE_TOL[torch.float16], "promoted")


@pytest.mark.parametrize("N,B,G,D,dtype,want", [
    (8192, 1, 4, 128, torch.bfloat16, (128, 64, 8, 3)),     # a long prefill, Llama-3-8B
    (512, 1, 7, 128, torch.bfloat16, (128, 64, 8, 3)),      # Qwen2.5-7B: 18 tokens a tile
    (128, 128, 4, 128, torch.bfloat16, (16, 64, 4, 3)),     # one token a sequence
    (256, 16, 4, 128, torch.float16, (64, 64, 4, 3)),       # 16-token chunks
    (4096, 2, 8, 256, torch.bfloat16, (64, 32, 4, 2)),      # D 256
    (4096, 2, 4, 128, torch.float32, (64, 32, 4, 2)),
    (1, 1, 32, 64, torch.float16, (32, 64, 4, 3)),          # one token: the group's 32 rows
])
def test_prefill_tile_table(N, B, G, D, dtype, want):
    assert prefill_tile(N, B, G, D, dtype) == want


@pytest.mark.parametrize("N,B,G,D,dtype,want", [
    (8192, 1, 4, 128, torch.bfloat16, (64, 64, 4, 3)),      # one warpgroup, 64 rows
    (128, 128, 4, 128, torch.bfloat16, (16, 64, 4, 3)),
    (4096, 2, 8, 256, torch.bfloat16, (64, 32, 4, 2)),
])
def test_prefill_tile_table_with_tma(N, B, G, D, dtype, want):
    assert prefill_tile(N, B, G, D, dtype, tma=True) == want


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_padding_and_empty_calls(kernel_device, poison, backend):
    """Rows after query_start[B] get 0 / -inf; no sequences at all (B 0) and no rows (N 0)."""
    case = make_case([(3, 2)], 8, 1, 2, 32, torch.float16, kernel_device, seed=1, pad=5)
    with kvops.backend(backend):
        out, lse = torch.ops.kvops.paged_prefill_attention(**case)
        assert bool((out[2:] == 0).all()) and bool(torch.isneginf(lse[2:]).all())
        assert bool(torch.isfinite(lse[:2]).all())
        none = dict(case, block_table=case["block_table"][:0],
                    query_start=case["query_start"][:1].zero_(), seq_lens=case["seq_lens"][:0])
        out, lse = torch.ops.kvops.paged_prefill_attention(**none)
        assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
        empty = dict(case, q=case["q"][:0], query_start=torch.zeros_like(case["query_start"]))
        out, lse = torch.ops.kvops.paged_prefill_attention(**empty)
        assert out.shape == (0, 2, 32) and lse.shape == (0, 2)


def test_op_dispatch_and_opcheck(kernel_device):
    case = make_case([(5, 3), (0, 4)], 8, 2, 2, 32, torch.float16, "cpu", seed=10, pad=1)
    for c in (case["k_cache"], case["v_cache"]):
        c.nan_to_num_(0.0)          # opcheck compares outputs through NaN-sensitive paths
    torch.library.opcheck(torch.ops.kvops.paged_prefill_attention.default, (),
                          dict(case, scale=0.2, window=4))
    dev = {n: t.to(kernel_device) for n, t in case.items()}
    with kvops.backend("triton"):
        out, lse = torch.ops.kvops.paged_prefill_attention(**dev, scale=0.2, window=4)
    want, want_lse = paged_prefill_attention_ref(**case, scale=0.2, window=4)
    assert_close("out", out, want, *ATTN_TOL[torch.float16], "op")
    assert_close("lse", lse, want_lse, LSE_TOL[torch.float16], LSE_TOL[torch.float16], "op")


def test_compiled_prefill_steps_never_recompile():
    """Steps with new chunk lengths, prefixes, tables and values at fixed shapes (N rows, B
    sequences, a fixed pool): one compile; each equals the reference."""
    torch._dynamo.reset()
    backend, calls = counting_backend()

    @torch.compile(backend=backend, fullgraph=True)
    def step(x, k_cache, v_cache, block_table, query_start, seq_lens):
        out, lse = torch.ops.kvops.paged_prefill_attention(x * 0.5, k_cache, v_cache,
                                                           block_table, query_start, seq_lens,
                                                           window=6)
        return out * 2, lse

    gen = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(5):
            a = int(torch.randint(1, 9, (1,), generator=gen))
            chunks = [(int(torch.randint(0, 20, (1,), generator=gen)), a), (t, 10 - a)]
            case = make_case(chunks, 8, 2, 2, 32, torch.float16, "cpu", seed=t, pool_pages=12,
                             spare_blocks=4 - max(-(-(p + n) // 8) for p, n in chunks))
            for c in (case["k_cache"], case["v_cache"]):
                c.nan_to_num_(0.0)
            x = case.pop("q") * 2
            got, lse = step(x, **case)
            want, want_lse = paged_prefill_attention_ref(x * 0.5, **case, window=6)
            torch.testing.assert_close(got, want * 2)
            torch.testing.assert_close(lse, want_lse)
    assert len(calls) == 1


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_graph_replay_with_new_lengths(dtype):
    """One captured call (Llama-3-8B heads, 4 sequences, 192 rows), replayed with new chunk
    lengths, prefixes and tables: each replay equals the oracle."""
    S, pool = 16, 96

    def fresh(seed):
        gen = torch.Generator().manual_seed(seed)
        cuts = sorted(torch.randint(0, 190, (3,), generator=gen).tolist())
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [190])]
        chunks = [(int(torch.randint(0, 96, (1,), generator=gen)), n) for n in sizes]
        L = max(-(-(p + n) // S) for p, n in chunks)
        return make_case(chunks, S, 8, 4, 128, dtype, "cuda", seed=seed, pad=2,
                         pool_pages=pool, spare_blocks=20 - L)

    static = fresh(1)
    graph, (out, lse) = capture_graph(lambda: torch.ops.kvops.paged_prefill_attention(**static))
    for seed in (2, 3, 4):
        case = fresh(seed)
        for n, t in case.items():
            static[n].copy_(t)
        graph.replay()
        check_against_oracle(out, lse, case, f"graph{seed}")


@requires_cuda
@pytest.mark.parametrize("S", [16, 64], ids=["S16", "S64"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_long_prefill_on_cuda(D, S, descriptors):
    """Default launch shapes on a real GPU: 400 new tokens over a 300-token prefix and a
    second sequence sharing it, bf16; pages of 64 take the descriptor path on Hopper."""
    case = make_case([(300, 400), (300, 100)], S, 2, 4, D, torch.bfloat16, "cuda", seed=D)
    out, lse = torch.ops.kvops.paged_prefill_attention(**case)
    tma = prefill_tma(S, D, torch.bfloat16, torch.cuda.get_device_capability(), True)
    assert len(descriptors) == (2 if tma else 0)
    check_against_oracle(out, lse, case, f"long-D{D}-S{S}")


@requires_cuda
def test_pool_past_int32_offsets_on_cuda():
    """A pool of more than 2**31 elements (8 GiB of K and V at pages of 16, Llama-3-8B's KV
    heads): the plan takes 64-bit offsets, and pages whose offsets are all past 2**31 read
    right."""
    case = make_case([(300, 200), (40, 100)], 16, 8, 4, 128, torch.bfloat16, "cuda", seed=7)
    small = case["k_cache"].shape[0]
    P = 2**31 // (16 * 1024) + small             # every case page at an offset past 2**31
    if torch.cuda.get_device_properties(0).total_memory < 3 * P * 16 * 1024 * 2:
        pytest.skip("needs about 12 GiB of GPU memory")
    big = {}
    for name in ("k_cache", "v_cache"):
        big[name] = torch.full((P, 16, 8, 128), float("nan"), dtype=torch.bfloat16,
                               device="cuda")
        big[name][P - small:] = case[name]      # the case's pages at the pool's end
    table = case["block_table"].clone()
    ok = (table >= 0) & (table < small)
    table[ok] += P - small
    table[~ok] = -1
    moved = dict(case, block_table=table, **big)
    prefill_kernel._PLANS.clear()
    out, lse = torch.ops.kvops.paged_prefill_attention(**moved)
    assert [p.launch.meta["OFF64"] for p in prefill_kernel._PLANS.values()] == [True]
    check_against_oracle(out, lse, case, "past-int32")


@requires_cuda
@pytest.mark.parametrize("S", [16, 64], ids=["S16", "S64"])
def test_new_rows_on_cuda(S):
    """Default launch shapes on a real GPU with the new tokens' rows: on Hopper the rule reads
    the chunks' own tiles through descriptors at any page size; the pool's chunk rows in those
    tiles are NaN."""
    case = make_case([(300, 400), (300, 100), (0, 333)], S, 8, 4, 128, torch.bfloat16, "cuda",
                     seed=S)
    k, v = new_rows(case)
    out, lse = torch.ops.kvops.paged_prefill_attention(**poison_chunk_tiles(case, 64)[0], k=k, v=v)
    check_against_oracle(out, lse, case, f"new-rows-S{S}")


@requires_cuda
@pytest.mark.parametrize("S,rows", [(64, False), (16, True), (64, True)],
                         ids=["S64", "S16-rows", "S64-rows"])
def test_tma_cuda_graph_replay_with_new_lengths(S, rows):
    """The descriptor paths (pool descriptors at pages of 64, the chunk's own rows at any page
    size, where the GPU has a tensor copy engine) captured once and replayed with new chunk
    lengths, prefixes, tables and rows."""
    pool = 40 if S == 64 else 160

    def fresh(seed):
        gen = torch.Generator().manual_seed(seed)
        chunks = [(int(torch.randint(0, 200, (1,), generator=gen)),
                   int(torch.randint(1, 150, (1,), generator=gen))) for _ in range(3)]
        L = max(-(-(p + n) // S) for p, n in chunks)
        return make_case(chunks, S, 8, 4, 128, torch.bfloat16, "cuda", seed=seed, pad=2,
                         pool_pages=pool, spare_blocks=(8 if S == 64 else 24) - L)

    def with_rows(case):
        return dict(case, **dict(zip(("k", "v"), new_rows(case, garbage=0.0)))) if rows else case

    static = with_rows(fresh(1))
    N = 3 * 150 + 2
    for name in ("q", "k", "v") if rows else ("q",):
        static[name] = torch.zeros(N, *static[name].shape[1:], dtype=torch.bfloat16,
                                   device="cuda")
    graph, (out, lse) = capture_graph(lambda: torch.ops.kvops.paged_prefill_attention(**static))
    for seed in (2, 3, 4):
        case = with_rows(fresh(seed))
        n = case["q"].shape[0]
        for name, t in case.items():
            if name in ("q", "k", "v"):
                static[name].zero_()
                static[name][:n].copy_(t)
            else:
                static[name].copy_(t)
        graph.replay()
        check_against_oracle(out[:n], lse[:n],
                             {name: t for name, t in case.items() if name not in ("k", "v")},
                             f"tma-graph{seed}-S{S}-rows{rows}")


@requires_cuda
@pytest.mark.parametrize("S,rows", [(64, False), (16, True), (64, True)],
                         ids=["pool", "rows-S16", "pool-and-rows"])
def test_tma_direct_launch_matches_the_jit(monkeypatch, descriptors, S, rows):
    """A descriptor plan (pool descriptors at pages of 64, the chunk's own rows at any page
    size) launched through the compiled launcher (``_launch``: the JIT's first call keeps the
    binary, the second goes direct, and this test's plans are the ones that must) gives the
    JIT's rows bit for bit, with fresh pools, tables and rows between calls (the descriptors
    are made each call)."""
    from kvops.kernels import _launch
    if not prefill_tma(64, 128, torch.bfloat16, torch.cuda.get_device_capability(), True):
        pytest.skip("no tensor copy engine on this GPU")
    monkeypatch.setattr(prefill_kernel, "_PLANS", {})
    monkeypatch.setattr(prefill_kernel, "GLUON", False)
    cases = [make_case([(130, 70), (0, 200), (64, 1)], S, 8, 4, 128, torch.bfloat16, "cuda",
                       seed=seed, pool_pages=12 if S == 64 else 40) for seed in (1, 2, 3)]
    if rows:
        cases = [dict(c, **dict(zip(("k", "v"), new_rows(c, garbage=0.0)))) for c in cases]
    monkeypatch.setattr(prefill_kernel, "TMA_DIRECT", False)
    want = [torch.ops.kvops.paged_prefill_attention(**case) for case in cases]
    monkeypatch.setattr(prefill_kernel, "TMA_DIRECT", True)
    monkeypatch.setattr(prefill_kernel, "_PLANS", {})
    descriptors.clear()
    got = [torch.ops.kvops.paged_prefill_attention(**case) for case in cases]
    torch.cuda.synchronize()
    assert len(descriptors) == (6 if S == 64 else 0)
    plans = list(prefill_kernel._PLANS.values())
    assert plans and all(p.launch.meta["NEW"] == rows and p.launch.meta["NEW_TMA"] == rows
                         for p in plans)
    if _launch._STATE["direct"]:
        kernel = id(prefill_kernel._paged_prefill_kernel)
        for plan in plans:
            token = plan.launch.key
            assert token is not None
            assert _launch._BINS[(kernel, token)][2] in ("c", "tail", "plain")
    for (o, lse), (wo, wl) in zip(got, want):
        assert torch.equal(o, wo) and torch.equal(lse, wl)


@pytest.mark.parametrize("capability,dtype,D,S,window,rows,aligned,splits,want", [
    ((9, 0), torch.bfloat16, 128, 64, 0, True, True, 1, True),
    ((9, 0), torch.float16, 64, 128, 0, True, True, 1, True),
    ((9, 0), torch.bfloat16, 128, 192, 0, True, True, 1, True),    # three boxes a page
    ((9, 0), torch.bfloat16, 128, 16, 0, True, True, 1, True),     # eight pages a key tile
    ((9, 0), torch.bfloat16, 128, 96, 0, True, True, 1, True),     # boxes of 32 rows
    ((9, 0), torch.bfloat16, 128, 48, 0, True, True, 1, True),     # boxes of 16 rows
    ((9, 0), torch.bfloat16, 128, 8, 0, True, True, 1, False),     # boxes under 16 rows
    ((9, 0), torch.bfloat16, 128, 24, 0, True, True, 1, False),
    ((9, 0), torch.bfloat16, 256, 64, 0, True, True, 1, False),    # the accumulators' registers
    ((9, 0), torch.bfloat16, 96, 64, 0, True, True, 1, False),
    ((9, 0), torch.float32, 128, 64, 0, True, True, 1, False),
    ((9, 0), torch.bfloat16, 128, 64, 32, True, True, 1, False),   # a window
    ((9, 0), torch.bfloat16, 128, 64, 0, False, True, 1, False),   # no rows
    ((9, 0), torch.bfloat16, 128, 64, 0, True, False, 1, False),   # misaligned
    ((9, 0), torch.bfloat16, 128, 64, 0, True, True, 4, False),    # a split call
    ((10, 0), torch.bfloat16, 128, 64, 0, True, True, 1, False),   # no warpgroup MMA
    ((8, 0), torch.bfloat16, 128, 64, 0, True, True, 1, False),
])
def test_prefill_gluon_table(capability, dtype, D, S, window, rows, aligned, splits, want):
    assert prefill_gluon(capability, dtype, D, S, window, rows, aligned, splits) == (
        want and HAVE_GLUON)


@pytest.mark.parametrize("tiles,want", [(1, True), (65535, True), (65536, False)])
def test_prefill_gluon_tiles_fit_the_grid(tiles, want):
    assert prefill_gluon((9, 0), torch.bfloat16, 128, 64, 0, True, True, 1, tiles) == (
        want and HAVE_GLUON)


def test_forced_gluon_refuses_what_it_cannot_run():
    case = make_case([(5, 3)], 64, 2, 2, 64, torch.bfloat16, "cpu", seed=0)
    k, v = new_rows(case)
    with pytest.raises(ValueError, match="gluon: expected an sm_90 device"):
        paged_prefill_attention_fwd(**case, k=k, v=v, gluon=True)


@pytest.mark.skipif(not HAVE_GLUON, reason="no Gluon Hopper ops in this triton")
def test_gluon_descriptors_equal_the_checked_ones():
    """The Gluon launch's descriptors, made without ``TensorDescriptor.__post_init__``, hold
    field for field what the checked constructor makes (rows, an interleaved pool's K half)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    import kvops.kernels.paged_prefill_gluon as g
    rows = torch.randn(40, 2, 64, dtype=torch.bfloat16)[:37]
    pool = torch.randn(6, 2, 64, 2, 64, dtype=torch.float16)[:, 0]
    want_rows = TensorDescriptor(rows, [37, 128], [128, 1], [128, 64],
                                 g._layout(128, 64, torch.bfloat16))
    # pages 128 rows of Hkv * D = 128 apart (K and V interleaved), the last page 64 rows
    want_pool = TensorDescriptor(pool, [5 * 128 + 64, 128], [128, 1],
                                 [64, 64], g._layout(64, 64, torch.float16))
    assert g._descriptor(rows, *g._rows(rows), [128, 64],
                         g._layout(128, 64, torch.bfloat16)) == want_rows
    assert g._descriptor(pool, *g._pool(pool), [64, 64],
                         g._layout(64, 64, torch.float16)) == want_pool


@pytest.mark.skipif(not HAVE_GLUON, reason="no Gluon Hopper ops in this triton")
def test_gluon_launch_passes_each_kernel_parameter(monkeypatch):
    """The host side of the Gluon path on the CPU (the rule told it is on an sm_90 device):
    the plan keeps the launch's grid, ints and constants, and a call hands the kernel each
    parameter by name, twice over one plan."""
    import kvops.kernels.paged_prefill_gluon as g
    from kvops.kernels import _launch
    monkeypatch.setattr(prefill_kernel, "_PLANS", {})
    monkeypatch.setattr(prefill_kernel, "nvidia_ptx", lambda device: True)
    monkeypatch.setattr(prefill_kernel, "cuda_capability", lambda device: (9, 0))
    launches = []
    monkeypatch.setattr(_launch, "launch", lambda kernel, grid, key, args, meta: launches.append(
        (kernel, grid, key, args, meta)))
    case = make_case([(70, 200), (0, 9)], 64, 2, 4, 128, torch.bfloat16, "cpu", seed=3)
    k, v = new_rows(case, garbage=0.0)
    for _ in range(2):
        out, lse = paged_prefill_attention_fwd(**case, k=k, v=v, scale=0.1)
    assert out.shape == (209, 8, 128) and lse.shape == (209, 8)
    assert len(prefill_kernel._PLANS) == 1 and len(launches) == 2
    kernel, grid, key, args, meta = launches[-1]
    plan, = prefill_kernel._PLANS.values()
    assert kernel is g._paged_prefill_gluon_kernel and key is plan.launch.key
    named = dict(zip(kernel.arg_names, args))
    assert len(args) + 2 == len(kernel.arg_names) and set(meta) == {"HQ", "G", "num_warps",
                                                                    "maxnreg"}
    P = case["k_cache"].shape[0]
    L = case["block_table"].shape[1]
    assert grid == (8, 209 // 128 + 2 + 1) and named["num_tiles"] == grid[1]
    assert (named["N"], named["B"], named["P"], named["L"], named["S"]) == (209, 2, P, L, 64)
    assert named["page_rows"] == 64 and named["pool_rows"] == (P - 1) * 64 + 64
    assert named["stride_bt"] == L and named["scale_log2"] == pytest.approx(0.1 * 1.4426950408)
    assert named["out_ptr"] is out and named["lse_ptr"] is lse
    assert named["q_desc"].base is case["q"] and named["kn_desc"].base is k
    assert named["vp_desc"].base is case["v_cache"] and named["o_desc"].base is out
    assert named["q_desc"].block_shape == [64, 128] and named["kp_desc"].block_shape == [64, 128]
    assert named["vn_desc"].block_shape == [128, 128] and named["o_desc"].shape == [209, 1024]
    assert (meta["HQ"], meta["G"]) == (8, 4)


def _gluon_gpu() -> bool:
    return (torch.cuda.is_available() and prefill_gluon(
        torch.cuda.get_device_capability(), torch.bfloat16, 128, 64, 0, True, True, 1))


@pytest.fixture
def gluon_calls(monkeypatch):
    """Counts the Gluon kernel's launches (skips where the GPU cannot run it)."""
    if not _gluon_gpu():
        pytest.skip("needs an sm_90 GPU and Gluon's Hopper ops")
    made = []
    real = prefill_kernel.paged_prefill_gluon_fwd

    def spy(*args):
        made.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(prefill_kernel, "paged_prefill_gluon_fwd", spy)
    return made


@pytest.mark.parametrize("chunks,S,G,D,dtype,hole,interleaved,pad", [
    ([(0, 1)], 64, 4, 128, torch.bfloat16, False, False, 0),
    ([(0, 130), (64, 64), (63, 200), (129, 7)], 64, 4, 128, torch.bfloat16, False, False, 3),
    ([(0, 130), (64, 64), (63, 200), (129, 7)], 64, 7, 64, torch.float16, True, True, 3),
    ([(300, 400), (300, 100), (0, 333)], 64, 4, 128, torch.bfloat16, True, False, 0),
    ([(300, 400), (300, 100), (0, 333)], 128, 1, 128, torch.float16, False, True, 2),
    ([(1000, 129), (5, 256), (0, 0), (191, 1)], 128, 2, 64, torch.bfloat16, True, False, 5),
    ([(0, 130), (64, 64), (63, 200), (129, 7)], 16, 4, 128, torch.bfloat16, True, False, 3),
    ([(300, 400), (300, 100), (0, 333)], 32, 2, 64, torch.float16, True, True, 0),
    ([(1000, 129), (5, 256), (0, 0), (191, 1)], 48, 4, 128, torch.bfloat16, False, False, 2),
    ([(300, 400), (64, 64), (0, 333)], 16, 8, 64, torch.bfloat16, False, True, 1),
], ids=["one-token", "mixed", "mixed-hole-interleaved", "long", "long-S128", "far-prefix",
        "mixed-hole-S16", "long-hole-interleaved-S32", "far-prefix-S48", "mixed-interleaved-S16-D64"])
def test_gluon_kernel_matches_oracle(gluon_calls, chunks, S, G, D, dtype, hole, interleaved, pad):
    """The Gluon kernel (the rule's choice on sm_90 with the chunk's rows, forced here) against the float64
    oracle: empty, page-boundary and mid-page prefixes, a shared prefix, chunks of 1 to 400
    tokens (ending mid-tile, so the next sequence's rows sit in a tile), an empty chunk, holes
    (an unmapped prefix page is left out; an unmapped chunk page sends that sequence's chunk
    through the pages), interleaved pools, padding rows, every pool row at a chunk's positions
    NaN (the rows are read, not the pages) and NaN in every row no query may see."""
    case = make_case(chunks, S, 2, G, D, dtype, "cuda", seed=S + D + G, pad=pad, hole=hole,
                     interleaved=interleaved)
    k, v = new_rows(case)
    poisoned, _ = poison_chunk_tiles(case, 1)
    gluon_calls.clear()
    # forced: the rule would split the far prefix's few tiles through the Triton kernel
    out, lse = paged_prefill_attention_fwd(**poisoned, k=k, v=v, gluon=True)
    assert gluon_calls
    check_against_oracle(out, lse, case, f"gluon-{chunks}-S{S}-G{G}-D{D}-{dtype}-{hole}")


@pytest.mark.parametrize("block", [540, 563], ids=["prefix", "chunk"])
def test_gluon_finds_a_hole_past_the_first_page_block(gluon_calls, block):
    """A 9064-token sequence at pages of 16 (567 page ids: the page check's second block of
    512) with one unmapped page there, in the prefix (its keys left out, the chunk from its
    rows) or among the chunk's keys (the chunk from its pages), against the oracle."""
    case = make_case([(9000, 64)], 16, 2, 4, 128, torch.bfloat16, "cuda", seed=block)
    case["block_table"][0, block] = -1
    k, v = new_rows(case)
    out, lse = paged_prefill_attention_fwd(**case, k=k, v=v, gluon=True)
    assert gluon_calls
    check_against_oracle(out, lse, case, f"gluon-hole-block-{block}")


def test_gluon_direct_launch_matches_the_jit(gluon_calls, monkeypatch):
    """The Gluon kernel launched through its compiled launcher (``_launch``: the first call of
    a signature goes through the JIT, the next ones direct) gives the JIT's rows bit for bit,
    with fresh pools, tables and rows between calls (each address's descriptors encoded once a
    position), and each plan calls the C entry itself under triton 3.6."""
    from kvops.kernels import _launch
    monkeypatch.setattr(prefill_kernel, "_PLANS", {})
    # this test's binaries only: another test's one-call signature keeps no convention yet
    monkeypatch.setattr(_launch, "_BINS", {})
    cases = [make_case([(130, 70), (0, 200), (64, 1)], 64, 8, 4, 128, torch.bfloat16, "cuda",
                       seed=seed, pool_pages=12) for seed in (1, 2, 3)]
    cases = [dict(c, **dict(zip(("k", "v"), new_rows(c, garbage=0.0)))) for c in cases]
    monkeypatch.setitem(_launch._STATE, "direct", False)
    want = [torch.ops.kvops.paged_prefill_attention(**case) for case in cases]
    monkeypatch.setitem(_launch._STATE, "direct", True)
    got = [torch.ops.kvops.paged_prefill_attention(**case) for case in cases]
    torch.cuda.synchronize()
    assert len(gluon_calls) == 6
    from kvops.kernels.paged_prefill_gluon import _paged_prefill_gluon_kernel
    modes = [v[2] for (k, _), v in _launch._BINS.items() if k == id(_paged_prefill_gluon_kernel)]
    assert modes and all(m in ("c", "tail", "plain", "jit") for m in modes), modes
    for (o, lse), (wo, wl) in zip(got, want):
        assert torch.equal(o, wo) and torch.equal(lse, wl)
    again = [torch.ops.kvops.paged_prefill_attention(**case) for case in cases]   # kept maps
    for (o, lse), (wo, wl) in zip(again, want):
        assert torch.equal(o, wo) and torch.equal(lse, wl)
    import triton
    if triton.__version__.startswith("3.6"):      # the direct form this launch is built for
        runs = [p.launch for p in prefill_kernel._PLANS.values()
                if p.gluon]
        assert runs and all(isinstance(r._c, tuple) for r in runs), [r._c for r in runs]


def test_gluon_chunk_longer_than_its_context_finishes(gluon_calls):
    """Outside validation mode a chunk with more queries than its context (bad input: 400
    queries over a table of one 64-token page) finishes, as in the Triton kernel: rows at
    negative positions see no key (out 0, lse -inf), the last 64 rows see the page's keys up
    to their own position, and no tile waits on a load that never comes (the first tiles have
    no key at all)."""
    case = make_case([(0, 400)], 64, 2, 4, 128, torch.bfloat16, "cuda", seed=5)
    k, v = new_rows(case, garbage=0.0)
    bad = dict(case, block_table=case["block_table"][:, :1].contiguous(),
               seq_lens=torch.tensor([64], dtype=torch.int32, device="cuda"))
    out, lse = paged_prefill_attention_fwd(**bad, k=k, v=v, gluon=True)
    torch.cuda.synchronize()
    assert gluon_calls
    assert torch.isneginf(lse[:336]).all() and (out[:336] == 0).all()
    assert torch.isfinite(lse[336:]).all() and torch.isfinite(out.float()).all()


def test_gluon_and_triton_kernels_agree_on_an_8k_prefill(gluon_calls):
    """One 8k prefill from nothing and its last 512-token chunk over a 7.5k prefix, at
    Llama-3-8B's heads, at pages of 64 and of 16 (the engine's): the Gluon kernel's rows within
    bf16 rounding of the Triton kernel's."""
    for S, prefix, new in ((64, 0, 8192), (64, 7680, 512), (16, 7680, 512)):
        case = make_case([(prefix, new)], S, 8, 4, 128, torch.bfloat16, "cuda", seed=new)
        k, v = new_rows(case)
        got = paged_prefill_attention_fwd(**case, k=k, v=v)
        want = paged_prefill_attention_fwd(**case, k=k, v=v, gluon=False)
        assert_close("out", got[0].float(), want[0].float(), 2e-2, 2e-2, f"S{S} {prefix}+{new}")
        assert_close("lse", got[1], want[1], 1e-3, 1e-3, f"S{S} {prefix}+{new}")
    assert len(gluon_calls) == 3


def _bad_inputs():
    ok = make_case([(5, 3), (0, 4)], 8, 2, 2, 32, torch.float16, "cpu", seed=0)
    yield "q-rank", dict(ok, q=ok["q"][0]), ValueError, "q: expected rank 3"
    yield "q-dtype", dict(ok, q=ok["q"].double()), TypeError, "q: expected dtype"
    yield "cache-dtype", dict(ok, k_cache=ok["k_cache"].bfloat16(),
                              v_cache=ok["v_cache"].bfloat16()), TypeError, "k_cache: expected"
    yield "v-shape", dict(ok, v_cache=ok["v_cache"][:1]), ValueError, "v_cache: expected shape"
    yield "heads", dict(ok, q=torch.randn(7, 3, 32).half()), ValueError, "Hq=3 must be a multiple"
    yield "head-dim", dict(ok, q=torch.randn(7, 4, 16).half()), ValueError, \
        r"k_cache: expected shape \[P, S, Hkv, D=16\]"
    yield "page-size", dict(ok, k_cache=ok["k_cache"][:, :6], v_cache=ok["v_cache"][:, :6]), \
        ValueError, "S=6"
    yield "table-dtype", dict(ok, block_table=ok["block_table"].long()), TypeError, "block_table"
    yield "starts-shape", dict(ok, query_start=ok["query_start"][:2]), ValueError, \
        r"query_start: expected shape \[B\+1=3\]"
    yield "starts-dtype", dict(ok, query_start=ok["query_start"].long()), TypeError, "query_start"
    yield "seq-shape", dict(ok, seq_lens=ok["seq_lens"][:1]), ValueError, \
        r"seq_lens: expected shape \[B=2\]"
    yield "window-type", dict(ok, window=2.0), RuntimeError, "argument 'window'"
    yield "window-neg", dict(ok, window=-1), ValueError, "window: expected 0"
    P = ok["k_cache"].shape[0]
    yield "cache-strided", dict(ok, k_cache=torch.zeros(P, 8, 4, 32).half()[:, :, :2]), \
        ValueError, "k_cache: expected contiguous pages"
    yield "q-last-dim", dict(ok, q=torch.zeros(7, 4, 64).half()[:, :, ::2]), ValueError, \
        "q: expected the last dim"
    k, v = new_rows(ok, garbage=0.0)
    yield "k-alone", dict(ok, k=k), ValueError, "k, v: expected both"
    yield "new-shape", dict(ok, k=k[:3], v=v[:3]), ValueError, r"k: expected shape \[N=7"
    yield "new-dtype", dict(ok, k=k.float(), v=v.float()), TypeError, "k: expected dtype"
    yield "new-heads", dict(ok, k=k, v=torch.zeros(7, 32, 2).half().transpose(1, 2)), \
        ValueError, "v: expected each row's heads contiguous"


@pytest.mark.parametrize("name,kwargs,exc,msg", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise(name, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        torch.ops.kvops.paged_prefill_attention(**kwargs)


def test_validation_mode_raises_on_out_of_range():
    ok = make_case([(5, 3), (0, 4)], 8, 2, 2, 32, torch.float16, "cpu", seed=1)
    with kvops.validate(True):
        torch.ops.kvops.paged_prefill_attention(**ok)
    table = ok["block_table"].clone()
    table[0, 0] = ok["k_cache"].shape[0]
    hole = ok["block_table"].clone()
    hole[1, 0] = -1
    bad = [("query_start", torch.tensor([0, 3, 8], dtype=torch.int32), "query_start"),
           ("query_start", torch.tensor([0, 4, 3], dtype=torch.int32), r"query_start \(steps\)"),
           ("seq_lens", torch.tensor([8, 2], dtype=torch.int32), "seq_lens - query count"),
           ("seq_lens", torch.tensor([8, 99], dtype=torch.int32), "seq_lens"),
           ("block_table", table, "block_table"), ("block_table", hole, "block_table")]
    for name, value, msg in bad:
        with kvops.validate(True), pytest.raises(IndexError, match=msg):
            torch.ops.kvops.paged_prefill_attention(**dict(ok, **{name: value}))


def test_the_step_varying_sizes_are_not_specialized():
    """A serving step's token and sequence counts change every step. Triton compiles a binary
    for each new specialization: an int that is 1 or a multiple of 16, or a new constexpr value.
    That would be a compile of a second or more inside a step, so the compiled kernels
    (outside the interpreter, which this suite runs under) must not specialize on them."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json\n"
            "from kvops.kernels.paged_prefill_attention import _paged_prefill_kernel as p\n"
            "from kvops.kernels.paged_kv_write import _paged_kv_write_kernel as w\n"
            "names = lambda k: sorted(k.arg_names[i] if isinstance(i, int) else i\n"
            "                         for i in k.do_not_specialize)\n"
            "print(json.dumps([names(p), names(w)]))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    prefill, write = json.loads(got)
    assert {"N", "B", "num_tiles", "NUM_SPLITS"} <= set(prefill)
    assert "N" in write

