"""Markdown tables and dated run records.

A record is one Markdown file ``<directory>/<date>-<HHMM>-<name>.md`` headed by what makes a number
reproducible: the UTC date and time, the device, the commit, the torch / triton / python versions
and the command line. The benchmarks and examples write theirs to ``bench/results/``.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table with right-aligned columns; floats print with 3 decimals below 10, else 1."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)


def commit_id(cwd: str | Path = ".") -> str:
    """The commit a record names: ``KVOPS_COMMIT`` when set (a checkout whose git is not the
    tree's, as on the device machine, whose copied ``.git`` can lag the tree), else git's short
    HEAD in ``cwd`` (``+dirty`` with uncommitted changes to tracked files), else "unknown"."""
    env = os.environ.get("KVOPS_COMMIT")
    if env:
        return env
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=cwd, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=cwd).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


_STARTED: dict[tuple[str, str], tuple[datetime.datetime, Path]] = {}


def record_path(directory: str | Path, name: str) -> tuple[datetime.datetime, Path]:
    """``(time, path)`` of this process's record ``name`` in ``directory``:
    ``<directory>/<date>-<HHMM>-<name>.md`` named by the UTC time of the first call for it
    (``-2``, ``-3`` after the name where another run took that minute's file), the same on
    every later call. So two runs on one day (three parts of a sweep, a bench run twice on one
    machine) are two files, and a bench that rewrites its record after every row keeps
    rewriting its own."""
    directory = Path(directory)
    key = (str(directory.resolve()), name)
    if key not in _STARTED:
        now = datetime.datetime.now(datetime.timezone.utc)
        path = directory / f"{now:%Y-%m-%d-%H%M}-{name}.md"
        n = 1
        while path.exists():
            n += 1
            path = directory / f"{now:%Y-%m-%d-%H%M}-{name}-{n}.md"
        _STARTED[key] = now, path
    return _STARTED[key]


def write_record(directory: str | Path, name: str, body: str) -> Path:
    """Write this process's record ``name`` (``record_path``) in ``directory``, and a copy under
    ``$OUT`` when set, with the run's header (the date and time that name it); returns the path.
    The commit is :func:`commit_id`'s (``KVOPS_COMMIT`` wins)."""
    import triton

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gpu = (torch.cuda.get_device_name() if torch.cuda.is_available()
           else f"none (CPU run, {platform.machine()}, {os.cpu_count()} cores)")
    now, path = record_path(directory, name)
    header = "\n".join([
        f"# {name}",
        "",
        f"- date: {now:%Y-%m-%d %H:%M} UTC",
        f"- gpu: {gpu}",
        f"- commit: {commit_id(directory)}",
        f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}",
        f"- command: `{' '.join(shlex.quote(a) for a in getattr(sys, 'orig_argv', sys.argv))}`",
        "",
    ])
    text = header + body.rstrip() + "\n"
    path.write_text(text)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / path.name).write_text(text)
    return path
