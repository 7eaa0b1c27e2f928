"""The KV-RM configurations of one engine (the paper's Table 5 and its dynamic baseline), and
how one KV budget in bytes becomes each configuration's KV manager.

- ``static``: a worst-case arena row per request (``max_context`` tokens); decode with
  ``static_sliding_attention`` over the row; no pager, no transport.
- ``pager``: pager pages plus window arenas; decode with ``static_sliding_attention`` over the
  window; every page move its own copy (no merging), tail pages copied each step.
- ``pager+merge``: the same with merged trains (up to 128 KiB) and write-through, so only
  arrivals, aliases and copy-on-write remaps move.
- ``kvrm``: ``pager+merge`` plus the far view (summaries of far chunks in the far slots), whose
  summarized far blocks go back to the pool (the bounded budget).
- ``kvrm-ret``: ``pager+merge`` plus the retrieval far view (the ``ret_top_k`` far pages each
  layer's query chooses, exact, in the far slots; chosen at a request's first decode step and
  every ``ret_every`` steps); its far blocks stay mapped (a budget as ``pager+merge``'s).
- ``paged``: pager pages only; decode with ``elastic_attention``'s native path over block
  tables (a vLLM-style paged runtime, preemption by recompute).
- ``elastic``: ``paged`` with ElasticKV's Fidelity policy over every layer's K and V pool:
  demotion to BASE on shortage before any preemption, promotion back when pages are spare,
  decode through ``elastic_attention``'s span path (float16 or bfloat16 KV; no prefix sharing).
- ``elastic-watermark``, ``elastic-eager-promote``, ``elastic-no-promote``,
  ``elastic-general``: ElasticKV's ablations (its Table 3), ``elastic`` with one mechanism
  changed (:data:`kvops.engine.elastic_kv.ABLATIONS`).
- ``offload``: ``paged`` whose preemption swaps the request's K/V to host memory and back
  (ElasticKV's Exact-offload baseline).
- ``reserve``: ``paged`` with worst-case reservation (prompt + every output) at admission;
  it never preempts.

Every configuration gets the same byte budget: ``static`` divides it into rows of
``max_context`` tokens (so it binds first), the arena configurations spend ``max_seqs x
window`` tokens of it on the arenas and the rest on pages; ``paged``, ``elastic``,
``offload`` and ``reserve`` spend it all on pages (``elastic``'s BASE backings live in host
memory, as ``offload``'s swapped K/V does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvops.engine.elastic_kv import ELASTIC_CONFIGS, ElasticKV, elastic_arguments
from kvops.engine.kv import PagedKV, StaticKV
from kvops.engine.offload_kv import OffloadKV
from kvops.engine.reserve_kv import ReserveKV

CONFIGS = ("static", "pager", "pager+merge", "kvrm", "kvrm-ret", "paged", *ELASTIC_CONFIGS,
           "offload", "reserve")
PAGES_ONLY = {"paged": PagedKV, **dict.fromkeys(ELASTIC_CONFIGS, ElasticKV), "offload": OffloadKV,
              "reserve": ReserveKV}


def is_elastic(name: str) -> bool:
    """``elastic`` or one of its ablations."""
    return name in ELASTIC_CONFIGS


@dataclass
class KVBudget:
    bytes: int              # K and V, every layer
    max_seqs: int           # slots of the pager's tables (and window arenas)
    max_context: int        # tokens: a static row, the pager's block-table length
    window: int = 1024      # W of the arena configurations
    page_size: int = 16
    far_chunk: int = 128    # kvrm: tokens per far chunk
    far_cap: int = 16       # kvrm: far slots per session
    far_rerank: int = 8     # kvrm: decode steps between utility pulls (the host's re-ranking)
    ret_top_k: int = 64     # kvrm-ret: exact far pages per session and layer
    ret_every: int = 16     # kvrm-ret: decode steps between choices (docs/far_view.md)


def make_kv(name: str, budget: KVBudget, model_cfg, dtype: torch.dtype, device: torch.device,
            prefix_sharing: bool = True, fidelity: dict | None = None):
    """The KV manager of configuration ``name`` on ``budget``; ``fidelity``: keyword arguments
    of ``elastic``'s (and its ablations') :class:`~kvops.runtime.Fidelity` (and ``demote``)."""
    if name not in CONFIGS:
        raise ValueError(f"config: expected one of {', '.join(CONFIGS)}, got {name!r}")
    S = budget.page_size
    tok = 2 * model_cfg.n_layers * model_cfg.n_kv_heads * model_cfg.head_dim \
        * torch.empty(0, dtype=dtype).element_size()
    geo = dict(layers=model_cfg.n_layers, kv_heads=model_cfg.n_kv_heads,
               head_dim=model_cfg.head_dim, dtype=dtype, device=device)
    max_context = -(-budget.max_context // S) * S
    if name == "static":
        slots = min(budget.bytes // (max_context * tok), budget.max_seqs)
        if slots < 1:
            raise ValueError(f"budget: {budget.bytes} bytes hold no static row of {max_context} "
                             f"tokens ({max_context * tok} bytes)")
        return StaticKV(slots=slots, slot_tokens=max_context, page_size=S, **geo)
    window = min(-(-budget.window // S) * S, max_context) if name not in PAGES_ONLY else 0
    arena = budget.max_seqs * window * tok
    pages = (budget.bytes - arena) // (S * tok)
    if pages < 1:
        raise ValueError(f"budget: {budget.bytes} bytes leave no pages after the window arenas "
                         f"({arena} bytes for {budget.max_seqs} x {window} tokens)")
    kw = dict(num_pages=int(pages), page_size=S, max_sessions=budget.max_seqs,
              max_blocks=max_context // S, prefix_sharing=prefix_sharing, **geo)
    if fidelity is not None and not is_elastic(name):
        raise ValueError(f"fidelity: only the elastic configurations take it, got config {name!r}")
    if is_elastic(name):
        return ElasticKV(**elastic_arguments(name, fidelity), **kw)
    if name in PAGES_ONLY:
        return PAGES_ONLY[name](**kw)
    page_bytes = S * model_cfg.n_kv_heads * model_cfg.head_dim * torch.empty(0, dtype=dtype).element_size()
    if name == "pager":
        return PagedKV(window=window, max_train_bytes=page_bytes, copy_tail=True, **kw)
    far = retrieval = None
    if name == "kvrm":
        far = {"chunk_tokens": min(budget.far_chunk, window), "cap": budget.far_cap,
               "rerank_every": budget.far_rerank}
    if name == "kvrm-ret":
        retrieval = {"top_k": budget.ret_top_k, "select_every": budget.ret_every}
    return PagedKV(window=window, max_train_bytes=131072, copy_tail=False, far=far,
                   retrieval=retrieval, **kw)


def decode_kind(name: str) -> str:
    if is_elastic(name):
        return "elastic"
    return {"static": "static", "paged": "paged", "offload": "paged", "reserve": "paged"
            }.get(name, "arena")
