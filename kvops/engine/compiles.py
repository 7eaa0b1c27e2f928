"""Triton kernels compiled into the process while a replay runs: the recompiles the issue asks
to count after warm-up, beside the CUDA-graph re-captures.

Triton compiles a kernel once per specialization (its constexprs, the dtypes of its tensors,
and which integer and pointer arguments are 1 or multiples of 16), the first time a launch
meets it in a process. That first launch costs from tens of milliseconds (the binary read from
Triton's disk cache) to seconds (compiled), on the step that meets it: a configuration whose
warm-up missed a specialization pays it inside its measured replay, and so does whichever
configuration a replay runs first. :class:`TritonCompiles` counts those events through
Triton's ``jit_post_compile_hook`` (chaining a hook already set) with the kernel's name; under
the interpreter (``TRITON_INTERPRET=1``) and without Triton nothing compiles and the count is 0.
"""

from __future__ import annotations

from collections import Counter


def _runtime_knobs():
    try:
        import triton
    except ImportError:
        return None
    return getattr(getattr(triton, "knobs", None), "runtime", None)


class TritonCompiles:
    """Context manager: ``count`` and ``names`` (a Counter of kernel names) of the Triton
    compiles while it is active; the hook it found is called through and put back on exit."""

    def __init__(self):
        self.names: Counter = Counter()
        self._knobs = _runtime_knobs()
        self._prev = None

    @property
    def count(self) -> int:
        return sum(self.names.values())

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        self.names[(getattr(fn, "name", None) or "?").rsplit(".", 1)[-1]] += 1
        if self._prev is not None:
            return self._prev(*args, **kwargs)
        return None

    def __enter__(self) -> TritonCompiles:
        if self._knobs is not None and hasattr(self._knobs, "jit_post_compile_hook"):
            self._prev = self._knobs.jit_post_compile_hook
            self._knobs.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None and hasattr(self._knobs, "jit_post_compile_hook"):
            self._knobs.jit_post_compile_hook = self._prev
        self._prev = None
