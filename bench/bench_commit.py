"""Host cost of one frame commit, with and without a far view, as an A/B in one process.

Every configuration is built on the same workload as ``bench_paged_gather``'s control part
(S = 16, W = 2048, L = 512 blocks, sessions of 1,000-4,000 tokens growing one token a step,
host tables only, a Transport attached) and all of one session count are stepped in
alternating blocks of steps in one process, so the load of a shared host falls on each alike;
the ratios are the result, the absolute times depend on the host.

- ``copy tail`` / ``write-through``: the plain commit (the transport only);
- ``+ far view``: a FarView (32 layers, chunks of 8 pages, cap 8) too, no pulls of utilities;
- ``+ far view, pull every 8``: the same with ``pull_scores`` every 8 steps (the engine's
  default ``far_rerank``) of fresh random utilities (the worst case: each pull reorders about
  two rows in five), so the pull ranks the summaries again and the commit after it writes the
  rows that change; "pull" is the pull's own time (on CUDA the ranking runs on the device and
  the pull waits for it: wall time), "after a pull" the p50 of the commits right after one,
  and "commit + pull mean" both spread over the steps;
- ``+ far view, summarized blocks trimmed``: the next frame trims the blocks of each chunk a
  commit summarized, as the engine's ``kvrm`` does (``far_trim``): those commits carry general
  edits;
- ``--far-from REV``: the far view rows again with ``kvops/runtime/far_view.py`` as of git
  revision ``REV`` (a before/after of that file on the same steps).

Commit time is ``Frame.commit()`` only (the verbs are timed apart), thread CPU time (which
leaves out preemption by other processes). ``--device cuda`` puts the pager's tables and the
far view on the GPU, so a commit includes its upload and a pull its device ranking. Prints a
short table last and writes ``bench/results/<date>-<HHMM>-commit.md``.

    OMP_NUM_THREADS=1 taskset -c 1 python -m bench.bench_commit
    python -m bench.bench_commit --quick
    python -m bench.bench_commit --device cuda
    python -m bench.bench_commit --far-from HEAD~1
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import table, write_result
from kvops.runtime import FarView, Pager, Transport

S, W, HKV, D, LAYERS, CAP, CHUNK_PAGES, RERANK = 16, 2048, 8, 128, 32, 8, 8, 8


def far_view_at(rev: str):
    """The FarView class of ``kvops/runtime/far_view.py`` at git revision ``rev``."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:kvops/runtime/far_view.py"], cwd=root,
                         check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "far_view_at.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"far_view_at_{rev}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.FarView


class Config:
    """One pager on the workload; ``step(n)`` runs ``n`` steps and records the commits."""

    def __init__(self, sessions: int, copy_tail: bool, far_cls=None, pull: int = 0,
                 trim: bool = False, device: str = "cpu"):
        self.sessions, self.pull, self.trim = sessions, pull, trim
        self.cuda = device == "cuda"
        self.pager = Pager(sessions * 300, S, sessions, 512, device=device if self.cuda else None)
        Transport(self.pager, W, S * HKV * D * 2, copy_tail=copy_tail)
        self.far = None
        if far_cls is not None:
            self.far = far_cls(self.pager, window_tokens=W, chunk_tokens=CHUNK_PAGES * S,
                               cap=CAP, num_layers=LAYERS, num_kv_heads=HKV, head_dim=D,
                               device=device)
            self.rng = np.random.default_rng(sessions)
        with self.pager.frame() as f:
            for s in range(sessions):
                f.reserve(s, 1000 + (s * 97) % 3000)
        self.cpu: list[float] = []
        self.pulls: list[float] = []
        self.after_pull: list[bool] = []
        self.summaries = 0
        self.steps = 0
        self.to_trim: list[tuple[int, range]] = []

    def step(self, n: int, record: bool = True) -> None:
        pager, sessions, far = self.pager, self.sessions, self.far
        for _ in range(n):
            self.steps += 1
            pulled = bool(self.pull) and self.steps % self.pull == 0
            if pulled:
                u = self.rng.random(far.scores.shape, dtype=np.float32)
                if self.cuda:                   # the utilities on the device, as observe leaves them
                    far.scores.copy_(torch.from_numpy(u))
                    torch.cuda.synchronize()
                    p1 = time.perf_counter()
                    far.pull_scores()
                    p2 = time.perf_counter()
                else:
                    p1 = time.thread_time()
                    far.pull_scores(u)
                    p2 = time.thread_time()
                if record:
                    self.pulls.append(p2 - p1)
            f = pager.frame()
            for key, blocks in self.to_trim:    # the summarized chunks' blocks go back
                f.trim(key, blocks)
            for s in range(sessions):
                f.reserve(s, 1)
            c1 = time.thread_time()
            f.commit()
            c2 = time.thread_time()
            if self.trim:
                ids, M = pager.host_tables["far_leave_ids"], far.M
                self.to_trim = [(s, range(int(ids[pager.slot(s)]) * M,
                                          (int(ids[pager.slot(s)]) + 1) * M))
                                for s in np.flatnonzero(ids != far.J).tolist()]
            if record:
                self.cpu.append(c2 - c1)
                self.after_pull.append(pulled)
                if far is not None:
                    self.summaries += far.last.get("summaries", 0)


def run(sessions: int, rounds: int, block: int, far_from: str | None,
        device: str = "cpu") -> list[list]:
    dev = {"device": device}
    configs = {"copy tail": Config(sessions, True, **dev),
               "write-through": Config(sessions, False, **dev),
               "write-through + far view": Config(sessions, False, FarView, **dev),
               "write-through + far view, pull every 8": Config(sessions, False, FarView,
                                                                RERANK, **dev),
               "write-through + far view, summarized blocks trimmed":
                   Config(sessions, False, FarView, trim=True, **dev)}
    if far_from:
        old = far_view_at(far_from)
        configs[f"write-through + far view ({far_from})"] = Config(sessions, False, old)
        configs[f"write-through + far view, pull every 8 ({far_from})"] = \
            Config(sessions, False, old, RERANK)
        configs[f"write-through + far view, summarized blocks trimmed ({far_from})"] = \
            Config(sessions, False, old, trim=True)
    order = list(configs.values())
    for c in order:                          # past the first commits' prefill queue
        c.step(100, record=False)
    gc.collect()
    for r in range(rounds):
        for c in (order if r % 2 == 0 else order[::-1]):
            c.step(block)
    plain = float(np.median(configs["write-through"].cpu))
    plain_mean = float(np.mean(configs["write-through"].cpu))
    rows = []
    for name, c in configs.items():
        us = np.array(c.cpu) * 1e6
        p50 = float(np.median(us))
        pulled = np.array(c.after_pull)
        rerank = float(np.median(us[pulled])) if pulled.any() else "-"
        pull = np.array(c.pulls) * 1e6
        both = float(us.mean() + pull.sum() / len(us))
        rows.append([sessions, name, p50, float(np.quantile(us, 0.9)), float(us.mean()),
                     p50 / (plain * 1e6), float(us.mean()) / (plain * 1e6), rerank,
                     float(np.median(pull)) if pull.size else "-", both,
                     both / (plain_mean * 1e6), c.summaries / len(us) if c.far else "-"])
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--rounds", type=int, default=40, help="alternating blocks per config")
    ap.add_argument("--block", type=int, default=25, help="steps per block")
    ap.add_argument("--sessions", default="64,256")
    ap.add_argument("--far-from", default=None,
                    help="git revision whose far_view.py to time beside this one")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the pager's tables and the far view live (default cpu)")
    args = ap.parse_args()
    rounds = 8 if args.quick else args.rounds
    rows = []
    for sessions in (int(x) for x in args.sessions.split(",")):
        rows += run(sessions, rounds, args.block, args.far_from, args.device)
    load = os.getloadavg()
    where = (f"tables and far view on {torch.cuda.get_device_name()}" if args.device == "cuda"
             else "host tables only")
    body = ("## Frame commit: host CPU time per step\n\n"
            f"{rounds} alternating blocks of {args.block} steps per configuration after 100 "
            f"warm-up steps; one new token per session per step; S={S}, W={W}, {where}; "
            f"far view: {LAYERS} layers, chunks of {CHUNK_PAGES} pages, cap {CAP}. "
            "Thread CPU time of Frame.commit(); 'x plain' is the p50 (or the mean) over the "
            "write-through p50 of the same session count; 'after a pull' is the p50 of the "
            "commits right after a pull_scores, 'pull' the pull's p50 (wall on CUDA), "
            "'commit + pull' the mean of both a step, over the plain mean. Host load average "
            f"at the end: {load[0]:.1f} (1 min) on {os.cpu_count()} CPUs.\n\n"
            + table(["sessions", "commit", "CPU p50 us", "CPU p90 us", "CPU mean us",
                     "x plain (p50)", "x plain (mean)", "after a pull p50 us", "pull p50 us",
                     "commit + pull mean us", "x plain (mean)", "summaries per commit"], rows)
            + "\n")
    path = write_result("commit", body)
    print(f"wrote {path}\n")
    print(body)


if __name__ == "__main__":
    main()
