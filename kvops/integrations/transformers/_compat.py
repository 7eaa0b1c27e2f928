"""The transformers versions this integration supports, and the one API difference it handles.

Supported: transformers >= 5.17, < 5.25 (tested on 5.17 and 5.24; pyproject's ``hf`` extra). Between
them the attention modules of the Llama family call ``cache.update(k, v, layer_idx)`` (5.17) or
``cache.update(k, v, layer_idx, kwargs=kwargs)`` (5.24), and name the cache argument
``past_key_values`` (5.17) or ``cache`` (5.24, which still accepts ``past_key_values`` with a
deprecation warning). kvops layers take any trailing arguments to ``update`` and ignore them, so
both calls reach the same code; ``generate(..., past_key_values=cache)`` works on both.
"""

from __future__ import annotations

import transformers

MIN_VERSION = (5, 17)
MAX_VERSION = (5, 25)  # exclusive


def _parse(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def check_version(version: str | None = None) -> tuple[int, int]:
    """Raise ImportError unless ``version`` (default: the installed transformers) is supported."""
    version = transformers.__version__ if version is None else version
    got = _parse(version)
    if not MIN_VERSION <= got < MAX_VERSION:
        raise ImportError(
            f"kvops.integrations.transformers: expected transformers >= "
            f"{'.'.join(map(str, MIN_VERSION))}, < {'.'.join(map(str, MAX_VERSION))}, got {version} "
            f"(install kvops[hf])")
    return got
