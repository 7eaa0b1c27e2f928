"""pack_base_pairs / refine_base_pairs: kernels and reference against byte-level expectations,
the in-place cases (dst == src_a / src_b, base_page == dst_a / dst_b) with chunking forced, page
strided pools, and the op contract (opcheck, compile, CUDA graphs, input errors, validation)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvops
from kvops.kernels.base_pairs import pack_base_pairs_fwd, refine_base_pairs_fwd
from kvops.layouts import codecs
from kvops.layouts.pairs import base_pair_view
from kvops.ops.pack_base_pairs import pack_base_pairs_ref
from kvops.ops.refine_base_pairs import refine_base_pairs_ref
from tests.conftest import counting_backend, requires_cuda, same_bits
from tests.oracles_elastic import high_low_bytes

CODECS = [(torch.float16, "hi8"), (torch.float16, "hi8r"), (torch.bfloat16, "e4m3")]
CODEC_IDS = ["fp16-hi8", "fp16-hi8r", "bf16-e4m3"]
# (src_a, src_b, dst) rows; the refine rows are the same triples read as (dst_a, dst_b, base)
ROWS = {
    "dst-is-a": [[0, 1, 0], [5, 3, 5]],
    "dst-is-b": [[0, 1, 1], [5, 3, 3]],
    "third-page": [[0, 1, 2], [5, 3, 4]],
    "mixed": [[6, 1, 6], [0, 7, 7], [2, 3, 4]],
}


def make_pool(P, S, Hkv, D, dtype, device, seed, interleaved=False):
    """A random pool [P, S, Hkv, D]; ``interleaved``: the K half of a [P, 2, S, Hkv, D] pool, so
    pages are contiguous but the page stride is twice the page."""
    gen = torch.Generator().manual_seed(seed)
    if interleaved:
        full = torch.randn(P, 2, S, Hkv, D, generator=gen).to(dtype).to(device)
        return full[:, 0], full
    cache = torch.randn(P, S, Hkv, D, generator=gen).to(dtype).to(device)
    return cache, cache


def empty_backing(n, cache, codec):
    _, S, Hkv, D = cache.shape
    back = torch.empty((n, 2, S, Hkv, D), dtype=codecs.backing_dtype(codec, cache.dtype),
                       device=cache.device)
    back.view(torch.uint8).fill_(0xA5)                 # poison: every byte must be written
    return back


def expected_pack(orig, rows, codec):
    """Per row: BASE bytes of page dst as [2, S, Hkv, D] and the backing, from the contract."""
    want = []
    for a, b, _ in rows:
        pair = torch.stack([orig[a], orig[b]])
        if codec == "hi8":
            base, back = high_low_bytes(pair)
        else:
            base, back = codecs.encode(pair, codec)
        want.append((base, back))
    return want


def run_pack_refine(pack, refine, dtype, codec, rows, S, Hkv, D, device, interleaved=False):
    P = 8
    cache, full = make_pool(P, S, Hkv, D, dtype, device, seed=S + D, interleaved=interleaved)
    orig, full_orig = cache.clone(), full.clone()
    pairs = torch.tensor(rows, dtype=torch.int32, device=device)
    backing = empty_backing(len(rows), cache, codec)
    pack(cache, pairs, backing, codec)
    view = base_pair_view(cache)
    for n, (base, back) in enumerate(expected_pack(orig, rows, codec)):
        assert same_bits(view[rows[n][2]], base), f"row {n}: BASE bytes"
        assert same_bits(backing[n], back), f"row {n}: backing"
    touched = {p for r in rows for p in r}
    for p in set(range(P)) - touched:
        assert same_bits(cache[p], orig[p]), f"page {p} untouched by the pack changed"
    refine(cache, pairs, backing, codec)
    keep = sorted({p for r in rows for p in r[:2]})
    assert same_bits(cache[keep], orig[keep])
    if interleaved:
        assert same_bits(full[:, 1], full_orig[:, 1]), "the V half of the pool changed"


@pytest.mark.parametrize("dtype,codec", CODECS, ids=CODEC_IDS)
@pytest.mark.parametrize("rows", list(ROWS.values()), ids=list(ROWS))
@pytest.mark.parametrize("S,Hkv,D,block", [(8, 3, 48, 256), (16, 1, 64, 128), (64, 2, 16, 128)],
                         ids=["S8-Hkv3-D48-blk256", "S16-Hkv1-D64-blk128", "S64-Hkv2-D16-blk128"])
def test_kernel_in_place_orders_with_many_chunks(kernel_device, dtype, codec, rows, S, Hkv, D,
                                                 block):
    """A small block splits every page into 4.5 to 16 chunks, so a wrong chunk order overwrites
    bytes before they are read and the test fails (on the GPU, so does a missing barrier)."""
    pack = lambda c, p, b, k: pack_base_pairs_fwd(c, p, b, k, block=block)
    refine = lambda c, p, b, k: refine_base_pairs_fwd(c, p, b, k, block=block)
    run_pack_refine(pack, refine, dtype, codec, rows, S, Hkv, D, kernel_device)


@given(S=st.sampled_from([8, 16, 64]), Hkv=st.sampled_from([1, 2, 3]),
       D=st.sampled_from([16, 48, 64]), codec=st.sampled_from(range(len(CODECS))),
       n_rows=st.integers(1, 5), block=st.sampled_from([None, 128, 256]),
       interleaved=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_kernels_random_rows(kernel_device, S, Hkv, D, codec, n_rows, block, interleaved, seed):
    """Random disjoint rows over a random page permutation, each row in place on a, in place on
    b, or into a third page; random chunking; pack then refine against the contract's bytes."""
    dtype, codec = CODECS[codec]
    gen = torch.Generator().manual_seed(seed)
    P = 3 * n_rows + 2
    perm = torch.randperm(P, generator=gen).tolist()
    rows = []
    for i in range(n_rows):
        a, b, c = perm[3 * i: 3 * i + 3]
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        rows.append([a, b, (a, b, c)[kind]])
    cache, full = make_pool(P, S, Hkv, D, dtype, kernel_device, seed=seed, interleaved=interleaved)
    orig, full_orig = cache.clone(), full.clone()
    pairs = torch.tensor(rows, dtype=torch.int32, device=kernel_device)
    backing = empty_backing(n_rows, cache, codec)
    pack_base_pairs_fwd(cache, pairs, backing, codec, block=block)
    for n, (base, back) in enumerate(expected_pack(orig.cpu(), rows, codec)):
        assert same_bits(base_pair_view(cache)[rows[n][2]], base), f"row {n} {rows[n]}: BASE"
        assert same_bits(backing[n], back), f"row {n} {rows[n]}: backing"
    refine_base_pairs_fwd(cache, pairs, backing, codec, block=block)
    keep = sorted({p for r in rows for p in r[:2]})
    assert same_bits(cache[keep], orig[keep])
    if interleaved:
        assert same_bits(full[:, 1], full_orig[:, 1]), "the V half of the pool changed"


@pytest.mark.parametrize("dtype,codec", CODECS, ids=CODEC_IDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["pool", "kv-interleaved"])
def test_op_under_triton_backend(kernel_device, dtype, codec, interleaved):
    with kvops.backend("triton"):
        run_pack_refine(torch.ops.kvops.pack_base_pairs, torch.ops.kvops.refine_base_pairs,
                        dtype, codec, ROWS["mixed"], 16, 2, 64, kernel_device, interleaved)


@pytest.mark.parametrize("dtype,codec", CODECS, ids=CODEC_IDS)
@pytest.mark.parametrize("rows", list(ROWS.values()), ids=list(ROWS))
def test_reference(dtype, codec, rows):
    run_pack_refine(pack_base_pairs_ref, refine_base_pairs_ref, dtype, codec, rows, 8, 3, 48, "cpu")
    run_pack_refine(pack_base_pairs_ref, refine_base_pairs_ref, dtype, codec, rows, 8, 3, 48, "cpu",
                    interleaved=True)


def test_default_codec_matches_named_default():
    for dtype, name in ((torch.float16, "hi8"), (torch.bfloat16, "e4m3")):
        a, _ = make_pool(4, 8, 1, 16, dtype, "cpu", seed=1)
        b = a.clone()
        pairs = torch.tensor([[0, 1, 0]], dtype=torch.int32)
        ba, bb = empty_backing(1, a, name), empty_backing(1, a, name)
        torch.ops.kvops.pack_base_pairs(a, pairs, ba)
        torch.ops.kvops.pack_base_pairs(b, pairs, bb, name)
        assert same_bits(a, b) and same_bits(ba, bb)


def test_no_rows_is_a_no_op(kernel_device):
    cache, _ = make_pool(3, 8, 1, 16, torch.float16, kernel_device, seed=2)
    orig = cache.clone()
    pairs = torch.empty((0, 3), dtype=torch.int32, device=kernel_device)
    backing = empty_backing(0, cache, "hi8")
    with kvops.backend("triton"):
        torch.ops.kvops.pack_base_pairs(cache, pairs, backing)
        torch.ops.kvops.refine_base_pairs(cache, pairs, backing)
    assert same_bits(cache, orig)


def test_opcheck():
    for dtype, codec in CODECS:
        cache, _ = make_pool(6, 8, 2, 16, dtype, "cpu", seed=3)
        pairs = torch.tensor([[0, 1, 0], [2, 3, 4]], dtype=torch.int32)
        backing = empty_backing(2, cache, codec)
        torch.library.opcheck(torch.ops.kvops.pack_base_pairs.default,
                              (cache, pairs, backing, codec))
        torch.library.opcheck(torch.ops.kvops.refine_base_pairs.default,
                              (cache, pairs, backing, codec))


def test_compiled_demote_promote_never_recompiles():
    """A compiled step that packs and refines different pairs each call: one compile."""
    torch._dynamo.reset()
    backend, calls = counting_backend()

    @torch.compile(backend=backend, fullgraph=True)
    def step(cache, pack_rows, refine_rows, backing):
        torch.ops.kvops.pack_base_pairs(cache, pack_rows, backing, "hi8r")
        torch.ops.kvops.refine_base_pairs(cache, refine_rows, backing, "hi8r")
        return cache.float().sum(dim=(1, 2, 3))

    cache, _ = make_pool(10, 8, 2, 16, torch.float16, "cpu", seed=4)
    orig = cache.clone()
    backing = empty_backing(2, cache, "hi8r")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(6):
            a = [(t + i) % 10 for i in range(4)]
            rows = torch.tensor([[a[0], a[1], a[0]], [a[2], a[3], a[3]]], dtype=torch.int32)
            sums = step(cache, rows, rows.clone(), backing)
            assert same_bits(cache, orig)
            torch.testing.assert_close(sums, orig.float().sum(dim=(1, 2, 3)))
    assert len(calls) == 1


@requires_cuda
@pytest.mark.parametrize("dtype,codec", CODECS, ids=CODEC_IDS)
def test_cuda_graph_replay_with_new_pairs(dtype, codec):
    S, Hkv, D, P, N = 16, 8, 128, 64, 8
    cache, _ = make_pool(P, S, Hkv, D, dtype, "cuda", seed=5)
    orig = cache.clone()
    pairs = torch.zeros((N, 3), dtype=torch.int32, device="cuda")
    backing = empty_backing(N, cache, codec)

    def make_rows(seed):
        pages = torch.randperm(P, generator=torch.Generator().manual_seed(seed))[:2 * N].view(N, 2)
        dst = torch.where(torch.arange(N) % 2 == 0, pages[:, 0], pages[:, 1])
        return torch.cat([pages, dst[:, None]], 1).int()

    pairs.copy_(make_rows(0))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.kvops.pack_base_pairs(cache, pairs, backing, codec)
        torch.ops.kvops.refine_base_pairs(cache, pairs, backing, codec)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.kvops.pack_base_pairs(cache, pairs, backing, codec)
    for seed in range(1, 4):
        rows = make_rows(seed)
        pairs.copy_(rows)
        cache.copy_(orig)
        graph.replay()
        torch.cuda.synchronize()
        for n, (base, back) in enumerate(expected_pack(orig.cpu(), rows.tolist(), codec)):
            assert same_bits(base_pair_view(cache)[rows[n, 2]], base)
            assert same_bits(backing[n], back)
        torch.ops.kvops.refine_base_pairs(cache, pairs, backing, codec)
        assert same_bits(cache, orig)


@requires_cuda
@pytest.mark.parametrize("dtype,codec", CODECS, ids=CODEC_IDS)
def test_many_in_place_rows_with_default_blocks(dtype, codec):
    """512 in-place rows of Llama-sized pages with the kernel's default chunking and warps: the
    barrier and chunk order hold when thousands of warps race (reference bytes must match)."""
    S, Hkv, D, N = 16, 8, 128, 512
    cache, _ = make_pool(2 * N, S, Hkv, D, dtype, "cuda", seed=6)
    orig = cache.clone()
    a = torch.arange(0, 2 * N, 2, dtype=torch.int32, device="cuda")
    dst = torch.where(torch.arange(N, device="cuda") % 2 == 0, a, a + 1).int()
    pairs = torch.stack([a, a + 1, dst], 1)
    backing, ref_backing = empty_backing(N, cache, codec), empty_backing(N, cache, codec)
    ref = orig.clone()
    torch.ops.kvops.pack_base_pairs(cache, pairs, backing, codec)
    pack_base_pairs_ref(ref, pairs, ref_backing, codec)
    assert same_bits(cache, ref) and same_bits(backing, ref_backing)
    refine = torch.stack([a, a + 1, dst], 1)
    torch.ops.kvops.refine_base_pairs(cache, refine, backing, codec)
    assert same_bits(cache, orig)


@requires_cuda
def test_large_pool_offsets_do_not_overflow():
    """A pool of more than 2**31 elements: page offsets must be 64-bit."""
    S, Hkv, D = 16, 8, 128
    P = 2**31 // (S * Hkv * D) + 8
    cache = torch.empty((P, S, Hkv, D), dtype=torch.float16, device="cuda")
    last = torch.randn(3, S, Hkv, D, device="cuda").half()
    cache[-3:] = last
    pairs = torch.tensor([[P - 3, P - 2, P - 1]], dtype=torch.int32, device="cuda")
    backing = empty_backing(1, cache, "hi8")
    torch.ops.kvops.pack_base_pairs(cache, pairs, backing)
    base, back = high_low_bytes(last[:2].cpu())
    assert same_bits(base_pair_view(cache)[P - 1], base) and same_bits(backing[0], back)
    torch.ops.kvops.refine_base_pairs(cache, torch.tensor([[P - 3, P - 2, P - 1]], dtype=torch.int32,
                                                          device="cuda"), backing)
    assert same_bits(cache[-3:-1], last[:2])


def _bad_inputs():
    cache, _ = make_pool(6, 8, 2, 16, torch.float16, "cpu", seed=0)
    pairs = torch.tensor([[0, 1, 0]], dtype=torch.int32)
    back = empty_backing(1, cache, "hi8")
    ok = dict(cache=cache, pairs=pairs, backing=back)
    yield "cache-dtype", dict(ok, cache=cache.float()), TypeError, "cache: expected dtype"
    yield "cache-rank", dict(ok, cache=cache[0]), ValueError, "cache: expected rank 4"
    yield "cache-page-size", dict(ok, cache=torch.zeros(6, 12, 2, 16).half()), ValueError, "S=12"
    yield "cache-strided", dict(ok, cache=torch.zeros(6, 8, 4, 16).half()[:, :, :2]), ValueError, \
        "contiguous pages"
    yield "pairs-dtype", dict(ok, pairs=pairs.long()), TypeError, "pairs: expected dtype"
    yield "pairs-shape", dict(ok, pairs=pairs[:, :2]), ValueError, "pairs: expected shape"
    yield "backing-dtype", dict(ok, backing=back.half()), TypeError, "backing: expected dtype"
    yield "backing-shape", dict(ok, backing=back[:, :1]), ValueError, "backing: expected shape"
    yield "backing-strided", dict(ok, backing=torch.empty(1, 2, 8, 16, 2, dtype=torch.uint8)
                                  .transpose(3, 4)), ValueError, "backing: expected a contiguous"
    yield "codec-unknown", dict(ok, codec="hi4"), ValueError, "codec: expected one of"
    yield "codec-for-bf16", dict(ok, cache=cache.bfloat16(), backing=back.bfloat16() * 0,
                                 codec="hi8r"), ValueError, "codec: expected one of"


@pytest.mark.parametrize("op", ["pack_base_pairs", "refine_base_pairs"])
@pytest.mark.parametrize("name,kwargs,exc,msg", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise(op, name, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        getattr(torch.ops.kvops, op)(**kwargs)


@pytest.mark.parametrize("op", ["pack_base_pairs", "refine_base_pairs"])
def test_validation_mode(op):
    cache, _ = make_pool(6, 8, 2, 16, torch.float16, "cpu", seed=0)
    back = empty_backing(2, cache, "hi8")
    fn = getattr(torch.ops.kvops, op)
    cases = [([[0, 6, 0], [2, 3, 4]], IndexError, r"pairs: page ids must lie in \[0, 6\)"),
             ([[0, 1, -1], [2, 3, 4]], IndexError, "pairs: page ids"),
             ([[0, 0, 2], [3, 4, 5]], ValueError, "row 0 has"),
             ([[0, 1, 2], [2, 3, 4]], ValueError, "page 2 appears in more than one row"),
             ([[0, 1, 0], [1, 3, 4]], ValueError, "page 1 appears in more than one row")]
    for rows, exc, msg in cases:
        with kvops.validate(True), pytest.raises(exc, match=msg):
            fn(cache, torch.tensor(rows, dtype=torch.int32), back)
    with kvops.validate(True):
        fn(cache, torch.tensor([[0, 1, 0], [2, 3, 3]], dtype=torch.int32), back)
