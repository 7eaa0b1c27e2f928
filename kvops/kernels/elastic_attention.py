"""Triton kernel for ``kvops.elastic_attention``: paged decode over TARGET and BASE blocks.

One kernel family, three paths chosen by the constexpr ``MODE`` (ElasticKV section 3.2):

- ``MODE == 0`` native: every block TARGET. A plain GQA paged decode kernel; no BASE code is
  compiled in, so it pays nothing for the elastic machinery.
- ``MODE == 1`` structured: ``base_span [B, 2]`` gives the BASE blocks ``[first, end)``; a block's
  mode and half follow from its index, so no per-block metadata is loaded.
- ``MODE == 2`` general: a per-block mode (0 TARGET, 1 half 0, 2 half 1) in ``block_mode
  [B, L]``, scanned to cut runs. A BASE tile that loads one page id a page also loads the
  page's mode byte (its half); for tiles that load an id a row, ``_half_pages_kernel`` first
  folds the modes into the page ids (``2 * page + half``), so the loop loads page and half
  together.

One program handles one (sequence, KV head, split): it loads the ``G`` query heads of the group
once and streams its share of the sequence's tokens in tiles of ``BLOCK_N`` rows, so each KV row
is read once for the whole group. A tile's page comes from the page table: one id a tile when
``S`` is a multiple of ``BLOCK_N``, one for each half of a tile of two whole pages, else one a
row (``tile_pages``). The mixed paths walk the split as runs of one
form (three at most on the structured path, found by scanning the mode table on the general
one), and each run is a plain pipelined loop of single-form tiles: TARGET tiles read 16-bit
values, BASE tiles read their half of the pair page as 32-bit words of four bytes and decode
them into four byte planes (``_planes``), against which the query group and the accumulator are
split the same way for the run. So a tile costs the bytes and the instructions of its own form
only. Splits are merged in the same launch by the last split of each (sequence, KV head) in eager
calls (``_splitk.merge_if_last``), by ``_splitk.merge_split_outputs`` under CUDA-graph capture.
The mixed paths cut long splits where
they cost alike rather than at equal rows (``weighted_from``).

Launch shapes come from ``elastic_launch``: one-warp programs of 16-row tiles on the native
path and 32-row tiles on the mixed paths, 4-5 pipeline stages, BASE runs a buffered tile deeper
than TARGET runs, and the dense kernel's shape (128-row tiles, 4 warps, unsplit) on the native
path where that fills one wave of the SMs. A one-warp program keeps a tile's scores, softmax and
``P`` in its own registers, and many small programs an SM hide each other's latency.
docs/tuning.md gives the measurements behind each rule.

``CODEC``: 0 float16 BASE (hi8/hi8r: the byte is the high byte, low byte zero), 2 bfloat16
BASE (float8 e4m3fn), as in ``kvops.layouts.codecs``. Compiled for NVIDIA sm_89+, e4m3 planes
are float16 (the GPU's float8 conversion; every e4m3 value is a float16), so a bf16 BASE run
dots a float16 query group (a power-of-two scale a head) against them: 831 SASS instructions a
32-row tile against 4,040 for the integer decode into bfloat16, which the interpreter and older
GPUs keep.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._attention import (
    dot,
    finish_rows,
    load_query_group,
    online_softmax_tile,
    raise_max,
    softmax_step,
    split_range,
)
from kvops.kernels._common import (
    LOG2E,
    DeviceProps,
    device_props,
    dot_precision,
    grid_waves,
    kv_block_n,
    kv_tile_bytes,
    next_pow2,
)
from kvops.kernels._launch import Launch, keep_plan, launch
from kvops.kernels._splitk import (
    DecodePlan,
    default_num_splits,
    launch_split,
    merge_if_last,
    merge_plan,
    split_outputs,
    standard_strides,
    use_pdl,
)
from kvops.layouts.codecs import CODEC_IDS


@triton.jit
def _decode_base(b_x, CODEC: tl.constexpr):
    """BASE bytes (uint8) -> TARGET values (float16 for CODEC 0, bfloat16 for CODEC 2)."""
    # Both codecs return from their own branch of the static if: triton 3.6 rejects a function
    # whose early return and fall-through return differ in type, even under a constexpr test.
    if CODEC == 0:
        return (b_x.to(tl.int16) << 8).to(tl.float16, bitcast=True)
    else:
        # e4m3fn -> float16 bits, the exponent rebias folded into a *256 (exact, subnormals too)
        b_mag = (b_x & 0x7F).to(tl.int16)
        b_h = ((b_mag << 7) | ((b_x & 0x80).to(tl.int16) << 8)).to(tl.float16, bitcast=True)
        b_f = tl.where(b_mag == 0x7F, float("nan"), b_h.to(tl.float32) * 256.0)
        return b_f.to(tl.bfloat16)


_HI8_PLANES = tl.constexpr(
    "{ .reg .b32 z, y; and.b32 z, $4, 0xFFFFFF00; and.b32 y, $5, 0x00FFFFFF; "
    "prmt.b32 $0, $4, y, 0x4707; prmt.b32 $1, z, $5, 0x5010; "
    "prmt.b32 $2, z, $5, 0x6020; prmt.b32 $3, z, $5, 0x7030; }")
# plane k: byte k of both words into one 16-bit pair, then the GPU's e4m3x2 -> f16x2 (sm_89+)
_E4M3_PLANES = tl.constexpr(
    "{ .reg .b32 t; .reg .b16 lo, hi; "
    + "".join(f"prmt.b32 t, $4, $5, 0x00{4 + k}{k}; mov.b32 {{lo, hi}}, t; "
              f"cvt.rn.f16x2.e4m3x2 ${k}, lo; " for k in range(4)) + "}")


@triton.jit
def _planes(b_w, CODEC: tl.constexpr, PTX: tl.constexpr):
    """int32 words of BASE bytes [R, C] -> four tiles [R, C]: plane k holds byte k of every
    word (element ``4j + k`` of a row whose words are ``j``), decoded.

    Planes are how a BASE tile reaches the tensor cores without moving data between threads:
    a dot operand register holds two neighbours along the reduced axis, and the two words of
    those neighbours (adjacent words of a row for K, the same word of adjacent rows for V) both
    sit in one thread, so every plane register is built from two words by one byte permute.
    ``PTX`` (compiled NVIDIA code) does exactly that in inline PTX: for hi8 with the low bytes
    zeroed (four ``prmt`` and two ``and`` a word pair); for e4m3 (sm_89+) each permute is
    followed by the GPU's float8 -> float16 conversion, so e4m3 planes are float16 (exact: every
    e4m3 value is a float16) and ``_run`` meets them with a float16 query group. Otherwise each
    byte is decoded arithmetically into the TARGET dtype. A one-tensor decode (four values a
    word, joined back into rows) makes ptxas shuffle registers and stage V through shared memory
    (948 instructions a 32-row BASE tile against 875 with planes).
    """
    if PTX and CODEC == 0:
        return tl.inline_asm_elementwise(
            _HI8_PLANES, "=r,=r,=r,=r,r,r", [b_w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    elif PTX:
        return tl.inline_asm_elementwise(
            _E4M3_PLANES, "=r,=r,=r,=r,r,r", [b_w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        return (_decode_base((b_w & 0xFF).to(tl.uint8), CODEC),
                _decode_base(((b_w >> 8) & 0xFF).to(tl.uint8), CODEC),
                _decode_base(((b_w >> 16) & 0xFF).to(tl.uint8), CODEC),
                _decode_base(((b_w >> 24) & 0xFF).to(tl.uint8), CODEC))


@triton.jit
def _float16_query(b_q):
    """The query group [BLOCK_G, BLOCK_D] as float16, each row under its own power-of-two scale,
    for dots with float16 e4m3 planes: ``(q * s[:, None], s)`` with ``s = 2^(13 - e)`` where
    ``2^e <= max |q_row| < 2^(e+1)`` (read from the float32 exponent bits; NaN elements are
    ignored by the max), so every finite row has ``max |q_row * s| < 2^14``. Scaling by a power
    of two and the narrowing are exact for every bfloat16 element of at least ``2^-27
    max |q_row|`` in magnitude (float16 keeps 11 significant bits, bfloat16 has 8); smaller ones
    keep fewer bits. Rows are independent, so an infinite or tiny head does not touch its
    neighbours. Zero rows get ``s = 2^127``. The scores are divided by ``s`` again, in the
    softmax scale."""
    b_f = b_q.to(tl.float32)
    b_max = tl.max(tl.abs(b_f), 1)
    b_e = ((b_max.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    b_s = ((127 + 13 - tl.maximum(b_e, -114)) << 23).to(tl.float32, bitcast=True)
    return (b_f * b_s[:, None]).to(tl.float16), b_s


@triton.jit
def _split4(x):
    """[R, C] -> the four planes [R, C // 4] of its columns: plane k holds columns 4j + k."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    xa0, xa1 = tl.split(tl.reshape(x, (R, C // 4, 2, 2)))   # column 4j + 2m + a: xa{a}[j, m]
    x0, x2 = tl.split(xa0)
    x1, x3 = tl.split(xa1)
    return x0, x1, x2, x3


@triton.jit
def _join4(x0, x1, x2, x3):
    """The inverse of ``_split4``: four planes [R, C] -> [R, 4 * C]."""
    R: tl.constexpr = x0.shape[0]
    C: tl.constexpr = x0.shape[1]
    return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), (R, 4 * C))


@triton.jit
def _page_rows(p_table, p_mode, start, hi, o_n, S: tl.constexpr, Hkv, i_h, D: tl.constexpr,
               MODE: tl.constexpr, BASE: tl.constexpr, ONE_PAGE: tl.constexpr):
    """Rows ``start + o_n`` of a sequence: (page id, page, row offsets inside the page or half,
    row mask, logical block). ``ONE_PAGE``: the rows lie in one page, so the id, page and block
    are scalars and the row offsets do not depend on the ids (past ``hi`` the id is not read:
    the second half of a pair tile may start past the table's end). On the general path
    (``MODE == 2``) a BASE tile's id is ``2 * page + half``: per-row ids come so from
    ``_half_pages_kernel``'s table (for TARGET rows too), a one-page id from the block table
    and the page's mode byte, which a one-page TARGET tile does not read. Rows of a ``-1`` block
    are masked: their K/V are never loaded."""
    o_t = start + o_n
    m_n = o_t < hi
    if ONE_PAGE:
        b_page = tl.load(p_table + start // S, mask=start < hi, other=0)
        b_id = b_page
        if MODE == 2 and BASE:
            b_id = 2 * b_page + (tl.load(p_mode + start // S, mask=start < hi, other=0) == 2)
        o_in = (((start % S) + o_n) * Hkv + i_h) * D
        j = start // S
    else:
        b_id = tl.load(p_table + o_t // S, mask=m_n, other=0)
        b_page = b_id >> 1 if MODE == 2 else b_id
        o_in = ((o_t % S) * Hkv + i_h) * D
        j = o_t // S
    m_n = m_n & ((b_page + 0 * o_n) >= 0)    # a -1 block (trimmed, unmapped) is never read
    return b_id, b_page.to(tl.int64), o_in, m_n, j


@triton.jit
def _target_tile(K, V, b_page, o_in, m_n, o_d, m_d, stride_kp, stride_vp,
                 ONE_PAGE: tl.constexpr):
    """K and V rows of a TARGET tile. Offsets are added to the pointer page first, then rows:
    a scalar page offset then stays a scalar (about 40 fewer instructions a tile than adding it
    to every element's offset)."""
    m_kv = m_n[:, None] & m_d[None, :]
    if ONE_PAGE:
        o_r = o_in[:, None] + o_d[None, :]
        b_k = tl.load(K + b_page * stride_kp + o_r, mask=m_kv, other=0.0)
        b_v = tl.load(V + b_page * stride_vp + o_r, mask=m_kv, other=0.0)
    else:
        b_k = tl.load(K + (b_page * stride_kp + o_in)[:, None] + o_d[None, :], mask=m_kv,
                      other=0.0)
        b_v = tl.load(V + (b_page * stride_vp + o_in)[:, None] + o_d[None, :], mask=m_kv,
                      other=0.0)
    return b_k, b_v


@triton.jit
def _base_tile(K, V, b_id, b_page, j, span_lo, o_in, m_n, o_w, stride_kp, stride_vp,
               S: tl.constexpr, Hkv, D: tl.constexpr, MODE: tl.constexpr, CODEC: tl.constexpr,
               PTX_DECODE: tl.constexpr, ONE_PAGE: tl.constexpr):
    """The K and V planes (``_planes``) of a BASE tile: its rows' half of their pair pages,
    read as 32-bit words. The half of logical block ``j`` is ``(j - span_lo) & 1`` on the
    structured path; on the general path the id is ``2 * page + half``."""
    if MODE == 1:
        o_half = ((j - span_lo) & 1) * (S * Hkv * D)
    else:
        o_half = (b_id & 1) * (S * Hkv * D)
    # word offsets: every term is a multiple of 4 bytes (D % 16 == 0, even page strides,
    # aligned pools); page first, as in _target_tile
    p_kw = K.to(tl.pointer_type(tl.int32))
    p_vw = V.to(tl.pointer_type(tl.int32))
    m_w = m_n[:, None] & (o_w < D // 4)[None, :]
    if ONE_PAGE:
        o_r = (o_in // 4)[:, None] + o_w[None, :]
        b_wk = tl.load(p_kw + (b_page * (2 * stride_kp) + o_half) // 4 + o_r, mask=m_w, other=0)
        b_wv = tl.load(p_vw + (b_page * (2 * stride_vp) + o_half) // 4 + o_r, mask=m_w, other=0)
    else:
        o_kw = (b_page * (2 * stride_kp) + (o_half + o_in)) // 4
        o_vw = (b_page * (2 * stride_vp) + (o_half + o_in)) // 4
        b_wk = tl.load(p_kw + o_kw[:, None] + o_w[None, :], mask=m_w, other=0)
        b_wv = tl.load(p_vw + o_vw[:, None] + o_w[None, :], mask=m_w, other=0)
    k0, k1, k2, k3 = _planes(b_wk, CODEC, PTX_DECODE)
    v0, v1, v2, v3 = _planes(b_wv, CODEC, PTX_DECODE)
    return k0, k1, k2, k3, v0, v1, v2, v3


@triton.jit
def _base_scores(b_q, q0, q1, q2, q3, k0, k1, k2, k3, PRECISION: tl.constexpr):
    """Raw scores [BLOCK_G, rows] of the query group against a BASE tile's K planes."""
    if q0.shape[1] >= 16:
        return (dot(q0, tl.trans(k0), PRECISION) + dot(q1, tl.trans(k1), PRECISION)
                + dot(q2, tl.trans(k2), PRECISION) + dot(q3, tl.trans(k3), PRECISION))
    else:   # BLOCK_D < 64 (D <= 32): a plane dot would reduce fewer than 16 columns, tl.dot's least
        return dot(b_q, tl.trans(_join4(k0, k1, k2, k3)), PRECISION)


@triton.jit
def _softmax_step2(b_sa, b_biasa, b_sb, b_biasb, b_m, b_l, scale_log2):
    """``softmax_step`` over a tile given as two row halves (scores, biases): the new max and
    sum, ``alpha``, and both halves' probabilities."""
    b_sa = b_sa * scale_log2 + b_biasa[None, :]
    b_sb = b_sb * scale_log2 + b_biasb[None, :]
    b_mn, b_ms, b_alpha = raise_max(b_m, tl.maximum(tl.max(b_sa, 1), tl.max(b_sb, 1)))
    b_pa = tl.exp2(b_sa - b_ms[:, None])
    b_pb = tl.exp2(b_sb - b_ms[:, None])
    b_l = b_l * b_alpha + tl.sum(b_pa, 1) + tl.sum(b_pb, 1)
    return b_mn, b_l, b_alpha, b_pa, b_pb


@triton.jit
def _run(K, V, p_table, p_mode, span_lo, lo, hi, b_q, b_m, b_l, b_acc, scale_log2, i_h,
         stride_kp, stride_vp, Hkv, o_n, o_d, m_d,
         D: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr, BASE: tl.constexpr,
         MODE: tl.constexpr, CODEC: tl.constexpr, PRECISION: tl.constexpr,
         PTX_DECODE: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr):
    """Fold rows ``[lo, hi)`` of one form into the running softmax, ``BLOCK_N`` rows a tile.

    TARGET (``BASE`` false): 16-bit rows of their pages. BASE: the row's half of its pair page,
    loaded as 32-bit words (a byte-typed tile is moved through shared memory a byte at a time)
    and decoded into four planes (``_planes``); the query group and the accumulator are split
    into the same planes for the run, so ``q k^T`` is the sum of four plane dots and ``p v``
    fills four plane accumulators. e4m3 planes decoded in PTX are float16, so for those runs
    the caller passes the float16 query group of ``_float16_query`` and a per-row
    ``scale_log2 [BLOCK_G, 1]`` that undoes its scale; ``p`` is float16 too.

    Page ids, by how a tile meets pages (``TILE``, from ``tile_pages``; a tile starts where a
    split or a run starts, a multiple of ``BLOCK_N`` or of ``S``, or ``BLOCK_N`` after the last):

    - ``S`` a multiple of ``BLOCK_N`` (``ONE_PAGE``): a tile lies in one page, so it loads one
      id and its row offsets are fixed (native 16-row tiles at S 64: 359 instructions against
      525 with an id a row);
    - ``BLOCK_N == 2 * S >= 32`` (``PAIR``, 32-row mixed tiles at S 16): the two halves of a
      tile are loaded as two one-page tiles, and the softmax still spans the 32 rows (BASE 875
      -> 814 instructions, TARGET 886 -> 707);
    - otherwise each row loads its page id, in the tile's own iteration: with 4-5 stages the
      pipeliner copies them to shared memory ahead of the tile's K/V copies, so no load waits
      on another. The general path then reads ids from ``_half_pages_kernel``'s table, because
      a mode byte a row is too narrow for those copies."""
    BLOCK_D: tl.constexpr = o_d.shape[0]
    ONE_PAGE: tl.constexpr = TILE == 1        # TILE_ONE_PAGE (tile_pages)
    PAIR: tl.constexpr = TILE == 2            # TILE_PAIR
    o_w = tl.arange(0, BLOCK_D // 4)
    o_h = tl.arange(0, BLOCK_N // 2)
    if BASE:
        q0, q1, q2, q3 = _split4(b_q)
        a0, a1, a2, a3 = _split4(b_acc)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        if PAIR:
            id_a, page_a, in_a, m_a, j_a = _page_rows(p_table, p_mode, start, hi, o_h, S, Hkv,
                                                      i_h, D, MODE, BASE, True)
            id_b, page_b, in_b, m_b, j_b = _page_rows(p_table, p_mode, start + S, hi, o_h, S,
                                                      Hkv, i_h, D, MODE, BASE, True)
            bias_a = tl.where(m_a, 0.0, float("-inf"))
            bias_b = tl.where(m_b, 0.0, float("-inf"))
            if BASE:
                ka0, ka1, ka2, ka3, va0, va1, va2, va3 = _base_tile(
                    K, V, id_a, page_a, j_a, span_lo, in_a, m_a, o_w, stride_kp, stride_vp, S,
                    Hkv, D, MODE, CODEC, PTX_DECODE, True)
                kb0, kb1, kb2, kb3, vb0, vb1, vb2, vb3 = _base_tile(
                    K, V, id_b, page_b, j_b, span_lo, in_b, m_b, o_w, stride_kp, stride_vp, S,
                    Hkv, D, MODE, CODEC, PTX_DECODE, True)
                b_m, b_l, b_alpha, b_pa, b_pb = _softmax_step2(
                    _base_scores(b_q, q0, q1, q2, q3, ka0, ka1, ka2, ka3, PRECISION), bias_a,
                    _base_scores(b_q, q0, q1, q2, q3, kb0, kb1, kb2, kb3, PRECISION), bias_b,
                    b_m, b_l, scale_log2)
                b_pa = b_pa.to(va0.dtype)
                b_pb = b_pb.to(va0.dtype)
                a0 = a0 * b_alpha[:, None] + dot(b_pa, va0, PRECISION) + dot(b_pb, vb0, PRECISION)
                a1 = a1 * b_alpha[:, None] + dot(b_pa, va1, PRECISION) + dot(b_pb, vb1, PRECISION)
                a2 = a2 * b_alpha[:, None] + dot(b_pa, va2, PRECISION) + dot(b_pb, vb2, PRECISION)
                a3 = a3 * b_alpha[:, None] + dot(b_pa, va3, PRECISION) + dot(b_pb, vb3, PRECISION)
            else:
                b_ka, b_va = _target_tile(K, V, page_a, in_a, m_a, o_d, m_d, stride_kp,
                                          stride_vp, True)
                b_kb, b_vb = _target_tile(K, V, page_b, in_b, m_b, o_d, m_d, stride_kp,
                                          stride_vp, True)
                b_m, b_l, b_alpha, b_pa, b_pb = _softmax_step2(
                    dot(b_q, tl.trans(b_ka), PRECISION), bias_a,
                    dot(b_q, tl.trans(b_kb), PRECISION), bias_b, b_m, b_l, scale_log2)
                b_acc = (b_acc * b_alpha[:, None] + dot(b_pa.to(b_va.dtype), b_va, PRECISION)
                         + dot(b_pb.to(b_vb.dtype), b_vb, PRECISION))
        else:
            b_id, b_page, o_in, m_n, j = _page_rows(p_table, p_mode, start, hi, o_n, S, Hkv, i_h,
                                                    D, MODE, BASE, ONE_PAGE)
            b_bias = tl.where(m_n, 0.0, float("-inf"))
            if BASE:
                k0, k1, k2, k3, v0, v1, v2, v3 = _base_tile(
                    K, V, b_id, b_page, j, span_lo, o_in, m_n, o_w, stride_kp, stride_vp, S,
                    Hkv, D, MODE, CODEC, PTX_DECODE, ONE_PAGE)
                b_m, b_l, b_alpha, b_p = softmax_step(
                    _base_scores(b_q, q0, q1, q2, q3, k0, k1, k2, k3, PRECISION), b_bias, b_m,
                    b_l, scale_log2)
                b_p = b_p.to(v0.dtype)
                a0 = a0 * b_alpha[:, None] + dot(b_p, v0, PRECISION)
                a1 = a1 * b_alpha[:, None] + dot(b_p, v1, PRECISION)
                a2 = a2 * b_alpha[:, None] + dot(b_p, v2, PRECISION)
                a3 = a3 * b_alpha[:, None] + dot(b_p, v3, PRECISION)
            else:
                b_k, b_v = _target_tile(K, V, b_page, o_in, m_n, o_d, m_d, stride_kp, stride_vp,
                                        ONE_PAGE)
                b_m, b_l, b_acc = online_softmax_tile(b_q, b_k, b_v, b_bias, b_m, b_l, b_acc,
                                                      scale_log2, PRECISION)
    if BASE:
        b_acc = _join4(a0, a1, a2, a3)
    return b_m, b_l, b_acc


@triton.jit
def _half_pages_kernel(Table, Mode, Out, n, L, stride_tb, stride_mb, BLOCK: tl.constexpr,
                       PDL_TRIGGER: tl.constexpr):
    """``out[b, j] = 2 * block_table[b, j] + (block_mode[b, j] == 2)``, out contiguous [B, L]:
    the general path's page ids with the BASE half in bit 0."""
    if PDL_TRIGGER:  # the attention kernel may launch now; it waits for this grid on-device
        tl.extra.cuda.gdc_launch_dependents()
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    i_b = (o // L).to(tl.int64)
    j = o % L
    b_page = tl.load(Table + i_b * stride_tb + j, mask=m, other=0)
    b_mode = tl.load(Mode + i_b * stride_mb + j, mask=m, other=0)
    tl.store(Out + o, b_page * 2 + (b_mode == 2).to(tl.int32), mask=m)


MODE_SCAN = tl.constexpr(128)    # general path: modes a load (``_general_run_end``), 128 bytes


@triton.jit
def _general_run_end(p_mode, j0, j_end, SCAN: tl.constexpr):
    """First logical block in ``(j0, j_end)`` whose form (TARGET or BASE) differs from block
    ``j0``'s, or ``j_end``; and block ``j0``'s form (1 BASE, 0 TARGET). Reads ``SCAN`` modes a
    load, block ``j0``'s form from the first, so a run of ``n`` blocks costs at most
    ``n // SCAN + 1`` dependent loads (the block that differs included). Each is a DRAM round
    trip in which the program streams nothing: with 16 modes a load (and the first mode loaded
    alone) a 4k-token half-BASE sequence at S 16 took 19 of them (4 with 128), and the general
    path ran 1.07-1.10x the structured one at B 64 x 4k, where only 4 programs share an SM to
    hide them."""
    o_s = tl.arange(0, SCAN)
    m_j = j0 + o_s < j_end
    b_form = (tl.load(p_mode + j0 + o_s, mask=m_j, other=0) != 0).to(tl.int32)
    form = tl.max(tl.where(o_s == 0, b_form, 0), 0)
    end = tl.min(tl.where(m_j & (b_form != form), j0 + o_s, j_end), 0)
    jb = j0 + SCAN
    while jb < end:
        o_j = jb + o_s
        m_j = o_j < end
        b_form = (tl.load(p_mode + o_j, mask=m_j, other=0) != 0).to(tl.int32)
        end = tl.minimum(end, tl.min(tl.where(m_j & (b_form != form), o_j, end), 0))
        jb += SCAN
    return end, form


MODE_CHUNK = tl.constexpr(1024)  # general path: modes a load when cutting weighted split edges
SPLIT_WT = tl.constexpr(5)       # weighted split edges: a TARGET row costs 5, a BASE row 4
SPLIT_WB = tl.constexpr(4)
WEIGHTED_MAX_ROWS = tl.constexpr(2 ** 22)   # int32 edge arithmetic: 64 * 5 * 2**22 < 2**31
WEIGHTED_MAX_SPLITS = 64        # ... for at most this many splits (the launcher's own cap)


@triton.jit
def _weighted_edge(t, bs, be, n, NUM_SPLITS, WT: tl.constexpr, WB: tl.constexpr,
                   UNIT: tl.constexpr):
    """Structured path: the last multiple of ``UNIT`` at most ``n`` below which the rows cost at
    most ``t / NUM_SPLITS``, a TARGET row costing ``WT`` and a row of the BASE rows ``[bs, be)``
    ``WB``. The cost of the first ``x`` rows is ``WT x`` up to ``bs``, ``WT bs + WB (x - bs)`` up
    to ``be``, and ``WT x - (WT - WB)(be - bs)`` past it; each piece is inverted exactly in
    integers (int32: ``t`` is at most ``NUM_SPLITS * WT * n``, see ``WEIGHTED_MAX_ROWS``)."""
    x1 = t // (WT * NUM_SPLITS)
    x2 = bs + (t - WT * bs * NUM_SPLITS) // (WB * NUM_SPLITS)
    x3 = be + (t - (WT * bs + WB * (be - bs)) * NUM_SPLITS) // (WT * NUM_SPLITS)
    x = tl.where(x1 < bs, x1, tl.where(x2 < be, x2, x3))
    return tl.minimum(x, n) // UNIT * UNIT


@triton.jit
def _weighted_split(p_mode, span_lo, span_hi, n, i_s, NUM_SPLITS, MODE: tl.constexpr,
                    S: tl.constexpr, WT: tl.constexpr, WB: tl.constexpr, UNIT: tl.constexpr,
                    CHUNK: tl.constexpr):
    """Rows ``[lo, hi)`` of split ``i_s`` when the ``n`` rows are cut into ``NUM_SPLITS`` shares
    of equal cost (TARGET row ``WT``, BASE row ``WB``) at multiples of ``UNIT``, the last split
    ending at ``n``. Structured path: closed form (``_weighted_edge``). General path: from the
    mode table, to the same edges: one scan for the total cost (a partial last block counts its
    rows), one that counts the ``UNIT`` ends whose prefix cost is within ``i_s`` and ``i_s + 1``
    shares. A unit ``u`` ends after block ``u * UNIT / S - 1`` and its prefix cost is
    ``WT u UNIT - (WT - WB) S (BASE blocks before it)``, rising with ``u``, so the units within a
    share are the first ones and their count times ``UNIT`` is the structured path's edge.
    ``CHUNK`` modes a load (one load each up to 16k tokens at S 16)."""
    if MODE == 1:
        bs = tl.minimum(span_lo * S, n)
        be = tl.minimum(span_hi * S, n)
        cost = WT * n - (WT - WB) * (be - bs)
        lo = _weighted_edge(i_s * cost, bs, be, n, NUM_SPLITS, WT, WB, UNIT)
        hi = _weighted_edge((i_s + 1) * cost, bs, be, n, NUM_SPLITS, WT, WB, UNIT)
    else:
        o_c = tl.arange(0, CHUNK)
        n_blocks = tl.cdiv(n, S)
        base_rows = n * 0
        for j0 in range(0, n_blocks, CHUNK):
            o_j = j0 + o_c
            b_base = tl.load(p_mode + o_j, mask=o_j < n_blocks, other=0) != 0
            base_rows += tl.sum(tl.where(b_base, tl.minimum(n - o_j * S, S), 0), 0)
        cost = WT * n - (WT - WB) * base_rows
        t_lo = i_s * cost
        t_hi = (i_s + 1) * cost
        n_lo = n * 0
        n_hi = n * 0
        before = n * 0                               # BASE blocks before the chunk
        full = n // S
        for j0 in range(0, full, CHUNK):
            o_j = j0 + o_c
            m_j = o_j < full
            b_base = (tl.load(p_mode + o_j, mask=m_j, other=0) != 0).to(tl.int32)
            b_cost = (WT * (o_j + 1) * S - (WT - WB) * S * (before + tl.cumsum(b_base, 0))) \
                * NUM_SPLITS
            b_end = m_j & ((o_j + 1) % (UNIT // S) == 0)
            n_lo += tl.sum((b_end & (b_cost <= t_lo)).to(tl.int32), 0)
            n_hi += tl.sum((b_end & (b_cost <= t_hi)).to(tl.int32), 0)
            before += tl.sum(b_base, 0)
        lo = n_lo * UNIT
        hi = n_hi * UNIT
    return lo, tl.where(i_s == NUM_SPLITS - 1, n, hi)


@triton.jit
def _elastic_decode_kernel(
    Q, K, V, BlockTable, SeqLens, BlockMode, BaseSpan, O, L, Out, Lse, Count,
    scale_log2,
    stride_qb, stride_qh,
    stride_kp, stride_vp,
    stride_tb, stride_mb, stride_sb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    NB, Hkv, NUM_SPLITS, WEIGHTED_FROM,
    G: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UNIT: tl.constexpr,
    WEIGHTED: tl.constexpr, MODE: tl.constexpr, CODEC: tl.constexpr, PRECISION: tl.constexpr,
    SAME_STRIDE: tl.constexpr, PTX_DECODE: tl.constexpr, TILE: tl.constexpr,
    PDL_TRIGGER: tl.constexpr, PDL_WAIT: tl.constexpr,
    STAGES_T: tl.constexpr, STAGES_B: tl.constexpr,
    FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
):
    if PDL_TRIGGER:  # let the split merge launch now; it waits for this grid on-device
        tl.extra.cuda.gdc_launch_dependents()
    i_bh = tl.program_id(0)
    i_s = tl.program_id(1)
    i_b = (i_bh // Hkv).to(tl.int64)
    i_h = i_bh % Hkv
    o_d = tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    m_d = o_d < D
    b_q = load_query_group(Q, i_b, i_h, stride_qb, stride_qh, G, D, BLOCK_G, BLOCK_D)
    if PDL_WAIT:   # launched early behind _half_pages_kernel: wait for its table
        tl.extra.cuda.gdc_wait()

    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n_tok = tl.minimum(tl.maximum(tl.load(SeqLens + i_b), 0), NB * S)
    lo, hi = split_range(n_tok, i_s, NUM_SPLITS, BLOCK_N)
    p_table = BlockTable + i_b * stride_tb
    if SAME_STRIDE:       # one row offset serves K and V: 15 % fewer loop instructions
        stride_vp = stride_kp
    p_mode = BlockMode + i_b * stride_mb
    if MODE == 0:
        b_m, b_l, b_acc = _run(K, V, p_table, p_mode, 0, lo, hi, b_q, b_m, b_l, b_acc,
                               scale_log2, i_h, stride_kp, stride_vp, Hkv, o_n, o_d, m_d,
                               D, S, BLOCK_N, False, MODE, CODEC, PRECISION, PTX_DECODE, TILE,
                               STAGES_T)
    else:
        # Walk the split as runs of one form; each run is a pipelined loop of single-form tiles
        # starting at the run's first row. Both mixed paths cut the same runs from the same
        # layout, so they fold the same tiles in the same order: bit-identical results.
        span_lo = 0
        span_hi = 0
        if MODE == 1:
            span_lo = tl.minimum(tl.maximum(tl.load(BaseSpan + i_b * stride_sb), 0), NB)
            span_hi = tl.minimum(tl.maximum(tl.load(BaseSpan + i_b * stride_sb + 1), span_lo), NB)
            span_lo = tl.where(span_lo == span_hi, NB, span_lo)   # no BASE: one TARGET run
            span_hi = tl.where(span_lo == NB, NB, span_hi)
        # Long splits are bound by their bytes: cut them where they cost alike, a BASE row 0.8
        # of a TARGET row (``weighted_from``), so the splits over TARGET rows do not outlast
        # the ones over BASE rows. Short splits keep equal rows: their time follows tiles.
        # ``WEIGHTED`` (the table can hold a sequence that long) compiles the rule in at all.
        if WEIGHTED and (n_tok >= WEIGHTED_FROM) & (n_tok <= WEIGHTED_MAX_ROWS):
            lo, hi = _weighted_split(p_mode, span_lo, span_hi, n_tok, i_s, NUM_SPLITS, MODE, S,
                                     SPLIT_WT, SPLIT_WB, UNIT, MODE_CHUNK)
        b_qb = b_q                      # the query group and scale of BASE runs
        scale_base = scale_log2
        if CODEC == 2 and PTX_DECODE:   # float16 e4m3 planes (``_planes``): a float16 query
            b_qb, b_s = _float16_query(b_q)
            scale_base = scale_log2 / b_s[:, None]
        pos = lo
        while pos < hi:
            if MODE == 1:
                is_base = ((pos >= span_lo * S) & (pos < span_hi * S)).to(tl.int32)
                end = tl.where(pos < span_lo * S, span_lo * S,
                               tl.where(pos < span_hi * S, span_hi * S, hi))
            else:
                end_j, is_base = _general_run_end(p_mode, pos // S, tl.cdiv(hi, S), MODE_SCAN)
                end = end_j * S
            end = tl.minimum(end, hi)
            if is_base != 0:
                b_m, b_l, b_acc = _run(K, V, p_table, p_mode, span_lo, pos, end, b_qb, b_m, b_l,
                                       b_acc, scale_base, i_h, stride_kp, stride_vp, Hkv, o_n,
                                       o_d, m_d, D, S, BLOCK_N, True, MODE, CODEC, PRECISION,
                                       PTX_DECODE, TILE, STAGES_B)
            else:
                b_m, b_l, b_acc = _run(K, V, p_table, p_mode, span_lo, pos, end, b_q, b_m, b_l,
                                       b_acc, scale_log2, i_h, stride_kp, stride_vp, Hkv, o_n,
                                       o_d, m_d, D, S, BLOCK_N, False, MODE, CODEC, PRECISION,
                                       PTX_DECODE, TILE, STAGES_T)
            pos = end

    finish_rows(b_m, b_l, b_acc, O, L, i_b, i_h, i_s, stride_ob, stride_oh, stride_os,
                stride_lb, stride_lh, G, D, BLOCK_G, BLOCK_D)
    if FUSED_MERGE:
        merge_if_last(O, L, Out, Lse, Count + i_bh, i_b, i_h, Hkv, stride_ob, stride_oh,
                      stride_os, stride_lb, stride_lh, NUM_SPLITS, G, D, BLOCK_G, BLOCK_D,
                      BLOCK_S)


TILE_ROWS, TILE_ONE_PAGE, TILE_PAIR = 0, 1, 2     # how a tile meets pages (see ``_run``)


def tile_pages(S: int, block_n: int) -> int:
    """``TILE_ONE_PAGE`` when every tile lies in one page, ``TILE_PAIR`` when it is two whole
    pages of at least 16 rows (a dot operand each), else ``TILE_ROWS`` (a page id a row)."""
    if S % block_n == 0:
        return TILE_ONE_PAGE
    return TILE_PAIR if block_n == 2 * S and S >= 16 else TILE_ROWS


BLOCK_N = 16            # native path: rows a tile, one warp a program (docs/tuning.md)
BLOCK_N_MIXED = 32      # structured and general paths (docs/tuning.md)
SMEM_BUDGET = 160 * 1024    # bytes of K/V stages a program may hold (the H200 allows 227 KiB)
WAVE_FILL = 0.8         # least busy share of the SMs for the native dense shape
DENSE_STAGES = 5        # native dense shape: two buffered 64 KiB tiles
DENSE_SMEM = 192 * 1024     # least shared memory a program may use for it (it takes 134-146 KiB)
DENSE_SPLITS = 2        # splits a pair of the dense shape where one a pair fills under half a wave


def native_dense_tile(pairs: int, G: int, D: int, itemsize: int, props: DeviceProps,
                      rows: int | None = None) -> tuple[int, int] | None:
    """``(rows a tile, splits)`` of the native path's dense launch shape (128-row tiles, 4
    warps, ``DENSE_STAGES``: the static kernel's shape with two 64 KiB tiles in flight), or None
    to keep 16-row one-warp split programs. Taken where it was measured to win (docs/tuning.md):
    16-bit K/V of D 65-128, query groups of at most 16 heads, a GPU that lets a program use
    ``DENSE_SMEM``, and programs filling one wave of the SMs to at least ``WAVE_FILL``: one a
    (sequence, KV head) with 128-row tiles, or with 64-row tiles where they fill two waves (two
    programs an SM, so again one wave), or, where one a pair fills under half a wave and the
    block table's span of ``rows`` (None: unknown; the lengths are on the device) gives each
    of two splits at least two tiles, two a pair with 128-row tiles (``DENSE_SPLITS``).
    Splitting further is left to the one-warp programs (B 1 x 16k in 16 dense splits: 24.0 us
    against 22.7)."""
    if itemsize != 2 or next_pow2(D) != 128 or next_pow2(G) > 16:
        return None
    if props.smem < DENSE_SMEM:
        return None
    block_n = kv_block_n(D, itemsize)
    waves, fill = grid_waves(pairs, props.sms)
    if fill >= WAVE_FILL and waves <= 2:
        # two waves' worth of programs: half tiles, two programs an SM in one wave
        return (block_n, 1) if waves == 1 else (block_n // 2, 1)
    waves, fill = grid_waves(DENSE_SPLITS * pairs, props.sms)
    if (waves == 1 and fill >= WAVE_FILL and rows is not None
            and rows >= 2 * DENSE_SPLITS * block_n):
        return block_n, DENSE_SPLITS
    return None


def default_num_stages(mode: int, programs_per_sm: float, tile_bytes: int) -> int:
    """Pipeline depth: 5 (per-row page ids one tile ahead of their K/V copies, those two tiles
    ahead of the math); the mixed paths take 4 from 6 programs an SM. ``tile_bytes`` (K and V of
    one tile) caps it so that ``stages - 1`` buffered tiles would fit ``SMEM_BUDGET``. The dense
    native shape sets its own depth (``DENSE_STAGES``). docs/tuning.md."""
    stages = 4 if mode != 0 and programs_per_sm >= 6 else 5
    return max(2, min(stages, 1 + SMEM_BUDGET // tile_bytes))


def default_base_stages(stages: int, block_n: int, D: int) -> int:
    """Pipeline depth of BASE runs, given ``stages`` for TARGET runs: one buffered K/V tile
    more. A loop that loads its page ids in the tile's own iteration gets ``(stages - 1) // 2``
    buffered tiles (triton 3.6), and a BASE tile holds half the bytes of a TARGET tile of as
    many rows. The extra buffer is dropped where it would not fit ``SMEM_BUDGET``; BASE runs are
    never shallower than TARGET runs, and unpipelined TARGET runs (``stages <= 1``) leave BASE
    runs unpipelined too. docs/tuning.md."""
    if stages <= 1:
        return stages
    buffers = min((stages - 1) // 2 + 1, SMEM_BUDGET // (2 * block_n * next_pow2(D)))
    return max(stages, 2 * buffers + 1)


LONG_SPLIT = 2048      # rows a split from which the mixed paths weight their split edges
NO_WEIGHTS = 2 ** 31 - 1


def weighted_from(mode: int, num_splits: int) -> int:
    """Sequence length from which a mixed-path launch cuts its splits at equal cost (a BASE row
    0.8 of a TARGET row, ``SPLIT_WB / SPLIT_WT``) rather than equal rows: splits of at least
    ``LONG_SPLIT`` rows, which are bound by their bytes (equal rows give a split over TARGET
    rows up to twice the bytes of one over BASE rows); shorter splits are bound by their tiles
    and keep equal rows. ``NO_WEIGHTS`` (never) for the native path, unsplit launches and split
    counts above ``WEIGHTED_MAX_SPLITS`` (the int32 edge arithmetic). A launch whose block table
    cannot hold that many rows compiles without the rule (``WEIGHTED``). docs/tuning.md."""
    if mode == 0 or not 1 < num_splits <= WEIGHTED_MAX_SPLITS:
        return NO_WEIGHTS
    return num_splits * LONG_SPLIT


def in_flight_tiles(mode: int, stages: int | None) -> int:
    """K/V tiles a program keeps in flight, for the split count's bytes an SM
    (``default_num_splits``): on the native path its buffered tiles, ``(stages - 1) // 2``
    (page ids load in the tile's own iteration, so the pipeliner buffers every other stage:
    two tiles at 5 stages); the mixed paths count one tile (their TARGET and BASE runs buffer
    to different depths, and no other count was measured there). One tile counted on the
    native path would split one-warp programs twice as finely as the 64 KiB an SM asks, and
    that is slower: on an H100, Phi-3's 32/32 heads at B 16 x 4k 0.933x cuDNN in 2 splits, 0.959x
    in 1 (the count with two tiles); MHA B 1 x 8k 0.989x in 33, 1.039x in 16; Qwen2.5-7B B 4 x 32k
    0.986x in 64, 0.998x in 33; D 256 at B 4 x 8k 1.074x in 33, 1.118x in 16
    (bench/results/2026-12-07-1645-elastic-native-splits-h100.md)."""
    if mode != 0 or stages is None:
        return 1
    return max(1, (stages - 1) // 2)


def default_num_warps(D: int, itemsize: int) -> int:
    """One warp a program while a row is at most 256 bytes (D <= 128 at 16 bits); wider rows
    take 4 warps, so a 16-row tile's operands stay in registers."""
    return 1 if D * itemsize <= 256 else 4


class ElasticLaunch(NamedTuple):
    block_n: int
    splits: int
    warps: int
    stages: int
    base_stages: int
    weighted_from: int
    tile: int


@functools.lru_cache(maxsize=4096)
def elastic_launch(mode: int, B: int, Hkv: int, G: int, NB: int, S: int, D: int, itemsize: int,
                   props: DeviceProps, block_n: int | None = None, splits: int | None = None,
                   warps: int | None = None, stages: int | None = None,
                   base_stages: int | None = None) -> ElasticLaunch:
    """The launch of ``B * Hkv`` (sequence, KV head) programs over block tables of ``NB`` pages
    of ``S`` rows on path ``mode`` (0 native, 1 structured, 2 general); given knobs are kept:
    the native dense shape where ``native_dense_tile`` takes it, else ``BLOCK_N`` (native) or
    ``BLOCK_N_MIXED`` rows, ``default_num_splits`` of ``in_flight_tiles``, ``default_num_stages``,
    ``default_base_stages``, ``default_num_warps``, ``weighted_from`` (docs/tuning.md)."""
    pairs = max(B, 1) * Hkv
    if mode == 0 and all(k is None for k in (block_n, splits, warps, stages)):
        dense = native_dense_tile(pairs, G, D, itemsize, props, NB * S)
        if dense is not None:
            (block_n, splits), warps, stages = dense, 4, DENSE_STAGES
    block_n = block_n or (BLOCK_N if mode == 0 else BLOCK_N_MIXED)
    tile_bytes = kv_tile_bytes(block_n, D, itemsize)
    if mode == 0:                   # one depth, whatever the programs an SM
        stages = stages or default_num_stages(0, 0, tile_bytes)
    if splits is None:
        splits = default_num_splits(pairs, NB * S, block_n,
                                    tile_bytes * in_flight_tiles(mode, stages), props.sms)
    stages = stages or default_num_stages(mode, B * Hkv * splits / props.sms, tile_bytes)
    if mode == 0:                   # no BASE runs: one depth, and no recompile per base_stages
        base_stages = stages
    else:
        base_stages = base_stages or default_base_stages(stages, block_n, D)
    return ElasticLaunch(block_n, splits, warps or default_num_warps(D, itemsize), stages,
                         base_stages, weighted_from(mode, splits), tile_pages(S, block_n))


def ptx_decode_ok(codec: int, props: DeviceProps) -> bool:
    """Whether the inline-PTX BASE decode may run: compiled NVIDIA code, and for e4m3 the
    GPU's float8 conversion (sm_89 and newer)."""
    if codec == CODEC_IDS["e4m3"]:
        return props.ptx and props.capability >= (8, 9)
    return props.ptx


_PLANS: dict = {}
_NO_KNOBS = (None,) * 7


def _plan(q, k_cache, v_cache, block_table, seq_lens, block_mode, base_span, scale, knobs):
    B, Hq, D = q.shape
    _, S, Hkv, _ = k_cache.shape
    NB = block_table.shape[1]
    G = Hq // Hkv
    block_n, num_splits, num_warps, num_stages, base_stages, ptx_decode, pdl = knobs
    props = device_props(q.device)
    mode = 2 if block_mode is not None else (1 if base_span is not None else 0)
    lp = elastic_launch(mode, B, Hkv, G, NB, S, D, k_cache.element_size(), props, block_n,
                        num_splits, num_warps, num_stages, base_stages)
    # programmatic dependent launch hides the launch gap before each kernel that follows
    # another of this op (the table kernel -> this kernel -> the merge)
    pdl = use_pdl(props) if pdl is None else pdl
    codec = CODEC_IDS["e4m3"] if k_cache.dtype == torch.bfloat16 else CODEC_IDS["hi8"]
    ptx_ok = ptx_decode_ok(codec, props)
    if ptx_decode and not ptx_ok:
        raise ValueError("ptx_decode: the inline-PTX BASE decode needs compiled NVIDIA code "
                         "(sm_89 or newer for bfloat16's e4m3), got ptx_decode=True on "
                         f"{q.device} ({'interpreter' if q.device.type == 'cpu' else 'GPU'})")
    ptx_decode = ptx_ok if ptx_decode is None else ptx_decode
    halves_table = mode == 2 and lp.tile == TILE_ROWS        # per-row ids: 2 * page + half
    pdl_wait = pdl and halves_table and block_table.numel() > 0
    scale = D ** -0.5 if scale is None else scale
    nsp = lp.splits
    o_strides = (Hq * D, D, 0, Hq, 1) if nsp == 1 else (Hq * nsp * D, nsp * D, D, Hq * nsp, nsp)
    table_stride = NB if halves_table else block_table.stride(0)
    mode_stride = block_table.stride(0) if block_mode is None else block_mode.stride(0)
    span_stride = block_table.stride(0) if base_span is None else base_span.stride(0)
    ints = (q.stride(0), q.stride(1), k_cache.stride(0), v_cache.stride(0),
            table_stride, mode_stride, span_stride, *o_strides, NB, Hkv, nsp, lp.weighted_from)
    meta = dict(
        G=G, D=D, S=S, BLOCK_G=max(16, next_pow2(G)), BLOCK_D=next_pow2(D), BLOCK_N=lp.block_n,
        UNIT=math.lcm(lp.block_n, S), WEIGHTED=lp.weighted_from <= NB * S, MODE=mode,
        CODEC=codec, PRECISION=dot_precision(q.dtype),
        SAME_STRIDE=k_cache.stride(0) == v_cache.stride(0), TILE=lp.tile, PTX_DECODE=ptx_decode,
        PDL_TRIGGER=pdl and nsp > 1, PDL_WAIT=pdl_wait, STAGES_T=lp.stages,
        STAGES_B=lp.base_stages, FUSED_MERGE=False, BLOCK_S=1, num_warps=lp.warps,
        num_stages=lp.stages, **({"launch_pdl": True} if pdl_wait else {}))
    halves = None
    if halves_table and block_table.numel():
        halves = ((triton.cdiv(block_table.numel(), 1024),),
                  (block_table.numel(), NB, block_table.stride(0), block_mode.stride(0)),
                  dict(BLOCK=1024, PDL_TRIGGER=pdl_wait, num_warps=4))
    merge = fused = None
    # the plan's own tokens key its compiled kernels (see static_sliding_attention._plan)
    first = Launch(_elastic_decode_kernel, (B * Hkv, nsp), object(), (scale * LOG2E, *ints),
                   meta)
    if nsp > 1:
        merge = merge_plan(B, Hq, nsp, D, q.dtype, pdl, q.device)
        fused = Launch(_elastic_decode_kernel, (B * Hkv, nsp), object(), (scale * LOG2E, *ints),
                       dict(meta, PDL_TRIGGER=False, FUSED_MERGE=True, BLOCK_S=next_pow2(nsp)))
    return DecodePlan(B, Hq, D, nsp, merge, fused, first, [], standard_strides(q), halves_table,
                      halves)


def elastic_attention_fwd(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor,
    block_mode: torch.Tensor | None = None, base_span: torch.Tensor | None = None,
    scale: float | None = None,
    *, num_splits: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
    base_stages: int | None = None, ptx_decode: bool | None = None, pdl: bool | None = None,
    signature=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the elastic paged decode kernel. Inputs are already checked by the op (BASE
    paths: 4-byte aligned pools with even page strides; general path: fewer than 2**30 pages).

    q [B, Hq, D]; k_cache, v_cache [P, S, Hkv, D] (pages contiguous); block_table int32 [B, L];
    seq_lens int32 [B]; block_mode int8 [B, L] or base_span int32 [B, 2] or neither (native).
    Returns out [B, Hq, D] (q.dtype) and lse float32 [B, Hq]. The keyword-only knobs override
    the launch rule (``elastic_launch``; benchmarks and tests use them; ``num_stages`` is TARGET
    runs' depth, ``base_stages`` BASE runs'); ``ptx_decode`` picks the inline-PTX BASE decode
    (``_planes``; default, and allowed, on compiled NVIDIA code, for e4m3 on sm_89 and newer;
    ``ValueError`` if forced elsewhere), ``pdl`` programmatic dependent launch (default on
    Hopper and newer, see ``_splitk.use_pdl``). A launch's plan is kept per argument signature
    (``signature``: the op's, else one is computed here).
    """
    knobs = (block_n, num_splits, num_warps, num_stages, base_stages, ptx_decode, pdl)
    if signature is not None and knobs == _NO_KNOBS:
        key = signature
    else:
        key = (knobs, sig(q), sig(k_cache), sig(v_cache), sig(block_table), sig(seq_lens),
               sig(block_mode), sig(base_span), scale)
    plan = _PLANS.get(key) or keep_plan(_PLANS, key, _plan(
        q, k_cache, v_cache, block_table, seq_lens, block_mode, base_span, scale, knobs))
    out, lse, part_o, part_l, count = split_outputs(
        plan.B, plan.Hq, plan.D, plan.splits, q.dtype, q.device, plan.launch.grid[0],
        q if plan.like_q else None)
    if plan.B == 0:
        return out, lse
    table = block_table
    if plan.halves_table:
        table = torch.empty(block_table.shape, dtype=torch.int32, device=block_table.device)
        if plan.halves is not None:
            h_grid, h_ints, h_meta = plan.halves
            launch(_half_pages_kernel, h_grid, plan.launch.key,
                   (block_table, block_mode, table, *h_ints), h_meta)
    # the kernel never reads the metadata of the other paths; pass valid pointers
    block_mode = block_table if block_mode is None else block_mode
    base_span = block_table if base_span is None else base_span
    launch_split((q, k_cache, v_cache, table, seq_lens, block_mode, base_span, part_o, part_l,
                  out, lse), count, seq_lens, (), plan)
    return out, lse
