"""Tensor parallelism for :class:`~kvops.models.llama.Llama` on ``torch.distributed``
(Megatron's layout): each of ``tp`` ranks holds ``Hq / tp`` query heads and ``Hkv / tp`` KV
heads, ``hidden / tp`` columns of the MLP and ``ceil(V / tp)`` rows of the vocabulary.

=====================  ==========================================  ===========================
module                 this rank's weight                          collective
=====================  ==========================================  ===========================
``wqkv`` (column)      its Q heads, then its K heads, its V heads  none (heads stay local)
``wo`` (row)           the columns of its Q heads                  all-reduce (sum)
``w13`` (column)       its rows of gate, then of up                none
``w2`` (row)           its columns of the hidden width             all-reduce (sum)
embedding (vocab)      rows ``[r * Vr, (r + 1) * Vr)``             all-reduce (sum)
output head (vocab)    the same rows (tied or not)                 all-gather (last dim)
=====================  ==========================================  ===========================

Query head ``h`` reads KV head ``h // G``; a rank's query heads ``[r Hq/tp, (r+1) Hq/tp)`` read
exactly its KV heads ``[r Hkv/tp, (r+1) Hkv/tp)``, so attention (and every KV page) is local:
each rank's KV pool holds its ``Hkv / tp`` heads of every page, and page ids mean the same on
every rank. The vocabulary is padded to ``tp * Vr`` rows (zero rows, never a token: an id
outside a rank's rows embeds to zero there, and the padded logits are cut off after the
gather).

The collectives are functional (``torch.distributed._functional_collectives``), so
``torch.compile(fullgraph=True)`` traces them inside a step, and a sharded model runs through
every path the full one has (:meth:`Llama.forward`, ``prefill`` / ``decode_step``,
:func:`kvops.models.paged.forward_packed`). Every rank shards the same full weights:
:func:`shard_llama` of a model loaded from the GGUF, or of :func:`~kvops.models.paged.random_llama`
with the same seed (the generator is deterministic, so each rank draws the same full tensors).
The sharded model's ``cfg`` is this rank's shapes (``n_heads``, ``n_kv_heads``, ``hidden_dim``
divided by ``tp``; ``vocab_size`` whole, the gathered logits' width): KV pools sized from it
hold this rank's heads. ``full_cfg`` is the model's.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from kvops.models.config import LlamaConfig
from kvops.models.llama import Llama

# torch >= 2.12 names it all_gather_single (the same op); 2.11 has all_gather_tensor only
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def check_tp(cfg: LlamaConfig, tp: int) -> None:
    """Raise ``ValueError`` naming ``tp`` unless it is a positive int that divides the query
    heads, the KV heads and the MLP width of ``cfg``."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp: expected a positive int (the tensor-parallel world size), got {tp!r}")
    for what, n in (("n_heads (Hq)", cfg.n_heads), ("n_kv_heads (Hkv)", cfg.n_kv_heads),
                    ("hidden_dim", cfg.hidden_dim)):
        if n % tp:
            raise ValueError(f"tp: expected a divisor of the model's {what}={n} (heads, not "
                             f"pages, are sharded; Hq={cfg.n_heads}, Hkv={cfg.n_kv_heads}), "
                             f"got tp={tp}")


def local_config(cfg: LlamaConfig, tp: int) -> LlamaConfig:
    """One rank's shapes: heads and MLP width divided by ``tp``, the vocabulary whole."""
    check_tp(cfg, tp)
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // tp, n_kv_heads=cfg.n_kv_heads // tp,
                               hidden_dim=cfg.hidden_dim // tp)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T)``: the input's last dim is sharded, the output
    whole on every rank."""

    def __init__(self, weight: Tensor, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        return funcol.all_reduce(F.linear(x, self.weight), "sum", self.group)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + Vr)`` of the embedding; ids outside embed to zero here, and the
    all-reduce sums the one rank that holds each id."""

    def __init__(self, weight: Tensor, start: int, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, tokens: Tensor) -> Tensor:
        local = tokens - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        x = x * inside.unsqueeze(-1).to(x.dtype)
        return funcol.all_reduce(x, "sum", self.group)


class VocabParallelHead(nn.Module):
    """This rank's ``Vr`` logits per row, all-gathered into ``[..., V]`` (padding cut)."""

    def __init__(self, weight: Tensor, vocab_size: int, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.group = vocab_size, group

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        lead = y.shape[:-1]
        y = _all_gather(y.reshape(-1, y.shape[-1]).t().contiguous(), 0, self.group)
        return y.t()[:, :self.vocab_size].reshape(*lead, self.vocab_size)


def _rows(w: Tensor, n_parts: int, rank: int) -> Tensor:
    return w.chunk(n_parts, dim=0)[rank]


def _cols(w: Tensor, n_parts: int, rank: int) -> Tensor:
    return w.chunk(n_parts, dim=1)[rank]


def shard_llama(model: Llama, rank: int | None = None, tp: int | None = None, group=None) -> Llama:
    """Make ``model`` (full weights) this rank's shard, in place, and return it.

    ``rank`` and ``tp`` default to the rank and size of ``group`` (the default process group);
    ``tp`` must divide ``Hq``, ``Hkv`` and the MLP width (``ValueError`` naming ``tp``
    otherwise). The full weights are dropped as each module is replaced (slices are cloned),
    so the peak is one full model plus one rank's shard. ``tp = 1`` keeps every weight and
    still runs the collectives (over a group of one): the distributed path on one device."""
    if tp is not None:
        check_tp(model.cfg, tp)
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("shard_llama: torch.distributed is not initialized; call "
                               "init_process_group first (or kvops.engine.distributed.init)")
        group = dist.group.WORLD
    rank = dist.get_rank(group) if rank is None else rank
    tp = dist.get_world_size(group) if tp is None else tp
    cfg = model.cfg
    loc = local_config(cfg, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank: expected 0 <= rank < tp={tp}, got {rank}")
    D, Hq, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    for block in model.layers:
        att, ffn = block.attention, block.feed_forward
        w = att.wqkv.weight
        q, k, v = w.split((Hq * D, Hkv * D, Hkv * D))
        att.wqkv = _linear(torch.cat([_rows(q, tp, rank), _rows(k, tp, rank), _rows(v, tp, rank)]))
        att.wo = RowParallelLinear(_cols(att.wo.weight, tp, rank).contiguous(), group)
        att.n_heads, att.n_kv_heads = loc.n_heads, loc.n_kv_heads
        att.split = (loc.n_heads * D, loc.n_kv_heads * D, loc.n_kv_heads * D)
        gate, up = ffn.w13.weight.split(cfg.hidden_dim)
        ffn.w13 = _linear(torch.cat([_rows(gate, tp, rank), _rows(up, tp, rank)]))
        ffn.w2 = RowParallelLinear(_cols(ffn.w2.weight, tp, rank).contiguous(), group)
        ffn.hidden = loc.hidden_dim
    V = cfg.vocab_size
    Vr = -(-V // tp)
    start = rank * Vr

    def vocab_rows(w: Tensor) -> Tensor:
        out = w.new_zeros((Vr, w.shape[1]))
        n = max(0, min(V, start + Vr) - start)
        out[:n] = w[start:start + n]
        return out

    emb = vocab_rows(model.tok_embeddings.weight)
    tied = model.output.weight is model.tok_embeddings.weight
    head = emb if tied else vocab_rows(model.output.weight)
    model.tok_embeddings = VocabParallelEmbedding(emb, start, group)
    model.output = VocabParallelHead(head, V, group)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    model.full_cfg, model.cfg = cfg, loc
    model.tp_rank, model.tp_size, model.tp_group = rank, tp, group
    return model


def _linear(weight: Tensor) -> nn.Linear:
    with torch.device("meta"):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    return lin
