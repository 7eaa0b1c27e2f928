"""Process-wide settings: which implementation runs on CPU tensors, and validation mode.

Both start from the environment read at import (``KVOPS_BACKEND``, ``KVOPS_VALIDATE``) and can be
changed later with :func:`kvops.backend` and :func:`kvops.validate`, each of which also works as a
context manager that restores the previous value.

Backends:
- ``"auto"`` (default): CUDA tensors run the Triton kernels, CPU tensors the PyTorch reference.
- ``"triton"``: CPU tensors run the Triton kernels too, through the interpreter; this needs
  ``TRITON_INTERPRET=1`` in the environment before triton is imported.
- ``"torch"``: every device runs the PyTorch reference (debugging a kernel on the GPU).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")


# Called with no arguments after either setting changes (the replay kernel, kvops/ops/_replay.py,
# replays only under backend "auto" without validation)
ON_CHANGE: list = []


def _changed() -> None:
    for hook in ON_CHANGE:
        hook()


class _Setting:
    """A value with a setter that doubles as a context manager restoring the old value."""

    def __init__(self, name: str, value, check):
        self.name, self.value, self._check, self._stack = name, check(value), check, []

    def set(self, value):
        self._stack.append(self.value)
        self.value = self._check(value)
        _changed()
        return self

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        self.value = self._stack.pop()
        _changed()
        return False


def _check_backend(name):
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    return name


def _check_flag(flag):
    if isinstance(flag, str):
        flag = flag.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(flag)


_backend = _Setting("backend", os.environ.get("KVOPS_BACKEND", "auto") or "auto", _check_backend)
_validate = _Setting("validate", os.environ.get("KVOPS_VALIDATE", "0"), _check_flag)


def backend(name: str | None = None):
    """Get (no argument) or set the backend; setting returns a context manager.

    ``with kvops.backend("triton"): ...`` restores the previous backend on exit; a plain
    ``kvops.backend("triton")`` sets it for the rest of the process.
    """
    if name is None:
        return _backend.value
    return _backend.set(name)


def validate(enabled: bool | None = None):
    """Get (no argument) or set validation mode; setting returns a context manager.

    In validation mode every op checks index ranges (page ids, lengths) on the host and raises
    ``IndexError`` instead of reading out of bounds. It synchronizes, so it is off by default.
    """
    if enabled is None:
        return _validate.value
    return _validate.set(enabled)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return _check_flag(os.environ.get("TRITON_INTERPRET", "0"))


def use_triton(on: torch.device | torch.Tensor) -> bool:
    """Whether an op on tensors of device ``on`` (or on the device of tensor ``on``: an op's
    call asks with its first tensor, which skips making a device object) runs its Triton
    kernel (else the reference)."""
    backend = _backend.value
    if backend == "torch":
        return False
    if on.is_cuda if isinstance(on, torch.Tensor) else on.type == "cuda":
        return True
    if backend == "triton":
        if not interpreting():
            raise RuntimeError(
                "kvops backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                "before triton is imported"
            )
        return True
    return False
