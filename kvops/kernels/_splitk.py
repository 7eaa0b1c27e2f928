"""Split-K (flash-decoding) reduction shared by the decode attention kernels.

Stage 1 of a split-K kernel writes, per (sequence, query head, split), a normalized partial
output and its natural-log ``lse`` (``-inf`` for a split that saw nothing). The ``NSP`` splits
of every row are merged into the final ``out``/``lse`` in one of two ways:

- in the same launch (``merge_if_last``, eager calls): each program counts itself done on its
  (sequence, KV head)'s counter, and the last of the group's splits merges the group's rows and
  sets the counter back to zero. One launch a call instead of two saves the host a launch
  (5.6 us on the H200's host, ``bench/results/2026-12-03-1730-eager-parts.md``);
- by a second launch (``merge_split_outputs``) while a CUDA graph is being captured, where a
  launch costs the host nothing at replay and fresh counters would need a zeroing node.

The number of splits is a launch constant chosen from shapes only, so either form is
fixed-shape and graph-replayable. The two sum the splits in different orders, so an eager
call and a replay of the same launch may differ in the last bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvops.kernels._common import DeviceProps, next_pow2
from kvops.kernels._launch import Launch, launch
from kvops.kernels._workspace import split_scratch


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


@triton.jit
def arrive(Count, n):
    """Count this program done on ``Count`` (an int32 counter, zero before the launch) among the
    ``n`` programs that share it: True for the last to arrive, which then reads the others'
    writes (loads with ``cache_modifier=".cg"``) and sets the counter back to zero
    (``tl.atomic_xchg(Count, 0)``) for the next launch."""
    tl.debug_barrier()            # every thread's stores precede this program's count
    return tl.atomic_add(Count, 1, sem="acq_rel", scope="gpu") == n - 1


@triton.jit
def merge_if_last(PartO, PartL, Out, Lse, Count, i_b, i_h, Hkv,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, NUM_SPLITS,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Called by every split program of one (sequence ``i_b``, KV head ``i_h``) of a decode
    launch after it wrote its partials (``PartO``/``PartL`` with stage 1's strides): the last of
    the ``NUM_SPLITS`` to finish merges the group's ``G`` query rows into ``Out [B, Hq, D]`` and
    ``Lse [B, Hq]`` (contiguous) and sets ``Count`` (the group's counter) back to zero."""
    if arrive(Count, NUM_SPLITS):
        o_g = tl.arange(0, BLOCK_G)
        o_d = tl.arange(0, BLOCK_D)
        o_row = i_h * G + o_g
        r = i_b * Hkv * G + o_row
        merge_rows(PartO + i_b * stride_pb + o_row[:, None] * stride_ph + o_d[None, :],
                   stride_ps, PartL + i_b * stride_lb + o_row * stride_lh, o_g < G,
                   Out + r[:, None] * D + o_d[None, :], Lse + r, NUM_SPLITS, D, BLOCK_D,
                   BLOCK_S)
        tl.atomic_xchg(Count, 0)


@triton.jit
def merge_rows(p_o, stride_ps, p_l, m_r, p_out, p_lse, NUM_SPLITS, D: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the ``NUM_SPLITS`` partials of a block of rows as ``_merge_splits_kernel`` does:
    ``p_o [R, BLOCK_D]`` points at split 0's partial outputs (split ``s`` ``s * stride_ps``
    further), ``p_l [R]`` at split 0's partial lse (split stride 1), ``m_r [R]`` masks the rows;
    the results go to ``p_out [R, BLOCK_D]`` and ``p_lse [R]``. Partials are read from L2
    (``.cg``): other programs of the launch wrote them."""
    o_s = tl.arange(0, BLOCK_S)
    m_o = m_r[:, None] & (tl.arange(0, BLOCK_D) < D)[None, :]
    b_lse = tl.load(p_l[:, None] + o_s[None, :], mask=m_r[:, None] & (o_s < NUM_SPLITS)[None, :],
                    other=float("-inf"), cache_modifier=".cg")
    b_max = tl.max(b_lse, 1)
    b_safe = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_sum = tl.zeros_like(b_safe)
    b_acc = tl.zeros(p_o.shape, tl.float32)
    for s in range(NUM_SPLITS):
        b_w = tl.exp(tl.load(p_l + s, mask=m_r, other=float("-inf"), cache_modifier=".cg")
                     - b_safe)                                           # 0 for empty splits
        b_o = tl.load(p_o + s * stride_ps, mask=m_o, other=0.0, cache_modifier=".cg")
        b_acc += b_o * b_w[:, None]
        b_sum += b_w
    b_out = b_acc / tl.where(b_sum > 0, b_sum, 1.0)[:, None]
    # a NaN row (a win_len out of range) stays NaN; an empty one gets -inf
    b_lse_out = tl.where(b_sum > 0, b_safe + tl.log(tl.where(b_sum > 0, b_sum, 1.0)),
                         tl.where(b_sum == b_sum, float("-inf"), float("nan")))
    tl.store(p_out, b_out.to(p_out.dtype.element_ty), mask=m_o)
    tl.store(p_lse, b_lse_out, mask=m_r)


def load_capture_form(ready: list) -> bool:
    """Whether an eager one-launch call should also run its launch's two-launch form first:
    once a plan (``ready``, the plan's own list, empty until then). A captured call launches
    that form, and a kernel first compiled and loaded inside a capture can fail there (module
    loading is not allowed while a stream captures) and costs the capture a compile, so the
    first eager call of a plan, typically the warm-up before capture, loads it. Both forms
    write the same outputs; the one-launch form runs second."""
    if ready:
        return False
    ready.append(True)
    return True


class DecodePlan(NamedTuple):
    """What a split decode launcher's call of one argument signature launches (its ``_plan``;
    ``static_sliding_attention``, ``elastic_attention``)."""

    B: int
    Hq: int
    D: int
    splits: int
    merge: tuple | None  # ``merge_plan`` of the two-launch form (None unsplit)
    fused: Launch | None     # the one-launch form (split plans)
    launch: Launch       # the two-launch form's first launch (an unsplit plan's only one):
                         # its grid, the scale and integers, the constants
    ready: list          # ``load_capture_form``'s: empty until the two-launch form ran eagerly
    like_q: bool         # out allocated as ``empty_like(q)`` (``split_outputs``)
    halves_table: bool = False   # elastic's general path: per-row ids (``_half_pages_kernel``)
    halves: tuple | None = None  # that kernel's (grid, integers, constants); None: none to make


def launch_split(head: tuple, count, spare, rest: tuple, plan) -> None:
    """Launch a split kernel whose runtime arguments are ``(*head, counters, *rest)`` and then
    the plan's integers, ``head`` ending in its partials, out and lse (``split_outputs``'s
    tensors), by ``plan`` (a launcher's plan: its ``launch``, ``fused``, ``merge`` and
    ``ready``): with ``count`` (the counters ``split_outputs`` gave) the one-launch form
    (``plan.fused``), after the two-launch form on a plan's first call (``load_capture_form``);
    without, the two-launch form: ``plan.launch`` with ``spare``, any int32 tensor, in the
    counters' place (that form never reads it), then the merge by ``plan.merge``
    (``merge_plan``; None unsplit). Both launches are :class:`~kvops.kernels._launch.Launch`
    objects (each holds the integers, its binary key and constants), so an unsplit call
    launches its binary's C entry as a split call does."""
    if count is None or load_capture_form(plan.ready):
        plan.launch(*head, spare, *rest)
        if plan.merge is not None:
            merge_split_outputs(plan.merge, *head[-4:])
    if count is not None:      # one launch: the last split of each group merges it
        plan.fused(*head, count, *rest)


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


def standard_strides(t: torch.Tensor) -> bool:
    """Whether ``t`` has exactly a new tensor's strides for its shape, so ``empty_like(t)`` is
    one (``is_contiguous`` also holds for other strides on size-1 dims and for empty tensors,
    which ``empty_like`` would copy)."""
    expect, strides = 1, []
    for n in reversed(t.shape):
        strides.append(expect)
        expect *= n
    return t.stride() == tuple(reversed(strides))


def split_outputs(B: int, Hq: int, D: int, nsp: int, dtype: torch.dtype, device: torch.device,
                  groups: int, like: torch.Tensor | None = None):
    """Outputs of a split-K decode launch: ``out [B, Hq, D]`` (``dtype``), ``lse [B, Hq]``
    float32, where stage 1 writes: ``out``/``lse`` themselves when ``nsp == 1``, else float32
    partials ``[B, Hq, nsp, D]`` / ``[B, Hq, nsp]`` in the stream's scratch (read by this call's
    merge only), and, for a split launch of ``groups`` (sequence, KV head) groups, the zeroed
    counters ``merge_if_last`` counts on, or None where the merge is a second launch (capture,
    ``_workspace.split_scratch``). ``like``: a tensor of out's shape, dtype and device with
    ``[B, Hq, D]``'s standard strides (a query of them: ``standard_strides``), whose
    ``empty_like`` is out (no keywords to parse: 0.3 us less on the CPU machines). Returns
    (out, lse, part_o, part_l, counters)."""
    out = (torch.empty(B, Hq, D, device=device, dtype=dtype) if like is None else
           torch.empty_like(like))
    lse = torch.empty(B, Hq, device=device, dtype=torch.float32)
    if nsp == 1:
        return out, lse, out, lse, None
    part_o, part_l, count = split_scratch(device, ((B, Hq, nsp, D), (B, Hq, nsp)), groups)
    return out, lse, part_o, part_l, count


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
