"""Where an eager call's host time goes: each piece of ``static_sliding_attention``'s host path
timed alone (back-to-back calls, no sync), beside SDPA and a one-kernel aten op.

The pieces: the output allocations, the argument signature, the op's dispatch into Python, the
launcher's Python, the compiled Triton launcher with tensors and with raw pointers, the Triton
launcher's C function called without its Python wrapper, and PyTorch's static CUDA launcher
(``torch._inductor.runtime.static_cuda_launcher``) on the same binary. A piece that this stack
cannot run prints its error in place of a time.

    python3 -m bench.bench_eager_parts        # CUDA only; prints a table
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import kvops  # noqa: F401  (registers the ops)
from bench.common import eager_times, table
from kvops._checks import signature as sig
from kvops.kernels import _launch, _splitk, _workspace
from kvops.kernels import static_sliding_attention as ssa

HQ, HKV, D = 32, 8, 128
LOOP = dict(iters=2000, warmup=50)


def _compiled_stage1():
    hits = [v for (k, _), v in _launch._BINS.items() if k == id(ssa._sliding_window_kernel)]
    return hits[-1] if hits else None


def rows(B: int = 4, ctx: int = 512):
    dev = torch.device("cuda")
    dt = torch.bfloat16
    q = torch.randn(B, HQ, D, device=dev, dtype=dt)
    k = torch.randn(B, ctx, HKV, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    ws = torch.zeros(B, dtype=torch.int32, device=dev)
    wl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    q4 = q.unsqueeze(2)
    kd, vd = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    ops = torch.ops.kvops
    call = lambda: ops.static_sliding_attention(q, k, v, ws, wl)
    call()
    call()           # the second call keeps the compiled binary for direct launches
    op_mod = sys.modules["kvops.ops.static_sliding_attention"]
    key, _ = op_mod._checked(q, k, v, ws, wl, None, None, None, None)
    plan = ssa._PLANS[key]
    nsp, grid, merge, fused = plan.splits, plan.launch.grid, plan.merge, plan.fused
    out, lse, part_o, part_l, count = ssa.split_outputs(B, HQ, D, nsp, dt, dev, grid[0])
    # the eager call's one launch: stage 1 with the merge by the last split (split launches)
    meta, token = (fused.meta, fused.key) if fused is not None else (plan.launch.meta,
                                                                     plan.launch.key)
    args = (q, k, v, ws, wl, None, None, None, part_o, part_l, out, lse, count, *plan.launch.ints)
    ptr_args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    compiled, tail, mode = _compiled_stage1()[:3]
    g = grid + (1,) * (3 - len(grid))
    stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    head = (g[0], g[1], g[2], stream, compiled.function, getattr(compiled, "packed_metadata", None),
            None, None, None)
    full = args + tail if mode in ("c", "tail") else args
    full_ptr = ptr_args + tail if mode in ("c", "tail") else ptr_args
    x = torch.randn(B, HQ, D, device=dev, dtype=dt)
    dev0 = torch.device("cuda", torch.cuda.current_device())
    c_args = _c_args(compiled, head, full)
    pieces = {
        "sdpa (whole call)": lambda: F.scaled_dot_product_attention(q4, kd, vd, enable_gqa=True),
        "torch.add(x, x) (one aten kernel)": lambda: torch.add(x, x),
        "torch.empty x1": lambda: torch.empty((B, HQ, D), device=dev, dtype=dt),
        "torch.empty x1, device cuda:0": lambda: torch.empty((B, HQ, D), device=dev0, dtype=dt),
        "torch.empty x1, sizes positional": lambda: torch.empty(B, HQ, D, device=dev0, dtype=dt),
        "q.new_empty": lambda: q.new_empty((B, HQ, D)),
        "torch.empty bytes + 2 views": lambda: _one_buffer(B, dev0, dt),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "dispatch into Python only (no-op op)": lambda: _noop()(q, k, v, ws, wl, None, None, None,
                                                              None),
        "no-op op returning fresh out and lse": lambda: _noop(fresh=True)(
            q, k, v, ws, wl, None, None, None, None),
        "split_outputs (all outputs)": lambda: ssa.split_outputs(
            B, HQ, D, nsp, dt, dev, grid[0], q if plan.like_q else None),
        "sig(q)": lambda: sig(q),
        "signature key (9 args)": lambda: (sig(q), sig(k), sig(v), sig(ws), sig(wl), sig(None),
                                           sig(None), sig(None), None),
        "op: torch.ops call (whole)": call,
        "op: its .default overload": lambda: op_mod._op(q, k, v, ws, wl, None, None, None, None),
        "op: torch.ops call, launches stubbed": _Stubbed(call),
        "op: _impl direct (no dispatcher)": lambda: op_mod._impl(q, k, v, ws, wl),
        "launcher: static_sliding_attention_fwd": lambda: ssa.static_sliding_attention_fwd(
            q, k, v, ws, wl, signature=key),
        "split_scratch (kept partials and counters)": lambda: _workspace.split_scratch(
            dev, ((B, HQ, nsp, D), (B, HQ, nsp)), grid[0]),
        "launch(): stage 1 + merge (cached binary)": lambda: _launch.launch(
            ssa._sliding_window_kernel, grid, token, args, meta),
        "the plan's Launch (one-launch form)": lambda: fused(*args[:13]) if fused else None,
        "compiled.run, tensors": lambda: compiled.run(*head, *full),
        "compiled.run, raw pointers": lambda: compiled.run(*head, *full_ptr),
        "data_ptr of the args (Python)": lambda: tuple(
            a.data_ptr() if type(a) is torch.Tensor else a for a in args),
        "C launch direct, tensors": lambda: compiled.run.launch(*c_args[0]),
        "C launch direct, raw pointers": lambda: compiled.run.launch(*c_args[1]),
        "current stream query": lambda: torch._C._cuda_getCurrentRawStream(
            torch._C._cuda_getDevice()),
    }
    if merge is not None:
        pieces["merge launch (two-launch form)"] = lambda: _splitk.merge_split_outputs(
            merge, part_o, part_l, out, lse)
    out_rows = [["splits", nsp, "", ""], ["stage-1 runtime args", len(args), "", ""]]
    for name, fn in pieces.items():
        # the launcher launches through the plan's Launch objects (_splitk.launch_split), and
        # the two-launch form's merge through _splitk.launch
        saved = _splitk.launch, _launch.Launch.__call__
        if isinstance(fn, _Stubbed):
            _splitk.launch = lambda *a, **kw: None
            _launch.Launch.__call__ = lambda self, *a: None
        try:
            host, wall = eager_times(fn, **LOOP)
            out_rows.append([name, f"{host:.2f}", f"{wall:.2f}", ""])
        except Exception as e:  # noqa: BLE001
            out_rows.append([name, "error", repr(e)[:80], ""])
        finally:
            _splitk.launch, _launch.Launch.__call__ = saved
        print(out_rows[-1], flush=True)
    return out_rows


def _c_args(compiled, head, full):
    """The Triton 3.6 launcher's C entry point's arguments (what ``CudaLauncher.__call__``
    passes it, scratch buffers None), with tensors and with raw pointers."""
    run = compiled.run
    after = _launch._c_entry(compiled)[1]
    fixed = (*head[:4], *after)   # grid, stream
    ptrs = tuple(a.data_ptr() if type(a) is torch.Tensor else a for a in full)
    print("scratch sizes", run.global_scratch_size, run.profile_scratch_size, flush=True)
    return fixed + tuple(full), fixed + ptrs


def _one_buffer(B, dev, dt):
    buf = torch.empty(B * HQ * D * 2 + B * HQ * 4, device=dev, dtype=torch.uint8)
    n = B * HQ * D * 2
    return buf[:n].view(dt).view(B, HQ, D), buf[n:].view(torch.float32).view(B, HQ)


_NOOP: dict = {}


def _noop(fresh: bool = False):
    """A CUDA op with static_sliding_attention's schema whose implementation does nothing but
    return two tensors: kept ones, or (``fresh``) out and lse allocated as the op does."""
    if not _NOOP:
        lib = torch.library.Library("kvops_bench", "DEF")
        keep = []
        schema = ("(Tensor q, Tensor k, Tensor v, Tensor win_start, Tensor win_len, "
                  "Tensor? far_k=None, Tensor? far_v=None, Tensor? far_bias=None, "
                  "float? scale=None) -> (Tensor, Tensor)")
        lib.define("noop" + schema)
        lib.define("noop_fresh" + schema)

        def impl(q, k, v, ws, wl, fk=None, fv=None, fb=None, scale=None):
            if not keep:
                keep.extend([q.new_empty(1), q.new_empty(1)])
            return keep[0], keep[1]

        def impl_fresh(q, k, v, ws, wl, fk=None, fv=None, fb=None, scale=None):
            B, Hq, D = q.shape
            return (torch.empty(B, Hq, D, device=q.device, dtype=q.dtype),
                    torch.empty(B, Hq, device=q.device, dtype=torch.float32))

        lib.impl("noop", impl, "CUDA")
        lib.impl("noop_fresh", impl_fresh, "CUDA")
        _NOOP.update(lib=lib, kept=torch.ops.kvops_bench.noop.default,
                     fresh=torch.ops.kvops_bench.noop_fresh.default)
    return _NOOP["fresh" if fresh else "kept"]


class _Stubbed:
    """A piece timed with the op's Triton launches stubbed out (its host path but the
    launches): the loop below patches them around its timing."""

    def __init__(self, call):
        self.call = call

    def __call__(self):
        return self.call()


def main():
    if not torch.cuda.is_available():
        raise SystemExit("bench_eager_parts needs CUDA")
    from bench.common import write_result

    r = rows()
    text = table(["piece", "host us", "wall us", "note"], r)
    path = write_result("eager-parts", "static_sliding_attention's host path, Llama-3-8B heads, "
                        "bf16, B 4 x 512; each piece timed alone over 2000 back-to-back calls.\n\n"
                        + text)
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
