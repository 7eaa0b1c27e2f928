"""Merge-staged transport (KV-RM section 4.3): committed view deltas -> page moves -> trains.

Each session slot ``b`` owns a fixed window arena of ``NW = W / S`` pages (arena pages
``b * NW .. b * NW + NW - 1``; the dense ``[B, W, Hkv, D]`` arena viewed as pages by
:func:`kvops.layouts.arena_as_pages`). The window is the session's last ``NW`` logical blocks,
kept in ring order: logical block ``j`` lives in arena page ``b * NW + j % NW``, so token ``p``
sits in arena slot ``p % W``. As the window slides, blocks already in the arena stay where
they are.

At every frame commit (the transport is a pager policy, :mod:`kvops.runtime.policy`), for each session
the frame touched, the blocks of its new window whose contents or mapping changed become page
moves: the blocks that received new tokens (unless ``copy_tail=False``: the model writes new
tokens into the arena itself), blocks whose page changed (copy-on-write, alias), and every
block of a session new to its slot (with ``copy_tail=False`` only those holding tokens that
exist before the step: an aliased prefix). Blocks trimmed inside the window (page ``-1``)
are not moved. The moves, in slot order then ring order, go through
:func:`kvops.layouts.plan_trains` (greedy merge up to ``max_train_bytes``); the trains and
their count are written into the frame's tables, so the commit's single upload carries them
and one ``paged_gather_merged(k_cache, v_cache, trains, num_trains, k_arena_pages,
v_arena_pages)`` moves the step.

Tables it adds to the pager (all int32): ``trains [B * NW, 3]`` and ``num_trains [1]`` for
``paged_gather_merged``; ``win_start [B]`` and ``win_len [B]`` for
``static_sliding_attention`` (the visible tokens are the window's blocks: from the first
window block's first token to the session's length, so between ``W - S + 1`` and ``W`` tokens
once the session is longer than the window).

With ``defer_aliased`` (write-through only), a new session's aliased blocks are staged rather
than moved at its arrival: its prefill reads the pool, not the arena, so the arena must hold
them only from the first step in which the session grows by one token (a decode, the runner's
arena path). Each commit drops the staged blocks that have left the session's window (a long
prompt's later chunks push an aliased prefix out before it is ever read, and those copies are
never made), moves up to ``stage_pages`` of the newest still staged, and at that first
one-token step moves all that remain: the age cutoff is the step that reads them.

Per step, ``last`` (also the commit's ``Commit.stats["transport"]``) reports ``moves``
(unmerged: one descriptor per page), ``groups`` (trains), ``bytes`` (one of K or V),
``mean_train_bytes``, and with ``defer_aliased`` ``staged`` (blocks still staged after the
commit) and ``dropped`` (staged blocks that left their window unmoved in this commit).
"""

from __future__ import annotations

import sys

import numpy as np

from kvops.layouts.paged import arena_page
from kvops.layouts.trains import plan_trains
from kvops.runtime.frame import Frame, GrownBatch, SessionDelta, const
from kvops.runtime.pager import Pager
from kvops.runtime.policy import Staged

_CONTINUES = const((1 << 32) + 1)      # packed move continuing the previous one
_LITTLE = sys.byteorder == "little"


def plan_packed(key: np.ndarray, page_bytes: int, max_train_bytes: int) -> np.ndarray | None:
    """:func:`plan_trains` for moves packed as int64 ``dst << 32 | src`` (ids in
    ``[0, 2**31)``, which the transport guarantees): the int32 ``[T, 3]`` trains, or ``None``
    when no move continues its predecessor, so every move is a train of one page (rows
    ``(src, dst, 1)`` in move order, which the caller writes without building them).

    A decode step's moves rarely continue one another (tails of different sessions), so the
    common case is one comparison; otherwise it is :func:`plan_trains` itself, so the trains
    are always the planner's.
    """
    if key.size > 1 and np.count_nonzero((key[1:] - key[:-1]) == _CONTINUES):
        trains, _ = plan_trains(key & 0xFFFFFFFF, key >> 32, page_bytes, max_train_bytes)
        return trains.numpy()
    return None


def _src_dst(key: np.ndarray) -> np.ndarray:
    """``[m, 2]`` int32 ``(src, dst)`` of packed moves; on little-endian hosts this is
    ``key.view(np.int32).reshape(m, 2)`` (the int64's low word is src, the high word dst)."""
    return np.stack((key & 0xFFFFFFFF, key >> 32), axis=1).astype(np.int32)


class _PackedColumns:
    """Big-endian hosts: ``view[rows] = keys`` writes packed moves as ``(src, dst)``."""

    ndim = 2

    def __init__(self, cols: np.ndarray):
        self.cols = cols

    def __setitem__(self, where, key: np.ndarray) -> None:
        self.cols[where] = _src_dst(key)


class Transport:
    """Ring-window transport for one pager. Attach it before the pager's first frame.

    Parameters
    ----------
    pager : Pager
        The pager whose commits it follows (it calls ``pager.attach(self)``).
    window_tokens : int
        ``W``, the near-window width (a multiple of the page size).
    page_bytes : int
        Bytes of one page of one of K or V (``PagedGeometry.page_bytes``).
    max_train_bytes : int
        tau for :func:`plan_trains` (128 KiB by default, as in the paper).
    copy_tail : bool
        True (default): blocks that received tokens are moved, so the arena follows the pool
        alone. False: the model writes each new token's K/V into its arena slot as well as its
        pool page (as KV-RM's static kernel writes back), prefill's included, so growth
        moves nothing and only a new session's aliased blocks and remapped blocks are moved.
    defer_aliased : bool
        With ``copy_tail=False``: stage a new session's aliased window blocks until the first
        step it grows by one token, dropping those that leave its window first (module doc).
    stage_pages : int or None
        Staged pages a session moves in a commit before that step (the newest first); default
        one train's worth, ``max_train_bytes // page_bytes``.
    """

    kind = "transport"

    def __init__(self, pager: Pager, window_tokens: int, page_bytes: int,
                 max_train_bytes: int = 131072, copy_tail: bool = True,
                 defer_aliased: bool = False, stage_pages: int | None = None):
        S = pager.page_size
        if window_tokens < S or window_tokens % S:
            raise ValueError(f"window_tokens: expected a positive multiple of the page size "
                             f"S={S}, got W={window_tokens}")
        if defer_aliased and copy_tail:
            raise ValueError("defer_aliased: expected copy_tail=False (with copy_tail every "
                             "block that gets tokens moves, so a session's arena follows the "
                             "pool at every step), got copy_tail=True")
        if stage_pages is None:
            stage_pages = max(max_train_bytes // page_bytes, 1)
        if stage_pages.__class__ is not int or stage_pages < 0:
            raise ValueError(f"stage_pages: expected an int >= 0, got {stage_pages!r}")
        self.defer_aliased, self.stage_pages = defer_aliased, stage_pages
        # slot -> (session, its staged blocks, ascending); replaced, never edited, so that an
        # aborted frame leaves it as it was
        self._staged: dict[int, tuple[object, list[int]]] = {}
        self.pager = pager
        self.window_tokens = window_tokens
        self.pages_per_window = window_tokens // S
        self.page_bytes = page_bytes
        self.max_train_bytes = max_train_bytes
        self.copy_tail = copy_tail
        self._ones = 0                  # leading rows of the committed trains with n == 1
        self._pairs = None              # writes packed moves into the host trains table
        self._num_trains = None         # the committed num_trains table
        # lookups by session length n (tokens, at most L * S), so a step's window bounds and
        # move destinations cost one fancy index each and no arithmetic: with nb = ceil(n / S)
        # blocks, the window's ring slot win_start = first % W and win_len = n - first, first
        # = max(nb - NW, 0) * S its first token; the last block's ring page (nb - 1) % NW,
        # shifted to a packed move's destination (16 bytes per token of the longest session).
        # And what slot b adds to slot << 32 to make b * NW << 32.
        NW = self.pages_per_window
        n = np.arange(pager.max_blocks * S + 1, dtype=np.int64)
        nb = -(-n // S)
        first = np.maximum(nb - NW, 0) * S
        self._win_start_at = (first % window_tokens).astype(np.int32)
        self._win_len_at = (n - first).astype(np.int32)
        self._ring_key_at = ((nb - 1) % NW) << 32
        self._slot_key = (np.arange(pager.max_sessions, dtype=np.int64) * (NW - 1)) << 32
        pager.attach(self)

    @property
    def arena_pages(self) -> int:
        """``Q = B * NW``: pages of the whole arena (first dim of ``k_out``)."""
        return self.pager.max_sessions * self.pages_per_window

    def tables(self) -> dict:
        B = self.pager.max_sessions
        return {"trains": ((self.arena_pages, 3), 0), "num_trains": ((1,), 0),
                "win_start": ((B,), 0), "win_len": ((B,), 0)}

    def moves(self, d: SessionDelta) -> tuple[list[int], list[int]]:
        """Page moves ``(src_pages, dst_pages)`` that bring slot ``d.slot``'s arena up to date."""
        if d.closed:
            return [], []
        S, NW = self.pager.page_size, self.pages_per_window
        nb = -(-d.after_length // S)
        first = max(0, nb - NW)
        grew = self.copy_tail and d.after_length > d.before_length
        grew_from = d.before_length // S if grew else nb
        if d.new:               # write-through: the blocks the step writes whole move nothing
            if self._defers(d):
                return [], []   # staged (plan): the step's prefill reads the pool
            todo = range(first, nb) if self.copy_tail else self._aliased_window(d)
        else:   # O(delta): blocks that got tokens, and remapped blocks still in the window
            todo = range(max(first, grew_from), nb)
            old_end = min(grew_from, -(-d.before_length // S))
            remapped = [j for j in d.after_overlay if first <= j < old_end]
            if remapped:
                todo = sorted(remapped) + list(todo)
        src, dst = [], []
        for j in todo:
            page = d.page_after(j)
            if page >= 0 and (d.new or j >= grew_from or page != d.page_before(j)):
                src.append(page)
                dst.append(arena_page(d.slot, j, NW))
        return src, dst

    def plan(self, frame: Frame, deltas: list[SessionDelta], grown: GrownBatch) -> Staged:
        """Policy plan: plan the step's trains and window bounds into the frame's tables.

        Sessions with general edits go through :meth:`moves` (Python, O(edits)). The
        growth-only batch costs a few numpy calls whatever its size: with ``copy_tail`` each of
        its sessions moves the block its last token landed in (``grown.tails``), except the
        rare ones whose tokens spanned several blocks (``grown.multi``), which move each.
        """
        ex_key: list[int] = []          # moves as dst << 32 | src, and their slots
        ex_slot: list[int] = []
        staged = None
        if deltas:
            w_slot, w_after = [], []
            for d in deltas:
                src, dst = self.moves(d)
                if src:
                    ex_key += [t << 32 | s for s, t in zip(src, dst)]
                    ex_slot += [d.slot] * len(src)
                w_slot.append(d.slot)
                w_after.append(d.after_length)
            if self.defer_aliased:
                staged = self._stage_opened(deltas)
        stage_stats = None
        if self.defer_aliased:
            staged, stage_stats = self._stage_moves(frame, deltas, grown, staged, ex_key, ex_slot)
        slots, after = grown.slots, grown.after
        key = None
        if self.copy_tail and slots.size:
            # the last block's arena page (slot's ring, block nb - 1) and pool page, packed:
            # grown.packed is slot << 32 | tail, the tables add the rest of the destination
            key = grown.packed + self._slot_key[slots]
            key += self._ring_key_at[after]
            kslot = slots
            multi = grown.multi
            if multi:                       # tokens in several blocks: each of them moves
                S, NW = self.pager.page_size, self.pages_per_window
                before = grown.before
                for i, k in multi:
                    slot, n = int(slots[i]), -(-int(after[i]) // S)
                    for j in range(max(n - NW, int(before[i]) // S), n):
                        page = frame.page(k, j)
                        if page >= 0:
                            ex_key.append(arena_page(slot, j, NW) << 32 | page)
                            ex_slot.append(slot)
                keep = np.ones(slots.size, dtype=bool)
                keep[[i for i, _ in multi]] = False
                key, kslot = key[keep], slots[keep]
        if ex_key:
            more = np.array(ex_key, dtype=np.int64)
            if key is None:
                key, kslot = more, np.array(ex_slot, dtype=np.int64)
            else:
                key = np.concatenate((key, more))
                kslot = np.concatenate((kslot, np.array(ex_slot, dtype=np.int64)))
            key = key[np.argsort(kslot, kind="stable")]     # slot order, ring order within
        elif key is not None:
            key.sort()                      # one move per slot: destination order is slot order
        m = 0 if key is None else int(key.size)
        groups, ones = 0, self._ones
        if m:
            trains = plan_packed(key, self.page_bytes, self.max_train_bytes)
            if trains is None:              # one-page trains: (src, dst) columns, n = 1
                groups = m
                frame.write("trains", slice(0, m), key,
                            via=self._pair_view() if self._pairs is None else self._pairs)
                if m > ones:
                    frame.write("trains", (slice(ones, m), 2), 1)
                    ones = m
            else:
                groups = len(trains)
                frame.write("trains", slice(0, groups), trains)
                ones = 0
        if self._num_trains is None:
            self._num_trains = self.pager.host_tables["num_trains"]
        if groups != self._num_trains[0]:   # committed; rarely changes
            frame.write("num_trains", 0, groups)
        if deltas:
            slots = np.concatenate((slots, np.array(w_slot, dtype=np.int64)))
            after = np.concatenate((after, np.array(w_after, dtype=np.int64)))
        if slots.size:                      # the window: the last NW blocks
            frame.write("win_start", slots, self._win_start_at[after])
            frame.write("win_len", slots, self._win_len_at[after])
        nbytes = m * self.page_bytes
        last = {"groups": groups, "bytes": nbytes,
                "mean_train_bytes": nbytes / groups if groups else 0.0, "moves": m}
        if stage_stats is not None:
            last.update(stage_stats)
        if ones == self._ones and staged is None:
            return Staged(None, last)
        return Staged((ones, staged), last)

    def adopt(self, state) -> None:
        ones, staged = state
        self._ones = ones
        if staged is not None:
            self._staged = staged

    def _defers(self, d: SessionDelta) -> bool:
        """``defer_aliased`` stages new session ``d``'s aliased window blocks: it does not read
        its arena in this step (it grows by more than one token: a prefill)."""
        return self.defer_aliased and d.new and d.after_length - d.aliased != 1

    def _aliased_window(self, d: SessionDelta) -> range:
        """New session ``d``'s blocks that hold aliased tokens and lie in its window."""
        S = self.pager.page_size
        nb = -(-d.after_length // S)
        return range(max(0, nb - self.pages_per_window), min(nb, -(-d.aliased // S)))

    def _stage_opened(self, deltas: list[SessionDelta]) -> dict | None:
        """The staged blocks after this commit's closes and opens (``None``: unchanged): a
        closed session's go; a new session that aliased blocks inside its window and does not
        read its arena in this step stages them."""
        staged = None
        for d in deltas:                        # closes come before opens
            if d.closed and d.slot in self._staged:
                staged = dict(self._staged if staged is None else staged)
                del staged[d.slot]
            elif self._defers(d) and (blocks := list(self._aliased_window(d))):
                staged = dict(self._staged if staged is None else staged)
                staged[d.slot] = (d.key, blocks)
        return staged

    def _stage_moves(self, frame: Frame, deltas: list[SessionDelta], grown: GrownBatch,
                     staged: dict | None, ex_key: list[int], ex_slot: list[int]):
        """Move the staged blocks this commit takes (into ``ex_key``, ``ex_slot``): every one
        still in the window of a session that grows by one token in this step, else up to
        ``stage_pages`` of the newest; drop those that left the window. Returns the staged
        blocks after the commit (``None``: unchanged) and the stats."""
        have = self._staged if staged is None else staged
        if not have:
            return staged, {"staged": 0, "dropped": 0}
        S, NW = self.pager.page_size, self.pages_per_window
        span = {d.slot: (d.aliased if d.new else d.before_length, d.after_length, d)
                for d in deltas if not d.closed}
        slots = np.fromiter(have, np.int64, len(have))
        for i in np.flatnonzero(np.isin(grown.slots, slots)).tolist():
            span[int(grown.slots[i])] = (int(grown.before[i]), int(grown.after[i]), None)
        out, dropped, left = {}, 0, 0
        for slot, (key, blocks) in have.items():
            got = span.get(slot)
            if got is None:                     # not in this frame: nothing read, stage on
                n = self.pager.length(key)
                got = (n, n, None)
            before, after, d = got
            first = max(0, -(-after // S) - NW)
            keep = [j for j in blocks if j >= first]
            dropped += len(blocks) - len(keep)
            if d is not None and not d.new:     # remapped blocks: moves() moves them now
                keep = [j for j in keep if d.page_after(j) == d.page_before(j)]
            cut = 0 if after - before == 1 else max(len(keep) - self.stage_pages, 0)
            take = keep[cut:]
            for j in take:
                page = frame.page(key, j)
                if page >= 0:
                    ex_key.append(arena_page(slot, j, NW) << 32 | page)
                    ex_slot.append(slot)
            rest = keep[:cut]
            if rest:
                out[slot] = (key, rest)
                left += len(rest)
        return out, {"staged": left, "dropped": dropped}

    @property
    def last(self) -> dict:
        """The last commit's stats (``Commit.stats["transport"]``; ``{}`` before the first)."""
        commit = self.pager.last_commit
        return commit.stats.get("transport", {}) if commit is not None else {}

    def _pair_view(self):
        """A view of the host trains table that takes packed moves ``dst << 32 | src`` into
        the ``(src, dst)`` columns of its rows. On little-endian hosts an int64 at a row's start
        is exactly that, so a (strided, unaligned) int64 view of the first two columns takes
        the keys in one copy."""
        host = self.pager.host_tables["trains"]
        if _LITTLE:
            self._pairs = host.view(np.dtype([("sd", "<i8"), ("n", "<i4")])).reshape(-1)["sd"]
        else:
            self._pairs = _PackedColumns(host[:, :2])
        return self._pairs

    def window_of(self, session) -> tuple[int, int]:
        """Committed ``(win_start, win_len)`` of ``session`` (host side, for tests)."""
        slot = self.pager.slot(session)
        tables = self.pager.host_tables
        return int(tables["win_start"][slot]), int(tables["win_len"][slot])
