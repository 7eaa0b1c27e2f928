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

    def __init__(self, batch_size: int, window: int, device: torch.device):
        super().__init__(batch_size, device)
        self.window = window
        self.start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.slot = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.win_start = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.win_len = torch.zeros(batch_size, dtype=torch.int32, device=device)
        static(self.pos, self.start, self.slot, self.win_start, self.win_len)

    def advance(self) -> None:
        """A decode step: the new token's slot, then each row's window including it."""
        W = self.window
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
            st.filled = True
        return out, None

    def _decode(self, query, key, value, scaling, sliding_window):
        st, W = self.state, self.window
        if self.first:
            st.advance()
        self.keys.index_put_((st.rows, st.slot), key[:, :, 0])
        self.values.index_put_((st.rows, st.slot), value[:, :, 0])
        win_start, win_len = st.win_start, st.win_len
        if sliding_window is not None and sliding_window < W:     # this layer sees fewer
            win_len = win_len.clamp(max=int(sliding_window))
            win_start = ((st.pos - win_len) % W).to(torch.int32)
        out, _ = torch.ops.kvops.static_sliding_attention(
            query[:, :, 0], self.keys, self.values, win_start, win_len, scale=scaling)
        return out.unsqueeze(1), None


class SlidingCache(Cache):
    """A transformers ``Cache`` of :class:`SlidingLayer` s: ring windows of ``window`` tokens.

    ``SlidingCache(model, batch_size, window)`` takes the layer count, KV heads, head dim, dtype
    and device from ``model`` (or pass a config and ``dtype=``/``device=``). Use it with a model
    loaded with ``attn_implementation="kvops"``:
    ``model.generate(ids, attention_mask=mask, past_key_values=SlidingCache(model, 2, 512))``.
    Greedy tokens equal SDPA's while the window holds the whole context (prompt plus new tokens);
    beyond it each row attends to its last ``window`` tokens.
    """

    def __init__(self, model_or_config, batch_size: int, window: int, *, dtype=None, device=None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window: expected an int >= 1, got {window!r}")
        geo = geometry(model_or_config, dtype, device)
        self.window = window
        self.state = RingState(batch_size, window, geo.device)
        layers = [SlidingLayer(batch_size, window, geo, self.state) for _ in range(geo.num_layers)]
        self.state.first = layers[0]
        super().__init__(layers=layers)
