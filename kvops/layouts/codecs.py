"""BASE codecs of ElasticKV (paper sections 3.1 and B.3): an 8-bit, directly executable form of a
16-bit TARGET value, plus the backing that makes refinement back to TARGET bit exact.

Codecs, by TARGET dtype (``codec=None`` picks the default):

- float16, ``"hi8"`` (default, the paper's and the contract's): BASE is the high byte of the
  16-bit pattern, i.e. float8 e5m2 rounded toward zero; the backing is the low byte. Decoding
  puts the byte back as the high byte with a zero low byte.
- float16, ``"hi8r"``: the high byte rounded to nearest (ties away from zero) by adding bit 7 of
  the low byte into the 7-bit magnitude *modulo 128*; the backing is the same low byte. For a
  fixed low byte that map is a permutation of the 256 high bytes, so refinement is exact for all
  65,536 patterns (tested exhaustively). It decodes exactly like hi8 (byte, zero low byte), so
  ``elastic_attention`` reads both. Where it differs from a plain rounding cast: finite values
  with ``|x| >= 61440`` (the top e5m2 binade's upper half) round to inf, as an IEEE
  round-to-nearest cast to e5m2 does, and the 256 NaN patterns with magnitude ``>= 0x7F80``
  wrap to a signed zero (other NaNs stay NaN). Both only matter for values no KV cache holds.
- bfloat16, ``"e4m3"`` (the only bf16 codec): BASE is float8 e4m3fn, round to nearest even,
  saturating at +-448 (inf clamps to +-448, NaN stays NaN); the backing is the full bfloat16
  value. e4m3 was chosen over e5m2 by measured attention error; see docs/elastickv.md.

Shapes are free: every function works elementwise on any shape. ``base`` is always uint8;
``backing`` is uint8 for the hi8 codecs and the TARGET dtype for e4m3.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP16_CODECS = ("hi8", "hi8r")
# The kernels' CODEC constant: a codec's id (the elastic decode kernel reads hi8 and hi8r the
# same way, as the high byte, and takes hi8's id for both)
CODEC_IDS = {"hi8": 0, "hi8r": 1, "e4m3": 2}
BF16_CODECS = ("e4m3",)
E4M3_MAX = 448.0


def default_codec(dtype: torch.dtype) -> str:
    """The codec a TARGET dtype uses when none is named."""
    if dtype == torch.float16:
        return "hi8"
    if dtype == torch.bfloat16:
        return "e4m3"
    raise TypeError(f"cache: BASE codecs need dtype float16 or bfloat16, got {dtype}")


def check_codec(codec: str | None, dtype: torch.dtype) -> str:
    """Resolve ``codec`` for a TARGET ``dtype``; raise ``ValueError`` naming the valid codecs."""
    default = default_codec(dtype)
    if codec is None:
        return default
    valid = FP16_CODECS if dtype == torch.float16 else BF16_CODECS
    if codec not in valid:
        raise ValueError(f"codec: expected one of {valid} (or None) for {dtype}, got {codec!r}")
    return codec


def backing_dtype(codec: str, target: torch.dtype) -> torch.dtype:
    """dtype of the backing a codec keeps: uint8 low bytes (hi8, hi8r) or the TARGET itself."""
    return torch.uint8 if codec in FP16_CODECS else target


def _bits16(x: Tensor) -> Tensor:
    """The 16-bit patterns of ``x`` as int32 in [0, 65536)."""
    return x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _from_bits16(bits: Tensor, dtype: torch.dtype) -> Tensor:
    return bits.to(torch.int16).view(dtype)   # int32 -> int16 wraps, keeping the low 16 bits


def encode(x: Tensor, codec: str) -> tuple[Tensor, Tensor]:
    """TARGET ``x`` (float16 or bfloat16) -> ``(base uint8, backing)``, both of x's shape."""
    if codec in FP16_CODECS:
        bits = _bits16(x)
        hi, lo = bits >> 8, bits & 0xFF
        if codec == "hi8r":
            hi = (hi & 0x80) | ((hi + (lo >> 7)) & 0x7F)
        return hi.to(torch.uint8), lo.to(torch.uint8)
    if codec == "e4m3":
        base = x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return base, x.clone()
    raise ValueError(f"codec: unknown codec {codec!r}")


def decode(base: Tensor, dtype: torch.dtype) -> Tensor:
    """BASE bytes -> values in the TARGET ``dtype``, as attention reads them.

    float16: the byte is the high byte and the low byte is zero (hi8 and hi8r alike);
    bfloat16: the byte is float8 e4m3fn, converted exactly.
    """
    if dtype == torch.float16:
        return _from_bits16(base.to(torch.int32) << 8, torch.float16)
    if dtype == torch.bfloat16:
        return base.view(torch.float8_e4m3fn).to(torch.bfloat16)
    raise TypeError(f"cache: BASE codecs need dtype float16 or bfloat16, got {dtype}")


def refine(base: Tensor, backing: Tensor, codec: str, dtype: torch.dtype) -> Tensor:
    """``(base, backing)`` -> the original TARGET values, bit for bit."""
    if codec in FP16_CODECS:
        hi, lo = base.to(torch.int32), backing.to(torch.int32)
        if codec == "hi8r":
            hi = (hi & 0x80) | ((hi - (lo >> 7)) & 0x7F)
        return _from_bits16((hi << 8) | lo, dtype)
    if codec == "e4m3":
        return backing.clone()
    raise ValueError(f"codec: unknown codec {codec!r}")
