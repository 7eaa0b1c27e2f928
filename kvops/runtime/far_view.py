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
    among the session's selected chunks (optimistic, so it gets tried). At every commit the
    host picks, per layer and session, the ``C`` summarized chunks of highest utility (ties: the
    newer chunk); a chunk summarized in this very commit is always picked (it has no utility
    yet). The utilities the host ranks are the ones :meth:`FarView.pull_scores` last copied from
    the device (one step old when called after each step).

Commits
    The far view is a pager policy (:mod:`kvops.runtime.policy`): its tables
    ``far_select [layers * B, C]`` (chunk ids, ``-1`` empty), ``far_leave_pages [B * max_leave,
    M]`` and ``far_leave_ids [B * max_leave]`` are written inside the step's frame and go up
    with the pager's single upload, so the kernel shapes and the one-commit-per-step rule hold.
    Selection rows are written only where they change. A queued chunk keeps only its id; its
    pages are read from the frame's view when its summary is due, and a chunk whose blocks were
    trimmed meanwhile is dropped. The plan returns the next host state (immutable per-slot
    records); the pager adopts it once the commit is complete, so an aborted frame leaves the
    far view as it was.

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
host-sync free (compiles once, replays in a CUDA graph).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvops.runtime.frame import Frame, GrownBatch, SessionDelta
from kvops.runtime.pager import Pager
from kvops.runtime.policy import Staged


@dataclass(frozen=True, slots=True)
class _Slot:
    """Host state of one session slot (replaced, never mutated, so a staged commit can hold
    it): chunks ``[0, seen)`` have become far; ``pending`` chunk ids wait for a summary, in
    order; ``summarized`` are stored."""

    key: object = None
    seen: int = 0
    pending: tuple[int, ...] = ()
    summarized: tuple[int, ...] = ()


_EMPTY_SLOT = _Slot()


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
        self.host_scores = np.zeros((num_layers, self.B, self.J + 1), dtype=np.float32)
        self._slots = [_EMPTY_SLOT] * self.B
        # the length at which each slot's next chunk becomes far (a chunk of M blocks is far
        # once W/S more blocks follow it: length > ((seen + 1) * M + W/S - 1) * S)
        self._next_len = np.full(self.B, self._first_far(0), dtype=np.int64)
        self._queued: frozenset[int] = frozenset()           # slots with pending chunks
        self._many: frozenset[int] = frozenset()              # slots with more than C summaries
        self._leave_rows: tuple[int, ...] = ()    # far_leave rows the last commit filled
        self._scores_new = False                  # pull_scores ran since the last commit
        # far chunks of a session of n tokens (a lookup by length, as the transport's)
        n = np.arange(pager.max_blocks * S + 1, dtype=np.int64)
        self._far_at = np.clip((-(-n // S) - self.window_pages) // self.M, 0, self.J)
        self.last: dict = {}
        pager.attach(self)

    # -- pager policy -------------------------------------------------------------------------
    kind = "far_view"

    def tables(self) -> dict:
        B, C, M, n = self.B, self.C, self.M, self.B * self.max_leave
        return {"far_select": ((self.layers * B, C), -1),
                "far_leave_pages": ((n, M), -1),
                "far_leave_ids": ((n,), self.J)}

    def _first_far(self, seen: int) -> int:
        """Tokens at which chunk ``seen`` becomes far (past the table's length once all ``J``
        chunks are far)."""
        if seen >= self.J:
            return 1 << 62
        return ((seen + 1) * self.M + self.window_pages - 1) * self.pager.page_size + 1

    def plan(self, frame: Frame, deltas: list[SessionDelta], grown: GrownBatch) -> Staged:
        """Policy plan: new far chunks, this commit's summaries and the selection, as table
        writes; the host state to adopt. Python work is per session with general edits, per
        session whose far history grows and per summary; the growth batch is three array ops.
        """
        M, J, C, B, L = self.M, self.J, self.C, self.B, self.layers
        slots: dict[int, _Slot] = {}           # touched slots' next state
        views: dict[int, SessionDelta] = {}
        for d in deltas:                       # EOS first: a reused slot starts empty
            if d.closed:
                slots[d.slot] = _EMPTY_SLOT
                continue
            views[d.slot] = d
            old = _Slot(d.key) if d.new else slots.get(d.slot, self._slots[d.slot])
            far = int(self._far_at[d.after_length])
            if far > old.seen:
                old = _Slot(d.key, far, old.pending + tuple(range(old.seen, far)),
                            old.summarized)
            slots[d.slot] = old
        if grown.slots.size:                   # growth-only sessions whose far history grew
            gs, after = grown.slots, grown.after
            for i in np.flatnonzero(after >= self._next_len[gs]).tolist():
                b = int(gs[i])
                old = self._slots[b]
                far = int(self._far_at[after[i]])
                slots[b] = _Slot(old.key, far, old.pending + tuple(range(old.seen, far)),
                                 old.summarized)
        for b in self._queued:                  # untouched sessions still drain their queue
            if b not in slots:
                slots[b] = self._slots[b]
        # this commit's summaries: each queued chunk's pages as the frame maps them now; a
        # chunk with a trimmed block is dropped, never summarized
        rows, pages, ids, fresh = [], [], [], {}
        for b, st in list(slots.items()):
            if not st.pending:
                continue
            d = views.get(b)
            take, left = [], list(st.pending)
            while left and len(take) < self.max_leave:
                j = left.pop(0)
                got = ([d.page_after(i) for i in range(j * M, (j + 1) * M)] if d is not None
                       else frame.block_pages(st.key, j * M, (j + 1) * M))
                if min(got) >= 0:
                    rows.append(b * self.max_leave + len(take))
                    pages.append(got)
                    ids.append(j)
                    take.append(j)
            fresh[b] = take
            slots[b] = _Slot(st.key, st.seen, tuple(left), st.summarized + tuple(take))
        if rows:
            at = np.array(rows, dtype=np.int64)
            frame.write("far_leave_pages", at, np.array(pages, dtype=np.int32))
            frame.write("far_leave_ids", at, np.array(ids, dtype=np.int32))
        stale = set(self._leave_rows).difference(rows)
        if stale:                               # last commit's rows: nothing to summarize
            at = np.array(sorted(stale), dtype=np.int64)
            frame.write("far_leave_pages", at, -1)
            frame.write("far_leave_ids", at, J)
        # selection, written only where it changes. A session with at most C summaries shows
        # them all, so its rows change only with its summaries (new ones, or the slot reset);
        # above C, utilities order them, and they are ranked again when the scores were pulled
        # since the last commit or their summaries changed: all such sessions together, all
        # layers at once (padded to the longest list)
        many = self._many
        few, rank = [], []
        for b, st in slots.items():
            changed = st.summarized != self._slots[b].summarized or st is _EMPTY_SLOT
            if len(st.summarized) > C:
                if b not in many:
                    many = many | {b}
                if changed:
                    rank.append(b)
            else:
                if b in many:
                    many = many - {b}
                if changed:
                    few.append(b)
        rank = sorted(many) if self._scores_new else sorted(rank)
        cols = few + rank
        changed = 0
        if cols:
            want = np.full((L, len(cols), C), -1, dtype=np.int32)
            for i, b in enumerate(few):                 # every summary fits: all layers alike
                got = slots[b].summarized
                want[:, i, : len(got)] = np.sort(got)
            if rank:
                # each session's chunks newest first, so a stable sort by utility breaks ties
                # toward the newer chunk; padding (-1) ranks last, this commit's summaries first
                lists = [slots.get(b, self._slots[b]).summarized[::-1] for b in rank]
                n = max(len(x) for x in lists)
                idm = np.full((len(rank), n), -1, dtype=np.int64)
                for i, x in enumerate(lists):
                    idm[i, : len(x)] = x
                util = self.host_scores[:, np.array(rank)[:, None], np.maximum(idm, 0)]
                util[:, idm < 0] = -np.inf
                if any(fresh.get(b) for b in rank):
                    new = np.zeros(idm.shape, dtype=bool)
                    for i, b in enumerate(rank):
                        if fresh.get(b):
                            got = set(fresh[b])
                            new[i] = [x in got for x in lists[i]] + [False] * (n - len(lists[i]))
                    util[:, new] = np.inf
                order = np.argsort(-util, axis=-1, kind="stable")[..., :C]
                top = idm[np.arange(len(rank))[:, None], order]       # [L, m, C]
                want[:, len(few):] = np.sort(top, axis=-1)
            committed = self.pager.host_tables["far_select"].reshape(L, B, C)
            layers, which = np.nonzero((committed[:, cols] != want).any(axis=-1))
            if layers.size:                                # one write for every changed row
                frame.write("far_select", layers * B + np.asarray(cols)[which],
                            want[layers, which])
            changed = int(layers.size)
        pending = sum(len(st.pending) for st in slots.values())
        last = {"summaries": len(rows), "select_rows_changed": changed, "pending": pending}
        return Staged((slots, tuple(rows), many, last), last)

    def adopt(self, state) -> None:
        slots, rows, many, last = state
        queued = self._queued
        for b, st in slots.items():
            self._slots[b] = st
            self._next_len[b] = self._first_far(st.seen)
            if st.pending:
                if b not in queued:
                    queued = queued | {b}
            elif b in queued:
                queued = queued - {b}
        self._queued, self._many = queued, many
        self._leave_rows, self.last = rows, last
        self._scores_new = False

    # -- host reads ---------------------------------------------------------------------------
    @property
    def summaries_due(self) -> bool:
        """Whether the last commit queued summaries for :meth:`absorb` (without any, every
        ``far_leave`` row is empty and an absorb changes nothing, so a caller outside a
        captured graph may skip it)."""
        return bool(self._leave_rows)

    def pull_scores(self, values=None) -> None:
        """Copy the device utilities to the host (ranked at the next commit); syncs the device.
        ``values``: host utilities ``[layers, B, J + 1]`` to rank instead (e.g. from a replay).
        The host ranks only at commits after a pull: utilities that did not change cannot
        change the selection."""
        self.host_scores[...] = self.scores.cpu().numpy() if values is None else values
        self._scores_new = True

    def summarized(self, slot: int) -> list[int]:
        """Chunk ids of ``slot`` whose summaries are stored (after the last commit's step)."""
        return list(self._slots[slot].summarized)

    def selection(self, layer: int, slot: int) -> list[int]:
        """Committed far slots of ``slot`` at ``layer`` (chunk ids, -1 empty)."""
        return self.pager.host_tables["far_select"][layer * self.B + slot].tolist()

    # -- device side (fixed shapes, no host sync) ---------------------------------------------
    def _tables(self) -> dict[str, Tensor]:
        return self.pager.device_tables

    def absorb(self, layer: int, k_cache: Tensor, v_cache: Tensor) -> None:
        """Summarize the chunks this commit made far (``far_leave_*``) into ``layer``'s store."""
        t = self._tables()
        B, n, J = self.B, self.max_leave, self.J
        pages = t["far_leave_pages"].view(B, n, self.M)
        ids = t["far_leave_ids"].view(B, n).long()
        k_new, v_new = torch.ops.kvops.far_view_summarize(k_cache, v_cache, pages)
        at = ids[..., None, None].expand_as(k_new)
        self.k_store[layer].scatter_(1, at, k_new)
        self.v_store[layer].scatter_(1, at, v_new)
        # a new summary starts at the best utility among the session's other selected chunks
        self.scores[layer].scatter_(1, ids, torch.zeros_like(ids, dtype=torch.float32))
        sel = t["far_select"].view(self.layers, B, self.C)[layer].long()
        live = self.scores[layer].gather(1, sel.clamp(min=0))
        start = torch.where(sel >= 0, live, 0.0).amax(dim=1, keepdim=True)   # [B, 1]
        self.scores[layer].scatter_(1, ids, start.expand(B, n))
        self.scores[layer, :, J] = 0.0

    def view(self, layer: int, rows: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``far_k, far_v [R, C, Hkv, D]`` and ``far_bias float32 [R, C]`` for ``layer``, for
        the slots ``[0, R)`` (``rows``; all ``B`` when None: a decode batch bucket takes the
        first ``R`` slots)."""
        R = self._rows(rows)
        t = self._tables()
        sel = t["far_select"].view(self.layers, self.B, self.C)[layer, :R].long()
        idx = torch.where(sel >= 0, sel, self.J)
        at = idx[..., None, None].expand(-1, -1, *self.k_store.shape[-2:])
        far_k = self.k_store[layer, :R].gather(1, at)
        far_v = self.v_store[layer, :R].gather(1, at)
        live = math.log(self.count) if self.log_count_bias else 0.0
        far_bias = torch.where(sel >= 0, live, float("-inf")).to(torch.float32)
        return far_k, far_v, far_bias

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
        B, Hq, D = q.shape
        self._rows(B)
        Hkv = far_k.shape[2]
        scale = D ** -0.5 if scale is None else scale
        qf = q.float().view(B, Hkv, Hq // Hkv, D)
        logits = torch.einsum("bhgd,bchd->bhgc", qf, far_k.float()) * scale
        norm = lse.view(B, Hkv, Hq // Hkv, 1)
        # lse = -inf only when every far bias is -inf too: those logits stay -inf, mass 0
        norm = torch.where(norm > float("-inf"), norm, 0.0)
        mass = torch.exp(logits + far_bias[:, None, None, :] - norm).sum(dim=(1, 2))   # [R, C]
        sel = self._tables()["far_select"].view(self.layers, self.B, self.C)[layer, :B].long()
        idx = torch.where(sel >= 0, sel, self.J)
        scores = self.scores[layer, :B]
        old = scores.gather(1, idx)
        new = torch.where(sel >= 0, self.ema * old + (1.0 - self.ema) * mass, 0.0)
        if live is not None:                 # the sink column J holds 0, so old is 0 there
            new = torch.where(live[:, None], new, old)
        scores.scatter_(1, idx, new)
        return mass
