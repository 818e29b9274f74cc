"""The drill's injection lane in real ranks (gloo, torch.distributed): armed only with the run's token, a fault
at a real collective, and nothing listening in a run the drill did not start."""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path

import psutil
import pytest

from tp_supervise.supervisor.drills import host

LOOP = str(Path(__file__).resolve().parents[1] / "fakes" / "step_loop.py")
RANK = str(Path(__file__).resolve().parents[1] / "fakes" / "rank.py")
ARGS = ["--nproc-per-node", "2", "--kill-grace", "2", "--soft-timeout", "2", "--hard-timeout", "4"]


def rank_pid(run, rank: int, timeout: float = 60.0, script: str = "step_loop") -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(run.proc.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank) and any(script in a for a in child.cmdline()):
                    return child.pid
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} within {timeout} s")


def order(folder: Path, pid: int, token: str, kind: str, seam: str) -> None:
    tmp = folder / f".{pid}.tmp"
    tmp.write_text(json.dumps({"token": token, "kind": kind, "seam": seam}))
    os.replace(tmp, folder / f"{pid}.json")


def answer(folder: Path, pid: int, timeout: float = 10.0) -> dict | None:
    deadline = time.monotonic() + timeout
    path = folder / f"{pid}.armed"
    while time.monotonic() < deadline:
        try:
            said = json.loads(path.read_text())
            path.unlink()
            return said
        except (OSError, ValueError):
            time.sleep(0.1)
    return None


def test_a_skipped_all_reduce_armed_with_the_runs_token_names_that_rank(supervise, tmp_path):
    lane = tmp_path / "lane"
    lane.mkdir()
    token = secrets.token_hex(16)
    run = supervise(ARGS, [sys.executable, LOOP, "--seconds", "120", "--step", "0.05"],
                    env={"SUPERVISE_DRILL": f"{token}:{lane}"})  # fmt: skip
    pid = rank_pid(run, 1)
    time.sleep(3.0)
    order(lane, pid, "0" * 32, "skip_collective", "collective")  # another run's token: ignored
    assert answer(lane, pid, timeout=3.0) is None
    order(lane, pid, token, "python_loop", "step")  # no engine step in this program: refused, with why
    said = answer(lane, pid)
    assert said is not None and "no step seam" in said["problem"], said
    order(lane, pid, token, "skip_collective", "collective")
    said = answer(lane, pid)
    assert said is not None and said["problem"] == "", said
    # gloo pairs rank 1's next all-reduce with the one rank 0 is in, one behind: where the sizes are equal the group
    # ends in a hang, whose culprit is rank 1 (it is elsewhere); where they differ (a step's 1-float "go" against a
    # 64-float one) gloo aborts the process that reads the message that does not fit, and each of the two reads
    # one: either rank can die of SIGABRT first (seen both ways), and the first to die is the ruling's culprit.
    code = run.wait(90)
    assert code in (80, 81), run.stderr[-3000:]
    (bundle,) = run.events("incident_bundle_written")
    if code == 81:
        assert bundle["culprit_ranks"] == [1] and bundle["culprit"]["rank"] == 1, bundle
    else:
        assert "SIGABRT" in bundle["verdict"] and len(bundle["culprit_ranks"]) == 1, bundle["verdict"]


@pytest.mark.slow
def test_nothing_listens_in_a_run_the_drill_did_not_start(supervise, tmp_path):
    lane = tmp_path / "lane"
    lane.mkdir()
    run = supervise(ARGS, [sys.executable, LOOP, "--seconds", "8", "--step", "0.05"])
    pid = rank_pid(run, 1)
    order(lane, pid, "0" * 32, "exit0", "step")
    assert run.wait(90) == 0, run.stderr[-3000:]
    assert (lane / f"{pid}.json").exists() and not (lane / f"{pid}.armed").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="a memory cgroup limit needs root")
def test_a_rank_the_oom_killer_takes_is_named_with_the_kernels_own_words(supervise, tmp_path):
    """Rank 1 in a memory cgroup with 256 MiB of room (the drill's ``oom`` kind), growing through the lane until
    the kernel's OOM killer takes it: the exit is ruled an OOM kill, by the kernel's log line for that pid."""
    lane = tmp_path / "lane"
    lane.mkdir()
    token = secrets.token_hex(16)
    run = supervise(["--nproc-per-node", "2", "--kill-grace", "2"], [sys.executable, RANK, "--all", "sleep"],
                    env={"SUPERVISE_DRILL": f"{token}:{lane}"})  # fmt: skip
    pid = rank_pid(run, 1, script="rank.py")
    group = host.Cgroup("memory", pid, f"tps-test-oom-{token[:8]}")
    try:
        group.memory_headroom()
        order(lane, pid, token, "grow_memory", "now")
        assert run.wait(90) == 80, run.stderr[-3000:]
    finally:
        group.undo()
    (ended,) = [e for e in run.events("rank_exited") if e.get("pid") == pid]
    assert ended["reason"] == "oom_killed" and "OOM killer" in ended["description"], ended
    assert f"Killed process {pid}" in ended["description"], ended
