"""Issue 2 acceptance: every kind of rank death is seen, named, and cleaned up."""

from __future__ import annotations

from datetime import datetime

import pytest

from tests.conftest import fake_rank

GRACE = 2.0
DELAY = 1.0  # ranks run this long before the fault
# Generous bound for a loaded 2-core CI machine: start-up of the interpreter
# plus the injected delay plus the kill grace plus slack.
SLACK = 6.0

def _ts(line: dict) -> datetime:
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00"))


CASES = [
    ("sigkill", "SIGKILL", "signal"),
    ("segv", "SIGSEGV", "segfault"),
    ("abort", "SIGABRT", "native_abort"),
    ("raise", None, "nonzero"),
    ("exit0", None, "early_exit"),
]


@pytest.mark.parametrize("action,signal_name,reason", CASES)
def test_rank_death_is_named_and_everything_is_torn_down(supervise, action, signal_name, reason):
    run = supervise(
        ["--nproc-per-node", "3", "--kill-grace", str(GRACE)],
        fake_rank("--all", "sleep", "--on", f"1={action}", "--delay", str(DELAY)),
    )
    code = run.wait(timeout=DELAY + GRACE + SLACK + 10)
    assert code == 80, run.stderr[-3000:]
    assert run.elapsed < DELAY + GRACE + SLACK
    summary = run.summary("rank_exit")
    assert summary["reason"] == "rank_exit"
    assert summary["culprit_ranks"] == [1]
    assert summary["ranks"]["1"]["exit"]["reason"] == reason
    if signal_name:
        assert summary["ranks"]["1"]["exit"]["signal"] == signal_name
        assert signal_name in summary["verdict"]
    assert "rank 1" in summary["verdict"]
    failures = [line for line in run.lines if line.get("level") == "error" and line.get("rank") == 1]
    assert failures, "no error log line names rank 1"
    assert failures[0]["pid"] == summary["ranks"]["1"]["pid"]
    # Issue 2: exit within --kill-grace + 1 s of the death being noticed.
    noticed = _ts(failures[0])
    exited = _ts(run.events("supervise exiting")[-1])
    assert (exited - noticed).total_seconds() < GRACE + 1.0, (noticed, exited)


def test_sigterm_ignoring_ranks_and_setsid_grandchildren_are_killed(supervise):
    run = supervise(
        ["--nproc-per-node", "3", "--kill-grace", "1"],
        fake_rank("--all", "ignore_term", "--on", "0=doublefork", "--on", "2=exit:3", "--delay", str(DELAY + 0.5)),
    )
    assert run.wait(timeout=30) == 80
    sent_kill = run.events("sent SIGKILL")
    assert sent_kill, "teardown should have escalated to SIGKILL"
    assert run.events("teardown complete")
    # the fixture's leak check proves the setsid grandchild is gone too


def test_all_ranks_finishing_is_a_clean_exit_without_bundle(supervise):
    run = supervise(["--nproc-per-node", "3"], fake_rank("--all", "finish", "--steps", "20"))
    assert run.wait(timeout=30) == 0, run.stderr[-3000:]
    assert run.bundles() == []


def test_nonzero_exit_code_is_reported(supervise):
    run = supervise(["--nproc-per-node", "2", "--kill-grace", "1"], fake_rank("--all", "sleep", "--on", "0=exit:7", "--delay", "0.5"))
    assert run.wait(timeout=30) == 80
    summary = run.summary("rank_exit")
    assert summary["culprit_ranks"] == [0]
    assert summary["ranks"]["0"]["exit"]["code"] == 7


def test_ranks_that_said_they_finished_may_exit_at_different_times(supervise):
    run = supervise(["--nproc-per-node", "2"], fake_rank("--all", "finish", "--on", "0=finish_late", "--steps", "10"))
    assert run.wait(timeout=30) == 0, run.stderr[-3000:]
    assert run.bundles() == []
