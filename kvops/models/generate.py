"""Greedy generation through the kvops decode path: the entry point the demo and examples call.

``generate(prompt, max_new_tokens, device)`` loads SmolLM2-135M-Instruct (once per process and
dtype/device), prefills the prompt with standard attention, then decodes one token per step
with :meth:`Llama.decode_step` (``torch.ops.kvops.static_sliding_attention`` over the paged
ring window). On CUDA the step is compiled with ``torch.compile(mode="reduce-overhead",
fullgraph=True)`` (CUDA graphs); on CPU it runs eagerly, since compiling costs more than a
short demo decodes. The loop never syncs with the host per token: it checks for
end-of-sequence every ``sync_every`` steps.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from kvops.models.llama import Llama
from kvops.models.tokenizer import Tokenizer


@dataclass
class Generation:
    """What :func:`generate` returns. Times in seconds; ``decode_tokens_per_s`` counts the timed
    steps only (a compiled step's first, compiling call is left out); ``decode_gbps`` is the
    bytes a step must read (weights and the visible KV) over the measured step time."""

    prompt: str
    text: str
    prompt_tokens: list[int]
    new_tokens: list[int]
    device: str
    dtype: str
    window: int
    prefill_s: float
    decode_s: float
    decode_steps: int
    decode_tokens_per_s: float
    decode_gbps: float
    compiled: bool


@functools.lru_cache(maxsize=2)
def load_model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Llama, Tokenizer]:
    """SmolLM2-135M-Instruct and its tokenizer (cached per device and dtype)."""
    return Llama.from_gguf(dtype=dtype, device=device), Tokenizer.from_gguf()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_decode(model: Llama, prompt_ids: list[int], max_new_tokens: int, *,
                  step=None, eos_id: int | None = None, sync_every: int = 16
                  ) -> tuple[list[int], dict]:
    """Greedy continuation of one prompt on a model whose cache is set up with batch size 1.

    ``step`` is the decode function (default ``model.decode_step``; pass a compiled one).
    Returns the new token ids (stopping after ``eos_id``) and timings: ``prefill_s``,
    ``first_step_s`` (the first decode step, which compiles when ``step`` is compiled),
    ``decode_s`` and ``decode_steps`` (the remaining steps).
    """
    if model.batch_size != 1:
        raise ValueError(f"model: expected a cache set up with batch_size 1, got {model.batch_size}")
    T = len(prompt_ids)
    if T + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len={model.cfg.max_seq_len}")
    step = step or model.decode_step
    device = model.output.weight.device
    out = torch.empty(max_new_tokens, dtype=torch.int64, device=device)
    t0 = time.perf_counter()
    logits = model.prefill(torch.tensor(prompt_ids, device=device), 0)
    tok = logits[-1:].argmax(-1)                            # [1]: the step's token input
    out[0] = tok[0]
    _sync(device)
    t1 = time.perf_counter()
    pos = torch.full((1,), T, dtype=torch.int64, device=device)
    first_step_s, t2, done = 0.0, t1, 1
    for i in range(1, max_new_tokens):
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        tok = step(tok, pos).argmax(-1)
        out[i] = tok[0]
        pos += 1
        done = i + 1
        if i == 1:
            _sync(device)
            t2 = time.perf_counter()
            first_step_s = t2 - t1
        if eos_id is not None and (i % sync_every == 0 or i == max_new_tokens - 1) \
                and bool((out[:done] == eos_id).any()):
            break
    _sync(device)
    t3 = time.perf_counter()
    ids = out[:done].tolist()
    if eos_id is not None and eos_id in ids:
        ids = ids[:ids.index(eos_id) + 1]
    return ids, {"prefill_s": t1 - t0, "first_step_s": first_step_s, "decode_s": t3 - t2,
                 "decode_steps": max(done - 2, 0)}


def generate(prompt: str, max_new_tokens: int = 64, device: str | torch.device | None = None, *,
             dtype: torch.dtype | None = None, window: int | None = None, page_size: int = 16,
             chat: bool = True, compile: bool | None = None, stop_at_eos: bool = True
             ) -> Generation:
    """Greedy generation from ``prompt`` with SmolLM2-135M-Instruct, decoding through kvops.

    Parameters
    ----------
    prompt : the user text; with ``chat=True`` it is wrapped in the model's chat template.
    max_new_tokens : tokens to generate (fewer when the model ends its answer and
        ``stop_at_eos``).
    device : "cuda" when available else "cpu" by default.
    dtype : float32 on CPU, bfloat16 on CUDA by default (weights, activations and KV pool).
    window : ring window ``W`` in tokens (a multiple of ``page_size``); by default the whole
        prompt plus the new tokens rounded up to a page, so nothing slides out.
    compile : compile the decode step (default: on CUDA only).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    compile = device.type == "cuda" if compile is None else compile
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected at least 1, got {max_new_tokens}")
    model, tok = load_model(str(device), dtype)
    ids = tok.encode(tok.chat_prompt(prompt) if chat else prompt)
    need = -(-(len(ids) + max_new_tokens) // page_size) * page_size
    model.setup_cache(1, window or need, page_size)
    step = model.decode_step
    if compile:
        mode = "reduce-overhead" if device.type == "cuda" else None
        step = torch.compile(model.decode_step, mode=mode, fullgraph=True, dynamic=False)
    new, t = greedy_decode(model, ids, max_new_tokens, step=step,
                           eos_id=tok.eos_id if stop_at_eos else None)
    steps = t["decode_steps"]
    tps = steps / t["decode_s"] if steps and t["decode_s"] > 0 else 0.0
    visible = min(len(ids) + len(new) // 2, model.window)     # the mean window of timed steps
    step_bytes = model.weight_bytes() + model.kv_bytes(visible)
    return Generation(
        prompt=prompt, text=tok.decode(new), prompt_tokens=ids, new_tokens=new,
        device=str(device), dtype=str(dtype).replace("torch.", ""), window=model.window,
        prefill_s=t["prefill_s"], decode_s=t["decode_s"], decode_steps=steps,
        decode_tokens_per_s=tps, decode_gbps=step_bytes * tps / 1e9, compiled=compile,
    )
