"""Freeze, then dump (issue 11): real processes stopped, captured, resumed.

A rank the fault stopped keeps reading as stopped and is never resumed; the
ranks the freeze stopped are captured with py-spy --nonblocking, or resumed
only for their own faulthandler capture; a dead rank's stacks come from the
dump it wrote as it died.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tp_supervise.dumps import capture, freeze
from tp_supervise.dumps.bundle import BundleWriter
from tp_supervise.dumps.capture import RankTarget, capture_all
from tp_supervise.dumps.incident import capture_incident, write_captured

SETTLE_S = 2.0
BUDGET_S = 10.0


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return text[text.rindex(")") + 2]


def wait_state(pid: int, letters: str, timeout_s: float = 5.0) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        now = state(pid)
        if now in letters:
            return now
        time.sleep(0.005)
    raise AssertionError(f"pid {pid} is {state(pid)}, not in {letters!r}")


def test_freeze_stops_the_running_ranks_and_keeps_what_the_fault_did(fake_ranks):
    ranks = fake_ranks(3)
    ranks.start({0: "collective", 1: "python", 2: "collective"})
    ranks.stop(1)  # the fault
    frozen = freeze.freeze(ranks.targets(), settle_s=SETTLE_S)
    pids = {r: p.pid for r, p in ranks.procs.items()}
    assert frozen.settled
    assert frozen.before[1].state == "T"
    assert frozen.before[0].state in ("S", "R") and frozen.before[2].state in ("S", "R")  # not as we left them
    assert set(frozen.stopped) == {0, 2}, "the rank the fault stopped is not ours to stop or resume"
    assert all(state(pid) == "T" for pid in pids.values())
    assert frozen.to_dict()["already_stopped_ranks"] == [1]
    freeze.thaw(frozen)
    wait_state(pids[0], "S")
    wait_state(pids[2], "S")
    time.sleep(0.05)
    assert state(pids[1]) == "T", "thaw resumed the rank the fault stopped"


def test_frozen_ranks_are_captured_with_nonblocking_pyspy_and_read_as_before(fake_ranks):
    if capture.find_pyspy() is None:
        pytest.skip("py-spy not installed")
    ranks = fake_ranks(2)
    ranks.start({0: "collective", 1: "python"})
    targets = ranks.targets()
    frozen = freeze.freeze(targets, settle_s=SETTLE_S)
    try:
        ev = capture_all(targets, run_dir=ranks.run_dir, method="auto", per_rank_timeout_s=BUDGET_S,
                         deadline_s=BUDGET_S, frozen=frozen)
        for rank, fn in ((0, "wait_in_all_reduce"), (1, "stuck_in_user_code")):
            r = ev.ranks[rank]
            assert r.has_stacks, r.error
            assert r.method == "py-spy --nonblocking", r.attempts  # no ptrace attach on a stopped rank
            assert fn in r.stack_text
            assert r.state in ("S", "R"), "the evidence is the /proc state from before the freeze"
            assert state(ranks.procs[rank].pid) == "T", "capture resumed a frozen rank"
    finally:
        freeze.thaw(frozen)


def test_faulthandler_fallback_resumes_a_frozen_rank_only_for_its_capture(fake_ranks, monkeypatch):
    monkeypatch.setenv(capture.ENV_PYSPY, "off")  # as where ptrace is denied
    ranks = fake_ranks(2)
    ranks.start({0: "collective", 1: "python"})
    targets = ranks.targets()
    frozen = freeze.freeze(targets, settle_s=SETTLE_S)
    try:
        ev = capture_all(targets, run_dir=ranks.run_dir, method="auto", per_rank_timeout_s=BUDGET_S,
                         deadline_s=BUDGET_S, frozen=frozen)
        for rank, fn in ((0, "wait_in_all_reduce"), (1, "stuck_in_user_code")):
            r = ev.ranks[rank]
            assert r.has_stacks, r.error
            assert fn in r.stack_text
            assert "resumed for the capture" in r.method
            wait_state(ranks.procs[rank].pid, "T")  # stopped again
    finally:
        freeze.thaw(frozen)


def test_a_rank_that_leads_its_group_is_frozen_with_its_children():
    script = "import subprocess, sys, time; subprocess.Popen(['sleep', '60']); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        child = int(subprocess.check_output(["pgrep", "-P", str(proc.pid)], text=True).split()[0])
        target = RankTarget(rank=0, slot=0, pid=proc.pid, alive=True)
        frozen = freeze.freeze([target], settle_s=SETTLE_S)
        assert frozen.group[0] is True
        assert state(proc.pid) == "T"
        wait_state(child, "T")
        freeze.thaw(frozen)
        wait_state(child, "S")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


DIES_WITH_A_DUMP = textwrap.dedent(
    """
    import faulthandler, os, sys
    from tp_supervise.supervisor.rank.runtime import stack_file_path
    path = stack_file_path(sys.argv[1], 1, os.getpid())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    f = open(path, "w", buffering=1)
    faulthandler.enable(file=f, all_threads=True)   # what the rank side does for fatal signals
    def collective_that_aborts():
        os.abort()                                   # as gloo's std::terminate on a size mismatch
    collective_that_aborts()
    """
)


def test_a_dead_ranks_stacks_come_from_the_dump_it_wrote_as_it_died(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", DIES_WITH_A_DUMP, str(run_dir)], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGABRT
    pid = int(next((run_dir / "stacks").iterdir()).name.split("pid-")[1].split(".")[0])
    gone = RankTarget(rank=1, slot=1, pid=pid, alive=False, exit={"signal": "SIGABRT", "description": "aborted"})
    ev = capture_all([gone], run_dir=run_dir, method="auto", per_rank_timeout_s=1.0, deadline_s=1.0)
    r = ev.ranks[1]
    assert r.has_stacks, r.error
    assert r.method == "faulthandler at death (Aborted)"
    assert "collective_that_aborts" in r.stack_text
    # Without a dump, a dead rank says it is not running, as before.
    other = RankTarget(rank=2, slot=2, pid=pid, alive=False)
    ev = capture_all([other], run_dir=run_dir, method="auto", per_rank_timeout_s=1.0, deadline_s=1.0)
    assert not ev.ranks[2].has_stacks and ev.ranks[2].error == "rank is not running"


def test_capture_incident_freezes_then_resumes_and_the_bundle_says_so(fake_ranks, tmp_path):
    ranks = fake_ranks(2)
    ranks.start({0: "collective", 1: "python"})
    ranks.stop(1)
    captured = capture_incident(ranks.targets(), reason="hang", run_dir=ranks.run_dir, deadline_s=BUDGET_S, freeze=True)
    assert captured.frozen is not None and set(captured.frozen.stopped) == {0}
    wait_state(ranks.procs[0].pid, "S")  # resumed once the stacks were taken
    assert state(ranks.procs[1].pid) == "T"
    assert captured.diagnosis.culprit_ranks == [1]
    # A capture cut short by --dump-timeout: the summary names what is missing, and why.
    writer = BundleWriter(tmp_path / "dumps", keep=5, max_bytes=0)
    result = write_captured(writer, captured, reason="hang", run_id="r", incomplete={"why": "cut short"})
    summary = json.loads((result.path / "summary.json").read_text())
    assert summary["capture"]["freeze"]["stopped_ranks"] == [0]
    assert summary["capture"]["freeze"]["already_stopped_ranks"] == [1]
    assert summary["incomplete"]["why"] == "cut short"
    # Fake ranks serve no flight recorder; those files are named as missing, with the reason.
    assert set(summary["incomplete"]["missing"]) >= {"fr/rank-0", "fr/rank-1"}
    assert "stacks/rank-0.txt" not in summary["incomplete"]["missing"]
