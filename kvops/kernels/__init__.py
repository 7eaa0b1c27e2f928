"""Triton kernels and their launchers, one module per op; shared pieces in ``_*.py``.

Launchers only check what the kernel itself relies on, allocate outputs, build the grid and
launch. They never import the runtime.
"""
