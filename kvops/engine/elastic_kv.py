"""``elastic``: the ``paged`` configuration with ElasticKV's :class:`~kvops.runtime.Fidelity`
on the pager, over every layer's K and V pool (one allocation, so a demotion batch is one
``pack_base_pairs`` call and a promotion one ``refine_base_pairs`` call for all of them).

A step's frame: the trims, then ``Fidelity.step(frame, need, exclude)`` with ``need`` the pages
the step's reserves take, then the reserves. On a shortage the step demotes pairs (at least
``min_batch``, spread over sessions by BASE share) and their freed pages are reservable in the
same frame; with spare pages beyond the decaying reserve it issues promotions (on CUDA on a
side stream; on the CPU they finish at once) that map back a later step. The scheduler plans
on demotion through :meth:`ElasticKV.reclaimable` (``Fidelity.demotable`` summed over decoding
requests, capped by the host backing; a promoting request counts as settled, since a short step
waits for its promotions), so demotion comes before any preemption.

Which blocks may be BASE
    Decode reads every block through ``elastic_attention``'s structured path (the span table,
    passed every step, so one captured graph serves every state). Prefill chunks run
    ``paged_prefill_attention``, which reads pages as TARGET only, so a request whose prompt
    is not all computed is excluded from demotion (``exclude``) and holds no BASE block while
    it prefills (the runner checks that and raises instead of reading BASE bytes as TARGET).
    A request's BASE blocks are therefore those of its decode phase; it goes back to prefill
    only after a preemption, which ends its session.

Ablations (ElasticKV's Table 3; :data:`ABLATIONS`, configurations ``elastic-<name>``), each
changing one mechanism and nothing else:

- ``watermark``: demotion whenever the free pages left after the step's reserves would fall
  under a fixed watermark (``watermark`` x the pool's pages, 1/8 by default), instead of only
  on a shortage: the step passes ``need + watermark`` to ``Fidelity.step``, which then demotes
  at least ``min_batch`` pairs (a shortage is also under the watermark, so it still demotes
  there; promotion then keeps the watermark free too).
- ``eager-promote``: the decaying reserve is zero at every step (``Fidelity.reserve`` set to 0
  before each step), so promotion spends every spare page at once, pages just freed by a
  demotion included; its other checks (spare pages, ``headroom``, ``max_promote``) stay.
- ``no-promote``: ``max_promote = 0``: a BASE pair stays BASE until its request ends.
- ``general``: mixed batches decode through ``elastic_attention``'s general path (a block
  mode table built from the spans, :func:`kvops.ops.elastic_attention.span_modes`) instead of the
  structured one; TARGET-only batches keep the native path.

Not supported here: prefix sharing (a BASE page is mapped by one session only, and cached
prefixes would need promotion before every alias); ``make_kv`` turns it off for ``elastic``.
"""

from __future__ import annotations

import math
import time

import torch

from kvops.engine.kv import PagedKV, _blocks
from kvops.engine.request import Request
from kvops.runtime import Fidelity

ABLATIONS = {
    "watermark": {"watermark": 0.125},
    "eager-promote": {"eager": True},
    "no-promote": {"fidelity": {"max_promote": 0}},
    "general": {"general": True},
}
"""ElasticKV's ablations (module doc): configuration ``elastic-<name>`` is ``elastic`` with
these :class:`ElasticKV` arguments."""

ABLATION_CONFIGS = tuple(f"elastic-{n}" for n in ABLATIONS)
ELASTIC_CONFIGS = ("elastic", *ABLATION_CONFIGS)


def elastic_arguments(name: str, fidelity: dict | None = None) -> dict:
    """:class:`ElasticKV`'s keyword arguments for configuration ``name`` (``elastic`` or an
    ablation) with the caller's Fidelity settings ``fidelity`` (and ``demote``) under the
    ablation's (the ablation's mechanism wins)."""
    if name not in ELASTIC_CONFIGS:
        raise ValueError(f"config: expected one of {', '.join(ELASTIC_CONFIGS)}, got {name!r}")
    fid = dict(fidelity or {})
    out = {"demote": fid.pop("demote", True)}
    abl = ABLATIONS.get(name.removeprefix("elastic-"), {})
    fid.update(abl.get("fidelity", {}))
    out.update({k: v for k, v in abl.items() if k != "fidelity"}, fidelity=fid)
    return out


class ElasticKV(PagedKV):
    """:class:`PagedKV` (pages only, no prefix sharing) plus a :class:`Fidelity` over its
    pools; ``fidelity`` holds Fidelity's keyword arguments (``codec``, ``min_batch``,
    ``protect_first``, ``protect_recent``, ``reserve_decay``, ``headroom``, ``max_promote``,
    ``host_pairs``, ``host_ahead``) and ``demote=False`` keeps every block TARGET (the policy
    still runs). The ablations' switches (module doc): ``watermark`` (a fraction of the pool's
    pages in [0, 1); 0: demotion on shortage only), ``eager`` (reserve 0 every step) and
    ``general`` (the general decode path for mixed batches)."""

    def __init__(self, *, fidelity: dict | None = None, demote: bool = True,
                 watermark: float = 0.0, eager: bool = False, general: bool = False, **kw):
        if not isinstance(watermark, (int, float)) or not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark: expected a fraction of the pool's pages in [0, 1), "
                             f"got {watermark!r}")
        dtype = kw["dtype"]
        if dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"dtype: the elastic configuration's BASE form needs a float16 or "
                            f"bfloat16 KV cache, got {dtype} (pass --dtype bfloat16)")
        if kw.get("window"):
            raise ValueError(f"window: the elastic configuration has no window arenas, got "
                             f"{kw['window']}")
        kw["prefix_sharing"] = False
        super().__init__(**kw)
        caches = [*self.k_pool.unbind(0), *self.v_pool.unbind(0)]   # consecutive: one pool
        fidelity = dict(fidelity or {})
        # every page may end up a BASE pair: its backing (a page of low bytes for float16, two
        # pages of bfloat16 values for e4m3) is host memory, pinned in chunks of 64 pairs
        fidelity.setdefault("host_pairs", self.pager.num_pages)
        # on CUDA half of it is pinned here, before any step or graph capture, so a step pins
        # nothing until half the pages are BASE pairs (a 256 MiB chunk takes tens of ms)
        cuda = torch.device(self.device).type == "cuda"
        if cuda:
            fidelity.setdefault("host_ahead", fidelity["host_pairs"] // 2)
        self.fidelity = Fidelity(self.pager, caches, **fidelity)
        if cuda:
            self.fidelity.drain()
        self.demote = demote
        self.watermark_pages = math.ceil(watermark * self.pager.num_pages)
        self.eager, self.general = bool(eager), bool(general)
        self.base_touched: set[int] = set()      # rids that had a BASE block at some commit
        self._live: dict[str, Request] = {}
        self.last_fidelity: dict = {"demoted": 0, "promoted": 0, "settled": 0, "fid_s": 0.0}

    @staticmethod
    def _pools(shape, dtype, device):
        """K and V of every layer in one allocation ``[2, layers, P, S, Hkv, D]``."""
        both = torch.zeros((2, *shape), dtype=dtype, device=device)
        return both[0], both[1]

    # -- planning --------------------------------------------------------------------------------
    @staticmethod
    def prefilling(req: Request) -> bool:
        """True while a step of ``req`` may still run a prefill chunk (more than one token):
        its blocks must stay TARGET for ``paged_prefill_attention``."""
        return req.num_computed + 1 < req.num_tokens

    def reclaimable(self, reqs: list[Request]) -> int:
        """Pages demotion can free this step from ``reqs`` (decoding requests only)."""
        if not self.demote:
            return 0
        pairs = sum(self.fidelity.demotable(r.key) for r in reqs if not self.prefilling(r))
        return min(pairs, self.fidelity.host_free)

    def admission_margin(self, reqs: list[Request], computed: int | None = None) -> int:
        """Pages for ``reqs`` to reach their whole context at BASE cost, so the admitted
        requests can finish without a preemption: a page for every prompt block still to be
        computed (it stays TARGET while the prefill reads it), half a page for every later
        block (a grown block pair demotes into one page) and one a request still growing (its
        protected tail and an odd block stay TARGET)."""
        if not self.demote:
            return 0
        S, margin = self.S, 0
        for r in reqs:
            have = _blocks(r.num_computed if computed is None else computed, S)
            prompt, whole = _blocks(len(r.prompt), S), _blocks(r.max_tokens, S)
            full = max(prompt - have, 0)
            rest = max(whole - max(have, prompt), 0)
            if full or rest:
                margin += full + -(-rest // 2) + 1
        return margin

    # -- the frame -------------------------------------------------------------------------------
    def _open(self, f, req, src, hit, n):
        self._live[req.key] = req
        return super()._open(f, req, src, hit, n)

    def _before_reserves(self, f, reserves):
        need = self.fidelity.need(f, [(r.key, n) for r, n in reserves])
        exclude = {k for k, r in self._live.items() if self.prefilling(r)}
        t0 = time.perf_counter()
        if self.eager:
            self.fidelity.reserve = 0.0                  # eager promotion: no protected reserve
        if self.demote:
            got = self.fidelity.step(f, need=need + self.watermark_pages, exclude=exclude)
        else:                                       # never short: promotions only (none)
            got = self.fidelity.step(f, need=0)
        fid_s = time.perf_counter() - t0
        # the scheduler's plan is exact when nothing it counted was preempted after it took
        # pages from it; otherwise the last growths wait a step (never an admission)
        keep = list(reserves)
        while f.free_pages < self.fidelity.need(f, [(r.key, n) for r, n in keep]):
            grows = [i for i, (r, _) in enumerate(keep) if r.key in self.pager.committed.sessions]
            if not grows:
                raise RuntimeError(f"elastic: {f.free_pages} free pages after demotion cannot "
                                   f"hold this step's admissions")
            self.deferred.add(keep.pop(grows[-1])[0])
        self.last_fidelity = {**got, "fid_s": fid_s}
        return keep

    def _after_commit(self, commit, admits) -> None:
        for key in [k for k in self._live if k not in self.pager.committed.sessions]:
            del self._live[key]
        for key, req in self._live.items():
            first, end = self.fidelity.span(key)
            if end > first:
                self.base_touched.add(req.rid)

    def reset_counters(self) -> None:
        super().reset_counters()
        self.base_touched.clear()
        st = self.fidelity.stats
        st.update(demoted=0, promoted=0, demotion_batches=0, exposure_mean=0.0, steps=0)

    def quiesce(self) -> None:
        """Wait for promotions in flight and settle them (orphans' pages come back)."""
        self.fidelity.drain()
