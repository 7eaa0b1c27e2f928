"""bench.engine_steps groups a replay's decode-only steps by batch and compares configurations."""

from __future__ import annotations

import pytest

from bench.engine_steps import decode_groups, report, slowest


def step(decodes, tokens, step_ms, commit_ms=0.1, device_ms=None):
    got = dict(decodes=decodes, tokens=tokens, step_s=step_ms / 1e3, schedule_s=1e-5,
               commit_s=commit_ms / 1e3)
    if device_ms is not None:       # records from CUDA replays time the device
        got.update(device_s=device_ms / 1e3, gap_s=0.25e-3)
    return got


def test_groups_take_only_decode_steps_and_their_medians():
    steps = [step(4, 4, 10.0), step(6, 6, 12.0), step(8, 8, 30.0), step(5, 300, 99.0),
             step(20, 20, 15.0), step(0, 64, 50.0)]
    got = decode_groups(steps)
    assert set(got) == {(1, 8), (17, 32)}
    assert got[(1, 8)]["n"] == 3 and got[(1, 8)]["step_ms"] == pytest.approx(12.0)
    assert got[(17, 32)]["step_ms"] == pytest.approx(15.0)


def test_report_compares_against_the_reference_at_the_same_group():
    result = {"steps": {"paged": [step(4, 4, 10.0)],
                        "kvrm": [step(4, 4, 11.0, device_ms=9.5), step(40, 40, 20.0)]}}
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in report(result, "paged").splitlines() if line.startswith("|")]
    kvrm = {r[1]: r for r in rows if r[0] == "kvrm"}
    assert kvrm["1-8"][6:] == ["9.500", "0.250", "1.000", "1.100"]  # device, gap; 1 ms and
    assert kvrm["33-64"][6:] == ["0.000", "0.000", "", ""]           # 1.1x paged; none there
    with pytest.raises(ValueError, match="--ref"):
        report(result, "static")


def test_slowest_accounts_the_wall_time_and_lists_the_slowest_steps_in_order():
    steps = [dict(step(4, 4, ms), t=i * 0.1, running=4, waiting=w, path="native")
             for i, (ms, w) in enumerate([(10.0, 0), (900.0, 3), (12.0, 0), (450.0, 1)])]
    result = {"steps": {"static": steps}, "results": {"static": {"duration_s": 2.0}}}
    text = slowest(result, 2)
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|") and "---" not in line]
    acct = rows[1]
    assert acct[:2] == ["static", "4"] and float(acct[3]) == pytest.approx(1.372)
    assert float(acct[6]) == pytest.approx(1.35)                    # the top two steps' wall
    top = [r for r in rows if r[0] == "static" and len(r) == 11]
    assert [r[1] for r in top] == ["1", "3"] and [r[6] for r in top] == ["3", "1"]
