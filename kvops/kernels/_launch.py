"""Launching a compiled Triton kernel without the JIT's per-call Python dispatch.

``kernel[grid](*args, **meta)`` binds every argument, computes the specialization key (pointer
alignment, integer divisibility), looks the binary up and then launches it: tens of microseconds
of host time a launch for kernels with thirty arguments. A launcher here calls :func:`launch`
with a ``key`` that determines all of that (the shapes, strides, dtypes and pointer alignments
the arguments come from, and the launch constants): the first call with a key goes through the
JIT (compiling if needed) and keeps the compiled kernel; later calls hand the arguments straight
to its launcher, on triton 3.6 to the launcher's C entry point (``_conventions``): a launch then
costs 7.3 us of host time on the H200's host, against 12.3 through the compiled launcher's
Python wrapper (``bench/results/2026-12-03-1730-eager-parts.md``).

A launch plan holds its launches as :class:`Launch` objects (kernel, grid, key, trailing
integers, constants): after the first direct launch a call hands its arguments straight to the
C entry point, without the key lookup. A kernel whose first parameters are tensor descriptors
(the Gluon prefill's) is held as a :class:`DescribedLaunch`, which also keeps the descriptors'
encodings by address instead of having triton's launcher encode them on every call.

While a thread records (:func:`recording`, what kvops/ops/_replay.py runs an op's first calls
under), every launch it makes is noted: a launch through the C entry point as ``(compiled
kernel, grid, parameters, descriptor metadata or None)``, any other as None (a launch the
record cannot replay).

Under the interpreter, when a launch hook is installed (profilers), when ``key`` is None, or
when ``KVOPS_DIRECT_LAUNCH=0``, every launch goes through the JIT. A kernel object that is not
a ``JITFunction`` (Gluon's is one too; a test's spy is not) is always called through
``kernel[grid]``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch
from triton.runtime.jit import JITFunction

from kvops._config import interpreting

_ENABLED = os.environ.get("KVOPS_DIRECT_LAUNCH", "1").strip() not in ("0", "false", "off")
# (id(kernel), key) -> (compiled kernel, constexpr values, convention or None, kernel, the "c"
# convention's fixed arguments after the stream or None): the entry holds the kernel, so no
# other object takes its id while the entry lives
_BINS: dict = {}
MAX_BINS = 4096
MAX_PLANS = 4096   # launch plans a launcher keeps (a serving process sees a handful of shapes)


try:
    from triton import knobs as _knobs
    _RUNTIME = _knobs.runtime
except (ImportError, AttributeError):   # older triton keeps the hooks on CompiledKernel
    from triton.compiler.compiler import CompiledKernel as _RUNTIME


def _no_hooks() -> bool:
    """Whether no launch hook is installed (profilers install them): None, or an empty chain
    (triton 3.6 and newer keep a ``HookChain`` there)."""
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    return ((enter is None or not getattr(enter, "calls", True))
            and (leave is None or not getattr(leave, "calls", True)))


def keep_plan(plans: dict, key, plan):
    """Keep ``plan`` under ``key`` in a launcher's plan cache (starting over past
    ``MAX_PLANS``) and return it."""
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan
    return plan


def _conventions(compiled):
    """The ways of calling ``compiled``'s launcher, cheapest first. ``"c"``: the launcher's C
    entry point itself (triton 3.6's ``CudaLauncher.launch``, called as its ``__call__`` calls it
    with no scratch buffers; only for kernels that need none), skipping the Python wrapper's
    scratch allocation; ``"tail"``: the wrapper with the constexpr values after the runtime
    arguments (triton 3.3 and newer filter them in the launcher); ``"plain"``: the wrapper
    without them."""
    run = compiled.run
    c_ok = (callable(getattr(run, "launch", None))
            and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")
            and hasattr(compiled, "packed_metadata"))
    return ("c", "tail", "plain") if c_ok else ("tail", "plain")


def _c_entry(compiled) -> tuple:
    """How a launch of ``compiled`` calls the C entry point: ``(entry, after)``, called as
    ``entry(*grid, stream, *after, *arguments)`` with a three-dimensional grid, where ``after``
    is the function handle, the cooperative-grid and PDL flags, no scratch buffers, the packed
    metadata, and no launch metadata or hooks."""
    run = compiled.run
    return run.launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                        None, None, compiled.packed_metadata, None, None, None)


def _probed(kernel, key):
    """The kept binary of ``kernel`` under ``key`` once :func:`launch` found how to call it
    (its mode a convention, or "jit"), else None."""
    hit = _BINS.get((id(kernel), key)) if key is not None else None
    return hit if hit is not None and hit[2] is not None else None


_PAD = {1: (1, 1), 2: (1,), 3: ()}     # a grid's missing dimensions
_data_ptr = torch.Tensor.data_ptr


_REC = threading.local()     # .launches: the list the recording thread notes into
_RECORDING = 0               # threads inside recording() (a launch reads it to skip noting)
_RECORDING_LOCK = threading.Lock()


@contextlib.contextmanager
def recording():
    """Note every launch this thread makes inside the block into the list it yields (see the
    module doc); blocks nest, an inner one noting into its own list only."""
    global _RECORDING
    outer = getattr(_REC, "launches", None)
    notes: list = []
    _REC.launches = notes
    with _RECORDING_LOCK:     # += on a global is no atomic step: a lost count drops notes
        _RECORDING += 1
    try:
        yield notes
    finally:
        with _RECORDING_LOCK:
            _RECORDING -= 1
        _REC.launches = outer


def _note(compiled=None, g=None, params=None, descs=None) -> None:
    """Note a launch for this thread's :func:`recording`, if any: no ``compiled`` for a launch
    not made through the C entry point; ``descs``: the metadata of the tensor descriptors
    leading ``params`` (a kernel with descriptor parameters)."""
    notes = getattr(_REC, "launches", None)
    if notes is not None:
        notes.append(None if compiled is None else (compiled, g, params, descs))


def _jit(kernel, grid, args, meta):
    """``kernel[grid](*args, **meta)`` through triton's JIT (a launch a record cannot replay);
    returns what the JIT returns (the compiled kernel)."""
    compiled = kernel[grid](*args, **meta)
    if _RECORDING:
        _note()
    return compiled


def _call(mode, compiled, g, stream, args, tail, after=None):
    """Launch ``compiled`` by convention ``mode``; ``after``: the "c" form's fixed arguments
    after the stream (``_c_entry``; given with that form), as the binary's ``_BINS`` entry
    keeps them, so a call does not build them again."""
    packed = getattr(compiled, "packed_metadata", None)
    if mode == "c":
        compiled.run.launch(*g, stream, *after, *args, *tail)
        if _RECORDING:
            _note(compiled, g, (*args, *tail))
        return
    if _RECORDING:
        _note()
    if mode == "tail":
        compiled.run(g[0], g[1], g[2], stream, compiled.function, packed, None, None, None,
                     *args, *tail)
    else:
        compiled.run(g[0], g[1], g[2], stream, compiled.function, packed, None, None, None,
                     *args)


def launch(kernel, grid: tuple, key, args: tuple, meta: dict) -> None:
    """Launch ``kernel[grid](*args, **meta)``; ``args`` are the kernel's leading runtime
    arguments in order, ``meta`` its remaining (constexpr) parameters and launch options.
    ``key`` must determine everything triton specializes on and ``meta`` itself (see the module
    doc): shapes, strides, dtypes, pointer alignments and the constants, or a token that a
    cached launch plan holding all of them owns."""
    if key is not None and _STATE["direct"]:
        hit = _BINS.get((id(kernel), key))   # id: a JITFunction hashes in Python
        if hit is not None and _no_hooks():
            g = grid + _PAD[len(grid)]
            stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
            compiled, tail, mode, _, after = hit
            if mode == "jit":      # no convention took this binary's arguments
                _jit(kernel, grid, args, meta)
                return
            if mode is not None:
                _call(mode, compiled, g, stream, args, tail, after)
                return
            for candidate in _conventions(compiled):
                after = _c_entry(compiled)[1] if candidate == "c" else None
                try:       # a launcher that rejects its arguments launches nothing
                    _call(candidate, compiled, g, stream, args, tail, after)
                except Exception:  # noqa: BLE001 - any refusal: try the next convention
                    continue
                _BINS[(id(kernel), key)] = (compiled, tail, candidate, kernel, after)
                _STATE["mode"] = candidate
                return
            # no convention takes this binary's arguments (descriptor arguments on a triton
            # whose C entry does not expand them, say): it keeps the JIT path, the rest do not
            _BINS[(id(kernel), key)] = (compiled, tail, "jit", kernel, None)
            _jit(kernel, grid, args, meta)
            return
    compiled = _jit(kernel, grid, args, meta)
    if (key is None or not isinstance(kernel, JITFunction) or not _STATE["direct"]
            or compiled is None):
        return
    names = kernel.arg_names[len(args):]
    if any(n not in meta for n in names):
        return                       # a parameter left to its default: keep the JIT path
    if len(_BINS) >= MAX_BINS:
        _BINS.clear()
    _BINS[(id(kernel), key)] = (compiled, tuple(meta[n] for n in names), None, kernel, None)


class Launch:
    """One launch whose kernel, grid, binary key, trailing integers and constants are fixed
    (what a launch plan holds). Calling it with the leading runtime arguments launches
    ``kernel[grid](*args, *ints, **meta)`` through :func:`launch`; once the compiled kernel
    took its arguments directly, straight through its launcher (its C entry point on triton
    3.6), with no key lookup, grid padding or argument tuple made in Python (1.4 us of host time
    a call less on the CPU machines, where Python runs about twice as fast as on the GPU
    machines' hosts)."""

    __slots__ = ("kernel", "grid", "key", "ints", "meta", "_c")

    def __init__(self, kernel, grid: tuple, key, ints: tuple, meta: dict):
        self.kernel, self.grid, self.key, self.ints, self.meta = kernel, grid, key, ints, meta
        self._c = None

    def __call__(self, *args):
        c = self._c
        if c is not None and _STATE["direct"] and _no_hooks():
            stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
            if c[0] is not None:     # the C entry point (``_c_entry``)
                c[0](*c[1], stream, *c[2], *args, *c[3])
                if _RECORDING:
                    _note(c[4], c[1], (*args, *c[3]))
            else:                    # the launcher's Python wrapper
                _call(c[1], c[2], c[3], stream, (*args, *self.ints), c[4])
            return
        launch(self.kernel, self.grid, self.key, (*args, *self.ints), self.meta)
        hit = _probed(self.kernel, self.key)
        if hit is None or hit[2] == "jit":
            return                   # not yet probed, or the JIT's alone
        compiled, tail, mode = hit[:3]
        g = self.grid + _PAD[len(self.grid)]
        # the compiled kernel rides along: it owns the module its function handle lives in
        if mode == "c":
            entry, after = _c_entry(compiled)
            self._c = (entry, g, after, (*self.ints, *tail), compiled)
        else:
            self._c = (None, mode, compiled, g, tail)


MAX_DESCRIPTORS = 256     # encoded descriptors a DescribedLaunch keeps a position (a layer's
                          # pools, the activations' recurring addresses), and combinations of
                          # addresses it keeps whole
_BASE_ARGS = 13           # the C entry's arguments before the kernel's (grid, stream, ...)


def _descriptor_entry(compiled, count: int):
    """``(C entry, per-descriptor metadata, expansion)`` of a compiled kernel whose first
    ``count`` parameters are tensor descriptors and whose C-convention launcher expands them in
    Python on every call (triton 3.6's ``wrap_handle_tensordesc``: the C entry sits in its
    closure, ``make_tensordesc_arg(desc, metadata)`` encodes one); None for another form."""
    wrapper = compiled.run.launch
    code, cells = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or not cells:
        return None
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    driver = sys.modules.get(getattr(wrapper, "__module__", None) or "")
    expand = getattr(driver, "make_tensordesc_arg", None)
    if (set(free) != {"launcher", "tensordesc_indices", "tensordesc_meta"}
            or free["tensordesc_indices"] != set(range(count)) or not callable(free["launcher"])
            or not free["tensordesc_meta"] or len(free["tensordesc_meta"]) != count
            or None in free["tensordesc_meta"]
            or getattr(getattr(expand, "__code__", None), "co_argcount", 0) != 2
            or getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) != _BASE_ARGS):
        return None
    return free["launcher"], tuple(free["tensordesc_meta"]), expand


class DescribedLaunch(Launch):
    """A :class:`Launch` of a kernel whose first parameters are tensor descriptors. A call
    passes the tensor each one describes; the launch holds, for each position, ``(describe,
    box, layout)`` (``describe(tensor)`` gives the ``(shape, strides)`` the descriptor views it
    as) and ``make(tensor, shape, strides, box, layout)``, which builds the descriptor object
    the JIT takes.

    A launch plan fixes its tensors' shapes and strides (it is kept per argument signature), so
    between its calls only the descriptors' addresses change. Triton's compiled launcher encodes
    every descriptor again on every call (a Python expansion and ``cuTensorMapEncodeTiled``
    each). Once the compiled kernel took its arguments through the C entry, this launch
    encodes a descriptor only for an address it has not seen at that position (the box,
    element type and swizzle are the binary's), keeps the encoding, and hands the encodings
    with the other arguments straight to the C entry. An encoding holds no reference to the
    tensor: it is the same bytes whenever that memory has that shape again."""

    __slots__ = ("descs", "make", "_maps", "_flat")

    def __init__(self, kernel, grid: tuple, key, ints: tuple, meta: dict, descs: tuple, make):
        super().__init__(kernel, grid, key, ints, meta)   # _c: None until probed, then the
        self.descs, self.make = descs, make   # C entry's call, or False where there is none
        self._maps = tuple({} for _ in descs)   # a position's encodings by address
        self._flat: dict = {}     # every position's encodings by the tuple of addresses

    def _made(self, i: int, t: torch.Tensor):
        describe, box, layout = self.descs[i]
        return self.make(t, *describe(t), box, layout)

    def _encoded(self, c: tuple, bases: tuple, ptrs: tuple) -> tuple:
        """The C entry's arguments for the descriptors of ``bases`` (at addresses ``ptrs``):
        each position's kept encoding, made where that position has not seen its address."""
        flat = []
        for i, (t, ptr) in enumerate(zip(bases, ptrs)):
            maps = self._maps[i]
            m = maps.get(ptr)
            if m is None:
                if len(maps) >= MAX_DESCRIPTORS:
                    maps.clear()
                m = maps[ptr] = tuple(c[4](self._made(i, t), c[3][i]))
            flat += m
        if len(self._flat) >= MAX_DESCRIPTORS:
            self._flat.clear()
        flat = self._flat[ptrs] = tuple(flat)
        return flat

    def __call__(self, bases: tuple, *args):
        c = self._c
        if c and _STATE["direct"] and _no_hooks():
            # a call whose addresses all recur (a layer's pools, the activations' few
            # addresses) is one lookup
            ptrs = tuple(map(_data_ptr, bases))
            flat = self._flat.get(ptrs)
            if flat is None:
                flat = self._encoded(c, bases, ptrs)
            stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
            try:
                c[0](*c[1], stream, *c[2], *flat, *args, *c[5])
            except (TypeError, ValueError, OverflowError):   # arguments refused, nothing
                self._c = c = False                            # launched: the wrapper's way
            else:
                if _RECORDING:   # the descriptors as the JIT takes them, and their
                    # metadata (the replay kernel encodes them as triton's launcher does)
                    made = tuple(self._made(i, t) for i, t in enumerate(bases))
                    _note(c[6], c[1], (*made, *args, *c[5]), c[3])
                return
        made = tuple(self._made(i, t) for i, t in enumerate(bases))
        launch(self.kernel, self.grid, self.key, (*made, *args, *self.ints), self.meta)
        if c is not None:            # False: the launcher's form is not 3.6's; it encodes
            return
        hit = _probed(self.kernel, self.key)
        if hit is None:
            return                   # not yet probed
        compiled, tail, mode = hit[:3]
        entry = _descriptor_entry(compiled, len(self.descs)) if mode == "c" else None
        if entry is None:
            self._c = False
            return
        raw, metas, expand = entry
        g, after = self.grid + _PAD[len(self.grid)], _c_entry(compiled)[1]
        # the C entry under triton's wrapper; the compiled kernel rides along: it owns the
        # module its function handle lives in
        self._c = (raw, g, after, metas, expand, (*self.ints, *tail), compiled)


# "direct": compiled launches on; "mode": the convention the last first direct launch found
# (``_conventions``; None until a direct launch ran), for tests and benches to read
_STATE = {"direct": _ENABLED and not interpreting(), "mode": None}
