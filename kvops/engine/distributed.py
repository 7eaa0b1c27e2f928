"""The engine under tensor parallelism: one scheduler (rank 0) decides, every rank applies the
same step plan at the frame boundary, and the ranks check that they agree.

Each rank holds a shard of the model (:func:`kvops.models.tp.shard_llama`: ``Hq / tp`` query
and ``Hkv / tp`` KV heads) and a KV manager of the same pages, page size and sessions over its
own heads (the byte budget is the total over the ranks: each rank's is ``bytes // tp``, so a
rank maps as many pages as one process would). Page ids mean the same on every rank, so one
plan serves all of them:

- rank 0 runs the :class:`~kvops.engine.engine.Engine` unchanged over a :class:`KVLog`, which
  records every call that edits the KV manager (``evict_cached``, ``end``, ``commit_step``,
  ``after_step``) by request id, in order, and at each ``commit_step`` broadcasts the log since
  the last one (:class:`StepPlan`: the edits, then the step's ``(rid, start, n)`` items) before
  the step's forward;
- every other rank (:class:`FollowerEngine`) receives the plan, makes the same calls on its
  own KV manager with its own copies of the requests (the scheduler's state changes of an
  admission or a preemption with them), so its pager takes the same trims, aliases and
  reserves in the same frame and its policies (transport trains for its own page bytes,
  fidelity) plan from the same state; then it runs the same forward (the model's collectives
  pair up) and appends the same tokens.

Every ``check_every`` commits and at the end, every rank all-gathers ``(epoch, free pages,
plan hash, table hash)``: the plan hash folds every plan the rank applied and every token it
produced, the table hash is the committed ``block_table`` and ``seq_lens``. Any difference
raises :class:`TPDivergence` on every rank, naming the step, the ranks and the fields.

The control plane (plans, checks) runs on a gloo group, so it never waits on the GPU; the
model's collectives run on the default group (NCCL on CUDA, gloo on CPU).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import pickle
import socket
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from kvops.engine.engine import Engine
from kvops.engine.metrics import summarize
from kvops.engine.request import Request, Status
from kvops.models.tp import check_tp, local_config, shard_llama

CHECK_FIELDS = ("epoch", "free_pages", "plan_hash", "table_hash")


class TPDivergence(RuntimeError):
    """Tensor-parallel ranks no longer hold the same KV state (or produced other tokens)."""


@dataclasses.dataclass
class TPContext:
    """This process's place in the tensor-parallel group: ``rank`` of ``size``, the model's
    ``group`` (NCCL on CUDA), the control plane's ``cpu_group`` (gloo), the ``device``."""

    rank: int
    size: int
    group: object
    cpu_group: object
    device: torch.device
    check_every: int = 16

    def __post_init__(self):
        if not isinstance(self.check_every, int) or self.check_every < 1:
            raise ValueError(f"check_every: expected an int >= 1, got {self.check_every!r}")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def check_model(self, cfg) -> None:
        """``ValueError`` naming ``tp`` when this group's size does not divide ``cfg``'s heads."""
        check_tp(cfg, self.size)

    def shard(self, model):
        """This rank's shard of ``model`` (:func:`~kvops.models.tp.shard_llama`), after
        checking that every rank holds the same full weights (float64 sums of the embedding,
        the first and last layers' projections and the head, all-gathered): ``TPDivergence``
        when a rank loaded or drew other weights."""
        ws = [model.tok_embeddings.weight, model.layers[0].attention.wqkv.weight,
              model.layers[-1].feed_forward.w2.weight, model.output.weight]
        mine = torch.stack([w.sum(dtype=torch.float64) for w in ws]).cpu()
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(rows, mine, group=self.cpu_group)
        bad = [r for r in range(self.size) if not torch.equal(rows[r], rows[0])]
        if bad:
            raise TPDivergence(f"shard: ranks {bad} hold other full weights than rank 0 "
                               f"(weight sums {rows[bad[0]].tolist()} vs {rows[0].tolist()}); "
                               f"every rank must load the same file or draw with the same seed "
                               f"on the same kind of device")
        return shard_llama(model, self.rank, self.size, self.group)

    def local_config(self, cfg):
        return local_config(cfg, self.size)

    def kv_budget(self, budget):
        """This rank's share of a :class:`~kvops.engine.configs.KVBudget` (bytes // tp)."""
        return dataclasses.replace(budget, bytes=budget.bytes // self.size)

    def engine(self, model, kv, decode: str, sched=None, *, graphs: bool | None = None,
               clock: str = "wall", step_cost=None) -> Engine:
        """Rank 0's :class:`LeaderEngine` or another rank's :class:`FollowerEngine`. ``clock``
        and ``step_cost`` drive rank 0's scheduler (the others apply its plans, whatever
        their own clocks say)."""
        if getattr(kv, "fidelity", None) is not None and not isinstance(kv.fidelity, FidelitySync):
            kv.fidelity = FidelitySync(kv.fidelity, self.leader)
        if self.leader:
            return LeaderEngine(model, kv, decode, sched, graphs=graphs, tp=self, clock=clock,
                                step_cost=step_cost)
        return FollowerEngine(model, kv, decode, sched, graphs=graphs, tp=self)


def init(tp: int | None = None, *, rank: int | None = None, device: str | None = None,
         check_every: int = 16, timeout_s: float = 600.0) -> TPContext:
    """Join (or start) the process group: under ``torchrun`` from ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK`` and the rendezvous variables; otherwise ``rank`` of ``tp`` with
    ``MASTER_ADDR`` / ``MASTER_PORT`` already set (:func:`spawn` sets them). NCCL on CUDA (each
    rank on GPU ``LOCAL_RANK``), gloo on CPU; plans and checks always on a gloo group. ``tp``,
    when given, must equal the world size."""
    world = int(os.environ.get("WORLD_SIZE", tp or 1))
    if tp is not None and tp != world:
        raise ValueError(f"tp: expected the world size WORLD_SIZE={world} (torchrun's "
                         f"--nproc-per-node), got tp={tp}")
    rank = int(os.environ.get("RANK", 0 if rank is None else rank))
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TPContext(rank, world, group, cpu_group, dev, check_every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, fn: Callable, tp: int, port: int, args: tuple, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(tp), LOCAL_RANK=str(rank))
    try:
        fn(rank, *args, **kwargs)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    if dist.is_initialized():
        # every rank is past its last collective before any tears its group down (a finished
        # two-rank run once ended with one rank's SIGABRT under load, "terminate called
        # without an active exception", likely a gloo group torn down while its peer sent)
        dist.barrier()
        dist.destroy_process_group()


def spawn(fn: Callable, tp: int, *args, **kwargs) -> None:
    """Run ``fn(rank, *args, **kwargs)`` in ``tp`` processes (``torch.multiprocessing``) with
    the rendezvous variables set, so that :func:`init` joins them; an exception in a rank
    ends the others and is raised here."""
    import torch.multiprocessing as mp

    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: expected a positive int, got {tp!r}")
    mp.spawn(_spawned, args=(fn, tp, free_port(), args, kwargs), nprocs=tp, join=True)


# -- the plan ------------------------------------------------------------------------------------

@dataclasses.dataclass
class StepPlan:
    """What rank 0 decided since the last plan: KV edits in order (``("evict",)``, ``("end",
    rid, keep_prefix)``, ``("after", rids)``, ``("commit", admits, grows)`` with admits
    ``(rid, src, hit, n)`` and grows ``(rid, n)``), the step's items ``(rid, start, n)``, and
    whether the ranks check after applying it (``check``) or stop (``stop``)."""

    edits: list = dataclasses.field(default_factory=list)
    items: list = dataclasses.field(default_factory=list)
    check: bool = False
    stop: bool = False
    fidelity: list = dataclasses.field(default_factory=list)   # FidelityPlans, in step order


def _broadcast(tp: TPContext, plan: StepPlan | None) -> StepPlan:
    box = [plan]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]


def kv_state(kv) -> tuple[int, int, bytes]:
    """``(epoch, free pages, digest of the committed block_table and seq_lens)`` of a KV
    manager (a static arena: commits counted by the engine, its free rows, its lengths)."""
    if kv.kind == "paged":
        t = kv.pager.host_tables
        h = hashlib.blake2b(np.ascontiguousarray(t["block_table"]).tobytes(), digest_size=8)
        h.update(np.ascontiguousarray(t["seq_lens"]).tobytes())
        return kv.pager.epoch, kv.free_pages(), h.digest()
    h = hashlib.blake2b(np.ascontiguousarray(kv._len).tobytes(), digest_size=8)
    h.update(repr(sorted(kv._slot.items())).encode())
    return -1, kv.free_slots(), h.digest()


class _Checker:
    """The rolling plan hash and the all-gather check of one rank."""

    def __init__(self, tp: TPContext, kv):
        self.tp, self.kv = tp, kv
        self.hash = hashlib.blake2b(digest_size=8)
        self.commits = 0

    def fold(self, obj) -> None:
        self.hash.update(pickle.dumps(obj, protocol=4))

    def row(self) -> list[int]:
        epoch, free, tables = kv_state(self.kv)
        as63 = lambda b: int.from_bytes(b, "little") >> 1          # noqa: E731 (fits int64)
        epoch = epoch if epoch >= 0 else self.commits
        return [epoch, free, as63(self.hash.digest()), as63(tables)]

    def check(self, where: str) -> None:
        mine = torch.tensor(self.row(), dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.tp.size)]
        dist.all_gather(rows, mine, group=self.tp.cpu_group)
        rows = torch.stack(rows).tolist()
        bad = [(r, [f for f, a, b in zip(CHECK_FIELDS, rows[0], rows[r]) if a != b])
               for r in range(1, len(rows)) if rows[r] != rows[0]]
        if bad:
            lines = "; ".join(
                f"rank {r} differs in {', '.join(fields)} (" + ", ".join(
                    f"{f} {rows[r][CHECK_FIELDS.index(f)]} vs rank 0's {rows[0][CHECK_FIELDS.index(f)]}"
                    for f in fields) + ")" for r, fields in bad)
            raise TPDivergence(f"tensor-parallel ranks diverged {where} (commit {self.commits}, "
                               f"checked every {self.tp.check_every}): {lines}; the KV state "
                               f"of the ranks is no longer the same, so the replay stops")


class FidelitySync:
    """A :class:`~kvops.runtime.Fidelity` whose decisions are rank 0's: on rank 0 ``step``
    decides and queues its :class:`~kvops.runtime.FidelityPlan` in ``outbox``; on another rank
    ``step`` applies the next plan of ``inbox`` (the same settles, demotions and promotions in
    the same frame; a promotion rank 0 settled is waited for here). The engine carries the
    plans in its :class:`StepPlan` (a KV manager's ``fidelity`` attribute is wrapped by
    :meth:`TPContext.engine`); a program driving pagers itself calls :meth:`exchange` after
    rank 0's frame and before the other ranks'. Every other attribute is the policy's."""

    _OWN = frozenset({"fid", "leader", "outbox", "inbox"})

    def __init__(self, fid, leader: bool):
        self.fid, self.leader = fid, leader
        self.outbox: list = []
        self.inbox: list = []

    def __getattr__(self, name):
        return getattr(self.fid, name)

    def __setattr__(self, name, value):
        # the policy's settings (e.g. an engine setting ``reserve``) go to the policy
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.fid, name, value)

    def step(self, frame, need: int = 0, exclude=()) -> dict:
        """Rank 0: ``Fidelity.step`` (``exclude`` shapes its decisions) and the plan queued;
        another rank: rank 0's next plan applied (what it names, ``exclude`` or not)."""
        if self.leader:
            out = self.fid.step(frame, need, exclude=exclude)
            self.outbox.append(self.fid.last_plan)
            return out
        if not self.inbox:
            raise TPDivergence("fidelity: this rank steps its policy in a frame where rank 0 "
                               "stepped none (no plan of rank 0 is left to apply)")
        return self.fid.step(frame, need, plan=self.inbox.pop(0), exclude=exclude)

    def take(self) -> list:
        """Rank 0: the plans queued since the last take."""
        out, self.outbox = self.outbox, []
        return out

    def exchange(self, tp: TPContext) -> None:
        """Broadcast rank 0's queued plans into every other rank's ``inbox``."""
        box = [self.take() if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
        if not self.leader:
            self.inbox.extend(box[0])


@dataclasses.dataclass(frozen=True)
class _Rid:
    """A request in a logged call's arguments (each rank has its own Request objects)."""
    rid: int


def _encode(x):
    if isinstance(x, Request):
        return _Rid(x.rid)
    if isinstance(x, (list, tuple)):
        return type(x)(_encode(v) for v in x)
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    return x


def _decode(x, by_rid: dict):
    if isinstance(x, _Rid):
        return by_rid[x.rid]
    if isinstance(x, (list, tuple)):
        return type(x)(_decode(v, by_rid) for v in x)
    if isinstance(x, dict):
        return {k: _decode(v, by_rid) for k, v in x.items()}
    return x


class KVLog:
    """Rank 0's KV manager seen through a recorder: the calls that edit it are logged by
    request id (every other attribute is the manager's own); each ``commit_step`` broadcasts
    the log as a :class:`StepPlan` before returning, so the other ranks apply it before the
    step's forward. ``evict_cached``, ``end``, ``commit_step`` and ``after_step`` are logged
    always; a KV manager names its other editing methods in ``tp_edits`` (a tuple of method
    names), whose calls are logged and replayed as they are, requests by id."""

    def __init__(self, kv, tp: TPContext, checker: _Checker):
        self._kv, self._tp, self._checker = kv, tp, checker
        self._edits: list = []

    def __getattr__(self, name):
        attr = getattr(self._kv, name)
        if name in getattr(self._kv, "tp_edits", ()):
            def logged(*args, **kwargs):
                self._edits.append(("call", name, _encode(args), _encode(kwargs)))
                return attr(*args, **kwargs)
            return logged
        return attr

    def __setattr__(self, name, value):
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:                                   # counters the replay resets live on the manager
            setattr(self._kv, name, value)

    def evict_cached(self):
        self._edits.append(("evict",))
        return self._kv.evict_cached()

    def end(self, req: Request, keep_prefix: bool = False) -> None:
        self._edits.append(("end", req.rid, keep_prefix))
        self._kv.end(req, keep_prefix)

    def after_step(self, reqs) -> None:
        self._edits.append(("after", [r.rid for r in reqs]))
        self._kv.after_step(reqs)

    def commit_step(self, admits, grows):
        edit = ("commit", [(r.rid, src, hit, n) for r, src, hit, n in admits],
                [(r.rid, n) for r, n in grows])
        items = [(r.rid, hit, n) for r, _, hit, n in admits] + \
            [(r.rid, r.num_computed, n) for r, n in grows]
        commit = self._kv.commit_step(admits, grows)
        self._edits.append(edit)
        ck = self._checker
        ck.commits += 1
        plan = StepPlan(self._edits, items, check=ck.commits % self._tp.check_every == 0)
        sync = getattr(self._kv, "fidelity", None)
        if isinstance(sync, FidelitySync):
            plan.fidelity = sync.take()
        self._edits = []
        _broadcast(self._tp, plan)
        ck.fold((plan.edits, plan.items, plan.fidelity))
        if plan.check:
            ck.check(f"after commit {ck.commits}")
        return commit

    def flush(self) -> None:
        """The end: the edits since the last commit, then every rank's final check."""
        plan = StepPlan(self._edits, [], check=True, stop=True)
        self._edits = []
        _broadcast(self._tp, plan)
        self._checker.fold((plan.edits, plan.items, plan.fidelity))
        self._checker.check("at the end")


class LeaderEngine(Engine):
    """Rank 0: the :class:`~kvops.engine.engine.Engine` over a :class:`KVLog`; its tokens are
    folded into the plan hash as every rank's are."""

    def __init__(self, model, kv, decode, sched=None, *, graphs=None, tp: TPContext,
                 clock: str = "wall", step_cost=None):
        self.tp, self.checker = tp, _Checker(tp, kv)
        self.log = KVLog(kv, tp, self.checker)
        # overlap off: every rank folds a step's plan, then its tokens, in that order
        super().__init__(model, self.log, decode, sched, graphs=graphs, clock=clock,
                         step_cost=step_cost, overlap=False)
        launch = self.runner.launch

        def launch_and_fold(items):
            got = launch(items)
            self.checker.fold(sorted((r.rid, t) for r, t in got.collect().items()))
            return got

        self.runner.launch = launch_and_fold

    def replay(self, requests: list[Request], progress=None, concurrency=None) -> dict:
        res = super().replay(requests, progress, concurrency)
        self.log.flush()
        return res


class FollowerEngine(Engine):
    """Another rank: applies rank 0's plans to its own KV manager and requests, runs the same
    forwards, and joins every check; :meth:`replay` returns when rank 0's replay ends."""

    def __init__(self, model, kv, decode, sched=None, *, graphs=None, tp: TPContext):
        super().__init__(model, kv, decode, sched, graphs=graphs, overlap=False)
        self.tp, self.checker = tp, _Checker(tp, kv)

    def _serve(self, requests: list[Request], progress=None, concurrency=None,
               eff_bar=None) -> dict:
        """``concurrency`` is rank 0's: its plans carry the admissions (``Engine.replay`` calls
        this, counting the rank's Triton compiles)."""
        by_rid = {r.rid: r for r in requests}
        while True:
            plan = _broadcast(self.tp, None)
            self.apply(plan, by_rid)
            self.checker.fold((plan.edits, plan.items, plan.fidelity))
            if plan.check:
                self.checker.check("at the end" if plan.stop else f"after commit "
                                   f"{self.checker.commits}")
            if plan.stop:
                break
            self.forward(plan.items, by_rid)
        return summarize(requests, self.steps, {"rank": self.tp.rank})

    def apply(self, plan: StepPlan, by_rid: dict) -> None:
        """Make rank 0's KV calls, in order, with this rank's requests (an admission sets what
        the scheduler set; a preemption resets the request for recompute)."""
        kv = self.kv
        sync = getattr(kv, "fidelity", None)
        if isinstance(sync, FidelitySync):
            sync.inbox.extend(plan.fidelity)
        elif plan.fidelity:
            raise TPDivergence("fidelity: rank 0 sent fidelity plans, this rank's KV manager "
                               "has no fidelity policy")
        for edit in plan.edits:
            op = edit[0]
            if op == "evict":
                kv.evict_cached()
            elif op == "end":
                req = by_rid[edit[1]]
                kv.end(req, edit[2])
                if edit[2]:
                    req.status = Status.FINISHED
                else:
                    req.reset_for_recompute()
            elif op == "after":
                kv.after_step([by_rid[rid] for rid in edit[1]])
            elif op == "call":
                _, name, args, kwargs = edit
                if name not in getattr(kv, "tp_edits", ()):
                    raise TPDivergence(f"plan: rank 0 called {name!r} on its KV manager, which "
                                       f"this rank's does not name in tp_edits")
                getattr(kv, name)(*_decode(args, by_rid), **_decode(kwargs, by_rid))
            elif op == "commit":
                admits = []
                for rid, src, hit, n in edit[1]:
                    req = by_rid[rid]
                    req.status, req.num_computed, req.prefix_hit = Status.RUNNING, hit, hit
                    admits.append((req, src, hit, n))
                kv.commit_step(admits, [(by_rid[rid], n) for rid, n in edit[2]])
                self.checker.commits += 1
            else:
                raise ValueError(f"plan: unknown edit {op!r} from rank 0")
        if isinstance(sync, FidelitySync) and sync.inbox:
            raise TPDivergence(f"fidelity: rank 0 stepped its policy {len(sync.inbox)} more "
                               f"time(s) in this plan than this rank")

    def forward(self, items: list, by_rid: dict) -> None:
        if not items:                       # rank 0's engine runs no forward either
            return
        items = [(by_rid[rid], start, n) for rid, start, n in items]
        out = self.runner.run(items)
        self.checker.fold(sorted((r.rid, t) for r, t in out.items()))
        for req, start, n in items:
            req.num_computed = start + n
            tok = out.get(req)
            if tok is not None:
                req.output.append(tok)
                req.token_times.append(self.now())     # this rank's clock (its own metrics)
