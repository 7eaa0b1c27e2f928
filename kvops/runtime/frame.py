"""A frame: the shadow descriptor of one step, its verbs, and what a commit hands policies.

Every verb edits the frame's shadow (:class:`FrameEdits`: an overlay of the touched sessions'
blocks and lengths, pending reference-count changes, the pages and slots the frame took); the
pager's committed descriptor is not touched until :meth:`Frame.commit`.

Reuse inside a frame
    A page whose last reference a verb drops (a trim, an EOS, a remap) and a slot an EOS frees
    can be taken again by a later ``reserve`` or new session in the same frame: stream order
    makes that safe, since the step's copies, then its writes, run after the previous step's
    kernels and after any device work a policy did while planning the frame. Pages the pool
    holds free are used first; pages freed in the frame only when the pool alone is short.
    :meth:`Frame.hold` (whose pages a policy writes at once, on another stream) takes pool
    pages only.

Copies
    A ``reserve`` whose tokens land in a partly filled tail page that other blocks share takes
    a fresh page and records ``(old, new)`` in the frame's copies, in order
    (:mod:`kvops.runtime.copies`). The copy runs before the step's writes, so it must copy
    tokens that exist then: a tail holding tokens reserved in this very frame (an alias of a
    session's own new tokens, then a write into the alias) is refused with ``ValueError``.

Many blocks at once
    ``pages_at``, ``refcounts``, ``remap_many``, ``retain_many`` and ``release_many`` take and
    return numpy arrays, for a policy that edits a batch (the fidelity policy's demotions and
    promotions): each equals its per-block call on every entry in order, checks every entry
    before changing anything, and costs about a microsecond an entry instead of a few.

Growth fast path
    A committed session whose only edits are ``reserve``s into its unshared tail page or into
    fresh blocks (the decode step) is not an overlay entry: its new length, ``slot << 32 |
    tail page`` and fresh pages go into flat dicts kept in the same key order, which the commit
    turns into arrays with no per-session Python (:class:`GrownBatch`). Any other edit moves
    the session to the overlay first.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from kvops.runtime.allocator import OutOfPages
from kvops.runtime.policy import run_all

if TYPE_CHECKING:
    from kvops.runtime.pager import Commit, Pager


def as_int(name: str, value, low: int = 0) -> int:
    """``value`` as a Python int >= ``low``: ints, numpy integers and 0-d integer tensors
    (anything with ``__index__`` but a bool); else ``ValueError`` naming ``name``."""
    if value.__class__ is int and value >= low:
        return value
    try:
        if isinstance(value, bool) or isinstance(value, np.bool_):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}") from None
    if out < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    return out


def as_ints(name: str, values, high: int | None = None) -> np.ndarray:
    """``values`` as a 1-D int64 array of ints in ``[0, high)`` (any 1-D integer array-like;
    ``high`` None: no upper bound); else ``ValueError`` naming ``name``."""
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name}: expected a 1-D sequence of ints, got "
                         f"{arr.dtype} of shape {list(arr.shape)}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        bad = arr < 0 if high is None else (arr < 0) | (arr >= high)
        if bad.any():
            i = int(bad.argmax())
            span = ">= 0" if high is None else f"in [0, {high})"
            raise ValueError(f"{name}: expected ints {span}, got {int(arr[i])} at [{i}]")
    return arr


@dataclass(slots=True)
class SessionDelta:
    """What a commit changes for one session with general edits, for policies.

    ``before_*`` describe the committed view before the commit (length 0 and no blocks for a
    new session); ``page_after(j)`` reads the view after it; ``closed`` is an EOS trim.
    ``aliased``: for a new session, the tokens it took from another session by ``alias``
    (0 otherwise): every later token is its own, the step's to write.
    """

    key: Hashable
    slot: int
    new: bool
    closed: bool
    before_length: int
    before_blocks: list[int]
    after_length: int
    after_overlay: dict[int, int]
    aliased: int = 0

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


def const(value: int) -> np.ndarray:
    """A read-only 0-d int64 array: as an operand of an array op it costs less than a Python
    int (converted per call) or a numpy scalar (~0.35 against 0.5 us for 64 elements)."""
    out = np.array(value, dtype=np.int64)
    out.flags.writeable = False
    return out


_HIGH = const(32)                   # the growth fast path packs slot << 32 | tail page
_LOW = const(0xFFFFFFFF)


class GrownBatch:
    """Committed sessions whose only edit in a frame was growth, as arrays for policies.

    ``slots``, ``before`` and ``after`` lengths, ``tails`` (the page holding each session's
    last token after the growth) and ``packed`` (``slots << 32 | tails``) are int64 ``[n]``;
    ``keys`` are the sessions in the same order. ``appended`` (bool ``[n]``) marks sessions
    that took fresh blocks (a decode step crossing a page boundary, or a longer append);
    ``multi`` lists the ``(position, key)`` of those whose new tokens landed in more than one
    block, and ``Frame.page`` reads their new pages. All but ``slots`` and ``after`` are
    computed when first read, from the committed lengths and the frame: read them inside
    ``plan`` (a first read after the commit raises).
    """

    __slots__ = ("slots", "after", "_before", "_tails", "_keys", "_multi", "_packed",
                 "_frame", "_lens", "_appended")

    def __init__(self, slots: np.ndarray, before: np.ndarray, after: np.ndarray,
                 tails: np.ndarray | None = None, keys: list | None = None,
                 multi: list | None = None, appended: np.ndarray | None = None):
        self.slots, self.after = slots, after
        self._before, self._tails, self._keys = before, tails, keys
        self._multi = [] if multi is None else multi
        self._appended = np.zeros(slots.size, dtype=bool) if appended is None else appended
        self._packed = self._frame = self._lens = None

    @classmethod
    def of_frame(cls, frame: Frame, packed: np.ndarray, after: np.ndarray,
                 seq_lens: np.ndarray) -> GrownBatch:
        """The frame's growth-only sessions; ``packed`` holds ``slot << 32 | tail``."""
        batch = cls.__new__(cls)
        batch.slots, batch.after = packed >> _HIGH, after
        batch._before = batch._tails = batch._keys = batch._appended = None
        batch._multi = None if frame._gmulti else []
        batch._packed, batch._frame, batch._lens = packed, frame, seq_lens
        return batch

    @property
    def before(self) -> np.ndarray:
        if self._before is None:
            if self._lens is None:
                raise RuntimeError("GrownBatch: read its lazy fields inside plan")
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
            frame = self._live()
            multi = frame._gmulti
            self._multi = [(i, k) for i, k in enumerate(frame._grown) if k in multi] \
                if multi else []
        return self._multi

    @property
    def appended(self) -> np.ndarray:
        if self._appended is None:
            frame = self._live()
            app = frame._app
            self._appended = np.fromiter((k in app for k in frame._grown), bool,
                                         self.slots.size) if app else \
                np.zeros(self.slots.size, dtype=bool)
        return self._appended

    def _live(self) -> Frame:
        if self._frame is None:
            raise RuntimeError("GrownBatch: this field was not given, or is read after the "
                               "commit (read the pager's batch inside plan)")
        return self._frame

    def seal(self) -> None:
        """End of the commit's planning: lazy fields not read by now are no longer readable."""
        self._lens = self._frame = None


class FrameEdits:
    """The shadow of one frame, read by the pager at commit.

    Sessions with general edits (new, aliased, trimmed, closed, copied on write) are in
    ``length`` (their length in the frame) and ``overlay`` (their remapped blocks);
    growth-only sessions in ``grown`` (length), ``gst`` (``slot << 32 | tail``), ``app``
    (fresh pages continuing their committed blocks) and ``gmulti`` (keys whose tokens landed
    in more than one block). ``ref``: pending reference-count changes; ``allocated``: pages
    taken from the pool; ``slots_taken``: slots taken from the free list; ``freed_pages`` and
    ``freed_slots``: what verbs freed, reusable in the frame; ``written``: for sessions
    aliased in the frame, how many of their tokens exist before the step writes, and
    ``aliased`` how many they took by the alias;
    ``writes``: table writes ``(setter, index, values, table or its flat range)``; ``undo``
    and ``after``: the abort and commit callbacks; ``adopt``: the policies' ``(adopt,
    state)`` pairs the commit leaves for :meth:`Frame.commit` to hand over.
    """

    __slots__ = ("length", "overlay", "new", "closed", "grown", "gst", "app", "gmulti", "ref",
                 "allocated", "copies", "aliases", "writes", "slots_taken", "freed_pages",
                 "freed_slots", "written", "aliased", "undo", "after", "adopt")

    def __init__(self):
        self.length = {}
        self.overlay = {}
        self.new = {}
        self.closed = set()
        self.grown = {}
        self.gst = {}
        self.app = {}
        self.gmulti = set()
        self.ref = {}
        self.allocated = []
        self.copies = []
        self.aliases = []
        self.writes = []
        self.slots_taken = []
        self.freed_pages = []
        self.freed_slots = []
        self.written = {}
        self.aliased = {}
        self.undo = []
        self.after = []
        self.adopt = ()


class Frame:
    """The shadow descriptor of one step; see the module doc. Get one from :meth:`Pager.frame`.
    """

    def __init__(self, pager: Pager):
        self.pager = pager
        self.epoch = pager.epoch + 1
        self.result: Commit | None = None
        self.aborted = False
        e = self.edits = FrameEdits()
        c = pager.committed
        self._sessions, self._len, self._refs = c.sessions, c.lengths, c.refs
        self._pool, self._free_slots = pager.allocator, c.free_slots
        self._tables = pager.table_set
        # the frame's own handles on its shadow (the same objects as ``edits``)
        self._overlay, self._length, self._new, self._closed = (e.overlay, e.length, e.new,
                                                                e.closed)
        self._grown, self._gst, self._app, self._gmulti = e.grown, e.gst, e.app, e.gmulti
        self._ref, self._copies = e.ref, e.copies

    # -- reads through the shadow ------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self.result is None and not self.aborted

    def has(self, key: Hashable) -> bool:
        """Whether ``key`` is a live session in this frame's view."""
        if key in self._closed:
            return False
        return key in self._new or key in self._sessions

    def length(self, key: Hashable) -> int:
        """Tokens of ``key`` in this frame's view."""
        self._require(key)
        got = self._length.get(key)
        if got is None:
            got = self._grown.get(key)
            if got is None:
                got = self._len[key]
        return got

    def page(self, key: Hashable, j: int) -> int:
        """Page of logical block ``j`` of ``key`` in this frame's view (``-1`` none)."""
        self._require(key)
        return self._page(key, j)

    def _page(self, key: Hashable, j: int) -> int:
        over = self._overlay.get(key)
        if over is not None and j in over:
            return over[j]
        sess = self._sessions.get(key)
        if sess is None:
            return -1
        blocks = sess.blocks
        if j < len(blocks):
            return blocks[j]
        app = self._app.get(key)
        j -= len(blocks)
        return app[j] if app is not None and j < len(app) else -1

    def block_pages(self, key: Hashable, lo: int, hi: int) -> list[int]:
        """Pages of logical blocks ``[lo, hi)`` of ``key`` in this frame's view (``-1`` none):
        one slice of the committed blocks when the frame changed none of them."""
        self._require(key)
        sess = self._sessions.get(key)
        if (sess is not None and hi <= len(sess.blocks) and key not in self._overlay
                and key not in self._closed):
            return sess.blocks[lo:hi]
        return [self.page(key, j) for j in range(lo, hi)]

    def pages(self, key: Hashable) -> list[int]:
        """Pages of every logical block of ``key`` in this frame's view."""
        n = -(-self.length(key) // self.pager.page_size)
        return [self.page(key, j) for j in range(n)]

    def refcount(self, page: int) -> int:
        return self._refs[page] + self._ref.get(page, 0)

    # -- many blocks at once (policies that edit a batch: kvops.runtime.fidelity) -------------
    def _keys_of(self, verb: str, keys: Sequence[Hashable], n: int) -> list:
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__"):
            raise ValueError(f"{verb}: keys: expected a sequence of session keys (one an "
                             f"entry), got {keys!r}")
        keys = list(keys)
        if len(keys) != n:
            raise ValueError(f"{verb}: keys: expected {n} keys (one a block), got {len(keys)}")
        return keys

    def pages_at(self, keys: Sequence[Hashable], blocks) -> np.ndarray:
        """int64 ``[n]``: the page of block ``blocks[i]`` of session ``keys[i]`` in this
        frame's view (``-1`` none), as ``page`` would give each. Every key must be live;
        ``blocks`` ints >= 0 (``ValueError`` naming the argument otherwise)."""
        js = as_ints("pages_at: blocks", blocks)
        keys = self._keys_of("pages_at", keys, js.size)
        for key in dict.fromkeys(keys):
            self._require(key)
        return np.fromiter(map(self._page, keys, js.tolist()), np.int64, js.size)

    def refcounts(self, pages) -> np.ndarray:
        """int64 ``[n]``: ``refcount(pages[i])`` of every page (ints in ``[0, P)``)."""
        return self._refcounts(as_ints("refcounts: pages", pages, self.pager.num_pages).tolist())

    def _refcounts(self, ps: list[int]) -> np.ndarray:
        """``refcounts`` of pages already checked."""
        got = np.fromiter(map(self._refs.__getitem__, ps), np.int64, len(ps))
        if self._ref:
            got += np.fromiter(map(self._ref.get, ps, repeat(0)), np.int64, len(ps))
        return got

    def remap_many(self, keys: Sequence[Hashable], blocks, pages) -> None:
        """``remap(keys[i], blocks[i], pages[i])`` for every ``i`` in order, checked before
        anything changes: a bad entry raises ``ValueError`` (naming the argument and the
        index) and leaves the frame as it was. The ``(key, block)`` entries must be distinct."""
        self.check_open()
        js = as_ints("remap_many: blocks", blocks)
        n = js.size
        P = self.pager.num_pages
        try:
            ps = as_ints("remap_many: pages", pages, P)
        except ValueError as exc:
            raise ValueError(f"{exc} (pages must be live pages)") from None
        if ps.size != n:
            raise ValueError(f"remap_many: pages: expected {n} pages (one a block), got "
                             f"{ps.size}")
        keys = self._keys_of("remap_many", keys, n)
        S = self.pager.page_size
        nbs = {}
        for key in dict.fromkeys(keys):
            self._require(key)
            nbs[key] = -(-self.length(key) // S)
        jl, pl = js.tolist(), ps.tolist()
        if n and (js >= np.fromiter(map(nbs.__getitem__, keys), np.int64, n)).any():
            i = next(i for i, (k, j) in enumerate(zip(keys, jl)) if j >= nbs[k])
            raise ValueError(f"remap_many: blocks[{i}] of {keys[i]!r} must lie in "
                             f"[0, {nbs[keys[i]]}), got {jl[i]}")
        if len(set(zip(keys, jl))) != n:
            seen = set()
            i = next(i for i, e in enumerate(zip(keys, jl)) if e in seen or seen.add(e))
            raise ValueError(f"remap_many: blocks[{i}]: block {jl[i]} of {keys[i]!r} appears "
                             f"twice; remap a block once a call")
        olds = list(map(self._page, keys, jl))
        if n and min(olds) < 0:
            i = next(i for i, o in enumerate(olds) if o < 0)
            raise ValueError(f"remap_many: blocks[{i}]: block {jl[i]} of {keys[i]!r} is "
                             f"trimmed")
        live = self._refcounts(pl)
        dead = live < 1
        if dead.any() or not set(pl).isdisjoint(olds):
            # the per-block order: a target page must still be live when its remap runs
            count = dict(zip(pl, live.tolist()))
            for i, (t, o) in enumerate(zip(pl, olds)):
                if count[t] < 1:
                    raise ValueError(f"remap_many: pages[{i}]: expected a live page in "
                                     f"[0, {P}), got {t}")
                count[t] += 1
                if o in count:
                    count[o] -= 1
        for key in nbs:
            self._slow(key)
        for key, j, t, o in zip(keys, jl, pl, olds):      # remap's edits, entry by entry
            self._bump(t, 1)
            self._bump(o, -1)
            self._set(key, j, t)

    def retain_many(self, pages) -> None:
        """``retain(pages[i])`` for every ``i``, checked first (nothing changes on error)."""
        self.check_open()
        for p in self._live_pages("retain_many", pages, 1):
            self._bump(p, 1)

    def release_many(self, pages) -> None:
        """``release(pages[i])`` for every ``i`` in order, checked first: a page may appear as
        often as it has references (nothing changes on error)."""
        self.check_open()
        for p in self._live_pages("release_many", pages, None):
            self._bump(p, -1)

    def _live_pages(self, verb: str, pages, need: int | None) -> list[int]:
        """``pages`` as a list, each live and (``need`` None) with at least as many
        references as it appears; else ``ValueError`` naming ``pages`` and the index."""
        P = self.pager.num_pages
        try:
            ps = as_ints(f"{verb}: pages", pages, P)
        except ValueError as exc:
            raise ValueError(f"{exc} (pages must be live pages)") from None
        have = self._refcounts(ps.tolist())
        if need is None and ps.size:
            _, inv, cnt = np.unique(ps, return_inverse=True, return_counts=True)
            want = cnt[inv]
        else:
            want = 1
        bad = have < want
        if bad.any():
            i = int(bad.argmax())
            raise ValueError(f"{verb}: pages[{i}]: expected a live page in [0, {P}) with "
                             f"a reference for each time it appears, got {int(ps[i])} "
                             f"(refcount {int(have[i])})")
        return ps.tolist()

    @property
    def free_pages(self) -> int:
        """Pages a ``reserve`` in this frame can take: the pool's free pages plus those freed in
        the frame."""
        return self._pool.free + len(self.edits.freed_pages)

    @property
    def holdable_pages(self) -> int:
        """Pages a ``hold`` in this frame can take: the pool's free pages only (pages freed in
        the frame are reusable by a ``reserve``, not held)."""
        return self._pool.free

    @property
    def copies(self) -> tuple[tuple[int, int], ...]:
        """The copies ``(src, dst)`` recorded so far, in order."""
        return tuple(self._copies)

    @property
    def aliases(self) -> tuple[tuple[Hashable, Hashable, int, tuple[int, ...]], ...]:
        """Every ``alias`` of the frame so far: ``(dst, src, n_tokens, shared pages)``."""
        return tuple(self.edits.aliases)

    def pages_needed(self, key: Hashable, n_tokens: int) -> int:
        """Pages ``reserve(key, n_tokens)`` would take now (fresh blocks, plus one for a
        copy-on-write of a shared tail); nothing is changed."""
        n_tokens = as_int("n_tokens", n_tokens)
        S = self.pager.page_size
        old = self.length(key) if self.has(key) else 0
        new = old + n_tokens
        need = -(-new // S) - -(-old // S)
        if n_tokens and old % S:
            tail = self.page(key, old // S)
            if tail >= 0 and self.refcount(tail) > 1:
                need += 1
        return need

    def _require(self, key):
        if not self.has(key):
            raise KeyError(f"session {key!r}: not a live session")

    def check_open(self) -> None:
        """Raise ``RuntimeError`` when the frame has committed or aborted."""
        if self.result is not None or self.aborted:
            raise RuntimeError(f"frame of epoch {self.epoch} is closed; open a new frame")

    # -- shadow edits --------------------------------------------------------------------------
    def _new_session(self, key) -> None:
        if key in self._closed:
            raise ValueError(f"session {key!r} ended in this frame; reuse its key in a later "
                             f"frame")
        if self._free_slots:
            slot = self._free_slots.pop()
            self.edits.slots_taken.append(slot)
        elif self.edits.freed_slots:
            slot = self.edits.freed_slots.pop()
        else:
            raise OutOfPages(f"pager: all {self.pager.max_sessions} session slots are in use")
        self._new[key] = slot
        self._length[key] = 0
        self._overlay[key] = {}

    def _slow(self, key) -> None:
        """Committed session ``key`` gets edits beyond growth: track it in the general
        overlay (its fresh pages become overlay entries)."""
        if key in self._length or key not in self._sessions:
            return
        after = self._grown.pop(key, None)
        if after is None:
            self._length[key] = self._len[key]
            return
        del self._gst[key]
        self._gmulti.discard(key)
        app = self._app.pop(key, None)
        if app:
            base = len(self._sessions[key].blocks)
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
        r = self._ref.get(page, 0) + d
        self._ref[page] = r
        if r + self._refs[page] == 0:           # no reference left: reusable in this frame
            self.edits.freed_pages.append(page)

    def _alloc(self, n: int, after: int, fresh: bool, reuse: bool = True) -> list[int]:
        """``n`` pages, continuing right after page ``after`` when it can; pages freed in the
        frame only when the pool is short (and ``reuse``)."""
        pool, freed = self._pool, self.edits.freed_pages
        if n > pool.free + (len(freed) if reuse else 0):
            raise OutOfPages(f"pager: need {n} free pages, have {pool.free} of "
                             f"{pool.num_pages}" + (f" and {len(freed)} freed in this frame"
                                                    if reuse and freed else ""))
        pages: list[int] = []
        from_pool = min(n, pool.free)
        if from_pool:
            if after >= 0:
                k = pool.take_at(after + 1, from_pool)
                pages.extend(range(after + 1, after + 1 + k))
            if len(pages) < from_pool:
                for start, k in pool.take(from_pool - len(pages), spread=fresh and not pages):
                    pages.extend(range(start, start + k))
            self.edits.allocated.extend(pages)
        while len(pages) < n:
            pages.append(freed.pop())
        ref = self._ref
        for p in pages:
            ref[p] = ref.get(p, 0) + 1
        return pages

    def _written(self, key) -> int:
        """Tokens of ``key`` whose bytes exist before this step's writes."""
        got = self.edits.written.get(key)
        if got is not None:
            return got
        return self._len.get(key, 0) if key not in self._new else 0

    def _append(self, key, sess, old: int, n_tokens: int) -> bool:
        """Growth into fresh blocks of a growth-only session (the fast path's second half).

        False, with nothing changed, when the general path must take it: the partly filled
        tail is shared (copy-on-write) or trimmed, the block table is too short, or the pool
        is (the general path reuses the frame's freed pages, or raises)."""
        pager = self.pager
        S = pager.page_size
        new = old + n_tokens
        nb_old, nb_new = -(-old // S), -(-new // S)
        if nb_new > pager.max_blocks or nb_new - nb_old > self._pool.free:
            return False
        blocks, app = sess.blocks, self._app.get(key)
        have = len(blocks)
        if old & (S - 1):                              # the tail page takes tokens too
            j = old // S
            tail = blocks[j] if j < have else app[j - have]
            if tail < 0 or self._refs[tail] + self._ref.get(tail, 0) != 1:
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
        if (new - 1) // S > self._len[key] // S:      # past the committed tail page
            self._gmulti.add(key)
        return True

    # -- verbs ---------------------------------------------------------------------------------
    def reserve(self, key: Hashable, n_tokens: int) -> None:
        """Extend ``key`` by ``n_tokens`` tokens (a new key starts a session)."""
        if self.result is not None or self.aborted:
            self.check_open()
        if n_tokens.__class__ is not int or n_tokens < 0:
            n_tokens = as_int("n_tokens", n_tokens)
        # fast path (a decode step): a committed session with no other edits in this frame
        sess = self._sessions.get(key)
        if sess is not None and key not in self._length:
            old = self._grown.get(key)
            first = old is None
            if first:
                old = self._len[key]
            if not n_tokens:
                return
            S = self.pager.page_size
            r = old & (S - 1)
            if r and r + n_tokens <= S:                    # inside the tail page
                j = old // S
                blocks = sess.blocks
                tail = blocks[j] if j < len(blocks) else self._app[key][j - len(blocks)]
                if tail >= 0 and self._refs[tail] + self._ref.get(tail, 0) == 1:
                    self._grown[key] = old + n_tokens
                    if first:
                        self._gst[key] = sess.slot << 32 | tail
                    return
            elif self._append(key, sess, old, n_tokens):
                return
        pager = self.pager
        S, L = pager.page_size, pager.max_blocks
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
        if cow and old > self._written(key):
            raise ValueError(f"reserve: session {key!r} shares tokens [{self._written(key)}, "
                             f"{old}) of its tail page with another session, and they are "
                             f"written in this frame, after the copy-on-write copy would run; "
                             f"reserve into it in a later frame, or alias whole blocks")
        need = nb_new - nb_old + int(cow)
        if need > self.free_pages:
            raise OutOfPages(f"pager: reserve({key!r}, {n_tokens}) needs {need} pages, "
                             f"{self.free_pages} of {pager.num_pages} free")
        if fresh and not self._free_slots and not self.edits.freed_slots:
            raise OutOfPages(f"pager: all {pager.max_sessions} session slots are in use")
        self._slow(key)
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
        self.check_open()
        self._require(src)
        if self.has(dst):
            raise ValueError(f"alias: destination session {dst!r} already exists")
        try:
            n_tokens = as_int("n_tokens", n_tokens)
        except ValueError:
            n_tokens = -1
        if not 0 <= n_tokens <= self.length(src):
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
        self.edits.written[dst] = min(n_tokens, self._written(src))
        self.edits.aliased[dst] = n_tokens
        self.edits.aliases.append((dst, src, n_tokens, tuple(shared)))

    def trim(self, key: Hashable, blocks: Iterable[int] | None = None) -> None:
        """Give back logical ``blocks`` of ``key`` (already trimmed ones are skipped), or end the
        session (EOS) with ``blocks=None``."""
        self.check_open()
        self._require(key)
        S = self.pager.page_size
        nb = -(-self.length(key) // S)
        if blocks is not None:
            want = []
            for j in blocks:
                try:
                    j = as_int("blocks", j)
                except ValueError:
                    j = None
                if j is None or not 0 <= j < nb:
                    raise ValueError(f"trim: blocks of {key!r} must lie in [0, {nb}), got "
                                     f"{j!r}")
                want.append(j)
        self._slow(key)
        if blocks is None:
            for j in range(nb):
                page = self.page(key, j)
                if page >= 0:
                    self._bump(page, -1)
            e = self.edits
            if key in self._new:
                e.freed_slots.append(self._new.pop(key))
                self._overlay.pop(key, None)
                self._length.pop(key, None)
                e.written.pop(key, None)
                e.aliased.pop(key, None)
            else:
                self._closed.add(key)
                e.freed_slots.append(self._sessions[key].slot)
            return
        for j in want:
            page = self.page(key, j)
            if page >= 0:
                self._bump(page, -1)
                self._set(key, j, -1)

    # -- verbs for policies that move a block's bytes themselves (kvops.runtime.fidelity) --
    def remap(self, key: Hashable, j: int, page: int) -> None:
        """Point logical block ``j`` of ``key`` at ``page``, a live page (mapped, or held by
        :meth:`hold`), moving one reference from the block's old page to it. The caller keeps
        the bytes consistent (ElasticKV: a BASE pair page for two blocks, or a refined page)."""
        self.check_open()
        self._require(key)
        nb = -(-self.length(key) // self.pager.page_size)
        try:
            j = as_int("j", j)
        except ValueError:
            j = -1
        if not 0 <= j < nb:
            raise ValueError(f"remap: block of {key!r} must lie in [0, {nb}), got {j!r}")
        page = self._live_page("remap", page)
        old = self.page(key, j)
        if old < 0:
            raise ValueError(f"remap: block {j} of {key!r} is trimmed")
        self._slow(key)
        self._bump(page, 1)
        self._bump(old, -1)
        self._set(key, j, page)

    def hold(self, n: int) -> list[int]:
        """Take ``n`` free pages that no block maps, one reference each, until :meth:`release`
        (staging pages; an aborted frame gives them back). They come from the pool only, never
        from pages freed in this frame (a policy writes them at once, on its own stream).
        Raises :class:`OutOfPages` first when fewer are free."""
        self.check_open()
        n = as_int("hold: n", n)
        return self._alloc(n, -1, False, reuse=False) if n else []

    def retain(self, page: int) -> None:
        """One more reference to a live ``page``, so it outlives its blocks until
        :meth:`release` (a page still being read on another stream)."""
        self.check_open()
        self._bump(self._live_page("retain", page), 1)

    def release(self, page: int) -> None:
        """Drop a reference taken by :meth:`hold` or :meth:`retain`; with none left the page
        is free (reusable by a later reserve of this frame, in the pool after the commit)."""
        self.check_open()
        self._bump(self._live_page("release", page), -1)

    def _live_page(self, verb: str, page) -> int:
        P = self.pager.num_pages
        try:
            page = as_int("page", page)
        except ValueError:
            page = -1
        if not 0 <= page < P or self.refcount(page) < 1:
            raise ValueError(f"{verb}: page must be a live page in [0, {P}), got {page!r}")
        return page

    def on_commit(self, fn) -> None:
        """Call ``fn()`` once this frame has committed (tables written and uploaded), in the
        order registered, policies' registrations during the commit last. The commit is
        complete before the first call, so an exception from ``fn`` reaches the caller without
        undoing it, after the other callbacks ran (the first exception is raised)."""
        self.check_open()
        self.edits.after.append(fn)

    def on_abort(self, fn) -> None:
        """Call ``fn()`` if this frame aborts (undo of device work done for the frame), newest
        first, before the frame's held and allocated pages go back to the pool. Every callback
        runs even if one raises; the first exception is raised after the abort is complete."""
        self.check_open()
        self.edits.undo.append(fn)

    # -- table writes ----------------------------------------------------------------------------
    def write(self, table: str, index, values, *, via=None, at=None) -> None:
        """``pager.host_tables[table][index] = values`` at commit, in the commit's one upload:
        the table writer policies use. ``index`` is any numpy index (an int, a slice or an int
        array along dim 0, alone or first in a tuple, uploads just those rows; anything else
        the whole table, unless ``at`` says which elements). Unchecked beyond the table's
        name: policies compute in-range indices. ``via``: a view of that host table (e.g. a
        reshaped or structured-dtype view) whose ``__setitem__`` takes ``index`` and
        ``values`` instead. ``at``: the flat positions (int64 1-D, row-major in the table) of
        the elements the write touches, so the upload copies just those (a scatter across
        rows, say)."""
        if via is None:
            target = self._tables.host.get(table)
            if target is None:
                self._tables.check(table)
        else:
            target = via
        changed = table if at is None else self._tables.region[table].start + at
        if index.__class__ is np.ndarray and target.ndim == 1 and index.ndim == 1:
            self.edits.writes.append((target.put, index, values, changed))
        else:
            self.edits.writes.append((target.__setitem__, index, values, changed))

    def edit(self, table: str, row: int, values, start: int = 0) -> None:
        """Checked write of ``values`` as a run from ``table[row, start]`` at commit (row-major,
        so a long run continues into the following rows). For a 1-D table, ``row`` is the
        element index."""
        self.check_open()
        tables = self._tables
        tables.check(table)
        shape, width = tables.shape[table], tables.width[table]
        vals = np.asarray(values, dtype=np.int32).reshape(-1)
        row, start = as_int("row", row), as_int("start", start)
        if not row < shape[0] or row * width + start + vals.size > shape[0] * width:
            raise ValueError(f"edit: {table}{list(shape)} has no run row={row}, "
                             f"[{start}, {start + vals.size})")
        at = tables.offset[table] + row * width + start
        where = slice(at, at + vals.size)
        self.edits.writes.append((tables.master.__setitem__, where, vals, where))

    def scatter(self, table: str, rows, values) -> None:
        """Checked ``table[rows[i]] = values[i]`` into a 1-D table at commit."""
        self.check_open()
        tables = self._tables
        tables.check(table)
        shape = tables.shape[table]
        if len(shape) != 1:
            raise ValueError(f"scatter: {table}{list(shape)} is not 1-D; use edit()")
        at = np.asarray(rows, dtype=np.int64)
        vals = np.asarray(values, dtype=np.int32)
        if at.shape != vals.shape or at.ndim != 1:
            raise ValueError(f"scatter: rows and values must be equal-length 1-D, got "
                             f"{at.shape} and {vals.shape}")
        if at.size and (at.min() < 0 or at.max() >= shape[0]):
            raise ValueError(f"scatter: rows of {table}[{shape[0]}] out of range")
        at += tables.offset[table]
        self.edits.writes.append((tables.master.put, at, vals, at))

    # -- commit / abort ----------------------------------------------------------------------
    def commit(self) -> Commit:
        """Apply the shadow atomically; a second call returns the first result unchanged."""
        if self.result is not None:
            return self.result
        if self.aborted:
            raise RuntimeError(f"frame of epoch {self.epoch} was aborted")
        try:
            self.result = self.pager.apply_frame(self)
        except BaseException:
            self.abort()
            raise
        e = self.edits
        error = None
        for fn, state in e.adopt:       # the policies' staged states, then the callbacks
            try:
                fn(state)
            except BaseException as exc:  # noqa: BLE001 - every one runs; the first is raised
                error = error or exc
        if e.after:
            try:
                run_all(e.after)
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error
        return self.result

    def abort(self) -> None:
        """Drop the shadow: every undo callback runs (newest first), the pages and slots this
        frame took go back, nothing else changes. Raises the first callback error after."""
        if self.result is not None or self.aborted:
            return
        self.aborted = True
        e = self.edits
        try:
            run_all(reversed(e.undo))
        finally:
            for page in e.allocated:
                self._pool.give(page)
            self._free_slots.extend(e.slots_taken)
            self.pager.close_frame(self)

    def __enter__(self) -> Frame:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.abort()
        else:
            self.commit()
        return False
