"""Input checks shared by every op. Each raises naming the argument, the expectation and the value.

Wrong Python type or dtype raises ``TypeError``; wrong rank, shape, device or an unsupported size
raises ``ValueError``; an out-of-range index found by validation mode raises ``IndexError``.
Shape checks run in the fake (meta) implementation as well, so ``torch.compile`` reports them at
trace time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def tensor(name: str, t, *, rank: int | None = None, dtypes: Sequence[torch.dtype] | None = None,
           device: torch.device | None = None) -> torch.Tensor:
    """Check that ``t`` is a tensor of the given rank, one of ``dtypes``, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank}, got rank {t.dim()} (shape {tuple(t.shape)})")
    if dtypes is not None and t.dtype not in dtypes:
        want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({want}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device.type != device.type:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def shape(name: str, t: torch.Tensor, expected: Sequence, letters: str) -> None:
    """Check ``t.shape`` against ``expected`` (ints, or None for any) named by ``letters``.

    ``letters`` spells the dims, e.g. ``"B W Hkv D"``, so the message reads
    ``k: expected shape [B=2, W=96, Hkv=4, D=64], got (2, 96, 2, 64)``.
    """
    if len(t.shape) != len(expected) or any(
        e is not None and s != e for s, e in zip(t.shape, expected)
    ):
        dims = ", ".join(
            f"{n}={e}" if e is not None else n for n, e in zip(letters.split(), expected)
        )
        raise ValueError(f"{name}: expected shape [{dims}], got {tuple(t.shape)}")


def same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: expected dtype {ref.dtype} (same as {ref_name}), got {t.dtype}")


MAX_HEAD_DIM = 512


def head_dim(name: str, d: int) -> None:
    """Head dims the kernels support: multiples of 16 from 16 to 512 (64, 128, 256 tuned;
    docs/tuning.md)."""
    if d % 16 != 0 or not 16 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim D must be a multiple of 16 in [16, {MAX_HEAD_DIM}], "
                         f"got D={d}")


def heads(q_name: str, hq: int, kv_name: str, hkv: int) -> None:
    if hkv <= 0 or hq % hkv != 0:
        raise ValueError(
            f"{q_name}/{kv_name}: query heads Hq={hq} must be a multiple of KV heads Hkv={hkv}"
        )


def page_size(name: str, s: int) -> None:
    if s < 8 or s > 256 or s & (s - 1):
        raise ValueError(f"{name}: page size S must be a power of two in [8, 256], got S={s}")


def kv_pool(k_cache, v_cache) -> tuple[int, int, int, int]:
    """A K/V pool pair ``[P, S, Hkv, D]``: same device, dtype and shape, at least one page and one
    head, a supported page size and head dim. Returns ``(P, S, Hkv, D)``."""
    tensor("k_cache", k_cache, rank=4, dtypes=KV_DTYPES)
    P, S, Hkv, D = k_cache.shape
    if P < 1:
        raise ValueError(f"k_cache: expected at least one page, got P={P}")
    if Hkv < 1:
        raise ValueError(f"k_cache: expected at least one KV head, got Hkv={Hkv}")
    page_size("k_cache", S)
    head_dim("k_cache", D)
    tensor("v_cache", v_cache, rank=4, device=k_cache.device)
    same_dtype("v_cache", v_cache, "k_cache", k_cache)
    shape("v_cache", v_cache, (P, S, Hkv, D), "P S Hkv D")
    pages("k_cache", k_cache)
    pages("v_cache", v_cache)
    return P, S, Hkv, D


def pages(name: str, t: torch.Tensor) -> None:
    """The one page layout every op takes: each page ``t[p]`` of a ``[P, S, Hkv, D]`` pool one
    contiguous ``[S, Hkv, D]`` run, any page stride (so ``kv[:, 0]`` of an interleaved
    ``[P, 2, S, Hkv, D]`` pool works)."""
    _, S, Hkv, D = t.shape
    if not ((t.stride(3) == 1 or D == 1) and (t.stride(2) == D or Hkv == 1)
            and (t.stride(1) == Hkv * D or S == 1)):
        raise ValueError(f"{name}: expected contiguous pages [S, Hkv, D] (any page stride), got "
                         f"strides {t.stride()} for shape {tuple(t.shape)}")


def contiguous(name: str, t: torch.Tensor) -> None:
    """Mutated and kernel-read buffers must be contiguous: a silent copy would lose writes."""
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def index_range(name: str, t: torch.Tensor, lo: int, hi: int, *, allow: int | None = None) -> None:
    """Validation mode: every value in ``[lo, hi)`` (or equal to ``allow``); syncs the device."""
    if t.numel() == 0:
        return
    bad = (t < lo) | (t >= hi)
    if allow is not None:
        bad &= t != allow
    if bool(bad.any()):
        first = t[bad].flatten()[0].item()
        extra = f" or {allow}" if allow is not None else ""
        raise IndexError(f"{name}: values must lie in [{lo}, {hi}){extra}, found {first}")


def signature(t):
    """One tensor's part of an argument signature (None stays None): shape, strides, dtype,
    device index (-1 on the CPU; meta and fake tensors never reach an implementation) and
    whether its data is 16-byte aligned, which compiled kernels specialize on. Ops cache their
    checks and launch plans by the signatures of their arguments."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0)
