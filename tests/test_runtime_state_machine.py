"""A seeded random driver that mixes every verb and policy on one pager and checks real bytes.

Each step opens a frame and draws a mix of: prefills, decode growth, aliases of committed
prefixes, cold-block trims, EOS, ``Fidelity.step`` (demotion on shortage with the ``need`` of
the reserves to come, promotion otherwise), ``Fidelity.promote``, requests too large for the
pool (``OutOfPages`` from the verb, then a smaller retry) and edits the policy refuses
(``ValueError``); some frames raise at a random point and abort. After every committed frame
the driver runs the commit's copies, writes each reserved token's K/V, runs the transport's
``paged_gather_merged`` into the window arena, and checks, against a shadow of every session's
true tokens:

- every session's rows read through the committed tables (``elastic_rows``: BASE blocks as the
  codec decodes them, TARGET blocks bit for bit), reference counts against the mappings;
- every window slot of the arena (what ``static_sliding_attention`` reads) holds the session's
  true tokens, bit for bit;
- with the far view instead of the fidelity policy: the chunk pages each session's leave row
  names are that session's own pages for that chunk, and ``absorb`` stores their mean.

After an aborted or refused frame, the pool bytes of live pages, the tables and the policy
state are as before.
"""

from __future__ import annotations

import random

import pytest
import torch

import kvops  # noqa: F401  (registers the ops)
from kvops.layouts import arena_as_pages
from kvops.runtime import FarView, OutOfPages, Pager, Transport
from tests.test_fidelity import World

HKV, D = 2, 16
S, W = 8, 16                    # page size, window tokens (2 blocks)
NW = W // S


class _Abort(Exception):
    pass


class Driver:
    def __init__(self, seed: int, far: bool):
        self.rng = random.Random(seed)
        self.far = far
        if far:
            self.w = None
            self.pager = Pager(40, S, 5, 16, device="cpu")
            self.k = torch.randn(40, S, HKV, D).to(torch.float16)
            self.v = torch.randn(40, S, HKV, D).to(torch.float16)
            self.tr = Transport(self.pager, W, S * HKV * D * 2)
            self.fv = FarView(self.pager, window_tokens=W, chunk_tokens=2 * S, cap=2,
                              num_layers=1, num_kv_heads=HKV, head_dim=D, dtype=torch.float32,
                              max_leave=1)
            self.truth: dict = {}
        else:
            self.w = World(P=28, S=S, B=5, L=16, min_batch=2, protect_recent=NW)
            self.pager, self.k, self.v, self.truth = self.w.pager, self.w.k, self.w.v, \
                self.w.truth
            self.tr = Transport(self.pager, W, S * HKV * D * 2)
        B = self.pager.max_sessions
        self.k_arena = torch.zeros(B, W, HKV, D, dtype=torch.float16)
        self.v_arena = torch.zeros(B, W, HKV, D, dtype=torch.float16)
        self.next_key = 0

    # -- one frame -----------------------------------------------------------------------------
    def frame(self):
        rng, pager = self.rng, self.pager
        abort_at = rng.randrange(12) if rng.random() < 0.2 else -1
        snap = self.snapshot()
        f = pager.frame()
        grown: list[tuple] = []
        ops = 0
        try:
            live = [k for k in pager.sessions()]
            plan = {}
            for key in live:
                if rng.random() < 0.7:
                    plan[key] = 1 if rng.random() < 0.8 else rng.randrange(2, 3 * S)
            if rng.random() < 0.5 and len(live) + 1 < pager.max_sessions:
                plan[("s", self.next_key)] = rng.randrange(1, 8 * S)
                self.next_key += 1
            step = self.w is not None and rng.random() < 0.8
            early = rng.random() < 0.6      # before the reserves (its need), or after them
            if step and early:
                need = self.w.fid.need(f, plan)
                self.w.fid.step(f, need=need + rng.randrange(0, 8))
            for key in list(plan):
                ops += 1
                if ops == abort_at:
                    raise _Abort
                grown.extend(self._reserve(f, key, plan[key]))
            if step and not early:          # copies the reserves made must read TARGET
                self.w.fid.step(f, need=f.free_pages + rng.randrange(0, 8))
            for _ in range(rng.randrange(3)):
                ops += 1
                if ops == abort_at:
                    raise _Abort
                self._other(f, grown)
            if rng.random() < 0.05:
                f.reserve(("huge", self.next_key), pager.num_pages * S)     # OutOfPages
        except OutOfPages:
            f.abort()
            self.unchanged(snap)
            return
        except _Abort:
            f.abort()
            self.unchanged(snap)
            return
        except ValueError:              # a refused edit: the frame is dropped
            f.abort()
            self.unchanged(snap)
            return
        try:
            f.commit()
        except ValueError:              # refused at commit by a policy
            assert f.aborted
            self.unchanged(snap)
            return
        self.after_commit(f, grown)

    def _reserve(self, f, key, n):
        old = f.length(key) if f.has(key) else 0
        try:
            f.reserve(key, n)
        except OutOfPages:
            if n == 1:
                raise
            return self._reserve(f, key, 1) if f.free_pages else []
        kv = torch.randn(2, n, HKV, D).to(torch.float16)
        self.events.append(("grow", key, old, old + n, kv))
        return [(key, old, old + n)]

    def _other(self, f, grown):
        rng, pager = self.rng, self.pager
        live = [k for k in pager.sessions() if f.has(k)]
        if not live:
            return
        key = rng.choice(live)
        what = rng.random()
        if what < 0.3 and len(pager.sessions()) + 1 < pager.max_sessions:
            n = pager.length(key) if rng.random() < 0.4 else \
                rng.randrange(0, pager.length(key) + 1)
            dst = ("a", self.next_key)
            self.next_key += 1
            f.alias(dst, key, n)
            self.events.append(("alias", dst, key, n))
            if rng.random() < 0.5:          # a write into the alias in its own frame
                try:
                    grown.extend(self._reserve(f, dst, rng.randrange(1, S + 1)))
                except ValueError as e:     # its tail holds tokens written in this frame
                    assert "written in this frame" in str(e)
            if rng.random() < 0.6:          # a fork of the fork, written in the same frame
                dst2 = ("a", self.next_key)
                self.next_key += 1
                if len(pager.sessions()) + 2 < pager.max_sessions:
                    m = n if rng.random() < 0.5 else rng.randrange(0, f.length(dst) + 1)
                    f.alias(dst2, dst, m)
                    self.events.append(("alias", dst2, dst, m))
                    try:
                        grown.extend(self._reserve(f, dst2, 1))
                    except ValueError as e:
                        assert "written in this frame" in str(e)
        elif what < 0.55:
            nb = -(-f.length(key) // S)
            cold = [j for j in range(max(0, nb - NW - 1)) if rng.random() < 0.3]
            if cold:
                f.trim(key, cold)
        elif what < 0.62 and all(g[0] != key for g in grown):
            f.trim(key)
            self.events.append(("end", key))
        elif self.w is not None:
            self.w.fid.promote(f, key)

    # -- after the commit: copies, writes, the transport's gather, checks ---------------------
    def after_commit(self, f, grown):
        from kvops.runtime import apply_copies
        apply_copies(self.k, self.v, f.result.copies)
        # the shadow follows the verbs in the order they ran; then the step writes its tokens
        for ev in self.events:
            if ev[0] == "alias":
                _, dst, src, n = ev
                tk, tv = self.truth[src]
                self.truth[dst] = (tk[:n], tv[:n])
            elif ev[0] == "end":
                self.truth.pop(ev[1])
            else:
                _, key, old, new, kv = ev
                tk, tv = self.truth.get(key, (kv[0, :0], kv[1, :0]))
                assert len(tk) == old
                self.truth[key] = (torch.cat([tk, kv[0]]), torch.cat([tv, kv[1]]))
        for ev in self.events:
            if ev[0] != "grow":
                continue
            _, key, old, new, kv = ev
            pages = self.pager.pages(key)
            for t in range(old, new):
                if pages[t // S] >= 0:      # a block trimmed in the frame takes no write
                    self.k[pages[t // S], t % S] = kv[0, t - old]
                    self.v[pages[t // S], t % S] = kv[1, t - old]
        t = self.pager.device_tables
        torch.ops.kvops.paged_gather_merged(self.k, self.v, t["trains"], t["num_trains"],
                                            arena_as_pages(self.k_arena, S),
                                            arena_as_pages(self.v_arena, S))
        self.check()

    def check(self):
        pager = self.pager
        assert set(self.truth) == set(pager.sessions())
        if self.w is not None:
            self.w.check_all()
        else:                           # every session's rows through the committed tables
            bt = pager.host_tables["block_table"]
            for key in pager.sessions():
                slot, n = pager.slot(key), pager.length(key)
                tk, tv = self.truth[key]
                for t in range(n):
                    page = int(bt[slot, t // S])
                    if page >= 0:
                        assert torch.equal(self.k[page, t % S], tk[t]), (key, t)
                        assert torch.equal(self.v[page, t % S], tv[t]), (key, t)
        for key in pager.sessions():
            n, slot = pager.length(key), pager.slot(key)
            tk, tv = self.truth[key]
            assert len(tk) == n
            start, length = self.tr.window_of(key)
            assert length == min(n, n - max(0, -(-n // S) - NW) * S)
            pages = pager.pages(key)
            for p in range(n - length, n):
                if pages[p // S] < 0:
                    continue
                assert torch.equal(self.k_arena[slot, p % W], tk[p]), (key, p)
                assert torch.equal(self.v_arena[slot, p % W], tv[p]), (key, p)
        if self.far:
            self.check_far()

    def check_far(self):
        fv, pager = self.fv, self.pager
        rows = pager.host_tables["far_leave_pages"]
        ids = pager.host_tables["far_leave_ids"]
        for key in pager.sessions():
            slot = pager.slot(key)
            j = int(ids[slot])
            if j == fv.J:
                continue
            pages = pager.pages(key)
            assert rows[slot].tolist() == pages[j * fv.M:(j + 1) * fv.M], (key, j)
        fv.absorb(0, self.k.float(), self.v.float())
        for key in pager.sessions():
            slot = pager.slot(key)
            j = int(ids[slot])
            if j != fv.J:
                tv = self.truth[key][1][j * fv.M * S:(j + 1) * fv.M * S].float().mean(0)
                torch.testing.assert_close(fv.v_store[0, slot, j], tv, atol=1e-3, rtol=1e-3)
        # each row shows min(C, summaries) distinct chunks of its own session's summaries
        sel = pager.host_tables["far_select"].reshape(pager.max_sessions, fv.C)
        for key in pager.sessions():
            slot = pager.slot(key)
            row, have = [j for j in sel[slot].tolist() if j >= 0], set(fv.summarized(slot))
            assert len(set(row)) == len(row) and set(row) <= have, (key, row, have)
            assert len(row) == min(len(have), fv.C), (key, row, have)
        if self.rng.random() < 0.3:     # a pull of utilities (ties on purpose), ranked by
            fv.scores.copy_(torch.randint(0, 3, fv.scores.shape).float())   # the next commit
            fv.pull_scores()

    # -- what an aborted frame keeps ------------------------------------------------------------
    def snapshot(self):
        self.events = []
        pager = self.pager
        live = [p for p in range(pager.num_pages) if pager.refcount(p)]
        tables = {name: t.copy() for name, t in pager.host_tables.items()}
        state = (live, self.k[live].clone(), self.v[live].clone(), tables,
                 {key: pager.pages(key) for key in pager.sessions()}, pager.free_pages,
                 pager.epoch, self.k_arena.clone())
        return state, (self.w.snapshot() if self.w is not None and pager.epoch else None)

    def unchanged(self, snap):
        (live, k, v, tables, views, free, epoch, arena), wsnap = snap
        pager = self.pager
        assert [p for p in range(pager.num_pages) if pager.refcount(p)] == live
        assert torch.equal(self.k[live], k) and torch.equal(self.v[live], v)
        for name, t in pager.host_tables.items():
            assert (t == tables[name]).all(), name
        assert {key: pager.pages(key) for key in pager.sessions()} == views
        assert (pager.free_pages, pager.epoch) == (free, epoch)
        if wsnap is not None:
            self.w.unchanged(wsnap)
        self.check()


@pytest.mark.parametrize("far", [False, True], ids=["transport+fidelity", "transport+far-view"])
@pytest.mark.parametrize("seed", range(4))
def test_every_verb_and_policy_mixed_keeps_every_byte(seed, far):
    with kvops.backend("torch"):
        d = Driver(seed, far)
        for _ in range(80):
            d.frame()
