"""The KV pager (KV-RM section 4.2): page pool, per-session views, verbs, one commit a frame.

The device always runs the same fixed-shape kernels; the pager changes which pages they see.

Views
    A session (any hashable key) has a slot row in the device tables, a length in tokens and a
    list of pages, one per logical block ``j`` (tokens ``[j*S, (j+1)*S)``); ``-1`` marks a
    trimmed block. Pages are reference counted: ``alias`` shares a prefix, and the first write
    into a shared page (a ``reserve`` whose new tokens land in a partly filled shared tail)
    copies it first (copy-on-write). The copies are returned in the commit's ``copies`` for the
    caller to run on the device (:func:`kvops.runtime.copies.apply_copies`).

Verbs (inside a frame, :mod:`kvops.runtime.frame`)
    ``reserve(session, n_tokens)``, ``alias(dst, src, n_tokens)``, ``trim(session,
    blocks=None)`` (cold blocks, or EOS: all blocks and the slot); for policies that move a
    block's bytes themselves ``remap``, ``hold`` / ``retain`` / ``release``, ``on_commit`` /
    ``on_abort``; table writes ``write`` (and the checked ``edit`` / ``scatter``). Pages and
    slots a verb frees are reusable by later verbs of the same frame.

Commit
    ``with pager.frame() as f: ...`` (or ``f.commit()``). The commit builds the
    :class:`~kvops.runtime.frame.SessionDelta` list (sessions with general edits, EOS first) and
    the :class:`~kvops.runtime.frame.GrownBatch` (growth-only sessions, as arrays), asks every
    policy to ``plan`` (:mod:`kvops.runtime.policy`), then applies the shadow in O(edits),
    writes the changed table entries, ends in ONE upload of the table buffer
    (:mod:`kvops.runtime.tables`), and hands each policy its staged state. Committing the same
    frame again returns the same :class:`Commit`. An exception inside the ``with`` (or from a
    policy's ``plan``) aborts the frame: every undo callback runs, the pages and slots it took
    go back, and every mapping, count and table is as before. Running out of pages raises
    :class:`~kvops.runtime.allocator.OutOfPages` from the verb, before it changes anything.

Tables (one int32 buffer, fixed shapes once a frame opens or ``device_tables`` is read)
    ``block_table [B, L]`` (page of logical block ``j`` of slot ``b``, ``-1`` none),
    ``seq_lens [B]`` (tokens), plus any table added with :meth:`Pager.add_table` or by a
    policy. ``pager.device_tables[name]`` are views into the device buffer (the host buffer
    itself when ``device=None``): capture a CUDA graph on them once; every commit refreshes
    them in place.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvops.runtime.allocator import OutOfPages, SpanAllocator
from kvops.runtime.copies import apply_copies, copy_stages
from kvops.runtime.frame import Frame, GrownBatch, SessionDelta, const
from kvops.runtime.policy import sharing_refusal
from kvops.runtime.tables import TableSet

__all__ = ["Commit", "Committed", "Frame", "GrownBatch", "OutOfPages", "Pager", "Session",
           "SessionDelta", "SpanAllocator", "apply_copies", "copy_stages"]

_const = const          # the name the transport and benchmarks import
_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


@dataclass(slots=True)
class Session:
    """A committed session: its slot and the page of each logical block (``-1`` trimmed)."""

    slot: int
    blocks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Committed:
    """The pager's committed descriptor, which frames read and the commit edits: sessions,
    their lengths, every page's reference count and the free session slots."""

    sessions: dict
    lengths: dict
    refs: list
    free_slots: list


@dataclass
class Commit:
    """Result of one frame commit: its epoch, the copy-on-write page copies ``(src, dst)`` the
    caller runs on the device (in order, :func:`apply_copies`) before the step writes its new
    tokens, the live session count, and what the policies report (by kind)."""

    epoch: int
    copies: list[tuple[int, int]]
    sessions: int
    stats: dict = field(default_factory=dict)


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
        double-buffered on CUDA). ``None`` keeps host tables only (``device_tables`` are then
        CPU tensors over the host tables).
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
        self.last_commit: Commit | None = None
        self.allocator = SpanAllocator(num_pages)
        self.committed = Committed({}, {}, [0] * num_pages,
                                   list(range(max_sessions - 1, -1, -1)))
        self.table_set = TableSet(self.device)
        self.policies: list = []
        self._plans: list = []                  # (policy, its plan or None)
        self._open: Frame | None = None
        self.add_table("block_table", (max_sessions, max_blocks), fill=-1)
        self.add_table("seq_lens", (max_sessions,), fill=0)

    # -- tables and policies -----------------------------------------------------------------
    def add_table(self, name: str, shape: tuple[int, ...], fill: int = 0) -> None:
        """Register an int32 table uploaded with every commit; only before the first frame
        (and before ``device_tables`` is first read)."""
        self.table_set.add(name, shape, fill)

    @property
    def host_tables(self) -> dict[str, np.ndarray]:
        """The committed tables (numpy views of the host buffer); fixes the layout."""
        self.table_set.fix()
        return self.table_set.host

    @property
    def device_tables(self) -> dict[str, torch.Tensor]:
        """Stable views of the device buffer (the host buffer without a device), refreshed by
        every commit; reading them fixes the table layout."""
        self.table_set.fix()
        return self.table_set.views

    def attach(self, policy) -> None:
        """Add a policy (:mod:`kvops.runtime.policy`): its ``tables()`` join the upload, its
        ``plan`` runs at every commit and its ``adopt`` after it. Only before the first frame.
        Refused, with nothing attached, when its ``sharing`` declaration or another attached
        policy's refuses the pair. An object with ``on_commit(frame, deltas, grown) -> stats``
        instead of ``plan`` is called the same way and adopts nothing."""
        if self.table_set.fixed:
            raise RuntimeError("attach: policies are fixed once a frame has opened")
        for other in self.policies:
            reason = sharing_refusal(other, policy)
            if reason:
                raise ValueError(reason)
        tables = policy.tables()
        for name in tables:
            if name in self.table_set.specs:
                raise ValueError(f"attach: table {name!r} already exists")
        for name, (shape, fill) in tables.items():
            self.add_table(name, shape, fill)
        self.policies.append(policy)
        self._plans.append((policy, getattr(policy, "plan", None)))

    # -- frames ------------------------------------------------------------------------------
    def frame(self) -> Frame:
        """Open the step's frame (one at a time); use as a context manager or call commit()."""
        if self._open is not None:
            raise RuntimeError(f"a frame (epoch {self._open.epoch}) is already open")
        tables = self.table_set
        if not tables.fixed:
            tables.fix()
        self._seq_lens = tables.host["seq_lens"]
        self._block_table = tables.host["block_table"]
        self._open = Frame(self)
        return self._open

    def close_frame(self, frame: Frame) -> None:
        """Called by an aborting frame: no frame is open any more."""
        if self._open is frame:
            self._open = None

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

    def apply_frame(self, f: Frame) -> Commit:
        """Commit ``f`` (what :meth:`Frame.commit` calls): deltas and the growth batch, the
        policies' plans, then apply; O(edits) Python, and the growth batch as a handful of
        numpy calls. Nothing is mutated before every plan has returned."""
        S, L = self.page_size, self.max_blocks
        c = self.committed
        sessions, lens = c.sessions, c.lengths
        e = f.edits
        # 1. what changed, EOS first (a slot an EOS frees may hold a new session too)
        deltas = []
        if e.length:
            closed, new_slots, overlay = e.closed, e.new, e.overlay
            opened = []
            for key, after in e.length.items():
                slot = new_slots.get(key)
                if slot is None:
                    sess = sessions[key]
                    gone = key in closed
                    (deltas if gone else opened).append(
                        SessionDelta(key, sess.slot, False, gone, lens[key], sess.blocks,
                                     0 if gone else after, overlay.get(key) or {}))
                else:
                    opened.append(SessionDelta(key, slot, True, False, 0, [], after,
                                               overlay.get(key) or {}, e.aliased.get(key, 0)))
            deltas += opened
        grown = e.grown
        n = len(grown)
        if n:
            packed = np.fromiter(e.gst.values(), np.int64, n)
            after = np.fromiter(grown.values(), np.int64, n)
        else:
            packed = after = _EMPTY
        batch = GrownBatch.of_frame(f, packed, after, self._seq_lens)
        slots = batch.slots
        stats: dict = {}
        adopt = []
        for policy, plan in self._plans:
            if plan is None:
                out = policy.on_commit(f, deltas, batch)
                if out:
                    stats.update(out)
                continue
            staged = plan(f, deltas, batch)
            if staged is None:
                continue
            state, out = staged
            if state is not None:
                adopt.append((policy.adopt, state))
            if out:
                stats[policy.kind] = out
        batch.seal()
        # 2. apply: refcounts and free lists, views, table entries
        refs, give = c.refs, self.allocator.give
        for page, d in e.ref.items():
            r = refs[page] + d
            refs[page] = r
            if r == 0:                  # last reference gone, or allocated and dropped in-frame
                give(page)
        tables = self.table_set
        track = self.device is not None
        changed: list = []
        region = tables.region
        if n:
            if n == len(lens) and not e.length:
                c.lengths = lens = grown    # every session grew and nothing else happened
            else:
                lens.update(grown)
            self._seq_lens.put(slots, after)
            if track:
                changed.append(region["seq_lens"])
        idx: list[int] = []
        val: list[int] = []
        master = tables.master
        bt_off, sl_off = region["block_table"].start, region["seq_lens"].start
        if e.app:                       # fresh blocks of growth-only sessions
            bt = self._block_table
            for key, pages in e.app.items():
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
            if dlt.closed:              # cleared first: a new session may take the slot
                del sessions[dlt.key]
                nb = -(-lens.pop(dlt.key) // S)
                master[row: row + nb] = -1
                master[sl_off + dlt.slot] = 0
                if track:
                    changed.append(slice(row, row + nb))
                    changed.append(slice(sl_off + dlt.slot, sl_off + dlt.slot + 1))
                continue
            sess = sessions.get(dlt.key)
            if sess is None:
                sess = sessions[dlt.key] = Session(dlt.slot)
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
        if e.freed_slots:
            c.free_slots.extend(e.freed_slots)
        if idx:
            at = np.asarray(idx, dtype=np.int64)
            master[at] = val
            if track:
                changed.append(at)
        for setter, where, vals, table in e.writes:
            setter(where, vals)
            if track:
                changed.append(tables.rows_of(table, where) if table.__class__ is str
                               else table)
        self.epoch = f.epoch
        self._open = None
        if track:
            tables.upload(self.epoch, changed)
        e.adopt = adopt
        self.last_commit = Commit(f.epoch, list(e.copies), len(sessions), stats)
        return self.last_commit

    # -- reads of the committed (active) descriptor -------------------------------------------
    def sessions(self) -> list[Hashable]:
        return list(self.committed.sessions)

    def length(self, session: Hashable) -> int:
        return self.committed.lengths[session]

    def pages(self, session: Hashable) -> list[int]:
        """Committed pages of every logical block of ``session`` (``-1`` trimmed)."""
        return list(self.committed.sessions[session].blocks)

    def slot(self, session: Hashable) -> int:
        return self.committed.sessions[session].slot

    def refcount(self, page: int) -> int:
        return self.committed.refs[page]

    @property
    def free_pages(self) -> int:
        return self.allocator.free
