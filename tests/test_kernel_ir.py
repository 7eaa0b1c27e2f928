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

# (TMA, NEW, NEW_TMA, WINDOW, OFF64) of the paged prefill kernel: page tiles gathered or through
# pool descriptors, with or without the chunk's own rows, those by pointers or descriptors,
# 32- or 64-bit element offsets
PREFILL_PATHS = [c for c in itertools.product([False, True], repeat=5) if c[1] or not c[2]]
# (D, dtype, S) of the Gluon prefill kernel (``prefill_gluon``'s head dims and dtypes; pages
# of 64 take two boxes a key tile, of 16 eight)
GLUON_PATHS = [(64, "bfloat16", 64), (128, "bfloat16", 64), (128, "float16", 64),
               (128, "bfloat16", 16), (64, "bfloat16", 32)]


def build_all() -> dict:
    """``{path: None or the error}`` for every prefill path (run without TRITON_INTERPRET)."""
    from bench.kernel_build import build_ir, prefill_constants, prefill_signature

    got = {}
    for path in PREFILL_PATHS:
        tma, new, new_tma, window, off64 = path
        constants = prefill_constants(S=64 if tma else 16, block_m=64, window=window, tma=tma,
                                      new=new, new_tma=new_tma, off64=off64)
        try:
            build_ir(prefill_signature(tma, new_tma), constants)
            got[str(path)] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
            got[str(path)] = f"{type(exc).__name__}: {exc}"[:2000]
    import torch

    from bench.kernel_build import build_gluon_ir
    from kvops.kernels.paged_prefill_gluon import HAVE_GLUON
    for D, dtype, S in GLUON_PATHS:
        name = f"gluon{D}{dtype}S{S}"
        if not HAVE_GLUON:
            got[name] = "ImportError: no Gluon Hopper ops in this triton"
            continue
        try:
            build_gluon_ir(D, getattr(torch, dtype), S)
            got[name] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
            got[name] = f"{type(exc).__name__}: {exc}"[:2000]
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
                         ids=lambda p: "tma{}-new{}-newtma{}-win{}-off64{}".format(*map(int, p)))
def test_paged_prefill_builds_for_hopper(built, path):
    err = built[str(path)]
    if err is not None and err.startswith(("ImportError", "ModuleNotFoundError")):
        pytest.skip(f"this triton builds IR another way: {err[:200]}")
    assert err is None, err


@pytest.mark.parametrize("D,dtype,S", GLUON_PATHS, ids=lambda x: str(x))
def test_gluon_prefill_builds_for_hopper(built, D, dtype, S):
    """The Gluon kernel's frontend on this triton: its Hopper ops' names and signatures move
    between triton versions (3.9 renamed the TMA load), and only an sm_90 GPU runs it."""
    err = built[f"gluon{D}{dtype}S{S}"]
    if err is not None and err.startswith(("ImportError", "ModuleNotFoundError")):
        pytest.skip(f"this triton builds IR another way: {err[:200]}")
    assert err is None, err


@pytest.mark.parametrize("shared,registers,warps,want", [
    (115712, 255, 4, 2),     # the 64-row descriptor tile at pages of 64 (triton 3.6): two, exactly
    (132096, 255, 8, 1),     # 128/64/8/3 with descriptors: shared memory holds one
    (49152, 255, 8, 1),      # 128/64/8/3 gathered: shared memory holds four, registers one
    (16384, 64, 4, 8),       # a small kernel: registers bind at eight
    (116800, 128, 4, 1),     # 64 bytes past two programs' shared memory
])
def test_programs_per_sm_table(shared, registers, warps, want):
    from bench.kernel_build import programs_per_sm

    assert programs_per_sm(shared, registers, warps) == want
