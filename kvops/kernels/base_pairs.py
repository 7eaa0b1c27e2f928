"""Triton kernels for ``kvops.pack_base_pairs`` and ``kvops.refine_base_pairs``.

One program handles one pair row and streams its two 16-bit pages chunk by chunk. Packing
compacts two pages into the bytes of one, and refinement expands one into two, so when the
destination is also a source (``dst == src_a`` in a pack, ``dst_a == base_page`` in a refine)
a chunk's stores land on bytes that other chunks still have to read. The chunk order is chosen
per row so every store lands on bytes already read, and a CTA barrier between a chunk's loads
and its stores keeps warps from overtaking each other:

- pack, ``dst == src_a``: page a first, ascending (BASE byte ``i`` overwrites value ``i / 2``,
  already read), then page b. ``dst == src_b``: page b first, descending (byte ``E + i``
  overwrites value ``(E + i) / 2 >= i``, already read), then page a.
- refine, ``dst_a == base_page``: half 1 first (into ``dst_b``), then half 0 descending (value
  ``i`` overwrites bytes ``2i, 2i + 1 >= i``, already read). ``dst_b == base_page``: half 0
  first, then half 1 ascending (value ``i`` overwrites bytes ``2i + 1 < E + i``, already read).

``CODEC``: 0 hi8, 1 hi8r (float16), 2 e4m3 (bfloat16); see ``kvops.layouts.codecs``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._common import hw_fp8, next_pow2
from kvops.kernels._launch import Launch, keep_plan
from kvops.layouts.codecs import CODEC_IDS


@triton.jit
def _encode_e4m3(b_u):
    """bfloat16 bit patterns (int32 in [0, 65536)) -> e4m3fn bytes (int32): round to nearest
    even, saturating at +-448; NaN -> NaN. Integer math, so the interpreter and every GPU agree."""
    b_s = (b_u >> 8) & 0x80
    b_a = b_u & 0x7FFF
    b_e = b_a >> 7
    b_v = b_a - (120 << 7)                                      # rebias 127 -> 7
    b_norm = (b_v + 7 + ((b_v >> 4) & 1)) >> 4                  # drop 4 mantissa bits, RNE
    b_m = (b_a & 0x7F) | 0x80
    b_sh = tl.maximum(tl.minimum(125 - b_e, 9), 1)               # subnormal: units of 2^-9
    b_sub = (b_m + ((1 << (b_sh - 1)) - 1) + ((b_m >> b_sh) & 1)) >> b_sh
    b_r = tl.where(b_e >= 121, b_norm, b_sub)
    b_r = tl.where(b_a >= 0x43E0, 0x7E, b_r)                     # >= 448 (and inf): saturate
    b_r = tl.where(b_a > 0x7F80, 0x7F, b_r)                      # NaN
    return b_s | b_r


@triton.jit
def _encode_e4m3_hw(b_u):
    """As :func:`_encode_e4m3`, through the GPU's float8 conversion (sm_89 and newer): clamp to
    +-448, convert rounding to nearest even, then give NaN its sign back as the codec does.
    A few instructions instead of the integer encoder's ~30 per value."""
    b_f = b_u.to(tl.uint16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    b_f = tl.minimum(tl.maximum(b_f, -448.0), 448.0)
    b_x = b_f.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    return tl.where((b_u & 0x7FFF) > 0x7F80, ((b_u >> 8) & 0x80) | 0x7F, b_x)


@triton.jit
def _chunk_step(t, n_ch, b_first, REVERSE_B: tl.constexpr):
    """Step ``t`` of a row's ``2 * n_ch`` chunk steps -> (chunk index, whether it is of page or
    half b). ``b_first``: b's chunks come first, and then the first page's chunks run
    descending: b's in a pack (``REVERSE_B``), a's in a refine (module docstring)."""
    second = t >= n_ch
    k = tl.where(second, t - n_ch, t)
    use_b = second != b_first
    rev = (use_b if REVERSE_B else ~use_b) & b_first
    return tl.where(rev, n_ch - 1 - k, k), use_b


@triton.jit
def _pack_pairs_kernel(
    Cache, Pairs, Backing,
    stride_cp, stride_pn, stride_pc,
    E,
    CODEC: tl.constexpr, BLOCK: tl.constexpr, HW_FP8: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    p_row = Pairs + i_n * stride_pn
    src_a = tl.load(p_row).to(tl.int64)
    src_b = tl.load(p_row + stride_pc).to(tl.int64)
    dst = tl.load(p_row + 2 * stride_pc).to(tl.int64)
    p_c8 = Cache.to(tl.pointer_type(tl.uint8))
    b_first = (dst == src_b) & (dst != src_a)
    n_ch = tl.cdiv(E, BLOCK)
    o_e = tl.arange(0, BLOCK)
    for t in range(0, 2 * n_ch):
        chunk, use_b = _chunk_step(t, n_ch, b_first, True)
        src = tl.where(use_b, src_b, src_a)
        half = use_b.to(tl.int64)
        o_x = chunk * BLOCK + o_e
        m_x = o_x < E
        b_u = tl.load(Cache + src * stride_cp + o_x, mask=m_x, other=0).to(tl.int32) & 0xFFFF
        if CODEC == 2:
            if HW_FP8:
                b_base = _encode_e4m3_hw(b_u)
            else:
                b_base = _encode_e4m3(b_u)
        else:
            b_hi = b_u >> 8
            b_lo = b_u & 0xFF
            if CODEC == 1:
                b_hi = (b_hi & 0x80) | ((b_hi + (b_lo >> 7)) & 0x7F)
            b_base = b_hi
        tl.debug_barrier()
        tl.store(p_c8 + dst * 2 * stride_cp + half * E + o_x, b_base.to(tl.uint8), mask=m_x)
        p_back = Backing + (i_n * 2 + half) * E + o_x
        if CODEC == 2:
            tl.store(p_back, b_u.to(tl.int16), mask=m_x)
        else:
            tl.store(p_back, b_lo.to(tl.uint8), mask=m_x)


@triton.jit
def _refine_pairs_kernel(
    Cache, Pairs, Backing,
    stride_cp, stride_pn, stride_pc,
    E,
    CODEC: tl.constexpr, BLOCK: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    p_row = Pairs + i_n * stride_pn
    dst_a = tl.load(p_row).to(tl.int64)
    dst_b = tl.load(p_row + stride_pc).to(tl.int64)
    base = tl.load(p_row + 2 * stride_pc).to(tl.int64)
    p_c8 = Cache.to(tl.pointer_type(tl.uint8))
    b_first = (dst_a == base) & (dst_b != base)
    n_ch = tl.cdiv(E, BLOCK)
    o_e = tl.arange(0, BLOCK)
    for t in range(0, 2 * n_ch):
        chunk, use_b = _chunk_step(t, n_ch, b_first, False)
        dst = tl.where(use_b, dst_b, dst_a)
        half = use_b.to(tl.int64)
        o_x = chunk * BLOCK + o_e
        m_x = o_x < E
        p_back = Backing + (i_n * 2 + half) * E + o_x
        if CODEC == 2:
            b_u = tl.load(p_back, mask=m_x, other=0).to(tl.int32)
        else:
            b_hi = tl.load(p_c8 + base * 2 * stride_cp + half * E + o_x, mask=m_x,
                           other=0).to(tl.int32)
            b_lo = tl.load(p_back, mask=m_x, other=0).to(tl.int32)
            if CODEC == 1:
                b_hi = (b_hi & 0x80) | ((b_hi - (b_lo >> 7)) & 0x7F)
            b_u = (b_hi << 8) | b_lo
        tl.debug_barrier()
        tl.store(Cache + dst * stride_cp + o_x, b_u.to(tl.int16), mask=m_x)


# Launch shapes (values a chunk, warps), H200 sweeps in docs/tuning.md. No cache hint on the
# loads: evict_last made packs 2-4 % faster but left the dead source pages in L2 ahead of the
# next kernels' data (a refine right after such a pack ran 76 against 72 us).
PACK_LAUNCH = (8192, 16)
REFINE_LAUNCH = {"hi8": (8192, 8), "hi8r": (8192, 8), "e4m3": (8192, 16)}


_PLANS: dict = {}   # launches (``_launch.Launch``) by kernel, argument signature and knobs


def _launch(kernel, cache, pairs, backing, codec, block, num_warps, default, signature,
            hw=None):
    N = pairs.shape[0]
    if N == 0:
        return
    if signature is None:
        signature = (sig(cache), sig(pairs), sig(backing), codec)
    key = (id(kernel), signature, block, num_warps, hw)
    plan = _PLANS.get(key) or keep_plan(_PLANS, key, _plan(kernel, cache, pairs, backing, codec,
                                                           block, num_warps, default, hw))
    plan(cache.view(torch.int16), pairs,
         backing.view(torch.int16) if backing.element_size() == 2 else backing)


def _plan(kernel, cache, pairs, backing, codec, block, num_warps, default, hw):
    N = pairs.shape[0]
    _, S, Hkv, D = cache.shape
    E = S * Hkv * D
    ints = (cache.stride(0), pairs.stride(0), pairs.stride(1), E)
    meta = dict(CODEC=CODEC_IDS[codec], BLOCK=block or min(next_pow2(E), default[0]),
                num_warps=num_warps or default[1])
    if kernel is _pack_pairs_kernel:
        meta["HW_FP8"] = hw_fp8(cache.device) if hw is None else hw
    back_dtype = torch.int16 if backing.element_size() == 2 else backing.dtype
    key = (ints, cache.dtype, cache.device, back_dtype, tuple(sorted(meta.items())),
           cache.data_ptr() % 16, pairs.data_ptr() % 16, backing.data_ptr() % 16)
    return Launch(kernel, (N,), key, ints, meta)


def pack_base_pairs_fwd(cache: torch.Tensor, pairs: torch.Tensor, backing: torch.Tensor,
                        codec: str, *, block: int | None = None, num_warps: int | None = None,
                        hw: bool | None = None, signature=None) -> None:
    """Pack pairs in place. cache [P, S, Hkv, D] (16-bit, pages contiguous); pairs int32 [N, 3]
    rows (src_a, src_b, dst); backing [N, 2, S, Hkv, D] contiguous (uint8 for hi8/hi8r, the
    cache dtype for e4m3). Inputs are already checked by the op; ``block``/``num_warps`` override
    the defaults (benchmarks use them), ``hw`` the e4m3 encoder choice
    (:func:`kvops.kernels._common.hw_fp8`). A launch is kept per argument signature
    (``signature``: the op's, else one is computed here) and knobs."""
    _launch(_pack_pairs_kernel, cache, pairs, backing, codec, block, num_warps, PACK_LAUNCH,
            signature, hw)


def refine_base_pairs_fwd(cache: torch.Tensor, pairs: torch.Tensor, backing: torch.Tensor,
                          codec: str, *, block: int | None = None,
                          num_warps: int | None = None, signature=None) -> None:
    """Refine pairs in place: pairs int32 [N, 3] rows (dst_a, dst_b, base_page); other arguments
    as in :func:`pack_base_pairs_fwd`."""
    _launch(_refine_pairs_kernel, cache, pairs, backing, codec, block, num_warps,
            REFINE_LAUNCH[codec], signature)
