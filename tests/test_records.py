"""Run records: one file a run, named by the UTC minute of its first write, never over another
run's file; the header names the commit."""

from __future__ import annotations

import datetime
import re
import types

import pytest

from kvops.evals import records


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(records, "_STARTED", {})
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setenv("KVOPS_COMMIT", "abc1234")
    return tmp_path


def test_a_run_rewrites_its_own_record(fresh):
    first = records.write_record(fresh, "sweep", "row 1")
    again = records.write_record(fresh, "sweep", "row 1\nrow 2")
    assert first == again
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-\d{4}-sweep\.md", first.name)
    text = first.read_text()
    assert text.startswith("# sweep\n") and "- commit: abc1234" in text
    assert text.rstrip().endswith("row 1\nrow 2")
    assert [p.name for p in fresh.iterdir()] == [first.name]


def _clock(monkeypatch, *minutes):
    """Stand records' clock still at 16:mm of 2026-12-07 for each of ``minutes`` in turn."""
    times = iter(datetime.datetime(2026, 12, 7, 16, m, 5, tzinfo=datetime.timezone.utc)
                 for m in minutes)
    monkeypatch.setattr(records, "datetime", types.SimpleNamespace(
        datetime=types.SimpleNamespace(now=lambda tz=None: next(times)),
        timezone=datetime.timezone))


def test_a_rewrite_keeps_its_name_and_date(fresh, monkeypatch):
    _clock(monkeypatch, 38, 41)
    first = records.write_record(fresh, "sweep", "row 1")
    again = records.write_record(fresh, "sweep", "row 1\nrow 2")
    assert first == again and first.name == "2026-12-07-1638-sweep.md"
    assert "- date: 2026-12-07 16:38 UTC" in again.read_text()


def test_another_run_in_the_same_minute_writes_its_own_file(fresh, monkeypatch):
    _clock(monkeypatch, 38, 38, 38)
    first = records.write_record(fresh, "sweep", "part 1")
    monkeypatch.setattr(records, "_STARTED", {})          # a second process
    second = records.write_record(fresh, "sweep", "part 2")
    monkeypatch.setattr(records, "_STARTED", {})
    third = records.write_record(fresh, "sweep", "part 3")
    assert [p.name for p in (first, second, third)] == [
        "2026-12-07-1638-sweep.md", "2026-12-07-1638-sweep-2.md", "2026-12-07-1638-sweep-3.md"]
    assert "- date: 2026-12-07 16:38 UTC" in second.read_text()
    assert [p.read_text().rstrip()[-6:] for p in (first, second, third)] == [
        "part 1", "part 2", "part 3"]


def test_one_name_in_two_directories_is_two_records(fresh):
    a = records.write_record(fresh / "a", "eager", "a")
    b = records.write_record(fresh / "b", "eager", "b")
    assert a.parent == fresh / "a" and b.parent == fresh / "b" and a.name == b.name
    assert a.read_text().rstrip().endswith("a") and b.read_text().rstrip().endswith("b")


def test_names_are_records_of_their_own_and_out_gets_a_copy(fresh, monkeypatch):
    out = fresh / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    a = records.write_record(fresh / "results", "eager", "a")
    b = records.write_record(fresh / "results", "heads", "b")
    assert a != b and a.parent == b.parent == fresh / "results"
    assert (out / a.name).read_text() == a.read_text()
    assert (out / b.name).read_text() == b.read_text()
