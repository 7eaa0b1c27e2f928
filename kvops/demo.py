"""The attention-stack demo: a small Llama-shaped decoder with random weights whose decode steps
run through ``torch.ops.kvops.static_sliding_attention`` over fixed-shape ring windows, checked
step by step against dense ``scaled_dot_product_attention`` over the same tokens.

The window starts filled with a synthetic context (random K/V, as if prefilled) so that the
ring wraps during the run and every step reads a full window, as in steady-state serving.
On CUDA the whole decode step (all layers) is captured once in a CUDA graph and replayed.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

import kvops  # noqa: F401  (registers torch.ops.kvops)


@dataclasses.dataclass
class DemoConfig:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    window: int
    batch: int
    steps: int
    dtype: torch.dtype

    @classmethod
    def for_device(cls, device: torch.device) -> DemoConfig:
        if device.type == "cuda":   # Llama-3-8B attention shapes, 4 layers
            return cls(4, 4096, 32, 8, 128, 4096, 32, 64, torch.bfloat16)
        return cls(4, 512, 8, 2, 64, 128, 4, 96, torch.float32)


class AttentionStack:
    """RMSNorm -> q/k/v projections -> kvops decode attention -> output projection, per layer.

    State per layer: a window arena k_win, v_win [B, W, Hkv, D] written in place at the ring
    slot of each new token; the dense check keeps the full history beside it.
    """

    def __init__(self, cfg: DemoConfig, device: torch.device, seed: int = 0):
        self.cfg, self.device = cfg, device
        gen = torch.Generator(device="cpu").manual_seed(seed)
        H, D, Hq, Hkv = cfg.hidden, cfg.head_dim, cfg.q_heads, cfg.kv_heads
        w = lambda i, o: (torch.randn(i, o, generator=gen) * i ** -0.5).to(device, cfg.dtype)
        self.weights = [dict(wq=w(H, Hq * D), wk=w(H, Hkv * D), wv=w(H, Hkv * D), wo=w(Hq * D, H))
                        for _ in range(cfg.layers)]
        shape = (cfg.batch, cfg.window, Hkv, D)
        self.k_win = [torch.zeros(shape, device=device, dtype=cfg.dtype) for _ in range(cfg.layers)]
        self.v_win = [torch.zeros(shape, device=device, dtype=cfg.dtype) for _ in range(cfg.layers)]

    def prefill_synthetic(self, n_tokens: int, gen: torch.Generator) -> list[tuple]:
        """Fill the first ``n_tokens`` slots with random K/V; return the dense history."""
        cfg, hist = self.cfg, []
        for kw, vw in zip(self.k_win, self.v_win):
            k = torch.randn(cfg.batch, n_tokens, cfg.kv_heads, cfg.head_dim, generator=gen)
            v = torch.randn(cfg.batch, n_tokens, cfg.kv_heads, cfg.head_dim, generator=gen)
            kw[:, :n_tokens] = k.to(self.device, cfg.dtype)
            vw[:, :n_tokens] = v.to(self.device, cfg.dtype)
            hist.append((kw[:, :n_tokens].clone(), vw[:, :n_tokens].clone()))
        return hist

    def step(self, x: torch.Tensor, slot: torch.Tensor, win_start: torch.Tensor,
             win_len: torch.Tensor) -> torch.Tensor:
        """One decode step. x [B, hidden]; slot, win_start, win_len int32 [B] (device).
        Fixed shapes, no host sync: capturable in a CUDA graph."""
        cfg, rows = self.cfg, torch.arange(self.cfg.batch, device=x.device)
        for layer, kw, vw in zip(self.weights, self.k_win, self.v_win):
            h = F.rms_norm(x, (cfg.hidden,))
            q = (h @ layer["wq"]).view(cfg.batch, cfg.q_heads, cfg.head_dim)
            kw[rows, slot] = (h @ layer["wk"]).view(cfg.batch, cfg.kv_heads, cfg.head_dim)
            vw[rows, slot] = (h @ layer["wv"]).view(cfg.batch, cfg.kv_heads, cfg.head_dim)
            out, _ = torch.ops.kvops.static_sliding_attention(q, kw, vw, win_start, win_len)
            x = x + out.reshape(cfg.batch, -1) @ layer["wo"]
        return x

    def dense_step(self, x: torch.Tensor, hist: list[tuple]) -> torch.Tensor:
        """The same step with dense SDPA over the last W tokens of the full history (float32)."""
        cfg = self.cfg
        x = x.float()
        for i, layer in enumerate(self.weights):
            h = F.rms_norm(x, (cfg.hidden,)).to(cfg.dtype).float()
            wf = {n: t.float() for n, t in layer.items()}
            q = (h @ wf["wq"]).view(cfg.batch, cfg.q_heads, 1, cfg.head_dim)
            k_new = (h @ wf["wk"]).view(cfg.batch, 1, cfg.kv_heads, cfg.head_dim).to(cfg.dtype)
            v_new = (h @ wf["wv"]).view(cfg.batch, 1, cfg.kv_heads, cfg.head_dim).to(cfg.dtype)
            k_all = torch.cat([hist[i][0], k_new], 1)[:, -cfg.window:]
            v_all = torch.cat([hist[i][1], v_new], 1)[:, -cfg.window:]
            hist[i] = (k_all, v_all)
            out = F.scaled_dot_product_attention(q, k_all.float().transpose(1, 2),
                                                 v_all.float().transpose(1, 2), enable_gqa=True)
            x = x + out.reshape(cfg.batch, -1) @ wf["wo"]
        return x


def run_demo(device: str | None = None, steps: int | None = None, check: bool = True) -> dict:
    """Run the demo; print and return {steps, tokens_per_s, kv_tbps, max_err, ...}."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = DemoConfig.for_device(dev)
    if steps is not None:
        cfg.steps = steps
    stack = AttentionStack(cfg, dev)
    gen = torch.Generator().manual_seed(1)
    filled = cfg.window - cfg.steps // 2          # the ring wraps halfway through the run
    hist = stack.prefill_synthetic(filled, gen)
    x_in = torch.randn(cfg.steps, cfg.batch, cfg.hidden, generator=gen).to(dev, cfg.dtype)

    B, W = cfg.batch, cfg.window
    x_buf = torch.zeros(B, cfg.hidden, device=dev, dtype=cfg.dtype)
    slot = torch.zeros(B, dtype=torch.int32, device=dev)
    win_start = torch.zeros(B, dtype=torch.int32, device=dev)
    win_len = torch.zeros(B, dtype=torch.int32, device=dev)
    graph = None
    if dev.type == "cuda":   # capture once (warm-up compiles the kernels first)
        snapshot = [(k.clone(), v.clone()) for k, v in zip(stack.k_win, stack.v_win)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            stack.step(x_buf, slot, win_start, win_len)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_buf = stack.step(x_buf, slot, win_start, win_len)
        for (k, v), (k0, v0) in zip(zip(stack.k_win, stack.v_win), snapshot):
            k.copy_(k0)
            v.copy_(v0)

    max_err, elapsed = 0.0, 0.0
    for t in range(cfg.steps):
        pos = filled + t                                  # absolute position of the new token
        n_vis = min(pos + 1, W)
        slot.fill_(pos % W)
        win_start.fill_((pos + 1 - n_vis) % W)
        win_len.fill_(n_vis)
        x_buf.copy_(x_in[t])
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if graph is not None:
            graph.replay()
            torch.cuda.synchronize()
            y = y_buf
        else:
            y = stack.step(x_buf, slot, win_start, win_len)
        elapsed += time.perf_counter() - t0
        if check:
            want = stack.dense_step(x_in[t], hist)
            err = ((y.float() - want).abs().max() / want.abs().max()).item()
            max_err = max(max_err, err)

    elt = torch.tensor([], dtype=cfg.dtype).element_size()
    kv_bytes = cfg.layers * 2 * B * W * cfg.kv_heads * cfg.head_dim * elt
    w_bytes = sum(t.numel() * t.element_size() for layer in stack.weights for t in layer.values())
    per_step = elapsed / cfg.steps
    result = dict(device=str(dev), steps=cfg.steps, batch=B, window=W, layers=cfg.layers,
                  dtype=str(cfg.dtype).replace("torch.", ""), step_ms=per_step * 1e3,
                  tokens_per_s=B / per_step, kv_tbps=kv_bytes / per_step / 1e12,
                  total_tbps=(kv_bytes + w_bytes) / per_step / 1e12,
                  max_rel_err=max_err if check else float("nan"))
    print_table(result)
    return result


def print_table(r: dict) -> None:
    print(f"kvops attention-stack demo on {r['device']}: {r['layers']} layers, batch {r['batch']}, "
          f"window {r['window']}, {r['dtype']} (decode through torch.ops.kvops; "
          f"{'CUDA graph' if r['device'].startswith('cuda') else 'eager'})")
    rows = [("steps", f"{r['steps']}"), ("step time", f"{r['step_ms']:.3f} ms"),
            ("tokens/s", f"{r['tokens_per_s']:.0f}"),
            ("KV read bandwidth", f"{r['kv_tbps'] * 1e3:.1f} GB/s"),
            ("KV + weights bandwidth", f"{r['total_tbps'] * 1e3:.1f} GB/s"),
            ("max rel. error vs dense SDPA", f"{r['max_rel_err']:.2e}")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v}")
