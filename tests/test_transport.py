"""Transport: committed view deltas -> ring-window page moves -> trains, checked end to end by
running the committed tables through paged_gather_merged and reading the arena back."""

from __future__ import annotations

import pytest
import torch

import kvops
from kvops.layouts import arena_as_pages, plan_trains
from kvops.runtime import Pager, Transport, apply_copies
from tests.conftest import KERNEL_DEVICES, requires_cuda

S, HKV, D = 8, 1, 16


class Harness:
    """A pool whose token (session tag, position) is written as the K value and its negation as
    the V value; the arena must hold each session's window in ring order after each gather."""

    def __init__(self, device, P=48, B=3, W=24, L=16, copy_tail=True):
        self.device = device
        self.pager = Pager(P, S, B, L, device=device)
        self.tr = Transport(self.pager, W, S * HKV * D * 4, copy_tail=copy_tail)
        self.W = W
        self.k = torch.zeros(P, S, HKV, D, device=device)
        self.v = torch.zeros(P, S, HKV, D, device=device)
        self.k_arena = torch.full((B, W, HKV, D), float("nan"), device=device)
        self.v_arena = torch.full((B, W, HKV, D), float("nan"), device=device)
        self.tags: dict = {}

    def step(self, edits):
        old = {k: self.pager.length(k) for k in self.pager.sessions()}
        with self.pager.frame() as f:
            edits(f)
        apply_copies(self.k, self.v, f.result.copies)
        for key in self.pager.sessions():
            pages = self.pager.pages(key)
            for p in range(old.get(key, 0), self.pager.length(key)):
                if key in old or not self._aliased(key, p):
                    val = self.tags.setdefault(key, len(self.tags) + 1) * 1000 + p
                    self.k[pages[p // S], p % S] = val
                    self.v[pages[p // S], p % S] = -val
                    if not self.tr.copy_tail and key in old:     # the model writes through
                        self.k_arena[self.pager.slot(key), p % self.W] = val
                        self.v_arena[self.pager.slot(key), p % self.W] = -val
        self.gather()
        return f.result.stats["transport"]

    def gather(self):
        """One gather of the committed trains (the graph test swaps in a replay)."""
        dev = self.pager.device_tables
        torch.ops.kvops.paged_gather_merged(self.k, self.v, dev["trains"], dev["num_trains"],
                                            arena_as_pages(self.k_arena, S),
                                            arena_as_pages(self.v_arena, S))

    def _aliased(self, key, p):
        return p < getattr(self, "alias_len", {}).get(key, 0)

    def check_windows(self):
        for key in self.pager.sessions():
            slot = self.pager.slot(key)
            ws, wl = self.tr.window_of(key)
            n = self.pager.length(key)
            assert wl == n - max(0, -(-n // S) - self.W // S) * S
            assert (ws + wl - n) % self.W == 0, "window start and length disagree with ring"
            for p in range(n - wl, n):
                want = self.expected(key, p)
                got_k = self.k_arena[slot, p % self.W, 0, 0].item()
                got_v = self.v_arena[slot, p % self.W, 0, 0].item()
                assert (got_k, got_v) == (want, -want), f"{key} token {p} slot {p % self.W}"

    def expected(self, key, p):
        src = getattr(self, "alias_src", {}).get(key)
        if src is not None and p < self.alias_len[key]:
            return self.expected(src, p)
        return self.tags[key] * 1000 + p


@pytest.fixture(params=[("torch", "cpu")] + [("triton", d) for d in KERNEL_DEVICES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def harness(request):
    impl, device = request.param
    with kvops.backend(impl if device == "cpu" else "auto"):
        yield Harness(torch.device(device))


def test_decode_moves_one_page_per_session_per_step(harness):
    h = harness
    stats = h.step(lambda f: [f.reserve(s, 21) for s in ("a", "b")])
    assert stats["moves"] == 6 and stats["groups"] == 2      # 3 contiguous pages each
    h.check_windows()
    for _ in range(30):
        stats = h.step(lambda f: [f.reserve(s, 1) for s in ("a", "b")])
        assert stats["moves"] == 2 and stats["groups"] == 2
        h.check_windows()
    assert h.pager.length("a") == 51


def test_alias_cow_and_eos(harness):
    h = harness
    h.step(lambda f: f.reserve("a", 29))
    h.alias_src, h.alias_len = {"c": "a"}, {"c": 29}
    stats = h.step(lambda f: (f.alias("c", "a", 29), f.reserve("c", 2), f.reserve("a", 1)))
    # c's window: 3 blocks, its tail copied on write; a's tail gained a token
    assert stats["moves"] == 3 + 1
    h.check_windows()
    assert h.pager.pages("c")[:3] == h.pager.pages("a")[:3]
    assert h.pager.pages("c")[3] != h.pager.pages("a")[3]
    for _ in range(12):
        h.step(lambda f: (f.reserve("a", 1), f.reserve("c", 1)))
        h.check_windows()
    slot = h.pager.slot("a")
    stats = h.step(lambda f: (f.trim("a"), f.trim("c", [0, 1])))
    assert stats["moves"] == 0 and stats["groups"] == 0
    assert h.pager.host_tables["win_len"][slot] == 0
    h.check_windows()


def test_new_session_in_reused_slot_moves_its_whole_window(harness):
    h = harness
    h.step(lambda f: (f.reserve("a", 40), f.reserve("b", 3)))
    slot = h.pager.slot("a")
    h.step(lambda f: f.trim("a"))
    stats = h.step(lambda f: f.reserve("z", 17))
    assert h.pager.slot("z") == slot and stats["moves"] == 3
    h.check_windows()


def test_write_through_moves_only_new_windows_and_remaps(harness):
    """copy_tail=False: the model writes new tokens into the arena, so decode moves nothing;
    an arrival moves its window and a copy-on-write moves the remapped tail."""
    h = Harness(harness.device, copy_tail=False)
    stats = h.step(lambda f: (f.reserve("a", 21), f.reserve("b", 5)))
    assert stats["moves"] == 3 + 1
    for _ in range(20):
        stats = h.step(lambda f: [f.reserve(s, 1) for s in ("a", "b")])
        assert stats["moves"] == 0 and stats["groups"] == 0
        h.check_windows()
    h.alias_src, h.alias_len = {"c": "a"}, {"c": 41}
    stats = h.step(lambda f: (f.alias("c", "a", 41), f.reserve("a", 1)))
    # c's window (3 blocks) moves; a's shared tail is copied on write and moved once
    assert stats["moves"] == 3 + 1
    h.check_windows()


def test_stats_match_planner_and_tables():
    pager = Pager(64, 16, 4, 8)
    tr = Transport(pager, 64, 32768)
    with pager.frame() as f:
        for s in range(4):
            f.reserve(s, 50)
    stats = f.result.stats["transport"]
    moves_src, moves_dst = [], []
    for s in range(4):
        for j, page in enumerate(pager.pages(s)):
            moves_src.append(page)
            moves_dst.append(pager.slot(s) * 4 + j % 4)
    order = sorted(range(len(moves_src)), key=lambda i: moves_dst[i])
    trains, want = plan_trains([moves_src[i] for i in order], [moves_dst[i] for i in order],
                               32768)
    assert stats == dict(want, moves=16)
    n = want["groups"]
    assert pager.host_tables["num_trains"][0] == n
    assert pager.host_tables["trains"][:n].tolist() == trains.tolist()
    assert tr.arena_pages == 16


def test_bad_window_raises():
    with pytest.raises(ValueError, match="multiple of the page size"):
        Transport(Pager(8, 16, 2, 4), 40, 1024)


@requires_cuda
def test_one_captured_gather_follows_every_commit():
    """The gather is captured once on the pager's device tables; each step only commits a
    frame (one upload) and replays the graph, and the arena follows the moving mappings."""
    h = Harness(torch.device("cuda"), P=64, B=3, W=24, L=16)
    h.step(lambda f: (f.reserve("a", 9), f.reserve("b", 2)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        h.gather()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h.gather()
    h.gather = graph.replay
    h.alias_src, h.alias_len = {"c": "a"}, {"c": 30}
    for t in range(40):
        if t == 21:
            h.step(lambda f: (f.alias("c", "a", 30), f.reserve("c", 1), f.trim("b")))
        else:
            h.step(lambda f: [f.reserve(k, 1) for k in h.pager.sessions()])
        torch.cuda.synchronize()
        h.check_windows()



def test_window_tables_drive_static_sliding_attention():
    """Attention over the gathered arena with the committed win_start/win_len equals softmax
    attention over each session's visible tokens read straight from the pool."""
    gen = torch.Generator().manual_seed(4)
    P, B, W, L, Hkv, G, Dh = 40, 3, 32, 12, 2, 2, 16
    pager = Pager(P, S, B, L, device="cpu")
    Transport(pager, W, S * Hkv * Dh * 4)
    k = torch.randn(P, S, Hkv, Dh, generator=gen)
    v = torch.randn(P, S, Hkv, Dh, generator=gen)
    k_arena, v_arena = torch.zeros(B, W, Hkv, Dh), torch.zeros(B, W, Hkv, Dh)
    lengths = {"a": 5, "b": 29, "c": 0}
    pager.frame().commit()                  # an empty first step fixes the device tables
    dev = pager.device_tables
    for step in range(31):
        with pager.frame() as f:
            for key in ("a", "b"):
                f.reserve(key, lengths[key] if step == 0 else 1)
                lengths[key] += 0 if step == 0 else 1
            if step == 10:
                f.alias("c", "b", 36)
                lengths["c"] = 36
        torch.ops.kvops.paged_gather_merged(k, v, dev["trains"], dev["num_trains"],
                                            arena_as_pages(k_arena, S),
                                            arena_as_pages(v_arena, S))
        q = torch.randn(B, Hkv * G, Dh, generator=gen)
        out, _ = torch.ops.kvops.static_sliding_attention(q, k_arena, v_arena,
                                                          dev["win_start"], dev["win_len"])
        for key in pager.sessions():
            slot, n = pager.slot(key), lengths[key]
            pages = pager.pages(key)
            first = max(0, -(-n // S) - W // S) * S
            toks = torch.stack([k[pages[p // S], p % S] for p in range(first, n)])
            vals = torch.stack([v[pages[p // S], p % S] for p in range(first, n)])
            qs = q[slot].view(Hkv, G, Dh).double()
            logits = torch.einsum("hgd,nhd->hgn", qs, toks.double()) * Dh ** -0.5
            want = torch.einsum("hgn,nhd->hgd", logits.softmax(-1), vals.double())
            torch.testing.assert_close(out[slot].double(), want.reshape(Hkv * G, Dh),
                                       atol=1e-5, rtol=1e-5)
