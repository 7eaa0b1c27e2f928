"""far_slot_update: the kernel and the reference (the retrieval far view's Python slot path)
against a plain-loop oracle, bit for bit (index, far K/V rows including stale ones, bias), for
random old and new choices with overlaps, -1 holes, all-fresh and all-kept rows, trimmed and
out-of-pool pages, out-of-range blocks, strided pools and tables, successive steps; repeated
blocks keep every slot exact; the launch rule's table; the op contract (opcheck, bad inputs,
validation mode); on CUDA a captured graph replayed with new choices."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvops
from kvops.kernels.far_slot_update import far_slot_update_fwd, slot_update_launch
from kvops.ops.far_slot_update import far_slot_update_ref
from tests.conftest import capture_graph, requires_cuda
from tests.oracles_far_retrieval import far_slot_update_oracle

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
MODES = ["random", "all-fresh", "all-kept", "trimmed", "out-of-range"]


def _row(gen, K, L, blocks, n, pad=-1):
    """``blocks[:n]`` at random positions of a K-row, ``pad`` elsewhere."""
    row = torch.full((K,), pad, dtype=torch.int32)
    at = torch.randperm(K, generator=gen)[:n]
    row[at] = torch.as_tensor(blocks[:n], dtype=torch.int32)
    return row


def make_case(B, K, L, P, S, Hkv, D, dtype, device, seed, mode="random", interleaved=False,
              wide_table=False):
    """(new, block_table, k_cache, v_cache, index, far_k, far_v, far_bias): rows of ``index``
    with distinct blocks and -1 holes, rows of ``new`` drawn per ``mode`` against them, a table
    with about a fifth of its pages unmapped (-1, or outside the pool in "trimmed" mode), far
    buffers full of stale values and a NaN bias (every entry must be written)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, P, (B, L), generator=gen, dtype=torch.int32)
    hole = torch.rand(B, L, generator=gen) < 0.2
    table[hole] = -1
    new, old = [], []
    for b in range(B):
        perm = torch.randperm(L, generator=gen).tolist()
        n_old = int(torch.randint(0, K + 1, (1,), generator=gen))
        olds = perm[:n_old]
        rest = perm[n_old:]
        if mode == "all-kept":
            chosen = [olds[i] for i in torch.randperm(n_old, generator=gen).tolist()]
        elif mode == "all-fresh":
            chosen = rest[: int(torch.randint(0, K + 1, (1,), generator=gen))]
        else:
            keep = int(torch.randint(0, n_old + 1, (1,), generator=gen))
            chosen = olds[:keep] + rest[: int(torch.randint(0, K - keep + 1, (1,),
                                                            generator=gen))]
            chosen = [chosen[i] for i in torch.randperm(len(chosen), generator=gen).tolist()]
        row = _row(gen, K, L, chosen, len(chosen))
        if mode == "trimmed":                 # chosen blocks whose page is gone or bogus
            for j in row.tolist():
                if j >= 0 and torch.rand(1, generator=gen) < 0.4:
                    table[b, j] = -1 if torch.rand(1, generator=gen) < 0.5 else P + 3
        if mode == "out-of-range":            # entries no block table row has
            for i in range(K):
                if row[i] < 0 and torch.rand(1, generator=gen) < 0.7:
                    row[i] = L + int(torch.randint(0, 3, (1,), generator=gen)) \
                        if torch.rand(1, generator=gen) < 0.5 else -7
        new.append(row)
        old.append(_row(gen, K, L, olds, n_old))
    new, index = torch.stack(new), torch.stack(old)
    if wide_table:                            # a view of a wider table: row stride > L
        wide = torch.full((B, L + 5), -1, dtype=torch.int32)
        wide[:, :L] = table
        table = wide[:, :L]
    if interleaved:                           # k_cache = kv[:, 0]: page stride 2 * S * Hkv * D
        kv = torch.randn(P, 2, S, Hkv, D, generator=gen).to(dtype).to(device)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = torch.randn(P, S, Hkv, D, generator=gen).to(dtype).to(device)
        v_cache = torch.randn(P, S, Hkv, D, generator=gen).to(dtype).to(device)
    far_k = torch.randn(B, K * S, Hkv, D, generator=gen).to(dtype).to(device)
    far_v = torch.randn(B, K * S, Hkv, D, generator=gen).to(dtype).to(device)
    far_bias = torch.full((B, K * S), float("nan"), device=device)
    return (new.to(device), table.to(device), k_cache, v_cache, index.to(device), far_k, far_v,
            far_bias)


def clone(case):
    return tuple(t.clone() if i >= 4 else t for i, t in enumerate(case))


def assert_matches_oracle(case, got, name):
    want = far_slot_update_oracle(*case)
    index, far_k, far_v, far_bias = got
    assert torch.equal(index.cpu(), want[0]), (name, index, want[0])
    for what, g, w in (("far_k", far_k, want[1]), ("far_v", far_v, want[2]),
                       ("far_bias", far_bias, want[3])):
        assert torch.equal(g.double().cpu(), w), (name, what)


shapes = st.tuples(
    st.integers(1, 3),                        # B
    st.integers(1, 6),                        # K (odd sizes: masked lanes)
    st.integers(0, 6),                        # L - K
    st.integers(3, 40),                       # P
    st.sampled_from([8, 16]),                 # S
    st.sampled_from([1, 2, 3]),               # Hkv
    st.sampled_from([16, 32]),                # D
    st.sampled_from(DTYPES),
    st.integers(0, 2**31 - 1),
)


@settings(max_examples=12)
@given(shape=shapes, mode=st.sampled_from(MODES), layout=st.sampled_from(
    [(False, False, None), (True, False, None), (False, True, 64)]))
def test_kernel_matches_oracle(kernel_device, shape, mode, layout):
    B, K, dl, P, S, Hkv, D, dtype, seed = shape
    interleaved, wide, block_e = layout
    case = make_case(B, K, K + dl, P, S, Hkv, D, dtype, kernel_device, seed, mode, interleaved,
                     wide)
    before = clone(case)
    got = clone(case)
    far_slot_update_fwd(*got, block_e=block_e)
    assert_matches_oracle(before, got[4:], f"{shape} {mode} {layout}")


@settings(max_examples=25)
@given(shape=shapes, mode=st.sampled_from(MODES), interleaved=st.booleans())
def test_reference_matches_oracle(shape, mode, interleaved):
    B, K, dl, P, S, Hkv, D, dtype, seed = shape
    case = make_case(B, K, K + dl, P, S, Hkv, D, dtype, "cpu", seed, mode, interleaved, True)
    got = clone(case)
    far_slot_update_ref(*got)
    assert_matches_oracle(case, got[4:], f"{shape} {mode}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_successive_choices_keep_slots_and_copy_only_fresh_pages(kernel_device, backend):
    """Six steps of drifting top-K choices from empty slots; after each the op's state equals
    the oracle's, a block chosen again sits in its old slot, and a kept slot's rows are not
    rewritten (a marker written into them survives)."""
    if backend == "triton" and kernel_device.type != "cpu":
        pytest.skip("the interpreted kernel runs on CPU tensors")
    B, K, L, P, S, Hkv, D = 2, 5, 12, 30, 8, 2, 16
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(0, P, (B, L), generator=gen, dtype=torch.int32)
    table[0, 4] = -1                                   # a trimmed block: never a slot's
    k_cache = torch.randn(P, S, Hkv, D, generator=gen)
    v_cache = torch.randn(P, S, Hkv, D, generator=gen)
    index = torch.full((B, K), -1, dtype=torch.int32)
    far_k, far_v = torch.zeros(B, K * S, Hkv, D), torch.zeros(B, K * S, Hkv, D)
    far_bias = torch.zeros(B, K * S)
    score = torch.randn(B, L, generator=gen)
    with kvops.backend(backend):
        for t in range(6):
            score += 0.6 * torch.randn(B, L, generator=gen)
            new = score.topk(K, dim=1).indices.to(torch.int32)
            new[1, K - 1] = -1                             # fewer candidates than slots
            far_k[:, 0::S] += 1000.0                       # a marker in every slot's first row
            case = (new, table, k_cache, v_cache, index.clone(), far_k.clone(), far_v.clone(),
                    far_bias.clone())
            torch.ops.kvops.far_slot_update(new, table, k_cache, v_cache, index, far_k, far_v,
                                            far_bias)
            want = far_slot_update_oracle(*case)
            assert torch.equal(index, want[0]), t
            for g, w in zip((far_k, far_v, far_bias), want[1:]):
                assert torch.equal(g.double(), w), t
            assert not (index[0] == 4).any()
            for b in range(B):
                for slot, j in enumerate(case[4][b].tolist()):
                    if j >= 0 and j in new[b].tolist():    # chosen again: same slot, not copied
                        rows = slice(slot * S, (slot + 1) * S)
                        assert index[b, slot] == j, (t, b, slot)
                        assert torch.equal(far_k[b, rows], case[5][b, rows]), (t, b, slot)
            assert (index >= 0).sum() == 2 * K - 1 - (new[0] == 4).sum()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_repeated_blocks_still_leave_every_slot_exact(kernel_device, backend):
    """Outside the contract (a row of ``new`` repeats a block): whatever slots the repeat
    takes, every slot holds exactly its named block's page (bias 0) or is empty (-inf)."""
    if backend == "triton" and kernel_device.type != "cpu":
        pytest.skip("the interpreted kernel runs on CPU tensors")
    B, K, L, P, S, Hkv, D = 2, 6, 9, 20, 8, 1, 16
    case = make_case(B, K, L, P, S, Hkv, D, torch.float32, "cpu", 11, "random")
    new, table, k_cache, v_cache, index, far_k, far_v, far_bias = clone(case)
    new.copy_(torch.tensor([[3, 3, 5, -1, 3, 5], [0, 1, 1, 2, 8, 8]], dtype=torch.int32))
    index.copy_(torch.tensor([[5, -1, -1, 7, -1, -1], [-1, 1, -1, -1, -1, 2]], dtype=torch.int32))
    table.copy_(torch.arange(B * L, dtype=torch.int32).view(B, L) % P)
    for b in range(B):                        # the slots held start exact
        for slot, j in enumerate(index[b].tolist()):
            if j >= 0:
                far_k[b, slot * S:(slot + 1) * S] = k_cache[table[b, j]]
                far_v[b, slot * S:(slot + 1) * S] = v_cache[table[b, j]]
    with kvops.backend(backend):
        torch.ops.kvops.far_slot_update(new, table, k_cache, v_cache, index, far_k, far_v,
                                        far_bias)
    for b in range(B):
        for slot, j in enumerate(index[b].tolist()):
            rows = slice(slot * S, (slot + 1) * S)
            if j < 0:
                assert torch.isneginf(far_bias[b, rows]).all()
                continue
            assert j in new[b].tolist() and (far_bias[b, rows] == 0).all()
            assert torch.equal(far_k[b, rows], k_cache[table[b, j]]), (b, slot)
            assert torch.equal(far_v[b, rows], v_cache[table[b, j]]), (b, slot)


def _slot_outcome(new, view, j):
    """What the kernel's program for slot ``j`` computes from a row of ``new`` (mapped blocks,
    -1 none) and its view of the ``index`` row (its own entry always the old one)."""
    kept = [b >= 0 and b in new for b in view]
    fresh = [n for n in new if n >= 0 and n not in view]
    if kept[j]:
        return view[j]
    rank = sum(1 for s in range(j) if not kept[s])
    return fresh[rank] if rank < len(fresh) else -1


def test_a_slots_outcome_does_not_depend_on_which_neighbours_are_rewritten():
    """The kernel rewrites ``index`` in place while the row's other programs read it: for any
    mix of old and new neighbour entries a program may see, its own slot's outcome is the
    same (the argument in kvops/kernels/far_slot_update.py), and equals the oracle's."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        K, L = int(torch.randint(1, 9, (1,), generator=gen)), 14
        perm = torch.randperm(L, generator=gen).tolist()
        n_old = int(torch.randint(0, K + 1, (1,), generator=gen))
        old = _row(gen, K, L, perm[:n_old], n_old).tolist()
        keep = int(torch.randint(0, n_old + 1, (1,), generator=gen))
        chosen = perm[:keep] + perm[n_old:n_old + int(torch.randint(0, K - keep + 1, (1,),
                                                                      generator=gen))]
        new = _row(gen, K, L, chosen, len(chosen)).tolist()
        final = [_slot_outcome(new, old, j) for j in range(K)]
        table = torch.arange(L, dtype=torch.int32)[None]
        pool = torch.zeros(L, 8, 1, 16)
        want = far_slot_update_oracle(torch.tensor([new], dtype=torch.int32), table, pool, pool,
                                      torch.tensor([old], dtype=torch.int32),
                                      torch.zeros(1, K * 8, 1, 16), torch.zeros(1, K * 8, 1, 16),
                                      torch.zeros(1, K * 8))[0]
        assert final == want[0].tolist(), (trial, new, old)
        for _ in range(40):
            done = (torch.rand(K, generator=gen) < 0.5).tolist()
            view = [f if d else o for f, o, d in zip(final, old, done)]
            for j in range(K):
                seen = view[:j] + [old[j]] + view[j + 1:]
                assert _slot_outcome(new, seen, j) == final[j], (trial, new, old, seen, j)


# (S, Hkv, D, itemsize) -> (BLOCK_E, warps): 8 KiB copy vectors, or the page's largest
# power-of-two divisor below that
LAUNCH = [
    ((16, 8, 128, 2), (4096, 4)),      # Llama-3-8B fp16: a 32 KiB page in four steps
    ((16, 8, 128, 4), (2048, 4)),
    ((8, 1, 16, 2), (128, 4)),         # a 256-byte page: one step
    ((16, 3, 16, 2), (256, 4)),        # Hkv 3: 768 elements, 256 divides them
    ((32, 8, 256, 2), (4096, 4)),
]


@pytest.mark.parametrize("args,want", LAUNCH, ids=[str(a) for a, _ in LAUNCH])
def test_launch_rule_table(args, want):
    assert slot_update_launch(*args) == want


def test_opcheck():
    case = make_case(2, 3, 7, 12, 8, 2, 16, torch.float32, "cpu", 5, "random")
    torch.library.opcheck(torch.ops.kvops.far_slot_update.default, clone(case))


def test_compiled_call_never_recompiles():
    """Compiled once (fullgraph, through AOT autograd: functionalized, the in-place writes
    applied back to the buffers) with new choices and tables each call; the buffers equal
    the oracle's. Inductor's code generation is left out, which keeps the test short."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    torch._dynamo.reset()
    calls = []

    def compiler(gm, example_inputs):
        calls.append(1)
        return make_boxed_func(gm.forward)
    backend = aot_autograd(fw_compiler=compiler)
    case = make_case(2, 4, 9, 16, 8, 2, 16, torch.float32, "cpu", 2, "random")
    state = clone(case)

    @torch.compile(backend=backend, fullgraph=True)
    def update(new, table):
        torch.ops.kvops.far_slot_update(new, table, *state[2:])
        return state[4]

    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(4):
            nxt = make_case(2, 4, 9, 16, 8, 2, 16, torch.float32, "cpu", 20 + seed, "random")
            want = far_slot_update_oracle(nxt[0], nxt[1], *state[2:])
            update(nxt[0], nxt[1])
            assert torch.equal(state[4], want[0]) and torch.equal(state[5].double(), want[1])
    assert len(calls) == 1


def _bad_inputs():
    case = make_case(2, 3, 5, 8, 8, 2, 16, torch.float16, "cpu", 0)
    new, table, k, v, index, fk, fv, fb = case

    def with_(i, t):
        args = list(clone(case))
        args[i] = t
        return tuple(args)
    yield "new-dtype", with_(0, new.long()), TypeError, "new: expected dtype"
    yield "new-rank", with_(0, new[0]), ValueError, "new: expected rank 2"
    yield "new-empty", (new[:, :0], table, k, v, index[:, :0], fk[:, :0], fv[:, :0],
                        fb[:, :0]), ValueError, r"new: expected at least one slot"
    yield "table-rows", with_(1, table[:1]), ValueError, r"block_table: expected shape \[B=2, L\]"
    yield "table-dtype", with_(1, table.long()), TypeError, "block_table: expected dtype"
    yield "index-shape", with_(4, index[:, :2]), ValueError, r"index: expected shape \[B=2, K=3\]"
    yield "far-k-shape", with_(5, fk[:, :-1]), ValueError, r"far_k: expected shape \[B=2, K\*S=24"
    yield "far-v-dtype", with_(6, fv.float()), TypeError, "far_v: expected dtype"
    yield "bias-dtype", with_(7, fb.half()), TypeError, "far_bias: expected dtype"
    yield "bias-shape", with_(7, fb[:, :8]), ValueError, "far_bias: expected shape"
    yield "index-strided", with_(4, index.t().contiguous().t()), ValueError, \
        "index: expected a contiguous tensor"
    yield "pool-rows", with_(2, torch.zeros(8, 8, 2, 32, dtype=torch.float16)[..., :16]), \
        ValueError, r"k_cache: expected contiguous pages"
    yield "pool-dtype", with_(3, v.float()), TypeError, "v_cache: expected dtype"


@pytest.mark.parametrize("name,args,exc,msg", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise(name, args, exc, msg):
    with pytest.raises(exc, match=msg):
        torch.ops.kvops.far_slot_update(*args)


def test_validation_mode():
    case = make_case(2, 3, 5, 8, 8, 2, 16, torch.float32, "cpu", 1, "random")
    with kvops.validate(True):
        torch.ops.kvops.far_slot_update(*clone(case))
        for i, value, exc, msg in ((0, 5, IndexError, "new: values must lie in"),
                                   (4, -2, IndexError, "index: values must lie in"),
                                   (1, 8, IndexError, "block_table: values must lie in")):
            args = clone(case)
            args = tuple(a.clone() if j == i else a for j, a in enumerate(args))
            args[i][0, 0] = value
            with pytest.raises(exc, match=msg):
                torch.ops.kvops.far_slot_update(*args)
        args = clone(case)
        args = (torch.tensor([[1, 1, -1], [0, -1, -1]], dtype=torch.int32), *args[1:])
        with pytest.raises(ValueError, match="new: expected the blocks .* found block 1 twice"):
            torch.ops.kvops.far_slot_update(*args)
    # outside validation mode the same bad entries are no choice: nothing out of range is read
    args = clone(case)
    args = (torch.tensor([[5, 9, -3], [0, -1, 7]], dtype=torch.int32), *args[1:])
    want = far_slot_update_oracle(*args)
    torch.ops.kvops.far_slot_update(*args)
    assert torch.equal(args[4], want[0])


@requires_cuda
def test_cuda_graph_replays_with_new_choices():
    """One capture; new choices, tables and pools copied into its inputs replay right
    (Llama-3-8B heads, fp16, K 64), step after step against the oracle."""
    B, K, L, P, S, Hkv, D = 3, 64, 200, 600, 16, 8, 128
    case = make_case(B, K, L, P, S, Hkv, D, torch.float16, "cuda", 0, "random")
    new, table = case[0].clone(), case[1].clone()
    state = clone(case)

    def fn():
        torch.ops.kvops.far_slot_update(new, table, *state[2:])

    graph, _ = capture_graph(fn)
    for seed, mode in enumerate(MODES):
        nxt = make_case(B, K, L, P, S, Hkv, D, torch.float16, "cuda", 10 + seed, mode)
        new.copy_(nxt[0])
        table.copy_(nxt[1])
        # the old slots must be the op's own: start each check from the state it left
        want = far_slot_update_oracle(new, table, *state[2:])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(state[4].cpu(), want[0]), mode
        for g, w in zip(state[5:], want[1:]):
            assert torch.equal(g.double().cpu(), w), mode
