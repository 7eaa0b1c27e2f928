"""The engine loop: arrivals, schedule, one frame commit, the forwards, the new tokens.

    while requests remain:
        admit the requests that have arrived            (refused when they can never fit)
        plan = scheduler.schedule()                     (budget, chunks, pages, preemption)
        kv.commit_step(plan)                            (one Frame: trims, aliases, reserves)
        collect the last step's tokens                  (overlap: it ran during the above)
        runner.launch(plan.items())                     (prefill chunks, then decodes)
        count the step's tokens; finished requests end  (their trims go into the next frame)

With ``overlap`` (the default on CUDA) a step's device work runs while the host schedules and
commits the next one, as vLLM's asynchronous scheduling and SGLang's overlap scheduler do: a
request's context grows by the step's tokens when they are launched, before their values are
known, and a request that reaches its output length ends then; the values are collected
before the next launch, which reads them. Every queue on the device is the current stream, so
the next commit's table upload and copies run after the step that reads the old tables. Steps
whose requests may stop on EOS (``ignore_eos=False``), where the end depends on the value,
collect at once. Without ``overlap`` each step collects its own tokens (the order of a
synchronous engine); the tokens are the same either way, and so is every modeled and step
time (a closed loop on the wall clock sends a client's next request once its last token is
collected, one step later than a synchronous engine would). ``StepRecord.control_exposed_s``
is the control plane's time on the critical path: all of it unless the previous step's device
work was still running when the commit ended (then none); an upper bound, since the GPU may go
idle partway through the control plane.

The driving clock (``clock``) is wall time since the replay started (``"wall"``) or modeled
time (``"model"``: the sum of :class:`~kvops.engine.clock.StepCost` over the steps so far,
the same on every machine); while nothing is in flight it jumps to the next arrival (no
request waits then, so no latency changes). Every token is also stamped on the other clock
and with its step (:mod:`kvops.engine.clock`); a token's wall time is when the host has it.
"""

from __future__ import annotations

import time

from kvops.engine.clock import H200_8B, StepCost, check_clock
from kvops.engine.compiles import TritonCompiles
from kvops.engine.metrics import EFF_TBT_S, EFF_TTFT_S, StepRecord, eff_upper, summarize
from kvops.engine.request import Request, Status
from kvops.engine.runner import Launched, ModelRunner
from kvops.engine.scheduler import Scheduler, SchedulerConfig

# steps between two looks at whether a replay with an Eff@300 bar can still reach it
EFF_CHECK_STEPS = 8


class _Pending:
    """A launched step whose tokens the host has not read: the requests it gives a token
    (each with the index of its placeholder in ``output``), and its modeled time and index."""

    __slots__ = ("launched", "produced", "modeled", "index")

    def __init__(self, launched: Launched | None, produced: list, modeled: float, index: int):
        self.launched, self.produced, self.modeled, self.index = launched, produced, modeled, index


class Engine:
    def __init__(self, model, kv, decode: str, sched: SchedulerConfig | None = None, *,
                 graphs: bool | None = None, clock: str = "wall",
                 step_cost: StepCost | None = None, overlap: bool | None = None):
        self.model, self.kv = model, kv
        self.clock = check_clock(clock)
        self.step_cost = StepCost.parse(step_cost) if step_cost is not None else H200_8B
        self.model_t = 0.0                  # modeled seconds of the steps so far
        self.eff = (EFF_TTFT_S, EFF_TBT_S)  # Eff@300's thresholds (s)
        self.scheduler = Scheduler(sched or SchedulerConfig(), kv)
        self.runner = ModelRunner(model, kv, decode, graphs=graphs)
        if overlap is None:
            overlap = self.runner.device.type == "cuda"
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap: expected a bool or None, got {overlap!r}")
        self.overlap = overlap
        self._pending: _Pending | None = None
        self._timed: list[tuple[StepRecord, object, object]] = []   # (record, start, end)
        self.steps: list[StepRecord] = []
        self._t0 = time.perf_counter()
        self._skip = 0.0

    def wall(self) -> float:
        """Wall seconds since the replay started (with the idle jumps under the wall clock)."""
        return time.perf_counter() - self._t0 + (self._skip if self.clock == "wall" else 0.0)

    def modeled(self) -> float:
        """Modeled seconds since the replay started (with the idle jumps under the model
        clock)."""
        return self.model_t + (self._skip if self.clock == "model" else 0.0)

    def now(self) -> float:
        """The driving clock."""
        return self.modeled() if self.clock == "model" else self.wall()

    def arrive(self, req: Request) -> None:
        """Stamp ``req``'s arrival on every clock (the engine takes it in now)."""
        req.arrival_step = len(self.steps)
        req.arrival_wall = req.arrival if self.clock == "wall" else self.wall()
        req.arrival_model = req.arrival if self.clock == "model" else self.modeled()

    def step(self) -> StepRecord:
        sched, kv = self.scheduler, self.kv
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        kv.commit_step(plan.admits, plan.grows)
        t2 = time.perf_counter()
        prev = self._pending
        hidden = prev is not None and prev.launched is not None and not prev.launched.ready()
        self.collect()                      # the previous step's tokens (overlap)
        items = [it for it in plan.items() if it[0] not in kv.deferred]
        launched = self.runner.launch(items) if items else None
        tokens = sum(n for _, _, n in items)
        kv_tokens = sum(start + n for _, start, n in items)
        cost = self.step_cost.of(tokens, kv_tokens)
        self.model_t += cost
        produced = []
        for req, start, n in items:
            gives = start + n == req.num_tokens     # the step's logits give the next token
            req.num_computed = start + n
            if gives:
                req.output.append(None)             # its value comes with collect()
                produced.append((req, len(req.output) - 1))
        self.produced = len(produced)
        self._pending = _Pending(launched, produced, self.modeled(), len(self.steps) + 1)
        if not self.overlap or any(not r.ignore_eos for r, _ in produced):
            self.collect()                  # the end may depend on the value (EOS)
        else:
            for req, _ in produced:         # the output length ends it
                if req.done:
                    req.status = Status.FINISHED
                    sched.finish(req)
        kv.after_step([r for r, _, _ in items if r.status is Status.RUNNING])
        used = sum(r.num_computed for r in sched.running) * kv.token_bytes
        d = kv.dma()
        fid = getattr(kv, "fidelity", None)
        el = {}
        if fid is not None:
            got = kv.last_fidelity
            el = dict(base_blocks=fid.stats["base_blocks"], exposure=fid.stats["exposure"],
                      demoted=got["demoted"], promoted=got["promoted"], settled=got["settled"],
                      fidelity_s=got["fid_s"], **fid.last_times)
        rec = StepRecord(
            t=self.now(), step_s=time.perf_counter() - t0, schedule_s=t1 - t0, commit_s=t2 - t1,
            control_exposed_s=0.0 if hidden else t2 - t0,
            running=len(sched.running), waiting=len(sched.waiting),
            tokens=tokens, decodes=sum(n == 1 for _, _, n in items), kv_tokens=kv_tokens,
            model_s=cost, path=self.runner.last_path if items else "",
            reserved_bytes=kv.reserved_bytes(), used_bytes=used, groups=d["groups"],
            moving_sessions=d["sessions"], train_bytes=d["bytes"], far_groups=d["far_groups"],
            preempted=len(plan.preempted), **el)
        self.steps.append(rec)
        if launched is not None:
            start, end = launched.events()
            if start is not None:
                self._timed.append((rec, start, end))
        return rec

    def settle_timings(self) -> None:
        """Fill ``device_s`` (the stream from the step's first queued work to its tokens
        back, including any wait within the step for the host's launches) and ``gap_s`` (the
        stream between the previous timed step's end and this step's start: the host's time
        with nothing queued, and the commit's own copies: table uploads, copy-on-write,
        demotion packs, swaps) of the steps timed so far, from their CUDA events; waits for
        the device. CPU steps keep 0."""
        if not self._timed:
            return
        self._timed[-1][2].synchronize()
        prev = None
        for rec, start, end in self._timed:
            rec.device_s = start.elapsed_time(end) / 1e3
            rec.gap_s = max(prev.elapsed_time(start) / 1e3, 0.0) if prev is not None else 0.0
            prev = end
        self._timed = []

    def collect(self) -> None:
        """Read the launched step's tokens into its requests' outputs and stamp them (the
        wall clock when the host has them; the modeled clock and the step of the launch);
        a request whose token ends it finishes (at once, if :meth:`step` has not ended it)."""
        pend, self._pending = self._pending, None
        if pend is None or not pend.produced:
            return
        toks = pend.launched.collect()
        wall = self.wall()
        t = pend.modeled if self.clock == "model" else wall
        for req, i in pend.produced:
            req.output[i] = toks[req]
            req.token_times.append(t)
            req.token_walls.append(wall)
            req.token_model.append(pend.modeled)
            req.token_steps.append(pend.index)
            if req.done:
                if req.status is Status.RUNNING:
                    req.status = Status.FINISHED
                    self.scheduler.finish(req)
                req.finish_time = t

    def awaiting(self) -> int:
        """Requests that have ended whose last token the host has not collected (overlap), on
        the wall clock: a closed-loop client sends its next request once it has that token.
        On the modeled clock the token's time is its step's, so a client may send then, as
        it would from a synchronous engine (the modeled clock has no overlap)."""
        pend = self._pending
        if pend is None or self.clock == "model":
            return 0
        return sum(r.status is Status.FINISHED for r, _ in pend.produced)

    def drain(self) -> None:
        """Collect the last step's tokens, end every cached prefix and commit, so the pool is
        as it started."""
        self.collect()
        self.settle_timings()
        while self.kv.evict_cached() is not None:
            pass
        self.kv.quiesce()
        self.kv.commit_step([], [])

    def replay(self, requests: list[Request], progress=None, concurrency: int | None = None,
               eff_bar: float | None = None) -> dict:
        """Serve ``requests`` at their arrival times; returns :func:`summarize`'s metrics.
        ``concurrency``: a closed loop of that many clients (vLLM ``bench serve
        --max-concurrency``): a request is sent, and its arrival set to the clock, once it has
        arrived and fewer than ``concurrency`` are in flight. ``eff_bar``: stop, every
        ``EFF_CHECK_STEPS`` steps, once the requests' Eff@300 can no longer reach it
        (:func:`~kvops.engine.metrics.eff_upper` below it): the unfinished requests end
        unserved, and the metrics give ``stopped_s`` (the engine clock then) and
        ``eff_upper`` (the bound; both None without a stop). ``compiles``: the Triton kernels
        compiled while it ran (:mod:`kvops.engine.compiles`; after a warm-up, 0 is the goal),
        and ``compiled`` their names."""
        with TritonCompiles() as jit:
            res = self._serve(requests, progress, concurrency, eff_bar)
        res["compiles"], res["compiled"] = jit.count, dict(jit.names)
        return res

    def _serve(self, requests, progress, concurrency, eff_bar) -> dict:
        if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
            raise ValueError(f"concurrency: expected an int >= 1 or None, got {concurrency!r}")
        if eff_bar is not None and not 0.0 <= eff_bar <= 1.0:
            raise ValueError(f"eff_bar: expected a share in [0, 1] or None, got {eff_bar!r}")
        stopped = bound = None
        pending = sorted(requests, key=lambda r: (r.arrival, r.rid))
        sched, i = self.scheduler, 0
        self._t0, self._skip, self.model_t = time.perf_counter(), 0.0, 0.0
        while i < len(pending) or sched.waiting or sched.running:
            now = self.now()
            while i < len(pending) and pending[i].arrival <= now:
                if concurrency is not None:
                    if len(sched.waiting) + len(sched.running) + self.awaiting() >= concurrency:
                        break
                    pending[i].arrival = now
                self.arrive(pending[i])
                sched.add(pending[i])
                i += 1
            if not sched.waiting and not sched.running:
                if self._pending is not None:   # the last tokens come in before time jumps
                    self.collect()
                    continue
                if i < len(pending):
                    self._skip += pending[i].arrival - now
                continue
            self.step()
            if progress is not None:
                progress.update(self.produced)
            if eff_bar is not None and len(self.steps) % EFF_CHECK_STEPS == 0:
                now = self.now()
                bound = eff_upper(requests, now, *self.eff, unsent=pending[i:])
                if bound < eff_bar:
                    stopped = now
                    break
        if stopped is not None:     # the requests left end unserved, their pages given back
            self.collect()
            for req in list(sched.running):
                sched.finish(req)
            if self.kv.swaps:       # a swapped-out request's host copy goes with it
                for req in sched.waiting:
                    self.kv.forget(req)
            sched.waiting.clear()
        self.drain()
        extra = {"prefix_hit_tokens": self.kv.prefix_hit_tokens,
                 "cow_copies": self.kv.cow_copies,
                 "graph_captures": self.runner.captures,
                 "recaptures": self.runner.captures - self.runner.graphs_held
                 if self.runner.graphs else 0,
                 "decode_buckets": sorted(self.runner.buckets_used),
                 "decode_paths": dict(self.runner.paths), "clock": self.clock,
                 "kv_free_pages_end": self.kv.free_pages() if self.kv.kind == "paged" else None,
                 "cached_prefix_sessions_end": self.kv.cached_sessions(),
                 "stopped_s": stopped, "eff_upper": None if stopped is None else bound}
        if getattr(self.kv, "swaps", False):
            extra.update(swap_outs=self.kv.swap_outs, swap_ins=self.kv.swap_ins,
                         swap_gib=self.kv.swap_bytes / 2**30)
        if self.runner.retrieval is not None:      # kvrm-ret: the decode steps that chose
            extra.update(far_choices=self.runner.selections)
        if getattr(self.kv, "fidelity", None) is not None:
            extra.update(base_requests=len(self.kv.base_touched),
                         promoted_pairs=self.kv.fidelity.stats["promoted"],
                         demoted_pairs=self.kv.fidelity.stats["demoted"])
        return summarize(requests, self.steps, extra, eff=self.eff)
