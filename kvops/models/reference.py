"""Oracles for the kvops decode path: dense attention over the same tokens, batched decode
driving, and transformers' ``LlamaForCausalLM`` with the same weights. Used by the tests and
by ``bench/bench_model_decode.py`` (which records the errors on the GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvops.models.config import LlamaConfig
from kvops.models.llama import Llama


@torch.no_grad()
def window_logits(model: Llama, tokens: Tensor, window: int) -> Tensor:
    """Dense SDPA oracle: logits float32 ``[T, V]`` for ``tokens [T]`` where position ``i``
    attends to positions ``(i - window, i]`` (plain causal when ``window >= T``)."""
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


@torch.no_grad()
def run_decode(model: Llama, prompts: list[Tensor], steps: int, *, step=None,
               forced: list[Tensor] | None = None) -> tuple[list[Tensor], Tensor]:
    """Prefill ``prompts[b]`` into sequence ``b`` of a cache set up for ``len(prompts)``, then
    ``steps`` batched decode steps, greedy or feeding ``forced[b][i]`` at step ``i``. ``step``
    defaults to ``model.decode_step`` (pass a compiled one). Returns each sequence's tokens
    (prompt + fed tokens) and the decode logits float32 ``[steps, B, V]``."""
    step = step or model.decode_step
    seqs = [p.tolist() for p in prompts]
    tok = torch.stack([model.prefill(p, b)[-1].argmax() for b, p in enumerate(prompts)])
    pos = torch.tensor([len(p) for p in prompts], device=tok.device)
    out = []
    for i in range(steps):
        if forced is not None:
            tok = torch.stack([f[i] for f in forced])
        for b, s in enumerate(seqs):
            s.append(int(tok[b]))
        logits = step(tok, pos).clone()
        out.append(logits)
        tok, pos = logits.argmax(-1), pos + 1
    return [torch.tensor(s, device=tok.device) for s in seqs], torch.stack(out)


def random_prompts(lengths: list[int], vocab: int, device, seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in lengths]


def decode_vs_window(model: Llama, prompts: list[Tensor], steps: int, window: int
                     ) -> tuple[Tensor, list[Tensor]]:
    """Greedy decode through kvops with a ring of ``window`` tokens (``setup_cache`` with page
    16), and for each sequence the oracle's logits over the same tokens. Returns the decode
    logits ``[steps, B, V]`` and the oracle's ``[steps, V]`` per sequence."""
    model.setup_cache(batch_size=len(prompts), window=window, page_size=16)
    seqs, logits = run_decode(model, prompts, steps)
    want = [window_logits(model, s, window)[len(p):] for s, p in zip(seqs, prompts)]
    return logits, want


def rel_l2(got: Tensor, want: Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def hf_random(cfg: LlamaConfig, device, dtype=torch.float32, seed: int = 5):
    """transformers' ``LlamaForCausalLM`` of shape ``cfg`` with its own random initialization."""
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
        rope_theta=cfg.rope_base, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype).eval()


@torch.no_grad()
def decode_vs_transformers(hf_model, lengths: list[int], steps: int, seed: int = 6
                           ) -> tuple[Tensor, list[Tensor]]:
    """Our model with ``hf_model``'s weights decodes greedily through kvops (window covering
    everything); returns our logits ``[steps, B, V]`` and transformers' full-forward logits
    ``[steps, V]`` per sequence over the same tokens."""
    model = Llama.from_hf(hf_model)
    device = model.output.weight.device
    prompts = random_prompts(lengths, model.cfg.vocab_size, device, seed)
    model.setup_cache(batch_size=len(lengths), window=-(-(max(lengths) + steps) // 16) * 16,
                      page_size=16)
    seqs, logits = run_decode(model, prompts, steps)
    want = [hf_model(s[None]).logits[0, n:].float() for s, n in zip(seqs, lengths)]
    return logits, want
