"""Tile-level pieces shared by the decode attention kernels (sliding window and paged)."""

import triton
import triton.language as tl

from kvops.kernels import _common

LOG2E = tl.constexpr(_common.LOG2E)
LN2 = tl.constexpr(_common.LN2)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """``tl.dot`` under a launcher-chosen precision (see ``_common.dot_precision``)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def online_softmax_tile(b_q, b_k, b_v, b_bias, b_m, b_l, b_acc, scale_log2,
                        PRECISION: tl.constexpr):
    """Fold one KV tile into a running base-2 softmax for a block of query heads.

    b_q [BLOCK_G, BLOCK_D], b_k/b_v [BLOCK_N, BLOCK_D], b_bias [BLOCK_N] float32 in log2 units
    (0 for a visible slot, -inf for a masked one); b_m, b_l [BLOCK_G] running max and sum,
    b_acc [BLOCK_G, BLOCK_D] float32. A tile with nothing visible leaves the state unchanged.
    """
    b_s = dot(b_q, tl.trans(b_k), PRECISION)
    b_m, b_l, b_alpha, b_p = softmax_step(b_s, b_bias, b_m, b_l, scale_log2)
    b_acc = b_acc * b_alpha[:, None] + dot(b_p.to(b_v.dtype), b_v, PRECISION)
    return b_m, b_l, b_acc


@triton.jit
def softmax_step(b_s, b_bias, b_m, b_l, scale_log2):
    """The softmax half of a tile: raw scores b_s [BLOCK_G, BLOCK_N] and b_bias [BLOCK_N]
    (log2 units: 0 visible, -inf masked) -> the new running max and sum, the factor ``alpha``
    [BLOCK_G] that rescales the accumulator, and the tile's probabilities ``p`` [BLOCK_G,
    BLOCK_N] (float32)."""
    b_s = b_s * scale_log2 + b_bias[None, :]
    b_mn, b_ms, b_alpha = raise_max(b_m, tl.max(b_s, 1))
    b_p = tl.exp2(b_s - b_ms[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    return b_mn, b_l, b_alpha, b_p


@triton.jit
def raise_max(b_m, b_tile_max):
    """The running max [BLOCK_G] after a tile whose row maxima are ``b_tile_max``: the new max,
    the one to subtract (0 for a row that has seen nothing: -inf - -inf is NaN), and ``alpha``,
    the factor that rescales what was accumulated under the old max."""
    b_mn = tl.maximum(b_m, b_tile_max)
    b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    return b_mn, b_ms, tl.exp2(b_m - b_ms)


@triton.jit
def load_query_group(Q, i_b, i_h, stride_qb, stride_qh, G: tl.constexpr, D: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The G query heads of KV head ``i_h`` of sequence ``i_b`` from q [B, Hq, D]:
    a [BLOCK_G, BLOCK_D] block, padding rows and columns 0."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    p_q = Q + i_b * stride_qb + (i_h * G + o_g)[:, None] * stride_qh + o_d[None, :]
    return tl.load(p_q, mask=(o_g < G)[:, None] & (o_d < D)[None, :], other=0.0)


@triton.jit
def split_range(n, i_s, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """Rows ``[lo, hi)`` of split ``i_s`` when ``n`` rows are cut into ``NUM_SPLITS`` equal
    BLOCK_N-aligned ranges (computed on the device, so the split count stays a launch constant)."""
    chunk = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = i_s * chunk
    return lo, tl.minimum(lo + chunk, n)


@triton.jit
def finish_rows(b_m, b_l, b_acc, O, L, i_b, i_h, i_s, stride_ob, stride_oh, stride_os,
                stride_lb, stride_lh, G: tl.constexpr, D: tl.constexpr,
                BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Normalize and store the G rows of a program: out = acc / l at
    ``O[i_b, i_h*G + g, i_s, :]`` and lse = ln(sum exp) at ``L[i_b, i_h*G + g, i_s]``
    (``stride_os = 0`` and split 0 for unsplit outputs); empty rows get 0 and -inf."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < G
    o_row = i_h * G + o_g
    p_o = O + i_b * stride_ob + o_row[:, None] * stride_oh + i_s * stride_os + o_d[None, :]
    p_l = L + i_b * stride_lb + o_row * stride_lh + i_s
    b_has = b_l > 0
    b_out = b_acc / tl.where(b_has, b_l, 1.0)[:, None]
    b_lse = tl.where(b_has, (b_m + tl.log2(tl.where(b_has, b_l, 1.0))) * LN2,
                     float("-inf"))
    tl.store(p_o, b_out.to(p_o.dtype.element_ty), mask=m_g[:, None] & (o_d < D)[None, :])
    tl.store(p_l, b_lse, mask=m_g)
