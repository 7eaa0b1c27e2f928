"""The Llama forward over a paged KV pool, for serving engines: packed tokens of many
sequences, K/V written into pool slots, attention through a callable per layer.

:func:`forward_packed` runs the layers over ``N`` packed tokens at given positions; each
layer's attention is ``attend(layer, q, k, v) -> out`` (``q [N, Hq, D]``, ``k, v [N, Hkv, D]``
after RoPE), which the caller builds from kvops ops: write ``k, v`` with
``paged_kv_write`` and read with ``paged_prefill_attention`` (prefill chunks), or a decode
op (``elastic_attention``, ``static_sliding_attention``). :func:`random_llama` builds a
random-weight model of any Llama shape directly on its device (as vLLM's dummy weights), and
:data:`LLAMA3_8B` is Llama-3-8B's shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

import kvops.ops  # noqa: F401  (registers torch.ops.kvops.*)
from kvops.models.config import LlamaConfig
from kvops.models.llama import Llama, apply_rope, rope_table

LLAMA3_8B = LlamaConfig(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
    hidden_dim=14336, norm_eps=1e-5, rope_base=500000.0, max_seq_len=8192, bos_id=128000,
    eos_id=128001, tie_embeddings=False,
)
"""Llama-3-8B's layers, widths and heads (random weights: systems runs, not text)."""


def random_llama(cfg: LlamaConfig, *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", seed: int = 0, std: float = 0.02) -> Llama:
    """A model of shape ``cfg`` with normal(0, ``std``) weights drawn on ``device`` (no host
    copy: an 8B model initializes in seconds on a GPU), unit norms."""
    with torch.device("meta"):
        model = Llama(cfg)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope_cos, model.rope_sin = (t.to(device) for t in rope_table(cfg))
    return model.eval().requires_grad_(False)


Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def forward_packed(model: Llama, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
    """Final-norm hidden states ``[N, dim]`` of ``tokens [N]`` at ``positions [N]`` (int64),
    attention by ``attend(layer, q, k, v)`` returning ``[N, Hq, D]``. No host sync: with
    fixed-shape inputs and an ``attend`` that is, the call replays in a CUDA graph."""
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    x = model.tok_embeddings(tokens)
    for i, block in enumerate(model.layers):
        att = block.attention
        h = block.attention_norm(x)
        q, k, v = att.wqkv(h).split(att.split, dim=-1)
        q = apply_rope(q.unflatten(-1, (att.n_heads, att.head_dim)), cos, sin)
        k = apply_rope(k.unflatten(-1, (att.n_kv_heads, att.head_dim)), cos, sin)
        v = v.unflatten(-1, (att.n_kv_heads, att.head_dim))
        x = x + att.wo(attend(i, q, k, v).flatten(-2))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.norm(x)


def logits(model: Llama, hidden: Tensor) -> Tensor:
    """Logits float32 ``[M, V]`` of hidden states ``[M, dim]``."""
    return model.output(hidden).float()
