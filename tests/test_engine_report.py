"""The replay's goals table: each of the issue's goals met, missed, or not measured."""

from kvops.engine.report import goals


def _config(tok_s, p99, reserved, groups=1.5, kib=125.0):
    return {"output_tok_s": tok_s, "tpot_ms": {"p99": p99}, "reserved_gib_mean": reserved,
            "dma_groups_per_moving_session": groups, "mean_train_kib": kib,
            "control_exposed_share": 0.001, "control_share": 0.01, "commit_share": 0.005,
            "recaptures": 0, "compiles": 0}


def _rows(table):
    return {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")
            for line in table.splitlines() if line.startswith("| ") and "---" not in line}


def test_goals_mark_each_goal_met_or_missed():
    rows = _rows(goals({"results": {"static": _config(100.0, 80.0, 16.0),
                                    "kvrm": _config(130.0, 30.0, 11.0),
                                    "paged": _config(140.0, 35.0, 3.0)}}))
    assert rows["kvrm / static output tok/s"][1:] == ["1.30", ">= 1.25", "552 / 420 = 1.31", "yes"]
    assert rows["kvrm / static p99 TPOT"][-1] == "yes"
    assert rows["kvrm / paged output tok/s"][1] == "0.93" and rows["kvrm / paged output tok/s"][-1] == "no"
    assert rows["kvrm p99 TPOT below paged's"][-1] == "yes"
    assert rows["kvrm mean train KiB"][1] == "125.0" and rows["kvrm mean train KiB"][-1] == "yes"


def test_a_replay_that_moves_no_train_leaves_the_train_goal_unmeasured():
    rows = _rows(goals({"results": {"kvrm": _config(100.0, 30.0, 9.0, kib=0.0),
                                    "paged": _config(100.0, 35.0, 2.0)}}))
    assert rows["kvrm mean train KiB"][1] == "- (no train moved)"
    assert rows["kvrm mean train KiB"][-1] == "-"
    small = _rows(goals({"results": {"kvrm": _config(100.0, 30.0, 9.0, kib=32.0),
                                     "paged": _config(100.0, 35.0, 2.0)}}))
    assert small["kvrm mean train KiB"][-1] == "no"


def test_no_goals_without_kvrm_and_a_baseline():
    assert goals({"results": {"kvrm": _config(1.0, 1.0, 1.0)}}) == ""
    assert goals({"results": {"static": _config(1.0, 1.0, 1.0)}}) == ""
