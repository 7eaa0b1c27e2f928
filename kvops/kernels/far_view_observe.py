"""Triton kernel for ``kvops.far_view_observe``: the far view's utility update from one
attention call, one program a row.

Program ``r`` loads the row's ``C`` far biases (a slot is visible where its bias is above
``-inf``), then per KV head the group's ``G`` queries and the ``C`` far keys of that head (one
``tl.dot``, both sides padded to 16), and sums ``exp(scale * q . k + bias - lse)`` over
the group's heads (float32; an ``lse`` of ``-inf`` counts as 0, and an invisible slot's key is
never loaded, so nothing there reaches the sum). The row's mass is written, and where the
row is live each selection entry inside the utility row moves its utility to
``ema * old + (1 - ema) * mass``. Fixed grid ``(R,)``, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops._checks import signature as sig
from kvops.kernels._attention import dot
from kvops.kernels._common import dot_precision, next_pow2
from kvops.kernels._launch import Launch, keep_plan


@triton.jit
def _far_view_observe_kernel(
    Q, FK, FB, LSE, SEL, SC, LIVE, MASS,
    stride_qr, stride_qh, stride_kr, stride_kc, stride_kh, stride_lr, stride_sr,
    C, NCOL, ema, scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LIVE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < C
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < G
    bias = tl.load(FB + r * C + o_c, mask=m_c, other=float("-inf"))
    vis = m_c & (bias > float("-inf"))
    b_bias = tl.where(vis, bias, 0.0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    mass = tl.zeros([BLOCK_C], tl.float32)
    for h in range(HKV):
        b_q = tl.load(Q + r * stride_qr + (h * G + o_g)[:, None] * stride_qh + o_d[None, :],
                      mask=m_g[:, None] & m_d[None, :], other=0.0)
        b_k = tl.load(FK + r * stride_kr + o_c[:, None] * stride_kc + h * stride_kh
                      + o_d[None, :], mask=vis[:, None] & m_d[None, :], other=0.0)
        s = dot(b_q, tl.trans(b_k), PRECISION)                  # [BLOCK_G, BLOCK_C]
        lse = tl.load(LSE + r * stride_lr + h * G + o_g, mask=m_g, other=0.0)
        norm = tl.where(lse > float("-inf"), lse, 0.0)
        p = tl.exp(s * scale + b_bias[None, :] - norm[:, None])
        p = tl.where(m_g[:, None] & vis[None, :], p, 0.0)
        mass += tl.sum(p, axis=0)
    tl.store(MASS + r * C + o_c, mass, mask=m_c)
    sel = tl.load(SEL + r * C + o_c, mask=m_c, other=-1)
    upd = m_c & (sel >= 0) & (sel < NCOL)
    if HAS_LIVE:
        upd = upd & (tl.load(LIVE + r + o_c * 0, mask=m_c, other=0) != 0)
    p_s = SC + r * stride_sr + tl.where(upd, sel, 0)
    old = tl.load(p_s, mask=upd, other=0.0)
    tl.store(p_s, ema * old + (1.0 - ema) * mass, mask=upd)


def observe_launch(G: int, C: int, D: int) -> tuple[int, int, int, int]:
    """``(BLOCK_G, BLOCK_C, BLOCK_D, num_warps)`` for groups of ``G`` query heads over ``C``
    far slots of head dim ``D``: a head's scores are one ``tl.dot`` of ``[BLOCK_G, D]`` queries
    by ``[BLOCK_C, D]`` keys, so both sides are at least 16 (the smallest dot), the head dim
    whole; four warps."""
    return max(16, next_pow2(G)), max(16, next_pow2(C)), next_pow2(D), 4


def far_view_observe_fwd(q, far_k, far_bias, lse, select, scores, live, ema: float,
                         scale: float, signature=None) -> torch.Tensor:
    """Launch the observe kernel; inputs are already checked by the op. Returns ``mass
    float32 [R, C]`` and updates ``scores`` in place."""
    R, C = q.shape[0], far_k.shape[1]
    mass = torch.empty(R, C, dtype=torch.float32, device=q.device)
    if R == 0:
        return mass
    # the op's int signature holds ema and the scale it was given (None: D's, in the shapes)
    key = (signature if type(signature) is int else
           (tuple(sig(t) for t in (q, far_k, far_bias, lse, select, scores, live)), ema, scale))
    plan = _PLANS.get(key) or keep_plan(_PLANS, key, _plan(q, far_k, far_bias, lse, select,
                                                           scores, live, ema, scale))
    live_arg = live.view(torch.uint8) if live is not None else select   # unread without live
    plan(q, far_k, far_bias, lse, select, scores, live_arg, mass)
    return mass


_PLANS: dict = {}   # launches (``_launch.Launch``) by signature


def _plan(q, far_k, far_bias, lse, select, scores, live, ema, scale):
    R, Hq, D = q.shape
    C, Hkv = far_k.shape[1], far_k.shape[2]
    G = Hq // Hkv
    block_g, block_c, block_d, warps = observe_launch(G, C, D)
    ints = (q.stride(0), q.stride(1), far_k.stride(0), far_k.stride(1), far_k.stride(2),
            lse.stride(0), scores.stride(0), C, scores.shape[1], float(ema), float(scale))
    meta = dict(HKV=Hkv, G=G, D=D, BLOCK_G=block_g, BLOCK_C=block_c, BLOCK_D=block_d,
                HAS_LIVE=live is not None, PRECISION=dot_precision(q.dtype), num_warps=warps)
    # the binary specializes on the strides and ints above, the constants and each pointer's
    # 16-byte alignment of each pointer (a row slice of a layer's selection moves with the
    # layer; the op's signature holds it too); mass is fresh, always aligned
    bin_key = ("observe", q.device, q.dtype, ints[:9], tuple(meta.values()),
               tuple(t.data_ptr() % 16 == 0 for t in (q, far_k, far_bias, lse, select, scores,
                                                      live) if t is not None))
    return Launch(_far_view_observe_kernel, (R,), bin_key, ints, meta)
