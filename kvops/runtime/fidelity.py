"""Fidelity (ElasticKV section 3.3): demote TARGET pairs to BASE when pages run short, promote
them back when pages are spare, and keep BASE executable until TARGET is back.

Layout and state
    A session's BASE blocks form one span ``[first, end)`` of logical blocks, the structured
    layout ``elastic_attention`` reads through ``base_span`` (the pager table this policy adds,
    ``base_span [B, 2]``): block ``j`` of the span sits in half ``(j - first) % 2`` of its pair
    page, and both blocks of a pair map that page. Demotion grows a session's span upward by
    whole pairs (its oldest TARGET blocks after ``protect_first``, never the last
    ``protect_recent`` blocks nor a partly filled one); promotion takes the span's top pair
    first, so the span stays one span. :meth:`Fidelity.block_states` gives a session's state
    table: ``TARGET`` 0, ``BASE`` 1, ``PROMOTING`` 2 (BASE, refinement in flight).

Demotion (synchronous, on the current stream)
    ``step(frame, need)`` demotes when the pool's free pages fall short of ``need`` (the pages
    the caller will take before the next step): at least ``min_batch`` pairs (16, the paper's
    minimum batch), or as many as the shortage, spread over sessions so the one with the
    smallest BASE share gives the next pair. Each pair runs ``pack_base_pairs`` in place (rows
    ``(page_a, page_b, page_a)``) on every cache, its backing goes to host memory (pinned on
    CUDA, copied on the side stream), block ``j + 1`` is remapped onto ``page_a``, and ``page_b``
    returns to the pool at the frame's commit. If the frame aborts, the pairs are refined back
    from the device copy of the backing, so the pool is as before.

Promotion (asynchronous, on a side stream)
    When a step demotes nothing, the pages left after ``need``, the reserve and ``headroom``
    pay for promotions, two pages each while in flight (at most ``max_promote`` a step), from
    the pool's free pages (a hold never takes pages freed in the frame, e.g. by a settle). A
    promotion copies the pair's backing to the device and runs ``refine_base_pairs`` out of
    place into two held pages; the BASE page stays mapped (and retained), so attention keeps
    reading BASE meanwhile. A later ``step`` whose frame sees the side stream's event done
    remaps the two blocks onto the refined pages and lets the BASE page go; a step whose
    ``need`` exceeds the free pages first waits for the promotions still running, so on a
    shortage every pair is demotable again (as :meth:`Fidelity.demotable` counts it) and the
    pages they hold come back. The reserve is
    ``pages freed by demotion``, decaying by ``reserve_decay`` a step: promotion does not take
    back capacity a demotion just freed (the paper's decaying reserve; ``reserve_decay = 0``
    is its "eager promotion" ablation).

Host backing
    A host pool of slots ``[caches, 2, S, Hkv, D]`` (uint8 low bytes for float16 codecs, the
    bfloat16 values for e4m3), pinned on CUDA in chunks of 64 slots, holds each BASE pair's
    backing for every cache (``host_pairs`` slots at most; demotion stops when they are
    taken). A worker thread pins chunks ahead of use (``host_ahead``), since pinning takes
    tens of milliseconds a chunk. A batch takes consecutive slots where it can, so a demotion
    copies its backings down, and a promotion up (its refines in slot order), in one copy a
    run of slots, on the side stream. A slot goes back when its pair is promoted or its
    session ends.

Host cost
    A demotion batch is one ``pack_base_pairs`` launch and a promotion batch one
    ``refine_base_pairs`` launch over every pair and cache when the caches are one pool (else
    one a cache), plus a copy a run of host slots; the pair rows are built with numpy and go
    up from pinned memory without a sync; nothing reads a device value back. The frame calls
    do not grow with the pairs either: a batch reads pages and counts, remaps, retains and
    releases through the frame's many-block calls (``pages_at``, ``refcounts``,
    ``remap_many``, ``retain_many``, ``release_many``), one call each. On CUDA the
    constructor compiles both kernels on scratch pages, so no step compiles.
    ``bench/bench_fidelity_host.py`` counts a transition's ops and times its Python.

Frames
    ``step`` runs once a frame; ``promote``, ``alias``, ``trim`` and ``reserve`` may share its
    frame. What the policy does in a frame is kept in a pending record that its later calls
    and its checks read; its plan at commit returns it as the staged state, adopted once the
    commit is complete (an aborted frame drops it, undoes its packs and waits for its
    promotions' side-stream work, every undo running even if another raises). Blocks reserved
    in the frame, and pages a copy-on-write copy of the frame reads, are never demoted in it.
    A demotion's freed pages are reservable in the same frame: ``step(f, need=fid.need(f,
    reserves))`` then the reserves. ``attention_kwargs(always=True)``
    passes the span table even when nothing is BASE, for a step compiled or captured once.

What it does not do (checked, and refused with ``ValueError``)
    ``alias`` of a prefix holding a page BASE at any point of the frame, a copy-on-write copy
    of a BASE page, and trimming a BASE block abort their frame: a BASE page is mapped by
    exactly the two blocks of one session. Promote first (``promote`` with the session), or
    alias fewer blocks.

A decode step::

    with pager.frame() as f:
        fid.step(f, need=fid.need(f, {"req-3": 1, "req-9": 812}))
        f.reserve("req-3", 1)
        f.reserve("req-9", 812)
    # after the commit, attention reads BASE through the span table:
    out, lse = torch.ops.kvops.elastic_attention(q, k_cache, v_cache, tables["block_table"],
                                                 tables["seq_lens"], **fid.attention_kwargs())

Counters (``stats``): pairs demoted and promoted, demotion batches, promotions in flight, BASE
blocks, BASE exposure (BASE blocks / live blocks) now and its mean over steps.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvops._config import use_triton
from kvops._upload import upload
from kvops.layouts import codecs
from kvops.runtime.allocator import SpanAllocator
from kvops.runtime.frame import Frame, as_int
from kvops.runtime.pager import Pager
from kvops.runtime.policy import Staged

TARGET, BASE, PROMOTING = 0, 1, 2

PHASES = ("settle_s", "demote_s", "promote_s")   # Fidelity.last_times: a step's timed phases


def _one_pool(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The caches as one pool ``[caches * P, S, Hkv, D]`` when they are equal, consecutive
    slices of one allocation (e.g. ``torch.empty(2 * layers, P, S, Hkv, D).unbind(0)``), so a
    transition is one pack or refine call for all of them; else None (a call a cache)."""
    c0 = caches[0]
    step = c0.shape[0] * c0.stride(0)
    ptr = c0.untyped_storage().data_ptr()
    for i, c in enumerate(caches):
        if c.stride() != c0.stride() or c.untyped_storage().data_ptr() != ptr or \
                c.storage_offset() != c0.storage_offset() + i * step:
            return None
    return c0.as_strided((len(caches) * c0.shape[0], *c0.shape[1:]), c0.stride(),
                         c0.storage_offset())


def _transport_rule(fid, transport) -> str | None:
    """Why a Transport may not share ``fid``'s pager: its window could hold demoted blocks."""
    if fid.protect_recent < transport.pages_per_window:
        return (f"protect_recent: expected >= {transport.pages_per_window} (the transport's "
                f"window blocks), got {fid.protect_recent}: the window would hold demoted "
                f"blocks")
    return None


class _HostPool:
    """Host slots for pair backings, ``[caches, 2, S, Hkv, D]`` each, pinned on CUDA: chunks of
    ``chunk`` slots, slots handed out as contiguous runs (the pager's span allocator), so a
    batch's backings move in a few copies and nothing is pinned per batch.

    Pinning is slow (``cudaHostAlloc`` of a 256 MiB chunk takes tens of milliseconds), so a
    worker thread allocates chunks before they are needed: ``ahead`` slots' worth from the
    start, and once that stock is used, it keeps ``REFILL`` chunks (at most the stock) ready
    after every ``take`` that used some. A slot whose chunk is not allocated yet takes a ready
    one; only when none is ready does ``take`` wait for the worker or allocate itself.
    ``ahead = 0`` allocates a chunk when a slot of it is first taken."""

    REFILL = 4

    def __init__(self, slot_shape, dtype, pin: bool, capacity: int, chunk: int = 64,
                 ahead: int = 0):
        self.slot_shape, self.dtype, self.pin, self.chunk = tuple(slot_shape), dtype, pin, chunk
        self.alloc = SpanAllocator(capacity)
        self.chunks: dict[int, torch.Tensor] = {}
        self.limit = -(-capacity // chunk)                  # chunks the capacity spans
        ahead = -(-min(ahead, capacity) // chunk)           # chunks pinned from the start
        self.refill = min(ahead, self.REFILL)               # chunks kept ready after that
        self._ready: list = []                              # futures of allocated chunks
        self._worker = None
        self.inline = 0                                     # chunks ``take`` had to allocate
        self._refill(ahead)

    def _new_chunk(self) -> torch.Tensor:
        return torch.empty((self.chunk, *self.slot_shape), dtype=self.dtype, pin_memory=self.pin)

    def _refill(self, ready: int) -> None:
        """Start allocating chunks until ``ready`` are ready or on their way."""
        want = min(ready, self.limit - len(self.chunks)) - len(self._ready)
        if want <= 0:
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvops-host-pool")
        for _ in range(want):
            self._ready.append(self._worker.submit(self._new_chunk))

    def wait(self) -> None:
        """Wait until every chunk the worker is allocating is ready."""
        for fut in self._ready:
            fut.result()

    @property
    def free(self) -> int:
        return self.alloc.free

    def take(self, n: int) -> list[int]:
        slots = [s for start, k in self.alloc.take(n) for s in range(start, start + k)]
        new = sorted({s // self.chunk for s in slots} - self.chunks.keys())
        if not new:
            return slots
        try:
            for c in new:
                got = None
                if self._ready:             # one worker: its chunks come in submission order
                    fut = self._ready.pop(0)
                    try:
                        got = fut.result()
                    except Exception:           # the worker's allocation failed: try here
                        got = None
                if got is None:
                    got = self._new_chunk()
                    self.inline += 1
                self.chunks[c] = got
        except BaseException:
            for s in slots:
                self.alloc.give(s)
            raise
        self._refill(self.refill)
        return slots

    def give(self, slot: int) -> None:
        self.alloc.give(slot)

    def runs(self, slots: list[int]) -> list[tuple[int, int, int]]:
        """``(i, slot, k)``: slots[i: i + k] are ``slot .. slot + k - 1`` in one chunk."""
        out, i = [], 0
        while i < len(slots):
            k = 1
            while i + k < len(slots) and slots[i + k] == slots[i] + k and \
                    (slots[i] + k) % self.chunk:
                k += 1
            out.append((i, slots[i], k))
            i += k
        return out

    def view(self, slot: int, k: int = 1) -> torch.Tensor:
        c, at = divmod(slot, self.chunk)
        return self.chunks[c][at: at + k]


@dataclass
class _Pair:
    """A BASE pair page: the session and first block it holds, and its host backing slot."""
    key: Hashable
    j: int
    slot: int


@dataclass
class _Promotion:
    key: Hashable
    j: int
    page: int                              # the BASE page (retained while in flight)
    slot: int                              # its host backing slot
    new: tuple[int, int]                   # the refined pages (held)
    done: object                           # torch.cuda.Event, or None when already done
    keep: list = field(default_factory=list)   # device tensors the side stream still reads


@dataclass
class _Pending:
    """What the policy did in one frame, read by its later calls in the same frame and by the
    plan, and made the committed state when the pager adopts it (:meth:`Fidelity._apply`)."""
    frame: Frame
    spans: dict = field(default_factory=dict)        # key -> span after the frame ((0, 0): none)
    new_pairs: dict = field(default_factory=dict)    # page -> _Pair demoted in the frame
    gone: set = field(default_factory=set)           # BASE pages whose promotion settled
    settled: dict = field(default_factory=dict)      # key -> promotions settled, stack top first
    issued: dict = field(default_factory=dict)       # key -> [_Promotion] issued in the frame
    orphans_done: list = field(default_factory=list)
    mine: dict = field(default_factory=dict)         # (key, j) -> page the policy mapped
    stepped: bool = False
    demoted: int = 0
    decided: dict = field(default_factory=dict)      # this step's FidelityPlan fields


@dataclass(frozen=True)
class FidelityPlan:
    """What one :meth:`Fidelity.step` decided, as plain data (picklable, hashable): the
    promotions it settled (``(session, count)``, top of each stack first), the orphans whose
    pages it released (indices), the pairs it demoted and the promotions it issued
    (``(session, first block)``). ``step(frame, need, plan=...)`` applies a plan made
    elsewhere instead of deciding: the tensor-parallel ranks apply rank 0's
    (:class:`kvops.engine.distributed.FidelitySync`)."""
    settle: tuple = ()
    orphans: tuple = ()
    demote: tuple = ()
    promote: tuple = ()


class Fidelity:
    """ElasticKV fidelity policy over a :class:`~kvops.runtime.Pager` (module doc).

    Parameters
    ----------
    pager : Pager
        Attached here (before its first frame); adds the ``base_span [B, 2]`` table.
    caches : sequence of tensors
        Every pool the pager's page ids index (K and V of every layer), each ``[P, S, Hkv, D]``
        float16 or bfloat16 with contiguous pages.
    codec : str or None
        BASE codec (``kvops.layouts.codecs``; None: the dtype's default).
    min_batch : int
        Fewest pairs a demotion takes when that many are eligible (16).
    protect_first, protect_recent : int
        Blocks at the start (attention sinks) and at the end of every session never demoted.
    reserve_decay : float
        Per-step decay of the reserve that keeps freed pages from promotion, in [0, 1).
    headroom : int
        Free pages promotion always leaves.
    max_promote : int
        Promotions issued per step at most.
    host_pairs : int or None
        Pairs the host backing pool holds at most (default: half the pager's pages, every
        pair the pool could form). Each takes ``caches * 2 * S * Hkv * D`` backing bytes (one
        byte a value for float16 codecs, two for e4m3), pinned in chunks of 64 pairs.
    host_ahead : int or None
        Backing slots a worker thread allocates (pins) from the start, so demotion pins
        nothing on the critical path until that many pairs are BASE; after that it keeps four
        chunks (256 slots) ready at most (default: 256 on CUDA, where pinning a chunk takes
        tens of milliseconds, 0 on the CPU). :meth:`drain` waits for it.
    """

    def __init__(self, pager: Pager, caches: Sequence[torch.Tensor], codec: str | None = None,
                 *, min_batch: int = 16, protect_first: int = 0, protect_recent: int = 2,
                 reserve_decay: float = 0.9, headroom: int = 0, max_promote: int = 16,
                 host_pairs: int | None = None, host_ahead: int | None = None):
        if not caches:
            raise ValueError("caches: expected at least one [P, S, Hkv, D] pool, got none")
        first = caches[0]
        P, S = pager.num_pages, pager.page_size
        for i, c in enumerate(caches):
            if not isinstance(c, torch.Tensor) or c.dim() != 4:
                raise ValueError(f"caches[{i}]: expected a [P={P}, S={S}, Hkv, D] tensor, got "
                                 f"{getattr(c, 'shape', type(c).__name__)}")
            if c.shape[:2] != (P, S):
                raise ValueError(f"caches[{i}]: expected shape [P={P}, S={S}, Hkv, D] (the "
                                 f"pager's pages and page size), got {list(c.shape)}")
            if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
                raise ValueError(f"caches[{i}]: expected {first.dtype} on {first.device} of shape "
                                 f"{list(first.shape)} like caches[0], got {c.dtype} on "
                                 f"{c.device} {list(c.shape)}")
        for name, v in (("min_batch", min_batch), ("protect_first", protect_first),
                        ("protect_recent", protect_recent), ("headroom", headroom),
                        ("max_promote", max_promote)):
            if not isinstance(v, int) or v < (1 if name == "min_batch" else 0):
                raise ValueError(f"{name}: expected an int >= {1 if name == 'min_batch' else 0}"
                                 f", got {v!r}")
        host_pairs = pager.num_pages // 2 if host_pairs is None else host_pairs
        if not isinstance(host_pairs, int) or host_pairs < 1:
            raise ValueError(f"host_pairs: expected an int >= 1, got {host_pairs!r}")
        host_ahead = (256 if first.device.type == "cuda" else 0) if host_ahead is None \
            else host_ahead
        if not isinstance(host_ahead, int) or host_ahead < 0:
            raise ValueError(f"host_ahead: expected an int >= 0, got {host_ahead!r}")
        if not 0.0 <= reserve_decay < 1.0:
            raise ValueError(f"reserve_decay: expected a float in [0, 1), got {reserve_decay!r}")
        self.pager, self.caches = pager, list(caches)
        self.codec = codecs.check_codec(codec, first.dtype)
        self.min_batch, self.protect_first, self.protect_recent = (min_batch, protect_first,
                                                                   protect_recent)
        self.reserve_decay, self.headroom, self.max_promote = reserve_decay, headroom, max_promote
        self.device = first.device
        self._cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        self._pool = _one_pool(self.caches)
        self._host = _HostPool((len(self.caches), 2, *first.shape[1:]),
                               codecs.backing_dtype(self.codec, first.dtype), self._cuda,
                               host_pairs, ahead=host_ahead)
        if self._cuda and use_triton(self.device):
            self._warm()
        self._span: dict[Hashable, tuple[int, int]] = {}       # committed spans
        self._pairs: dict[int, _Pair] = {}                      # BASE page -> pair
        self._by_key: dict[Hashable, set[int]] = {}             # session -> its BASE pages
        self._flight: dict[Hashable, list[_Promotion]] = {}     # per session, top pair first
        self._orphans: list[_Promotion] = []                    # sessions ended in flight
        self._d2h: list[tuple[object, torch.Tensor]] = []       # (event, device backing)
        self._pend: _Pending | None = None                      # the open frame's record
        self.last_plan: FidelityPlan | None = None              # the last step's decisions
        self._picked: list = []                                 # the last promotions issued
        # host seconds of the last step's phases (PHASES): settling promotions, the demotion's
        # packs and copies down (device work on the critical path, launched), promotions' issue
        self.last_times = dict.fromkeys(PHASES, 0.0)
        self.reserve = 0.0
        self.stats = {"demoted": 0, "promoted": 0, "demotion_batches": 0, "in_flight": 0,
                      "base_blocks": 0, "exposure": 0.0, "exposure_mean": 0.0, "steps": 0}
        pager.attach(self)

    # -- this frame's pending state ------------------------------------------------------------
    def _now(self, frame: Frame) -> _Pending:
        """The pending record of ``frame`` (made, and its abort callback registered, on the
        first policy call in the frame); the commit adopts it (:meth:`adopt`)."""
        pend = self._pend
        if pend is None or pend.frame is not frame:
            frame.check_open()
            pend = self._pend = _Pending(frame)
            frame.on_abort(lambda: self._forget(pend))
        return pend

    def _of(self, frame: Frame) -> _Pending | None:
        pend = self._pend
        return pend if pend is not None and pend.frame is frame else None

    def _span_now(self, key, pend: _Pending | None) -> tuple[int, int]:
        if pend is not None and key in pend.spans:
            return pend.spans[key]
        return self._span.get(key, (0, 0))

    def _flight_now(self, key, pend: _Pending | None) -> list[_Promotion]:
        """Promotions of ``key`` in flight as of this frame, top pair first."""
        stack = self._flight.get(key, [])
        if pend is None:
            return stack
        return stack[pend.settled.get(key, 0):] + pend.issued.get(key, [])

    def _pair_now(self, page: int, pend: _Pending | None) -> _Pair | None:
        if pend is not None:
            if page in pend.gone:
                return None
            if page in pend.new_pairs:
                return pend.new_pairs[page]
        return self._pairs.get(page)

    def _base_in_frame(self, page: int, pend: _Pending | None) -> _Pair | None:
        """The pair of ``page`` if it is BASE at any point of the frame: one whose promotion
        settles in it too (an alias before the settle took the BASE page). Released pages
        go back to the pool only at the commit, so no fresh block holds one of these."""
        pair = self._pairs.get(page)
        if pair is None and pend is not None:
            pair = pend.new_pairs.get(page)
        return pair

    def _set_span(self, frame: Frame, pend: _Pending, key, span: tuple[int, int]) -> None:
        pend.spans[key] = span
        frame.edit("base_span", self.pager.slot(key), list(span))

    def _apply(self, pend: _Pending) -> None:
        """The frame committed: its promotions settled, pairs demoted, promotions issued and
        spans become the committed state (before any session it ended is dropped)."""
        self._pend = None
        for pr in pend.orphans_done:
            self._orphans.remove(pr)
            self._host.give(pr.slot)
        for key, k in pend.settled.items():
            stack = self._flight[key]
            for pr in stack[:k]:
                del self._pairs[pr.page]
                self._by_key[key].discard(pr.page)
                self._host.give(pr.slot)
            self.stats["promoted"] += k
            del stack[:k]
            if not stack:
                del self._flight[key]
        for page, pair in pend.new_pairs.items():
            self._pairs[page] = pair
            self._by_key.setdefault(pair.key, set()).add(page)
        for key, prs in pend.issued.items():
            self._flight.setdefault(key, []).extend(prs)
        for key, span in pend.spans.items():
            if span == (0, 0):
                self._span.pop(key, None)
                if not self._by_key.get(key, True):
                    del self._by_key[key]
            else:
                self._span[key] = span
        st = self.stats
        if pend.stepped:
            self.reserve = self.reserve * self.reserve_decay + pend.demoted
            if self.reserve < 1.0:          # less than a page holds nothing back
                self.reserve = 0.0
            st["demoted"] += pend.demoted
            st["demotion_batches"] += int(pend.demoted > 0)
        self._count()
        if pend.stepped:
            st["steps"] += 1
            st["exposure_mean"] += (st["exposure"] - st["exposure_mean"]) / st["steps"]

    def _forget(self, pend: _Pending) -> None:
        if self._pend is pend:
            self._pend = None

    # -- pager policy --------------------------------------------------------------------------
    kind = "fidelity"

    sharing = {
        # demoted blocks stay before every window when protect_recent covers it (a session's
        # length only grows), so the transport never copies BASE bytes into the arena
        "transport": _transport_rule,
        # the far view summarizes pages after they leave the window, where demotion packs them
        "far_view": "not supported (the far view would summarize pages that demotion packed "
                    "to BASE)",
    }

    def tables(self) -> dict:
        return {"base_span": ((self.pager.max_sessions, 2), 0)}

    def plan(self, frame: Frame, deltas, grown) -> Staged:
        """Refuse edits that would read or break a BASE pair: an alias sharing a page that is
        BASE at any point of the frame, a copy-on-write copy of one, a trim inside a span
        (the policy's own remaps excepted); clear the span row of ended sessions. The staged
        state is the frame's pending record and the sessions it ended."""
        pend = self._of(frame)
        for dst, _, _, pages in frame.aliases:
            for j, p in enumerate(pages):
                pair = self._base_in_frame(p, pend)
                if pair is not None:
                    raise ValueError(f"alias: session {dst!r} would share BASE block {j} of "
                                     f"{pair.key!r}; promote it first (Fidelity.promote) or "
                                     f"alias fewer blocks")
        for src, _ in frame.copies:
            pair = self._base_in_frame(src, pend)
            if pair is not None:
                raise ValueError(f"reserve: a copy-on-write copy would read BASE page {src} of "
                                 f"{pair.key!r} as TARGET; promote it first (Fidelity.promote)")
        ended = []
        mine = pend.mine if pend is not None else {}
        for d in deltas:
            if d.new:
                continue
            if d.closed:
                frame.write("base_span", d.slot, 0)
                ended.append(d.key)
                continue
            first, end = self._span_now(d.key, pend)
            bad = [j for j, p in d.after_overlay.items()       # in the span, not as the policy
                   if first <= j < end and mine.get((d.key, j)) != p]     # left it
            if bad:
                raise ValueError(f"trim: block {bad[0]} of {d.key!r} is BASE (span [{first}, "
                                 f"{end})); promote it first (Fidelity.promote)")
        return Staged((pend, tuple(ended)))

    def adopt(self, state) -> None:
        pend, ended = state
        if pend is not None:
            self._apply(pend)
        for key in ended:
            self._ended(key)

    def _ended(self, key) -> None:
        """Host state after a committed EOS: drop the session's pairs (their host slots go
        back), and its promotions in flight become orphans, whose pages and slots go back
        once their side-stream work is done."""
        self._span.pop(key, None)
        flying = self._flight.pop(key, [])
        busy = {pr.page for pr in flying}
        for page in self._by_key.pop(key, ()):
            pair = self._pairs.pop(page)
            if page not in busy:
                self._host.give(pair.slot)
        self._orphans.extend(flying)
        self._count()

    # -- reads -------------------------------------------------------------------------------
    @property
    def host_free(self) -> int:
        """Pairs the host backing pool can still take (demotion stops at zero)."""
        return self._host.free

    def demotable(self, key: Hashable) -> int:
        """Pairs the next :meth:`step` can demote from ``key``, from the committed state: exact
        for a session whose pages are unshared. Its promotions settle at the step's start
        (their pairs are demotable again): those done at once, and on a shortage (``need``
        above the free pages) the step first waits for those still running, so the count
        holds whatever the side stream's progress. A caller that plans reserves on demotion
        sums this over its sessions (and caps it by :attr:`host_free`)."""
        if key not in self.pager.committed.sessions:
            return 0
        first, end = self.span(key)
        flying = self._flight.get(key)
        if flying:
            end = flying[-1].j                  # the span once they settle
        S = self.pager.page_size
        n = self.pager.length(key)
        limit = min(n // S, -(-n // S) - self.protect_recent)
        start = end if end > first else self.protect_first
        return max(0, (limit - start) // 2)

    def span(self, key: Hashable) -> tuple[int, int]:
        """Committed BASE span ``[first, end)`` of ``key`` (``(0, 0)`` none)."""
        return self._span.get(key, (0, 0))

    def block_states(self, key: Hashable) -> np.ndarray:
        """int8 ``[blocks]``: ``TARGET`` 0, ``BASE`` 1, ``PROMOTING`` 2 (committed view)."""
        nb = -(-self.pager.length(key) // self.pager.page_size)
        out = np.zeros(nb, dtype=np.int8)
        first, end = self.span(key)
        out[first:end] = BASE
        for pr in self._flight.get(key, []):
            out[pr.j: pr.j + 2] = PROMOTING
        return out

    def attention_kwargs(self, always: bool = False) -> dict:
        """``{"base_span": table}`` while any block is BASE, else ``{}`` (the native path).
        ``always``: the table whatever the state (empty spans read as TARGET), for a decode
        step compiled or captured once, which must not switch paths between steps."""
        if not always and not self._pairs:      # ``always`` first: no guard on the pairs
            return {}
        return {"base_span": self.pager.device_tables["base_span"]}

    # -- the step ------------------------------------------------------------------------------
    def need(self, frame: Frame, reserves) -> int:
        """Pages the reserves ``{session: n_tokens}`` (or ``(session, n_tokens)`` pairs) about
        to be made in ``frame`` take: the ``need`` to give :meth:`step` before making them."""
        items = reserves.items() if hasattr(reserves, "items") else reserves
        return sum(frame.pages_needed(key, n) for key, n in items)

    def step(self, frame: Frame, need: int = 0, plan: FidelityPlan | None = None,
             exclude=()) -> dict:
        """Settle finished promotions (on a shortage, ``need`` above the free pages, every
        one, waiting for those still running), then demote on shortage or promote with spare
        pages; once a frame. ``need``: pages the caller takes before the next step (blocks
        reserved in this frame are never demoted in it). Returns this step's counts; its decisions
        are ``last_plan``. ``plan``: apply those decisions (settle exactly those promotions,
        waiting for their side-stream work; demote and promote exactly those pairs) instead
        of deciding; a pair the plan names that is not eligible here raises ``ValueError``.
        ``exclude``: sessions none of whose blocks is demoted in this frame by the policy's
        own decision (e.g. a request whose prefill still reads its blocks through a
        TARGET-only kernel)."""
        need = as_int("need", need)
        if isinstance(exclude, (str, bytes)):
            raise TypeError(f"exclude: expected a collection of session keys, got the string "
                            f"{exclude!r}")
        exclude = frozenset(exclude)
        pend = self._now(frame)
        if pend.stepped:
            raise ValueError(f"step: already called in the frame of epoch {frame.epoch}; "
                             f"call it once a frame")
        pend.stepped = True
        times = self.last_times = dict.fromkeys(PHASES, 0.0)
        self._reap_d2h()
        t0 = time.perf_counter()
        if plan is None and need > frame.free_pages:
            self._wait_promotions()         # a shortage: every promotion settles first
        settled = self._settle(frame, pend, plan)
        times["settle_s"] = time.perf_counter() - t0
        free = frame.free_pages
        short = need - free
        promoted = 0
        if plan is not None:
            if plan.demote:
                pend.demoted = self._demote(frame, pend, len(plan.demote), picks=plan.demote)
            if plan.promote:
                promoted = self._promote(frame, pend, len(plan.promote), picks=plan.promote)
        elif short > 0:
            pend.demoted = self._demote(frame, pend, max(short, self.min_batch),
                                        exclude=exclude)
        else:
            # promotions hold pool pages only; the reserves fall back on pages freed in the
            # frame (a settle's BASE pages), so both fit when holds stay within the pool
            spare = min(free - need, frame.holdable_pages) - math.ceil(self.reserve) \
                - self.headroom
            if spare >= 2:
                promoted = self._promote(frame, pend, min(spare // 2, self.max_promote))
        if promoted:
            pend.decided["promote"] = self._picked
        d = pend.decided
        self.last_plan = FidelityPlan(tuple(d.get("settle", ())), tuple(d.get("orphans", ())),
                                      tuple(d.get("demote", ())), tuple(d.get("promote", ())))
        return {"demoted": pend.demoted, "promoted": promoted, "settled": settled}

    def _count(self) -> None:
        st = self.stats
        st["in_flight"] = sum(len(v) for v in self._flight.values()) + len(self._orphans)
        base = 2 * len(self._pairs)
        S = self.pager.page_size
        live = int(((self.pager.host_tables["seq_lens"].astype(np.int64) + S - 1) // S).sum())
        st["base_blocks"] = base
        st["exposure"] = base / live if live else 0.0

    # -- demotion ------------------------------------------------------------------------------
    def _start(self, frame: Frame, pend: _Pending, key) -> tuple[int, int, int] | None:
        """(first, next pair's block, demotion limit) of a committed session, or None when
        it cannot grow its span now. The limit keeps the last ``protect_recent`` blocks, a
        partly filled one and blocks reserved in this frame TARGET."""
        if self._flight_now(key, pend):     # the span's top is promoting: do not grow past it
            return None
        S = self.pager.page_size
        n = frame.length(key)
        limit = min(min(n, self.pager.length(key)) // S, -(-n // S) - self.protect_recent)
        first, end = self._span_now(key, pend)
        if first == end:                    # a new span starts at the first eligible pair
            end = self.protect_first
            while end + 1 < limit and not self._eligible(frame, key, end):
                end += 1
            first = end
        return (first, end, limit) if end + 1 < limit else None

    def _eligible(self, frame: Frame, key, j: int) -> bool:
        """Whether blocks ``j, j + 1`` can form a pair: two live unshared pages, neither the
        source of a copy this frame makes (the copy runs after the pack, and must read TARGET
        bytes). :meth:`_read_ahead` is the same rule over many pairs at once."""
        a, b = frame.page(key, j), frame.page(key, j + 1)
        if a < 0 or b < 0 or a == b or frame.refcount(a) != 1 or frame.refcount(b) != 1:
            return False
        return not frame.copies or all(a != s and b != s for s, _ in frame.copies)

    def _read_ahead(self, frame: Frame, ahead: dict, runs, sources) -> None:
        """Fill ``ahead[key] = (j, [(a, b) or None])`` with ``_eligible`` of pairs ``j, j + 2,
        ...`` (``m`` of them) for every ``(key, j, m)`` of ``runs``, from a block range of
        pages a run and one read of their reference counts."""
        pages = np.array([p for key, j, m in runs for p in frame.block_pages(key, j, j + 2 * m)],
                         dtype=np.int64)
        refs = frame.refcounts(np.maximum(pages, 0))
        a, b = pages[0::2], pages[1::2]
        ok = (a >= 0) & (b >= 0) & (a != b) & (refs[0::2] == 1) & (refs[1::2] == 1)
        if sources:
            src = np.fromiter(sources, np.int64, len(sources))
            ok &= ~(np.isin(a, src) | np.isin(b, src))
        pairs = [(x, y) if k else None for x, y, k in zip(a.tolist(), b.tolist(), ok.tolist())]
        at = 0
        for key, j, m in runs:
            ahead[key] = (j, pairs[at: at + m])
            at += m

    def _ahead(self, frame: Frame, ahead: dict, key, j: int, limit: int,
               sources) -> tuple[int, int] | None:
        """The pages ``(a, b)`` of the pair at block ``j`` when it is eligible (else None) for
        the picking loop, from the pairs read
        ahead (:meth:`_read_ahead`); past them, the next run of twice as many is read."""
        got = ahead.get(key)
        if got is None or not got[0] <= j < got[0] + 2 * len(got[1]):
            m = min((limit - j) // 2, 8 if got is None else 2 * len(got[1]))
            self._read_ahead(frame, ahead, [(key, j, m)], sources)
            got = ahead[key]
        return got[1][(j - got[0]) // 2]

    def _demote(self, frame: Frame, pend: _Pending, want: int, picks=None,
                exclude=frozenset()) -> int:
        """Pick up to ``want`` pairs, the next one always from the session with the smallest
        BASE share (each session's pairs checked only as they are reached), and pack them;
        sessions in ``exclude`` give none. ``picks``: these ``(session, block)`` pairs
        instead, each the next of its span."""
        S = self.pager.page_size
        heap, plan = [], {}
        for key in self.pager.sessions():
            ok = frame.has(key) and key not in exclude
            got = self._start(frame, pend, key) if ok else None
            if got is not None:
                first, end, limit = got
                nb = -(-frame.length(key) // S)
                plan[key] = [first, end, end, limit]          # first, span end, next, limit
                heapq.heappush(heap, ((end - first) / nb, len(plan), key, nb))
        rows, who = [], []
        sources = {s for s, _ in frame.copies}
        ahead: dict = {}
        if picks is None and plan:          # read every session's first pairs at once
            m = -(-2 * min(want, self._host.free) // len(plan))
            self._read_ahead(frame, ahead, [(key, p[2], min(m, (p[3] - p[2]) // 2))
                                            for key, p in plan.items()], sources)
        if picks is not None:
            if len(picks) > self._host.free:
                raise ValueError(f"plan: demotes {len(picks)} pairs, the host pool has "
                                 f"{self._host.free} free slots")
            for key, j in picks:
                p = plan.get(key)
                ab = None if p is None or j != p[2] or j + 1 >= p[3] else \
                    self._ahead(frame, ahead, key, j, p[3], sources)
                if ab is None:
                    raise ValueError(f"plan: blocks {j}, {j + 1} of {key!r} cannot be demoted "
                                     f"here (span {self._span_now(key, pend)}, next pair "
                                     f"{None if p is None else p[2]}); this pager's state is "
                                     f"not the planner's")
                rows.append(ab)
                who.append((key, j))
                p[2] = j + 2
            heap = []
        want = min(want, self._host.free)
        while heap and len(rows) < want:
            _, order, key, nb = heapq.heappop(heap)
            p = plan[key]
            j = p[2]
            ab = self._ahead(frame, ahead, key, j, p[3], sources) if j + 1 < p[3] else None
            if ab is None:
                continue                                      # this session's span stops here
            rows.append(ab)
            who.append((key, j))
            p[2] = j + 2
            heapq.heappush(heap, ((j + 2 - p[0]) / nb, order, key, nb))
        if not rows:
            return 0
        pend.decided["demote"] = list(who)
        pages = np.array(rows, dtype=np.int32)
        triples = np.concatenate([pages, pages[:, :1]], axis=1)   # (a, b, a): in place
        slots = self._host.take(len(rows))                    # before the pack: may raise
        t0 = time.perf_counter()
        try:
            back = self._pack(triples)                        # [N, caches, 2, S, Hkv, D]
        except BaseException:
            for slot in slots:
                self._host.give(slot)
            raise
        frame.on_abort(lambda: self._undo_pack(triples, back, slots))
        self._to_host(back, slots)
        self.last_times["demote_s"] += time.perf_counter() - t0
        keys = [key for key, _ in who]
        js = [j for _, j in who]
        tops = [j + 1 for j in js]
        firsts = pages[:, 0]
        frame.remap_many(keys, tops, firsts)                  # block j + 1 onto page a
        firsts = firsts.tolist()
        pend.mine.update(zip(zip(keys, tops), firsts))
        pend.new_pairs.update(zip(firsts, map(_Pair, keys, js, slots)))
        for key, p in plan.items():
            if p[2] > p[1]:
                self._set_span(frame, pend, key, (p[0], p[2]))
        return len(rows)

    def _to_host(self, back: torch.Tensor, slots: list[int]) -> None:
        """A batch's device backing ``[N, caches, ...]`` -> its host slots, one copy a run of
        consecutive slots. On CUDA the copies run on the side stream after the packs (off the
        current stream's critical path); the device buffer stays referenced until they are
        done. Every later use of a slot (a promotion's copy up, the next demotion into a slot
        given back) is on the same stream, so it follows."""
        if not self._cuda:
            for i, slot, k in self._host.runs(slots):
                self._host.view(slot, k).copy_(back[i: i + k])
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            for i, slot, k in self._host.runs(slots):
                self._host.view(slot, k).copy_(back[i: i + k], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._side)
        self._d2h.append((ev, back))

    def _undo_pack(self, triples, back: torch.Tensor, slots) -> None:
        """The frame aborted after its pack: refine the pairs back where they were."""
        self._refine(triples, back)
        for slot in slots:
            self._host.give(slot)

    # -- the ops over every cache ----------------------------------------------------------------
    def _rows(self, triples) -> torch.Tensor:
        """int32 rows on the device: the triples, or for the one-pool view each triple once a
        cache, offset by the cache's first page (pair-major, so a backing is ``[N, caches]``).
        Built on the host with numpy and, on CUDA, copied up from pinned memory without
        waiting: the stream orders the copy before the op that reads it, and no host sync
        lands in the step (a pageable copy would wait for everything queued on the stream,
        e.g. a promotion's backing copy on the side stream)."""
        rows = np.asarray(triples, dtype=np.int32).reshape(-1, 3)
        if self._pool is not None:
            offs = np.arange(len(self.caches), dtype=np.int32) * np.int32(self.pager.num_pages)
            rows = (rows[:, None, :] + offs[None, :, None]).reshape(-1, 3)
        return upload(rows, self.device)

    def _pack(self, triples) -> torch.Tensor:
        """``pack_base_pairs`` of rows ``(src_a, src_b, dst)`` on every cache: one call over the
        one-pool view, else one a cache. Returns the backing ``[N, caches, 2, S, Hkv, D]``."""
        N, C = len(triples), len(self.caches)
        shape = (N, C, *self._host.slot_shape[1:])
        rows = self._rows(triples)
        if self._pool is not None:
            back = torch.empty(shape, dtype=self._host.dtype, device=self.device)
            torch.ops.kvops.pack_base_pairs(self._pool, rows, back.view(N * C, *shape[2:]),
                                            self.codec)
            return back
        backs = []
        for cache in self.caches:
            b = torch.empty((N, *shape[2:]), dtype=self._host.dtype, device=self.device)
            torch.ops.kvops.pack_base_pairs(cache, rows, b, self.codec)
            backs.append(b)
        return torch.stack(backs, dim=1)

    def _refine(self, triples, back: torch.Tensor) -> None:
        """``refine_base_pairs`` of rows ``(dst_a, dst_b, base_page)`` on every cache, from
        the contiguous backing ``[N, caches, 2, S, Hkv, D]``."""
        N, C = back.shape[:2]
        rows = self._rows(triples)
        if self._pool is not None:
            torch.ops.kvops.refine_base_pairs(self._pool, rows, back.view(N * C, *back.shape[2:]),
                                              self.codec)
            return
        for c, cache in enumerate(self.caches):
            torch.ops.kvops.refine_base_pairs(cache, rows, back[:, c].contiguous(), self.codec)

    def _warm(self) -> None:
        """Compile the pack and refine kernels for these caches now, on scratch pages of the
        same page stride and geometry: a kernel's first launch compiles it (hundreds of
        milliseconds), which would otherwise land on the first demotion and promotion."""
        c = self.caches[0]
        E = c[0].numel()
        base = torch.zeros(2 * c.stride(0) + E, dtype=c.dtype, device=self.device)
        scratch = base.as_strided((3, *c.shape[1:]), c.stride())
        rows = torch.tensor([[0, 1, 0]], dtype=torch.int32, device=self.device)
        back = torch.empty((1, *self._host.slot_shape[1:]), dtype=self._host.dtype,
                           device=self.device)
        torch.ops.kvops.pack_base_pairs(scratch, rows, back, self.codec)
        torch.ops.kvops.refine_base_pairs(scratch, rows, back, self.codec)
        rows = torch.tensor([[1, 2, 0]], dtype=torch.int32, device=self.device)
        torch.ops.kvops.refine_base_pairs(scratch, rows, back, self.codec)   # out of place
        if self._cuda:
            torch.cuda.synchronize(self.device)

    def _reap_d2h(self) -> None:
        self._d2h = [(ev, keep) for ev, keep in self._d2h if not ev.query()]

    # -- promotion -----------------------------------------------------------------------------
    def _promote(self, frame: Frame, pend: _Pending, want: int,
                 only: Hashable | None = None, picks=None) -> int:
        """Issue up to ``want`` promotions, top pairs of the sessions with the largest BASE
        share first (``only``: that session's pairs; ``picks``: these ``(session, block)``)."""
        if picks is not None:
            for key, j in picks:
                first, end = self._span_now(key, pend)
                if not frame.has(key) or not first <= j < end - 1 or (j - first) % 2 or any(
                        pr.j == j for pr in self._flight_now(key, pend)):
                    raise ValueError(f"plan: blocks {j}, {j + 1} of {key!r} are not a BASE "
                                     f"pair to promote here (span [{first}, {end})); this "
                                     f"pager's state is not the planner's")
            self._picked = list(picks)
            self._issue(frame, pend, self._picked)
            return len(picks)
        # each session's pairs come top first, their shares falling: merge the sessions on a
        # heap (ties: the earlier session), so a step looks at ``want`` pairs, not every pair
        S = self.pager.page_size
        heap = []
        keys = [only] if only is not None else list({**self._span, **pend.spans})
        for order, key in enumerate(keys):
            first, end = self._span_now(key, pend)
            if not frame.has(key) or end <= first:
                continue
            j = end - 2 * len(self._flight_now(key, pend)) - 2
            nb = -(-frame.length(key) // S)
            if j >= first:
                heap.append((-(j + 2 - first) / nb, order, j, first, nb, key))
        heapq.heapify(heap)
        picks = []
        while heap and len(picks) < want:
            _, order, j, first, nb, key = heap[0]
            picks.append((key, j))
            if j - 2 >= first:
                heapq.heapreplace(heap, (-(j - first) / nb, order, j - 2, first, nb, key))
            else:
                heapq.heappop(heap)
        self._picked = picks
        if picks:
            self._issue(frame, pend, picks)
        return len(picks)

    def _issue(self, frame: Frame, pend: _Pending, picks: list[tuple[Hashable, int]]) -> None:
        """One batch of promotions: hold two pages a pair, retain the BASE pages, and on the
        side stream copy the batch's backings up (a copy a run of host slots) and refine."""
        t0 = time.perf_counter()
        try:
            self._issue_batch(frame, pend, picks)
        finally:
            self.last_times["promote_s"] += time.perf_counter() - t0

    def _issue_batch(self, frame: Frame, pend: _Pending,
                     picks: list[tuple[Hashable, int]]) -> None:
        keys = [key for key, _ in picks]
        js = np.fromiter((j for _, j in picks), np.int64, len(picks))
        both = frame.pages_at(keys + keys, np.concatenate([js, js + 1]))
        pages, tops = both[:len(picks)], both[len(picks):]
        bad = (pages < 0) | (tops != pages)
        if bad.any():
            key, j = picks[int(bad.argmax())]
            raise ValueError(f"promote: BASE blocks {j}, {j + 1} of {key!r} were trimmed in "
                             f"this frame (a trim of a BASE block is refused at commit)")
        held = frame.hold(2 * len(picks))
        frame.retain_many(pages)
        pages = pages.tolist()
        slots = [self._pair_now(page, pend).slot for page in pages]
        # the refines run in host-slot order (rows are independent), so the backings come up
        # in one copy a run of consecutive slots whatever order the pairs were picked in
        order = sorted(range(len(pages)), key=slots.__getitem__)
        triples = [(held[2 * i], held[2 * i + 1], pages[i]) for i in order]
        ordered = [slots[i] for i in order]
        pool, m = self._host, len(pages)
        keep: list = []
        if self._cuda:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                dev = torch.empty((m, *pool.slot_shape), dtype=pool.dtype, device=self.device)
                for i, slot, k in pool.runs(ordered):
                    dev[i: i + k].copy_(pool.view(slot, k), non_blocking=True)
                self._refine(triples, dev)
                done = torch.cuda.Event()
                done.record(self._side)
            keep = [dev]
        else:
            runs = pool.runs(ordered)
            back = pool.view(runs[0][1], m) if len(runs) == 1 else \
                torch.cat([pool.view(slot, k) for _, slot, k in runs])
            self._refine(triples, back)
            done = None
        for i, ((key, j), page) in enumerate(zip(picks, pages)):
            pend.issued.setdefault(key, []).append(
                _Promotion(key, j, page, slots[i], (held[2 * i], held[2 * i + 1]), done, keep))
        frame.on_abort(lambda: done is not None and done.synchronize())

    def _settle(self, frame: Frame, pend: _Pending, plan: FidelityPlan | None = None) -> int:
        """Map finished promotions (each span's top pair first) and release the pages of
        orphans whose side-stream work is done; with ``plan``, exactly its promotions and
        orphans, after waiting for their side-stream work."""
        ready = lambda pr: pr.done is None or pr.done.query()        # noqa: E731
        if plan is not None:
            wanted = dict(plan.settle)
            for key, k in wanted.items():
                if len(self._flight.get(key, ())) < k or not frame.has(key):
                    raise ValueError(f"plan: settles {k} promotions of {key!r}, "
                                     f"{len(self._flight.get(key, ()))} are in flight here; "
                                     f"this pager's state is not the planner's")
            if any(i >= len(self._orphans) for i in plan.orphans):
                raise ValueError(f"plan: releases orphans {list(plan.orphans)}, "
                                 f"{len(self._orphans)} are here")
            for pr in [*(self._orphans[i] for i in plan.orphans),
                       *(pr for key, k in wanted.items() for pr in self._flight[key][:k])]:
                if pr.done is not None:
                    pr.done.synchronize()
        orphans = []
        rk, rj, rp, free = [], [], [], []       # the remaps and releases, made at once below
        for i, pr in enumerate(self._orphans):
            if (ready(pr) if plan is None else i in plan.orphans):
                free += (*pr.new, pr.page)
                pend.orphans_done.append(pr)
                orphans.append(i)
        settled, done = 0, []
        for key, stack in self._flight.items():
            k = 0
            if plan is None:
                while k < len(stack) and ready(stack[k]):
                    k += 1
            else:
                k = wanted.get(key, 0)
            if not k or not frame.has(key):
                continue
            done.append((key, k))
            for pr in stack[:k]:
                n0, n1 = pr.new
                rk += (key, key)
                rj += (pr.j, pr.j + 1)
                rp += (n0, n1)
                free += (n0, n1, pr.page)
                pend.gone.add(pr.page)
            first = self._span[key][0]
            end = stack[k - 1].j
            self._set_span(frame, pend, key, (first, end) if end > first else (0, 0))
            pend.settled[key] = k
            settled += k
        if rk:
            frame.remap_many(rk, rj, rp)
            pend.mine.update(zip(zip(rk, rj), rp))
        if free:
            frame.release_many(free)
        pend.decided["settle"], pend.decided["orphans"] = done, orphans
        return settled

    def promote(self, frame: Frame, key: Hashable, limit: int | None = None) -> int:
        """Issue promotions of every BASE pair of ``key`` not yet in flight (whatever the
        reserve), or of its top ``limit`` pairs (two held pages each); raises
        :class:`~kvops.runtime.OutOfPages` if the pool cannot hold them."""
        want = 1 << 30 if limit is None else as_int("limit", limit)
        return self._promote(frame, self._now(frame), want, only=key) if want else 0

    def drain(self) -> None:
        """Wait for every promotion in flight (the caller then settles them with ``step``) and
        for the host backing chunks being pinned ahead (``host_ahead``)."""
        self._host.wait()
        self._wait_promotions()

    def _wait_promotions(self) -> None:
        """Wait for the side-stream work of every promotion in flight and every orphan."""
        for pr in [*self._orphans, *(p for s in self._flight.values() for p in s)]:
            if pr.done is not None:
                pr.done.synchronize()
