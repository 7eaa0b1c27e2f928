"""Kernels built to Triton IR for an NVIDIA Hopper target on the CPU, no GPU needed.

Triton's interpreter, which runs the kernel tests on a CPU, passes a tensor descriptor as a
tensor: code that adds offsets to one, or other code the compiler's frontend refuses, passes
there and fails to compile on a GPU. This builds each load path's IR (the frontend, where such
code fails) for ``sm_90`` in a process without ``TRITON_INTERPRET`` (under it the kernels are
interpreted functions, which build no IR), so CI sees it.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

# (TMA, NEW, NEW_TMA, WINDOW) of the paged prefill kernel: page tiles gathered or through pool
# descriptors, with or without the chunk's own rows, those by pointers or descriptors
PREFILL_PATHS = [c for c in itertools.product([False, True], repeat=4) if c[1] or not c[2]]


def _build_ir(fn, signature: dict, constants: dict) -> None:
    """The frontend's IR of ``fn`` for ``sm_90`` (raises the compiler's error)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    names = fn.arg_names
    sig = dict(signature, **dict.fromkeys(constants, "constexpr"))
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constants.items()})
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": 4, "num_stages": 3})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    src.make_ir(target, options, backend.get_codegen_implementation(options),
                backend.get_module_map(), ctx)


def _prefill_signature(kernel, tma: bool, new_tma: bool) -> dict:
    desc = "tensordesc<bf16[64,128]>"
    sig = {}
    for n in kernel.arg_names:
        if n in ("Q", "KC", "VC", "O", "Out"):
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


def build_all() -> dict:
    """``{path: None or the error}`` for every prefill path (run without TRITON_INTERPRET)."""
    import kvops.kernels.paged_prefill_attention as pk

    kernel = pk._paged_prefill_kernel
    got = {}
    for tma, new, new_tma, window in PREFILL_PATHS:
        constants = dict(S=64 if tma else 16, HKV=8, G=4, D=128, BLOCK_Q=16, BLOCK_M=64,
                         BLOCK_N=64, BLOCK_D=128, BLOCK_B=pk.SEQ_CHUNK, WINDOW=window,
                         PRECISION="tf32", PREFETCH=True, FUSED_MERGE=False, BLOCK_S=1, TMA=tma,
                         NEW=new, NEW_TMA=new_tma)
        try:
            _build_ir(kernel, _prefill_signature(kernel, tma, new_tma), constants)
            got[str((tma, new, new_tma, window))] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
            got[str((tma, new, new_tma, window))] = f"{type(exc).__name__}: {exc}"[:2000]
    return got


@pytest.fixture(scope="module")
def built() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
            "from tests.test_kernel_ir import build_all; print(json.dumps(build_all()))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code, root], env=env, capture_output=True,
                         text=True, timeout=600)
    if run.returncode:
        pytest.fail(f"the IR build process failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", PREFILL_PATHS,
                         ids=lambda p: "tma{}-new{}-newtma{}-win{}".format(*map(int, p)))
def test_paged_prefill_builds_for_hopper(built, path):
    err = built[str(path)]
    if err is not None and err.startswith(("ImportError", "ModuleNotFoundError")):
        pytest.skip(f"this triton builds IR another way: {err[:200]}")
    assert err is None, err
