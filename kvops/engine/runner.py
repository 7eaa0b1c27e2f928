"""The model runner: one engine step's forwards through kvops ops on the KV manager's tables.

A step runs, in order:

1. the transport's copy trains into the window arenas (``paged_gather_merged``, one call a
   layer, or one graph of them all once :meth:`ModelRunner.capture_transfers` has run) when
   the configuration has arenas and the step's commit queued trains;
2. the prefill chunks, packed: K/V written into the pool with ``paged_kv_write`` (and into the
   arena ring for tokens inside the window, write-through), attention with
   ``paged_prefill_attention`` over each request's block table, given the chunks' own K/V rows
   (contiguous, so their tiles load without the page indirection);
3. the far view's summaries of chunks this commit made far (``kvrm``; nothing when the commit
   queued none);
4. the decode tokens, one row per KV slot up to a batch bucket (1, 2, 4, 8, then multiples of
   8, and of 16 above 64; ``kvrm`` too: the far view's tables are per slot, and a bucket
   takes the first slots' far rows),
   with the configuration's decode attention: ``elastic_attention`` over block tables
   (``paged``, ``offload``, ``reserve``; ``elastic`` adds the BASE span table, so BASE blocks
   decode in place on the structured path, or with ``kv.general`` a block-mode table made
   from the spans on the device, the general path, for mixed batches: the
   ``elastic-general`` ablation), ``static_sliding_attention`` over the worst-case arena
   (``static``) or over the window arena (``pager``, ``pager+merge``, ``kvrm``, with the far
   slots; ``kvrm-ret``, with the far pages its queries choose, exact: a selecting step
   summarizes the pages that left the window and chooses every layer's pages, a step that does
   not select reuses them; a request's first decode step selects, after the bounds of every
   far page are taken at once, and then every ``select_every`` steps). On CUDA each bucket's
   decode step is captured once in a CUDA graph (``kvrm-ret``: one that selects and one that
   does not) and replayed; captures are counted.
5. ``kvrm``: every ``rerank_every`` steps, the far view's utilities to the host
   (``FarView.pull_scores``), so the next commit ranks the sessions' summaries again; between
   pulls a commit only places new summaries.

Rows of the decode batch that decode nothing this step (free slots, slots in prefill) have
position ``-1``: they write nothing and their logits are not read.
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import torch

from kvops._upload import upload
from kvops.engine.sampling import draws, next_tokens
from kvops.layouts import arena_as_pages
from kvops.models.paged import forward_packed, logits
from kvops.ops.elastic_attention import span_modes


def bucket_of(rows: int, max_rows: int) -> int:
    """The decode batch bucket for ``rows``: 1, 2, 4, 8, then multiples of 8 up to 64 and of
    16 beyond, at most ``max_rows``."""
    if rows <= 8:
        b = 1 << max(rows - 1, 0).bit_length()
    elif rows <= 64:
        b = -(-rows // 8) * 8
    else:
        b = -(-rows // 16) * 16
    return min(b, max_rows)


DECODE_KINDS = ("paged", "elastic", "static", "arena")


class Launched:
    """A step whose device work is queued. Each part's next tokens (``(requests, rows,
    tokens)``: the requests' rows of ``tokens``, or ``None`` for one a request in order) are
    copied into pinned host memory behind the step's work on CUDA, so :meth:`ready` asks
    without waiting, :meth:`collect` waits for this step only, and a captured graph's output
    may be overwritten by the next replay. ``start``: a timing event recorded before the
    step's first device work (CUDA), so that :meth:`events` time the step."""

    __slots__ = ("_parts", "_event", "_tokens", "_start")

    def __init__(self, device: torch.device, parts: list, start=None):
        self._tokens = self._event = None
        self._start = start
        if device.type == "cuda":
            kept = []
            for reqs, rows, toks in parts:
                host = torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True)
                host.copy_(toks, non_blocking=True)
                kept.append((reqs, rows, host))
            parts = kept
            self._event = torch.cuda.Event(enable_timing=start is not None)
            self._event.record()
        self._parts = parts

    def events(self) -> tuple:
        """``(start, end)``: timing events around the step's device work (CUDA; ``end`` after
        its tokens are copied back), or ``(None, None)`` on the CPU."""
        return (self._start, self._event) if self._start is not None else (None, None)

    def ready(self) -> bool:
        """Whether the step's device work is done (always, on the CPU)."""
        return self._event is None or self._event.query()

    def collect(self) -> dict:
        """``{request: next token}``; waits for this step's work (CUDA)."""
        if self._tokens is None:
            if self._event is not None:
                self._event.synchronize()
            out = {}
            for reqs, rows, toks in self._parts:
                vals = toks.tolist()
                out.update(zip(reqs, vals if rows is None else [vals[i] for i in rows]))
            self._tokens = out
        return self._tokens


class ModelRunner:
    """Runs steps of ``model`` on ``kv`` with decode attention ``decode`` (``paged``,
    ``elastic``, ``static`` or ``arena``); ``graphs`` captures decode buckets (CUDA only)."""

    def __init__(self, model, kv, decode: str, *, graphs: bool | None = None):
        if decode not in DECODE_KINDS:
            raise ValueError(f"decode: expected one of {', '.join(DECODE_KINDS)}, got {decode!r}")
        if decode == "elastic" and getattr(kv, "fidelity", None) is None:
            raise ValueError("decode: 'elastic' needs a KV manager with a Fidelity policy "
                             "(ElasticKV)")
        self.model, self.kv, self.decode = model, kv, decode
        self.device = kv.k_pool.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError("graphs: CUDA graphs need a CUDA device")
        self.S = kv.S
        self.rows = kv.max_sessions
        self.write_arena = kv.transport is not None
        if self.write_arena:
            S = self.S
            self.k_arena_pages = [arena_as_pages(kv.k_arena[i], S) for i in range(kv.layers)]
            self.v_arena_pages = [arena_as_pages(kv.v_arena[i], S) for i in range(kv.layers)]
        dev, B = self.device, self.rows
        self._tok = torch.zeros(B, dtype=torch.int64, device=dev)
        self._pos = torch.zeros(B, dtype=torch.int64, device=dev)
        self._rows = torch.arange(B, dtype=torch.int64, device=dev)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.retrieval = getattr(kv, "retrieval", None)
        self._selected_for: dict[int, str] = {}   # slot -> session whose pages it holds
        self._since_selection = 0
        self.selections = 0
        self._pool = None
        self._absorb_graph = self._gather_graph = None
        self.captures = 0
        self.steps = 0
        self.buckets_used: set[int] = set()
        self.paths: Counter = Counter()        # decode steps by attention path
        self.last_path = ""

    # -- slot arithmetic --------------------------------------------------------------------------
    def _slots(self, req, start: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Positions, pool slots and arena slots (``-1``: outside the window) of ``n`` tokens
        from ``start``."""
        S = self.S
        pos = np.arange(start, start + n)
        pages = np.asarray(self.kv.pages(req), dtype=np.int64)
        pool = pages[pos // S] * S + pos % S
        if not self.write_arena:
            return pos, pool, pool
        W = self.kv.window
        first_block = max(-(-(start + n) // S) - W // S, 0)
        arena = np.where(pos // S >= first_block, self.kv.slot(req) * W + pos % W, -1)
        return pos, pool, arena

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def launch(self, items: list) -> Launched:
        """Queue the step's device work for ``items`` ``(request, start, n)``; returns the
        :class:`Launched` step, whose :meth:`Launched.collect` gives the next tokens. On CUDA
        nothing here waits for the GPU (inputs go up asynchronously, next tokens come back
        into pinned memory), except a far-view utility pull (``kvrm``, every
        ``rerank_every`` steps), which syncs. On the CPU the work is done when this returns."""
        kv = self.kv
        self.last_path = ""
        start = None
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        if self.write_arena and kv.trains_due():     # skipped when nothing moves
            self._transfer(self._gather_graph, self._gather)
        prefill = [it for it in items if it[2] > 1]
        decode = [it for it in items if it[2] == 1]
        parts = []
        if prefill:
            parts.append(self._prefill(prefill))
        if kv.far is not None and kv.far.summaries_due:     # skipped when none is due
            self._transfer(self._absorb_graph, self._absorb)
        if decode:
            parts.append(self._decode(decode))
        if kv.far is not None:
            self.steps += 1
            if self.steps % kv.far_rerank == 0:    # the next commit re-ranks (a device sync)
                kv.far.pull_scores()
        return Launched(self.device, [p for p in parts if p[0]], start)

    def run(self, items: list) -> dict:
        """Compute ``items`` ``(request, start, n)``; returns ``{request: next token}`` for
        the requests whose tokens reach the end of what they have."""
        return self.launch(items).collect()

    def _prefill(self, items: list) -> tuple[list, None, torch.Tensor | None]:
        kv = self.kv
        if self.decode == "elastic":            # paged_prefill_attention reads TARGET only
            for req, _, _ in items:
                first, end = kv.fidelity.span(req.key)
                if end > first:
                    raise RuntimeError(f"prefill: request {req.rid} holds BASE blocks "
                                       f"[{first}, {end}); paged_prefill_attention reads pages "
                                       f"as TARGET (prefilling requests are never demoted)")
        toks, poss, pools, arenas, qs, lens, slots = [], [], [], [], [0], [], []
        for req, start, n in items:
            pos, pool, arena = self._slots(req, start, n)
            toks.append(req.tokens(start, start + n))
            poss.append(pos)
            pools.append(pool)
            arenas.append(arena)
            qs.append(qs[-1] + n)
            lens.append(start + n)
            slots.append(kv.slot(req))
        done = [it[0] for it in items if it[1] + it[2] == it[0].num_tokens]
        last = [qs[j + 1] - 1 for j, (req, start, n) in enumerate(items)
                if start + n == req.num_tokens]
        up = functools.partial(upload, device=self.device)
        tokens = up(np.concatenate(toks).astype(np.int64, copy=False))
        positions = up(np.concatenate(poss))
        pool_map = up(np.concatenate(pools))
        arena_map = up(np.concatenate(arenas))
        t = kv.tables()
        bt = t["block_table"].index_select(0, up(np.asarray(slots, dtype=np.int64)))
        q_start = up(np.asarray(qs, dtype=np.int32))
        seq_lens = up(np.asarray(lens, dtype=np.int32))
        last_rows = up(np.asarray(last, dtype=np.int64)) if done else None

        def attend(i, q, k, v):
            torch.ops.kvops.paged_kv_write(k, v, kv.k_pool[i], kv.v_pool[i], pool_map)
            if self.write_arena:
                torch.ops.kvops.paged_kv_write(k, v, self.k_arena_pages[i], self.v_arena_pages[i],
                                               arena_map)
            o, _ = torch.ops.kvops.paged_prefill_attention(q, kv.k_pool[i], kv.v_pool[i], bt,
                                                            q_start, seq_lens, k=k, v=v)
            return o

        hidden = forward_packed(self.model, tokens, positions, attend)
        if not done:
            return [], None, None
        return done, None, next_tokens(logits(self.model, hidden[last_rows]),
                                       [r.sampling for r in done], [len(r.output) for r in done])

    def _decode_forward(self, bk: int, selecting: bool = False) -> torch.Tensor:
        """The fixed-shape decode step over rows ``[0, bk)`` (row = KV slot): the greedy next
        tokens and the logits they come from (a row that samples draws from them after the
        step; :mod:`kvops.engine.sampling`). Inputs are the token and position buffers
        (position ``-1``: the row decodes nothing); the pool and arena slots come from the
        device block table, so the host fills two small buffers a step. ``selecting``
        (``kvrm-ret``): the step summarizes and chooses the far pages (:meth:`_select_plan`)."""
        kv, S, ret = self.kv, self.S, self.retrieval
        t = kv.tables()
        if ret is not None:
            ret.begin_step(summarize=selecting)
        pos_in = self._pos[:bk]
        valid = pos_in >= 0
        pos = pos_in.clamp(min=0)
        page = t["block_table"][:bk].gather(1, (pos // S)[:, None].to(torch.int64))[:, 0]
        none = torch.full_like(pos, -1)
        slot_map = torch.where(valid & (page >= 0), page.to(torch.int64) * S + pos % S, none)
        if self.write_arena:
            W = kv.window
            arena_map = torch.where(valid, self._rows[:bk] * W + pos % W, none)

        far = None
        if kv.far is not None and self.decode in ("static", "arena"):
            far = kv.far.views(bk)               # every layer's far slots, one gather a step
        mixed = {}
        if self.decode == "elastic":
            # a captured step takes the BASE table always (one graph a bucket); eager steps
            # take the native path while nothing is BASE
            span = kv.fidelity.attention_kwargs(always=self.graphs).get("base_span")
            if span is not None and getattr(kv, "general", False):
                mixed = {"block_mode": span_modes(span[:bk], t["block_table"].shape[1])}
            elif span is not None:
                mixed = {"base_span": span[:bk]}
        self.last_path = ("general" if "block_mode" in mixed else "span" if mixed else "native")

        def attend(i, q, k, v):
            torch.ops.kvops.paged_kv_write(k, v, kv.k_pool[i], kv.v_pool[i], slot_map)
            if self.write_arena:
                torch.ops.kvops.paged_kv_write(k, v, self.k_arena_pages[i], self.v_arena_pages[i],
                                               arena_map)
            if self.decode == "paged":
                o, _ = torch.ops.kvops.elastic_attention(
                    q, kv.k_pool[i], kv.v_pool[i], t["block_table"][:bk], t["seq_lens"][:bk])
                return o
            if self.decode == "elastic":
                o, _ = torch.ops.kvops.elastic_attention(
                    q, kv.k_pool[i], kv.v_pool[i], t["block_table"][:bk], t["seq_lens"][:bk],
                    **mixed)
                return o
            ka, va = kv.k_arena[i][:bk], kv.v_arena[i][:bk]
            ws, wl = t["win_start"][:bk], t["win_len"][:bk]
            slots = ()                       # the far slots, if any
            if ret is not None:
                if selecting:
                    ret.absorb(i, kv.k_pool[i])
                    ret.select(i, q, kv.k_pool[i], kv.v_pool[i])
                slots = ret.view(i, bk)
            elif far is not None:
                slots = far[0][i], far[1][i], far[2][i]
            o, lse = torch.ops.kvops.static_sliding_attention(q, ka, va, ws, wl, *slots)
            if far is not None:
                kv.far.observe(i, q, slots[0], slots[2], lse, live=valid)
            return o

        hidden = forward_packed(self.model, self._tok[:bk], pos, attend)
        lg = logits(self.model, hidden)
        return lg.argmax(-1), lg

    def _decode(self, items: list) -> tuple[list, list, torch.Tensor]:
        kv = self.kv
        slots = [kv.slot(req) for req, _, _ in items]
        bk = bucket_of(max(slots) + 1, self.rows)
        self.buckets_used.add(bk)
        host = np.zeros((2, bk), dtype=np.int64)
        host[1] = -1
        host[0, slots] = [req.token(start) for req, start, _ in items]
        host[1, slots] = [start for _, start, _ in items]
        dev = upload(host, self.device)
        self._tok[:bk].copy_(dev[0])
        self._pos[:bk].copy_(dev[1])
        selecting = self._select_plan(items, slots, bk)
        nxt, lg = self._replay(bk, selecting) if self.graphs else \
            self._decode_forward(bk, selecting)
        if any(draws(req.sampling) for req, _, _ in items):
            params, positions = [None] * bk, [0] * bk
            for (req, _, _), slot in zip(items, slots):
                params[slot], positions[slot] = req.sampling, len(req.output)
            nxt = next_tokens(lg, params, positions, greedy=nxt)
        if self.graphs:                     # the captured path: BASE tables always
            self.last_path = "native" if self.decode != "elastic" else (
                "general" if getattr(self.kv, "general", False) else "span")
        self.paths[self.last_path] += 1
        return [req for req, _, _ in items], slots, nxt

    @property
    def graphs_held(self) -> int:
        """The CUDA graphs this runner holds: a decode step a bucket (two for ``kvrm-ret``:
        choosing and reusing) and each captured transfer; a capture beyond them is a
        re-capture."""
        return len(self._graphs) + sum(g is not None
                                       for g in (self._absorb_graph, self._gather_graph))

    def _select_plan(self, items: list, slots: list, bk: int) -> bool:
        """Whether this decode step chooses far pages (``kvrm-ret``): when a row's session (a
        request; a new one after each preemption) decodes in its slot for the first time (every
        far page's bounds are taken first, in an eager step outside the graphs), or
        ``select_every`` steps after the last choice. A choosing step overwrites the pages of
        the bucket's rows that do not decode (their queries are not theirs), so those rows
        choose again when they next decode."""
        ret = self.retrieval
        if ret is None:
            return False
        self._since_selection += 1
        fresh = any(self._selected_for.get(slot) != req.key
                    for (req, _, _), slot in zip(items, slots))
        if not fresh and self._since_selection < self.kv.select_every:
            return False
        if fresh:
            ret.begin_step(drain=True)
            for i in range(self.kv.layers):
                ret.absorb(i, self.kv.k_pool[i])
        for slot in range(bk):
            self._selected_for.pop(slot, None)
        self._selected_for.update((slot, req.key) for (req, _, _), slot in zip(items, slots))
        self._since_selection = 0
        self.selections += 1
        return True

    def _absorb(self) -> None:
        self.kv.far.absorb_layers(self.kv.k_pool, self.kv.v_pool)

    @staticmethod
    def _transfer(graph, launch) -> None:
        """A transfer's captured graph (:meth:`capture_transfers`), else its eager launches."""
        if graph is not None:
            graph.replay()
        else:
            launch()

    def _gather(self) -> None:
        kv, t = self.kv, self.kv.tables()
        for i in range(kv.layers):
            torch.ops.kvops.paged_gather_merged(
                kv.k_pool[i], kv.v_pool[i], t["trains"], t["num_trains"],
                self.k_arena_pages[i], self.v_arena_pages[i])

    def warm_buckets(self) -> None:
        """Every decode bucket once with no row decoding (no K/V written, no far utility
        moved; with retrieval, its choosing and reusing step): captured on CUDA, run eagerly
        otherwise, so each bucket's kernels are compiled before a measured replay; then
        :meth:`capture_transfers`."""
        for bk in sorted({bucket_of(b, self.rows) for b in range(1, self.rows + 1)}):
            self._pos.fill_(-1)
            for selecting in (False, True) if self.retrieval is not None else (False,):
                if self.graphs:
                    self._replay(bk, selecting)
                else:
                    self._decode_forward(bk, selecting)
        self.capture_transfers()

    def capture_transfers(self) -> None:
        """Capture the step's fixed-shape transfers, each in one CUDA graph over every layer,
        so a step that needs one replays a graph instead of launching a kernel or more a layer
        (they read the commit's tables on the device):

        - the transport's copy trains (``paged_gather_merged``, one launch a layer; steps whose
          commit moved blocks), where the configuration has window arenas;
        - the far view's absorb (``kvrm``: ``FarView.absorb_layers``, about ten kernels for
          all layers; steps in which chunks leave the window).

        Each runs first eagerly over emptied tables (no trains; leave tables that write only
        the sink column), restored after, so the call changes no session's state whenever it
        comes. Counted as captures."""
        if not self.graphs:
            return
        kv = self.kv
        if self.write_arena and self._gather_graph is None:
            t = kv.tables()
            self._gather_graph = self._capture(self._gather, [(t["num_trains"], 0)])
        if kv.far is not None and self._absorb_graph is None:
            t = kv.far._tables()
            self._absorb_graph = self._capture(
                self._absorb, [(t["far_leave_pages"], -1), (t["far_leave_ids"], kv.far.J)])

    def _capture(self, fn, empties: list) -> torch.cuda.CUDAGraph:
        """``fn`` run once eagerly on a side stream with each table of ``empties`` filled with
        its empty value (restored after), then captured in a graph of its own pool."""
        kept = [(table, table.clone(), empty) for table, empty in empties]
        for table, _, empty in kept:
            table.fill_(empty)
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(s)
        for table, saved, _ in kept:
            table.copy_(saved)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        self.captures += 1
        return g

    def _replay(self, bk: int, selecting: bool = False) -> torch.Tensor:
        entry = self._graphs.get((bk, selecting))
        if entry is None:
            # warm-up (Triton compiles, the allocator warms) with no row decoding, so it writes
            # no K/V and moves no utility; the replay below is the step's one decode
            pos = self._pos[:bk].clone()
            self._pos[:bk].fill_(-1)
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                self._decode_forward(bk, selecting)
            torch.cuda.current_stream(self.device).wait_stream(s)
            self._pos[:bk].copy_(pos)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                out = self._decode_forward(bk, selecting)
            entry = self._graphs[bk, selecting] = (g, out)
            self.captures += 1
        entry[0].replay()
        return entry[1]
