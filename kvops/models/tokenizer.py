"""SmolLM2's tokenizer rebuilt offline from the vocabulary and merges stored in its GGUF file.

The GGUF says ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE) and ``pre = "smollm"``, whose
pre-tokenization (llama.cpp's) splits every digit on its own and then applies the GPT-2
regex; that is ``Digits(individual_digits=True)`` followed by ``ByteLevel`` in the
``tokenizers`` package. Tokens of type 3 (control: ``<|im_start|>``, ``<|endoftext|>``...) are
special: matched whole in the text, dropped by ``decode(skip_special=True)``.
"""

from __future__ import annotations

from pathlib import Path

from kvops.models.gguf import INSTALL_HINT, ModelUnavailable, tokenizer_spec

CONTROL = 3


class Tokenizer:
    """``encode(text) -> list[int]``, ``decode(ids) -> str``; ``bos_id``, ``eos_id``."""

    def __init__(self, spec: dict):
        try:
            from tokenizers import Tokenizer as _Tok
            from tokenizers import decoders, models, pre_tokenizers
        except ImportError as exc:
            raise ModelUnavailable(f"the tokenizer needs the PyPI package 'tokenizers': "
                                   f"{INSTALL_HINT}") from exc
        if spec["model"] != "gpt2":
            raise ValueError(f"tokenizer.ggml.model: expected 'gpt2' (byte-level BPE), "
                             f"got {spec['model']!r}")
        vocab = {tok: i for i, tok in enumerate(spec["tokens"])}
        merges = [tuple(m.split(" ", 1)) for m in spec["merges"]]
        tok = _Tok(models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([t for t, kind in zip(spec["tokens"], spec["token_type"])
                                if kind == CONTROL])
        self._tok = tok
        self.bos_id, self.eos_id = spec["bos_id"], spec["eos_id"]
        self.vocab_size = len(spec["tokens"])

    @classmethod
    def from_gguf(cls, path: Path | None = None) -> Tokenizer:
        return cls(tokenizer_spec(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """SmolLM2-Instruct's chat format (the GGUF's template) for one user turn."""
        system = system or "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        return (f"<|im_start|>system\n{system}<|im_end|>\n"
                f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
