"""Scratch tensors a launch writes and the same op call reads back (split-K partials), kept
across eager calls instead of allocated on every call (an allocation costs 5-7 us of host time
on the H200's host, a view 1 us).

One buffer per (device, stream, host thread). Work on one stream runs in issue order, so a
call's merge reads its partials before the next call on that stream writes them, and a second
stream or thread has a buffer of its own. While the current stream is capturing a CUDA graph,
every call allocates fresh (from the graph's private pool, which costs nothing at replay), so a
captured graph never shares scratch with eager calls or with another graph. CPU tensors (the
interpreter) allocate fresh too.

A buffer grows to the largest request seen on its stream and thread and is freed by
:func:`clear`.
"""

from __future__ import annotations

import threading

import torch

_BUFS: dict = {}       # (device index, stream, thread) -> [buffer, {request: views}]
_ALIGN = 32            # floats: every view starts 128 bytes after the previous one's start


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def float_views(device: torch.device, shapes: tuple) -> tuple:
    """float32 tensors of ``shapes`` (a tuple of shape tuples) over one scratch buffer: valid
    until the next call on this device, stream and thread; contents undefined."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return tuple(torch.empty(s, dtype=torch.float32, device=device) for s in shapes)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index), threading.get_ident())
    entry = _BUFS.get(key)
    if entry is not None:
        hit = entry[1].get(shapes)
        if hit is not None:
            return hit
    sizes = [_round(_numel(s)) for s in shapes]
    need = sum(sizes)
    if entry is None or entry[0].numel() < need:
        # the old buffer returns to the caching allocator, which hands it only to later work
        # on this stream: the calls already issued with it finish first
        entry = _BUFS[key] = [torch.empty(need, dtype=torch.float32, device=device), {}]
    views, start = [], 0
    for s, n in zip(shapes, sizes):
        views.append(entry[0][start:start + _numel(s)].view(s))
        start += n
    views = tuple(views)
    if len(entry[1]) >= 64:
        entry[1].clear()
    entry[1][shapes] = views
    return views


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def clear() -> None:
    """Free every scratch buffer (the next call on each stream allocates again)."""
    _BUFS.clear()
