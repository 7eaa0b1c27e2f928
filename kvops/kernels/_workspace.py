"""Scratch tensors a launch writes and the same op call reads back (split-K partials), and the
zeroed counters a split launch merges by, kept across eager calls instead of allocated on every
call (an allocation costs 2-7 us of host time on the H200's host, a view 1 us).

One buffer per (device, stream, host thread). Work on one stream runs in issue order, so a
call's merge reads its partials before the next call on that stream writes them, and a second
stream or thread has a buffer of its own. A call allocates fresh instead (and keeps nothing)
when any of these holds, because a kept buffer would then be unsafe or wrong:

- the current stream is capturing a CUDA graph (the graph's private pool serves it and costs
  nothing at replay; a captured graph never shares scratch with eager calls or another graph);
- the new buffer came from a private memory pool, not the caching allocator's default one:
  ``torch.compile(mode="reduce-overhead")``'s warm-up runs route every allocation into its
  graph pool, which it checks for stray tensors and later resets, and a ``use_mem_pool`` pool
  may be unmapped; the pool is read from ``torch.cuda.memory_snapshot`` when a buffer is made;
- the tensors' device is not the current device (kernels launch on the current device's
  stream, which is not the stream this cache would key);
- deterministic mode fills uninitialized memory (``torch.utils.deterministic``), which a kept
  buffer would skip;
- CPU tensors (the interpreter);
- ``KVOPS_KEEP_SCRATCH=0`` in the environment (every call allocates its partials).

A buffer grows to the largest request seen on its stream and thread. At most ``MAX_BUFFERS``
are kept (streams and threads that are gone leave theirs behind until then); :func:`clear`
frees them all.

Counters (the last of :func:`split_scratch`'s results) are int32 and zero whenever no launch
that counts on them is in flight: each launch that takes them leaves them zero
(``_splitk.arrive``), so a kept buffer is zeroed once, when it is made, and apart from the
float scratch (whose views of other shapes would overwrite them).
"""

from __future__ import annotations

import os
import threading

import torch

ENABLED = os.environ.get("KVOPS_KEEP_SCRATCH", "1").strip() not in ("0", "false", "off")
MAX_BUFFERS = 64
# (device index, stream, thread) -> [buffer, {request: views}]; a float buffer's requests are
# shapes (its views) or (shapes, n) (split_scratch's result: its views and the key's counters)
_BUFS: dict = {}
_COUNTS: dict = {}     # (device index, stream, thread) -> [int32 zeros, {n: view}]
_ALIGN = 32            # floats: every view starts 128 bytes after the previous one's start
# Called with no arguments when kept buffers are let go of (clear, or the cache starting over
# past MAX_BUFFERS): what else holds them (the replay kernel's recipes, kvops/ops/_replay.py)
# lets them go too. A buffer replaced by a larger one needs no call: a recipe that addresses
# it holds it, and keeps using it in its stream's order.
ON_CHANGE: list = []


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fresh(device, shapes) -> tuple:
    return tuple(torch.empty(s, dtype=torch.float32, device=device) for s in shapes)


def _views(buf: torch.Tensor, shapes) -> tuple:
    views, start = [], 0
    for s in shapes:
        views.append(buf[start:start + _numel(s)].view(s))
        start += _round(_numel(s))
    return tuple(views)


def _default_pool(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies in a segment of the caching allocator's default pool."""
    ptr = t.data_ptr()
    try:
        for seg in torch.cuda.memory_snapshot():
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                return tuple(seg["segment_pool_id"]) == (0, 0)
    except (KeyError, TypeError, RuntimeError):
        pass
    return False                      # not found or not readable: keep nothing


_CUDA: dict = {}   # torch.device -> whether it is a CUDA device (``device.type`` builds a new
                   # string every access: 0.3 us on the CPU machines, this lookup 0.06)


def _is_cuda(device: torch.device) -> bool:
    cuda = _CUDA.get(device)
    if cuda is None:
        cuda = _CUDA[device] = device.type == "cuda"
    return cuda


def _kept_key(device: torch.device, cuda: bool):
    """The (device index, stream, thread) a kept buffer for ``device`` (``cuda``: whether it is
    a CUDA device) lives under, or None where a call must allocate fresh (the module doc's
    cases, capture aside: callers test it first)."""
    if not ENABLED or not cuda:
        return None
    current = torch._C._cuda_getDevice()
    if (device.index is not None and device.index != current) or (
            torch._C._get_deterministic_algorithms()
            and torch.utils.deterministic.fill_uninitialized_memory):
        return None
    return (current, torch._C._cuda_getCurrentRawStream(current), threading.get_ident())


def split_scratch(device: torch.device, shapes: tuple, n: int) -> tuple:
    """float32 tensors of ``shapes`` (a tuple of shape tuples) over one scratch buffer, valid
    until the next call on this device, stream and thread, contents undefined; then ``n`` int32
    zeros for one launch that counts on them and leaves them zero, or None while the current
    stream captures a CUDA graph (a captured launch merges by a second kernel instead: zeroing
    fresh counters would add a node to every replay). Returns the views followed by the
    counters; a repeated request is one cache hit (every eager split decode call makes one)."""
    cuda = _is_cuda(device)
    if cuda and torch._C._cuda_isCurrentStreamCapturing():
        return (*_fresh(device, shapes), None)
    key = _kept_key(device, cuda)
    entry = _BUFS.get(key) if key is not None else None
    if entry is not None:
        hit = entry[1].get((shapes, n))
        if hit is not None:
            return hit
    views, floats = _float_views(key, device, shapes)
    count, kept_count = _counters(key, device, n)
    got = (*views, count)
    if floats is not None and kept_count:   # both kept: valid until either is replaced
        _remember(floats, (shapes, n), got)
    return got


def _float_views(key, device, shapes) -> tuple:
    """(views, the kept entry they lie in, or None)."""
    if key is None:
        return _fresh(device, shapes), None
    entry = _BUFS.get(key)
    if entry is not None:
        hit = entry[1].get(shapes)
        if hit is not None:
            return hit, entry
    need = sum(_round(_numel(s)) for s in shapes)
    if entry is None or entry[0].numel() < need:
        buf = torch.empty(need, dtype=torch.float32, device=device)
        if not _default_pool(buf):
            return _views(buf, shapes), None    # used by this call only
        entry = _keep(_BUFS, key, buf)
    return _view(entry, shapes, lambda buf: _views(buf, shapes)), entry


def _counters(key, device, n: int) -> tuple:
    """(counters, whether they lie in the kept counter buffer)."""
    if key is None:
        return torch.zeros(n, dtype=torch.int32, device=device), False
    entry = _COUNTS.get(key)
    if entry is not None:
        hit = entry[1].get(n)
        if hit is not None:
            return hit, True
    if entry is None or entry[0].numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        if not _default_pool(buf):
            return buf[:n], False               # used by this call only
        entry = _keep(_COUNTS, key, buf)
        floats = _BUFS.get(key)
        if floats is not None:                  # its split requests hold the old counters
            floats[1].clear()
    return _view(entry, n, lambda buf: buf[:n]), True


def _keep(kept: dict, key, buf) -> list:
    if len(kept) >= MAX_BUFFERS:
        kept.clear()
        if kept is _COUNTS:     # the float entries' split requests hold the dropped counters
            for entry in _BUFS.values():
                entry[1].clear()
        _changed()
    # a replaced buffer returns to the caching allocator, which hands it only to later work on
    # this stream: the calls already issued with it finish first
    entry = kept[key] = [buf, {}]
    return entry


def _view(entry: list, request, make):
    return _remember(entry, request, make(entry[0]))


def _remember(entry: list, request, views):
    if len(entry[1]) >= 64:
        entry[1].clear()
    entry[1][request] = views
    return views


def _changed() -> None:
    for hook in ON_CHANGE:
        hook()


def kept() -> tuple:
    """Every kept buffer as ``(start, end, buffer)``, start and end its byte addresses."""
    return tuple((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size(), b)
                 for kept in (_BUFS, _COUNTS) for b, _ in kept.values())


def clear() -> None:
    """Free every scratch buffer and counter buffer (the next call on each stream allocates
    again)."""
    _BUFS.clear()
    _COUNTS.clear()
    _changed()
