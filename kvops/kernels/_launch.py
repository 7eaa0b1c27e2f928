"""Launching a compiled Triton kernel without the JIT's per-call Python dispatch.

``kernel[grid](*args, **meta)`` binds every argument, computes the specialization key (pointer
alignment, integer divisibility), looks the binary up and then launches it: tens of microseconds
of host time a launch for kernels with thirty arguments. A launcher here calls :func:`launch`
with a ``key`` that determines all of that (the shapes, strides, dtypes and pointer alignments
the arguments come from, and the launch constants): the first call with a key goes through the
JIT (compiling if needed) and keeps the compiled kernel; later calls hand the arguments straight
to its launcher.

Under the interpreter, when a launch hook is installed (profilers), when ``key`` is None, or
when ``KVOPS_DIRECT_LAUNCH=0``, every launch goes through the JIT. A kernel object that is not
a ``JITFunction`` (a test's spy) is always called through ``kernel[grid]``.
"""

from __future__ import annotations

import os

import torch
from triton.runtime.jit import JITFunction

from kvops._config import interpreting

_ENABLED = os.environ.get("KVOPS_DIRECT_LAUNCH", "1").strip() not in ("0", "false", "off")
_BINS: dict = {}           # (kernel, key) -> (compiled kernel, trailing constexpr values or None)
MAX_BINS = 4096


try:
    from triton import knobs as _knobs
    _RUNTIME = _knobs.runtime
    _ENTER, _EXIT = "launch_enter_hook", "launch_exit_hook"
except (ImportError, AttributeError):   # older triton keeps the hooks on CompiledKernel
    from triton.compiler.compiler import CompiledKernel as _RUNTIME
    _ENTER, _EXIT = "launch_enter_hook", "launch_exit_hook"


def _no_hooks() -> bool:
    """Whether no launch hook is installed (profilers install them): None, or an empty chain
    (triton 3.9 keeps a ``HookChain`` there)."""
    for name in (_ENTER, _EXIT):
        hook = getattr(_RUNTIME, name, None)
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def launch(kernel, grid: tuple, key, args: tuple, meta: dict) -> None:
    """Launch ``kernel[grid](*args, **meta)``; ``args`` are the kernel's leading runtime
    arguments in order, ``meta`` its remaining (constexpr) parameters and launch options.
    ``key`` must determine everything triton specializes on and ``meta`` itself (see the module
    doc): shapes, strides, dtypes, pointer alignments and the constants, or a token that a
    cached launch plan holding all of them owns."""
    if key is not None and _STATE["direct"] and type(kernel) is JITFunction:
        hit = _BINS.get((kernel, key))
        if hit is not None and _no_hooks():
            compiled, tail = hit
            g = grid + (1,) * (3 - len(grid))
            stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
            head = (g[0], g[1], g[2], stream, compiled.function,
                    getattr(compiled, "packed_metadata", None), None, None, None)
            mode = _STATE["tail"]
            if mode is True:
                compiled.run(*head, *args, *tail)
                return
            if mode is False:
                compiled.run(*head, *args)
                return
            for tail_mode, full in ((True, args + tail), (False, args)):
                try:       # a launcher that rejects its arguments launches nothing
                    compiled.run(*head, *full)
                except Exception:  # noqa: BLE001 - any refusal: try the other convention
                    continue
                _STATE["tail"] = tail_mode
                return
            _STATE["direct"] = False     # neither convention: this triton keeps the JIT path
    compiled = kernel[grid](*args, **meta)
    if key is None or type(kernel) is not JITFunction or not _STATE["direct"] or compiled is None:
        return
    names = kernel.arg_names[len(args):]
    if any(n not in meta for n in names):
        return                       # a parameter left to its default: keep the JIT path
    if len(_BINS) >= MAX_BINS:
        _BINS.clear()
    _BINS[(kernel, key)] = (compiled, tuple(meta[n] for n in names))


# "direct": compiled launches on; "tail": whether this triton's compiled launcher takes the
# constexpr values after the runtime arguments (triton 3.3 and newer filter them in the
# launcher) or not, found at the first direct launch (None until then)
_STATE = {"direct": _ENABLED and not interpreting(), "tail": None}
