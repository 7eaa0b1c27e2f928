"""Small helpers every launcher uses: tile sizes, SM counts, dot precision."""

from __future__ import annotations

import functools

import torch
import triton

from kvops._config import interpreting


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 4 for CPU (interpreter) so split-K is exercised."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def dot_precision(dtype: torch.dtype) -> str:
    """How decode kernels run ``tl.dot``, passed as their ``PRECISION`` constexpr.

    "ieee": exact float32 dots (float32 inputs); "tf32": the tensor cores' default for 16-bit
    inputs; "upcast": operands cast to float32 first, used for bfloat16 under the interpreter,
    whose ``tl.dot`` on bfloat16 computes garbage (triton 3.9, seen here).
    """
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and interpreting():
        return "upcast"
    return "tf32"
