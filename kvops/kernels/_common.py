"""Small helpers every launcher uses: device properties, tile sizes, dot precision, constants."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from kvops._config import interpreting

LOG2E = 1.4426950408889634     # log2(e): kernels run softmax in base 2 (exp2)
LN2 = 0.6931471805599453       # ln(2): base-2 lse back to natural log


class DeviceProps(NamedTuple):
    """What launch rules read about a device (``kvops.kernels.launch_rules``): SMs, the shared
    memory one program may use, compute capability, and whether kernels are compiled NVIDIA code
    (inline PTX allowed). Hashable, so rules cache on it."""

    sms: int
    smem: int
    capability: tuple[int, int]
    ptx: bool


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def _device_props(kind: str, index: int | None) -> DeviceProps:
    if kind != "cuda":
        # the interpreter models a 4-SM Hopper, so split-K and multi-wave rules are exercised
        return DeviceProps(4, 227 * 1024, (0, 0), False)
    p = _props(index if index is not None else torch.cuda.current_device())
    smem = (getattr(p, "shared_memory_per_block_optin", 0)
            or getattr(p, "shared_memory_per_multiprocessor", 0))
    return DeviceProps(p.multi_processor_count, smem, (p.major, p.minor), _compiled_nvidia())


def device_props(device: torch.device) -> DeviceProps:
    """:class:`DeviceProps` of ``device``, queried once per device."""
    return _device_props(device.type, device.index)


@functools.cache
def _props(index: int):
    return torch.cuda.get_device_properties(index)


def _cuda_props(device: torch.device):
    """Properties of CUDA ``device``, queried once per device (launchers ask on every call)."""
    return _props(device.index if device.index is not None else torch.cuda.current_device())


def page_copy_block(page_elems: int, itemsize: int, budget_bytes: int) -> int:
    """Elements a page-copy step moves: the largest power of two that divides the page and
    holds at most ``budget_bytes``."""
    return min(page_elems & -page_elems, budget_bytes // itemsize)


def check_copy_block(name: str, block: int, page_elems: int) -> None:
    """A page-copy step given by hand must be a power of two dividing the page."""
    if page_elems % block or block & (block - 1):
        raise ValueError(f"{name}: expected a power of two dividing S*Hkv*D={page_elems}, "
                         f"got {block}")


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 4 for CPU (interpreter) so split-K is exercised."""
    if device.type != "cuda":
        return 4
    return _cuda_props(device).multi_processor_count


def grid_waves(programs: int, sms: int) -> tuple[int, float]:
    """How a grid of ``programs`` one-per-SM programs runs on ``sms`` SMs: the number of waves
    and the share of those waves' SM slots it fills (at least one wave, so 0 programs fill 0)."""
    waves = -(-max(programs, 1) // sms)
    return waves, programs / (waves * sms)


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device``: the opt-in per-block limit
    (227 KiB on Hopper, 163 on A100, 99 on Ada), else the per-SM size, else 0 where torch says
    neither. The interpreter models Hopper, as ``sm_count`` models 4 SMs."""
    if device.type != "cuda":
        return 227 * 1024
    props = _cuda_props(device)
    return (getattr(props, "shared_memory_per_block_optin", 0)
            or getattr(props, "shared_memory_per_multiprocessor", 0))


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` compute capability of ``device``; ``(0, 0)`` for a CPU device."""
    if device.type != "cuda":
        return (0, 0)
    p = _cuda_props(device)
    return (p.major, p.minor)


@functools.cache
def _compiled_nvidia() -> bool:
    # fixed for the process: triton picks the interpreter when kvops' kernels are decorated
    return not interpreting() and torch.version.hip is None


def nvidia_ptx(device: torch.device) -> bool:
    """Whether kernels on ``device`` are compiled NVIDIA code, so inline PTX may be used (not
    under the interpreter, not on ROCm). Asked on every launch, so it reads nothing anew."""
    return device.type == "cuda" and _compiled_nvidia()


def hw_fp8(device: torch.device) -> bool:
    """Whether ``device`` converts float8 e4m3 in hardware (NVIDIA sm_89 and newer, compiled)."""
    return nvidia_ptx(device) and cuda_capability(device) >= (8, 9)


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


def _itemsize(dtype) -> int:
    return dtype if isinstance(dtype, int) else dtype.itemsize


def kv_tile_bytes(block_n: int, D: int, dtype) -> int:
    """Bytes of one K tile plus one V tile of ``block_n`` rows as staged in shared memory
    (``dtype``: a torch dtype or its item size)."""
    return 2 * block_n * next_pow2(D) * _itemsize(dtype)


def kv_block_n(D: int, dtype) -> int:
    """Rows of the decode kernels' large K/V tiles: 32 KiB of K (64 KiB of K and V), at most
    128 rows, at least 16 (docs/tuning.md)."""
    row_bytes = next_pow2(D) * _itemsize(dtype)
    return max(16, min(128, 32768 // row_bytes))
