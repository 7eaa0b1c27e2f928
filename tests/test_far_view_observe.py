"""far_view_observe (the far view's utility update): the kernel and the reference against a
float64 loop oracle, with invisible slots holding NaN, rows with nothing visible, rows that are
not live, empty and out-of-range selection entries and more utility rows than query rows; the
op contract (opcheck, input errors, validation mode, compile, CUDA graphs); and FarView.observe
giving what the op gives."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvops
from kvops.kernels.far_view_observe import far_view_observe_fwd, observe_launch
from kvops.ops.far_view_observe import far_view_observe_ref
from tests.conftest import capture_graph, counting_backend, requires_cuda
from tests.oracles_far_view import far_view_observe_oracle
from tests.tolerances import assert_close

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}


def make_case(R, C, Hkv, G, D, N, dtype=torch.float32, seed=0, extra_rows=1, live=True):
    """A call's q, far keys and biases (some slots invisible, their keys NaN), an lse that
    bounds the logits (one row with nothing visible: lse -inf), distinct selection entries
    per row with -1 and out-of-range ones, and utilities for ``R + extra_rows`` rows."""
    gen = torch.Generator().manual_seed(seed)
    Hq = Hkv * G
    q = torch.randn(R, Hq, D, generator=gen).to(dtype)
    far_k = torch.randn(R, C, Hkv, D, generator=gen).to(dtype)
    vis = torch.rand(R, C, generator=gen) < 0.7
    if R > 1:
        vis[R - 1] = False                               # nothing visible in the last row
    far_bias = torch.where(vis, torch.rand(R, C, generator=gen) * 3 - 1, float("-inf"))
    far_k[~vis] = float("nan")
    logits = torch.einsum("rhgd,rchd->rhgc", q.double().view(R, Hkv, G, D),
                          torch.where(vis[:, :, None, None], far_k.double(), 0.0)) * D ** -0.5
    lse = torch.logsumexp(logits + far_bias.double()[:, None, None, :], dim=-1).view(R, Hq)
    lse = (lse + torch.rand(R, Hq, generator=gen, dtype=torch.float64)).float()  # a window too
    sel = torch.stack([torch.randperm(max(N + 2, C), generator=gen)[:C] for _ in range(R)]).int() - 1
    keep = torch.rand(R, C, generator=gen) < 0.3           # invisible, still owning a column:
    sel = torch.where(vis | keep | (sel < 0), sel, -1)    # mass 0, its utility decays
    sel[0, 0] = N + 3 if C > 1 else sel[0, 0]             # an entry past the row updates nothing
    scores = torch.rand(R + extra_rows, N, generator=gen)
    alive = (torch.rand(R, generator=gen) < 0.75) if live else None
    return q, far_k, far_bias, lse, sel, scores, alive


def check(mass, new_scores, want, dtype, case):
    tol = TOL[dtype]
    assert_close("mass", mass, want[0], tol, tol, case)
    assert_close("scores", new_scores, want[1], tol, tol, case)


shapes = st.tuples(st.integers(1, 5), st.sampled_from([1, 3, 8, 16]), st.sampled_from([1, 2]),
                   st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([16, 64, 96]),
                   st.integers(1, 40),
                   st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
                   st.booleans(), st.integers(0, 2**31 - 1))


@given(shape=shapes)
def test_reference_matches_oracle(shape):
    R, C, Hkv, G, D, N, dtype, live, seed = shape
    q, fk, fb, lse, sel, scores, alive = make_case(R, C, Hkv, G, D, N, dtype, seed, live=live)
    want = far_view_observe_oracle(q, fk, fb, lse, sel, scores, alive, 0.8)
    got = scores.clone()
    mass = far_view_observe_ref(q, fk, fb, lse, sel, got, alive, 0.8)
    check(mass, got, want, dtype, str(shape))


@given(shape=shapes)
def test_kernel_matches_oracle(kernel_device, poison, shape):
    R, C, Hkv, G, D, N, dtype, live, seed = shape
    q, fk, fb, lse, sel, scores, alive = make_case(R, C, Hkv, G, D, N, dtype, seed, live=live)
    want = far_view_observe_oracle(q, fk, fb, lse, sel, scores, alive, 0.8)
    dev = [t.to(kernel_device) if t is not None else None
           for t in (q, fk, fb, lse, sel, scores, alive)]
    mass = far_view_observe_fwd(*dev, 0.8, D ** -0.5)
    check(mass.cpu(), dev[5].cpu(), want, dtype, str(shape))


def test_kernel_on_a_wide_group(kernel_device):
    """G 8 over 64 slots at D 256, and G 64 of one KV head: tiles past the smallest dot."""
    for R, C, Hkv, G, D in ((3, 64, 1, 8, 256), (2, 5, 1, 64, 32)):
        q, fk, fb, lse, sel, scores, alive = make_case(R, C, Hkv, G, D, 80, seed=3)
        want = scores.clone()
        want_mass = far_view_observe_ref(q, fk, fb, lse, sel, want, alive, 0.5)
        dev = [t.to(kernel_device) for t in (q, fk, fb, lse, sel, scores, alive)]
        with kvops.backend("triton"):
            mass = torch.ops.kvops.far_view_observe(*dev, ema=0.5)
        assert_close("mass", mass, want_mass, 1e-5, 1e-5, str((R, C, Hkv, G, D)))
        assert_close("scores", dev[5], want, 1e-5, 1e-5, str((R, C, Hkv, G, D)))


def test_the_same_tensors_under_another_scale_or_ema_take_their_own(kernel_device):
    """Scale and ema are part of the call's signature: calls on the same tensors alternating
    them each give the reference's mass (a launch plan kept by the tensors alone would reuse
    the first call's constants)."""
    q, fk, fb, lse, sel, scores, alive = make_case(3, 6, 2, 2, 32, 20, seed=5)
    dev = [t.to(kernel_device) for t in (q, fk, fb, lse, sel, scores, alive)]
    for scale, ema in ((None, 0.9), (0.1, 0.9), (None, 0.9), (0.25, 0.5), (0.25, 0.9)):
        want = dev[5].cpu().clone()
        want_mass = far_view_observe_ref(q, fk, fb, lse, sel, want, alive, ema, scale)
        with kvops.backend("triton"):
            mass = torch.ops.kvops.far_view_observe(*dev, ema=ema, scale=scale)
        assert_close("mass", mass.cpu(), want_mass, 1e-5, 1e-5, f"scale {scale} ema {ema}")
        assert_close("scores", dev[5].cpu(), want, 1e-5, 1e-5, f"scale {scale} ema {ema}")


def test_launch_rule_table():
    """A head's scores are one dot: both sides padded to at least 16, the head dim whole."""
    table = {(4, 16, 128): (16, 16, 128, 4), (8, 64, 256): (16, 64, 256, 4),
             (1, 8, 64): (16, 16, 64, 4), (7, 16, 96): (16, 16, 128, 4),
             (64, 64, 128): (64, 64, 128, 4), (32, 3, 512): (32, 16, 512, 4)}
    for (G, C, D), want in table.items():
        assert observe_launch(G, C, D) == want, (G, C, D)


def test_opcheck():
    args = make_case(3, 4, 2, 2, 16, 9, seed=1)
    args = (*args[:6], args[6])
    torch.library.opcheck(torch.ops.kvops.far_view_observe.default, args, {"ema": 0.7})


def _bad_inputs():
    q, fk, fb, lse, sel, scores, live = make_case(3, 4, 2, 2, 16, 9, seed=0)
    yield "q-dtype", (q.double(), fk, fb, lse, sel, scores), TypeError, "q: expected dtype"
    yield "k-dtype", (q, fk.half(), fb, lse, sel, scores), TypeError, "far_k: expected dtype"
    yield "k-shape", (q, fk[:2], fb, lse, sel, scores), ValueError, "far_k: expected shape"
    yield "heads", (q[:, :3], fk, fb, lse[:, :3], sel, scores), ValueError, "multiple of KV"
    yield "bias-dtype", (q, fk, fb.double(), lse, sel, scores), TypeError, "far_bias: expected"
    yield "lse-shape", (q, fk, fb, lse[:, :2], sel, scores), ValueError, "lse: expected shape"
    yield "sel-dtype", (q, fk, fb, lse, sel.long(), scores), TypeError, "select: expected dtype"
    yield "sel-shape", (q, fk, fb, lse, sel[:, :2], scores), ValueError, "select: expected shape"
    yield "scores-rows", (q, fk, fb, lse, sel, scores[:2]), ValueError, "B >= R=3"
    yield "scores-last-dim", (q, fk, fb, lse, sel, scores.t().contiguous().t()), ValueError, \
        "scores: expected the last dim contiguous"
    yield "live-dtype", (q, fk, fb, lse, sel, scores, live.int()), TypeError, "live: expected"
    yield "ema", (q, fk, fb, lse, sel, scores, live, 1.0), ValueError, "ema: expected"
    yield "head-dim", (q[..., :8], fk[..., :8], fb, lse, sel, scores), ValueError, "head dim"
    wide = make_case(1, 65, 1, 1, 512, 9)
    yield "slots-x-dim", wide[:6], ValueError, "C \\* D <= 32768"


@pytest.mark.parametrize("name,args,exc,msg", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise(name, args, exc, msg):
    with pytest.raises(exc, match=msg):
        torch.ops.kvops.far_view_observe(*args)


def test_validation_mode_raises_on_out_of_range_entries():
    q, fk, fb, lse, sel, scores, live = make_case(3, 4, 2, 2, 16, 9, seed=0)
    assert int(sel.max()) >= scores.shape[1]
    with kvops.validate(True):
        with pytest.raises(IndexError, match="select"):
            torch.ops.kvops.far_view_observe(q, fk, fb, lse, sel, scores, live)


def test_compile_updates_in_place_without_recompiles():
    backend, calls = counting_backend()
    step = torch.compile(torch.ops.kvops.far_view_observe, backend=backend, fullgraph=True)
    for seed in range(3):
        q, fk, fb, lse, sel, scores, live = make_case(3, 4, 2, 2, 16, 9, seed=seed)
        want = scores.clone()
        want_mass = far_view_observe_ref(q, fk, fb, lse, sel, want, live)
        mass = step(q, fk, fb, lse, sel, scores, live)
        assert_close("mass", mass, want_mass, 1e-6, 1e-6)
        assert_close("scores", scores, want, 1e-6, 1e-6)
    assert len(calls) == 1


def test_far_view_observe_uses_the_op():
    """FarView.observe updates the layer's utilities as the op does on its selection rows."""
    from kvops.runtime import Pager
    from kvops.runtime.far_view import FarView

    pager = Pager(64, 8, max_sessions=3, max_blocks=16, device="cpu")
    far = FarView(pager, window_tokens=32, chunk_tokens=16, cap=4, num_layers=2, num_kv_heads=2,
                  head_dim=16, dtype=torch.float32)
    with pager.frame():
        pass
    sel = pager.device_tables["far_select"].view(2, 3, 4)
    sel.copy_(torch.tensor([[[0, 2, -1, 5], [1, -1, -1, -1], [3, 4, 6, 7]]] * 2,
                           dtype=torch.int32))
    far.scores.copy_(torch.rand(far.scores.shape))
    q, fk, fb, lse, _, _, live = make_case(3, 4, 2, 2, 16, 8, seed=5)
    fb = torch.where(sel[1] >= 0, 0.5, float("-inf"))
    fk = torch.where(torch.isnan(fk), 0.0, fk)
    want = far.scores[1].clone()
    want_mass = far_view_observe_ref(q, fk, fb, lse, sel[1], want, live, far.ema)
    before = far.scores[0].clone()
    mass = far.observe(1, q, fk, fb, lse, live=live)
    assert torch.equal(far.scores[0], before)
    assert_close("mass", mass, want_mass, 1e-6, 1e-6)
    assert_close("scores", far.scores[1], want, 1e-6, 1e-6)


@requires_cuda
def test_cuda_layer_slices_at_any_alignment():
    """Rows of a layer's selection and utilities start wherever the layer does (4-byte steps),
    and the launch specializes on 16-byte alignment: every offset gives the reference."""
    q, fk, fb, lse, sel, scores, live = make_case(5, 3, 2, 4, 64, 7, torch.bfloat16, seed=2)
    for off in range(4):
        sel_buf = torch.full((off * 3 + sel.numel(),), -1, dtype=torch.int32)
        sel_buf[off * 3:] = sel.flatten()
        sc_buf = torch.zeros(off * 7 + scores.numel())
        sc_buf[off * 7:] = scores.flatten()
        sel_c = sel_buf.cuda()[off * 3:].view(5, 3)
        sc_c = sc_buf.cuda()[off * 7:].view(scores.shape)
        lse_c = torch.cat([torch.zeros(off), lse.flatten()]).cuda()[off:].view(lse.shape)
        want = scores.clone()
        want_mass = far_view_observe_ref(q, fk, fb, lse, sel, want, live, 0.9)
        mass = torch.ops.kvops.far_view_observe(q.cuda(), fk.cuda(), fb.cuda(), lse_c, sel_c,
                                                sc_c, live.cuda())
        assert_close("mass", mass, want_mass, 2e-3, 2e-3, f"offset {off}")
        assert_close("scores", sc_c, want, 2e-3, 2e-3, f"offset {off}")


@requires_cuda
def test_cuda_graph_replay_with_new_inputs():
    static = [t.cuda() for t in make_case(64, 16, 8, 4, 128, 64, torch.bfloat16, seed=0)]

    def fn():
        return torch.ops.kvops.far_view_observe(*static, ema=0.9)

    base = static[5].clone()
    graph, mass = capture_graph(fn)
    for seed in range(1, 4):
        new = make_case(64, 16, 8, 4, 128, 64, torch.bfloat16, seed=seed)
        for dst, src in zip(static, new):
            dst.copy_(src)
        want = far_view_observe_oracle(*new, 0.9)
        graph.replay()
        check(mass.cpu(), static[5].cpu(), want, torch.bfloat16, f"graph-{seed}")
    assert not torch.equal(base, static[5])


def test_step_bench_runs_on_cpu():
    """bench/bench_far_view_step.py's pieces (prepare, view, observe, its torch form, absorb)
    run on tiny CPU shapes, so the GPU bench does not rot between device runs."""
    from bench.bench_far_view_step import SMOKE, run

    text = run(SMOKE, smoke=True)
    for part in ("view", "observe (far_view_observe)", "observe, torch reference", "absorb"):
        assert part in text
