"""Merge-staged transport (KV-RM section 4.3): committed view deltas -> page moves -> trains.

Each session slot ``b`` owns a fixed window arena of ``NW = W / S`` pages (arena pages
``b * NW .. b * NW + NW - 1``; the dense ``[B, W, Hkv, D]`` arena viewed as pages by
:func:`kvops.layouts.arena_as_pages`). The window is the session's last ``NW`` logical blocks,
kept in ring order: logical block ``j`` lives in arena page ``b * NW + j % NW``, so token ``p``
sits in arena slot ``p % W``. As the window slides, blocks already in the arena stay where
they are.

At every frame commit (the transport is a pager hook, :meth:`Pager.attach`), for each session
the frame touched, the blocks of its new window whose contents or mapping changed become page
moves: the blocks that received new tokens (unless ``copy_tail=False``: the model writes new
tokens into the arena itself), blocks whose page changed (copy-on-write, alias), and every
block of a session new to its slot. Blocks trimmed inside the window (page ``-1``)
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

Per step, ``stats`` (also in the commit's ``Commit.stats``) reports ``moves`` (unmerged: one
descriptor per page), ``groups`` (trains), ``bytes`` (one of K or V) and ``mean_train_bytes``.
"""

from __future__ import annotations

import numpy as np

from kvops.layouts.paged import arena_page
from kvops.layouts.trains import plan_trains
from kvops.runtime.pager import Frame, GrownBatch, Pager, SessionDelta


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
        pool page (as KV-RM's static kernel writes back), so growth moves nothing and only
        new sessions and remapped blocks are moved.
    """

    def __init__(self, pager: Pager, window_tokens: int, page_bytes: int,
                 max_train_bytes: int = 131072, copy_tail: bool = True):
        S = pager.page_size
        if window_tokens < S or window_tokens % S:
            raise ValueError(f"window_tokens: expected a positive multiple of the page size "
                             f"S={S}, got W={window_tokens}")
        self.pager = pager
        self.window_tokens = window_tokens
        self.pages_per_window = window_tokens // S
        self.page_bytes = page_bytes
        self.max_train_bytes = max_train_bytes
        self.copy_tail = copy_tail
        self.last: dict = {}
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
        if d.new:
            todo = range(first, nb)
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

    def on_commit(self, frame: Frame, deltas: list[SessionDelta], grown: GrownBatch) -> dict:
        """Pager hook: plan the step's trains and window bounds into the frame's tables."""
        S, W, NW = self.pager.page_size, self.window_tokens, self.pages_per_window
        src: list[int] = []
        dst: list[int] = []
        slots: list[int] = []
        lengths: list[int] = []
        for d in deltas:
            s, t = self.moves(d)
            src += s
            dst += t
            slots.append(d.slot)
            lengths.append(d.after_length)
        # tail-only growth, vectorized: one move each, the tail block (always in the window)
        g_slots = grown.slots if self.copy_tail else grown.slots[:0]
        tail = grown.before[: g_slots.size] // S
        all_src = np.concatenate((np.asarray(src, dtype=np.int64), self.pager.host_tables[
            "block_table"][g_slots, tail].astype(np.int64)))
        all_dst = np.concatenate((np.asarray(dst, dtype=np.int64), g_slots * NW + tail % NW))
        order = np.argsort(all_dst // NW, kind="stable")      # slot order, ring order within
        trains, stats = plan_trains(all_src[order], all_dst[order], self.page_bytes,
                                    self.max_train_bytes)
        all_slots = np.concatenate((np.asarray(slots, dtype=np.int64), grown.slots))
        if all_slots.size:
            after = np.concatenate((np.asarray(lengths, dtype=np.int64), grown.after))
            first = np.maximum(-(-after // S) - NW, 0) * S
            frame.scatter("win_start", all_slots, first % W)
            frame.scatter("win_len", all_slots, after - first)
        if stats["groups"]:
            frame.edit("trains", 0, trains.numpy().reshape(-1))
        frame.edit("num_trains", 0, [stats["groups"]])
        self.last = dict(stats, moves=int(all_src.size))
        return {"transport": self.last}

    def window_of(self, session) -> tuple[int, int]:
        """Committed ``(win_start, win_len)`` of ``session`` (host side, for tests)."""
        slot = self.pager.slot(session)
        tables = self.pager.host_tables
        return int(tables["win_start"][slot]), int(tables["win_len"][slot])
