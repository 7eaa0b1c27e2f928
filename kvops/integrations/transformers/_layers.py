"""What the kvops cache layers share: geometry from a model or config, the transformers
``CacheLayerMixin`` plumbing, the step handed to the attention call, static addresses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from kvops.integrations.transformers.attention import KVStep


@dataclass(frozen=True)
class Geometry:
    """Per-layer KV geometry: layers, KV heads, head dim, dtype, device."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


def geometry(model_or_config, dtype=None, device=None) -> Geometry:
    """Read the geometry from a transformers model (dtype and device from its weights) or a
    config (then dtype defaults to the config's, device to the CPU)."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not isinstance(getattr(config, name, None), int):
            raise TypeError(f"model_or_config: expected a transformers model or config with an "
                            f"int {name}, got {type(model_or_config).__name__}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if model_or_config is not config and hasattr(model_or_config, "parameters"):
        p = next(model_or_config.parameters())
        dtype = p.dtype if dtype is None else dtype
        device = p.device if device is None else device
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    return Geometry(config.num_hidden_layers, kv_heads, head_dim, dtype,
                    torch.device("cpu" if device is None else device))


class StepState:
    """Per-step state that every layer of one cache shares (the first layer updates it):
    ``pos``, the cache position, and whatever the cache type adds."""

    def __init__(self, batch_size: int, device: torch.device):
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.rows = torch.arange(batch_size, device=device)
        self.first = None
        self.filled = False


def static(*tensors: torch.Tensor) -> None:
    """Mark cache-owned tensors as static addresses (CUDA-graph replays read them in place)."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


class KvopsLayer(CacheLayerMixin):
    """Base of the kvops cache layers. ``update`` hands the new K/V to the attention call
    (:class:`KVStep`), which writes and attends: only it sees the padding mask."""

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, batch_size: int, geo: Geometry, state):
        super().__init__()
        self.batch_size = batch_size
        self.geo = geo
        self.device = geo.device
        self.state = state
        # tokens each row has passed through the model, pads included (generate's cache
        # position): one device scalar shared by the cache's layers
        self.pos = state.pos
        self.is_initialized = True

    @property
    def first(self) -> bool:
        """The cache's first layer, which does a step's bookkeeping for all of them."""
        return self is self.state.first

    def lazy_initialization(self, key_states, value_states) -> None:
        """Storage is allocated at construction; nothing to do."""

    def check_step(self, key_states: torch.Tensor) -> None:
        B, H, D = self.batch_size, self.geo.num_kv_heads, self.geo.head_dim
        if (key_states.dim() != 4 or key_states.shape[0] != B or key_states.shape[1] != H
                or key_states.shape[3] != D):
            raise ValueError(f"key_states: expected shape [B={B}, Hkv={H}, T, D={D}] (the cache's "
                             f"geometry), got {tuple(key_states.shape)}")
        if key_states.dtype != self.geo.dtype:
            raise TypeError(f"key_states: expected {self.geo.dtype} (the cache's dtype), got "
                            f"{key_states.dtype}")

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[KVStep, KVStep]:
        self.check_step(key_states)
        step = KVStep(self, key_states, value_states)
        return step, step

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The new tokens only: the layer knows what each sequence sees (attention.kvops_mask)."""
        return query_length, 0

    def get_seq_length(self) -> torch.Tensor:
        """Tokens seen per row, as a device scalar (a Python int would recompile every step)."""
        return self.pos

    def offload(self):
        raise NotImplementedError("kvops cache layers are not offloaded")

    def prefetch(self):
        raise NotImplementedError("kvops cache layers are not offloaded")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("kvops caches do not support beam search (greedy and sampling)")
