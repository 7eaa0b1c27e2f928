"""far_view_rank (the far view's re-ranking on the device): the kernel and the reference
against a loop oracle over (utility, id) pairs, with ties, -inf, empty rows, fewer chunks than
entries and partly filled committed rows; plus the op contract (opcheck, input errors,
validation mode, CUDA graphs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvops
from kvops.kernels.far_view_rank import far_view_rank_fwd
from kvops.ops.far_view_rank import EMPTY_KEY, far_view_rank_ref
from tests.conftest import capture_graph, requires_cuda

VALUES = np.array([-math.inf, -1.5, 0.0, 0.25, 1.0, 3.0, 7.5], dtype=np.float32)


def make_case(L, B, J, C, seed):
    """Utilities drawn from a few values (ties everywhere: ids break them), a summarized set a
    slot, and committed rows holding distinct summarized chunks, some rows partly empty."""
    rng = np.random.default_rng(seed)
    scores = VALUES[rng.integers(0, VALUES.size, (L, B, J + 1))]
    summ = rng.random((B, J)) < rng.choice([0.0, 0.3, 0.8, 1.0], size=(B, 1))
    sel = np.full((L, B, C), -1, dtype=np.int32)
    for b in range(B):
        have = np.flatnonzero(summ[b])
        for layer in range(L):
            n = int(rng.integers(0, min(C, have.size) + 1))
            sel[layer, b, :n] = rng.permutation(have)[:n]
            sel[layer, b] = rng.permutation(sel[layer, b])       # empties anywhere
    return torch.from_numpy(scores), torch.from_numpy(summ), torch.from_numpy(sel)


def oracle_row(u, summ, cur, C):
    """(moved, top ids): the C best summarized chunks by (utility, id), loops only."""
    cand = [(float(u[j]), j) for j in range(len(summ)) if summ[j]]
    cand.sort(reverse=True)
    top = [j for _, j in cand[:C]]
    have = [int(j) for j in cur if j >= 0]
    return set(have) != set(top), top


def check(got, scores, summ, sel, where):
    L, B, C = sel.shape
    keys, changed = (t.cpu().numpy() for t in got)
    assert keys.shape == (L, B, C) and keys.dtype == np.int64
    assert changed.shape == (L, B) and changed.dtype == bool
    ids = keys.astype(np.int32)                         # the low words: selection entries
    for layer in range(L):
        for b in range(B):
            u = scores[layer, b].numpy()
            moved, top = oracle_row(u, summ[b].numpy(), sel[layer, b].numpy(), C)
            row = f"{where} row ({layer}, {b})"
            assert changed[layer, b] == moved, row
            if moved:
                assert sorted(j for j in ids[layer, b] if j >= 0) == sorted(top), row
                assert (ids[layer, b] < 0).sum() == C - len(top), row
            else:
                assert ids[layer, b].tolist() == sel[layer, b].tolist(), row   # committed order
            for j, key in zip(ids[layer, b], keys[layer, b]):
                if j < 0:
                    assert key == EMPTY_KEY, row
                else:                                   # the high word orders the utility
                    hi = np.int64(key) >> 32
                    bits = np.float32(u[j]).view(np.int32)
                    assert hi == (bits ^ ((bits >> 31) & 0x7FFFFFFF)), row


shapes = st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 70),
                   st.sampled_from([1, 2, 3, 8, 16]), st.integers(0, 2**31 - 1))


@given(shape=shapes)
def test_kernel_matches_oracle(kernel_device, poison, shape):
    L, B, J, C, seed = shape
    scores, summ, sel = make_case(L, B, J, C, seed)
    got = far_view_rank_fwd(scores.to(kernel_device), summ.to(kernel_device),
                            sel.to(kernel_device), EMPTY_KEY)
    check(got, scores, summ, sel, str(shape))


@given(shape=shapes)
def test_reference_matches_oracle(shape):
    L, B, J, C, seed = shape
    scores, summ, sel = make_case(L, B, J, C, seed)
    check(far_view_rank_ref(scores, summ, sel), scores, summ, sel, str(shape))


def test_kernel_equals_reference_on_a_wide_row(kernel_device):
    """Hundreds of chunks a row (the launch takes more warps past 1024)."""
    scores, summ, sel = make_case(2, 3, 1500, 8, 1)
    scores = scores + torch.rand(scores.shape)          # distinct utilities
    want, moved = far_view_rank_ref(scores, summ, sel)
    with kvops.backend("triton"):
        got, got_moved = (t.cpu() for t in torch.ops.kvops.far_view_rank(
            scores.to(kernel_device), summ.to(kernel_device), sel.to(kernel_device)))
    assert moved.any() and not moved.all()
    assert torch.equal(got_moved, moved)
    assert torch.equal(got[~moved], want[~moved])
    assert torch.equal(got[moved].sort(dim=1).values, want[moved].sort(dim=1).values)


def test_opcheck():
    scores, summ, sel = make_case(2, 3, 9, 4, 2)
    torch.library.opcheck(torch.ops.kvops.far_view_rank.default, (scores, summ, sel))


def _bad_inputs():
    scores, summ, sel = make_case(2, 3, 9, 4, 0)
    yield "scores-dtype", (scores.double(), summ, sel), TypeError, "scores: expected dtype"
    yield "scores-rank", (scores[0], summ, sel), ValueError, "scores: expected rank 3"
    yield "scores-no-chunk", (scores[..., :1], summ[:, :0], sel), ValueError, "J >= 1"
    yield "scores-last-dim", (scores.transpose(1, 2).contiguous().transpose(1, 2), summ, sel), \
        ValueError, "last dim"
    yield "summ-dtype", (scores, summ.to(torch.uint8), sel), TypeError, "summarized: expected"
    yield "summ-shape", (scores, summ[:, :5], sel), ValueError, "summarized: expected shape"
    yield "sel-dtype", (scores, summ, sel.long()), TypeError, "select: expected dtype"
    yield "sel-shape", (scores, summ, sel[:, :2]), ValueError, "select: expected shape"
    yield "sel-empty", (scores, summ, sel[..., :0]), ValueError, "C >= 1"


@pytest.mark.parametrize("name,args,exc,msg", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise(name, args, exc, msg):
    with pytest.raises(exc, match=msg):
        torch.ops.kvops.far_view_rank(*args)


def test_validation_mode_raises_on_out_of_range_entries():
    scores, summ, sel = make_case(1, 2, 5, 3, 0)
    sel[0, 1, 0] = 5                                    # ids lie in [-1, J)
    with kvops.validate(True):
        with pytest.raises(IndexError, match="select"):
            torch.ops.kvops.far_view_rank(scores, summ, sel)


@requires_cuda
def test_cuda_graph_replay_with_new_inputs():
    L, B, J, C = 4, 64, 96, 8
    static = [t.cuda() for t in make_case(L, B, J, C, 0)]

    def fn():
        return torch.ops.kvops.far_view_rank(*static)

    graph, out = capture_graph(fn)
    for seed in range(1, 4):
        new = make_case(L, B, J, C, seed)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        check(out, *new, f"graph-{seed}")
