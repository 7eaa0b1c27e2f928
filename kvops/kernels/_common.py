"""Small helpers every launcher uses: tile sizes, SM counts, dot precision."""

from __future__ import annotations

import functools

import torch
import triton

from kvops._config import interpreting


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def _props(index: int):
    return torch.cuda.get_device_properties(index)


def _cuda_props(device: torch.device):
    """Properties of CUDA ``device``, queried once per device (launchers ask on every call)."""
    return _props(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 4 for CPU (interpreter) so split-K is exercised."""
    if device.type != "cuda":
        return 4
    return _cuda_props(device).multi_processor_count


def grid_waves(programs: int, device: torch.device) -> tuple[int, float]:
    """How a grid of ``programs`` one-per-SM programs runs on ``device``: the number of waves
    and the share of those waves' SM slots it fills (at least one wave, so 0 programs fill 0)."""
    sms = sm_count(device)
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


def kv_tile_bytes(block_n: int, D: int, dtype: torch.dtype) -> int:
    """Bytes of one K tile plus one V tile of ``block_n`` rows as staged in shared memory."""
    return 2 * block_n * next_pow2(D) * dtype.itemsize


def kv_block_n(D: int, dtype: torch.dtype) -> int:
    """Rows of the decode kernels' large K/V tiles: 32 KiB of K (64 KiB of K and V), at most
    128 rows. Two such tiles in flight (the dense kernel at 3 stages, the paged native kernel at
    5) take 128 KiB of the H200's 227 KiB of shared memory; 128 float32 rows of D 128 would
    take 256 KiB and fail to launch.
    """
    row_bytes = next_pow2(D) * dtype.itemsize
    return max(16, min(128, 32768 // row_bytes))
