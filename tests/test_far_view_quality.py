"""Far-view quality on SmolLM2-135M: the recorded evaluations, as slow tests (not run in CI).

    python -m pytest -m slow tests/test_far_view_quality.py      # a few minutes on one CPU core

They rerun a small part of the evaluation (:mod:`kvops.evals.far_view` and
:mod:`kvops.evals.passkey`, which ``examples/far_view_eval.py`` runs) and check it
against the numbers recorded in docs/far_view.md (bench/results/2026-11-30-far_view-*.md), so a
change that moves the evaluation or the ops under it shows up here. The full tables come from the script.
"""

from __future__ import annotations

import pytest
import torch

from kvops.evals import far_view as ev
from kvops.evals import passkey
from kvops.evals.perplexity import kjv_tokens
from kvops.models import Llama, ModelUnavailable, Tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    try:
        return Llama.from_gguf(), Tokenizer.from_gguf()
    except ModelUnavailable as exc:
        pytest.skip(str(exc))


def test_perplexity_at_2k_reproduces_the_recorded_table(smollm2):
    """KJV, first 2048 tokens, W 512, sv_chunk 128: dense 4.710, near-only 10.306, far64 with
    the log-count bias 10.261 (bench/results/2026-11-30-far_view-perplexity-2048-4096.md)."""
    model, tok = smollm2
    ids = kjv_tokens(tok, 2048)
    with torch.no_grad():
        got = {c: ev.perplexity(model, ids, c) for c in ("dense", "near", "far64")}
    assert got["dense"] == pytest.approx(4.710, abs=2e-3)
    assert got["near"] == pytest.approx(10.306, abs=2e-3)
    assert got["far64"] == pytest.approx(10.261, abs=2e-3)
    assert got["far64"] < got["near"]


def test_passkey_at_2k_dense_retrieves_and_the_window_alone_does_not(smollm2):
    """10 prompts at depths 0..1: dense attention finds most keys (40/50 recorded), the near
    window alone none (0/50 recorded)."""
    model, tok = smollm2
    with torch.no_grad():
        hits, _, _ = passkey.passkey_hits(model, tok, 2048, ["dense", "near"], prompts=10)
    assert len(hits["dense"]) >= 6, hits
    assert hits["near"] == [], hits


def test_served_retrieval_at_2k_finds_what_dense_finds(smollm2):
    """Served (the prompt prefilled densely, the answer decoded with the far view): the
    retrieval far view finds every key dense finds on 10 prompts at 2k (40 / 40 on 50
    recorded, bench/results/2026-12-06-far_view-passkey-2048-4096-8192-served-50.md) and the
    window alone only keys in the last quarter, its window (0.78-1.00 recorded); multikey serves
    the same way, a served config answering only questions dense's prefill was run for."""
    model, tok = smollm2
    configs = ["dense", "ret128+decode@8", "near+decode"]
    with torch.no_grad():
        hits, seconds, _ = passkey.passkey_hits(model, tok, 2048, configs, prompts=10)
        keys, _ = passkey.multikey_hits(model, tok, 2048, ["ret64+decode"], trials=1, needles=2)
    assert len(hits["dense"]) >= 6 and hits["ret128+decode@8"] == hits["dense"], hits
    assert all(i / 9 > 0.75 for i in hits["near+decode"]), hits     # the last 512 tokens
    assert seconds["ret128+decode@8"] < seconds["dense"]       # the answer's positions only
    assert set(keys) == {"dense", "ret64+decode"} and set(keys["ret64+decode"]) <= {(0, 0), (0, 1)}
