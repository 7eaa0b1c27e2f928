"""``PagedCache``: a KV pool per layer mapped by :class:`kvops.runtime.Pager`, written with
``paged_kv_write``, decoded with ``elastic_attention`` (native path: every block TARGET).

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
packed first. Not done here: Fidelity (BASE blocks: no policy is attached, decode runs the
native path), sliding windows (a ``sliding_window`` below ``max_tokens`` raises).
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
from kvops.runtime import Pager


class PagedState(StepState):
    """What the layers of one PagedCache share: the pager, the reservation, the rows' lengths
    and the step's slots; the first layer updates it each step."""

    def __init__(self, batch_size: int, max_tokens: int, page_size: int, num_pages: int,
                 device: torch.device):
        super().__init__(batch_size, device)
        self.max_tokens, self.page_size = max_tokens, page_size
        self.max_blocks = math.ceil(max_tokens / page_size)
        self.pager = Pager(num_pages, page_size, max_sessions=batch_size,
                           max_blocks=self.max_blocks, device=device)
        with self.pager.frame():
            pass                                  # freezes the tables: device views exist now
        self.block_table = self.pager.device_tables["block_table"]
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

    def __init__(self, batch_size: int, geo: Geometry, state: PagedState, num_pages: int):
        super().__init__(batch_size, geo, state)
        shape = (num_pages, state.page_size, geo.num_kv_heads, geo.head_dim)
        self.keys = torch.zeros(shape, dtype=geo.dtype, device=geo.device)
        self.values = torch.zeros(shape, dtype=geo.dtype, device=geo.device)
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
        torch.ops.kvops.paged_kv_write(key.transpose(1, 2).reshape(B * T, H, D),
                                       value.transpose(1, 2).reshape(B * T, H, D),
                                       self.keys, self.values, st.chunk_slots)
        Hq = query.shape[1]
        q = query.transpose(1, 2).reshape(B * T, Hq, D)[st.chunk_order]
        out, _ = torch.ops.kvops.paged_prefill_attention(
            q, self.keys, self.values, st.block_table, st.chunk_starts, st.seq_lens,
            scale=scaling)
        full = torch.zeros_like(out).index_copy_(0, st.chunk_order, out)
        return full.view(B, T, Hq, D), None

    def _decode(self, query, key, value, scaling):
        st = self.state
        if self.first:
            st.advance()
        torch.ops.kvops.paged_kv_write(key[:, :, 0], value[:, :, 0], self.keys, self.values,
                                       st.slots)
        out, _ = torch.ops.kvops.elastic_attention(query[:, :, 0], self.keys, self.values,
                                                   st.block_table, st.seq_lens, scale=scaling)
        return out.unsqueeze(1), None


class PagedCache(Cache):
    """A transformers ``Cache`` of :class:`PagedLayer` s over one :class:`kvops.runtime.Pager`.

    ``PagedCache(model, batch_size, max_tokens, page_size=16, num_pages=None)``: ``max_tokens``
    bounds each row's prompt (padding included) plus new tokens; the pool defaults to enough
    pages for every row to reach it. Use with ``attn_implementation="kvops"``:
    ``model.generate(ids, attention_mask=mask, past_key_values=PagedCache(model, 2, 128))``.
    Greedy tokens equal SDPA's. ``cache.pager`` is the pager (its sessions are the rows).
    """

    def __init__(self, model_or_config, batch_size: int, max_tokens: int, *, page_size: int = 16,
                 num_pages: int | None = None, dtype=None, device=None):
        for name, v in (("batch_size", batch_size), ("max_tokens", max_tokens),
                        ("page_size", page_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        geo = geometry(model_or_config, dtype, device)
        blocks = math.ceil(max_tokens / page_size)
        if num_pages is None:
            num_pages = batch_size * blocks
        if not isinstance(num_pages, int) or num_pages < batch_size * blocks:
            raise ValueError(f"num_pages: expected an int >= batch_size * ceil(max_tokens / "
                             f"page_size) = {batch_size * blocks} (every row reserves its "
                             f"max_tokens at the prompt), got {num_pages!r}")
        self.state = PagedState(batch_size, max_tokens, page_size, num_pages, geo.device)
        layers = [PagedLayer(batch_size, geo, self.state, num_pages)
                  for _ in range(geo.num_layers)]
        self.state.first = layers[0]
        super().__init__(layers=layers)

    @property
    def pager(self) -> Pager:
        return self.state.pager

    def reset(self) -> None:
        """End every row's session (their pages go back) and clear the lengths."""
        self.state.end()
