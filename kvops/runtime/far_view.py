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
    The far view is a pager hook (:meth:`kvops.runtime.Pager.attach`): its tables
    ``far_select [layers * B, C]`` (chunk ids, ``-1`` empty), ``far_leave_pages [B * max_leave,
    M]`` and ``far_leave_ids [B * max_leave]`` are edited inside the step's frame and go up
    with the pager's single upload, so the kernel shapes and the one-commit-per-step rule hold.
    Selection rows are edited only where they change. Host state follows a commit only once the
    pager's epoch shows that commit happened, so an aborted frame leaves the far view as it was.

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
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from kvops.runtime.pager import Frame, Pager, SessionDelta


@dataclass
class _Slot:
    """Host state of one session slot."""

    seen: int = 0                        # chunks [0, seen) have become far
    pending: list[tuple[int, list[int]]] = field(default_factory=list)  # (chunk, its pages)
    summarized: list[int] = field(default_factory=list)


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
        self._slots = [_Slot() for _ in range(self.B)]
        self._leave_rows: list[int] = []     # far_leave rows the last settled commit filled
        self._staged: tuple[int, dict, list[int]] | None = None
        self.last: dict = {}
        pager.attach(self)

    # -- pager hook ---------------------------------------------------------------------------
    def tables(self) -> dict:
        B, C, M, n = self.B, self.C, self.M, self.B * self.max_leave
        return {"far_select": ((self.layers * B, C), -1),
                "far_leave_pages": ((n, M), -1),
                "far_leave_ids": ((n,), self.J)}

    def _settle(self) -> None:
        """Adopt the state staged by the last on_commit once its commit is visible."""
        if self._staged is not None and self.pager.epoch >= self._staged[0]:
            _, slots, rows = self._staged
            for b, st in slots.items():
                self._slots[b] = st
            self._leave_rows = rows
        self._staged = None

    def _far_chunks(self, d: SessionDelta) -> int:
        nb = -(-d.after_length // self.pager.page_size)
        return max(0, nb - self.window_pages) // self.M

    def on_commit(self, frame: Frame, deltas: list[SessionDelta], grown=None) -> dict:
        """Pager hook: new far chunks, this commit's summaries, and the selection, as edits.

        ``grown`` (the pager's tail-only growth batch) needs nothing here: growth inside a
        session's last page adds no block, so no chunk becomes far.
        """
        self._settle()
        M, J, C, B, L = self.M, self.J, self.C, self.B, self.layers
        slots: dict[int, _Slot] = {}
        for d in deltas:
            if d.closed or d.new:
                slots[d.slot] = _Slot()
            if d.closed:
                continue
            old = slots.get(d.slot) or self._slots[d.slot]
            st = _Slot(old.seen, list(old.pending), list(old.summarized))
            far = min(self._far_chunks(d), J)
            for j in range(st.seen, far):
                pages = [d.page_after(i) for i in range(j * M, (j + 1) * M)]
                if min(pages) >= 0:
                    st.pending.append((j, pages))
            st.seen = max(st.seen, far)
            slots[d.slot] = st
        for b, st in enumerate(self._slots):          # untouched sessions still drain their queue
            if b not in slots and st.pending:
                slots[b] = _Slot(st.seen, list(st.pending), list(st.summarized))
        # this commit's summaries
        rows, fresh = [], {}
        for b, st in slots.items():
            take, st.pending = st.pending[: self.max_leave], st.pending[self.max_leave:]
            for i, (j, pages) in enumerate(take):
                r = b * self.max_leave + i
                frame.edit("far_leave_pages", r, pages)
                frame.edit("far_leave_ids", r, [j])
                rows.append(r)
            fresh[b] = [j for j, _ in take]
            st.summarized = st.summarized + fresh[b]
        for r in set(self._leave_rows) - set(rows):   # last commit's rows: nothing to summarize
            frame.edit("far_leave_pages", r, [-1] * M)
            frame.edit("far_leave_ids", r, [J])
        # selection, edited only where it changes. A session with at most C summaries shows
        # all of them, so its rows change only when its summaries do (new ones, or the slot
        # reset); above C, utilities order them: those sessions are ranked together, all layers
        # at once (padded to the longest list), so a commit costs a fixed number of array ops
        committed = self.pager.host_tables["far_select"].reshape(L, B, C)
        reset = {d.slot for d in deltas if d.new or d.closed}
        few, many = [], []
        for b in range(B):
            st = slots.get(b) or self._slots[b]
            if len(st.summarized) > C:
                many.append((b, st.summarized))
            elif fresh.get(b) or b in reset:
                few.append((b, st.summarized))
        cols = [b for b, _ in few] + [b for b, _ in many]
        want = np.full((L, len(cols), C), -1, dtype=np.int32)
        for i, (_, ids) in enumerate(few):                 # every summary fits: all layers alike
            want[:, i, : len(ids)] = np.sort(ids)
        if many:
            # each session's chunks newest first, so a stable sort by utility breaks ties
            # toward the newer chunk; padding (-1) ranks last, this commit's summaries first
            n = max(len(ids) for _, ids in many)
            bs = np.array([b for b, _ in many])
            ids = np.full((len(many), n), -1, dtype=np.int64)
            new = np.zeros((len(many), n), dtype=bool)
            for i, (b, got) in enumerate(many):
                ids[i, : len(got)] = got[::-1]
                if fresh.get(b):
                    new[i, : len(got)] = np.isin(got[::-1], fresh[b])
            util = self.host_scores[:, bs[:, None], np.maximum(ids, 0)]      # [L, m, n]
            util[:, ids < 0] = -np.inf
            util[:, new] = np.inf
            order = np.argsort(-util, axis=-1, kind="stable")[..., :C]
            top = np.take_along_axis(np.broadcast_to(ids, util.shape), order, axis=-1)
            want[:, len(few):] = np.sort(top, axis=-1)
        changed = 0
        if cols:
            layers, which = np.nonzero((committed[:, cols] != want).any(axis=-1))
            if layers.size:                                # one write for every changed row
                frame._put("far_select", layers * B + np.asarray(cols)[which],
                           want[layers, which])
            changed = layers.size
        self._staged = (frame.epoch, slots, rows)
        self.last = {"summaries": len(rows), "select_rows_changed": changed,
                     "pending": sum(len(st.pending) for st in slots.values())}
        return {"far_view": self.last}

    # -- host reads ---------------------------------------------------------------------------
    def pull_scores(self) -> None:
        """Copy the device utilities to the host (ranked at the next commit); syncs the device."""
        self.host_scores[...] = self.scores.cpu().numpy()

    def summarized(self, slot: int) -> list[int]:
        """Chunk ids of ``slot`` whose summaries are stored (after the last commit's step)."""
        self._settle()
        return list(self._slots[slot].summarized)

    def selection(self, layer: int, slot: int) -> list[int]:
        """Committed far slots of ``slot`` at ``layer`` (chunk ids, -1 empty)."""
        return self.pager.host_tables["far_select"][layer * self.B + slot].tolist()

    # -- device side (fixed shapes, no host sync) ---------------------------------------------
    def _tables(self) -> dict[str, Tensor]:
        tables = self.pager.device_tables
        if not tables:
            raise RuntimeError("FarView: the pager has no device tables (give it a device)")
        return tables

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

    def view(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """``far_k, far_v [B, C, Hkv, D]`` and ``far_bias float32 [B, C]`` for ``layer``."""
        t = self._tables()
        sel = t["far_select"].view(self.layers, self.B, self.C)[layer].long()
        idx = torch.where(sel >= 0, sel, self.J)
        at = idx[..., None, None].expand(-1, -1, *self.k_store.shape[-2:])
        far_k = self.k_store[layer].gather(1, at)
        far_v = self.v_store[layer].gather(1, at)
        live = math.log(self.count) if self.log_count_bias else 0.0
        far_bias = torch.where(sel >= 0, live, float("-inf")).to(torch.float32)
        return far_k, far_v, far_bias

    def observe(self, layer: int, q: Tensor, far_k: Tensor, far_bias: Tensor, lse: Tensor,
                scale: float | None = None) -> Tensor:
        """Update ``layer``'s utilities from one attention call; returns ``mass [B, C]``.

        q [B, Hq, D] (the query the kernel saw); far_k [B, C, Hkv, D] and far_bias [B, C] (what
        :meth:`view` gave it); lse float32 [B, Hq] (the kernel's). Rows with ``lse = -inf``
        (nothing visible) add no mass.
        """
        B, Hq, D = q.shape
        Hkv = far_k.shape[2]
        scale = D ** -0.5 if scale is None else scale
        qf = q.float().view(B, Hkv, Hq // Hkv, D)
        logits = torch.einsum("bhgd,bchd->bhgc", qf, far_k.float()) * scale
        norm = lse.view(B, Hkv, Hq // Hkv, 1)
        # lse = -inf only when every far bias is -inf too: those logits stay -inf, mass 0
        norm = torch.where(norm > float("-inf"), norm, 0.0)
        mass = torch.exp(logits + far_bias[:, None, None, :] - norm).sum(dim=(1, 2))   # [B, C]
        sel = self._tables()["far_select"].view(self.layers, self.B, self.C)[layer].long()
        idx = torch.where(sel >= 0, sel, self.J)
        old = self.scores[layer].gather(1, idx)
        new = torch.where(sel >= 0, self.ema * old + (1.0 - self.ema) * mass, 0.0)
        self.scores[layer].scatter_(1, idx, new)
        return mass
