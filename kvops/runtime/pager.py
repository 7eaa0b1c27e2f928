"""The KV pager (KV-RM section 4.2): page pool, per-session views, four verbs, Frame commits.

The device always runs the same fixed-shape kernels; the pager changes which pages they see.

Pool and allocator
    ``P`` physical pages of ``S`` tokens. Free pages are kept as maximal spans
    ``[start, start + n)`` in free lists partitioned by span size (list ``b`` holds spans of
    ``2**b .. 2**(b+1) - 1`` pages), with boundary tags so that freeing a page coalesces with
    its neighbours in O(1). A session grows into the page right after its last page when that
    page starts a free span; a new session is placed in the middle of a span from the largest
    list, leaving room on both sides; a request for ``n`` pages otherwise takes a span from the
    smallest list whose spans all hold ``n``. Sessions therefore stay physically contiguous and
    the transport's trains long. Reserve and trim are O(1) per block.

Views
    A session (any hashable key) has a slot row in the device tables, a length in tokens and a
    list of pages, one per logical block ``j`` (tokens ``[j*S, (j+1)*S)``); ``-1`` marks a
    trimmed block. Pages are reference counted: ``alias`` shares a prefix, and the first write
    into a shared page (a ``reserve`` whose new tokens land in a partly filled shared tail)
    copies it first (copy-on-write). The copy is returned in the commit's ``copies`` for the
    caller to run on the device (:func:`apply_copies`).

Verbs (all inside a frame)
    ``reserve(session, n_tokens)``: extend the session by ``n_tokens`` (creating it when new),
    allocating the blocks the new tokens need. ``alias(dst, src, n_tokens)``: a new session
    ``dst`` sharing the first ``n_tokens`` of ``src``. ``trim(session, blocks=None)``: give the
    listed logical blocks back (cold blocks), or with ``blocks=None`` end the session (EOS): all
    its blocks and its slot go back. Pages reach the free lists when their count drops to zero,
    at commit. Plus the generic ``edit(table, row, values, start=0)``, which writes a run of
    values into a row of any registered table (policies such as the far view carry their
    per-session tables through the same commit). Policies that move a block's bytes
    themselves (the ElasticKV fidelity policy, :mod:`kvops.runtime.fidelity`) use
    ``remap(session, j, page)``, ``hold(n)`` / ``retain(page)`` / ``release(page)`` (references
    not tied to a block) and ``on_commit(fn)`` / ``on_abort(fn)`` callbacks.

Frame
    ``with pager.frame() as f: f.reserve(...); ...`` (or ``pager.reserve`` while a frame is
    open). Every edit goes to the frame's shadow descriptor (an overlay of the touched
    sessions' blocks and lengths plus pending reference-count changes); the active descriptor is
    not touched until commit. A session whose only edit is growth (the decode step: tokens
    into its unshared tail page or into fresh blocks) takes a fast path that records its new
    length, slot and tail page in flat dicts, which the commit turns into arrays with no
    per-session Python (:class:`GrownBatch`). Commit (at the end of the ``with``, or
    ``f.commit()``) applies the overlay in O(edits), bumps the epoch, runs the hooks (the
    transport plans its trains there), writes the changed table entries and ends in ONE
    host-to-device copy of the fixed-shape table buffer. Committing the same frame again
    returns the same :class:`Commit` and changes nothing (idempotent retry). An exception
    inside the ``with`` aborts the frame: pages it allocated go back, and every session's
    mapping is as before. Running out of pages raises
    :class:`OutOfPages` from the verb, before it changes anything.

Tables (one int32 buffer on the device, fixed shapes after the first commit)
    ``block_table [B, L]`` (page of logical block ``j`` of slot ``b``, ``-1`` none),
    ``seq_lens [B]`` (tokens), plus any table added with :meth:`Pager.add_table` or by a hook
    (the transport's ``trains [T, 3]``, ``num_trains [1]``, ``win_start [B]``, ``win_len [B]``).
    ``pager.device_tables[name]`` are views into the device buffer: capture a CUDA graph on them
    once; every commit refreshes them in place.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch


class OutOfPages(MemoryError):
    """The pool cannot satisfy a reserve; raised before any mapping changes."""


class SpanAllocator:
    """Free pages as maximal spans in size-partitioned free lists; O(1) take and give."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free = 0
        self._len_at: dict[int, int] = {}       # span start -> length
        self._start_of_last: dict[int, int] = {}  # span's last page -> start
        self._lists: list[dict[int, None]] = [{} for _ in range(max(1, num_pages.bit_length()))]
        self._insert(0, num_pages)

    def _insert(self, start: int, n: int) -> None:
        self._len_at[start] = n
        self._start_of_last[start + n - 1] = start
        self._lists[n.bit_length() - 1][start] = None
        self.free += n

    def _remove(self, start: int) -> int:
        n = self._len_at.pop(start)
        del self._start_of_last[start + n - 1]
        del self._lists[n.bit_length() - 1][start]
        self.free -= n
        return n

    def _take_from(self, start: int, offset: int, n: int) -> int:
        """Cut ``n`` pages at ``start + offset`` out of the free span at ``start``."""
        length = self._remove(start)
        if offset:
            self._insert(start, offset)
        rest = length - offset - n
        if rest:
            self._insert(start + offset + n, rest)
        return start + offset

    def take_at(self, page: int, n: int) -> int:
        """Take up to ``n`` pages starting exactly at ``page`` when a free span starts there.

        Returns how many were taken (0 when ``page`` does not start a free span).
        """
        length = self._len_at.get(page)
        if not length:
            return 0
        k = min(n, length)
        self._take_from(page, 0, k)
        return k

    def take(self, n: int, *, spread: bool = False) -> list[tuple[int, int]]:
        """Take ``n`` pages as few contiguous runs ``(start, count)`` as the free lists allow.

        ``spread`` (a new session): from the largest list, in the middle of the span, so the
        session and the one before the span can both grow in place.
        """
        if n > self.free:
            raise OutOfPages(f"pager: need {n} free pages, have {self.free} of {self.num_pages}")
        runs = []
        while n:
            fit = max(0, (n - 1).bit_length())        # spans in list >= fit hold n pages
            lists = self._lists
            pick = -1
            if spread:
                for b in range(len(lists) - 1, -1, -1):
                    if lists[b]:
                        pick = b
                        break
            else:
                for b in range(fit, len(lists)):
                    if lists[b]:
                        pick = b
                        break
                if pick < 0:                           # nothing holds n: the largest, in parts
                    for b in range(fit - 1, -1, -1):
                        if lists[b]:
                            pick = b
                            break
            start = next(iter(lists[pick]))
            length = self._len_at[start]
            k = min(n, length)
            offset = (length - k) // 2 if spread and start > 0 else 0
            runs.append((self._take_from(start, offset, k), k))
            n -= k
        return runs

    def give(self, page: int) -> None:
        """Return one page, merging it with free neighbours."""
        start, n = page, 1
        left = self._start_of_last.get(page - 1)
        if left is not None:
            n += self._remove(left)
            start = left
        if page + 1 in self._len_at:
            n += self._remove(page + 1)
        self._insert(start, n)

    def spans(self) -> list[tuple[int, int]]:
        """Free spans ``(start, length)`` sorted by start (for tests and stats)."""
        return sorted(self._len_at.items())


@dataclass(slots=True)
class _Session:
    slot: int
    blocks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SessionDelta:
    """What a commit changed for one session, for hooks (the transport reads it).

    ``before_*`` describe the active view before the commit (length 0 and no blocks for a new
    session); ``page_after(j)`` reads the committed view; ``closed`` is an EOS trim.
    """

    key: Hashable
    slot: int
    new: bool
    closed: bool
    before_length: int
    before_blocks: list[int]
    after_length: int
    after_overlay: dict[int, int]

    def page_before(self, j: int) -> int:
        return self.before_blocks[j] if j < len(self.before_blocks) else -1

    def page_after(self, j: int) -> int:
        if self.closed:
            return -1
        page = self.after_overlay.get(j)
        if page is not None:
            return page
        return self.page_before(j)


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False

def _const(value: int) -> np.ndarray:
    """A read-only 0-d int64 array: as an operand of an array op it costs less than a Python
    int (converted per call) or a numpy scalar (~0.35 against 0.5 us for 64 elements)."""
    out = np.array(value, dtype=np.int64)
    out.flags.writeable = False
    return out


_HIGH = _const(32)                  # the growth fast path packs slot << 32 | tail page
_LOW = _const(0xFFFFFFFF)


class GrownBatch:
    """Sessions whose only edit in a frame was growth, as arrays for vectorized hooks.

    ``slots``, ``before`` and ``after`` lengths, ``tails`` (the page that holds each
    session's last token after the growth) and ``packed`` (``slots << 32 | tails``) are int64
    ``[n]``; ``keys`` are the sessions in the same order. By default a hook gets the sessions
    that grew inside their unshared tail page: their blocks did not change (the common decode
    step). A hook whose class sets ``grown_appends = True`` (the transport) also gets the
    sessions that appended fresh blocks (a decode step crossing a page boundary, or a longer
    append to an unshared tail); ``multi`` then lists the ``(position, key)`` of those whose
    new tokens landed in more than one block, and ``Frame.page`` reads their new pages. All
    but ``slots`` and ``after`` are computed when first read, from the committed lengths and
    the frame: read them inside ``on_commit`` (a first read after the commit raises).
    """

    __slots__ = ("slots", "after", "_before", "_tails", "_keys", "_multi", "_packed",
                 "_frame", "_lens")

    def __init__(self, slots: np.ndarray, before: np.ndarray, after: np.ndarray,
                 tails: np.ndarray | None = None, keys: list | None = None,
                 multi: list | None = None):
        self.slots, self.after = slots, after
        self._before, self._tails, self._keys = before, tails, keys
        self._multi = [] if multi is None else multi
        self._packed = self._frame = self._lens = None

    @classmethod
    def _of_frame(cls, frame: Frame, packed: np.ndarray, after: np.ndarray,
                  seq_lens: np.ndarray) -> GrownBatch:
        """The frame's growth-only sessions; ``packed`` holds ``slot << 32 | tail``."""
        batch = cls.__new__(cls)
        batch.slots, batch.after = packed >> _HIGH, after
        batch._before = batch._tails = batch._keys = None
        batch._multi = None if frame._gmulti else []
        batch._packed, batch._frame, batch._lens = packed, frame, seq_lens
        return batch

    @property
    def before(self) -> np.ndarray:
        if self._before is None:
            if self._lens is None:
                raise RuntimeError("GrownBatch: read its lazy fields inside on_commit")
            self._before = self._lens[self.slots].astype(np.int64)
        return self._before

    @property
    def tails(self) -> np.ndarray:
        if self._tails is None:
            self._live()
            self._tails = self._packed & _LOW
        return self._tails

    @property
    def packed(self) -> np.ndarray:
        """``slots << 32 | tails`` (int64), the form the transport builds its moves from."""
        if self._packed is None:
            self._packed = self.slots << _HIGH | self.tails
        return self._packed

    @property
    def keys(self) -> list:
        if self._keys is None:
            self._keys = list(self._live()._grown)
        return self._keys

    @property
    def multi(self) -> list:
        if self._multi is None:
            multi = self._live()._gmulti
            self._multi = [(i, k) for i, k in enumerate(self._frame._grown) if k in multi] \
                if multi else []
        return self._multi

    def _live(self) -> Frame:
        if self._frame is None:
            raise RuntimeError("GrownBatch: this field was not given, or is read after the "
                               "commit (read the pager's batch inside on_commit)")
        return self._frame

    def _seal(self) -> None:
        self._lens = self._frame = None

    def _tail_only(self) -> GrownBatch:
        """The sessions that did not append blocks (what a hook without ``grown_appends``
        gets)."""
        app = self._frame._app
        keep = [i for i, k in enumerate(self._frame._grown) if k not in app]
        at = np.array(keep, dtype=np.int64)
        keys = self.keys
        return GrownBatch(self.slots[at], self.before[at], self.after[at], self.tails[at],
                          [keys[i] for i in keep])


@dataclass
class Commit:
    """Result of one frame commit: its epoch, the copy-on-write page copies ``(src, dst)`` the
    caller must run on the device before the step reads the pool, and what the hooks report."""

    epoch: int
    copies: list[tuple[int, int]]
    sessions: int
    stats: dict = field(default_factory=dict)


class Frame:
    """The shadow descriptor of one step; see the module doc. Get one from :meth:`Pager.frame`.

    Two kinds of shadow state. Sessions with general edits (new, aliased, trimmed, closed,
    copied on write) are in ``_length`` (their length in this frame) and ``_overlay`` (their
    remapped blocks). Committed sessions whose only edits are growth into their own unshared
    tail page or into fresh blocks (the decode step) are in four dicts kept in the same key
    order, so the commit turns them into arrays without a Python loop: ``_grown`` (length),
    ``_gst`` (``slot << 32 | tail``, tail the page of the last token), plus ``_app``
    (fresh pages, which continue the committed blocks) and ``_gmulti`` (keys whose tokens
    landed in more than one block).
    A growth-only session that gets any other edit moves to the general state (``_slow``).
    """

    def __init__(self, pager: Pager):
        self.pager = pager
        self.epoch = pager.epoch + 1
        self.result: Commit | None = None
        self.aborted = False
        self._overlay: dict[Hashable, dict[int, int]] = {}
        self._length: dict[Hashable, int] = {}
        self._new: dict[Hashable, int] = {}            # new session -> slot
        self._closed: set[Hashable] = set()
        self._grown: dict[Hashable, int] = {}          # growth only (the fast path): length
        self._gst: dict[Hashable, int] = {}
        self._app: dict[Hashable, list[int]] = {}
        self._gmulti: set[Hashable] = set()
        self._ref: dict[int, int] = {}                 # pending refcount changes
        self._allocated: list[int] = []
        self._copies: list[tuple[int, int]] = []
        self._edits: list[tuple] = []                  # (setter, where, values, region)
        self._slots_taken: list[int] = []
        self._undo: list = []                          # on_abort callbacks
        self._after: list = []                         # on_commit callbacks

    # -- reads through the shadow ------------------------------------------------------------
    def has(self, key: Hashable) -> bool:
        """Whether ``key`` is a live session in this frame's view."""
        if key in self._closed:
            return False
        return key in self._new or key in self.pager._sessions

    def length(self, key: Hashable) -> int:
        """Tokens of ``key`` in this frame's view."""
        self._require(key)
        got = self._length.get(key)
        if got is None:
            got = self._grown.get(key)
            if got is None:
                got = self.pager._len[key]
        return got

    def page(self, key: Hashable, j: int) -> int:
        """Page of logical block ``j`` of ``key`` in this frame's view (``-1`` none)."""
        self._require(key)
        over = self._overlay.get(key)
        if over is not None and j in over:
            return over[j]
        sess = self.pager._sessions.get(key)
        if sess is None:
            return -1
        blocks = sess.blocks
        if j < len(blocks):
            return blocks[j]
        app = self._app.get(key)
        j -= len(blocks)
        return app[j] if app is not None and j < len(app) else -1

    def pages(self, key: Hashable) -> list[int]:
        """Pages of every logical block of ``key`` in this frame's view."""
        n = -(-self.length(key) // self.pager.page_size)
        return [self.page(key, j) for j in range(n)]

    def refcount(self, page: int) -> int:
        return self.pager._refs[page] + self._ref.get(page, 0)

    def _require(self, key):
        if not self.has(key):
            raise KeyError(f"session {key!r}: not a live session")

    def _open(self):
        if self.result is not None or self.aborted:
            raise RuntimeError(f"frame of epoch {self.epoch} is closed; open a new frame")

    # -- verbs -------------------------------------------------------------------------------
    def _new_session(self, key) -> None:
        pager = self.pager
        if key in self._closed:
            raise ValueError(f"session {key!r} ended in this frame; reuse its key in a later "
                             f"frame")
        if not pager._free_slots:
            raise OutOfPages(f"pager: all {pager.max_sessions} session slots are in use")
        slot = pager._free_slots.pop()
        self._slots_taken.append(slot)
        self._new[key] = slot
        self._length[key] = 0
        self._overlay[key] = {}

    def _slow(self, key) -> None:
        """Committed session ``key`` gets edits beyond growth: track it in the general
        overlay (its fresh pages become overlay entries)."""
        if key in self._length or key not in self.pager._sessions:
            return
        after = self._grown.pop(key, None)
        if after is None:
            self._length[key] = self.pager._len[key]
            return
        del self._gst[key]
        self._gmulti.discard(key)
        app = self._app.pop(key, None)
        if app:
            base = len(self.pager._sessions[key].blocks)
            over = self._overlay.setdefault(key, {})
            for i, page in enumerate(app):
                over[base + i] = page
        self._length[key] = after

    def _set(self, key, j: int, page: int) -> None:
        over = self._overlay.get(key)
        if over is None:
            over = self._overlay[key] = {}
        over[j] = page

    def _bump(self, page: int, d: int) -> None:
        self._ref[page] = self._ref.get(page, 0) + d

    def _alloc(self, n: int, after: int, fresh: bool) -> list[int]:
        """``n`` pages, continuing right after page ``after`` when it can."""
        alloc = self.pager._alloc
        if n > alloc.free:
            raise OutOfPages(f"pager: need {n} free pages, have {alloc.free} of "
                             f"{alloc.num_pages}")
        pages: list[int] = []
        if after >= 0:
            k = alloc.take_at(after + 1, n)
            pages.extend(range(after + 1, after + 1 + k))
        if len(pages) < n:
            for start, k in alloc.take(n - len(pages), spread=fresh and not pages):
                pages.extend(range(start, start + k))
        self._allocated.extend(pages)
        ref = self._ref
        for p in pages:
            ref[p] = ref.get(p, 0) + 1
        return pages

    def _append(self, key, sess: _Session, old: int, n_tokens: int) -> bool:
        """Growth into fresh blocks of a growth-only session (the fast path's second half).

        False, with nothing changed, when the general path must take it: the partly filled
        tail is shared (copy-on-write) or trimmed, the block table is too short, or the pool
        is (the general path raises)."""
        pager = self.pager
        S = pager.page_size
        new = old + n_tokens
        nb_old, nb_new = -(-old // S), -(-new // S)
        if nb_new > pager.max_blocks or nb_new - nb_old > pager._alloc.free:
            return False
        blocks, app = sess.blocks, self._app.get(key)
        have = len(blocks)
        if old & (S - 1):                              # the tail page takes tokens too
            j = old // S
            tail = blocks[j] if j < have else app[j - have]
            if tail < 0 or pager._refs[tail] + self._ref.get(tail, 0) != 1:
                return False
        j = nb_old - 1
        last = -1 if j < 0 else blocks[j] if j < have else app[j - have]
        pages = self._alloc(nb_new - nb_old, last, False)
        if app is None:
            self._app[key] = pages
        else:
            app.extend(pages)
        self._grown[key] = new
        self._gst[key] = sess.slot << 32 | pages[-1]
        if (new - 1) // S > pager._len[key] // S:     # past the committed tail page
            self._gmulti.add(key)
        return True

    def reserve(self, key: Hashable, n_tokens: int) -> None:
        """Extend ``key`` by ``n_tokens`` tokens (a new key starts a session)."""
        if self.result is not None or self.aborted:
            self._open()
        if not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"n_tokens: expected an int >= 0, got {n_tokens!r}")
        pager = self.pager
        # fast path (a decode step): a committed session with no other edits in this frame
        sess = pager._sessions.get(key)
        if sess is not None and key not in self._length:
            old = self._grown.get(key)
            first = old is None
            if first:
                old = pager._len[key]
            if not n_tokens:
                return
            S = pager.page_size
            r = old & (S - 1)
            if r and r + n_tokens <= S:                    # inside the tail page
                j = old // S
                blocks = sess.blocks
                tail = blocks[j] if j < len(blocks) else self._app[key][j - len(blocks)]
                if tail >= 0 and pager._refs[tail] + self._ref.get(tail, 0) == 1:
                    self._grown[key] = old + n_tokens
                    if first:
                        self._gst[key] = sess.slot << 32 | tail
                    return
            elif self._append(key, sess, old, n_tokens):
                return
        S, L = pager.page_size, pager.max_blocks
        self._slow(key)
        fresh = not self.has(key)
        old = 0 if fresh else self.length(key)
        new = old + n_tokens
        nb_old, nb_new = -(-old // S), -(-new // S)
        if nb_new > L:
            raise ValueError(f"reserve: session {key!r} would need {nb_new} blocks, the block "
                             f"table holds L={L}")
        if n_tokens == 0:
            if fresh:
                self._new_session(key)
            return
        tail = old // S if old % S else -1           # partly filled block the tokens land in
        tail_page = self.page(key, tail) if tail >= 0 and not fresh else -1
        if tail >= 0 and tail_page < 0:
            raise ValueError(f"reserve: session {key!r} writes into trimmed block {tail}")
        cow = tail_page >= 0 and self.refcount(tail_page) > 1
        need = nb_new - nb_old + int(cow)
        if need > pager._alloc.free:
            raise OutOfPages(f"pager: reserve({key!r}, {n_tokens}) needs {need} pages, "
                             f"{pager._alloc.free} of {pager.num_pages} free")
        if fresh:
            self._new_session(key)
        last = self.page(key, nb_old - 1) if nb_old else -1
        pages = self._alloc(need, last, fresh) if need else []
        if cow:
            page = pages.pop(0)
            self._copies.append((tail_page, page))
            self._bump(tail_page, -1)
            self._set(key, tail, page)
        for j, page in zip(range(nb_old, nb_new), pages):
            self._set(key, j, page)
        self._length[key] = new

    def alias(self, dst: Hashable, src: Hashable, n_tokens: int) -> None:
        """New session ``dst`` sharing the first ``n_tokens`` tokens of ``src`` (refcounted)."""
        self._open()
        self._require(src)
        if self.has(dst):
            raise ValueError(f"alias: destination session {dst!r} already exists")
        if not isinstance(n_tokens, int) or not 0 <= n_tokens <= self.length(src):
            raise ValueError(f"alias: n_tokens must be an int in [0, {self.length(src)}] "
                             f"(the length of {src!r}), got {n_tokens!r}")
        nb = -(-n_tokens // self.pager.page_size)
        shared = [self.page(src, j) for j in range(nb)]
        if any(p < 0 for p in shared):
            raise ValueError(f"alias: the first {n_tokens} tokens of {src!r} include trimmed "
                             f"blocks")
        self._new_session(dst)
        for j, page in enumerate(shared):
            self._bump(page, 1)
            self._set(dst, j, page)
        self._length[dst] = n_tokens

    def trim(self, key: Hashable, blocks: Iterable[int] | None = None) -> None:
        """Give back logical ``blocks`` of ``key`` (already trimmed ones are skipped), or end the
        session (EOS) with ``blocks=None``."""
        self._open()
        self._require(key)
        self._slow(key)
        nb = -(-self.length(key) // self.pager.page_size)
        if blocks is None:
            for j in range(nb):
                page = self.page(key, j)
                if page >= 0:
                    self._bump(page, -1)
            if key in self._new:
                self.pager._free_slots.append(self._new.pop(key))
                self._slots_taken.remove(self.pager._free_slots[-1])
                self._overlay.pop(key, None)
                self._length.pop(key, None)
            else:
                self._closed.add(key)
            return
        blocks = list(blocks)
        bad = [j for j in blocks if not isinstance(j, int) or not 0 <= j < nb]
        if bad:
            raise ValueError(f"trim: blocks of {key!r} must lie in [0, {nb}), got {bad[0]!r}")
        for j in blocks:
            page = self.page(key, j)
            if page >= 0:
                self._bump(page, -1)
                self._set(key, j, -1)

    # -- verbs for policies that move a block's bytes themselves (kvops.runtime.fidelity) --
    def remap(self, key: Hashable, j: int, page: int) -> None:
        """Point logical block ``j`` of ``key`` at ``page``, a live page (mapped, or held by
        :meth:`hold`), moving one reference from the block's old page to it. The caller keeps
        the bytes consistent (ElasticKV: a BASE pair page for two blocks, or a refined page)."""
        self._open()
        self._require(key)
        nb = -(-self.length(key) // self.pager.page_size)
        if not isinstance(j, int) or not 0 <= j < nb:
            raise ValueError(f"remap: block of {key!r} must lie in [0, {nb}), got {j!r}")
        self._live_page("remap", page)
        old = self.page(key, j)
        if old < 0:
            raise ValueError(f"remap: block {j} of {key!r} is trimmed")
        self._slow(key)
        self._bump(old, -1)
        self._bump(page, 1)
        self._set(key, j, page)

    def hold(self, n: int) -> list[int]:
        """Take ``n`` free pages that no block maps, one reference each, until :meth:`release`
        (staging pages; an aborted frame gives them back). Raises :class:`OutOfPages` first
        when fewer are free."""
        self._open()
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"hold: n must be an int >= 0, got {n!r}")
        return self._alloc(n, -1, False) if n else []

    def retain(self, page: int) -> None:
        """One more reference to a live ``page``, so it outlives its blocks until
        :meth:`release` (a page still being read on another stream)."""
        self._open()
        self._live_page("retain", page)
        self._bump(page, 1)

    def release(self, page: int) -> None:
        """Drop a reference taken by :meth:`hold` or :meth:`retain`; the page goes back to the
        pool at commit when no reference is left."""
        self._open()
        self._live_page("release", page)
        self._bump(page, -1)

    def _live_page(self, verb: str, page) -> None:
        P = self.pager.num_pages
        if not isinstance(page, int) or not 0 <= page < P or self.refcount(page) < 1:
            raise ValueError(f"{verb}: page must be a live page in [0, {P}), got {page!r}")

    def on_commit(self, fn) -> None:
        """Call ``fn()`` once this frame has committed (tables written and uploaded), in the
        order registered, hooks' registrations last: a policy's host state that must change
        only if the frame does. The commit is complete before the first call, so an exception
        from ``fn`` reaches the caller without undoing it, after the other callbacks ran (the
        first exception is raised)."""
        self._open()
        self._after.append(fn)

    def on_abort(self, fn) -> None:
        """Call ``fn()`` if this frame aborts (a policy undoing device work it did for the
        frame), before the frame's held and allocated pages go back to the pool."""
        self._open()
        self._undo.append(fn)

    def edit(self, table: str, row: int, values, start: int = 0) -> None:
        """Write ``values`` as a run from ``table[row, start]`` at commit (row-major, so a
        long run continues into the following rows).

        For a 1-D table, ``row`` is the element index. Any table given to
        :meth:`Pager.add_table` can be edited; edits land in the same single upload.
        """
        self._open()
        offset, shape = self.pager._layout_of(table)
        vals = np.asarray(values, dtype=np.int32).reshape(-1)
        width = self.pager._width[table]
        if not 0 <= row < shape[0] or start < 0 or row * width + start + vals.size > \
                shape[0] * width:
            raise ValueError(f"edit: {table}{list(shape)} has no run row={row}, "
                             f"[{start}, {start + vals.size})")
        at = offset + row * width + start
        where = slice(at, at + vals.size)
        self._edits.append((self.pager._master.__setitem__, where, vals, where))

    def scatter(self, table: str, rows, values) -> None:
        """Write ``table[rows[i]] = values[i]`` into a 1-D table at commit."""
        self._open()
        offset, shape = self.pager._layout_of(table)
        if len(shape) != 1:
            raise ValueError(f"scatter: {table}{list(shape)} is not 1-D; use edit()")
        at = np.asarray(rows, dtype=np.int64)
        vals = np.asarray(values, dtype=np.int32)
        if at.shape != vals.shape or at.ndim != 1:
            raise ValueError(f"scatter: rows and values must be equal-length 1-D, got "
                             f"{at.shape} and {vals.shape}")
        if at.size and (at.min() < 0 or at.max() >= shape[0]):
            raise ValueError(f"scatter: rows of {table}[{shape[0]}] out of range")
        at += offset
        self._edits.append((self.pager._master.__setitem__, at, vals, at))

    def _put(self, table: str, index, values) -> None:
        """``pager.host_tables[table][index] = values`` at commit, unchecked: the fast edit
        for this package's hooks, which compute in-range indices (``index`` a numpy index:
        an int, or a slice along dim 0, alone or in a tuple)."""
        self._edits.append((self.pager._setters[table], index, values, table))

    def _put_with(self, setter, table: str, index, values) -> None:
        """``setter(index, values)`` at commit, unchecked: a hook's own writer into
        ``pager.host_tables[table]`` (a cached view's ``__setitem__``), ``index`` a slice
        along dim 0 of that table or anything else (the upload then copies the whole table)."""
        self._edits.append((setter, index, values, table))

    def _put_rows(self, table: str, rows: np.ndarray, values) -> None:
        """``pager.host_tables[table][rows] = values`` at commit for a 1-D table and an int64
        index array, unchecked (``ndarray.put``, the cheapest scatter)."""
        self._edits.append((self.pager._putters[table], rows, values, table))

    def _put_host(self, array, index, values) -> None:
        """``array[index] = values`` at commit, for a hook's own host-side state that must
        change only when the commit does (nothing is uploaded)."""
        self._edits.append((array.__setitem__, index, values, None))

    # -- commit / abort ----------------------------------------------------------------------
    def commit(self) -> Commit:
        """Apply the shadow atomically; a second call returns the first result unchanged."""
        if self.result is not None:
            return self.result
        if self.aborted:
            raise RuntimeError(f"frame of epoch {self.epoch} was aborted")
        try:
            self.result = self.pager._commit(self)
        except BaseException:
            self.abort()
            raise
        error = None
        for fn in self._after:          # every callback runs, even after one raised
            try:
                fn()
            except Exception as e:      # noqa: BLE001 - the first is re-raised below
                error = error or e
        if error is not None:
            raise error
        return self.result

    def abort(self) -> None:
        """Drop the shadow: pages this frame allocated go back, nothing else changes."""
        if self.result is not None or self.aborted:
            return
        self.aborted = True
        pager = self.pager
        try:
            for fn in reversed(self._undo):
                fn()
        finally:
            for page in self._allocated:
                pager._alloc.give(page)
            pager._free_slots.extend(self._slots_taken)
            pager._open = None

    def __enter__(self) -> Frame:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.abort()
        else:
            self.commit()
        return False


class Pager:
    """Page pool + session views + Frame commits. See the module doc for the whole contract.

    Parameters
    ----------
    num_pages, page_size : int
        The pool ``[P, S, Hkv, D]`` this pager maps (``P``, ``S``).
    max_sessions : int
        ``B``, rows of every per-session table.
    max_blocks : int
        ``L``, logical blocks per session the block table holds.
    device : torch.device or str or None
        Where the tables are uploaded at each commit (one copy of one int32 buffer; pinned and
        double-buffered on CUDA). ``None`` keeps host tables only (no upload).
    """

    def __init__(self, num_pages: int, page_size: int, max_sessions: int, max_blocks: int,
                 device: torch.device | str | None = None):
        if num_pages < 1 or max_sessions < 1 or max_blocks < 1:
            raise ValueError(f"Pager: num_pages, max_sessions and max_blocks must be >= 1, got "
                             f"{num_pages}, {max_sessions}, {max_blocks}")
        if num_pages > 2**31 or max_sessions > 2**31:
            raise ValueError(f"Pager: page ids and slots are int32, got {num_pages} pages and "
                             f"{max_sessions} sessions")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"Pager: page_size must be a power of two, got {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.max_sessions, self.max_blocks = max_sessions, max_blocks
        self.device = torch.device(device) if device is not None else None
        self.epoch = 0
        self._alloc = SpanAllocator(num_pages)
        self._refs = [0] * num_pages
        self._sessions: dict[Hashable, _Session] = {}
        self._len: dict[Hashable, int] = {}            # committed length of each session
        self._free_slots = list(range(max_sessions - 1, -1, -1))
        self._open: Frame | None = None
        self._hooks: list[tuple[object, bool]] = []    # (hook, takes appends in the batch)
        self._specs: dict[str, tuple[tuple[int, ...], int]] = {}
        self._layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._frozen = False
        self.add_table("block_table", (max_sessions, max_blocks), fill=-1)
        self.add_table("seq_lens", (max_sessions,), fill=0)

    # -- tables ------------------------------------------------------------------------------
    def add_table(self, name: str, shape: tuple[int, ...], fill: int = 0) -> None:
        """Register an int32 table uploaded with every commit; only before the first frame."""
        if self._frozen:
            raise RuntimeError(f"add_table({name!r}): tables are fixed once a frame has opened")
        if name in self._specs:
            raise ValueError(f"add_table: table {name!r} already exists")
        self._specs[name] = (tuple(int(s) for s in shape), int(fill))

    def attach(self, hook) -> None:
        """Add a commit hook (e.g. the transport): an object with ``tables()`` -> ``{name:
        (shape, fill)}`` and ``on_commit(frame, deltas, grown) -> stats dict`` (``deltas``: a
        :class:`SessionDelta` per session with general edits; ``grown``: a
        :class:`GrownBatch` of growth-only sessions). It edits its tables through
        ``frame.edit`` / ``frame.scatter``, before anything is applied. A hook whose class
        sets ``grown_appends = True`` gets the sessions that appended fresh blocks in
        ``grown``; any other hook gets them as deltas (and ``grown`` holds tail-only growth).
        Only before the first frame. A hook with a ``check_peer(other)`` method is asked about
        every other hook on the pager, whichever attached first, and raises to refuse it
        (nothing is attached then)."""
        if self._frozen:
            raise RuntimeError("attach: hooks are fixed once a frame has opened")
        for other, _ in self._hooks:
            for a, b in ((other, hook), (hook, other)):
                if hasattr(a, "check_peer"):
                    a.check_peer(b)
        for name, (shape, fill) in hook.tables().items():
            self.add_table(name, shape, fill)
        self._hooks.append((hook, bool(getattr(hook, "grown_appends", False))))

    def _freeze(self) -> None:
        offset = 0
        for name, (shape, _) in self._specs.items():
            self._layout[name] = (offset, shape)
            offset += int(np.prod(shape))
        self._size = offset
        master = np.empty(offset, dtype=np.int32)
        for name, (shape, fill) in self._specs.items():
            off = self._layout[name][0]
            master[off: off + int(np.prod(shape))] = fill
        self._master = master
        self._stage, self._events, self._last_changed = [], [], []
        self.device_tables: dict[str, torch.Tensor] = {}
        if self.device is not None:
            pin = self.device.type == "cuda"
            for _ in range(2):
                buf = torch.from_numpy(master.copy())
                self._stage.append(buf.pin_memory() if pin else buf)
                self._events.append(torch.cuda.Event() if pin else None)
            self._device_buf = self._stage[0].to(self.device, copy=True)
            for name, (off, shape) in self._layout.items():
                n = int(np.prod(shape))
                self.device_tables[name] = self._device_buf[off: off + n].view(shape)
        self.host_tables = {name: master[off: off + int(np.prod(shape))].reshape(shape)
                            for name, (off, shape) in self._layout.items()}
        self._width = {name: int(np.prod(shape[1:])) for name, (_, shape) in
                       self._layout.items()}
        self._region = {name: slice(off, off + int(np.prod(shape))) for name, (off, shape) in
                        self._layout.items()}
        self._setters = {name: t.__setitem__ for name, t in self.host_tables.items()}
        self._putters = {name: t.put for name, t in self.host_tables.items()}
        self._seq_lens = self.host_tables["seq_lens"]
        self._block_table = self.host_tables["block_table"]
        self._frozen = True

    def _layout_of(self, name: str) -> tuple[int, tuple[int, ...]]:
        if name not in self._layout:
            raise KeyError(f"table {name!r}: not registered (have {list(self._layout)})")
        return self._layout[name]

    # -- frames ------------------------------------------------------------------------------
    def frame(self) -> Frame:
        """Open the step's frame (one at a time); use as a context manager or call commit()."""
        if self._open is not None:
            raise RuntimeError(f"a frame (epoch {self._open.epoch}) is already open")
        if not self._frozen:
            self._freeze()
        self._open = Frame(self)
        return self._open

    def _current(self) -> Frame:
        if self._open is None:
            raise RuntimeError("pager: verbs run inside a frame; use `with pager.frame():`")
        return self._open

    def reserve(self, session: Hashable, n_tokens: int) -> None:
        """:meth:`Frame.reserve` on the open frame."""
        self._current().reserve(session, n_tokens)

    def alias(self, dst_session: Hashable, src_session: Hashable, n_tokens: int) -> None:
        """:meth:`Frame.alias` on the open frame."""
        self._current().alias(dst_session, src_session, n_tokens)

    def trim(self, session: Hashable, blocks: Iterable[int] | None = None) -> None:
        """:meth:`Frame.trim` on the open frame."""
        self._current().trim(session, blocks)

    def _commit(self, f: Frame) -> Commit:
        """Deltas and the growth batch, hooks, then apply; O(edits) Python, and the growth
        batch (one entry per growing session) as a handful of numpy calls."""
        S, L = self.page_size, self.max_blocks
        sessions, lens = self._sessions, self._len
        # 1. what changed (nothing mutated yet, so a failing hook leaves the pager as it was)
        deltas = []
        if f._length:
            closed, new_slots, overlay = f._closed, f._new, f._overlay
            for key, after in f._length.items():
                slot = new_slots.get(key)
                if slot is None:
                    sess = sessions[key]
                    gone = key in closed
                    deltas.append(SessionDelta(key, sess.slot, False, gone, lens[key],
                                               sess.blocks, 0 if gone else after,
                                               overlay.get(key) or {}))
                else:
                    deltas.append(SessionDelta(key, slot, True, False, 0, [], after,
                                               overlay.get(key) or {}))
        grown = f._grown
        n = len(grown)
        if n:
            packed = np.fromiter(f._gst.values(), np.int64, n)
            after = np.fromiter(grown.values(), np.int64, n)
        else:
            packed = after = _EMPTY
        batch = GrownBatch._of_frame(f, packed, after, self._seq_lens)
        slots = batch.slots
        stats: dict = {}
        legacy = None
        for hook, appends in self._hooks:
            if appends:
                out = hook.on_commit(f, deltas, batch)
            else:
                if legacy is None:
                    legacy = self._tail_only_view(f, deltas, batch)
                out = hook.on_commit(f, *legacy)
            if out:
                stats.update(out)
        batch._seal()
        # 2. apply: refcounts and free lists, views, table entries
        refs, give = self._refs, self._alloc.give
        for page, d in f._ref.items():
            r = refs[page] + d
            refs[page] = r
            if r == 0:                  # last reference gone, or allocated and dropped in-frame
                give(page)
        track = self.device is not None
        changed: list = []
        if n:
            if n == len(lens) and not f._length:
                self._len = lens = grown    # every session grew and nothing else happened
            else:
                lens.update(grown)
            self._seq_lens.put(slots, after)
            if track:
                changed.append(self._region["seq_lens"])
        idx: list[int] = []
        val: list[int] = []
        if track or deltas:
            bt_off, sl_off = self._region["block_table"].start, self._region["seq_lens"].start
        if f._app:                      # fresh blocks of growth-only sessions
            bt = self._block_table
            for key, pages in f._app.items():
                sess = sessions[key]
                blocks = sess.blocks
                base = len(blocks)
                blocks += pages
                if len(pages) == 1:
                    bt[sess.slot, base] = pages[0]
                else:
                    bt[sess.slot, base: base + len(pages)] = pages
                if track:               # written above; only the upload needs to know
                    row = bt_off + sess.slot * L + base
                    changed.append(slice(row, row + len(pages)))
        for dlt in deltas:
            row = bt_off + dlt.slot * L
            if dlt.closed:
                sess = sessions.pop(dlt.key)
                nb = -(-lens.pop(dlt.key) // S)
                idx.extend(range(row, row + nb))
                val.extend([-1] * nb)
                idx.append(sl_off + dlt.slot)
                val.append(0)
                self._free_slots.append(dlt.slot)
                continue
            sess = sessions.get(dlt.key)
            if sess is None:
                sess = sessions[dlt.key] = _Session(dlt.slot)
            blocks = sess.blocks
            need = -(-dlt.after_length // S)
            if len(blocks) < need:
                blocks.extend([-1] * (need - len(blocks)))
            for j, page in dlt.after_overlay.items():
                blocks[j] = page
                idx.append(row + j)
                val.append(page)
            if dlt.new or lens[dlt.key] != dlt.after_length:
                lens[dlt.key] = dlt.after_length
                idx.append(sl_off + dlt.slot)
                val.append(dlt.after_length)
        master = self._master
        if idx:
            at = np.asarray(idx, dtype=np.int64)
            master[at] = val
            if track:
                changed.append(at)
        for setter, where, vals, region in f._edits:
            setter(where, vals)
            if track and region is not None:
                changed.append(self._region_of(region, where) if region.__class__ is str
                               else region)
        self.epoch = f.epoch
        self._open = None
        if track:
            self._upload(changed)
        return Commit(f.epoch, list(f._copies), len(sessions), stats)

    def _tail_only_view(self, f: Frame, deltas: list[SessionDelta],
                        batch: GrownBatch) -> tuple[list[SessionDelta], GrownBatch]:
        """``(deltas, grown)`` for a hook without ``grown_appends``: sessions that appended
        fresh blocks become deltas, as they would without the fast path."""
        if not f._app:
            return deltas, batch
        extra = []
        for key, pages in f._app.items():
            sess = self._sessions[key]
            base = len(sess.blocks)
            extra.append(SessionDelta(key, sess.slot, False, False, self._len[key],
                                      sess.blocks, f._grown[key],
                                      {base + i: p for i, p in enumerate(pages)}))
        return deltas + extra, batch._tail_only()

    def _region_of(self, table: str, where):
        """The flat range of the master buffer an edit ``host_tables[table][where]`` wrote: the
        rows of an int, a slice or a 1-D integer array (lowest to highest) along dim 0, alone or
        first in a tuple; else the whole table (the upload copies it)."""
        region = self._region[table]
        if isinstance(where, tuple):
            where = where[0]
        if isinstance(where, (int, np.integer)):
            start, stop = int(where), int(where) + 1
        elif isinstance(where, slice) and where.step is None:
            start, stop, _ = where.indices(self._layout[table][1][0])
        elif isinstance(where, np.ndarray) and where.ndim == 1 and where.dtype.kind in "iu" \
                and where.size:
            start, stop = int(where.min()), int(where.max()) + 1
        else:
            return region
        if start < 0:
            return region
        width = self._width[table]
        return slice(region.start + start * width, region.start + stop * width)

    def _upload(self, changed: list) -> None:
        """Bring the staging buffer up to date (this and the previous commit's changes, as the
        other buffer may still be in flight) and copy it to the device in one transfer."""
        i = self.epoch % 2
        stage = self._stage[i]
        if self._events[i] is not None:
            self._events[i].synchronize()
        buf = stage.numpy()
        for where in self._last_changed + changed:
            buf[where] = self._master[where]
        self._last_changed = changed
        self._device_buf.copy_(stage, non_blocking=self._events[i] is not None)
        if self._events[i] is not None:
            self._events[i].record()

    # -- reads of the committed (active) descriptor -------------------------------------------
    def sessions(self) -> list[Hashable]:
        return list(self._sessions)

    def length(self, session: Hashable) -> int:
        return self._len[session]

    def pages(self, session: Hashable) -> list[int]:
        """Committed pages of every logical block of ``session`` (``-1`` trimmed)."""
        return list(self._sessions[session].blocks)

    def slot(self, session: Hashable) -> int:
        return self._sessions[session].slot

    def refcount(self, page: int) -> int:
        return self._refs[page]

    @property
    def free_pages(self) -> int:
        return self._alloc.free


def apply_copies(k_cache: torch.Tensor, v_cache: torch.Tensor,
                 copies: list[tuple[int, int]]) -> None:
    """Run a commit's copy-on-write copies ``(src_page, dst_page)`` on the pool, K and V."""
    if not copies:
        return
    src, dst = zip(*copies)
    src_t = torch.tensor(src, dtype=torch.long).to(k_cache.device, non_blocking=True)
    dst_t = torch.tensor(dst, dtype=torch.long).to(k_cache.device, non_blocking=True)
    k_cache.index_copy_(0, dst_t, k_cache.index_select(0, src_t))
    v_cache.index_copy_(0, dst_t, v_cache.index_select(0, src_t))
