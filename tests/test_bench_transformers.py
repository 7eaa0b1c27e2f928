"""The transformers generate benchmark's CPU smoke path (``--smoke``): every kvops cache and
SDPA run through the bench's own plumbing (filled caches, rewinds, timed generates) on a tiny
model, and the tokens of every cache that holds the same K/V agree."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the hf (or test) extra")


def test_smoke_grid_runs_on_cpu(tmp_path, monkeypatch, capsys):
    from bench import bench_transformers as bt

    monkeypatch.setattr(bt, "write_result", lambda name, body: tmp_path / name)
    # eager cells only (the compiled decode of these caches is the integration tests' subject);
    # a kvops cache first: the bench registers attn_implementation="kvops" before any cell
    rows = bt.main(["--smoke", "--impls", "sliding,sdpa,paged,paged-base", "--modes", "eager"])
    assert [r[3] for r in rows] == ["sliding", "sdpa", "paged", "paged-base"]
    for _mode, B, ctx, impl, step, _tps, _vs, _setup, note in rows:
        assert (B, ctx) == (2, 64)
        assert not note.startswith("failed"), (impl, note)
        # a step time is positive, or the row says the machine's noise hid it
        assert (step != "-" and float(step) > 0) or "timing noise" in note, (impl, step, note)
    # the same K/V in every cache: sliding, SDPA and paged agree on the tokens here
    assert all(r[-1].split(";")[0] == "tokens = first run's" for r in rows[:3])
    out = capsys.readouterr().out
    last = [c.strip() for c in out.rstrip().splitlines()[-1].split("|")[1:5]]
    assert last == ["eager", "2", "64", "paged-base"]          # the table prints last


def test_rounds_take_the_median_of_the_impls_in_turn(tmp_path, monkeypatch):
    from bench import bench_transformers as bt

    monkeypatch.setattr(bt, "write_result", lambda name, body: tmp_path / name)
    order = []
    real = bt.run
    monkeypatch.setattr(bt, "run", lambda model, impl, *a, **k: (order.append(impl),
                                                                   real(model, impl, *a, **k))[1])
    rows = bt.main(["--smoke", "--impls", "sliding,sdpa", "--modes", "eager", "--rounds", "3",
                    "--repeats", "1"])
    assert order == ["sliding", "sdpa"] * 3
    assert [r[3] for r in rows] == ["sliding", "sdpa"]
    for row in rows:
        assert "median of 3 rounds" in row[-1] or "timing noise" in row[-1], row
