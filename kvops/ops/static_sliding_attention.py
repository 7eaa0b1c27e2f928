"""``torch.ops.kvops.static_sliding_attention``: fixed-shape decode attention over a ring window.

KV-RM's static sliding kernel (paper section 4.1) with the optional far view (section 4.4) in
the same call. See CONTRACT.md for the binding semantics; in short:

- q [B, Hq, D]; k, v [B, W, Hkv, D] (NHD window; any row order); win_start, win_len int32 [B].
  Slot j of sequence b is visible iff (j - win_start[b]) mod W < win_len[b].
- far_k, far_v [B, C, Hkv, D] and far_bias float32 [B, C]: always in the softmax, with far_bias
  added to the scaled logits (log(count) for a summary of count tokens, -inf for an empty slot).
- Returns out [B, Hq, D] in q's dtype and lse float32 [B, Hq]; a row with nothing visible gets
  out = 0 and lse = -inf. Accumulation is float32. scale defaults to D ** -0.5.

Values outside the documented ranges are not read out of bounds: win_start is taken mod W and
win_len clamped to [0, W]; validation mode (kvops.validate(True)) raises IndexError instead.

Implementations: CUDA tensors run ``kvops.kernels.static_sliding_attention`` (Triton); CPU
tensors run :func:`static_sliding_attention_ref` (or the interpreted kernel under backend
"triton"). Output shapes depend on input shapes only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.ops._reference import softmax_attend


def _check(q, k, v, win_start, win_len, far_k, far_v, far_bias, scale) -> None:
    _checks.tensor("q", q, rank=3, dtypes=_checks.KV_DTYPES)
    dev = q.device
    B, Hq, D = q.shape
    _checks.tensor("k", k, rank=4, device=dev)
    _checks.same_dtype("k", k, "q", q)
    _, W, Hkv, _ = k.shape
    _checks.shape("k", k, (B, None, None, D), "B W Hkv D")
    _checks.tensor("v", v, rank=4, device=dev)
    _checks.same_dtype("v", v, "q", q)
    _checks.shape("v", v, (B, W, Hkv, D), "B W Hkv D")
    if W < 1:
        raise ValueError(f"k: window width W must be at least 1, got W={W}")
    _checks.heads("q", Hq, "k", Hkv)
    _checks.head_dim("q", D)
    for name, t in (("win_start", win_start), ("win_len", win_len)):
        _checks.tensor(name, t, rank=1, dtypes=(torch.int32,), device=dev)
        _checks.shape(name, t, (B,), "B")
    given = [t is not None for t in (far_k, far_v, far_bias)]
    if any(given) and not all(given):
        raise ValueError(
            "far_k/far_v/far_bias: give all three or none, got "
            + ", ".join(f"{n}={'tensor' if g else 'None'}"
                        for n, g in zip(("far_k", "far_v", "far_bias"), given))
        )
    if all(given):
        _checks.tensor("far_k", far_k, rank=4, device=dev)
        _checks.same_dtype("far_k", far_k, "q", q)
        C = far_k.shape[1]
        _checks.shape("far_k", far_k, (B, C, Hkv, D), "B C Hkv D")
        _checks.tensor("far_v", far_v, rank=4, device=dev)
        _checks.same_dtype("far_v", far_v, "q", q)
        _checks.shape("far_v", far_v, (B, C, Hkv, D), "B C Hkv D")
        _checks.tensor("far_bias", far_bias, rank=2, dtypes=(torch.float32,), device=dev)
        _checks.shape("far_bias", far_bias, (B, C), "B C")
    for name, t in (("q", q), ("k", k), ("v", v), ("far_k", far_k), ("far_v", far_v)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected the last dim (D) contiguous, got strides {t.stride()}")
    # the kernel indexes these by row with unit stride
    _checks.contiguous("win_start", win_start)
    _checks.contiguous("win_len", win_len)
    if far_bias is not None and far_bias.numel() and far_bias.stride(-1) != 1:
        raise ValueError(f"far_bias: expected the last dim (C) contiguous, got strides "
                         f"{far_bias.stride()}")


def static_sliding_attention_ref(
    q: Tensor, k: Tensor, v: Tensor, win_start: Tensor, win_len: Tensor,
    far_k: Tensor | None = None, far_v: Tensor | None = None, far_bias: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PyTorch reference (float32 math); the CPU implementation. Shapes as in the module doc."""
    B, Hq, D = q.shape
    W, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    qf = q.float().view(B, Hkv, G, D)
    logits = torch.einsum("bhgd,bwhd->bhgw", qf, k.float()) * scale
    slot = torch.arange(W, device=q.device)
    rel = (slot[None, :] - win_start.long()[:, None]) % W
    visible = rel < win_len.long().clamp(0, W)[:, None]
    logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
    values = v.float()
    if far_k is not None:
        far = torch.einsum("bhgd,bchd->bhgc", qf, far_k.float()) * scale
        logits = torch.cat([logits, far + far_bias[:, None, None, :]], dim=-1)
        values = torch.cat([values, far_v.float()], dim=1)
    out, lse = softmax_attend(logits, values)
    return out.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq)


@torch.library.custom_op("kvops::static_sliding_attention", mutates_args=())
def static_sliding_attention(
    q: Tensor, k: Tensor, v: Tensor, win_start: Tensor, win_len: Tensor,
    far_k: Tensor | None = None, far_v: Tensor | None = None, far_bias: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Decode attention over a ring window plus optional far slots; see the module doc."""
    _check(q, k, v, win_start, win_len, far_k, far_v, far_bias, scale)
    if validate():
        W = k.shape[1]
        _checks.index_range("win_start", win_start, 0, W)
        _checks.index_range("win_len", win_len, 0, W + 1)
    if use_triton(q.device):
        from kvops.kernels.static_sliding_attention import static_sliding_attention_fwd

        return static_sliding_attention_fwd(q, k, v, win_start, win_len, far_k, far_v, far_bias,
                                            scale)
    return static_sliding_attention_ref(q, k, v, win_start, win_len, far_k, far_v, far_bias,
                                        scale)


@static_sliding_attention.register_fake
def _(q, k, v, win_start, win_len, far_k=None, far_v=None, far_bias=None, scale=None):
    _check(q, k, v, win_start, win_len, far_k, far_v, far_bias, scale)
    B, Hq, D = q.shape
    return q.new_empty((B, Hq, D)), q.new_empty((B, Hq), dtype=torch.float32)
