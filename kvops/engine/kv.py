"""Where requests' K/V live: :class:`PagedKV` (pages mapped by the :class:`~kvops.runtime.Pager`,
optionally a ring-window arena fed by the :class:`~kvops.runtime.Transport` and a far view,
:class:`~kvops.runtime.FarView` or :class:`~kvops.runtime.FarRetrieval`) and :class:`StaticKV`
(one worst-case contiguous arena row per request, the static-graph baseline).

Both take the scheduler's decisions for a step in :meth:`commit_step`: ends (finished or
preempted requests), admissions and growth by ``n`` tokens. :class:`PagedKV` turns them into one
Frame (trims, aliases, reserves), one commit and its copy-on-write copies; pages a trim gives
back are free from the next step on (the pager returns them at commit). Prefix sharing: a
request whose leading Mooncake ``hash_ids`` chain equals a live session's (whose K/V for those
blocks is already computed) is opened with ``alias`` over the shared whole blocks; finished
requests stay mapped as cached prefixes (trimmed to their hashed blocks) until pages or slots are
needed, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from kvops._upload import upload
from kvops.engine.request import Request, Status
from kvops.runtime import FarRetrieval, FarView, Pager, Transport, apply_copies

_NEVER = np.iinfo(np.int64).max     # a trim count no summarized lead passes


def _blocks(n: int, S: int) -> int:
    return -(-n // S)


class PagedKV:
    """Pool ``[layers, P, S, Hkv, D]`` mapped by a pager; ``window`` > 0 adds the arenas
    ``[layers, B, W, Hkv, D]`` and a transport (``max_train_bytes``, ``copy_tail``; without
    ``copy_tail`` the model writes through and an aliased prefix's window blocks are staged
    until the session first decodes: ``Transport``'s ``defer_aliased``); ``far`` a
    far view (``{"chunk_tokens", "cap"}``, optionally ``"rerank_every"``: steps between pulls of
    the utilities, which the host ranks at the next commit; 1 by default); ``retrieval`` the
    retrieval far view instead (``{"top_k", "select_every"}``: the ``top_k`` far pages each
    query chooses, exact, chosen again every ``select_every`` decode steps and at a request's
    first decode step; its far pages stay mapped, so it saves no pages)."""

    kind = "paged"
    # editing calls beyond the engine's own (distributed.KVLog)
    tp_edits = ("hold_prefix", "release_prefix")

    def __init__(self, *, num_pages: int, page_size: int, max_sessions: int, max_blocks: int,
                 layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, window: int = 0, max_train_bytes: int = 131072,
                 copy_tail: bool = False, far: dict | None = None, prefix_sharing: bool = True,
                 far_trim: bool = True, retrieval: dict | None = None):
        self.S, self.layers, self.device = page_size, layers, device
        self.max_sessions, self.max_blocks = max_sessions, max_blocks
        self.token_bytes = 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        self.pager = Pager(num_pages, page_size, max_sessions, max_blocks, device=device)
        pool = (layers, num_pages, page_size, kv_heads, head_dim)
        self.k_pool, self.v_pool = self._pools(pool, dtype, device)
        self.window = window
        self.transport = self.far = self.retrieval = None
        self.k_arena = self.v_arena = None
        if window:
            page_bytes = page_size * kv_heads * head_dim * self.k_pool.element_size()
            self.transport = Transport(self.pager, window, page_bytes, max_train_bytes, copy_tail,
                                       defer_aliased=not copy_tail)
            arena = (layers, max_sessions, window, kv_heads, head_dim)
            self.k_arena = torch.zeros(arena, dtype=dtype, device=device)
            self.v_arena = torch.zeros(arena, dtype=dtype, device=device)
        if far:
            self.far = FarView(self.pager, window_tokens=window, chunk_tokens=far["chunk_tokens"],
                               cap=far["cap"], num_layers=layers, num_kv_heads=kv_heads,
                               head_dim=head_dim, dtype=dtype, device=device)
            self.far_rerank = int(far.get("rerank_every", 1))
            if self.far_rerank < 1:
                raise ValueError(f"far: rerank_every: expected >= 1 steps, got {self.far_rerank}")
        if retrieval:
            if far or not window:
                raise ValueError("retrieval: expected window arenas and no mean far view "
                                 f"(window={window}, far={far})")
            every = int(retrieval["select_every"])
            if every < 1:
                raise ValueError(f"retrieval: select_every: expected >= 1 steps, got {every}")
            self.retrieval = FarRetrieval(
                self.pager, window_tokens=window, top_k=min(int(retrieval["top_k"]), max_blocks),
                num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                device=device, max_leave=-(-every // page_size) + 1)
            self.select_every = every
        self.prefix_sharing = prefix_sharing
        self.far_trim = far_trim and self.far is not None
        self._far_trimmed: dict[str, int] = {}    # session -> leading blocks trimmed as far
        # the same per slot, for the running request in it (_NEVER: a slot whose session does
        # not decode: free, a cached prefix, ended), and the request a slot was opened for
        self._trim_at = np.full(max_sessions, _NEVER, dtype=np.int64)
        # the far view's lead_epoch at the last look, and whether a candidate was held back
        # then (in prefill, or the source of an alias): without either, nothing can be trimmed
        self._trim_epoch, self._trim_waiting = -1, False
        self._slot_req: dict[int, Request] = {}
        self._holders: dict[tuple, list[str]] = {}       # hash chain -> sessions holding it
        self._chains: dict[str, list[tuple]] = {}        # session -> chains it registered
        self._cached: OrderedDict[str, None] = OrderedDict()   # finished, kept as prefixes
        self._held: set[str] = set()          # cached prefixes this step's admissions alias
        self._ends: list[tuple[str, list[int] | None]] = []     # trims for the next frame
        self._partial: set[str] = set()     # sessions that share a partly filled page
        self.prefix_hit_tokens = 0
        self.cow_copies = 0
        self.last_commit = None
        self.deferred: set[Request] = set()

    @staticmethod
    def _pools(shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pools ``[layers, P, S, Hkv, D]``."""
        return (torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device))

    # -- capacity ------------------------------------------------------------------------------
    @property
    def total_pages(self) -> int:
        return self.pager.num_pages

    def free_pages(self) -> int:
        return self.pager.free_pages

    def free_slots(self) -> int:
        return self.max_sessions - len(self.pager.sessions())

    def refuse_reason(self, req: Request) -> str | None:
        n = req.max_tokens
        nb = _blocks(n, self.S)
        if nb > self.max_blocks:
            return (f"request {req.rid}: needs {n} tokens of context ({nb} blocks of {self.S}), "
                    f"a session holds at most {self.max_blocks} blocks")
        if nb > self.total_pages:
            return (f"request {req.rid}: needs {n} tokens of context ({nb} pages of {self.S}), "
                    f"the pool holds {self.total_pages} pages")
        return None

    def pages_for(self, req: Request, n: int, hit: int = 0) -> int:
        """Free pages growing ``req`` by ``n`` tokens takes (``hit`` aliased tokens first when
        it is new): new blocks plus a copy-on-write of a shared partly filled tail."""
        S = self.S
        running = req.status is Status.RUNNING
        start = req.num_computed if running else hit
        if running and n == 1 and req.key not in self._partial:     # a decode step
            return int(start % S == 0)
        need = _blocks(start + n, S) - _blocks(start, S)
        if start % S:                       # the tokens land in a partly filled tail page
            if not running:                 # aliased mid-page: its first write copies the page
                need += 1
            elif req.key in self._partial and \
                    self.pager.refcount(self.pager.pages(req.key)[start // S]) > 1:
                need += 1
        return need

    swaps = False        # preemption swaps the request's K/V out (OffloadKV), else recompute

    def reclaimable(self, reqs: list[Request]) -> int:
        """Pages this step can free without preempting, by lowering fidelity of ``reqs``'
        blocks (ElasticKV); none here."""
        return 0

    def admission_margin(self, reqs: list[Request], computed: int | None = None) -> int:
        """Pages admission keeps free (or demotable) for ``reqs``' growth to their whole
        context (``computed``: tokens computed once admitted, for one waiting request); none
        here: admission takes free pages as vLLM does."""
        return 0

    def quiesce(self) -> None:
        """Wait for background KV work (none here); the engine calls it before its last commit."""

    def reset_counters(self) -> None:
        """Start the counters again (after a warm-up); the state stays."""
        self.prefix_hit_tokens = self.cow_copies = 0

    def pages_of(self, req: Request) -> int:
        """Pages a preemption of ``req`` gives back (those not shared)."""
        return sum(1 for p in self.pager.pages(req.key) if p >= 0 and self.pager.refcount(p) == 1)

    def hold_prefix(self, key: str) -> None:
        """Keep the cached prefix ``key`` until this step's commit: an admission of the step
        aliases it, and the commit runs trims before aliases, so evicting it now would end the
        session the alias reads."""
        self._held.add(key)

    def release_prefix(self, key: str) -> None:
        """Undo :meth:`hold_prefix` for ``key`` (no admission of this step aliases it)."""
        self._held.discard(key)

    def evict_cached(self) -> int | None:
        """End the least recently used cached prefix that no admission of this step aliases
        (freed at the next commit); returns the pages that gives back (0 when all are shared),
        None when none can be evicted."""
        key = next((k for k in self._cached if k not in self._held), None)
        if key is None:
            return None
        del self._cached[key]
        freed = sum(1 for p in self.pager.pages(key) if p >= 0 and self.pager.refcount(p) == 1)
        self._drop_chains(key)
        self._partial.discard(key)
        self._ends.append((key, None))
        return freed

    # -- prefix sharing ------------------------------------------------------------------------
    def prefix_lookup(self, req: Request) -> tuple[str | None, int]:
        """The session to alias and how many leading tokens: whole hash blocks that a live
        session computed, never the prompt's last token."""
        if not self.prefix_sharing or not req.hash_ids:
            return None, 0
        src, hit, chain = None, 0, ()
        for i, h in enumerate(req.hash_ids):      # a holder of a chain holds its prefixes too
            chain = chain + (h,)
            end = (i + 1) * req.hash_block
            holders = self._holders.get(chain)
            if not holders or end > len(req.prompt) - 1:
                break
            src, hit = holders[-1], end
        return src, hit

    def _prefix_blocks(self, req: Request) -> int:
        """Leading blocks of ``req``'s session that its registered hash chains cover."""
        chains = self._chains.get(req.key)
        return _blocks(len(chains) * req.hash_block, self.S) if chains else 0

    def _register(self, req: Request) -> None:
        if req.key in self._far_trimmed:      # no chain over blocks a far trim gave back
            return
        key, have = req.key, self._chains.setdefault(req.key, [])
        full = min(req.num_computed, len(req.prompt)) // req.hash_block
        for i in range(len(have), min(full, len(req.hash_ids))):
            chain = tuple(req.hash_ids[:i + 1])
            self._holders.setdefault(chain, []).append(key)
            have.append(chain)

    def _drop_chains(self, key: str) -> None:
        for chain in self._chains.pop(key, []):
            holders = self._holders.get(chain, [])
            if key in holders:
                holders.remove(key)
            if not holders:
                self._holders.pop(chain, None)

    # -- a step ----------------------------------------------------------------------------------
    def end(self, req: Request, keep_prefix: bool = False) -> None:
        """``req`` finished (``keep_prefix``: stay cached over its hashed blocks) or was
        preempted; its trim goes into the next frame."""
        key = req.key
        if keep_prefix and self.prefix_sharing and self._chains.get(key):
            nb = _blocks(self.pager.length(key), self.S)
            cold = list(range(max(self._prefix_blocks(req), self._far_trimmed.pop(key, 0)), nb))
            if cold:
                self._ends.append((key, cold))
            self._cached[key] = None
            self._stop_trims(key)
            return
        self._drop_chains(key)
        self._partial.discard(key)
        self._far_trimmed.pop(key, None)
        self._ends.append((key, None))
        self._stop_trims(key)

    def _stop_trims(self, key: str) -> None:
        """``key``'s session decodes no more: its slot is no far trim's candidate."""
        sess = self.pager.committed.sessions.get(key) if self.far_trim else None
        if sess is not None:
            self._trim_at[sess.slot] = _NEVER

    def commit_step(self, admits: list[tuple[Request, str | None, int, int]],
                    grows: list[tuple[Request, int]]):
        """One frame: pending trims, then ``admits`` ``(req, src, hit, n)`` (alias ``hit``
        tokens of ``src``, then reserve ``n``) and ``grows`` ``(req, n)``; one commit. Returns
        the :class:`~kvops.runtime.Commit`."""
        if self.far_trim:                   # not a session this step aliases from
            self._trim_far({src for _, src, hit, _ in admits if hit})
        self.deferred = set()
        with self.pager.frame() as f:
            for key, blocks in self._ends:
                f.trim(key, blocks)
            reserves = []
            for req, src, hit, n in admits:
                reserves.append((req, self._open(f, req, src, hit, n)))
            reserves += list(grows)
            for req, n in self._before_reserves(f, reserves):
                f.reserve(req.key, n)
        self._ends = []
        self._held.clear()
        commit = f.result
        self.cow_copies += len(commit.copies)
        if commit.copies:
            for layer in range(self.layers):
                apply_copies(self.k_pool[layer], self.v_pool[layer], commit.copies)
        self.last_commit = commit
        if self.far_trim:
            for req, _, _, _ in admits:
                slot = self.pager.slot(req.key)
                self._slot_req[slot] = req
                self._trim_at[slot] = 0
        self._after_commit(commit, admits)
        return commit

    def _open(self, f, req: Request, src, hit: int, n: int) -> int:
        """Open an admitted request's session in frame ``f`` (alias ``hit`` tokens of ``src``);
        returns the tokens to reserve for it."""
        if hit:
            f.alias(req.key, src, hit)
            if hit % self.S:
                self._partial.update((req.key, src))
            if src in self._cached:
                self._cached.move_to_end(src)
            self.prefix_hit_tokens += hit
        return n

    def _before_reserves(self, f, reserves: list[tuple[Request, int]]):
        """The step's reserves ``(request, tokens)`` about to be made in ``f``, after its trims
        and aliases: the ones to make (a subclass may act first, or defer some: those go into
        ``self.deferred`` and compute nothing this step)."""
        return reserves

    def _after_commit(self, commit, admits) -> None:
        """The frame committed (and its copy-on-write copies ran)."""
    def _trim_far(self, keep: set) -> None:
        """``kvrm``'s bounded budget: once a decoding request's leading far chunks are
        summarized (absorbed in an earlier step), their blocks go back, except those of its
        registered hash chains (a prefix it serves to later admissions, usually mapped by the
        sessions that aliased it too, so trimming it would free little and end the sharing).
        A request still in prefill keeps them (its prefill attends to the whole prefix). The
        candidates are the slots whose summarized lead passed
        what was trimmed (one array comparison), looked at only when the far view adopted a
        commit that moved the summarized lead (``lead_epoch``) or a candidate was held back at
        the last look: a decode step in which no chunk was summarized does nothing."""
        epoch = self.far.lead_epoch
        if epoch == self._trim_epoch and not self._trim_waiting:
            return
        self._trim_epoch, waiting = epoch, False
        M = self.far.M
        lead = self.far.leading_summarized_all()
        for slot in np.flatnonzero(lead * M > self._trim_at).tolist():
            req = self._slot_req[slot]
            if req.num_computed < len(req.prompt) or req.key in keep:
                waiting = True
                continue
            have, now = int(self._trim_at[slot]), int(lead[slot]) * M
            first = max(have, self._prefix_blocks(req))
            if first < now:
                self._ends.append((req.key, list(range(first, now))))
                self._far_trimmed[req.key] = now
            self._trim_at[slot] = now
        self._trim_waiting = waiting

    def after_step(self, reqs: list[Request]) -> None:
        """The step's K/V is written: register the hash blocks it completed."""
        if self.prefix_sharing:
            for r in reqs:
                if r.hash_ids:
                    self._register(r)

    # -- reads for the runner and the metrics --------------------------------------------------
    def slot(self, req: Request) -> int:
        return self.pager.slot(req.key)

    def pages(self, req: Request) -> list[int]:
        return self.pager.pages(req.key)

    def tables(self) -> dict:
        return self.pager.device_tables

    def reserved_bytes(self) -> int:
        used_pages = self.pager.num_pages - self.pager.free_pages
        arena = self.max_sessions * self.window if self.window else 0
        return (used_pages * self.S + arena) * self.token_bytes

    def cached_sessions(self) -> int:
        return len(self._cached)

    def trains_due(self) -> bool:
        """Whether this step's commit queued copy trains (``num_trains > 0`` on the device).
        Without any, every layer's ``paged_gather_merged`` copies nothing, so the runner skips
        them."""
        return self.transport is not None and bool(self.transport.last.get("groups", 0))

    def dma(self) -> dict:
        """This commit's copy trains: groups (near-window trains), far groups (far-view
        summaries: one read of a far chunk's pages each), moving sessions (those with a near
        train or a far summary: the paper's near-window train plus far-view train are both a
        session's), bytes (one of K or V, a layer, of the near trains)."""
        c = self.last_commit
        if c is None or self.transport is None:
            return {"groups": 0, "sessions": 0, "bytes": 0, "far_groups": 0}
        t = c.stats.get("transport", {})
        groups = int(t.get("groups", 0))
        moving = np.zeros(0, dtype=np.int64)
        if groups:
            tr = self.pager.host_tables["trains"][:groups]
            nw = self.window // self.S
            rows = np.repeat(tr[:, 1], tr[:, 2]) + np.concatenate(
                [np.arange(n) for n in tr[:, 2]])
            moving = rows // nw
        far = int(c.stats.get("far_view", {}).get("summaries", 0)) if self.far else 0
        if far:       # this commit's leave rows hold chunk ids; the others hold the sink
            ids = self.pager.host_tables["far_leave_ids"]
            moving = np.concatenate([moving, np.flatnonzero(ids != self.far.J)
                                     // self.far.max_leave])
        return {"groups": groups, "sessions": len(np.unique(moving)),
                "bytes": int(t.get("bytes", 0)), "far_groups": far}


class StaticKV:
    """The static-graph baseline: ``slots`` arena rows of ``slot_tokens`` each (the worst-case
    context), ``[layers, slots, slot_tokens, Hkv, D]``, seen as a pool whose row ``b`` is pages
    ``[b * L, (b + 1) * L)``. A request holds one whole row from admission to finish."""

    kind = "static"
    window = 0
    transport = far = None

    def __init__(self, *, slots: int, slot_tokens: int, page_size: int, layers: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        if slot_tokens % page_size:
            raise ValueError(f"slot_tokens: expected a multiple of page_size={page_size}, "
                             f"got {slot_tokens}")
        self.S, self.layers, self.device = page_size, layers, device
        self.max_sessions, self.slot_tokens = slots, slot_tokens
        self.max_blocks = slot_tokens // page_size
        self.token_bytes = 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        pool = (layers, slots * self.max_blocks, page_size, kv_heads, head_dim)
        self.k_pool = torch.zeros(pool, dtype=dtype, device=device)
        self.v_pool = torch.zeros(pool, dtype=dtype, device=device)
        self.k_arena = self.k_pool.view(layers, slots, slot_tokens, kv_heads, head_dim)
        self.v_arena = self.v_pool.view(layers, slots, slot_tokens, kv_heads, head_dim)
        self._free = list(range(slots - 1, -1, -1))
        self._slot: dict[str, int] = {}
        self._len = np.zeros(slots, dtype=np.int32)
        bt = np.arange(slots * self.max_blocks, dtype=np.int32).reshape(slots, self.max_blocks)
        self._tables = {"block_table": torch.from_numpy(bt).to(device),
                        "seq_lens": torch.zeros(slots, dtype=torch.int32, device=device),
                        "win_start": torch.zeros(slots, dtype=torch.int32, device=device)}
        self._tables["win_len"] = self._tables["seq_lens"]
        self.prefix_hit_tokens = 0
        self.cow_copies = 0
        self.prefix_sharing = False

    total_pages = property(lambda self: self.max_sessions * self.max_blocks)

    def free_pages(self) -> int:
        return 1 << 62            # admission is by slot: a slot holds the worst case

    def free_slots(self) -> int:
        return len(self._free)

    def refuse_reason(self, req: Request) -> str | None:
        if req.max_tokens > self.slot_tokens:
            return (f"request {req.rid}: needs {req.max_tokens} tokens of context, a static "
                    f"arena slot holds {self.slot_tokens}")
        return None

    swaps = False
    deferred: frozenset = frozenset()

    def pages_for(self, req: Request, n: int, hit: int = 0) -> int:
        return 0

    def pages_of(self, req: Request) -> int:
        return 0

    def reclaimable(self, reqs) -> int:
        return 0

    def admission_margin(self, reqs, computed=None) -> int:
        return 0

    def reset_counters(self) -> None:
        self.prefix_hit_tokens = 0

    def quiesce(self) -> None:
        pass

    def evict_cached(self) -> None:
        return None

    def prefix_lookup(self, req: Request):
        return None, 0

    def end(self, req: Request, keep_prefix: bool = False) -> None:
        slot = self._slot.pop(req.key)
        self._len[slot] = 0
        self._free.append(slot)

    def commit_step(self, admits, grows):
        for req, _, _, n in admits:
            slot = self._slot[req.key] = self._free.pop()
            self._len[slot] = n
        for req, n in grows:
            self._len[self._slot[req.key]] += n
        self._tables["seq_lens"].copy_(upload(self._len, self.device))   # no wait for the GPU
        return None

    def after_step(self, reqs) -> None:
        pass

    def slot(self, req: Request) -> int:
        return self._slot[req.key]

    def pages(self, req: Request) -> list[int]:
        b = self._slot[req.key]
        return list(range(b * self.max_blocks, (b + 1) * self.max_blocks))

    def tables(self) -> dict:
        return self._tables

    def reserved_bytes(self) -> int:
        return self.max_sessions * self.slot_tokens * self.token_bytes

    def cached_sessions(self) -> int:
        return 0

    def dma(self) -> dict:
        return {"groups": 0, "sessions": 0, "bytes": 0, "far_groups": 0}
