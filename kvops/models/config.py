"""Model geometry: :class:`LlamaConfig` and the SmolLM2-135M numbers (so a GPU check can build a
random-weights model of the same shape without the GGUF file)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes of a Llama decoder. ``head_dim`` is ``D``, ``n_heads`` is ``Hq``, ``n_kv_heads`` is
    ``Hkv`` in the contract's letters; ``max_seq_len`` bounds absolute RoPE positions."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    max_seq_len: int = 8192
    bos_id: int = 1
    eos_id: int = 2
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads: expected a multiple of n_kv_heads={self.n_kv_heads}, "
                             f"got {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even number (RoPE pairs), got {self.head_dim}")


# SmolLM2-135M(-Instruct), as its GGUF metadata states it.
SMOLLM2_135M = LlamaConfig(
    vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
    hidden_dim=1536, norm_eps=9.999999747378752e-06, rope_base=100000.0, max_seq_len=8192,
    bos_id=1, eos_id=2, tie_embeddings=True,
)
