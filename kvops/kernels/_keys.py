"""Ranking keys inside kernels: a float32 score and an entry id as one unique int64.

The float's bits are mapped to an int32 with the same order (negative floats have their
magnitude bits flipped), placed in the high word, the id in the low word. Comparing keys
compares scores and breaks ties by the larger id, so a row's keys are distinct and a top-k is
a set of keys at or above a threshold key.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def score_bits(u):
    """int32 of float32 ``u`` with the same order; every NaN (of either sign) above +inf, as
    ``torch.topk`` ranks it."""
    u = tl.where(u != u, float("nan"), u)
    bits = u.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def score_key(u, ids):
    """int64 key of float32 score ``u`` and non-negative int32 id ``ids``."""
    return (score_bits(u).to(tl.int64) << 32) | ids.to(tl.int64)

