"""BASE codecs: exhaustive round trips over all 65,536 16-bit patterns, for the reference codecs
and for the Triton pack/refine kernels, plus what each codec's BASE value is."""

from __future__ import annotations

import pytest
import torch

from kvops.kernels.base_pairs import pack_base_pairs_fwd, refine_base_pairs_fwd
from kvops.layouts import codecs
from kvops.layouts.pairs import base_pair_view
from tests.oracles_elastic import decode_f64, high_low_bytes

ALL = torch.arange(65536, dtype=torch.int32).to(torch.int16)   # every 16-bit pattern
CASES = [(torch.float16, "hi8"), (torch.float16, "hi8r"), (torch.bfloat16, "e4m3")]
IDS = ["fp16-hi8", "fp16-hi8r", "bf16-e4m3"]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


@pytest.mark.parametrize("dtype,codec", CASES, ids=IDS)
def test_reference_round_trip_every_pattern(dtype, codec):
    x = ALL.view(dtype)
    base, backing = codecs.encode(x, codec)
    assert base.dtype == torch.uint8 and backing.dtype == codecs.backing_dtype(codec, dtype)
    assert same_bits(codecs.refine(base, backing, codec, dtype), x)


def test_hi8_base_is_the_high_byte_and_decodes_with_zero_low_byte():
    x = ALL.view(torch.float16)
    base, backing = codecs.encode(x, "hi8")
    hi, lo = high_low_bytes(x)
    assert torch.equal(base, hi) and torch.equal(backing, lo)
    dec = codecs.decode(base, torch.float16)
    assert torch.equal(high_low_bytes(dec)[0], hi)
    assert torch.equal(high_low_bytes(dec)[1], torch.zeros_like(lo))
    # and that is float8 e5m2 rounded toward zero: never larger in magnitude
    fin = torch.isfinite(x)
    assert bool((dec[fin].double().abs() <= x[fin].double().abs()).all())


def test_hi8r_rounds_to_nearest_and_says_where_it_differs():
    x = ALL.view(torch.float16)
    base, _ = codecs.encode(x, "hi8r")
    dec = decode_f64(base, torch.float16)
    xd = x.double()
    small = torch.isfinite(x) & (xd.abs() < 61440)
    rne = x.to(torch.float8_e5m2).double()
    tie = small & (high_low_bytes(x)[1] == 0x80)
    # off ties it is the round-to-nearest cast; at ties it rounds the magnitude away from zero
    assert torch.equal(dec[small & ~tie], rne[small & ~tie])
    assert bool((dec[tie].abs() > xd[tie].abs()).all())
    assert bool(((dec[small] - xd[small]).abs() <= (rne[small] - xd[small]).abs()).all())
    big = torch.isfinite(x) & (xd.abs() >= 61440)     # the top half binade rounds to inf
    assert torch.equal(dec[big], torch.where(xd[big] > 0, float("inf"), float("-inf")).double())
    nan = torch.isnan(x)
    wrapped = nan & ((ALL.to(torch.int32) & 0x7FFF) >= 0x7F80)
    assert int(wrapped.sum()) == 256                   # 0x7F80..0x7FFF and 0xFF80..0xFFFF
    assert bool((dec[wrapped] == 0).all())
    to_inf = nan & ((ALL.to(torch.int32) & 0x7FFF) < 0x7C80)   # 0x7C01..0x7C7F, as with hi8
    assert bool(torch.isinf(dec[to_inf]).all())
    assert bool(torch.isnan(dec[nan & ~wrapped & ~to_inf]).all())


def test_hi8r_halves_the_base_error():
    x = (torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) *
         torch.logspace(-3, 3, 1 << 16)).to(torch.float16)
    err = {c: (codecs.decode(codecs.encode(x, c)[0], torch.float16).double() - x.double()).abs()
           for c in ("hi8", "hi8r")}
    normal = x.double().abs() >= 2 ** -14               # e5m2 normals: relative bounds hold
    rel = {c: (e[normal] / x.double().abs()[normal]).max().item() for c, e in err.items()}
    assert rel["hi8"] <= 2 ** -2 and rel["hi8r"] <= 2 ** -3
    ratio = (err["hi8r"].mean() / err["hi8"].mean()).item()
    assert 0.4 < ratio < 0.6, ratio


def test_e4m3_base_is_the_saturating_round_to_nearest_cast():
    x = ALL.view(torch.bfloat16)
    base, _ = codecs.encode(x, "e4m3")
    fin = torch.isfinite(x)
    want = x[fin].double().clamp(-448, 448).to(torch.float8_e4m3fn).double()
    assert torch.equal(decode_f64(base, torch.bfloat16)[fin], want)
    assert torch.equal(decode_f64(base, torch.bfloat16)[torch.isinf(x)].abs(),
                       torch.full((2,), 448.0, dtype=torch.float64))
    assert bool(torch.isnan(decode_f64(base, torch.bfloat16)[torch.isnan(x)]).all())
    assert torch.equal(codecs.decode(base, torch.bfloat16).double()[fin], want)


@pytest.mark.parametrize("dtype,codec", CASES, ids=IDS)
def test_kernels_round_trip_every_pattern_in_place(kernel_device, dtype, codec):
    """Page 0 holds all 65,536 patterns, page 1 the same reversed; pack in place into page 0,
    check BASE and backing bytes against the reference codec, refine in place back."""
    page = ALL.view(dtype).reshape(16, 16, 256)
    cache = torch.stack([page, page.flip(0), torch.zeros_like(page)]).to(kernel_device)
    orig = cache.clone()
    pairs = torch.tensor([[0, 1, 0]], dtype=torch.int32, device=kernel_device)
    backing = torch.empty((1, 2, 16, 16, 256), dtype=codecs.backing_dtype(codec, dtype),
                          device=kernel_device)
    pack_base_pairs_fwd(cache, pairs, backing, codec)
    base, back = codecs.encode(orig[:2].cpu(), codec)
    assert torch.equal(base_pair_view(cache)[0].cpu(), base)
    assert torch.equal(backing[0].cpu().view(torch.uint8), back.view(torch.uint8))
    assert same_bits(cache[1:], orig[1:])
    refine_base_pairs_fwd(cache, torch.tensor([[0, 1, 0]], dtype=torch.int32,
                                              device=kernel_device), backing, codec)
    assert same_bits(cache, orig)
