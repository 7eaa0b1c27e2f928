"""``torch.ops.kvops.static_sliding_attention``: checks, PyTorch reference, registration, fake.

The op's documentation is :func:`static_sliding_attention`'s docstring (``help()`` shows it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops import _checks
from kvops._config import use_triton, validate
from kvops.kernels.static_sliding_attention import static_sliding_attention_fwd
from kvops.ops._library import CheckedSignatures, register
from kvops.ops._reference import softmax_attend

NHD_HINT = ("K/V windows are [B, W, Hkv, D] (token-major); a transformers cache tensor is "
            "[B, Hkv, T, D]: pass k.transpose(1, 2)")


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
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q/k: query heads Hq={Hq} must be a multiple of KV heads "
                         f"Hkv=k.shape[2]={Hkv} ({NHD_HINT})")
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
    if scale is not None and not isinstance(scale, float):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")


_checked = CheckedSignatures(_check)


def _validate(k, win_start, win_len) -> None:
    W = k.shape[1]
    _checks.index_range("win_start", win_start, 0, W)
    bad = (win_len < 0) | (win_len > W)
    if bool(bad.any()):
        raise IndexError(f"win_len: values must lie in [0, {W + 1}) (W = k.shape[1] = {W}), "
                         f"found {int(win_len[bad][0])}; {NHD_HINT}")


def static_sliding_attention_ref(
    q: Tensor, k: Tensor, v: Tensor, win_start: Tensor, win_len: Tensor,
    far_k: Tensor | None = None, far_v: Tensor | None = None, far_bias: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PyTorch reference (float32 math); the CPU implementation. Shapes as documented in
    :func:`static_sliding_attention`. Invisible slots and empty far slots are masked in both the
    logits and the values, so NaN or inf there never reaches an output."""
    B, Hq, D = q.shape
    W, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    qf = q.float().view(B, Hkv, G, D)
    logits = torch.einsum("bhgd,bwhd->bhgw", qf, k.float()) * scale
    slot = torch.arange(W, device=q.device)
    rel = (slot[None, :] - win_start.long()[:, None]) % W
    wl = win_len.long()
    visible = rel < wl.clamp(0, W)[:, None]
    logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
    values = v.float().masked_fill(~visible[:, :, None, None], 0.0)
    if far_k is not None:
        live = far_bias > float("-inf")                                   # [B, C]
        far = torch.einsum("bhgd,bchd->bhgc", qf, far_k.float()) * scale + far_bias[:, None, None, :]
        far = far.masked_fill(~live[:, None, None, :], float("-inf"))
        logits = torch.cat([logits, far], dim=-1)
        values = torch.cat([values, far_v.float().masked_fill(~live[:, :, None, None], 0.0)], dim=1)
    out, lse = softmax_attend(logits, values)
    out, lse = out.reshape(B, Hq, D), lse.reshape(B, Hq)
    bad = ((wl < 0) | (wl > W))[:, None]                                  # outside [0, W]: NaN
    out = out.masked_fill(bad[..., None], float("nan"))
    lse = lse.masked_fill(bad, float("nan"))
    return out.to(q.dtype), lse


def _impl(q, k, v, win_start, win_len, far_k=None, far_v=None, far_bias=None, scale=None):
    key, _ = _checked(q, k, v, win_start, win_len, far_k, far_v, far_bias, scale)
    if validate():
        _validate(k, win_start, win_len)
    if use_triton(q):
        return static_sliding_attention_fwd(q, k, v, win_start, win_len, far_k, far_v, far_bias,
                                            scale, signature=key)
    return static_sliding_attention_ref(q, k, v, win_start, win_len, far_k, far_v, far_bias,
                                        scale)


def _fake(q, k, v, win_start, win_len, far_k=None, far_v=None, far_bias=None, scale=None):
    _check(q, k, v, win_start, win_len, far_k, far_v, far_bias, scale)
    B, Hq, D = q.shape
    return q.new_empty((B, Hq, D)), q.new_empty((B, Hq), dtype=torch.float32)


_op = register(
    "static_sliding_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor win_start, Tensor win_len, Tensor? far_k=None, "
    "Tensor? far_v=None, Tensor? far_bias=None, float? scale=None) -> (Tensor, Tensor)",
    _impl, _fake)


def static_sliding_attention(
    q: Tensor, k: Tensor, v: Tensor, win_start: Tensor, win_len: Tensor,
    far_k: Tensor | None = None, far_v: Tensor | None = None, far_bias: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Fixed-shape decode attention over a ring window plus optional far slots
    (``torch.ops.kvops.static_sliding_attention``; KV-RM's static sliding kernel, paper
    section 4.1, with the far view of section 4.4 in the same call).

    - q [B, Hq, D]; k, v [B, W, Hkv, D]: the window, token-major (NHD), any row order, the last
      dim contiguous. A transformers cache tensor is [B, Hkv, T, D]: pass ``k.transpose(1, 2)``.
    - win_start, win_len int32 [B], contiguous: slot j of sequence b is visible iff
      ``(j - win_start[b]) mod W < win_len[b]`` (a circular interval, so a ring buffer works;
      win_start 0 is the plain prefix). win_start is taken mod W.
    - far_k, far_v [B, C, Hkv, D] and far_bias float32 [B, C]: always in the softmax, with
      far_bias added to the scaled logits (log(count) for a summary of count tokens, -inf for an
      empty slot). All three or none.
    - Returns out [B, Hq, D] in q's dtype and lse float32 [B, Hq] (natural log of the sum of exp
      of the scaled, biased logits); a row with nothing visible gets out = 0 and lse = -inf.
      Accumulation is float32; scale defaults to D ** -0.5. Hq must be a multiple of Hkv (GQA).
    - An invisible slot or an empty far slot is never read into an output: NaN or inf there
      changes nothing.

    ``win_len`` outside [0, W]: the row's out and lse are NaN. The op cannot raise there
    without reading win_len on the host (a sync, and impossible inside a CUDA graph); a
    win_len above W is what K/V in transformers' [B, Hkv, T, D] layout look like when
    Hq % T == 0 lets the shapes pass (W is then read as Hkv). Validation mode
    (``kvops.validate(True)``) checks win_start and win_len on the host and raises IndexError
    naming that layout. When the shapes do not fit, the heads error names it. One case no check
    can tell apart: T == Hkv with win_len <= T (a square [Hkv, T] block read transposed).

    CUDA tensors run the Triton kernel (``kvops.kernels.static_sliding_attention``); CPU tensors
    run :func:`~kvops.ops.static_sliding_attention.static_sliding_attention_ref` (or the
    interpreted kernel under backend "triton"). Output shapes depend on input shapes only.
    """
    return _op(q, k, v, win_start, win_len, far_k, far_v, far_bias, scale)
