"""Retrieval far view: exact far pages chosen per step by the query (Quest-style bounds).

A second far-view policy beside :class:`kvops.runtime.FarView` with the same fixed-shape
interface to the decode kernel: ``static_sliding_attention(q, k, v, win_start, win_len, far_k,
far_v, far_bias)``, here with ``far_k, far_v [B, K * S, Hkv, D]`` holding the exact tokens of
``K`` far pages (``far_bias`` 0 for them, ``-inf`` for an empty slot), so the kernel sees a
fixed ``W + K * S`` width.

Far pages
    A session's far pages are its logical blocks before the near window (the transport's last
    ``W / S`` blocks): ``nf = max(0, ceil(len / S) - W / S)``. Every far block is full and
    immutable, so its key summary never changes. The pages stay in the pool: retrieval reads
    them exact (the caller must not trim far blocks it wants retrievable; a trimmed block is
    never gathered).

Summaries, once per page, on the device
    :meth:`begin_step` (once per step, after the frame's commit) reads the device
    ``block_table`` and ``seq_lens`` and picks, per session, the next ``max_leave`` far blocks
    not summarized yet (a device counter ``done [B]``); :meth:`absorb` (per layer) runs
    ``far_page_summarize_into`` on them: one launch stores the per-channel key min and max into
    the layer's summary table ``[B, L + 1, Hkv, D]`` at the blocks' rows (row ``L`` a sink).
    A prefill that makes many blocks far at once drains ``max_leave`` per step, or all of them
    in one step with ``begin_step(drain=True)`` (an eager step: the shapes follow the table's
    width), which an engine calls after a prompt's prefill so that its first decode step can
    choose among every far page. The summary tables cost ``2 / S`` of the K pool of a
    full-length session.

Selection, on the device, no host sync
    :meth:`select` (per layer, with the layer's query) runs ``far_page_select`` over blocks
    ``[0, done)``: with each query head's bound ``sum_c max(q_c kmin_c, q_c kmax_c)`` of a
    page, ``ceil(K / 2)`` pages are those of highest bound for any one head and the rest those
    of highest bound summed over the heads (one page list per session), and their
    tokens are brought exact into the layer's persistent ``far_k, far_v`` buffers by one
    ``far_slot_update`` launch: a page chosen the time before keeps its slot, only the newly
    chosen pages are copied (the copy costs the pages that changed), and a block trimmed
    since its summary is never gathered (its slot gets bias ``-inf``). :meth:`view` returns
    the buffers. Selection may run every step or every ``N`` steps (the host decides which step
    graph to replay; the buffers keep the last selection, which stays valid because far pages
    do not change); the page that leaves the window between two selections is in neither
    until the next one. Only selection reads the bounds, so the steps between selections
    summarize nothing either (``begin_step(summarize=False)``, no :meth:`absorb`): such a
    step costs the attention alone, and the selecting step summarizes the pages that left
    meanwhile.

Host side
    Nothing but one table, ``far_ret_gen [B]``: the commit that opens or closes a session in a
    slot bumps the slot's entry, and :meth:`begin_step` resets that slot's counter and far
    buffers on the device when it sees a new value. The hook's only host work per commit is a
    pass over the commit's general deltas.

A decode step, after the frame's commit::

    ret.begin_step(summarize=selecting)    # selecting: every step, or every N steps
    for l, layer in enumerate(layers):
        if selecting:                      # the bounds are read only here: absorb with it
            ret.absorb(l, k_cache[l])
            ret.select(l, q, k_cache[l], v_cache[l])
        far_k, far_v, far_bias = ret.view(l)
        out, lse = torch.ops.kvops.static_sliding_attention(q, k_win, v_win, win_start,
                                                            win_len, far_k, far_v, far_bias)

Every device method is fixed-shape, in place on persistent buffers, and host-sync free, so the
step compiles once and replays in one CUDA graph (one graph with selection, one without).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvops.runtime.pager import Frame, Pager, SessionDelta

_GEN_WRAP = 2**30


class FarRetrieval:
    """Retrieval far-view policy for one pager; attach before the pager's first frame.

    Parameters
    ----------
    pager : Pager
        Maps sessions to pages of the pools ``[P, S, Hkv, D]`` (one pair per layer); needs a
        device (the policy reads the device tables).
    window_tokens : int
        ``W``, the near window in tokens (a multiple of ``S``; the transport's window).
    top_k : int
        ``K``, far pages per session and layer the kernel sees (``K * S`` far tokens).
    num_layers, num_kv_heads, head_dim : int
        Model geometry; one summary table and one far buffer per layer.
    dtype, device
        Of the KV pools (summaries and far buffers are kept in the pool dtype).
    max_leave : int
        Far pages per session summarized per step (a prefill drains at this rate, or at once
        in a step whose ``begin_step`` drains).
    """

    def __init__(self, pager: Pager, *, window_tokens: int, top_k: int, num_layers: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float16,
                 device: torch.device | str | None = None, max_leave: int = 4):
        S = pager.page_size
        if window_tokens < S or window_tokens % S:
            raise ValueError(f"window_tokens: expected a positive multiple of the page size "
                             f"S={S}, got {window_tokens}")
        L = pager.max_blocks
        if not 1 <= top_k <= L:
            raise ValueError(f"top_k: expected a page count in [1, L={L}], got {top_k}")
        if max_leave < 1 or num_layers < 1:
            raise ValueError(f"max_leave and num_layers must be >= 1, got {max_leave}, "
                             f"{num_layers}")
        dev = torch.device(device) if device is not None else pager.device
        if dev is None:
            raise ValueError("FarRetrieval: the pager has no device and none was given")
        self.pager, self.S, self.L, self.B = pager, S, L, pager.max_sessions
        self.window_pages, self.K, self.layers, self.max_leave = window_tokens // S, top_k, \
            num_layers, max_leave
        # the candidates: a session's far blocks are at most L minus the window's blocks
        self.far_width = max(L - self.window_pages, top_k)
        B, K = self.B, top_k
        bounds = (num_layers, B, L + 1, num_kv_heads, head_dim)
        self.k_min = torch.zeros(bounds, dtype=dtype, device=dev)
        self.k_max = torch.zeros(bounds, dtype=dtype, device=dev)
        far = (num_layers, B, K * S, num_kv_heads, head_dim)
        self.far_k = torch.zeros(far, dtype=dtype, device=dev)
        self.far_v = torch.zeros(far, dtype=dtype, device=dev)
        self.far_bias = torch.full((num_layers, B, K * S), float("-inf"), device=dev)
        self.index = torch.full((num_layers, B, K), -1, dtype=torch.int32, device=dev)
        self.done = torch.zeros(B, dtype=torch.int32, device=dev)
        self.gen = torch.zeros(B, dtype=torch.int32, device=dev)
        self.leave_pages = torch.full((B, max_leave), -1, dtype=torch.int32, device=dev)
        self.leave_ids = torch.full((B, max_leave), L, dtype=torch.int64, device=dev)
        self._offsets = torch.arange(max_leave, dtype=torch.int32, device=dev)
        self._leave = (self.leave_pages, self.leave_ids)      # what absorb summarizes
        pager.attach(self)

    # -- pager hook ---------------------------------------------------------------------------
    def tables(self) -> dict:
        return {"far_ret_gen": ((self.B,), 0)}

    def on_commit(self, frame: Frame, deltas: list[SessionDelta], grown=None) -> dict:
        """Pager hook: bump the generation of every slot a session opens or closes in."""
        gen = self.pager.host_tables["far_ret_gen"]
        slots = sorted({d.slot for d in deltas if d.new or d.closed})
        if slots:
            frame.scatter("far_ret_gen", slots, [(int(gen[s]) + 1) % _GEN_WRAP for s in slots])
        return {"far_retrieval": {"reset_slots": len(slots)}}

    # -- device side (fixed shapes, in place, no host sync) -----------------------------------
    def _tables(self) -> dict[str, Tensor]:
        tables = self.pager.device_tables
        if not tables:
            raise RuntimeError("FarRetrieval: the pager has no device tables (give it a device)")
        return tables

    def far_pages(self) -> Tensor:
        """int32 [B]: far blocks per session at the committed lengths (before the window)."""
        lens = self._tables()["seq_lens"]
        blocks = (lens + self.S - 1) // self.S
        return (blocks - self.window_pages).clamp(min=0).to(torch.int32)

    def begin_step(self, drain: bool = False, summarize: bool = True) -> None:
        """Once per step after the commit: reset reopened slots, pick the pages to summarize:
        per session the next ``max_leave`` far blocks not summarized yet, or with ``drain``
        every one of them (``far_width`` entries a session, in buffers made for the step: a
        step that drains is not captured). With ``summarize=False`` (a step that does not
        select: only :meth:`select` reads the bounds) it only resets, picks nothing and the
        step's :meth:`absorb` calls can be left out (one made anyway summarizes nothing). A
        caller that summarizes only when it selects, every ``N`` steps, needs ``max_leave``
        at least ``ceil(N / S) + 1`` (the pages that leave the window meanwhile), or the
        unsummarized backlog grows."""
        t = self._tables()
        gen = t["far_ret_gen"]
        reset = gen != self.gen
        self.gen.copy_(gen)
        self.done.copy_(torch.where(reset, 0, self.done))
        self.far_bias.copy_(torch.where(reset[None, :, None], float("-inf"), self.far_bias))
        self.index.copy_(torch.where(reset[None, :, None], -1, self.index))
        if not summarize:
            self.leave_pages.fill_(-1)
            self.leave_ids.fill_(self.L)
            self._leave = (self.leave_pages, self.leave_ids)
            return
        offsets = self._offsets if not drain else torch.arange(
            self.far_width, dtype=torch.int32, device=self.done.device)
        j = self.done[:, None] + offsets[None, :]                                # [B, n]
        take = j < self.far_pages()[:, None]
        page = t["block_table"].gather(1, j.clamp(max=self.L - 1).long())
        page, ids = torch.where(take, page, -1), torch.where(take, j, self.L).long()
        if drain:
            self._leave = (page, ids)
        else:
            self.leave_pages.copy_(page)
            self.leave_ids.copy_(ids)
            self._leave = (self.leave_pages, self.leave_ids)
        self.done.add_(take.sum(dim=1, dtype=torch.int32))

    def absorb(self, layer: int, k_cache: Tensor) -> None:
        """Key bounds of the pages :meth:`begin_step` picked, into ``layer``'s summary table."""
        torch.ops.kvops.far_page_summarize_into(k_cache, *self._leave, self.k_min[layer],
                                                self.k_max[layer])

    def select(self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Pick ``layer``'s top-K far pages for ``q [R, Hq, D]`` (the first ``R <= B`` slots'
        queries: a batch bucket) and bring them exact into those slots' far buffers:
        ``far_page_select`` scores and ranks, then one ``far_slot_update`` launch keeps every
        slot whose page is chosen again (not copied), puts the new pages in the freed slots
        (copying only them), and writes the index and the bias. ``k_cache, v_cache [P, S, Hkv,
        D]``: contiguous pages, any page stride (one layer of a ``[P, layers, S, Hkv, D]`` pool
        works). Returns the logical block of each slot, int32 [R, K] (-1 empty)."""
        R = q.shape[0]
        if not 1 <= R <= self.B:
            raise ValueError(f"q: expected the queries of the first 1..{self.B} slots, got "
                             f"{R} rows")
        lo, hi = self.bounds(layer)
        new, _ = torch.ops.kvops.far_page_select(q, lo[:R], hi[:R], self.done[:R], self.K)
        index = self.index[layer, :R]
        torch.ops.kvops.far_slot_update(new, self._tables()["block_table"][:R], k_cache,
                                        v_cache, index, *self.view(layer, R))
        return index

    def bounds(self, layer: int) -> tuple[Tensor, Tensor]:
        """``layer``'s key bounds ``k_min, k_max [B, far_width, Hkv, D]`` as :meth:`select`
        scores them: the first ``max(L - W / S, K)`` entries of the summary table, every block
        a session can have before its window (a row narrower than ``L`` keeps the choice's
        one-block row in a smaller power of two: 2017 entries at 32k against 2049)."""
        return self.k_min[layer, :, :self.far_width], self.k_max[layer, :, :self.far_width]

    def view(self, layer: int, rows: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``far_k, far_v [R, K * S, Hkv, D]`` and ``far_bias float32 [R, K * S]`` of ``layer``
        (the last selection's pages) for the first ``rows`` slots (``R``; all ``B`` by
        default)."""
        R = self.B if rows is None else rows
        return self.far_k[layer, :R], self.far_v[layer, :R], self.far_bias[layer, :R]
