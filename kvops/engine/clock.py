"""The engine's clocks: wall time, engine steps, and a modeled time that does not depend on the
machine the replay runs on.

Every request records each output token on three clocks: wall time (the engine's
``time.perf_counter``), the engine step that produced it (steps counted from the replay's
start), and modeled time, the sum of the modeled costs of the steps so far::

    cost of a step = a + b * tokens computed + c * KV tokens attended

``tokens`` counts the step's prefill-chunk and decode tokens (recomputed prompts included:
the price of a recompute preemption), and ``KV tokens`` the context each of them attends to
(``start + n`` of every item: what the decode attention reads). A step that computes nothing
(every request deferred) costs nothing. Modeled time is a ruler, not a prediction: it ranks
configurations by the work they schedule (steps, recomputed tokens, KV read) with the same
weights on every machine, where the wall times of a shared 2-core CPU do not compare between
configurations.

:data:`H200_8B` holds constants read off the H200 runs of Llama-3-8B's shape in bfloat16
(``bench/results/2026-12-02-elastic-pressure-8b.md``): ``a`` = 10 ms (a decode step of 8 rows
took 12.4 ms with 33 k KV tokens), ``b`` = 40 us a token (prefill steps of 4,096 tokens took about
170 ms), ``c`` = 50 ns a KV token (128 KiB of bfloat16 K/V a token at about 2.6 TB/s).
:meth:`StepCost.scaled` divides ``b`` and ``c`` by a length scale, so that a replay with lengths
x 1/16 charges a prompt what the full-length prompt costs (a token stands for 16).

The engine's ``clock`` (``"wall"`` or ``"model"``) is the one that drives it: arrivals of an
open-loop trace are admitted by it, a closed loop stamps arrivals with it, and the idle engine
jumps along it to the next arrival. Under ``"model"`` the whole replay (admissions, preemptions,
demotions, every latency) is the same on every machine for the same requests; wall times are
then still recorded, measured from the wall instant each request was admitted.
"""

from __future__ import annotations

from dataclasses import dataclass

CLOCKS = ("wall", "model")


@dataclass(frozen=True)
class StepCost:
    """Modeled cost of a step, in seconds: ``a + b * tokens + c * kv_tokens``."""

    a: float = 10e-3          # a step's fixed cost (weights read, launches)
    b: float = 40e-6          # a computed token
    c: float = 50e-9          # a KV token attended

    def __post_init__(self):
        for name in ("a", "b", "c"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"step_cost.{name}: expected a number >= 0 (seconds), got {v!r}")

    def of(self, tokens: int, kv_tokens: int) -> float:
        return self.a + self.b * tokens + self.c * kv_tokens if tokens else 0.0

    def scaled(self, length_scale: float) -> StepCost:
        """The cost model for lengths x ``length_scale``: a token stands for ``1 /
        length_scale`` tokens, a step for a step."""
        if not length_scale > 0:
            raise ValueError(f"length_scale: expected > 0, got {length_scale!r}")
        return StepCost(self.a, self.b / length_scale, self.c / length_scale)

    @classmethod
    def parse(cls, value) -> StepCost:
        """A :class:`StepCost`, a ``(a, b, c)`` sequence or ``"a,b,c"`` (seconds)."""
        if isinstance(value, StepCost):
            return value
        if isinstance(value, str):
            try:
                value = [float(x) for x in value.split(",")]
            except ValueError:
                raise ValueError(f"step_cost: expected 'a,b,c' in seconds, got {value!r}") from None
        try:
            a, b, c = value
        except (TypeError, ValueError):
            raise ValueError(f"step_cost: expected three numbers (a, b, c) in seconds, got "
                             f"{value!r}") from None
        return cls(float(a), float(b), float(c))


H200_8B = StepCost()
"""Llama-3-8B's shape in bfloat16 on one H200 (module doc)."""


def check_clock(clock: str) -> str:
    if clock not in CLOCKS:
        raise ValueError(f"clock: expected one of {', '.join(CLOCKS)}, got {clock!r}")
    return clock
