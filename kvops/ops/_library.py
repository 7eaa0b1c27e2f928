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

from collections.abc import Callable

import torch

from kvops._checks import signature as sig  # noqa: F401  (re-exported for the ops)

LIB = torch.library.Library("kvops", "DEF")

# Checked argument signatures a cache keeps before it starts over (a serving process sees a
# handful of shapes; a sweep of many shapes only re-checks).
SIGNATURE_CACHE = 4096


def register(name: str, schema: str, impl: Callable, fake: Callable):
    """Define ``kvops::<name><schema>`` with ``impl`` for CPU and CUDA tensors and ``fake`` for
    fake and meta tensors; returns the op's default overload (what the public function calls)."""
    LIB.define(name + schema)
    LIB.impl(name, impl, "CPU")
    LIB.impl(name, impl, "CUDA")
    torch.library.register_fake(f"kvops::{name}", fake, lib=LIB)
    return getattr(torch.ops.kvops, name).default


class CheckedSignatures:
    """Argument signatures that passed an op's checks, so a repeated call re-checks nothing.

    A signature is everything the checks read: each tensor's shape, strides, dtype and device,
    and each non-tensor argument (or its type). Calling it with a signature and the arguments
    returns what the check returned for that signature. Index range checks (validation mode)
    read values and run on every call.
    """

    __slots__ = ("_seen", "_check")

    def __init__(self, check: Callable):
        self._seen: dict = {}
        self._check = check

    def __call__(self, key, *args):
        try:
            return self._seen[key]
        except KeyError:
            pass
        value = self._check(*args)
        if len(self._seen) >= SIGNATURE_CACHE:
            self._seen.clear()
        self._seen[key] = value
        return value
