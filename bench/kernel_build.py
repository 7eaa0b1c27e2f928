"""The paged prefill kernel built for an NVIDIA Hopper target on a machine without a GPU: its
Triton IR (the frontend, where code only a GPU compiler refuses fails: the interpreter passes
tensor descriptors as tensors) and its binary's resources (registers, and the stack a thread
spills to), for any tile. Compare Triton versions by putting another one first on the path
(``PYTHONPATH=<unpacked wheel>``: the device runs triton 3.6).

    python -m bench.kernel_build                  # resources of the rule's tiles and neighbours
    python -m bench.kernel_build --tiles 128/64/8/3,64/64/4/3 --page 16 --new-rows

Run without ``TRITON_INTERPRET`` (under it the kernels are interpreted functions, which build
no IR). The resources need ``cuobjdump`` (Triton's NVIDIA backend ships one).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import kvops.kernels.paged_prefill_attention as prefill_kernel


def prefill_signature(tma: bool, new_tma: bool) -> dict:
    """The prefill kernel's argument types for bf16 pools and D 128: tensor descriptors where
    ``tma`` (the pools) and ``new_tma`` (the new rows) say so."""
    desc = "tensordesc<bf16[64,128]>"
    sig = {}
    for n in prefill_kernel._paged_prefill_kernel.arg_names:
        if n in ("Q", "KC", "VC", "O", "Out", "KR", "VR"):
            sig[n] = "*bf16"
        elif n in ("BT", "QS", "SL", "Counts"):
            sig[n] = "*i32"
        elif n in ("LSE", "Lse"):
            sig[n] = "*fp32"
        elif n in ("KD", "VD"):
            sig[n] = desc if tma else "*bf16"
        elif n in ("KN", "VN"):
            sig[n] = desc if new_tma else "*bf16"
        elif n == "scale_log2":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    return sig


def prefill_constants(*, S=16, block_m=128, block_n=64, window=False, prefetch=True, tma=False,
                      new=False, new_tma=False, off64=False) -> dict:
    """The constexprs of Llama-3-8B's heads (Hkv 8, G 4, D 128) at one tile."""
    return dict(S=S, HKV=8, G=4, D=128, BLOCK_Q=block_m // 4, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_D=128, BLOCK_B=prefill_kernel.SEQ_CHUNK, WINDOW=window, PRECISION="tf32",
                PREFETCH=prefetch, FUSED_MERGE=False, BLOCK_S=1, TMA=tma, NEW=new,
                NEW_TMA=new_tma, OFF64=off64)


def _source(signature: dict, constants: dict):
    from triton.compiler import ASTSource

    fn = prefill_kernel._paged_prefill_kernel
    names = fn.arg_names
    sig = dict(signature, **dict.fromkeys(constants, "constexpr"))
    return ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constants.items()})


def _frontend(source, options: dict) -> None:
    """``source``'s frontend IR for ``sm_90`` under launch ``options`` (raises the compiler's
    error)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    opts = backend.parse_options(options)
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    source.make_ir(target, opts, backend.get_codegen_implementation(opts),
                   backend.get_module_map(), ctx)


def build_ir(signature: dict, constants: dict) -> None:
    """The Triton prefill kernel's frontend IR for ``sm_90`` (raises the compiler's error)."""
    _frontend(_source(signature, constants), {"num_warps": 4, "num_stages": 3})


def gluon_source(D: int = 128, dtype=None, S: int = 64):
    """The Gluon prefill kernel's source for Llama-3-8B's heads (32/8) at head dim ``D`` and
    pages of ``S`` tokens (the pool's boxes: ``box_rows``)."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource

    import kvops.kernels.paged_prefill_gluon as g

    dtype = dtype or torch.bfloat16
    ty = "bf16" if dtype == torch.bfloat16 else "fp16"

    def desc(rows):
        return f"tensordesc<{ty}[{rows},{D}],{g._layout(rows, D, dtype)!r}>"

    fn = g._paged_prefill_gluon_kernel
    sig = dict(q_desc=desc(int(g.HALF)), kp_desc=desc(g.box_rows(S)), vp_desc=desc(g.box_rows(S)),
               kn_desc=desc(int(g.BLOCK_N)), vn_desc=desc(int(g.BLOCK_N)),
               o_desc=desc(int(g.HALF)), out_ptr="*" + ty,
               lse_ptr="*fp32", BT="*i32", QS="*i32", SL="*i32")
    sig.update(dict.fromkeys(("N", "B", "P", "L", "S", "page_rows", "pool_rows", "num_tiles",
                              "stride_bt"), "i32"))
    sig.update(scale_log2="fp32", HQ="constexpr", G="constexpr")
    names = fn.arg_names
    return GluonASTSource(fn, sig, constexprs={(names.index("HQ"),): 32,
                                               (names.index("G"),): 4})


def build_gluon_ir(D: int = 128, dtype=None, S: int = 64) -> None:
    """The Gluon kernel's frontend IR for ``sm_90`` (raises the compiler's error)."""
    _frontend(gluon_source(D, dtype, S), {"num_warps": 4, "maxnreg": 168})


# an sm_90 SM (H100, H200): shared memory, of which each resident block reserves 1 KiB, and
# 32-bit registers, allocated a warp at a time in units of 256
SM_SHARED, BLOCK_RESERVED, SM_REGISTERS, REG_UNIT = 228 * 1024, 1024, 65536, 256


def programs_per_sm(shared: int, registers: int, num_warps: int) -> int:
    """How many programs of a kernel fit one sm_90 SM at once, by its shared memory and its
    registers (the smaller; the hardware's 32-block and 64-warp limits are not the bound at
    these sizes)."""
    by_shared = SM_SHARED // (shared + BLOCK_RESERVED)
    per_warp = -(-registers * 32 // REG_UNIT) * REG_UNIT
    return min(by_shared, SM_REGISTERS // (per_warp * num_warps))


def resources(signature: dict, constants: dict, num_warps: int, num_stages: int,
              source=None, options=None) -> dict:
    """Registers a thread and the stack it spills to, of the ``sm_90`` binary
    (``cuobjdump -res-usage``), its shared memory and the programs an SM holds at once
    (``source``, ``options``: another kernel's, the Gluon one's)."""
    import triton
    from triton.backends.compiler import GPUTarget

    compiled = triton.compile(source or _source(signature, constants),
                              target=GPUTarget("cuda", 90, 32),
                              options=options or {"num_warps": num_warps,
                                                  "num_stages": num_stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    fields = dict(tok.split(":") for line in out.splitlines() if "REG:" in line
                  for tok in line.split() if ":" in tok)
    regs, shared = int(fields["REG"]), int(compiled.metadata.shared)
    return {"registers": regs, "stack": int(fields["STACK"]), "shared": shared,
            "per_sm": programs_per_sm(shared, regs, num_warps)}


def main():
    import triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", default="128/64/8/3,128/64/8/2,128/32/8/3,128/64/4/3,64/64/4/3",
                    help="BLOCK_M/BLOCK_N/warps/stages, comma separated")
    ap.add_argument("--page", type=int, default=16, help="S; 64 or more takes pool descriptors")
    ap.add_argument("--new-rows", action="store_true", help="the chunk's own rows given")
    ap.add_argument("--off64", action="store_true", help="64-bit element offsets")
    ap.add_argument("--gluon", action="store_true",
                    help="the Gluon kernel's resources (D 64 and 128, bf16, at --page) instead")
    args = ap.parse_args()
    if args.gluon:
        print(f"triton {triton.__version__}, sm_90, the Gluon prefill kernel, Llama-3-8B heads, "
              f"bf16, S {args.page}; registers: the launch's cap (the partitions set their own)\n"
              "| D | registers | stack bytes | shared bytes | programs an SM |\n"
              "|---:|---:|---:|---:|---:|")
        for D in (64, 128):
            r = resources(None, None, 4, 0, gluon_source(D, S=args.page),
                          {"num_warps": 4, "maxnreg": 168})
            r["per_sm"] = programs_per_sm(r["shared"], r["registers"], 12)
            print(f"| {D} | {r['registers']} | {r['stack']} | {r['shared']} | {r['per_sm']} |")
        return
    tma = args.page >= prefill_kernel.TMA_MIN_PAGE
    print(f"triton {triton.__version__}, sm_90, Llama-3-8B heads, bf16, S {args.page}"
          f"{', pool descriptors' if tma else ''}"
          f"{', new rows through descriptors' if args.new_rows else ''}"
          f"{', 64-bit offsets' if args.off64 else ''}")
    print("| tile | prefetch | registers | stack bytes | shared bytes | programs an SM |\n"
          "|---|---|---:|---:|---:|---:|")
    for tile in args.tiles.split(","):
        bm, bn, warps, stages = (int(x) for x in tile.split("/"))
        for prefetch in (True, False):
            r = resources(prefill_signature(tma, args.new_rows),
                          prefill_constants(S=args.page, block_m=bm, block_n=bn, prefetch=prefetch,
                                            tma=tma, new=args.new_rows, new_tma=args.new_rows,
                                            off64=args.off64),
                          warps, stages)
            print(f"| {tile} | {prefetch} | {r['registers']} | {r['stack']} | {r['shared']} | "
                  f"{r['per_sm']} |", flush=True)


if __name__ == "__main__":
    main()
