"""``SlidingCache``: KV-RM's fixed ring window per layer, decoded by ``static_sliding_attention``.

Each layer owns ``keys``, ``values`` ``[B, W, Hkv, D]`` (the contract's NHD window, allocated once:
static addresses). The layers share the device scalar ``pos`` (tokens each row has passed, pads
included), ``start`` int64 ``[B]`` (each row's leading padding) and the step's ``slot``,
``win_start``, ``win_len``, which the first layer computes once a step. The token at cache
position ``p`` lives in slot ``p % W``. A decode step writes its token at slot ``pos % W`` and
then every row sees its last ``min(pos + 1 - start, W)`` tokens (fewer in a layer with a
shorter ``sliding_window``, e.g. Mistral's) from ``win_start = (pos + 1 - win_len) % W``:
lengths computed on the device, one shape for every step, so a compiled step never recompiles
and replays in a CUDA graph.

The prompt (``T > 1`` new tokens, onto an empty cache) runs transformers' SDPA with its own mask
and writes its last ``min(T, W)`` keys and values into the ring; the mask gives ``start``. Keys
carry RoPE at their absolute positions, so a ring that wraps slides correctly (docs/models.md).
A second prompt onto a filled cache (chat continuation) is not supported: ``reset()`` first.

Far view (``far_chunks = C > 0``): KV-RM's far slots in the same launch. The token a decode
step overwrites (cache position ``pos - W``) joins far chunk ``g = (pos - W) // chunk_size``,
kept in slot ``g % C`` as float32 sums (restarted at the chunk's first token, which drops the
chunk C before it); the slot holds their mean K and V and ``far_bias = log(count)`` (``-inf``
empty). A prompt longer than W puts its first ``T - W`` tokens' last C chunks there. Padding
is never counted. The chunks are the most recent C (recency), not FarView's utility-ranked
selection over the pager. A layer whose own ``sliding_window`` is shorter than W keeps none.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvops  # noqa: F401  (registers torch.ops.kvops.*)
from kvops.integrations.transformers._layers import (
    Geometry,
    KvopsLayer,
    StepState,
    geometry,
    static,
)
from kvops.integrations.transformers.attention import padding_start


class RingState(StepState):
    """What the layers of one SlidingCache share; the first layer updates it each step."""

    def __init__(self, batch_size: int, window: int, device: torch.device, far_chunks: int = 0,
                 far_chunk_size: int = 64):
        super().__init__(batch_size, device)
        self.window = window
        self.start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.slot = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.win_start = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.win_len = torch.zeros(batch_size, dtype=torch.int32, device=device)
        static(self.pos, self.start, self.slot, self.win_start, self.win_len)
        self.far_chunks, self.far_chunk_size = far_chunks, far_chunk_size
        if far_chunks:
            C = far_chunks
            self.far_count = torch.zeros(batch_size, C, dtype=torch.float32, device=device)
            self.far_bias = torch.full((batch_size, C), float("-inf"), device=device)
            self.far_c = torch.zeros(1, dtype=torch.long, device=device)
            self.far_new = torch.zeros((), dtype=torch.bool, device=device)
            self.far_real = torch.zeros(batch_size, dtype=torch.bool, device=device)
            static(self.far_count, self.far_bias, self.far_c, self.far_new, self.far_real)

    def far_reset(self) -> None:
        if self.far_chunks:
            self.far_count.zero_()
            self.far_bias.fill_(float("-inf"))

    def far_prompt(self, T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The prompt's tokens that never enter the ring (``T > W``): ``(chunk slot [E],
        weight float32 [B, E])`` of each, 0 for padding and for chunks older than the last C;
        sets the counts and biases. None when nothing is evicted."""
        self.far_reset()
        E = T - self.window
        if not self.far_chunks or E <= 0:
            return None
        p = torch.arange(E, device=self.pos.device)
        g = p // self.far_chunk_size
        recent = g > (E - 1) // self.far_chunk_size - self.far_chunks
        weight = ((p[None, :] >= self.start[:, None]) & recent[None, :]).float()
        c = g % self.far_chunks
        self.far_count.index_add_(1, c, weight)
        self._far_bias()
        return c, weight

    def _far_bias(self) -> None:
        self.far_bias.copy_(torch.where(self.far_count > 0, self.far_count.log(),
                                        float("-inf")))

    def _far_advance(self) -> None:
        """The token about to be overwritten (cache position ``pos - W``) joins far chunk
        ``(pos - W) // chunk_size`` in slot ``chunk % C``, which restarts at a chunk's first
        token (dropping the chunk C before it)."""
        e = self.pos - self.window
        self.far_c.copy_((e // self.far_chunk_size) % self.far_chunks)
        self.far_new.copy_(e % self.far_chunk_size == 0)
        self.far_real.copy_((e >= 0) & (e >= self.start))
        count = self.far_count.index_select(1, self.far_c)[:, 0]
        count = torch.where(self.far_new, 0.0, count) + self.far_real.float()
        self.far_count.index_copy_(1, self.far_c, count[:, None])
        self._far_bias()

    def advance(self) -> None:
        """A decode step: the new token's slot, then each row's window including it."""
        W = self.window
        if self.far_chunks:
            self._far_advance()
        self.slot.copy_((self.pos % W).expand_as(self.slot))
        self.pos.add_(1)
        win_len = (self.pos - self.start).clamp(0, W)
        self.win_len.copy_(win_len)
        self.win_start.copy_((self.pos - win_len) % W)


class SlidingLayer(KvopsLayer):
    """One layer's ring window; see the module doc."""

    def __init__(self, batch_size: int, window: int, geo: Geometry, state: RingState):
        super().__init__(batch_size, geo, state)
        self.window = window
        shape = (batch_size, window, geo.num_kv_heads, geo.head_dim)
        self.keys = torch.zeros(shape, dtype=geo.dtype, device=geo.device)
        self.values = torch.zeros(shape, dtype=geo.dtype, device=geo.device)
        static(self.keys, self.values)
        if state.far_chunks:
            far = (batch_size, state.far_chunks, geo.num_kv_heads, geo.head_dim)
            self.far_ksum = torch.zeros(far, dtype=torch.float32, device=geo.device)
            self.far_vsum = torch.zeros(far, dtype=torch.float32, device=geo.device)
            self.far_k = torch.zeros(far, dtype=geo.dtype, device=geo.device)
            self.far_v = torch.zeros(far, dtype=geo.dtype, device=geo.device)
            static(self.far_ksum, self.far_vsum, self.far_k, self.far_v)

    def _far_for(self, sliding_window) -> bool:
        """Whether this layer keeps a far view: the cache has one and the layer's own
        sliding_window (if any) does not cut the ring shorter."""
        return bool(self.state.far_chunks) and (sliding_window is None
                                                or sliding_window >= self.window)

    def _far_store(self, chunk: torch.Tensor) -> None:
        count = self.state.far_count.index_select(1, chunk).clamp(min=1)[..., None, None]
        for s_, out in ((self.far_ksum, self.far_k), (self.far_vsum, self.far_v)):
            out.index_copy_(1, chunk, (s_.index_select(1, chunk) / count).to(out.dtype))

    @property
    def start(self) -> torch.Tensor:
        return self.state.start

    @property
    def filled(self) -> bool:
        return self.state.filled

    def get_max_length(self) -> int:
        return -1  # the ring slides: any length, the last W tokens visible

    def reset(self) -> None:
        # slots outside a row's window are never read, so the storage is not cleared
        if self.first:
            self.state.pos.zero_()
            self.state.start.zero_()
            self.state.far_reset()
            self.state.filled = False

    def attend(self, module, query, key, value, mask, *, scaling=None, sliding_window=None,
               **kwargs):
        T = query.shape[2]
        if T == 1:
            return self._decode(query, key, value, scaling, sliding_window)
        st = self.state
        if st.filled and self.first:
            raise NotImplementedError(
                f"SlidingCache: a {T}-token step onto a filled cache (a second prompt) is not "
                f"supported; call cache.reset() before the next prompt")
        out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling,
                                        sliding_window=sliding_window, **kwargs)
        W = self.window
        n = min(T, W)
        slots = torch.arange(T - n, T, device=self.device) % W
        self.keys.index_copy_(1, slots, key[:, :, T - n:].transpose(1, 2))
        self.values.index_copy_(1, slots, value[:, :, T - n:].transpose(1, 2))
        if self.first:
            st.pos.fill_(T)
            st.start.copy_(padding_start(mask, self.batch_size, T, self.device))
            st.far_evicted = st.far_prompt(T)
            st.filled = True
        if self._far_for(sliding_window):
            self.far_ksum.zero_()
            self.far_vsum.zero_()
            if st.far_evicted is not None:
                chunk, weight = st.far_evicted
                E = weight.shape[1]
                for s_, x in ((self.far_ksum, key), (self.far_vsum, value)):
                    s_.index_add_(1, chunk, x[:, :, :E].transpose(1, 2).float()
                                  * weight[..., None, None])
            self._far_store(torch.arange(st.far_chunks, device=self.device))
        return out, None

    def _decode(self, query, key, value, scaling, sliding_window):
        st, W = self.state, self.window
        if self.first:
            st.advance()
        far = self._far_for(sliding_window)
        if far:       # the token leaving the ring joins its far chunk before it is overwritten
            new, real = st.far_new, st.far_real.float()[:, None, None]
            for s_, ring in ((self.far_ksum, self.keys), (self.far_vsum, self.values)):
                old = ring[st.rows, st.slot].float()
                s_.index_copy_(1, st.far_c, (torch.where(new, 0.0, s_.index_select(
                    1, st.far_c)[:, 0]) + old * real)[:, None])
            self._far_store(st.far_c)
        self.keys.index_put_((st.rows, st.slot), key[:, :, 0])
        self.values.index_put_((st.rows, st.slot), value[:, :, 0])
        win_start, win_len = st.win_start, st.win_len
        if sliding_window is not None and sliding_window < W:     # this layer sees fewer
            win_len = win_len.clamp(max=int(sliding_window))
            win_start = ((st.pos - win_len) % W).to(torch.int32)
        far_args = (self.far_k, self.far_v, st.far_bias) if far else (None, None, None)
        out, _ = torch.ops.kvops.static_sliding_attention(
            query[:, :, 0], self.keys, self.values, win_start, win_len, *far_args, scale=scaling)
        return out.unsqueeze(1), None


class SlidingCache(Cache):
    """A transformers ``Cache`` of :class:`SlidingLayer` s: ring windows of ``window`` tokens.

    ``SlidingCache(model, batch_size, window)`` takes the layer count, KV heads, head dim, dtype
    and device from ``model`` (or pass a config and ``dtype=``/``device=``). Use it with a model
    loaded with ``attn_implementation="kvops"``:
    ``model.generate(ids, attention_mask=mask, past_key_values=SlidingCache(model, 2, 512))``.
    Greedy tokens equal SDPA's while the window holds the whole context (prompt plus new tokens);
    beyond it each row attends to its last ``window`` tokens, and with ``far_chunks = C > 0`` also
    to C far slots: the mean K and V of each of the last C chunks of ``far_chunk_size`` tokens
    that left the ring, weighted by their token count (``far_bias = log(count)``).
    """

    def __init__(self, model_or_config, batch_size: int, window: int, *, far_chunks: int = 0,
                 far_chunk_size: int = 64, dtype=None, device=None):
        for name, v, low in (("batch_size", batch_size, 1), ("window", window, 1),
                             ("far_chunks", far_chunks, 0), ("far_chunk_size", far_chunk_size, 1)):
            if not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {v!r}")
        geo = geometry(model_or_config, dtype, device)
        self.window = window
        self.state = RingState(batch_size, window, geo.device, far_chunks, far_chunk_size)
        layers = [SlidingLayer(batch_size, window, geo, self.state) for _ in range(geo.num_layers)]
        self.state.first = layers[0]
        super().__init__(layers=layers)
