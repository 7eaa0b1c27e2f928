"""Far view (KV-RM section 4.4): a bounded set of far-chunk summaries beside the near window.

Each session keeps its exact near window (the transport's last ``W / S`` blocks) and, per layer,
at most ``cap`` (``C``) summaries of far chunks of ``sv_chunk = M * S`` tokens, so the decode
kernel sees a fixed ``W + C`` width: ``static_sliding_attention(..., far_k, far_v, far_bias)``
with ``far_k, far_v [B, C, Hkv, D]`` and ``far_bias float32 [B, C]``.

Chunks
    Chunk ``j`` of a session is its logical blocks ``[j*M, (j+1)*M)``. It becomes *far* at the
    commit where all its blocks precede the window (``(j+1)*M <= nb - W/S``, ``nb`` the
    session's blocks). A session's far history is therefore its complete chunks before the
    window: up to ``sv_chunk - S`` tokens between the newest far chunk and the window's first
    token are in neither (they join the far view when their chunk completes). A chunk with a
    trimmed block (page -1) is never summarized.

Summaries, computed once
    The commit where a chunk becomes far writes its pages into the ``far_leave_pages`` table
    (at most ``max_leave`` chunks per session per commit; more wait for later commits, in order).
    In the step, :meth:`FarView.absorb` runs ``far_view_summarize`` over that table, one fixed-
    shape call per layer, and scatters the summaries into a per-layer store
    ``[B, J + 1, Hkv, D]`` (``J`` chunks per session, row ``J`` a sink for unused rows). A
    summary is never recomputed; selection only changes which stored rows the kernel sees.

Utility and selection
    :meth:`FarView.observe` takes the kernel's ``lse [B, Hq]`` and the far slots it just
    attended to and computes, without touching the window, the attention mass each summary
    received, ``mass_c = sum over query heads of exp(q . k_sum_c * scale + far_bias_c - lse)``,
    and updates that chunk's utility ``u_c <- ema * u_c + (1 - ema) * mass_c`` on the device.
    Chunks not in the view keep their utility. A new summary starts at the largest utility
    among the session's selected chunks (optimistic, so it gets tried). Each row of the
    selection holds, per layer and session, the ``C`` summarized chunks of highest utility
    (ties: the newer chunk) by the utilities of the last :meth:`FarView.pull_scores` (one step
    old when called after each step; the engine pulls every ``far_rerank`` steps). The pull
    ranks on the device, where the utilities are: one ``far_view_rank`` op (each layer's and
    session's top ``C`` ranking keys, compared with the committed rows) brings back only the
    ``[L, B, C]`` keys and which rows change; the next commit writes those rows. A chunk
    summarized since the last pull has no utility on the host yet and ranks above every pulled
    one (of two such, the newer). Between pulls the ranking cannot change, so a commit only
    puts each new summary in place of its row's lowest entry (an empty slot first). A row's
    slots are in no particular order (the kernel does not care).

Commits
    The far view is a pager policy (:mod:`kvops.runtime.policy`): its tables
    ``far_select [layers * B, C]`` (chunk ids, ``-1`` empty), ``far_leave_pages [B * max_leave,
    M]`` and ``far_leave_ids [B * max_leave]`` are written inside the step's frame and go up
    with the pager's single upload, so the kernel shapes and the one-commit-per-step rule hold.
    Selection rows are written only where they change. A queued chunk keeps only its id; its
    pages are read when its summary is due (from the committed block table, or the frame's view
    for a session the frame edits), and a chunk whose blocks were trimmed meanwhile is dropped.
    Host state is a few arrays over the slots (chunks far, chunks done, dropped chunks, the
    ranking key of every committed selection entry), so a commit's work is array ops over all
    sessions and layers at once, Python only per session with general edits; a decode step's
    commit, the one after a pull included, takes a short path of about a dozen array ops. The
    plan returns the next host state without touching the current one; the pager adopts it
    once the commit is complete, so an aborted frame leaves the far view as it was (and a
    pull's ranking waits for the next commit).

Bias switch
    ``far_bias = log(M * S)`` for a selected slot when ``log_count_bias`` (a summary stands for
    ``M * S`` tokens), ``0`` otherwise; ``-inf`` for an empty slot. The value is read when
    :meth:`FarView.view` runs (a captured graph keeps the value it was captured with).

A decode step, for every layer ``l`` after the frame's commit::

    far.absorb(l, k_cache[l], v_cache[l])
    far_k, far_v, far_bias = far.view(l)
    out, lse = torch.ops.kvops.static_sliding_attention(q, k, v, win_start, win_len,
                                                        far_k, far_v, far_bias)
    far.observe(l, q, far_k, far_bias, lse)

and ``far.pull_scores()`` once after the step. Every device method is fixed-shape and
host-sync free (compiles once, replays in a CUDA graph). With the layers' pools stacked in one
allocation, :meth:`FarView.absorb_layers` and :meth:`FarView.views` do the absorb and the
views of every layer at once, before the layers.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from kvops.ops.far_view_rank import EMPTY_KEY, rank_keys
from kvops.runtime.frame import Frame, GrownBatch, SessionDelta
from kvops.runtime.pager import Pager
from kvops.runtime.policy import Staged

_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False
_FILL = np.array(-1, dtype=np.int32)            # an empty leave page or selection slot
_FILL.flags.writeable = False
_CLEARED, _DECODE, _GENERAL = "cleared", "decode", "general"     # kinds of staged state


def _ids_of(keys: np.ndarray) -> np.ndarray:
    """The chunk ids of ranking keys as far_select entries (int32, ``-1`` for an empty key):
    their low 32 bits."""
    return keys.astype(np.int32)


_FRESH = int(rank_keys(np.array([np.inf], dtype=np.float32), np.zeros(1, np.int64))[0])


class FarView:
    """Far-view policy for one pager; attach before the pager's first frame.

    Parameters
    ----------
    pager : Pager
        Maps sessions to pages of the pools ``[P, S, Hkv, D]`` (one pair per layer).
    window_tokens : int
        ``W``, the near-window width in tokens (a multiple of ``S``; the transport's window).
    chunk_tokens : int
        ``sv_chunk``, tokens per far chunk (a multiple of ``S``): ``M = sv_chunk / S`` pages.
    cap : int
        ``C``, far slots the kernel sees per session and layer.
    num_layers, num_kv_heads, head_dim : int
        Model geometry (``Hkv``, ``D``); one summary store and utility table per layer.
    dtype, device
        Of the KV pools (the summaries are stored in the pool dtype).
    max_leave : int
        Chunks per session summarized per commit (prefill can make many chunks far at once).
    ema : float
        Utility decay per step, in ``[0, 1)``.
    log_count_bias : bool
        ``far_bias = log(M * S)`` (True) or ``0`` (False) for a selected slot.
    """

    def __init__(self, pager: Pager, *, window_tokens: int, chunk_tokens: int, cap: int,
                 num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: torch.device | str | None = None,
                 max_leave: int = 1, ema: float = 0.9, log_count_bias: bool = True):
        S = pager.page_size
        for name, val in (("window_tokens", window_tokens), ("chunk_tokens", chunk_tokens)):
            if val < S or val % S:
                raise ValueError(f"{name}: expected a positive multiple of the page size S={S}, "
                                 f"got {val}")
        if cap < 1 or max_leave < 1 or num_layers < 1:
            raise ValueError(f"cap, max_leave and num_layers must be >= 1, got {cap}, "
                             f"{max_leave}, {num_layers}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema: expected a value in [0, 1), got {ema}")
        self.pager = pager
        self.B = pager.max_sessions
        self.M = chunk_tokens // S
        self.J = pager.max_blocks // self.M
        if self.J < 1:
            raise ValueError(f"chunk_tokens: a chunk of {self.M} pages does not fit the block "
                             f"table's L={pager.max_blocks} blocks")
        self.window_pages = window_tokens // S
        self.C, self.layers, self.max_leave = cap, num_layers, max_leave
        self.ema, self.log_count_bias = ema, log_count_bias
        self.count = chunk_tokens
        dev = torch.device(device) if device is not None else (pager.device or torch.device("cpu"))
        store = (num_layers, self.B, self.J + 1, num_kv_heads, head_dim)
        self.k_store = torch.zeros(store, dtype=dtype, device=dev)
        self.v_store = torch.zeros(store, dtype=dtype, device=dev)
        self.scores = torch.zeros((num_layers, self.B, self.J + 1), dtype=torch.float32, device=dev)
        # the first store row of each slot in a layer's store viewed [B * (J + 1), Hkv, D]
        self._store_row = torch.arange(self.B, device=dev, dtype=torch.int32)[:, None] * (self.J + 1)
        self._host_scores = np.zeros((num_layers, self.B, self.J + 1), dtype=np.float32)
        self._host_stale = False                      # the device utilities moved since
        B, J, L = self.B, self.J, num_layers
        # host state, one entry per slot: chunks [0, seen) have become far, [0, done) were
        # summarized or dropped (so [done, seen) are queued, in order; nothing is queued where
        # they are equal); ``dropped`` marks those with a trimmed block, never summarized
        self._sd = np.zeros((2, B), dtype=np.int64)
        self._seen, self._done = self._sd
        self._dropped = np.zeros((B, J), dtype=bool)
        self._holes: set[int] = set()                 # slots with a dropped chunk
        self.lead_epoch = 0                           # adopted commits that moved done/dropped
        self._keys: list = [None] * B                 # the session in each slot
        self._queue = _NONE                           # the slots with queued chunks
        self._leave_rows = _NONE                      # far_leave rows the last commit filled
        # the last pull_scores' ranking for the next commit: keys [L, B, C] int64 (aligned
        # with the committed row where it stays) and changed [L, B]
        self._pulled = None
        self._summ_bufs = ()                           # a device pull's mask: pinned, device
        # the ranking key (rank_keys) of every committed far_select entry: its pulled utility,
        # +inf for a summary stored since the last pull (its utility is not on the host yet),
        # EMPTY_KEY for an empty slot; so a row's lowest entry is the one a new summary evicts
        self._sel_key = np.full((L, B, cap), EMPTY_KEY, dtype=np.int64)
        self._fresh_key = _FRESH | np.arange(J, dtype=np.int64)
        # far chunks of a session of n tokens (a lookup by length, as the transport's)
        n = np.arange(pager.max_blocks * S + 1, dtype=np.int64)
        self._far_at = np.clip((-(-n // S) - self.window_pages) // self.M, 0, J)
        # index helpers
        self._lrow = np.arange(L, dtype=np.int64)[:, None]
        self._chunk_cols = np.arange(self.M, dtype=np.int64)
        self._chunk_blocks = np.arange(J)[:, None] * self.M + self._chunk_cols   # [J, M]
        # where the blocks of chunk j of slot b are in the flat block table: [B, J, M]
        self._page_at = (np.arange(B, dtype=np.int64)[:, None] * pager.max_blocks
                         + np.arange(J * self.M, dtype=np.int64)).reshape(B, J, self.M)
        self._chunk_ids = np.arange(J, dtype=np.int64)
        self._leave_cols = np.arange(max_leave, dtype=np.int64)
        self._sink = np.array(J, dtype=np.int32)
        self._bt = self._sel = None                    # host table views, at the first plan
        self._score_at = None                          # flat index helper of the host ranking
        self.last: dict = {}
        pager.attach(self)

    # -- pager policy -------------------------------------------------------------------------
    kind = "far_view"

    def tables(self) -> dict:
        B, C, M, n = self.B, self.C, self.M, self.B * self.max_leave
        return {"far_select": ((self.layers * B, C), -1),
                "far_leave_pages": ((n, M), -1),
                "far_leave_ids": ((n,), self.J)}

    def plan(self, frame: Frame, deltas: list[SessionDelta], grown: GrownBatch) -> Staged:
        """Policy plan: new far chunks, this commit's summaries and the selection, as table
        writes; the host state to adopt. No loop over sessions or layers: Python work is per
        session with general edits (and per queued chunk one of whose pages the committed
        block table does not hold); growth, the queue, the leave rows and the selection are
        array ops over all sessions and layers at once. A decode step's commit (nothing queued,
        ``max_leave`` 1, no session opened, closed or given a far chunk by a general edit:
        growth, and trims such as the engine's of summarized far blocks) takes a short path of
        about a dozen array ops whatever the session count: one write puts in the rows a pull
        changed, one lookup and subtraction find the sessions whose next chunk became far, one
        take of the committed block table reads their pages, one argmin over every layer's
        ranking keys finds the entry each new summary replaces, and one write puts it there."""
        if self._bt is None:
            tables = self.pager.host_tables
            self._bt = tables["block_table"]
            self._bt_flat = self._bt.reshape(-1)
            self._sel = tables["far_select"].reshape(self.layers, self.B, self.C)
        if self._queue.size or self.max_leave != 1:
            return self._plan_general(frame, deltas, grown)
        if deltas:                  # the short path holds if no edited session opens, closes
            seen, far_at = self._seen, self._far_at    # or gains a far chunk (a trim of
            for d in deltas:                           # summarized far blocks, say)
                if d.closed or d.new or far_at[d.after_length] != seen[d.slot]:
                    return self._plan_general(frame, deltas, grown)
        g = grown.slots
        rows = self._leave_rows
        moved, sel_key = 0, self._sel_key
        if self._pulled is not None:            # the pull's rows first, in place
            moved, sel_key, _ = self._put_pulled(frame)
        if g.size:
            had = self._seen[g]
            more = self._far_at[grown.after] - had      # far chunks each session gained
            hit = more.nonzero()[0]
        else:
            hit = _NONE
        if not hit.size:
            last = {"summaries": 0, "select_rows_changed": moved, "pending": 0}
            if rows.size:                       # last commit's rows: nothing to summarize
                frame.write("far_leave_pages", rows, _FILL)
                frame.write("far_leave_ids", rows, self._sink)
            how = _CLEARED if rows.size else None
            return Staged((how, (last, sel_key)), last)
        q = g[hit]                              # max_leave 1: the slots are the leave rows
        first = had[hit]                        # nothing queued: the first new far chunk
        pages = self._bt_flat.take(self._page_at[q, first])     # [n, M], committed
        # a trimmed block, or one appended in this frame (a Python min is the cheaper test
        # of a few pages)
        if (min(pages.ravel().tolist()) if q.size < 8 else pages.min()) < 0:
            return self._plan_general(frame, deltas, grown)    # (it writes the pull's rows)
        if rows.size:
            frame.write("far_leave_pages", rows, _FILL)
            frame.write("far_leave_ids", rows, self._sink)
        frame.write("far_leave_pages", q, pages)
        frame.write("far_leave_ids", q, first)
        col = sel_key.take(q, axis=1).argmin(axis=2)              # [L, n]: the entry to replace
        at = ((self._lrow * self.B + q) * self.C + col).reshape(-1)  # its flat position
        frame.write("far_select", (self._lrow, q, col), first, via=self._sel, at=at)
        queue, lim, pending = _NONE, None, 0
        # more far chunks than one summary queue; a session gains at most one far chunk unless
        # its new tokens spanned several blocks (grown.multi, empty in a decode step)
        if grown.multi and more.max() > 1:
            more = more[hit]
            queue, lim, pending = q[more > 1], first + more, int(more.sum()) - q.size
        last = {"summaries": int(q.size), "select_rows_changed": int(col.size) + moved,
                "pending": pending}
        return Staged((_DECODE, (q, first, lim, col, queue, last, sel_key)), last)

    def _plan_general(self, frame: Frame, deltas: list[SessionDelta],
                      grown: GrownBatch) -> Staged:
        """:meth:`plan` for any commit: general edits, a queue, a pull to rank, ``max_leave``
        above 1, pages the committed block table does not hold."""
        sd = self._sd.copy()
        seen, done = sd
        views: dict[int, SessionDelta] = {}
        resets: list[int] = []
        keys: dict[int, object] = {}
        far_at = self._far_at
        for d in deltas:                        # EOS first: a reused slot starts empty
            b = d.slot
            views.pop(b, None)
            if d.closed or d.new:
                seen[b] = done[b] = 0
                resets.append(b)
                keys[b] = d.key if d.new else None
                if d.closed:
                    continue
            views[b] = d
            far = far_at[d.after_length]
            if far > seen[b]:
                seen[b] = far
        g = grown.slots
        if g.size:                              # growth-only sessions whose far history grew
            far = far_at[grown.after]
            hit = (far > seen[g]).nonzero()[0]
            seen[g[hit]] = far[hit]
        dropped: list[tuple[int, int]] = []
        take = self._take(frame, seen, done, views, keys, dropped)
        last_rows = self._leave_rows
        if last_rows.size:                      # last commit's rows: nothing to summarize
            frame.write("far_leave_pages", last_rows, _FILL)
            frame.write("far_leave_ids", last_rows, self._sink)
        rows = _NONE
        if take is not None:
            rows, _, ids, pages, _, _ = take
            frame.write("far_leave_pages", rows, pages)
            frame.write("far_leave_ids", rows, ids)
        changed, keyed = self._select(frame, take, resets)
        left = seen - done
        queue = np.flatnonzero(left)
        pending = int(left[queue].sum()) if queue.size else 0
        last = {"summaries": int(rows.size), "select_rows_changed": changed, "pending": pending}
        return Staged((_GENERAL, (sd, take, resets, keys, dropped, keyed, rows, queue, last)),
                      last)

    def _take(self, frame: Frame, seen: np.ndarray, done: np.ndarray,
              views: dict[int, SessionDelta], keys: dict[int, object],
              dropped: list[tuple[int, int]]):
        """This commit's summaries, advancing ``done`` in place: every session's next
        ``max_leave`` queued chunks, their pages as the frame maps them now. A chunk with a
        trimmed block is dropped (into ``dropped``), never summarized, and the next queued one
        is tried instead. Pages come from the committed block table in one gather; sessions
        with general edits in the frame, or with a chunk one of whose pages that table does not
        hold (trimmed, or appended in this frame), are read from the frame's view, one chunk at
        a time.

        Returns ``None`` (no summary) or ``(rows, slots, ids, pages, sessions, taken)``: per
        summary its far_leave row, slot, chunk id and pages ``[n, M]``; per session with a
        summary its slot and its chunk ids ``[u, max_leave]`` in order (``-1`` padded)."""
        q = (seen > done).nonzero()[0]
        if not q.size:
            return None
        M, n = self.M, self.max_leave
        first, lim = done[q], seen[q]
        ids = first[:, None] + self._leave_cols                   # [q, n]
        valid = ids < lim[:, None]
        pages = self._bt[q[:, None, None], self._chunk_blocks[np.minimum(ids, self.J - 1)]]
        bad = (valid & (pages.min(axis=2) < 0)).any(axis=1)       # pages: [q, n, M]
        if views:
            mark = np.zeros(self.B, dtype=bool)
            mark[list(views)] = True
            bad |= mark[q]
        fast = ~bad
        use = valid & fast[:, None]
        slots = np.broadcast_to(q[:, None], ids.shape)[use]
        got_rows = [slots * n + np.broadcast_to(self._leave_cols, ids.shape)[use]]
        got_slots, got_ids, got_pages = [slots], [ids[use]], [pages[use]]
        done[q[fast]] = np.minimum(first + n, lim)[fast]
        sessions, taken = [q[fast]], [np.where(valid, ids, -1)[fast]]
        for b in q[bad].tolist():               # Python, chunk by chunk, as the frame maps it
            d = views.get(b)
            key = keys.get(b, self._keys[b])
            j, stop, mine = int(done[b]), int(seen[b]), []
            while j < stop and len(mine) < n:
                lo, hi = j * M, (j + 1) * M
                got = ([d.page_after(i) for i in range(lo, hi)] if d is not None
                       else frame.block_pages(key, lo, hi))
                if min(got) >= 0:
                    got_rows.append(np.array([b * n + len(mine)]))
                    got_slots.append(np.array([b]))
                    got_ids.append(np.array([j]))
                    got_pages.append(np.array([got], dtype=np.int32))
                    mine.append(j)
                else:
                    dropped.append((b, j))
                j += 1
            done[b] = j
            if mine:
                sessions.append(np.array([b]))
                taken.append(np.array([mine + [-1] * (n - len(mine))]))
        rows = np.concatenate(got_rows).astype(np.int64)
        if not rows.size:
            return None
        return (rows, np.concatenate(got_slots).astype(np.int64),
                np.concatenate(got_ids).astype(np.int64), np.concatenate(got_pages),
                np.concatenate(sessions).astype(np.int64), np.concatenate(taken))

    def _select(self, frame: Frame, take, resets: list[int]):
        """The selection rows of a general commit, as writes; returns the rows changed and
        the ranking keys to adopt: ``("rows", sessions, keys [L, u, C])`` for the sessions
        written, or ``("all", keys [L, B, C])`` after a pull.

        A closed or reopened slot shows nothing. After a pull, the rows it changed are written
        first (:meth:`_put_pulled`). A row then holds the top ``C`` of its summaries by ranking
        key, so each new summary (key +inf, above all but newer ones) replaces the row's lowest
        entry: one argmin over every session and layer a round (one round per summary a
        session takes in this commit), which keeps the top ``C`` of the pulled summaries and
        this commit's ones together."""
        sel = self._sel
        changed = 0
        at = np.array(resets, dtype=np.int64) if resets else None
        keys = moved = None
        if self._pulled is not None:
            changed, keys, moved = self._put_pulled(frame, resets)
        if resets:
            wipe = (sel[:, at] >= 0).any(axis=2)                  # [L, r]
            changed += int(wipe.sum())
            frame.write("far_select", (slice(None), at), _FILL, via=sel)
        keyed = None if keys is None else ("all", keys)
        if take is None:
            return changed, keyed
        sessions, taken = take[4], take[5]
        cur = sel[:, sessions]                                    # [L, u, C]
        kr = (self._sel_key if keys is None else keys)[:, sessions]
        if moved is not None:                   # the rows the pull rewrote, as written
            m = moved[:, sessions]
            cur[m] = _ids_of(kr[m])
        if resets:
            gone = np.isin(sessions, resets)
            cur[:, gone], kr[:, gone] = -1, EMPTY_KEY
        idx = np.arange(sessions.size)
        for r in range(taken.shape[1]):
            new = taken[:, r]
            p = idx[new >= 0]
            if not p.size:
                break
            col = kr[:, p].argmin(axis=2)                         # [L, p]
            cur[self._lrow, p, col] = new[p]
            kr[self._lrow, p, col] = self._fresh_key[new[p]]
        frame.write("far_select", (slice(None), sessions), cur, via=sel)
        changed += int(cur.shape[0] * sessions.size)
        if keys is None:
            keyed = ("rows", sessions, kr)
        else:
            if keys is self._pulled[0]:         # the pull's own array: a frame that aborts
                keys = keys.copy()              # leaves the pull as it came
            keys[:, sessions] = kr
            keyed = ("all", keys)
        return changed, keyed

    def _put_pulled(self, frame: Frame, resets: list[int] | None = None):
        """Write the selection rows the last pull changes (not those of ``resets``, slots this
        commit wipes); returns ``(rows written, keys [L, B, C], changed [L, B])``: every
        committed entry's ranking key after those writes."""
        C, B = self.C, self.B
        keys, moved = self._pulled             # the pull's own arrays: adopted, then edited
        if resets:                              # (copies: an aborted frame keeps the pull)
            keys, moved = keys.copy(), moved.copy()
            moved[:, resets] = False
            keys[:, resets] = EMPTY_KEY
        layers, rows = np.nonzero(moved)
        n = int(layers.size)
        if 4 * n > moved.size:                  # many: the whole table (a row that stays
            frame.write("far_select", slice(None),          # reads as it is committed)
                        _ids_of(keys).reshape(-1, C))
        elif n:                                 # by far_select row (layer * B + slot): the
            frame.write("far_select", layers * B + rows,    # upload copies the rows written
                        _ids_of(keys[layers, rows]))
        return n, keys, moved

    def adopt(self, state) -> None:
        how, got = state
        self._pulled = None                     # a commit puts a pull's ranking in place
        if how is None or how is _CLEARED:      # nothing changed but the stats (and a pull)
            self.last, self._sel_key = got
            if how is _CLEARED:
                self._leave_rows = _NONE
        elif how is _DECODE:
            self.lead_epoch += 1
            q, first, lim, col, queue, last, self._sel_key = got
            if lim is None:                     # seen = done: nothing queued
                self._sd[:, q] = first + 1
            else:
                self._seen[q] = lim
                self._done[q] = first + 1
            self._sel_key[self._lrow, q, col] = self._fresh_key[first]
            self._leave_rows, self._queue, self.last = q, queue, last
        else:
            self.lead_epoch += 1
            sd, take, resets, keys, dropped, keyed, rows, queue, last = got
            self._sd = sd
            self._seen, self._done = sd
            for b, key in keys.items():
                self._keys[b] = key
            if resets:
                self._dropped[resets] = False
                self._holes.difference_update(resets)
                self._sel_key[:, resets] = EMPTY_KEY
            if dropped:
                self._dropped[tuple(np.array(dropped).T)] = True
                self._holes.update(b for b, _ in dropped)
            if keyed is not None and keyed[0] == "rows":
                self._sel_key[:, keyed[1]] = keyed[2]
            elif keyed is not None:             # after a pull: every entry's key
                self._sel_key = keyed[1]
            self._leave_rows, self._queue, self.last = rows, queue, last

    # -- host reads ---------------------------------------------------------------------------
    @property
    def summaries_due(self) -> bool:
        """Whether the last commit queued summaries for :meth:`absorb` (without any, every
        ``far_leave`` row is empty and an absorb changes nothing, so a caller outside a
        captured graph may skip it)."""
        return bool(self._leave_rows.size)

    def pull_scores(self, values=None) -> None:
        """Rank every session's summaries again by the utilities on the device, for the next
        commit to put in place; syncs the device. ``values``: host utilities ``[layers, B,
        J + 1]`` to rank instead (e.g. from a replay). On a GPU the ranking is one op
        (``torch.ops.kvops.far_view_rank``: one program a row, against the committed rows)
        and brings back the ``[L, B, C]`` int64 keys and which rows change (a few hundred KiB
        at hundreds of sessions) instead of the utilities, through pinned memory; the host
        ranks nothing.
        Between pulls the ranking cannot change: utilities that did not change cannot change
        the selection. Utilities on the CPU, or ``values``, are ranked by numpy
        (:meth:`_rank_host`, the same result), which a CPU runs faster than the op."""
        summ = (self._chunk_ids < self._done[:, None]) & ~self._dropped          # [B, J]
        if values is None and self.scores.device.type != "cpu":
            dev = self.scores.device
            pin = dev.type == "cuda"
            if not self._summ_bufs:                     # the mask's way up, made once
                up = torch.empty(summ.shape, dtype=torch.bool, pin_memory=pin)
                self._summ_bufs = (up, torch.empty_like(up, device=dev))
            up, summ_dev = self._summ_bufs
            up.numpy()[...] = summ                      # free: the last pull synced
            summ_dev.copy_(up, non_blocking=True)
            keys, moved = self._rank(self.scores, self._tables()["far_select"], summ_dev)
            # the keys come back into fresh pinned memory: a commit adopts them as the
            # ranking keys, which later commits edit in place
            down = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in (keys, moved))
            down[0].copy_(keys, non_blocking=True)      # the committed rows: the stream
            down[1].copy_(moved, non_blocking=True)     # orders the ranking after them
            if pin:
                torch.cuda.current_stream(dev).synchronize()
            self._pulled = down[0].numpy(), down[1].numpy()
            self._host_stale = True
            return
        if values is None:
            vals = self.scores.numpy()
        else:
            shape = self._host_scores.shape
            vals = np.asarray(values, dtype=np.float32)
            if vals.shape != shape:
                raise ValueError(f"values: expected host utilities of shape {list(shape)} "
                                 f"([layers, B, J + 1]), got {list(vals.shape)}")
        self._host_scores[...] = vals
        self._host_stale = False
        self._pulled = self._rank_host(self._host_scores, self.pager.host_tables["far_select"],
                                       summ)

    def _rank(self, scores: Tensor, sel: Tensor, summ: Tensor) -> tuple[Tensor, Tensor]:
        """``keys [L, B, C]`` int64 and ``changed [L, B]``: per layer and slot the ranking keys
        of the row's top ``C`` summaries by ``scores [L, B, J + 1]`` (``summ [B, J]``: the
        summarized chunks), in the committed row's order (``sel``, far_select) where the row
        holds them already, and whether the row changes (``torch.ops.kvops.far_view_rank``)."""
        return torch.ops.kvops.far_view_rank(scores, summ,
                                             sel.view(self.layers, self.B, self.C))

    def _rank_host(self, scores: np.ndarray, sel: np.ndarray,
                   summ: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_rank` in numpy on host arrays. Only rows of slots with more than ``C``
        summaries can change (a row shows every summary of the others), so those alone are
        ranked, over the chunks they have summarized (``[0, max done)``), with a partition."""
        L, B, C = self.layers, self.B, self.C
        cur = sel.reshape(L, B, C).astype(np.int64)
        has = cur >= 0
        cur_key = np.empty((L, B, C), dtype=np.int64)
        changed = np.zeros((L, B), dtype=bool)
        if self._score_at is None:              # flat index of (layer, slot, chunk 0)
            self._score_at = (np.arange(L * B, dtype=np.int64) * (self.J + 1)).reshape(L, B, 1)
        # an empty entry (-1) reads its neighbour; its key is set to empty below
        cur_key[...] = rank_keys(scores.reshape(-1).take(self._score_at + cur), cur)
        np.copyto(cur_key, EMPTY_KEY, where=~has)
        many = np.flatnonzero(summ.sum(axis=1) > C)
        if not many.size:
            return cur_key, changed
        n = int(self._done[many].max())
        key = rank_keys(scores[:, many, :n], self._chunk_ids[:n])             # [L, m, n]
        np.copyto(key, EMPTY_KEY, where=~summ[many, :n])
        top = np.partition(key, n - C, axis=2)[..., n - C:]                   # [L, m, C]
        # these slots have more than C summaries, so their top C are real keys, above an
        # empty entry's: a row that is not full has an empty lowest key and changes too
        moved = cur_key[:, many].min(axis=2) < top.min(axis=2)
        layers, which = np.nonzero(moved)
        rows = many[which]
        cur_key[layers, rows] = top[layers, which]
        changed[layers, rows] = True
        return cur_key, changed

    @property
    def host_scores(self) -> np.ndarray:
        """The utilities ``[layers, B, J + 1]`` the last pull ranked (a host copy; copied
        from the device when read after a pull that ranked the device's)."""
        if self._host_stale:
            self._host_scores[...] = self.scores.cpu().numpy()
            self._host_stale = False
        return self._host_scores

    def summarized(self, slot: int) -> list[int]:
        """Chunk ids of ``slot`` whose summaries are stored (after the last commit's step)."""
        done = int(self._done[slot])
        if slot not in self._holes:             # nothing dropped: every chunk below done
            return list(range(done))
        return self._chunk_ids[:done][~self._dropped[slot, :done]].tolist()

    def leading_summarized(self, slot: int) -> int:
        """How many of ``slot``'s first chunks are all summarized: chunks ``[0, k)`` are,
        chunk ``k`` is not (after the last commit's step)."""
        done = int(self._done[slot])
        if slot not in self._holes:
            return done
        gone = np.flatnonzero(self._dropped[slot, :done])
        return int(gone[0]) if gone.size else done

    def leading_summarized_all(self) -> np.ndarray:
        """:meth:`leading_summarized` of every slot, ``[B]`` int64 (one copy and a lookup per
        slot with a dropped chunk). It changes only with ``lead_epoch``, which counts the
        adopted commits that summarized, dropped or reset chunks."""
        lead = self._done.astype(np.int64)
        for slot in self._holes:
            lead[slot] = self.leading_summarized(slot)
        return lead

    def selection(self, layer: int, slot: int) -> list[int]:
        """Committed far slots of ``slot`` at ``layer`` (chunk ids, -1 empty), in slot order
        (the order of ``view``'s far slots; the chunks in a row are in no particular order)."""
        return self.pager.host_tables["far_select"][layer * self.B + slot].tolist()

    # -- device side (fixed shapes, no host sync) ---------------------------------------------
    def _tables(self) -> dict[str, Tensor]:
        return self.pager.device_tables

    def absorb(self, layer: int, k_cache: Tensor, v_cache: Tensor) -> None:
        """Summarize the chunks this commit made far (``far_leave_*``) into ``layer``'s store."""
        self._absorb(slice(layer, layer + 1), k_cache[None], v_cache[None])

    def absorb_layers(self, k_pools: Tensor, v_pools: Tensor) -> None:
        """:meth:`absorb` for every layer at once from pools stacked ``[layers, P, S, Hkv,
        D]`` (one allocation, as an engine keeps them): one ``far_view_summarize`` over the
        layers' pages and one of each store and utility update, instead of about ten launches
        a layer."""
        if k_pools.dim() != 5 or k_pools.shape[0] != self.layers or v_pools.shape != k_pools.shape:
            raise ValueError(f"k_pools, v_pools: expected [layers={self.layers}, P, S, Hkv, D] "
                             f"each, got {list(k_pools.shape)} and {list(v_pools.shape)}")
        for name, pools in (("k_pools", k_pools), ("v_pools", v_pools)):
            if pools.stride(0) != pools.shape[1] * pools.stride(1):
                raise ValueError(f"{name}: expected the layers' pools back to back (stride(0) "
                                 f"== P * stride(1), so that they view as one pool of "
                                 f"layers * P pages), got strides {pools.stride()}")
        self._absorb(slice(None), k_pools, v_pools)

    def _absorb(self, layers: slice, k_pools: Tensor, v_pools: Tensor) -> None:
        """The absorb of the store layers ``layers`` from pools ``[n, P, S, Hkv, D]`` (pool
        ``i`` for the ``i``-th layer of the slice): the layers' pages as rows of one
        ``[n * P, S, Hkv, D]`` view."""
        t = self._tables()
        B, m, J = self.B, self.max_leave, self.J
        n, P = k_pools.shape[:2]
        pages = t["far_leave_pages"].view(1, B, m, self.M)
        if n > 1:                           # layer i's pages at rows i * P.. of the flat view
            step = torch.arange(n, device=pages.device, dtype=pages.dtype).view(n, 1, 1, 1) * P
            pages = torch.where(pages >= 0, pages + step, pages)
        k_new, v_new = torch.ops.kvops.far_view_summarize(
            k_pools.flatten(0, 1), v_pools.flatten(0, 1), pages.reshape(n * B, m, self.M))
        ids = t["far_leave_ids"].view(1, B, m).long().expand(n, B, m)
        at = ids[..., None, None].expand(n, B, m, *k_new.shape[-2:])
        self.k_store[layers].scatter_(2, at, k_new.view(at.shape))
        self.v_store[layers].scatter_(2, at, v_new.view(at.shape))
        # a new summary starts at the best utility among the session's other selected chunks
        scores = self.scores[layers]
        scores.scatter_(2, ids, torch.zeros_like(ids, dtype=torch.float32))
        sel = t["far_select"].view(self.layers, B, self.C)[layers].long()
        live = scores.gather(2, sel.clamp(min=0))
        start = torch.where(sel >= 0, live, 0.0).amax(dim=2, keepdim=True)      # [n, B, 1]
        scores.scatter_(2, ids, start.expand(n, B, m))
        scores[:, :, J] = 0.0

    def prepare(self, rows: int | None = None) -> tuple[Tensor, Tensor]:
        """Every layer's gather rows and far bias for the slots ``[0, R)``, from the committed
        selection in one pass: ``(flat int32 [L, R * C], far_bias float32 [L, R, C])``, what
        :meth:`view` takes as ``prepared`` (a decode step computes them once for all its
        layers instead of once a layer)."""
        R = self._rows(rows)
        flat, bias = self._gather_rows(
            self._tables()["far_select"].view(self.layers, self.B, self.C)[:, :R])
        return flat.view(self.layers, -1), bias

    def _gather_rows(self, sel: Tensor) -> tuple[Tensor, Tensor]:
        """Selection entries ``[..., R, C]`` -> rows of a layer's store viewed ``[B * (J + 1),
        Hkv, D]`` (an empty slot reads the sink) and the far bias."""
        has = sel >= 0
        flat = torch.where(has, sel, self.J) + self._store_row[:sel.shape[-2]]
        live = math.log(self.count) if self.log_count_bias else 0.0
        return flat, torch.where(has, live, float("-inf")).to(torch.float32)

    def views(self, rows: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`view` for every layer at once: ``far_k, far_v [layers, R, C, Hkv, D]`` and
        ``far_bias [layers, R, C]``, one gather a store instead of two a layer (a decode step
        takes them before its layers and hands layer ``l`` its ``[l]``). They hold every layer's
        far slots at once: ``2 * layers * R * C * Hkv * D`` elements, where :meth:`view` holds
        one layer's."""
        R = self._rows(rows)
        flat, bias = self.prepare(R)
        rows_per_layer = self.B * (self.J + 1)
        flat = flat + torch.arange(self.layers, device=flat.device,
                                   dtype=flat.dtype)[:, None] * rows_per_layer
        shape = (self.layers, R, self.C, *self.k_store.shape[-2:])
        far_k = self.k_store.flatten(0, 2).index_select(0, flat.view(-1)).view(shape)
        far_v = self.v_store.flatten(0, 2).index_select(0, flat.view(-1)).view(shape)
        return far_k, far_v, bias

    def view(self, layer: int, rows: int | None = None,
             prepared: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``far_k, far_v [R, C, Hkv, D]`` and ``far_bias float32 [R, C]`` for ``layer``, for
        the slots ``[0, R)`` (``rows``; all ``B`` when None: a decode batch bucket takes the
        first ``R`` slots). ``prepared``: :meth:`prepare`'s result for the same rows (else this
        layer's rows are computed here)."""
        R = self._rows(rows)
        if prepared is not None:
            flat, bias = prepared[0][layer], prepared[1][layer]
        else:
            flat, bias = self._gather_rows(
                self._tables()["far_select"].view(self.layers, self.B, self.C)[layer, :R])
            flat = flat.view(-1)
        shape = (R, self.C, *self.k_store.shape[-2:])
        far_k = self.k_store[layer].flatten(0, 1).index_select(0, flat).view(shape)
        far_v = self.v_store[layer].flatten(0, 1).index_select(0, flat).view(shape)
        return far_k, far_v, bias

    def _rows(self, rows: int | None) -> int:
        if rows is None:
            return self.B
        if not 1 <= rows <= self.B:
            raise ValueError(f"rows: expected 1..{self.B} (the pager's session slots), got {rows}")
        return rows

    def observe(self, layer: int, q: Tensor, far_k: Tensor, far_bias: Tensor, lse: Tensor,
                scale: float | None = None, live: Tensor | None = None) -> Tensor:
        """Update ``layer``'s utilities from one attention call; returns ``mass [R, C]``.

        q [R, Hq, D] (the query the kernel saw, slots ``[0, R)``); far_k [R, C, Hkv, D] and
        far_bias [R, C] (what :meth:`view` gave it); lse float32 [R, Hq] (the kernel's); live
        bool [R] (optional): rows whose query is real (a decode batch's rows that decode
        nothing must not move their slot's utilities). Rows with ``lse = -inf`` (nothing
        visible) add no mass.
        """
        self._rows(q.shape[0])
        sel = self._tables()["far_select"].view(self.layers, self.B, self.C)[layer, :q.shape[0]]
        mass = torch.ops.kvops.far_view_observe(q, far_k, far_bias, lse, sel, self.scores[layer],
                                                live, self.ema, scale)
        return mass
