"""The one way an op is registered: a ``torch.library`` schema, one implementation for CPU and
CUDA tensors, a fake (meta) implementation, and the public Python function.

Why not ``torch.library.custom_op``: its Python wrapper layers (autograd, dynamo-disable,
argument binding) cost about 65 us a call on the host, several times an SDPA call. Here an eager
call is the C++ dispatcher plus the implementation. The ops have no autograd formula (decode,
transport and pool maintenance are not differentiated); with inputs that require grad the
dispatcher's autograd fallback warns that backward is not implemented.

``torch.library.opcheck``, ``torch.compile(fullgraph=True)`` (the fake implementation gives the
output shapes; mutated arguments are functionalized from the schema's ``(a!)`` annotations) and
CUDA-graph capture work on the registered ops as on any aten op.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable

import torch

from kvops._checks import signature as sig

LIB = torch.library.Library("kvops", "DEF")
# The Python implementations' CUDA registrations live in a library of their own, so that the
# replay kernel (kvops/ops/_replay.py) can take their place and give it back.
CUDA_LIB = torch.library.Library("kvops", "IMPL", "CUDA")
IMPLS: dict[str, Callable] = {}     # op name -> its Python implementation

# Checked argument signatures a cache keeps before it starts over (a serving process sees a
# handful of shapes; a sweep of many shapes only re-checks).
SIGNATURE_CACHE = 4096


def register(name: str, schema: str, impl: Callable, fake: Callable):
    """Define ``kvops::<name><schema>`` with ``impl`` for CPU and CUDA tensors and ``fake`` for
    fake and meta tensors; returns the op's default overload (what the public function calls)."""
    if CUDA_LIB is None:
        raise RuntimeError(f"register({name!r}): ops are registered before the replay kernel "
                           "is installed (kvops/ops/_replay.py)")
    LIB.define(name + schema)
    LIB.impl(name, impl, "CPU")
    CUDA_LIB.impl(name, impl)
    IMPLS[name] = impl
    torch.library.register_fake(f"kvops::{name}", fake, lib=LIB)
    return getattr(torch.ops.kvops, name).default


def cuda_python(on: bool) -> None:
    """Register (``on``) or drop every op's Python implementation as its CUDA kernel."""
    global CUDA_LIB
    if on and CUDA_LIB is None:
        CUDA_LIB = torch.library.Library("kvops", "IMPL", "CUDA")
        for name, impl in IMPLS.items():
            CUDA_LIB.impl(name, impl)
    elif not on and CUDA_LIB is not None:
        CUDA_LIB._destroy()
        CUDA_LIB = None


def _picker(positions: tuple):
    """A function returning the tuple of its argument tuple's items at ``positions``."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    if positions:
        i = positions[0]
        return lambda args: (args[i],)
    return lambda args: ()


def _guards(tensors: tuple):
    """A C++ check that tensors match ``tensors`` in type, dispatch keys, dtype, device, shape,
    strides and requires_grad (``TensorGuards``, what ``torch.compile``'s guards run), or None
    where this torch has none of that form."""
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors])
    except Exception:  # noqa: BLE001 - another torch's form: the op keeps its hashed path
        return None


try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:        # pragma: no cover - every supported torch has it
    _TensorGuards = None

_NEXT_KEY = itertools.count()   # keys name signatures for the life of the process
_data_ptr = torch.Tensor.data_ptr


class CheckedSignatures:
    """Argument signatures that passed an op's checks, so a repeated call re-checks nothing.

    Calling it with the op's arguments (in its check function's order) runs the check the
    first time their signature is seen and returns ``(key, value)``: ``key`` an int naming the
    signature (one per signature for the life of the process, so launchers keep their plans by
    it and hash nothing larger) and ``value`` what the check returned. A signature is everything
    the checks and the kernels' specializations read: each tensor's shape, strides, dtype,
    device and whether its data is 16-byte aligned (``kvops._checks.signature``), and each other
    argument. Index range checks (validation mode) read values and run on every call.

    A call whose arguments match one of the two most recent signatures is recognized without
    computing one: its tensors go through one C++ check (``_guards``; about 0.1 us a tensor
    against 0.45 for a signature tuple on the CPU machines), their data pointers' alignment and
    the other arguments are compared. Every layer of a decode step calls an op with the same
    signature; an engine that writes the pool and then a transport arena alternates two. A
    signature's check is made once, when it is first seen with all its tensors 16-byte aligned
    (a call with an unaligned tensor is always signed in full).
    """

    __slots__ = ("_seen", "_check", "_last", "_prev")

    def __init__(self, check: Callable):
        self._seen: dict = {}
        self._check = check
        self._last = self._prev = None

    def __call__(self, *args):
        last = self._last
        if last is not None:
            if _matches(last, args):
                return last[4]
            prev = self._prev
            if prev is not None and _matches(prev, args):
                self._last, self._prev = prev, last
                return prev[4]
        return self._sign(args)

    def _sign(self, args):
        full = tuple(sig(a) if isinstance(a, torch.Tensor) else a for a in args)
        hit = self._seen.get(full)
        if hit is None:
            hit = [(next(_NEXT_KEY), self._check(*args)), None]
            if len(self._seen) >= SIGNATURE_CACHE:
                self._seen.clear()
            self._seen[full] = hit
        found, entry = hit
        if entry is None:         # False: this signature has no quick check
            entry = hit[1] = _entry(args, found) or False
        if entry and entry is not self._last:
            self._last, self._prev = entry, self._last
        return found


def _entry(args: tuple, found: tuple):
    """The quick check of the signature of ``args`` (all its tensors 16-byte aligned), or None
    where they are not or this torch has no ``TensorGuards``: (guards, the tensors' picker,
    the other arguments' picker, those arguments, ``found``)."""
    at = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    tensors = tuple(args[i] for i in at)
    if (not tensors or _TensorGuards is None
            or functools.reduce(operator.or_, map(_data_ptr, tensors)) & 15):
        return None
    guards = _guards(tensors)
    if guards is None:
        return None
    others_of = _picker(tuple(i for i in range(len(args)) if i not in at))
    return guards, _picker(at), others_of, others_of(args), found


def _matches(entry: tuple, args: tuple) -> bool:
    guards, tensors_of, others_of, others, _ = entry
    if others_of(args) != others:
        return False
    tensors = tensors_of(args)
    return guards.check(*tensors) and not functools.reduce(operator.or_,
                                                           map(_data_ptr, tensors)) & 15
