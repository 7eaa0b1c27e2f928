"""Retrieval tasks for the far view on SmolLM2-135M: passkey and multikey.

Passkey (:func:`passkey_hits`): a 5-digit key in one sentence hidden at a swept depth of
repeated filler text, asked for at the end (chat format); a prompt counts as retrieved when
greedy decoding would emit the key's digits, read from one forward over prompt + key. The
prompts share their beginning, so per configuration the deepest prompt runs in full and keeps
every layer's K/V, and each other prompt computes only the positions from where it departs
(:func:`kvops.evals.far_view.hidden_states_from`; ``dense`` goes through
:func:`kvops.evals.far_view.attention_dense`). Configurations that see the same slots at the
prompt length (:func:`same_slots`) are computed once and reported for both.

Multikey (:func:`multikey_hits`): several keys, each named by a color, at stratified random
depths of one context, each asked for in turn; every question reuses the K/V of the previous
one's common prefix.

The configurations are those of :func:`kvops.evals.far_view.parse_config`.
"""

from __future__ import annotations

import random
import time

import torch

from kvops.evals.far_view import (
    decode_only,
    hidden_states_from,
    parse_config,
    retrieval_every,
    window_geometry,
)
from kvops.models import Tokenizer

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n\n")


def passkey_prompt(tok: Tokenizer, n_tokens: int, depth: float, key: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of about ``n_tokens`` tokens: the key sentence after
    ``depth`` (0..1) of the filler, the question at the end, in SmolLM2's chat format."""
    prompt, answer, _ = passkey_layout(tok, n_tokens, depth, key)
    return prompt, answer


def passkey_layout(tok: Tokenizer, n_tokens: int, depth: float, key: str):
    """:func:`passkey_prompt`'s (prompt ids, answer ids) and the key sentence's token span
    ``(start, end)`` in the prompt."""
    head = tok.encode(tok.chat_prompt(INTRO).split(INTRO)[0] + INTRO)
    needle = tok.encode(f"The pass key is {key}. Remember it. {key} is the pass key.\n")
    tail = tok.encode("\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is")
    filler = tok.encode(FILLER)
    answer = tok.encode(" " + key)
    reps = max(1, (n_tokens - len(head) - len(needle) - len(tail) - len(answer)) // len(filler))
    at = round(depth * reps)
    body = filler * at + needle + filler * (reps - at)
    start = len(head) + at * len(filler)
    return head + body + tail, answer, (start, start + len(needle))


def reusable_prefix(base: torch.Tensor | None, ids: torch.Tensor, answer_len: int) -> int:
    """Leading tokens of ``ids`` (a prompt and its ``answer_len``-token answer) equal to those of
    ``base`` (the sequence whose K/V is cached; None: nothing cached), never the token before
    the answer: the positions a teacher-forced pass can take from the cache."""
    if base is None:
        return 0
    m = min(len(base), len(ids) - answer_len - 1)
    same = (base[:m] == ids[:m]).tolist()
    return same.index(False) if False in same else m


def passkey_cases(tok: Tokenizer, n_tokens: int, prompts: int, seed: int = 0,
                  spans: bool = False):
    """The prompts: (depth, prompt ids, answer ids), depths ``0, 1/(prompts-1), ..., 1``, and
    with ``spans`` the key sentence's token span last (:func:`passkey_layout`)."""
    rng = random.Random(seed)
    cases = []
    for i in range(prompts):
        depth = i / max(1, prompts - 1)
        key = str(rng.randint(10000, 99999))
        prompt, answer, span = passkey_layout(tok, n_tokens, depth, key)
        cases.append((depth, prompt, answer, span) if spans else (depth, prompt, answer))
    return cases


def same_slots(configs: list[str], T: int) -> dict[str, str]:
    """config -> the first config it computes identically to at length ``T``: ``far<cap>`` and
    ``far<cap'>`` with the same bias and sink when every far chunk fits both caps (the
    block-parallel evaluation then sees the same slots; the cap only bounds them)."""
    chunks = int(window_geometry(T, "cpu")[2].max())
    seen, alias = {}, {}
    for c in configs:
        mode, cap, bias, sink = parse_config(c)
        key = ("far", bias, sink) if mode == "far" and cap >= chunks else c
        alias[c] = seen.setdefault(key, c)
    return alias


def passkey_hits(model, tok, n_tokens, configs, prompts, seed=0) -> tuple[dict, dict, dict]:
    """Per config: the indices of the prompts retrieved, the seconds it took, and which config
    it was computed as (:func:`same_slots`; an alias is not recomputed).

    The prompts share their beginning (the chat head and the filler before the key sentence),
    so per config the deepest prompt runs in full and keeps every layer's K/V; each other prompt
    computes only its positions from where it leaves that prompt, attending to the kept K/V for
    the positions before (exact: causal attention; float rounding may differ from one full
    forward at the 1e-6 level).

    A ``+decode`` config (:func:`kvops.evals.far_view.decode_only`) is served as an engine
    serves it: each prompt's dense forward is its prefill (computed for ``dense``, which runs
    whether asked for or not), so the first digit is dense's, and the answer's positions are
    decoded with the far view over the prompt's K/V; its seconds are those of the answer's
    positions alone."""
    cases = passkey_cases(tok, n_tokens, prompts, seed)
    alias = same_slots(configs, max(len(p) + len(a) for _, p, a in cases))
    runs, served = served_plan([c for c in configs if alias[c] == c])
    hits, seconds = {c: [] for c in runs + served}, {c: 0.0 for c in runs + served}
    for c in runs:
        t = time.perf_counter()
        order = sorted(range(prompts), key=lambda i: -cases[i][0])   # deepest first
        cache, base = None, None
        for i in order:
            depth, prompt, answer = cases[i]
            ids = torch.tensor(prompt + answer, device=model.rope_cos.device)
            n = len(answer)
            start = reusable_prefix(base, ids, n)
            start -= start % retrieval_every(c)       # a selection step's query is recomputed
            hidden, kvs = hidden_states_from(model, ids, c, start, cache)
            if cache is None:
                cache, base = kvs, ids
            got = model.output(hidden[-n - 1:-1]).argmax(-1).tolist()
            if got == answer:
                hits[c].append(i)
            print(f"{c} prompt {i} depth {depth:.2f} from {start}/{len(ids)}: "
                  f"{'hit' if got == answer else 'miss'} (total {len(hits[c])}, "
                  f"{time.perf_counter() - t:.0f} s)", flush=True)
            if c == "dense":
                t += decode_served(model, ids, served, len(prompt), kvs, got[0], answer, i,
                                   hits, seconds)
        seconds[c] = time.perf_counter() - t
    for c in configs:
        hits[c], seconds[c] = sorted(hits[alias[c]]), seconds[alias[c]]
    return hits, seconds, alias


COLORS = ["red", "blue", "green", "gold", "silver", "black", "white", "pink"]


def multikey_prompt(tok: Tokenizer, n_tokens: int, depths: list[float], keys: list[str],
                    ask: int) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of about ``n_tokens`` tokens: one key sentence per key, the
    ``i``-th named ``COLORS[i]`` and placed after ``depths[i]`` of the filler, then the question
    for key ``ask`` (chat format)."""
    head = tok.encode(tok.chat_prompt(INTRO).split(INTRO)[0] + INTRO)
    needles = [tok.encode(f"The {COLORS[i]} pass key is {key}. Remember it. {key} is the "
                          f"{COLORS[i]} pass key.\n") for i, key in enumerate(keys)]
    tail = tok.encode(f"\nWhat is the {COLORS[ask]} pass key?<|im_end|>\n<|im_start|>assistant\n"
                      f"The {COLORS[ask]} pass key is")
    filler = tok.encode(FILLER)
    answer = tok.encode(" " + keys[ask])
    used = len(head) + sum(map(len, needles)) + len(tail) + len(answer)
    reps = max(1, (n_tokens - used) // len(filler))
    body, at = [], 0
    for d, needle in sorted(zip(depths, needles), key=lambda p: p[0]):
        upto = round(d * reps)
        body += filler * (upto - at) + needle
        at = upto
    body += filler * (reps - at)
    return head + body + tail, answer


def multikey_cases(tok: Tokenizer, n_tokens: int, trials: int, needles: int, seed: int = 0):
    """Per trial, ``needles`` keys at stratified random depths (key ``i`` in the ``i``-th of
    ``needles`` equal bands of the filler), each asked for once: a list of (trial, key index,
    depth, prompt ids, answer ids), a trial's questions together (they share the context)."""
    if not 1 <= needles <= len(COLORS):
        raise ValueError(f"needles: expected 1..{len(COLORS)}, got {needles}")
    rng = random.Random(seed)
    cases = []
    for r in range(trials):
        depths = [(i + rng.random()) / needles for i in range(needles)]
        keys = [str(rng.randint(10000, 99999)) for _ in range(needles)]
        for i in range(needles):
            cases.append((r, i, depths[i], *multikey_prompt(tok, n_tokens, depths, keys, i)))
    return cases


def multikey_hits(model, tok, n_tokens, configs, trials, needles, seed=0) -> tuple[dict, dict]:
    """Per config: the (trial, key) pairs answered (every digit the argmax, as for passkey)
    and the seconds it took. Each question reuses the K/V of the previous one's common prefix
    (a trial's questions share the whole context; trials share the filler before their first
    key). A ``+decode`` config is served as :func:`passkey_hits` serves it."""
    cases = multikey_cases(tok, n_tokens, trials, needles, seed)
    runs, served = served_plan(configs)
    hits, seconds = {c: [] for c in runs + served}, {c: 0.0 for c in runs + served}
    for c in runs:
        t = time.perf_counter()
        cache, base = None, None
        for r, i, depth, prompt, answer in cases:
            ids = torch.tensor(prompt + answer, device=model.rope_cos.device)
            n = len(answer)
            start = reusable_prefix(base, ids, n)
            start -= start % retrieval_every(c)
            hidden, cache = hidden_states_from(model, ids, c, start, cache)
            base = ids
            got = model.output(hidden[-n - 1:-1]).argmax(-1).tolist()
            if got == answer:
                hits[c].append((r, i))
            print(f"{c} trial {r} key {i} depth {depth:.2f} from {start}/{len(ids)}: "
                  f"{'hit' if got == answer else 'miss'} (total {len(hits[c])}, "
                  f"{time.perf_counter() - t:.0f} s)", flush=True)
            if c == "dense":
                t += decode_served(model, ids, served, len(prompt), cache, got[0], answer,
                                   (r, i), hits, seconds)
        seconds[c] = time.perf_counter() - t
    return hits, seconds


def served_plan(configs: list[str]) -> tuple[list[str], list[str]]:
    """(the configs a task runs over every prompt, the ``+decode`` ones it serves over dense's
    prefill): ``dense`` runs whether asked for or not when any config is served."""
    served = [c for c in configs if decode_only(c)]
    runs = [c for c in configs if c not in served]
    if served and "dense" not in runs:
        runs.insert(0, "dense")
    return runs, served


def decode_served(model, ids, served, prompt_len, kvs, first, answer, key, hits,
                  seconds) -> float:
    """Each served config's answer to ``ids`` (prompt + answer), decoded with its far view over
    the prompt's dense K/V ``kvs`` (the prefill; ``first``: the prefill's own next token, the
    answer's first); ``key`` joins ``hits[config]`` when every token is the argmax. Adds each
    config's seconds to ``seconds`` and returns their sum."""
    spent = 0.0
    for d in served:
        t = time.perf_counter()
        tail, _ = hidden_states_from(model, ids, d, prompt_len, kvs)
        got = [first] + model.output(tail[:-1]).argmax(-1).tolist()
        if got == answer:
            hits[d].append(key)
        seconds[d] += time.perf_counter() - t
        spent += time.perf_counter() - t
        print(f"  {d}: {'hit' if got == answer else 'miss'} (total {len(hits[d])})", flush=True)
    return spent


def depth_ranges(indices: list[int], prompts: int) -> str:
    """Retrieved prompt indices as depth ranges: ``"0.00-0.12, 0.86-1.00"``."""
    runs = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    d = lambda i: f"{i / max(1, prompts - 1):.2f}"
    return ", ".join(d(a) if a == b else f"{d(a)}-{d(b)}" for a, b in runs) or "none"
