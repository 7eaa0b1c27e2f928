"""The next token: greedy, or sampled at a temperature with top-k and top-p, reproducible per
request.

A request that samples draws its noise from a counter-based hash (splitmix64) of its ``seed``,
the index of the output token being drawn and the vocabulary id, evaluated on the device. So
its tokens depend on nothing else: not on which requests share its batch, not on the engine's
overlap, not on a preemption (a recomputed request draws the same noise at the same output
index), as vLLM's per-request seeds give, without a generator per request.

The draw is Gumbel-max: the argmax over the kept tokens of ``logits / temperature + g``, with
``g = -log(-log(u))`` and ``u`` uniform in (0, 1) from the hash. That samples from
``softmax(logits / temperature)`` restricted to the kept tokens: the ``top_k`` of highest logit
(0: all), then the smallest prefix of them, by falling probability renormalized over them,
whose mass reaches ``top_p`` (the first token always kept), as vLLM and transformers cut. When
every row sets ``top_k`` the draw takes ``torch.topk`` of the largest ``top_k`` instead of
sorting the vocabulary. The noise of a token is the noise of its id, so with nothing cut the
cut and the plain draws give the same token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvops._upload import upload

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    """An unsigned 64-bit value as the int64 of the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def splitmix64(x: int) -> int:
    """splitmix64's finalizer of ``x`` (Python ints, unsigned 64-bit): the reference the device
    hash is tested against."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` keeps the sign)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`splitmix64` of every element of an int64 tensor (bits as unsigned; products
    wrap)."""
    z = x + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens: ``temperature`` 0 is greedy (the other fields unused);
    above 0 it samples, keeping the ``top_k`` most likely tokens (0: every token) and of those
    the nucleus of mass ``top_p``; ``seed`` fixes the draws (module doc; None: a
    :class:`~kvops.engine.request.Request` takes one from its id, so requests draw apart)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {t!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0: every token), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed: expected an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def cuts(self) -> bool:
        """Whether top-k or top-p removes any token (then the draw sorts the logits)."""
        return self.top_k > 0 or self.top_p < 1


def draws(params: SamplingParams | None) -> bool:
    """Whether a row with ``params`` samples (None and temperature 0 are greedy)."""
    return params is not None and not params.greedy


def request_seed(rid: int) -> int:
    """The seed of a request that names none: a hash of its id."""
    return _signed(splitmix64(rid ^ 0x5EED))


def row_keys(params: list[SamplingParams], positions: list[int]) -> np.ndarray:
    """Each row's hash key: ``splitmix64(seed ^ splitmix64(position))`` as int64."""
    if any(p.seed is None for p in params):
        raise ValueError("params: expected a seed in each (a Request sets one from its id)")
    return np.array([_signed(splitmix64((p.seed & _MASK64) ^ splitmix64(pos)))
                     for p, pos in zip(params, positions)], dtype=np.int64)


def uniform(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1): row ``r``, token id ``ids[r, j]`` (or ``ids[j]``) from the top
    24 bits of ``splitmix64(keys[r] + id)``."""
    z = splitmix64_tensor(keys[:, None] + ids.to(torch.int64))
    return (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           positions: list[int]) -> torch.Tensor:
    """Next tokens ``[R]`` int64 of ``logits [R, V]``: row ``r`` by ``params[r]`` (temperature
    above 0) drawing output index ``positions[r]`` (module doc)."""
    R, V = logits.shape
    if len(params) != R or len(positions) != R:
        raise ValueError(f"params, positions: expected {R} each (one a row of logits), got "
                         f"{len(params)} and {len(positions)}")
    if any(p.greedy for p in params):
        raise ValueError("params: sample() draws; greedy rows take the logits' argmax")
    dev = logits.device
    keys = upload(row_keys(params, positions), dev)
    temp = upload(np.array([p.temperature for p in params], dtype=np.float32), dev)
    x = logits.float() / temp[:, None]
    if not any(p.cuts for p in params):
        g = -torch.log(-torch.log(uniform(keys, torch.arange(V, device=dev))))
        return (x + g).argmax(-1)
    if all(p.top_k for p in params):    # the largest k only, in falling order
        vals, ids = x.topk(min(max(p.top_k for p in params), V), dim=-1)
    else:
        vals, ids = x.sort(dim=-1, descending=True)
    k = upload(np.array([p.top_k or V for p in params], dtype=np.int64), dev)
    top_p = upload(np.array([p.top_p for p in params], dtype=np.float32), dev)
    vals = vals.masked_fill(torch.arange(vals.shape[1], device=dev)[None, :] >= k[:, None],
                            float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    vals = vals.masked_fill((probs.cumsum(dim=-1) - probs) >= top_p[:, None], float("-inf"))
    g = -torch.log(-torch.log(uniform(keys, ids)))
    return ids.gather(1, (vals + g).argmax(-1, keepdim=True))[:, 0]


def next_tokens(logits: torch.Tensor, params: list[SamplingParams | None],
                positions: list[int], greedy: torch.Tensor | None = None) -> torch.Tensor:
    """Next tokens ``[R]`` of ``logits [R, V]``: the argmax (``greedy`` when given) where
    ``params[r]`` is None or greedy, :func:`sample` elsewhere."""
    out = logits.argmax(-1) if greedy is None else greedy
    rows = [r for r, p in enumerate(params) if draws(p)]
    if not rows:
        return out
    at = upload(np.asarray(rows, dtype=np.int64), logits.device)
    drawn = sample(logits.index_select(0, at), [params[r] for r in rows],
                   [positions[r] for r in rows])
    return out.index_copy(0, at, drawn)
