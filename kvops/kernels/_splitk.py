"""Split-K (flash-decoding) reduction shared by the decode attention kernels.

Stage 1 of a split-K kernel writes, per (sequence, query head, split), a normalized partial
output and its natural-log ``lse`` (``-inf`` for a split that saw nothing). This kernel merges
the ``NSP`` splits of every row into the final ``out``/``lse``. The number of splits is a launch
constant chosen from shapes only, so the pair of launches is fixed-shape and graph-replayable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops.kernels._common import DeviceProps, next_pow2
from kvops.kernels._launch import launch
from kvops.kernels._workspace import float_views


@triton.jit
def _merge_splits_kernel(
    PartO, PartLse, Out, Lse,
    stride_pr, stride_ps,          # PartO [R, NSP, D] (last stride 1)
    stride_or,                     # Out [R, D]
    NSP, D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # launched early (programmatic dependent launch): wait for stage 1's writes
        tl.extra.cuda.gdc_wait()
    i_r = tl.program_id(0)
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_s = o_s < NSP
    m_d = o_d < D
    b_lse = tl.load(PartLse + i_r * NSP + o_s, mask=m_s, other=float("-inf"))
    b_max = tl.max(b_lse, 0)
    b_safe = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_w = tl.exp(b_lse - b_safe)                                  # 0 for empty splits
    p_o = PartO + i_r * stride_pr + o_s[:, None] * stride_ps + o_d[None, :]
    b_o = tl.load(p_o, mask=m_s[:, None] & m_d[None, :], other=0.0)
    b_sum = tl.sum(b_w, 0)
    b_out = tl.sum(b_o * b_w[:, None], 0) / tl.where(b_sum > 0, b_sum, 1.0)
    # a NaN row (a win_len out of range) stays NaN; an empty one gets -inf
    b_lse_out = tl.where(b_sum > 0, b_safe + tl.log(tl.where(b_sum > 0, b_sum, 1.0)),
                         tl.where(b_sum == b_sum, float("-inf"), float("nan")))
    tl.store(Out + i_r * stride_or + o_d, b_out.to(Out.dtype.element_ty), mask=m_d)
    tl.store(Lse + i_r, b_lse_out)


def default_num_splits(pairs: int, n: int, block_n: int, tile_bytes: int, sms: int) -> int:
    """Splits of each (sequence, KV head) pair's ``n`` rows on ``sms`` SMs: enough programs to
    keep about 64 KiB of K/V tiles in flight per SM (one program an SM for 64 KiB tiles, two
    for 32 KiB), at least 2 tiles a split, at most 64 splits. Shapes only, so a captured graph
    stays valid (docs/tuning.md)."""
    per_sm = max(1, 65536 // tile_bytes)
    want = sms * per_sm // max(pairs, 1)
    return max(1, min(want, n // (2 * block_n), 64))


def use_pdl(props: DeviceProps) -> bool:
    """Programmatic dependent launch (NVIDIA Hopper and newer, compiled): the merge launches
    while stage 1 is still running and waits on-device, hiding one launch latency. Stage 1
    kernels take it as a constexpr (``USE_PDL`` or ``PDL_TRIGGER``) and call
    ``gdc_launch_dependents``. Off under the interpreter and on ROCm (whose gfx9 parts also
    report capability 9), where the ``gdc_*`` instructions do not exist."""
    return props.ptx and props.capability[0] >= 9


def merge_warps(D: int) -> int:
    """Warps of a merge program: 4 for rows of 128 values or more, else 2."""
    return 4 if D >= 128 else 2


def split_outputs(B: int, Hq: int, D: int, nsp: int, dtype: torch.dtype, device: torch.device):
    """Outputs of a split-K decode launch: ``out [B, Hq, D]`` (``dtype``), ``lse [B, Hq]``
    float32, and where stage 1 writes: ``out``/``lse`` themselves when ``nsp == 1``, else float32
    partials ``[B, Hq, nsp, D]`` / ``[B, Hq, nsp]`` in the stream's scratch
    (``_workspace.float_views``: read by this call's merge only). Returns (out, lse, part_o,
    part_l)."""
    out = torch.empty(B, Hq, D, device=device, dtype=dtype)
    lse = torch.empty(B, Hq, device=device, dtype=torch.float32)
    if nsp == 1:
        return out, lse, out, lse
    part_o, part_l = float_views(device, ((B, Hq, nsp, D), (B, Hq, nsp)))
    return out, lse, part_o, part_l


def merge_plan(B: int, Hq: int, nsp: int, D: int, dtype: torch.dtype, pdl: bool,
               device: torch.device):
    """What :func:`merge_split_outputs` launches for ``split_outputs(B, Hq, D, nsp, ...)``'s
    tensors on ``device``, computed once per launch plan: (grid, key, runtime integers,
    constants). The key names the device: a binary is loaded per device."""
    R = B * Hq
    ints = (nsp * D, D, D, nsp)
    meta = dict(D=D, BLOCK_S=next_pow2(nsp), BLOCK_D=next_pow2(D), USE_PDL=pdl,
                num_warps=merge_warps(D), **({"launch_pdl": True} if pdl else {}))
    return (R,), ("merge", ints, dtype, pdl, device.type, device.index), ints, meta


def merge_split_outputs(plan, part_o, part_l, out, lse) -> None:
    """Merge the partials of ``split_outputs`` into ``out``/``lse`` by a :func:`merge_plan`
    (contiguous and 16-byte aligned)."""
    grid, key, ints, meta = plan
    launch(_merge_splits_kernel, grid, key, (part_o, part_l, out, lse, *ints), meta)
