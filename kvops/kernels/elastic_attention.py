"""Triton kernel for ``kvops.elastic_attention``: paged decode over TARGET and BASE blocks.

One kernel family, three paths chosen by the constexpr ``MODE`` (ElasticKV section 3.2):

- ``MODE == 0`` native: every block TARGET. A plain GQA paged decode kernel; no BASE code is
  compiled in, so it pays nothing for the elastic machinery.
- ``MODE == 1`` structured: ``base_span [B, 2]`` gives the BASE blocks ``[first, end)``; a block's
  mode and half follow from its index, so no per-block metadata is loaded.
- ``MODE == 2`` general: a per-block mode (0 TARGET, 1 half 0, 2 half 1) read from
  ``block_mode [B, L]`` beside the block table.

One program handles one (sequence, KV head, split): it loads the ``G`` query heads of the group
once and streams its share of the sequence's tokens in tiles of ``BLOCK_N`` rows, so each KV row
is read once for the whole group. A row's page comes from the block table; a TARGET row is read
as 16-bit values, a BASE row as bytes from its half of the page and decoded in registers (the
two loads are predicated per row, so a row costs the bytes of its form only). Splits are merged
by ``_splitk.merge_splits``.

``CODEC``: 0 float16 BASE (hi8/hi8r: the byte is the high byte, low byte zero), 2 bfloat16
BASE (float8 e4m3fn), as in ``kvops.layouts.codecs``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops.kernels._attention import (
    finish_rows,
    load_query_group,
    online_softmax_tile,
    split_range,
)
from kvops.kernels._common import dot_precision, kv_block_n, kv_tile_bytes, next_pow2
from kvops.kernels._splitk import default_num_splits, merge_splits, split_outputs


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


@triton.jit
def _load_rows(P, o_t, o_b, b_isb, m_n, o_d, m_d, CODEC: tl.constexpr):
    """Rows of a mixed tile: TARGET rows at element offsets ``o_t`` of ``P``, BASE rows at byte
    offsets ``o_b``; ``b_isb`` [BLOCK_N] says which. Masked rows read nothing and give 0."""
    m_t = (m_n & (b_isb == 0))[:, None] & m_d[None, :]
    m_b = (m_n & (b_isb != 0))[:, None] & m_d[None, :]
    b_t = tl.load(P + o_t[:, None] + o_d[None, :], mask=m_t, other=0.0)
    b_x = tl.load(P.to(tl.pointer_type(tl.uint8)) + o_b[:, None] + o_d[None, :], mask=m_b,
                  other=0)
    return tl.where(m_b, _decode_base(b_x, CODEC), b_t)


@triton.jit
def _elastic_decode_kernel(
    Q, K, V, BlockTable, SeqLens, BlockMode, BaseSpan, O, L,
    scale_log2,
    stride_qb, stride_qh,
    stride_kp, stride_vp,
    stride_tb, stride_mb, stride_sb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    NB, Hkv, NUM_SPLITS,
    G: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, CODEC: tl.constexpr, PRECISION: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_s = tl.program_id(1)
    i_b = (i_bh // Hkv).to(tl.int64)
    i_h = i_bh % Hkv
    o_d = tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    m_d = o_d < D
    b_q = load_query_group(Q, i_b, i_h, stride_qb, stride_qh, G, D, BLOCK_G, BLOCK_D)

    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n_tok = tl.minimum(tl.maximum(tl.load(SeqLens + i_b), 0), NB * S)
    lo, hi = split_range(n_tok, i_s, NUM_SPLITS, BLOCK_N)
    E = S * Hkv * D                                   # elements of one page (bytes of one half)
    if MODE == 1:
        span_lo = tl.load(BaseSpan + i_b * stride_sb)
        span_hi = tl.load(BaseSpan + i_b * stride_sb + 1)
    # Page ids of a tile are loaded one iteration ahead (loop-carried), so the K/V loads of a
    # tile do not wait on a load of the same iteration: the software pipeliner then keeps two
    # K/V tiles in flight as in the dense kernel (with the page-id load in the same iteration
    # it kept one, and the native path read at half the dense kernel's bandwidth on an H200).
    p_table = BlockTable + i_b * stride_tb
    b_page = tl.load(p_table + (lo + o_n) // S, mask=lo + o_n < hi, other=0).to(tl.int64)
    for start in range(lo, hi, BLOCK_N):
        o_t = start + o_n
        m_n = o_t < hi
        o_j = o_t // S
        o_in = ((o_t % S) * Hkv + i_h) * D            # the row inside its page (and half)
        o_k = b_page * stride_kp + o_in
        o_v = b_page * stride_vp + o_in
        if MODE == 0:
            m_kv = m_n[:, None] & m_d[None, :]
            b_k = tl.load(K + o_k[:, None] + o_d[None, :], mask=m_kv, other=0.0)
            b_v = tl.load(V + o_v[:, None] + o_d[None, :], mask=m_kv, other=0.0)
        else:
            if MODE == 1:
                b_isb = ((o_j >= span_lo) & (o_j < span_hi)).to(tl.int32)
                o_half = ((o_j - span_lo) & 1) * E
            else:
                b_mode = tl.load(BlockMode + i_b * stride_mb + o_j, mask=m_n, other=0)
                b_isb = (b_mode != 0).to(tl.int32)
                o_half = (b_mode == 2).to(tl.int32) * E
            b_k = _load_rows(K, o_k, b_page * (2 * stride_kp) + o_half + o_in, b_isb, m_n,
                             o_d, m_d, CODEC)
            b_v = _load_rows(V, o_v, b_page * (2 * stride_vp) + o_half + o_in, b_isb, m_n,
                             o_d, m_d, CODEC)
        b_page = tl.load(p_table + (o_t + BLOCK_N) // S, mask=o_t + BLOCK_N < hi,
                         other=0).to(tl.int64)
        b_bias = tl.where(m_n, 0.0, float("-inf"))
        b_m, b_l, b_acc = online_softmax_tile(b_q, b_k, b_v, b_bias, b_m, b_l, b_acc,
                                              scale_log2, PRECISION)

    finish_rows(b_m, b_l, b_acc, O, L, i_b, i_h, i_s, stride_ob, stride_oh, stride_os,
                stride_lb, stride_lh, G, D, BLOCK_G, BLOCK_D)


def elastic_attention_fwd(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor,
    block_mode: torch.Tensor | None = None, base_span: torch.Tensor | None = None,
    scale: float | None = None,
    *, num_splits: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the elastic paged decode kernel. Inputs are already checked by the op.

    q [B, Hq, D]; k_cache, v_cache [P, S, Hkv, D] (pages contiguous); block_table int32 [B, L];
    seq_lens int32 [B]; block_mode int8 [B, L] or base_span int32 [B, 2] or neither (native).
    Returns out [B, Hq, D] (q.dtype) and lse float32 [B, Hq]. The keyword-only knobs override
    the defaults (benchmarks and tests use them).
    """
    B, Hq, D = q.shape
    _, S, Hkv, _ = k_cache.shape
    NB = block_table.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    mode = 2 if block_mode is not None else (1 if base_span is not None else 0)
    # the mixed paths stage a TARGET and a BASE tile each: half the rows to fit shared memory
    block_n = block_n or kv_block_n(D, k_cache.dtype, tiles_per_row=1 if mode == 0 else 2)
    if num_splits is None:
        tile = kv_tile_bytes(block_n, D, k_cache.dtype) * (1 if mode == 0 else 2)
        num_splits = default_num_splits(max(B, 1) * Hkv, NB * S, block_n, tile, q.device)
    out, lse, part_o, part_l, s_os = split_outputs(B, Hq, D, num_splits, q.dtype, q.device)
    if B == 0:
        return out, lse
    # the kernel never reads the metadata of the other paths; pass valid pointers
    block_mode = block_table if block_mode is None else block_mode
    base_span = block_table if base_span is None else base_span
    _elastic_decode_kernel[(B * Hkv, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, block_mode, base_span, part_o, part_l,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1),
        k_cache.stride(0), v_cache.stride(0),
        block_table.stride(0), block_mode.stride(0), base_span.stride(0),
        part_o.stride(0), part_o.stride(1), s_os,
        part_l.stride(0), part_l.stride(1),
        NB, Hkv, num_splits,
        G=G, D=D, S=S, BLOCK_G=max(16, next_pow2(G)), BLOCK_D=next_pow2(D), BLOCK_N=block_n,
        MODE=mode, CODEC=2 if k_cache.dtype == torch.bfloat16 else 0,
        PRECISION=dot_precision(q.dtype),
        num_warps=num_warps or 4, num_stages=num_stages or 3,
    )
    if num_splits > 1:
        merge_splits(part_o.view(B * Hq, num_splits, D), part_l.view(B * Hq, num_splits),
                     out.view(B * Hq, D), lse.view(B * Hq))
    return out, lse
