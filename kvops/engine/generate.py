"""Text in, text out through the engine: SmolLM2-135M-Instruct, every prompt a request of
the ``paged`` configuration, greedy or sampled (:mod:`kvops.engine.sampling`), stopping at EOS
(``kvops generate``)."""

from __future__ import annotations

import dataclasses

import torch

from kvops.engine.configs import KVBudget, make_kv
from kvops.engine.engine import Engine
from kvops.engine.request import Request
from kvops.engine.sampling import SamplingParams
from kvops.engine.scheduler import SchedulerConfig


def generate_ids(model, prompts: list[list[int]], max_new_tokens: int, *, eos_id: int | None = None,
                 config: str = "paged", page_size: int = 16, budget_tokens: int | None = None,
                 sched: SchedulerConfig | None = None,
                 sampling: SamplingParams | None = None,
                 budget_options: dict | None = None) -> list[list[int]]:
    """Continuations of token-id ``prompts`` served together by the engine (stopping after
    ``eos_id`` when given): greedy, or drawn by ``sampling``, prompt ``i`` with seed
    ``sampling.seed + i`` (a seed from its request id when ``sampling.seed`` is None).
    ``budget_options``: other :class:`~kvops.engine.configs.KVBudget` fields, such as the arena
    configurations' ``window`` (the whole context by default) or ``kvrm-ret``'s ``ret_top_k``
    and ``ret_every``."""
    from kvops.engine.configs import decode_kind

    dev = model.output.weight.device
    dtype = model.output.weight.dtype
    ctx = max(len(p) for p in prompts) + max_new_tokens
    ctx = -(-ctx // page_size) * page_size
    n = len(prompts)
    c = model.cfg
    tok = 2 * c.n_layers * c.n_kv_heads * c.head_dim * torch.empty(0, dtype=dtype).element_size()
    tokens = budget_tokens or n * ctx * 2
    budget = KVBudget(bytes=tokens * tok, max_seqs=n, max_context=ctx,
                      **{"window": ctx, "page_size": page_size, **(budget_options or {})})
    kv = make_kv(config, budget, c, dtype, dev)
    engine = Engine(model, kv, decode_kind(config), sched or SchedulerConfig(max_num_seqs=n))
    reqs = [Request(i, 0.0, list(p), max_new_tokens, ignore_eos=eos_id is None, eos_id=eos_id,
                    sampling=sampling if sampling is None or sampling.seed is None else
                    dataclasses.replace(sampling, seed=sampling.seed + i))
            for i, p in enumerate(prompts)]
    engine.replay(reqs)
    return [r.output for r in reqs]


def generate_texts(prompts: list[str], max_new_tokens: int = 48, *, device: str | None = None,
                   chat: bool = True, sampling: SamplingParams | None = None) -> list[str]:
    from kvops.models import Llama, Tokenizer

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, tok = Llama.from_gguf(dtype=dtype, device=dev), Tokenizer.from_gguf()
    ids = [tok.encode(tok.chat_prompt(p) if chat else p) for p in prompts]
    outs = generate_ids(model, ids, max_new_tokens, eos_id=tok.eos_id, sampling=sampling)
    return [tok.decode(o) for o in outs]
