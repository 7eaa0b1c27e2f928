"""The pager's tables: one int32 buffer on the host and one on the device, fixed shapes.

Tables are registered (:meth:`TableSet.add`) until the layout is fixed (:meth:`TableSet.fix`,
at the first frame or the first read of the device views). Then ``host[name]`` are numpy views
into one host buffer (the committed tables) and ``device[name]`` are views into one device
buffer (``torch`` views of the host buffer itself when there is no device): capture a CUDA
graph on them once; every commit refreshes them in place.

An upload (:meth:`TableSet.upload`) copies the changed ranges of the host buffer into one of
two staging buffers (pinned on CUDA) and that buffer to the device in ONE transfer; an event
per staging buffer keeps a buffer from being rewritten while its copy is in flight, so each
upload also repeats the previous commit's ranges into the buffer it reuses.
"""

from __future__ import annotations

import numpy as np
import torch


class TableSet:
    """The named int32 tables of one pager and their one upload."""

    def __init__(self, device: torch.device | None):
        self.device = device
        self.specs: dict[str, tuple[tuple[int, ...], int]] = {}
        self.fixed = False

    def add(self, name: str, shape: tuple[int, ...], fill: int = 0) -> None:
        if self.fixed:
            raise RuntimeError(f"add_table({name!r}): tables are fixed once a frame has opened "
                               f"or the device tables were read")
        if name in self.specs:
            raise ValueError(f"add_table: table {name!r} already exists")
        self.specs[name] = (tuple(int(s) for s in shape), int(fill))

    def fix(self) -> None:
        """Lay the tables out in one buffer, filled, and make the host and device views."""
        if self.fixed:
            return
        self.offset: dict[str, int] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        at = 0
        for name, (shape, _) in self.specs.items():
            self.offset[name], self.shape[name] = at, shape
            at += int(np.prod(shape))
        master = np.empty(at, dtype=np.int32)
        self.region = {}
        for name, (shape, fill) in self.specs.items():
            off = self.offset[name]
            self.region[name] = slice(off, off + int(np.prod(shape)))
            master[self.region[name]] = fill
        self.master = master
        self.width = {name: int(np.prod(shape[1:])) for name, shape in self.shape.items()}
        self.host = {name: master[r].reshape(self.shape[name]) for name, r in self.region.items()}
        self._stage: list[torch.Tensor] = []
        self._events: list = []
        self._last: list = []
        if self.device is None:
            buf = torch.from_numpy(master)
        else:
            pin = self.device.type == "cuda"
            for _ in range(2):
                stage = torch.from_numpy(master.copy())
                self._stage.append(stage.pin_memory() if pin else stage)
                self._events.append(torch.cuda.Event() if pin else None)
            buf = self._stage[0].to(self.device, copy=True)
        self.device_buffer = buf
        self.views = {name: buf[r].view(self.shape[name]) for name, r in self.region.items()}
        self._stage_np = [stage.numpy() for stage in self._stage]
        self._rows_memo = (None, 0, 0)      # the last array index and its lowest, highest row
        self.fixed = True

    def check(self, name: str) -> None:
        if name not in self.shape:
            raise KeyError(f"table {name!r}: not registered (have {list(self.shape)})")

    def rows_of(self, name: str, where):
        """The part of the buffer a write ``host[name][where]`` touches: the flat range of the
        rows of an int, a slice or a 1-D integer array (lowest to highest) along dim 0, alone
        or first in a tuple; the flat positions of just its rows for a 1-D array whose rows
        fill less than a quarter of that range (rows scattered over the table); else the whole
        table."""
        region = self.region[name]
        if isinstance(where, tuple):
            where = where[0]
        if isinstance(where, (int, np.integer)):
            start, stop = int(where), int(where) + 1
        elif isinstance(where, slice) and where.step is None:
            start, stop, _ = where.indices(self.shape[name][0])
        elif isinstance(where, np.ndarray) and where.ndim == 1 and where.dtype.kind in "iu" \
                and where.size:
            memo = self._rows_memo          # one index array often writes several tables
            if memo[0] is where:
                start, stop = memo[1], memo[2]
            else:
                start, stop = int(where.min()), int(where.max()) + 1
                self._rows_memo = (where, start, stop)
            if start >= 0 and 4 * where.size < stop - start:
                width = self.width[name]
                rows = region.start + where.astype(np.int64) * width
                return (rows[:, None] + np.arange(width)).reshape(-1)
        else:
            return region
        if start < 0:
            return region
        width = self.width[name]
        return slice(region.start + start * width, region.start + stop * width)

    def upload(self, epoch: int, changed: list) -> None:
        """Copy the changed ranges (slices or flat index arrays of the buffer) to the device in
        one transfer; nothing to do without a device (the device views are the host buffer)."""
        self._rows_memo = (None, 0, 0)      # an index array may change before the next commit
        if self.device is None:
            return
        i = epoch % 2
        stage, event = self._stage[i], self._events[i]
        if event is not None:
            event.synchronize()
        buf = self._stage_np[i]
        master = self.master
        for where in self._last + changed:
            buf[where] = master[where]
        self._last = changed
        self.device_buffer.copy_(stage, non_blocking=event is not None)
        if event is not None:
            event.record()
