"""KV-RM's step loop in miniature: pager frames, merged gather, fixed-shape attention.

Sessions arrive, decode and finish; every step is one Frame (reserve / alias / trim) whose
commit uploads the block table, the step's copy trains and the window bounds in one copy; one
``paged_gather_merged`` moves the changed pages into the ring arena and
``static_sliding_attention`` runs over it, shapes never changing. Each step is checked against
attention computed straight from the pool. Runs on the CPU in a few seconds:

    python examples/paged_window_step.py            # add --device cuda on a GPU
"""

from __future__ import annotations

import argparse

import torch

import kvops  # noqa: F401  (registers torch.ops.kvops.*)
from kvops.layouts import PagedGeometry, arena_as_pages
from kvops.runtime import Pager, Transport, apply_copies


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    dev = torch.device(args.device)
    geo = PagedGeometry(num_pages=96, page_size=16, num_kv_heads=2, head_dim=64,
                        dtype=torch.float32)
    B, W, Hq = 4, 64, 4
    k_cache, v_cache = (t.normal_() for t in geo.empty_pool(dev))
    pager = Pager(geo.num_pages, geo.page_size, max_sessions=B, max_blocks=16, device=dev)
    Transport(pager, W, geo.page_bytes)             # a commit hook: plans each step's trains
    k_arena = torch.zeros(B, W, geo.num_kv_heads, geo.head_dim, device=dev)
    v_arena = torch.zeros_like(k_arena)
    k_pages, v_pages = arena_as_pages(k_arena, geo.page_size), arena_as_pages(v_arena, geo.page_size)
    plan = {0: [("reserve", "a", 40), ("reserve", "b", 7)], 12: [("alias", "c", "a", 50)],
            30: [("trim", "b")], 31: [("reserve", "d", 100)]}
    for step in range(args.steps):
        with pager.frame() as f:
            for key in pager.sessions():
                f.reserve(key, 1)                       # one new token per live session
            for verb, *rest in plan.get(step, []):
                getattr(f, verb)(*rest)
        commit = f.result
        tables = pager.device_tables
        apply_copies(k_cache, v_cache, commit.copies)  # copy-on-write before writes
        # (a model would write this step's new K/V into the pool pages here)
        torch.ops.kvops.paged_gather_merged(k_cache, v_cache, tables["trains"],
                                            tables["num_trains"], k_pages, v_pages)
        q = torch.randn(B, Hq, geo.head_dim, device=dev)
        out, _ = torch.ops.kvops.static_sliding_attention(q, k_arena, v_arena,
                                                          tables["win_start"], tables["win_len"])
        worst = 0.0
        for key in pager.sessions():
            slot, n = pager.slot(key), pager.length(key)
            first = n - int(tables["win_len"][slot])
            pages = torch.tensor(pager.pages(key), device=dev)
            pos = torch.arange(first, n, device=dev)
            keys = k_cache[pages[pos // geo.page_size], pos % geo.page_size]
            vals = v_cache[pages[pos // geo.page_size], pos % geo.page_size]
            qg = q[slot].view(geo.num_kv_heads, Hq // geo.num_kv_heads, geo.head_dim)
            att = torch.einsum("hgd,nhd->hgn", qg, keys) * geo.head_dim ** -0.5
            want = torch.einsum("hgn,nhd->hgd", att.softmax(-1), vals).reshape(Hq, -1)
            worst = max(worst, (out[slot] - want).abs().max().item())
        stats = commit.stats["transport"]
        print(f"step {step:2d} epoch {commit.epoch:2d} sessions {pager.sessions()} "
              f"moves {stats['moves']:2d} trains {stats['groups']:2d} "
              f"free pages {pager.free_pages:2d} max err {worst:.1e}")
        assert worst < 1e-4, "attention over the arena differs from the pool"


if __name__ == "__main__":
    main()
