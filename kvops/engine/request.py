"""A request and its lifecycle: what the scheduler, the KV manager and the metrics read.

A request carries its prompt tokens, the number of tokens to generate and, from Mooncake
traces, one ``hash_id`` per 512-token block of its prompt (equal ids are an equal prefix).
``num_computed`` counts the tokens whose K/V is in the cache; each step the scheduler gives a
request ``n`` tokens starting there, and when those reach the end of ``prompt + output`` the
step's logits give the next token. Decode is the case ``n = 1``; preemption by recompute sets
``num_computed`` back to 0, so the next prefill runs over the prompt and the tokens generated
so far, as vLLM does. Token times are kept on three clocks (wall, modeled, engine steps:
:mod:`kvops.engine.clock`); ``arrival`` and ``token_times`` are the engine's driving clock.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from kvops.engine.sampling import SamplingParams, request_seed

HASH_BLOCK = 512
"""Tokens per Mooncake ``hash_id`` block."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REFUSED = "refused"


@dataclass(eq=False)
class Request:
    """One request. ``arrival`` in seconds from the start of the replay; ``output_len`` is the
    number of tokens to generate (replay forces it and ignores EOS); with ``ignore_eos=False``
    generation also stops after ``eos_id``. ``sampling``: how its tokens are picked
    (:class:`~kvops.engine.sampling.SamplingParams`; None: greedy)."""

    rid: int
    arrival: float
    prompt: list[int]
    output_len: int
    hash_ids: tuple[int, ...] = ()
    hash_block: int = HASH_BLOCK         # prompt tokens per hash id (scaled with the lengths)
    ignore_eos: bool = True
    eos_id: int | None = None
    sampling: SamplingParams | None = None
    # state
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    prefix_hit: int = 0                  # tokens aliased from another session at admission
    preemptions: int = 0
    error: str | None = None
    token_times: list[float] = field(default_factory=list)   # each output token, engine clock
    finish_time: float | None = None
    # the same on every clock (kvops.engine.clock): at arrival (when the engine took the
    # request in) and at each output token
    arrival_wall: float = 0.0
    arrival_model: float = 0.0
    arrival_step: int = 0                # engine steps done before it arrived
    token_walls: list[float] = field(default_factory=list)
    token_model: list[float] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)    # the step (1-based) of each token
    _key: tuple[int, str] = field(default=(-1, ""), repr=False)  # (preemptions, key) made

    def __post_init__(self):
        if not self.prompt:
            raise ValueError(f"request {self.rid}: prompt: expected at least one token, got 0")
        if self.output_len < 1:
            raise ValueError(f"request {self.rid}: output_len: expected >= 1, got {self.output_len}")
        if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"request {self.rid}: sampling: expected SamplingParams or None, got "
                             f"{type(self.sampling).__name__}")
        if self.sampling is not None and self.sampling.seed is None:
            self.sampling = dataclasses.replace(self.sampling, seed=request_seed(self.rid))

    @property
    def key(self) -> str:
        """The request's pager session key (a new one after each preemption, since the pager
        takes a key again only in a later frame); made once per preemption count, since the
        scheduler and the KV manager read it a few times a step."""
        made = self._key
        if made[0] != self.preemptions:
            made = self._key = (self.preemptions, f"r{self.rid}.{self.preemptions}")
        return made[1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def max_tokens(self) -> int:
        """Context the request reaches at most: prompt plus every output token but the last
        (the last token is sampled, never fed back)."""
        return len(self.prompt) + self.output_len - 1

    def token(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        return (self.prompt + self.output)[start:stop]

    @property
    def done(self) -> bool:
        if len(self.output) >= self.output_len:
            return True
        return (not self.ignore_eos and self.eos_id is not None and bool(self.output)
                and self.output[-1] == self.eos_id)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the cache is dropped, the tokens stay."""
        self.num_computed = 0
        self.prefix_hit = 0
        self.preemptions += 1
        self.status = Status.WAITING
