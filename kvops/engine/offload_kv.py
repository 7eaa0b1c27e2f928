"""``offload``: the ``paged`` configuration whose preemption swaps instead of recomputing (the
ElasticKV paper's Exact-offload baseline). A preempted request's computed K/V, every layer, is
copied into host memory (pinned on CUDA) while its pages are still mapped, its session ends
(the pages are free from the next commit), and it waits at the head of the queue with its
tokens and ``num_computed`` kept. Its re-admission reserves ``num_computed`` tokens plus the
step's, copies the K/V back into the new pages after the commit (before the step's forwards)
and continues where it stopped: the tokens are those of an unpreempted run.

Copies run on the current stream (device to pinned host and back, ``non_blocking``; the page
lists go up through pinned memory too), so the stream orders them against the forwards that
overwrite the freed pages and read the restored ones, and a swap queued while the previous
step runs (engine overlap) does not wait for it; a swap-in's host buffer is kept until the
copy is known done (the next swap-in's event).
"""

from __future__ import annotations

import numpy as np
import torch

from kvops._upload import upload
from kvops.engine.kv import PagedKV, _blocks
from kvops.engine.request import Request

SWAP_IN = "<swap-in>"
"""The source ``prefix_lookup`` names for a swapped-out request: its admission restores."""


class OffloadKV(PagedKV):
    """:class:`PagedKV` with swap preemption (module doc). Counters: ``swap_outs``,
    ``swap_ins``, ``swap_bytes`` (both directions)."""

    swaps = True
    tp_edits = PagedKV.tp_edits + ("swap_out",)   # the scheduler's preemption (distributed.KVLog)

    def __init__(self, **kw):
        super().__init__(**kw)
        if self.window:
            raise ValueError(f"window: the offload configuration has no window arenas, got "
                             f"{self.window}")
        self._swapped: dict[int, tuple[int, torch.Tensor]] = {}   # rid -> (tokens, host K/V)
        self._restore: list[tuple[Request, torch.Tensor]] = []
        self._inflight: list = []                # host buffers of swap-ins, until copied
        self.swap_outs = self.swap_ins = self.swap_bytes = 0

    def is_swapped(self, req: Request) -> bool:
        return req.rid in self._swapped

    def forget(self, req: Request) -> None:
        """Drop ``req``'s host copy: a request that ends unserved while swapped out (a replay
        stopped under an Eff@300 bar)."""
        self._swapped.pop(req.rid, None)

    def swap_out(self, req: Request) -> int:
        """Copy ``req``'s computed K/V to the host and end its session; returns the pages that
        gives back (freed at the next commit)."""
        n = req.num_computed
        freed = self.pages_of(req)
        nb = _blocks(n, self.S)
        pin = self.device.type == "cuda"
        host = torch.empty((2, self.layers, nb, *self.k_pool.shape[2:]), dtype=self.k_pool.dtype,
                           pin_memory=pin)
        if nb:
            pages = self._page_ids(req, nb)
            host[0].copy_(self.k_pool.index_select(1, pages), non_blocking=pin)
            host[1].copy_(self.v_pool.index_select(1, pages), non_blocking=pin)
        self.end(req)
        self._swapped[req.rid] = (n, host)
        self.swap_outs += 1
        self.swap_bytes += host.numel() * host.element_size()
        return freed

    def _page_ids(self, req: Request, nb: int) -> torch.Tensor:
        """``req``'s first ``nb`` pages as int64 on the device, without a wait for the GPU."""
        return upload(np.asarray(self.pager.pages(req.key)[:nb], dtype=np.int64), self.device)

    def prefix_lookup(self, req: Request):
        if req.rid in self._swapped:
            return SWAP_IN, self._swapped[req.rid][0]
        return super().prefix_lookup(req)

    def pages_for(self, req: Request, n: int, hit: int = 0) -> int:
        if req.status.name != "RUNNING" and req.rid in self._swapped:
            return _blocks(hit + n, self.S)
        return super().pages_for(req, n, hit)

    def _open(self, f, req, src, hit, n):
        if src == SWAP_IN:           # by value: under tp the plan arrives pickled
            tokens, host = self._swapped.pop(req.rid)
            if tokens != hit:
                raise ValueError(f"request {req.rid}: swap-in of {hit} tokens, {tokens} were "
                                 f"swapped out")
            self._restore.append((req, host))
            return hit + n
        return super()._open(f, req, src, hit, n)

    def _after_commit(self, commit, admits) -> None:
        """Copy the swapped-in K/V into the pages the commit mapped."""
        cuda = self.device.type == "cuda"
        if cuda:
            self._inflight = [(ev, h) for ev, h in self._inflight if not ev.query()]
        for req, host in self._restore:
            nb = host.shape[2]
            if nb:
                pages = self._page_ids(req, nb)
                self.k_pool.index_copy_(1, pages, host[0].to(self.device, non_blocking=cuda))
                self.v_pool.index_copy_(1, pages, host[1].to(self.device, non_blocking=cuda))
                if cuda:
                    ev = torch.cuda.Event()
                    ev.record()
                    self._inflight.append((ev, host))
            self.swap_ins += 1
            self.swap_bytes += host.numel() * host.element_size()
        self._restore = []

    def reset_counters(self) -> None:
        super().reset_counters()
        self.swap_outs = self.swap_ins = self.swap_bytes = 0

    def held_host_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for _, h in self._swapped.values())
