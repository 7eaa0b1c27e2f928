"""Continuous batching under a per-step token budget with chunked prefill (vLLM's policy).

Each step: running requests first, in order (a decode takes one token, an unfinished prefill
its next chunk), then waiting requests in arrival order while budget, slots and free pages
last; no chunk is longer than ``long_prefill_tokens``. A running request whose growth finds too
few free pages first ends cached prefixes, then preempts by the policy (recompute: its cache
is dropped and it goes back to the head of the queue), and waits a step for the pages, which
the pager returns at the commit; no waiting request is admitted in such a step. Admission
stops at the first waiting request that does not fit (no overtaking). When every session slot
is taken, cached prefixes are ended, least recently used first, one for each admission: a slot
a frame frees is reusable in that frame (their pages come back at the commit). The prefix an
admission would alias goes last (it then runs without the hit). A request whose
context can never fit is refused when it arrives.

KV managers change three things: ``reclaimable`` pages (``elastic``: pairs demotion can free
in the step's own frame) count as free for growth before any preemption, and for admission
beyond what the running requests need to reach their whole context at BASE cost;
``swaps`` (``offload``) makes preemption a swap to host memory instead of recompute;
``free_pages`` and ``pages_for`` (``reserve``) hold each request's worst case from admission.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvops.engine.request import Request, Status


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512   # tokens a step computes (prefill chunks + decodes)
    max_num_seqs: int = 64              # running requests at most
    long_prefill_tokens: int = 256      # the longest prefill chunk one request takes a step
    preemption: str = "newest"          # a name in PREEMPTION_POLICIES


PREEMPTION_POLICIES: dict[str, Callable[[list[Request]], Request]] = {
    # vLLM: the lowest-priority running request, the one admitted last
    "newest": lambda candidates: candidates[-1],
    # the one holding the most KV (frees the most pages)
    "longest": lambda candidates: max(candidates, key=lambda r: r.num_computed),
}


@dataclass
class StepPlan:
    admits: list[tuple[Request, str | None, int, int]] = field(default_factory=list)
    grows: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def items(self) -> list[tuple[Request, int, int]]:
        """``(request, first position, tokens)`` for every request the step computes."""
        return ([(r, hit, n) for r, _, hit, n in self.admits]
                + [(r, r.num_computed, n) for r, n in self.grows])


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv):
        if cfg.preemption not in PREEMPTION_POLICIES:
            raise ValueError(f"preemption: expected one of {sorted(PREEMPTION_POLICIES)}, got "
                             f"{cfg.preemption!r}")
        if min(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.long_prefill_tokens) < 1:
            raise ValueError(f"scheduler: token budget, max_num_seqs and long_prefill_tokens "
                             f"must be >= 1, got {cfg}")
        self.cfg, self.kv = cfg, kv
        self.policy = PREEMPTION_POLICIES[cfg.preemption]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.refused: list[Request] = []
        self.preemptions = 0

    def add(self, req: Request) -> None:
        reason = self.kv.refuse_reason(req)
        if reason:
            req.status, req.error = Status.REFUSED, reason
            self.refused.append(req)
        else:
            self.waiting.append(req)

    def _preempt(self, req: Request) -> int:
        """Preempt ``req``: swap its K/V out (a KV manager that swaps) or drop it (recompute);
        either way it goes back to the head of the queue. Returns the pages it gives back."""
        self.running.remove(req)
        if self.kv.swaps:
            freed = self.kv.swap_out(req)
            req.preemptions += 1
            req.status = Status.WAITING
        else:
            freed = self.kv.pages_of(req)
            self.kv.end(req)
            req.reset_for_recompute()
        self.waiting.appendleft(req)
        self.preemptions += 1
        return freed

    def schedule(self) -> StepPlan:
        cfg, kv, plan = self.cfg, self.kv, StepPlan()
        budget, free, coming = cfg.max_num_batched_tokens, kv.free_pages(), 0
        reclaim = kv.reclaimable(self.running)     # pages demotion frees in this step's frame
        starved = False                            # a running request waits for pages
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget, cfg.long_prefill_tokens)
            need = kv.pages_for(req, n)
            if need <= free + reclaim:             # demotion first, before any preemption
                took = max(need - free, 0)
                free, reclaim = free - need + took, reclaim - took
                budget -= n
                plan.grows.append((req, n))
                i += 1
                continue
            while need > free + reclaim + coming:  # make room for the next step
                got = kv.evict_cached()
                if got is not None:
                    coming += got
                    continue
                later = self.running[i + 1:]
                if not later:
                    break
                victim = self.policy(later)
                reclaim = max(reclaim - kv.reclaimable([victim]), 0)
                coming += self._preempt(victim)
                plan.preempted.append(victim)
            starved = True
            if need > free + reclaim + coming:     # nothing left to free but itself
                reclaim = max(reclaim - kv.reclaimable([req]), 0)
                self._preempt(req)
                plan.preempted.append(req)
                continue
            i += 1                                 # runs once the pages are back
        slots = kv.free_slots()
        # a KV manager that demotes admits only while its free and demotable pages also cover
        # what every running request still needs at BASE cost (kv.admission_margin; zero for
        # the others), so that growth does not preempt later
        margin = kv.admission_margin(self.running)
        aliased: set = set()                       # prefixes this step's admissions alias
        while (self.waiting and not starved and budget > 0
               and len(self.running) < cfg.max_num_seqs):
            req = self.waiting[0]
            src, hit = kv.prefix_lookup(req)
            if slots < 1:                          # a cached prefix gives its session slot
                mine = hit and src not in aliased  # back in this step's frame (its pages at
                if mine:                           # the commit), not the one req aliases
                    kv.hold_prefix(src)
                got = kv.evict_cached()
                if got is None and mine:           # unless that is the only one: req goes
                    kv.release_prefix(src)         # without its hit
                    got = kv.evict_cached()
                if got is None:
                    break
                slots += 1
                coming += got
                continue
            n = min(req.num_tokens - hit, budget, cfg.long_prefill_tokens)
            need = kv.pages_for(req, n, hit)
            own = kv.admission_margin([req], computed=hit + n)
            if need + margin + own > free + reclaim:
                while need > free + coming:
                    got = kv.evict_cached()
                    if got is None:
                        break
                    coming += got
                break
            took = max(need - free, 0)             # pages this step's demotion frees
            free, reclaim, margin = free - need + took, reclaim - took, margin + own
            self.waiting.popleft()
            restored = kv.swaps and kv.is_swapped(req)   # swap-in: its own K/V, no prefix hit
            req.status = Status.RUNNING
            req.num_computed = hit
            if not restored:
                req.prefix_hit = hit
            budget -= n
            slots -= 1
            self.running.append(req)
            plan.admits.append((req, src, hit, n))
            if hit:                                # a later admission must not evict it
                kv.hold_prefix(src)
                aliased.add(src)
        return plan

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.end(req, keep_prefix=True)
