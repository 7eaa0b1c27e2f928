"""``PagedCache``: a KV pool per layer mapped by :class:`kvops.runtime.Pager`, written with
``paged_kv_write``, decoded with ``elastic_attention`` (native path: every block TARGET; the
structured path over BASE blocks with ``fidelity=``).

Rows of the batch are pager sessions ``0 .. B-1``. Only real tokens are stored: a left-padded
row's padding never reaches the pool, so row ``b``'s token ``i`` (``i`` counted from its first
real token, which is also its RoPE position under ``generate``) is logical slot ``i`` of its
session: page ``block_table[b, i // S]``, offset ``i % S``.

The prompt step runs one pager frame for the whole generation: it reserves each row's
``max_tokens`` minus its padding (``generate`` offers no host hook between compiled decode
steps), and the commit uploads the block table once. Decode steps then need no host work: the
first layer finds each row's new slot from the block table on the device and advances the
shared device ``lens`` (real tokens per row); every layer writes its K/V there with
``paged_kv_write`` and attends over ``lens`` tokens with ``elastic_attention``; a compiled step
has one shape and static addresses. A row that reaches its reservation stops storing tokens
and attends to its first ``max_tokens`` minus padding (eager steps raise ValueError first).
``reset()`` ends every session (one frame of trims) so the next prompt starts clean.

A step of ``T > 1`` tokens (the prompt, or a continuation onto a filled cache, whose tokens are
all real) writes the real tokens with ``paged_kv_write`` and attends with
``paged_prefill_attention`` over each row's paged prefix and itself, the real tokens of all rows
packed first.

Fidelity (ElasticKV): ``fidelity=True`` or a dict of :class:`kvops.runtime.Fidelity` options
attaches the policy to the pager over every layer's K and V (a pack or refine call a pool).
Decode then always runs
``elastic_attention``'s structured path with the pager's ``base_span`` table (empty spans read as
TARGET: one compiled graph whatever the state). Demotion and promotion are host calls between
steps (``generate`` has no host hook inside its compiled loop): :meth:`PagedCache.demote` packs
the oldest whole pairs of written blocks (``protect_first`` / ``protect_recent`` counted on what
each row holds, never a block still to be written) and returns their second pages to the pool;
:meth:`PagedCache.promote` refines every pair back, bit for bit, a round of frames at a time
(two held pages a pair in flight; one spare page beyond the reservation lets the last pair
through). A step of ``T > 1`` tokens promotes first (``paged_prefill_attention`` reads TARGET
only). Not done here: sliding windows (a ``sliding_window`` below ``max_tokens`` raises).
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache

import kvops  # noqa: F401  (registers torch.ops.kvops.*)
from kvops.integrations.transformers._layers import (
    Geometry,
    KvopsLayer,
    StepState,
    geometry,
    static,
)
from kvops.integrations.transformers.attention import padding_start
from kvops.runtime import Fidelity, OutOfPages, Pager
from kvops.runtime.fidelity import BASE

FIDELITY_OPTIONS = ("codec", "min_batch", "protect_first", "protect_recent", "reserve_decay",
                    "headroom", "max_promote", "host_pairs")


class PagedState(StepState):
    """What the layers of one PagedCache share: the pager, the reservation, the rows' lengths
    and the step's slots; the first layer updates it each step."""

    def __init__(self, batch_size: int, max_tokens: int, page_size: int, num_pages: int,
                 device: torch.device, pools: list[torch.Tensor], fidelity: dict | None):
        super().__init__(batch_size, device)
        self.max_tokens, self.page_size = max_tokens, page_size
        self.max_blocks = math.ceil(max_tokens / page_size)
        self.pager = Pager(num_pages, page_size, max_sessions=batch_size,
                           max_blocks=self.max_blocks, device=device)
        # attached before the first frame (it adds the base_span table)
        self.fidelity = None if fidelity is None else Fidelity(self.pager, pools, **fidelity)
        with self.pager.frame():
            pass                                  # freezes the tables: device views exist now
        self.block_table = self.pager.device_tables["block_table"]
        self.base_span = self.pager.device_tables.get("base_span")
        if self.base_span is not None:
            static(self.base_span)
        self.capacity = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.lens = torch.zeros(batch_size, dtype=torch.int32, device=device)   # real tokens
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.slots = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.host_pos = 0                         # eager steps only: the bound check
        self.reserved = False
        static(self.pos, self.block_table, self.capacity, self.lens, self.seq_lens, self.slots)

    def slots_of(self, index: torch.Tensor) -> torch.Tensor:
        """Flat pool slots of logical token ``index`` [B, n] of each row; -1 past the row's
        reservation or where ``index < 0`` (padding)."""
        S = self.page_size
        ok = (index >= 0) & (index < self.capacity.long()[:, None])
        block = (index.clamp(min=0) // S).clamp(max=self.max_blocks - 1)
        page = self.block_table.long().gather(1, block)
        return torch.where(ok, page * S + index.clamp(min=0) % S, -1)

    def begin_chunk(self, mask, B: int, T: int) -> None:
        """A step of ``T > 1`` tokens a row: the prompt (its mask gives each row's padding; the
        pager reserves every row's ``max_tokens``) or, on a filled cache, a continuation whose
        tokens are all real. Sets the new tokens' slots, the order that packs the real tokens
        of all rows first (row by row) for ``paged_prefill_attention``, their row starts, and
        the lengths after the chunk."""
        dev = self.lens.device
        if self.filled:
            if self.fidelity is not None:         # paged_prefill_attention reads TARGET only
                self.promote_all()
            if self.host_pos + T > self.max_tokens:
                raise ValueError(f"PagedCache: {self.host_pos} + {T} tokens a row exceed "
                                 f"max_tokens={self.max_tokens}")
            start = torch.zeros(B, dtype=torch.long, device=dev)
            self.host_pos += T
        else:
            start = padding_start(mask, B, T, dev)
            if not self.reserved:
                self.reserve(start, T)
        before = self.lens.long()
        index = torch.arange(T, device=dev)[None, :] - start[:, None]
        real = index >= 0
        self.chunk_slots = self.slots_of(torch.where(real, index + before[:, None], -1)).reshape(-1)
        self.chunk_order = torch.argsort((~real).reshape(-1).to(torch.int8), stable=True)
        counts = (T - start).to(torch.int32)
        self.chunk_starts = torch.cat([counts.new_zeros(1), counts.cumsum(0, dtype=torch.int32)])
        self.lens.add_(counts)
        self.seq_lens.copy_(torch.minimum(self.lens, self.capacity))
        self.pos.add_(T)
        self.filled = True

    def advance(self) -> None:
        """A decode step: each row's new token's slot, then the lengths including it."""
        if not torch.compiler.is_compiling():
            self.host_pos += 1
            if self.host_pos > self.max_tokens:
                raise ValueError(f"PagedCache: more than max_tokens={self.max_tokens} tokens "
                                 f"a row (padding included); make the cache larger")
        self.slots.copy_(self.slots_of(self.lens.long()[:, None])[:, 0])
        self.lens.add_(1)
        self.pos.add_(1)
        self.seq_lens.copy_(torch.minimum(self.lens, self.capacity))

    @torch.compiler.disable
    def reserve(self, start: torch.Tensor, T: int) -> None:
        """The prompt's frame (host work: a compiled prompt step breaks its graph here)."""
        if T > self.max_tokens:
            raise ValueError(f"PagedCache: a prompt of {T} tokens (padding included) exceeds "
                             f"max_tokens={self.max_tokens}")
        pads = start.tolist()                     # one sync a prompt
        with self.pager.frame() as f:
            for b, p in enumerate(pads):
                f.reserve(b, self.max_tokens - p)
        self.capacity.copy_(torch.tensor([self.max_tokens - p for p in pads], dtype=torch.int32))
        self.host_pos = T
        self.reserved = True

    # -- fidelity (host calls between steps) ---------------------------------------------------
    def demote(self, pages: int) -> int:
        """Demote whole pairs of written TARGET blocks until ``pages`` pages are freed (at
        least ``min_batch`` pairs when that many are eligible); returns the pairs demoted."""
        fid, S = self.fidelity, self.page_size
        if not self.reserved or pages <= 0:
            return 0
        # the pager's lengths are the reservations (max_tokens a row): keep every block that
        # is not yet fully written, plus the policy's protect_recent of what the row holds
        held = self.seq_lens.tolist()
        recent = fid.protect_recent
        keep = max(-(-self.pager.length(b) // S) - min(n // S, -(-n // S) - recent)
                   for b, n in enumerate(held))
        fid.protect_recent = max(recent, keep)
        try:
            with self.pager.frame() as f:
                got = fid.step(f, need=f.free_pages + pages)
        finally:
            fid.protect_recent = recent
        return got["demoted"]

    @torch.compiler.disable
    def promote_all(self) -> int:
        """Refine every BASE pair back to TARGET (bit for bit); returns the pairs promoted.
        Each round issues what the free pages hold (two a pair), the next settles them."""
        fid = self.fidelity
        if fid is None:
            return 0
        before, most = fid.stats["promoted"], fid.max_promote
        while fid.stats["base_blocks"] or fid.stats["in_flight"]:
            fid.drain()
            with self.pager.frame() as f:
                # settle only: no demotion (need = free pages) and none of the policy's own
                # promotions (max_promote 0), so the round's, counted below, hold every page
                fid.max_promote = 0
                try:
                    got = fid.step(f, need=f.free_pages)
                finally:
                    fid.max_promote = most
                room = self.pager.free_pages // 2          # held pages come from the pool
                issued = 0
                for b in self.pager.sessions():
                    waiting = int((fid.block_states(b) == BASE).sum()) // 2
                    n = min(room, waiting)
                    if n:
                        issued += fid.promote(f, b, limit=n)
                        room -= n
            if not issued and not got["settled"] and not fid.stats["in_flight"] \
                    and fid.stats["base_blocks"]:
                raise OutOfPages(f"PagedCache.promote: {fid.stats['base_blocks']} BASE blocks "
                                 f"and {self.pager.free_pages} free pages (a promotion holds 2)")
        return fid.stats["promoted"] - before

    def end(self) -> None:
        if self.reserved:
            with self.pager.frame() as f:
                for b in self.pager.sessions():
                    f.trim(b)
        for t in (self.capacity, self.lens, self.seq_lens, self.pos):
            t.zero_()
        self.host_pos = 0
        self.reserved = False
        self.filled = False


class PagedLayer(KvopsLayer):
    """One layer's pool ``[P, S, Hkv, D]`` (K and V) on the shared pager; see the module doc."""

    def __init__(self, batch_size: int, geo: Geometry, state: PagedState, keys: torch.Tensor,
                 values: torch.Tensor):
        super().__init__(batch_size, geo, state)
        self.keys, self.values = keys, values
        static(self.keys, self.values)

    @property
    def lens(self) -> torch.Tensor:
        return self.state.lens

    def get_max_length(self) -> int:
        return self.state.max_tokens

    def reset(self) -> None:
        """Nothing a layer owns: PagedCache.reset ends the sessions and clears the lengths."""

    def attend(self, module, query, key, value, mask, *, scaling=None, sliding_window=None,
               **kwargs):
        st = self.state
        if sliding_window is not None and sliding_window < st.max_tokens:
            raise NotImplementedError(
                f"PagedCache: the model's sliding_window={sliding_window} is below max_tokens="
                f"{st.max_tokens}; the paged path has no window (use SlidingCache)")
        B, _, T, _ = query.shape
        if T == 1:
            return self._decode(query, key, value, scaling)
        if self.first:
            st.begin_chunk(mask, B, T)
        H, D = self.geo.num_kv_heads, self.geo.head_dim
        k = key.transpose(1, 2).reshape(B * T, H, D)
        v = value.transpose(1, 2).reshape(B * T, H, D)
        torch.ops.kvops.paged_kv_write(k, v, self.keys, self.values, st.chunk_slots)
        Hq = query.shape[1]
        q = query.transpose(1, 2).reshape(B * T, Hq, D)[st.chunk_order]
        # the chunks' own rows, packed as q is: their tiles load without the page table
        out, _ = torch.ops.kvops.paged_prefill_attention(
            q, self.keys, self.values, st.block_table, st.chunk_starts, st.seq_lens,
            scale=scaling, k=k[st.chunk_order], v=v[st.chunk_order])
        full = torch.zeros_like(out).index_copy_(0, st.chunk_order, out)
        return full.view(B, T, Hq, D), None

    def _decode(self, query, key, value, scaling):
        st = self.state
        if self.first:
            st.advance()
        torch.ops.kvops.paged_kv_write(key[:, :, 0], value[:, :, 0], self.keys, self.values,
                                       st.slots)
        out, _ = torch.ops.kvops.elastic_attention(query[:, :, 0], self.keys, self.values,
                                                   st.block_table, st.seq_lens,
                                                   base_span=st.base_span, scale=scaling)
        return out.unsqueeze(1), None


class PagedCache(Cache):
    """A transformers ``Cache`` of :class:`PagedLayer` s over one :class:`kvops.runtime.Pager`.

    ``PagedCache(model, batch_size, max_tokens, page_size=16, num_pages=None, fidelity=None)``:
    ``max_tokens`` bounds each row's prompt (padding included) plus new tokens; the pool
    defaults to enough pages for every row to reach it (one more with fidelity). Use with
    ``attn_implementation="kvops"``:
    ``model.generate(ids, attention_mask=mask, past_key_values=PagedCache(model, 2, 128))``.
    Greedy tokens equal SDPA's. ``cache.pager`` is the pager (its sessions are the rows).

    ``fidelity``: ``True`` or a dict of :class:`kvops.runtime.Fidelity` options (``codec``,
    ``min_batch``, ``protect_first``, ``protect_recent``, ``reserve_decay``, ``headroom``,
    ``max_promote``, ``host_pairs``) attaches ElasticKV's policy (float16 or bfloat16 models):
    :meth:`demote` and :meth:`promote` between steps, ``cache.fidelity`` the policy.
    """

    def __init__(self, model_or_config, batch_size: int, max_tokens: int, *, page_size: int = 16,
                 num_pages: int | None = None, fidelity: bool | dict | None = None, dtype=None,
                 device=None):
        for name, v in (("batch_size", batch_size), ("max_tokens", max_tokens),
                        ("page_size", page_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        fidelity = _fidelity_options(fidelity)
        geo = geometry(model_or_config, dtype, device)
        if fidelity is not None and geo.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"fidelity: BASE codecs need a float16 or bfloat16 cache, got "
                             f"{geo.dtype} (the model's dtype, or dtype=)")
        blocks = math.ceil(max_tokens / page_size)
        spare = 0 if fidelity is None else 1      # a promotion holds two pages, frees one
        least = batch_size * blocks + spare
        if num_pages is None:
            num_pages = least
        if not isinstance(num_pages, int) or num_pages < least:
            why = "; promotion needs a spare page" if spare else ""
            raise ValueError(f"num_pages: expected an int >= batch_size * ceil(max_tokens / "
                             f"page_size){' + 1' if spare else ''} = {least} (every row reserves "
                             f"its max_tokens at the prompt{why}), got {num_pages!r}")
        # every layer's K and V in an allocation of its own: a compiled step whose mutated
        # inputs share storage is rebuilt by AOTAutograd from a synthetic base (an as_strided
        # clone of the whole allocation a step), which read out of bounds under inductor on
        # CUDA (bench/results/2026-12-02-transformers-paged-compile.md)
        pools = [torch.zeros((num_pages, page_size, geo.num_kv_heads, geo.head_dim),
                             dtype=geo.dtype, device=geo.device) for _ in range(2 * geo.num_layers)]
        self.state = PagedState(batch_size, max_tokens, page_size, num_pages, geo.device, pools,
                                fidelity)
        layers = [PagedLayer(batch_size, geo, self.state, pools[2 * n], pools[2 * n + 1])
                  for n in range(geo.num_layers)]
        self.state.first = layers[0]
        super().__init__(layers=layers)

    @property
    def pager(self) -> Pager:
        return self.state.pager

    @property
    def fidelity(self) -> Fidelity | None:
        """The attached :class:`kvops.runtime.Fidelity` (None without ``fidelity=``)."""
        return self.state.fidelity

    def demote(self, pages: int | None = None, *, budget: int | None = None) -> int:
        """Demote TARGET pairs to BASE (ElasticKV), between steps: free ``pages`` pool pages,
        or as many as bring the pages in use down to ``budget``. Each pair frees one page; at
        least the policy's ``min_batch`` pairs go when that many are eligible, and only whole
        pairs of blocks a row has fully written, past ``protect_first`` and before its last
        ``protect_recent``. Returns the pairs demoted (0 when none is eligible)."""
        if self.fidelity is None:
            raise ValueError("demote: this PagedCache has no fidelity policy; build it with "
                             "fidelity=True (or a dict of Fidelity options)")
        if (pages is None) == (budget is None):
            raise ValueError(f"demote: expected one of pages= and budget=, got pages={pages!r}, "
                             f"budget={budget!r}")
        if pages is None:
            if not isinstance(budget, int) or budget < 0:
                raise ValueError(f"budget: expected an int >= 0 (pool pages), got {budget!r}")
            pages = self.pager.num_pages - self.pager.free_pages - budget
        elif not isinstance(pages, int) or pages < 1:
            raise ValueError(f"pages: expected an int >= 1, got {pages!r}")
        return self.state.demote(pages)

    def promote(self) -> int:
        """Refine every BASE pair back to TARGET, bit for bit (between steps); returns the
        pairs promoted."""
        if self.fidelity is None:
            raise ValueError("promote: this PagedCache has no fidelity policy; build it with "
                             "fidelity=True (or a dict of Fidelity options)")
        return self.state.promote_all()

    def reset(self) -> None:
        """End every row's session (their pages go back) and clear the lengths."""
        self.state.end()


def _fidelity_options(fidelity) -> dict | None:
    if fidelity is None or fidelity is False:
        return None
    if fidelity is True:
        return {}
    if not isinstance(fidelity, dict):
        raise ValueError(f"fidelity: expected None, True or a dict of Fidelity options, got "
                         f"{type(fidelity).__name__}")
    unknown = sorted(set(fidelity) - set(FIDELITY_OPTIONS))
    if unknown:
        raise ValueError(f"fidelity: unknown option {unknown[0]!r}; expected some of "
                         f"{', '.join(FIDELITY_OPTIONS)}")
    return dict(fidelity)
