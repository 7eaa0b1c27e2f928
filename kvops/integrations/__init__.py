"""Integrations of kvops with other libraries, each imported on demand (kvops never imports them).

- :mod:`kvops.integrations.transformers`: ``attn_implementation="kvops"`` and kvops caches for
  ``model.generate`` (docs/transformers.md).
"""
