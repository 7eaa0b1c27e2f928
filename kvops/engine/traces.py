"""Replay traces as :class:`Request` lists: Azure 2023 CSVs, Mooncake JSONL, ShareGPT length
statistics with Poisson or Gamma arrivals, the small synthetic trace shipped with kvops, and
ElasticKV's high-pressure synthetic (:func:`pressure_rows`: fixed 4096 / 1024 lengths).

Traces give lengths, not text, so prompt tokens are drawn from a seeded generator: from the
request id, or, where the trace has ``hash_ids``, block by block from each block's id, so that
equal ids are equal token prefixes (and the KV manager may alias them). Every loader takes
``time_scale`` (arrival times are multiplied by it: 2.0 replays at half the rate) and
``length_scale`` (prompt and output lengths and the hash block are multiplied by it, at least
one token each), and ``max_requests``.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

import numpy as np

from kvops.engine.request import HASH_BLOCK, Request


@dataclass(frozen=True)
class TraceRow:
    arrival: float          # seconds from the trace's start
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


def default_trace_path() -> Path:
    """The synthetic burst shipped in the package (Mooncake JSONL format)."""
    return Path(str(resources.files("kvops.engine") / "data" / "synthetic_burst.jsonl"))


def parse_azure_time(text: str) -> float:
    """Seconds since the epoch of an Azure 2023 timestamp, ``2023-11-16 18:17:03.9799600``
    (seven fractional digits, which ``%f`` does not take)."""
    head, _, frac = text.strip().partition(".")
    base = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def densest_window(times: np.ndarray, seconds: float) -> tuple[int, int]:
    """``[i, j)``: the rows of sorted ``times`` in the window ``[t_i, t_i + seconds)`` that
    holds the most rows (the earliest such window)."""
    if len(times) == 0:
        return 0, 0
    ends = np.searchsorted(times, times + seconds, side="left")
    i = int(np.argmax(ends - np.arange(len(times))))
    return i, int(ends[i])


def read_azure(path: str | Path, window_s: float | None = 60.0) -> list[TraceRow]:
    """``TIMESTAMP,ContextTokens,GeneratedTokens`` rows; with ``window_s`` only the densest
    window of that many seconds (KV-RM's replay), arrivals relative to its first request."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    if not rows or not need <= set(rows[0]):
        raise ValueError(f"{path}: expected an Azure 2023 CSV with columns {sorted(need)}, got "
                         f"{sorted(rows[0]) if rows else 'no rows'}")
    t = np.array([parse_azure_time(r["TIMESTAMP"]) for r in rows])
    order = np.argsort(t, kind="stable")
    t = t[order]
    i, j = densest_window(t, window_s) if window_s else (0, len(t))
    return [TraceRow(float(t[k] - t[i]), int(rows[order[k]]["ContextTokens"]),
                     int(rows[order[k]]["GeneratedTokens"])) for k in range(i, j)]


def read_mooncake(path: str | Path) -> list[TraceRow]:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            try:
                out.append(TraceRow(r["timestamp"] / 1000.0, int(r["input_length"]),
                                    int(r["output_length"]), tuple(r.get("hash_ids", ()))))
            except KeyError as exc:
                raise ValueError(f"{path}:{n}: expected Mooncake keys timestamp, input_length, "
                                 f"output_length, got {sorted(r)}") from exc
    out.sort(key=lambda r: r.arrival)
    return out


def trace_windows(rows: list[TraceRow], count: int = 3,
                  seconds: float = 300.0) -> list[list[TraceRow]]:
    """``count`` temporally separated windows of ``seconds`` of a trace sorted by arrival
    (ElasticKV's Mooncake replay: three 300 s windows): their starts evenly spaced from the
    first arrival to the last arrival minus ``seconds`` (the first window opens the trace, the
    last closes it), each the rows arriving in ``[start, start + seconds)``, in order, with
    arrivals relative to the start. Raises ``ValueError`` when the trace is too short for
    ``count`` windows that do not overlap."""
    if not isinstance(count, int) or count < 1 or not seconds > 0:
        raise ValueError(f"count, seconds: expected an int >= 1 and seconds > 0, got {count!r}, "
                         f"{seconds!r}")
    if not rows:
        raise ValueError("rows: expected a trace, got no rows")
    t = np.array([r.arrival for r in rows])
    if np.any(np.diff(t) < 0):
        raise ValueError("rows: expected rows sorted by arrival")
    span = t[-1] - t[0]
    if count > 1 and span < count * seconds:
        raise ValueError(f"rows: the trace spans {span:.1f} s, too short for {count} separate "
                         f"windows of {seconds:g} s")
    starts = [t[0] + (span - seconds) * k / (count - 1) for k in range(count)] if count > 1 \
        else [t[0]]
    out = []
    for start in starts:
        i, j = np.searchsorted(t, start, "left"), np.searchsorted(t, start + seconds, "left")
        out.append([TraceRow(float(r.arrival - start), r.input_len, r.output_len, r.hash_ids)
                    for r in rows[i:j]])
    return out


def read_sharegpt(path: str | Path, num_requests: int, rate: float, *, arrival: str = "poisson",
                  cv: float = 1.0, seed: int = 0) -> list[TraceRow]:
    """Lengths sampled from a ShareGPT stats CSV (``num_prefill_tokens,num_decode_tokens``)
    with arrivals at ``rate`` requests/s: ``poisson`` (exponential gaps) or ``gamma`` (gaps
    with coefficient of variation ``cv``; burstier when ``cv > 1``)."""
    if rate <= 0 or num_requests < 1:
        raise ValueError(f"rate and num_requests: expected > 0, got {rate}, {num_requests}")
    with open(path, newline="") as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]))
                for r in csv.DictReader(f)]
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(rows), num_requests)
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, num_requests)
    elif arrival == "gamma":
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), num_requests)
    else:
        raise ValueError(f"arrival: expected 'poisson' or 'gamma', got {arrival!r}")
    t = np.concatenate([[0.0], np.cumsum(gaps)[:-1]])
    return [TraceRow(float(t[i]), rows[p][0], rows[p][1]) for i, p in enumerate(pick)]


def load_rows(path: str | Path | None = None, *, kind: str | None = None, **kw) -> list[TraceRow]:
    """Rows of the trace at ``path`` (the shipped synthetic burst when None); ``kind`` is
    ``azure``, ``mooncake`` or ``sharegpt``, by default from the file name."""
    path = Path(path) if path is not None else default_trace_path()
    if not path.is_file():
        raise FileNotFoundError(f"trace: no file at {path}")
    if kind is None:
        name = path.name.lower()
        kind = ("sharegpt" if "sharegpt" in name else "mooncake" if path.suffix == ".jsonl"
                else "azure")
    if kind == "azure":
        return read_azure(path, kw.get("window_s", 60.0))
    if kind == "mooncake":
        return read_mooncake(path)
    if kind == "sharegpt":
        return read_sharegpt(path, kw.get("num_requests", 64), kw.get("rate", 4.0),
                             arrival=kw.get("arrival", "poisson"), cv=kw.get("cv", 1.0),
                             seed=kw.get("seed", 0))
    raise ValueError(f"kind: expected 'azure', 'mooncake' or 'sharegpt', got {kind!r}")


def _block_tokens(hash_id: int, n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng([seed, 1, hash_id]).integers(0, vocab, n).tolist()


def build_requests(rows: list[TraceRow], vocab: int, *, time_scale: float = 1.0,
                   length_scale: float = 1.0, output_scale: float = 1.0,
                   max_requests: int | None = None, max_context: int | None = None,
                   seed: int = 0) -> list[Request]:
    """Requests with synthetic prompt tokens for ``rows``. ``max_context`` clips a prompt so
    that prompt + output fit (longer traces than the model's positions); hash ids are kept
    only for the blocks that remain whole or are the clipped prompt's last. Outputs are also
    multiplied by ``output_scale``."""
    if time_scale <= 0 or length_scale <= 0 or output_scale <= 0:
        raise ValueError(f"time_scale, length_scale and output_scale: expected > 0, got "
                         f"{time_scale}, {length_scale}, {output_scale}")
    rows = rows[:max_requests] if max_requests else rows
    block = max(1, round(HASH_BLOCK * length_scale))
    out = []
    for rid, r in enumerate(rows):
        n_out = max(1, round(r.output_len * length_scale * output_scale))
        n_in = max(1, round(r.input_len * length_scale))
        if max_context is not None:
            n_out = min(n_out, max_context // 2)
            n_in = min(n_in, max_context - n_out + 1)
        hashes = tuple(r.hash_ids[:math.ceil(n_in / block)])
        if hashes:
            prompt: list[int] = []
            for h in hashes:
                prompt += _block_tokens(h, block, vocab, seed)
            prompt = prompt[:n_in]
            prompt += np.random.default_rng([seed, 2, rid]).integers(
                0, vocab, n_in - len(prompt)).tolist()
        else:
            prompt = np.random.default_rng([seed, 2, rid]).integers(0, vocab, n_in).tolist()
        out.append(Request(rid, r.arrival * time_scale, prompt, n_out, hashes, block))
    return out


def repeated_block_tokens(requests: list[Request]) -> int:
    """Prompt tokens in hash blocks that an earlier request already had at the same position
    with the same chain of ids before it (the prefix a cache could serve), full blocks only,
    and never the prompt's last token (a prefill must compute it for the logits)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for r in sorted(requests, key=lambda r: (r.arrival, r.rid)):
        hit, chain = 0, ()
        for i, h in enumerate(r.hash_ids):
            chain = chain + (h,)
            end = min((i + 1) * r.hash_block, len(r.prompt) - 1)
            if chain in seen and end == (i + 1) * r.hash_block and hit == i * r.hash_block:
                hit = end
            seen.add(chain)
        total += hit
    return total


def synthetic_burst_rows(num_requests: int = 64, seed: int = 0) -> list[TraceRow]:
    """The shipped synthetic trace (``data/synthetic_burst.jsonl`` is this function's output):
    two bursts (five eighths of the requests in the first 2 s, the rest in 6-8 s), prompts
    log-normal around 1,000 tokens (128-3,500), half the outputs short as if ended by EOS
    (4-32 tokens) and half long (64-600), and 60 % of the requests opening with one of four
    shared system prompts of one or two 512-token blocks (Mooncake ``hash_ids``)."""
    rng = np.random.default_rng(seed)
    first = num_requests * 5 // 8
    t = np.sort(np.concatenate([rng.uniform(0, 2, first),
                                rng.uniform(6, 8, num_requests - first)]))
    rows, next_id = [], 100
    families = [(0,), (1, 2), (3,), (4, 5)]
    for i in range(num_requests):
        n_in = int(np.clip(rng.lognormal(np.log(1000), 0.6), 128, 3500))
        short = rng.random() < 0.5
        n_out = int(rng.integers(4, 33)) if short else int(np.clip(rng.lognormal(np.log(200), 0.6), 64, 600))
        fam = families[rng.integers(0, 4)] if rng.random() < 0.6 else ()
        nb = -(-n_in // HASH_BLOCK)
        own = list(range(next_id, next_id + nb - len(fam)))
        next_id += len(own)
        rows.append(TraceRow(float(round(t[i], 3)), n_in, n_out, tuple(fam[:nb]) + tuple(own)))
    return rows


def pressure_rows(num_requests: int, *, input_len: int = 4096, output_len: int = 1024,
                  output_scale: float = 1.0, rate: float | None = None,
                  seed: int = 0) -> list[TraceRow]:
    """ElasticKV's high-pressure synthetic workload: ``num_requests`` requests of
    ``input_len`` prompt and ``output_len * output_scale`` output tokens (4096 and 1024 in the
    paper), all arriving at 0 (replayed as a closed loop at a concurrency, vLLM ``bench serve
    --max-concurrency``) or, with ``rate``, Poisson arrivals at that many requests/s."""
    for name, v in (("num_requests", num_requests), ("input_len", input_len),
                    ("output_len", output_len)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    if not output_scale > 0 or (rate is not None and not rate > 0):
        raise ValueError(f"output_scale, rate: expected > 0, got {output_scale}, {rate}")
    n_out = max(1, round(output_len * output_scale))
    t = np.zeros(num_requests)
    if rate is not None:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests)
        t = np.concatenate([[0.0], np.cumsum(gaps)[:-1]])
    return [TraceRow(float(t[i]), input_len, n_out) for i in range(num_requests)]


def write_mooncake(rows: list[TraceRow], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"timestamp": int(round(r.arrival * 1000)), "input_length": r.input_len,
                                "output_length": r.output_len, "hash_ids": list(r.hash_ids)}) + "\n")
