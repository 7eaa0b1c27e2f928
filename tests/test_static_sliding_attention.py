"""static_sliding_attention: kernel and reference against a float64 oracle, plus the op contract
(opcheck, compile without recompiles, CUDA graphs, input errors, validation mode)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvops
import kvops.kernels.static_sliding_attention as ssa
from kvops.kernels import _splitk
from kvops.kernels._common import DeviceProps, kv_block_n
from kvops.kernels.static_sliding_attention import static_sliding_attention_fwd, wave_tile
from kvops.ops.static_sliding_attention import static_sliding_attention_ref
from tests.conftest import LaunchSpy, capture_graph, counting_backend, requires_cuda
from tests.oracles_attention import sliding_window_oracle
from tests.tolerances import ATTN_TOL, LSE_TOL, assert_close

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def make_case(B, W, Hkv, G, D, C, dtype, device, seed, empty_rows=()):
    """Random window, ring starts and lengths (some rows empty), optional far slots with some
    -inf biases. Values are unit-scale so tolerances mean the same at every D."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(device)
    q, k, v = rnd(B, Hkv * G, D), rnd(B, W, Hkv, D), rnd(B, W, Hkv, D)
    win_start = torch.randint(0, W, (B,), generator=gen, dtype=torch.int32)
    win_len = torch.randint(0, W + 1, (B,), generator=gen, dtype=torch.int32)
    win_len[-1] = W                                   # always one full window
    for r in empty_rows:
        win_len[r] = 0
    case = dict(q=q, k=k, v=v, win_start=win_start.to(device), win_len=win_len.to(device))
    if C:
        bias = torch.randn(B, C, generator=gen) * 2
        bias[torch.rand(B, C, generator=gen) < 0.3] = float("-inf")
        case.update(far_k=rnd(B, C, Hkv, D), far_v=rnd(B, C, Hkv, D), far_bias=bias.to(device))
    return case


def case_id(B, W, Hkv, G, D, C, dtype):
    return f"B{B}-W{W}-Hkv{Hkv}-G{G}-D{D}-C{C}-{str(dtype).replace('torch.', '')}"


def check_against_oracle(out, lse, case, dtype, name):
    want_out, want_lse = sliding_window_oracle(**case)
    atol, rtol = ATTN_TOL[dtype]
    assert out.dtype == case["q"].dtype and lse.dtype == torch.float32
    assert_close("out", out, want_out, atol, rtol, name)
    assert_close("lse", lse, want_lse, LSE_TOL[dtype], LSE_TOL[dtype], name)


shapes = st.tuples(
    st.integers(1, 5),                                 # B (odd sizes included)
    st.sampled_from([1, 7, 24, 48, 100, 130]),         # W, mostly not powers of two
    st.sampled_from([1, 2]),                           # Hkv
    st.sampled_from([1, 2, 3, 4, 8]),                  # G (3: SmolLM2's group)
    st.sampled_from([64, 128, 256]),                   # D
    st.sampled_from([0, 0, 3, 9]),                     # C far slots (0: none)
    st.sampled_from(DTYPES),
    st.integers(0, 2**31 - 1),                         # seed
)


@given(shape=shapes, num_splits=st.sampled_from([None, 1, 3]))
def test_kernel_matches_oracle(kernel_device, poison, shape, num_splits):
    *dims, seed = shape
    case = make_case(*dims, device=kernel_device, seed=seed, empty_rows=(0,) if seed % 3 == 0 else ())
    out, lse = static_sliding_attention_fwd(**case, num_splits=num_splits)
    check_against_oracle(out, lse, case, dims[-1], case_id(*dims) + f"-splits{num_splits}")


@given(shape=shapes)
def test_reference_matches_oracle(shape):
    *dims, seed = shape
    case = make_case(*dims, device="cpu", seed=seed)
    out, lse = static_sliding_attention_ref(**case)
    check_against_oracle(out, lse, case, dims[-1], case_id(*dims))


@pytest.mark.parametrize("far", [False, True], ids=["near", "far"])
def test_nothing_visible_gives_zero_and_neg_inf(kernel_device, poison, far):
    case = make_case(3, 40, 2, 4, 64, 4 if far else 0, torch.float16, kernel_device, seed=1)
    case["win_len"].zero_()
    if far:
        case["far_bias"].fill_(float("-inf"))
    for num_splits in (1, 4):
        out, lse = static_sliding_attention_fwd(**case, num_splits=num_splits)
        assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))
        assert torch.isneginf(lse).all()


def test_far_only_rows(kernel_device, poison):
    """An empty near window with live far slots attends to the far view alone."""
    case = make_case(2, 33, 1, 3, 64, 5, torch.float32, kernel_device, seed=2)
    case["win_len"].zero_()
    case["far_bias"][:, 0] = 0.0
    out, lse = static_sliding_attention_fwd(**case)
    check_against_oracle(out, lse, case, torch.float32, "far-only")


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_empty_far_slots_holding_nan_change_nothing(kernel_device, num_splits):
    """NaN and inf in the K/V of empty far slots (bias -inf) never reach the output, whichever
    split reads them; the live slots still count."""
    case = make_case(3, 40, 2, 4, 64, 70, torch.float16, kernel_device, seed=5)
    dead = torch.isneginf(case["far_bias"])
    assert dead.any() and (~dead).any()
    want = static_sliding_attention_fwd(**case, num_splits=num_splits)
    for name, bad in (("far_k", float("nan")), ("far_v", float("inf"))):
        case[name] = case[name].masked_fill(dead[:, :, None, None], bad)
    out, lse = static_sliding_attention_fwd(**case, num_splits=num_splits)
    torch.testing.assert_close(out, want[0], atol=0, rtol=0)
    torch.testing.assert_close(lse, want[1], atol=0, rtol=0)


@pytest.mark.parametrize("pairs,sms,D,dtype,want", [
    (4, 4, 128, torch.float16, 128),       # one full wave
    (5, 4, 128, torch.float16, 64),        # two waves, their slots 62 % full
    (13, 8, 128, torch.bfloat16, 64),      # 81 %
    (41, 25, 128, torch.float16, 64),      # 82 %: SPILL_FILL exactly
    (7, 4, 128, torch.float16, 128),       # 88 %
    (9, 4, 96, torch.float16, 64),         # D 96 pads to 128; 75 % of three waves
    (8, 4, 128, torch.float16, 128),       # two full waves
    (5, 8, 128, torch.float16, 64),        # one wave, 62 % of the SMs busy
    (13, 20, 128, torch.float16, 64),      # 65 %: IDLE_FILL exactly
    (6, 8, 128, torch.float16, 128),       # one wave, 75 %
    (5, 4, 64, torch.float16, 128),        # D 64: never measured
    (5, 4, 64, torch.float32, 128),        # float32 D 64 (also a 64 KiB, 128-row tile)
    (5, 4, 128, torch.float32, 64),        # float32 D 128: 64-row tiles already
])
def test_wave_tile_only_where_waves_are_poorly_filled(pairs, sms, D, dtype, want, monkeypatch):
    """``wave_tile`` given the default tile, on ``sms`` SMs."""
    block_n = kv_block_n(D, dtype)
    assert wave_tile(pairs, block_n, D, dtype.itemsize, sms) == min(want, block_n)


def _launches(case, sms, monkeypatch, **knobs):
    """(grid, BLOCK_N, num_stages) of every main-kernel launch the op makes on ``sms`` SMs (its
    one-launch form alone: a plan's first call also runs the two-launch form, of one shape)."""
    monkeypatch.setattr(ssa, "device_props", lambda device: DeviceProps(sms, 227 * 1024, (0, 0),
                                                                        False))
    monkeypatch.setattr(_splitk, "load_capture_form", lambda ready: False)
    spy = LaunchSpy(ssa._sliding_window_kernel)
    monkeypatch.setattr(ssa, "_sliding_window_kernel", spy)
    out, lse = static_sliding_attention_fwd(**case, **knobs)
    return out, lse, [(g, kw["BLOCK_N"], kw["num_stages"]) for g, kw in spy.launches]


@pytest.mark.parametrize("sms,grid", [(4, (6, 1)), (10, (6, 3))])
def test_wave_tile_launch_matches_oracle(kernel_device, sms, grid, monkeypatch):
    """Launches whose 128-row grid would spill into a partial second wave (6 programs on 4 SMs:
    64-row tiles, unsplit) or leave SMs idle (6 on 10: 64-row tiles, 3 splits) take that shape
    by themselves and still match the oracle, over a window longer than ``SHORT_SHARED`` with
    partial and empty windows."""
    dims = (3, ssa.SHORT_SHARED + 76, 2, 4, 128, 0, torch.float16)
    case = make_case(*dims, device=kernel_device, seed=sms, empty_rows=(1,))
    out, lse, launches = _launches(case, sms, monkeypatch)
    check_against_oracle(out, lse, case, dims[-1], case_id(*dims) + f"-sms{sms}")
    assert launches == [(grid, 64, 3)]


@pytest.mark.parametrize("knobs", [dict(num_splits=1), dict(block_n=128), dict(num_stages=3)])
def test_wave_tile_not_where_the_launch_is_forced(kernel_device, knobs, monkeypatch):
    """A forced tile, depth or split count keeps the 128-row tile where ``wave_tile`` would
    take 64 rows (6 programs on 4 SMs)."""
    dims = (3, ssa.SHORT_SHARED + 76, 2, 4, 128, 0, torch.float16)
    case = make_case(*dims, device=kernel_device, seed=1)
    out, lse, launches = _launches(case, 4, monkeypatch, **knobs)
    check_against_oracle(out, lse, case, dims[-1], case_id(*dims) + f"-{knobs}")
    assert [(n, stages) for _, n, stages in launches] == [(128, 3)]


@pytest.mark.parametrize("sms,grid", [(4, (6, 1)), (10, (6, 3))])
def test_far_slots_are_rows_of_the_same_splits(kernel_device, sms, grid, monkeypatch):
    """A window with far slots launches as a window as wide: ``SHORT_SHARED - 100`` rows and
    176 far slots take the grid and tile of ``SHORT_SHARED + 76`` rows (one launch, no extra
    split), split ranges crossing from the window into the far slots, and match the oracle."""
    dims = (3, ssa.SHORT_SHARED - 100, 2, 4, 128, 176, torch.float16)
    case = make_case(*dims, device=kernel_device, seed=sms, empty_rows=(1,))
    out, lse, launches = _launches(case, sms, monkeypatch)
    check_against_oracle(out, lse, case, dims[-1], case_id(*dims) + f"-sms{sms}")
    assert launches == [(grid, 64, 3)]


@pytest.mark.parametrize("far_block_n,num_splits", [(16, 1), (16, 3), (32, 5), (64, 2)])
def test_far_tile_smaller_than_the_window_tile(kernel_device, far_block_n, num_splits):
    """Far slots walked in tiles smaller than the window's (``far_block_n`` below ``block_n``
    64), over 100 far slots that several splits cut: every far slot is attended once."""
    dims = (3, 150, 2, 4, 64, 100, torch.float32)
    case = make_case(*dims, device=kernel_device, seed=far_block_n + num_splits)
    out, lse = static_sliding_attention_fwd(**case, block_n=64, num_splits=num_splits,
                                            far_block_n=far_block_n)
    check_against_oracle(out, lse, case, dims[-1], case_id(*dims) + f"-far{far_block_n}")


@pytest.mark.parametrize("bad", [8, 24, 0])
def test_far_block_n_must_be_a_power_of_two_of_16_or_more(bad):
    case = make_case(2, 32, 2, 4, 64, 4, torch.float32, torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match="far_block_n: expected a power of two >= 16"):
        static_sliding_attention_fwd(**case, far_block_n=bad)


def test_ring_wrap_equals_rotated_prefix(kernel_device):
    """A window that wraps the ring equals the same slots rotated to a plain prefix."""
    case = make_case(1, 96, 2, 4, 128, 0, torch.float32, kernel_device, seed=3)
    case["win_start"].fill_(80)
    case["win_len"].fill_(50)                         # slots 80..95 then 0..33
    out, lse = static_sliding_attention_fwd(**case)
    rolled = dict(case, k=case["k"].roll(-80, dims=1).contiguous(),
                  v=case["v"].roll(-80, dims=1).contiguous(),
                  win_start=torch.zeros_like(case["win_start"]))
    out2, lse2 = static_sliding_attention_fwd(**rolled)
    torch.testing.assert_close(out, out2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse2, atol=1e-5, rtol=1e-5)


def test_op_dispatches_to_kernel_under_triton_backend(kernel_device):
    case = make_case(2, 24, 2, 2, 64, 3, torch.float32, kernel_device, seed=4)
    with kvops.backend("triton"):
        out, lse = torch.ops.kvops.static_sliding_attention(**case)
    check_against_oracle(out, lse, case, torch.float32, "op-triton")


def test_backend_env_read_at_import():
    env = dict(os.environ, KVOPS_BACKEND="triton", TRITON_INTERPRET="1")
    code = "import kvops; print(kvops.backend())"
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert got == "triton"
    env["KVOPS_BACKEND"] = "cuda-please"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "backend: expected one of" in bad.stderr


def test_opcheck():
    for C in (0, 3):
        case = make_case(3, 20, 2, 3, 64, C, torch.float32, "cpu", seed=5)
        torch.library.opcheck(torch.ops.kvops.static_sliding_attention.default, (),
                              dict(case, scale=0.1))


def test_compiled_decode_step_never_recompiles():
    """20 decode steps with moving ring start and length: one compile, zero recompiles."""
    torch._dynamo.reset()
    backend, calls = counting_backend()
    B, W, Hkv, G, D = 2, 48, 2, 3, 64
    k = torch.randn(B, W, Hkv, D)
    v = torch.randn(B, W, Hkv, D)
    proj = torch.randn(D, D) * D ** -0.5

    @torch.compile(backend=backend, fullgraph=True)
    def step(x, k, v, win_start, win_len):
        q = x @ proj
        out, lse = torch.ops.kvops.static_sliding_attention(q, k, v, win_start, win_len)
        return out @ proj.T, lse

    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(20):
            x = torch.randn(B, Hkv * G, D)
            win_start = torch.tensor([t % W, (3 * t) % W], dtype=torch.int32)
            win_len = torch.tensor([min(t + 1, W), W - t], dtype=torch.int32)
            out, lse = step(x, k, v, win_start, win_len)
            want, want_lse = static_sliding_attention_ref(x @ proj, k, v, win_start, win_len)
            torch.testing.assert_close(out, want @ proj.T, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(lse, want_lse)
    assert len(calls) == 1


@requires_cuda
@pytest.mark.parametrize("far", [False, True], ids=["near", "far"])
def test_cuda_graph_replay_with_new_values(far):
    B, W, Hkv, G, D, C = 4, 1000, 8, 4, 128, (16 if far else 0)
    case = make_case(B, W, Hkv, G, D, C, torch.float16, "cuda", seed=6)
    static = {n: t.clone() for n, t in case.items()}
    graph, (out, lse) = capture_graph(lambda: torch.ops.kvops.static_sliding_attention(**static))
    for seed in range(7, 10):
        fresh = make_case(B, W, Hkv, G, D, C, torch.float16, "cuda", seed=seed)
        for n, t in fresh.items():
            static[n].copy_(t)
        graph.replay()
        want, want_lse = static_sliding_attention_ref(**fresh)
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


@requires_cuda
def test_large_batch_offsets_do_not_overflow():
    """k with more than 2**31 elements: batch offsets must be 64-bit."""
    B, W, Hkv, D = 9, 2**16, 32, 128        # 2.4e9 elements per tensor, 4.8 GB in fp16
    k = torch.randn(B, W, Hkv, D, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn(B, Hkv, D, device="cuda", dtype=torch.float16)
    ws = torch.zeros(B, dtype=torch.int32, device="cuda")
    wl = torch.full((B,), 64, dtype=torch.int32, device="cuda")
    out, lse = torch.ops.kvops.static_sliding_attention(q, k, v, ws, wl)
    want, want_lse = static_sliding_attention_ref(q[-1:], k[-1:, :64], v[-1:, :64], ws[-1:], wl[-1:])
    torch.testing.assert_close(out[-1:], want, atol=2e-3, rtol=2e-3)


def _bad_inputs():
    ok = make_case(2, 16, 2, 2, 64, 3, torch.float16, "cpu", seed=0)
    yield "q-rank", dict(ok, q=ok["q"][0]), ValueError, "q: expected rank 3"
    yield "q-dtype", dict(ok, q=ok["q"].to(torch.float64)), TypeError, "q: expected dtype"
    yield "k-dtype", dict(ok, k=ok["k"].float()), TypeError, "k: expected dtype"
    yield "v-shape", dict(ok, v=ok["v"][:, :8]), ValueError, "v: expected shape"
    yield "heads", dict(ok, q=torch.randn(2, 3, 64).half()), ValueError, "Hq=3 must be a multiple"
    yield "head-dim", dict(ok, q=ok["q"][..., :40].contiguous(), k=ok["k"][..., :40].contiguous(),
                           v=ok["v"][..., :40].contiguous(), far_k=ok["far_k"][..., :40].contiguous(),
                           far_v=ok["far_v"][..., :40].contiguous()), ValueError, "D=40"
    yield "win-dtype", dict(ok, win_len=ok["win_len"].long()), TypeError, "win_len: expected dtype"
    yield "win-shape", dict(ok, win_start=ok["win_start"][:1]), ValueError, "win_start: expected shape"
    yield "far-partial", dict(ok, far_v=None), ValueError, "give all three or none"
    yield "far-bias-dtype", dict(ok, far_bias=ok["far_bias"].half()), TypeError, "far_bias"
    yield "k-strided", dict(ok, k=ok["k"].transpose(1, 3).contiguous().transpose(1, 3)), ValueError, \
        "k: expected the last dim"
    yield "not-tensor", dict(ok, q=[1.0]), RuntimeError, "type 'Tensor' for argument 'q'"
    meta = torch.stack([ok["win_start"], ok["win_len"]], dim=1)       # [B, 2]: columns strided
    yield "win-strided", dict(ok, win_start=meta[:, 0], win_len=meta[:, 1]), ValueError, \
        "win_start: expected a contiguous tensor"
    wide = torch.zeros(2, 6)
    yield "far-bias-strided", dict(ok, far_bias=wide[:, ::2]), ValueError, \
        "far_bias: expected the last dim"


@pytest.mark.parametrize("name,kwargs,exc,msg", list(_bad_inputs()),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise(name, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        torch.ops.kvops.static_sliding_attention(**kwargs)


def test_validation_mode_raises_on_out_of_range():
    case = make_case(2, 16, 2, 2, 64, 0, torch.float32, "cpu", seed=0)
    case["win_len"][0] = 17
    out, lse = torch.ops.kvops.static_sliding_attention(**case)   # no sync: row 0 NaN
    assert out[0].isnan().all() and lse[0].isnan().all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()
    with kvops.validate(True), pytest.raises(IndexError, match=r"win_len: values must lie in "
                                             r"\[0, 17\).*\[B, Hkv, T, D\]"):
        torch.ops.kvops.static_sliding_attention(**case)
    case["win_len"][0] = 3
    case["win_start"][1] = -1
    with kvops.validate(True), pytest.raises(IndexError, match="win_start"):
        torch.ops.kvops.static_sliding_attention(**case)
    assert kvops.validate() is False


def test_transformers_layout_is_named_or_poisoned():
    """K/V in transformers' [B, Hkv, T, D]: when Hq % T != 0 the heads error names the layout;
    when the shapes fit (T divides Hq) and win_len = T exceeds W (read as Hkv), the rows are
    NaN, and validation mode raises naming the layout."""
    B, Hq, Hkv, D = 2, 8, 2, 32
    q = torch.randn(B, Hq, D)
    bad = torch.randn(B, Hkv, 3, D)                         # T = 3 does not divide Hq
    wl = torch.full((B,), 3, dtype=torch.int32)
    ws = torch.zeros(B, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\[B, Hkv, T, D\]"):
        torch.ops.kvops.static_sliding_attention(q, bad, bad, ws, wl)
    fits = torch.randn(B, Hkv, 4, D)                        # T = 4 divides Hq: shapes pass
    wl.fill_(4)
    out, lse = torch.ops.kvops.static_sliding_attention(q, fits, fits, ws, wl)
    assert out.isnan().all() and lse.isnan().all()
    with kvops.validate(True), pytest.raises(IndexError, match=r"\[B, Hkv, T, D\]"):
        torch.ops.kvops.static_sliding_attention(q, fits, fits, ws, wl)
