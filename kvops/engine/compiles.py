"""Triton kernels compiled into the process while a replay runs: the recompiles the issue asks
to count after warm-up, beside the CUDA-graph re-captures.

Triton compiles a kernel once per specialization (its constexprs, the dtypes of its tensors,
which integer and pointer arguments are 1 or multiples of 16, the launch options), the first
time a launch meets it in a process. That first launch costs from tens of milliseconds (the
binary read from Triton's disk cache) to seconds (compiled), on the step that meets it: a
configuration whose warm-up missed a specialization pays it inside its measured replay, and so
does whichever configuration a replay runs first. :class:`TritonCompiles` counts those events
through Triton's ``jit_post_compile_hook`` (chaining a hook already set) with the kernel's name.

Under the interpreter (``TRITON_INTERPRET=1``) nothing compiles, so it counts what would: each
launch's specialization key is computed as the JIT computes it (Triton's own
``native_specialize_impl`` where this Triton has it, the same rules in Python otherwise; the
constexpr values and launch options beside it), and a key first met in the process counts as a
compile. A CPU run then shows whether a warm-up covers the kernels a replay launches, with the
launch rules' CPU answers (the interpreter reports 4 SMs). Without Triton the count is 0.
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter

from kvops._config import interpreting

# interpreter: every specialization met in this process since the first TritonCompiles (as a
# JIT's in-memory cache holds them) and the counters of those now active; the interpreter's
# own launch and the specialization rules, once the counting launch is installed (it stays
# installed: a warm-up's launches outside any counter are met all the same)
_MET: set = set()
_ACTIVE: list = []
_RUN = _RULES = None


def _runtime_knobs():
    try:
        import triton
    except ImportError:
        return None
    return getattr(getattr(triton, "knobs", None), "runtime", None)


def _specialize_impl():
    """Triton's own specialization of one argument, ``(arg, specialize) -> key part``, or the
    same rules in Python where this Triton does not export it: tensors by dtype and 16-byte
    alignment, integers by width and whether they are 1 (a constant) or multiples of 16, floats
    and bools by type alone."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        native_specialize_impl = None
    if native_specialize_impl is None:
        return _python_rules

    def triton_rules(arg, spec):
        try:
            return native_specialize_impl(BaseBackend, arg, False, spec, spec)
        except TypeError:       # a type the interpreter takes and the JIT's rules do not
            return _python_rules(arg, spec)
    return triton_rules


def _python_rules(arg, spec):
    """Triton's specialization rules for one argument, for a Triton that does not export them."""
    if arg is None:
        return ("constexpr", None)
    if isinstance(arg, bool):
        return ("u1", None)
    if isinstance(arg, int):
        if spec and arg == 1:
            return ("constexpr", 1)
        width = "i32" if -2**31 <= arg < 2**31 else "i64"
        return (width, "D" if spec and arg % 16 == 0 else "")
    if isinstance(arg, float):
        return ("fp32", None)
    if hasattr(arg, "data_ptr"):
        return (str(arg.dtype), "D" if spec and arg.data_ptr() % 16 == 0 else "")
    return (type(arg).__name__, None)


def _hashable(value):
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


@functools.lru_cache(maxsize=1024)
def _parameters(fn):
    return inspect.signature(fn).parameters


def interpreter_key(fn, args: tuple, kwargs: dict, do_not_specialize=(), specialize=None):
    """The specialization key the JIT would compile a launch of Python function ``fn`` with
    ``args`` and ``kwargs`` under: its name and where it is defined, each parameter's part, the
    launch options."""
    specialize = specialize or _specialize_impl()
    params = _parameters(fn)
    bound = dict(zip(params, args))
    bound.update((k, v) for k, v in kwargs.items() if k in params)
    parts = []
    for i, (name, p) in enumerate(params.items()):
        value = bound.get(name, p.default)
        if "constexpr" in str(p.annotation):
            parts.append(("constexpr", _hashable(value)))
        else:
            spec = name not in do_not_specialize and i not in do_not_specialize
            parts.append(specialize(value, spec))
    options = tuple(sorted((k, _hashable(v)) for k, v in kwargs.items() if k not in params))
    code = fn.__code__
    return (fn.__name__, (code.co_filename, code.co_firstlineno), tuple(parts), options)


def _counted_run(fn_self, *args, grid, warmup, **kwargs):
    """The interpreter's launch, counting a specialization first met in every active counter."""
    key = interpreter_key(fn_self.fn, args, kwargs,
                          fn_self.kwargs.get("do_not_specialize") or (), _RULES)
    out = _RUN(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
    if key not in _MET:                 # counted once it ran (a launch that raised compiled nothing)
        _MET.add(key)
        for names in _ACTIVE:
            names[key[0]] += 1
    return out


def _interpreter_present() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction  # noqa: F401
    except ImportError:
        return False
    return True


def _install() -> None:
    global _RUN, _RULES
    from triton.runtime.interpreter import InterpretedFunction

    if _RUN is None:
        _RUN, _RULES = InterpretedFunction.run, _specialize_impl()
        InterpretedFunction.run = _counted_run


class TritonCompiles:
    """Context manager: ``count`` and ``names`` (a Counter of kernel names) of the Triton
    compiles while it is active (under the interpreter, of the specializations first met in the
    process); the compile hook it found is called through and put back on exit."""

    def __init__(self):
        self.names: Counter = Counter()
        self._knobs = _runtime_knobs()
        self._prev = None
        self._interpreted = False

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
        if interpreting() and _interpreter_present():
            _install()
            _ACTIVE.append(self.names)
            self._interpreted = True
        elif self._knobs is not None and hasattr(self._knobs, "jit_post_compile_hook"):
            self._prev = self._knobs.jit_post_compile_hook
            self._knobs.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        if self._interpreted:
            del _ACTIVE[next(i for i, n in enumerate(_ACTIVE) if n is self.names)]
            self._interpreted = False
        elif self._knobs is not None and hasattr(self._knobs, "jit_post_compile_hook"):
            self._knobs.jit_post_compile_hook = self._prev
        self._prev = None
