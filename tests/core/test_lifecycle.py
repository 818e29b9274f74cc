"""Supervisor lifecycle: signals to the supervisor, its own death, restarts."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from tests.conftest import fake_rank, marked_pids, wait_no_marked
from tests.live import wait_for
from tp_supervise.supervisor.rank.runtime import REGISTERED_SHM_FILE


def _wait_ranks(mark: str, count: int, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = marked_pids(mark)
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"expected {count} marked processes, saw {marked_pids(mark)}")


def test_sigterm_stops_gracefully_with_exit_0(supervise):
    run = supervise(["--nproc-per-node", "2", "--kill-grace", "3"], fake_rank("--all", "loop"))
    _wait_ranks(supervise.mark, 3)
    time.sleep(0.5)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=20) == 0, run.stderr[-3000:]
    assert run.bundles() == []


def test_second_sigint_kills_immediately(supervise):
    run = supervise(["--nproc-per-node", "2", "--kill-grace", "30"], fake_rank("--all", "ignore_term"))
    _wait_ranks(supervise.mark, 3)
    time.sleep(0.5)
    run.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    run.wait(timeout=20)
    assert time.monotonic() - t0 < 10, "second SIGINT must not wait for the 30 s grace"
    assert run.events("second stop signal")


def test_supervisor_sigkill_leaves_no_rank(supervise):
    pidfile = supervise.tmp / "escapee.pid"
    run = supervise(
        ["--nproc-per-node", "3"],
        fake_rank("--all", "loop", "--on", "1=doublefork"),
        env={"FAKE_ESCAPEE_FILE": str(pidfile)},
    )
    # The supervisor, its three ranks and rank 1's escaped grandchild, which names itself (a guess
    # by session id can take the intermediate fork before its setsid): all started before the kill.
    escapee = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 20.0, "rank 1's grandchild"))
    pids = _wait_ranks(supervise.mark, 5)
    time.sleep(0.5)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(timeout=10)  # not communicate(): the orphan holds the pipes
    left = wait_no_marked(supervise.mark, timeout=1.0)
    # The double-forked setsid grandchild is not a rank: it has no parent-death
    # signal.  Every rank must be gone within a second.
    rank_pids = [p for p in pids if p not in (run.proc.pid, escapee)]
    assert not [p for p in left if p in rank_pids], f"ranks survived the supervisor: {left}"
    # A semaphore its ranks registered with Python's resource tracker (as vLLM's do), recorded by the hook in the
    # run's directory as it records one: the tracker died with the run, nobody unlinks it.
    (entry,) = (supervise.tmp / "registry").glob("*.json")
    run_dir = Path("/dev/shm") / f"tp-supervise-{json.loads(entry.read_text())['run_id']}"
    sem = f"mp-tps{os.getpid()}"
    (Path("/dev/shm") / f"sem.{sem}").write_bytes(b"\0" * 32)
    with open(run_dir / REGISTERED_SHM_FILE, "a") as f:
        f.write(f"semaphore /{sem}\n")
    # The next supervisor on the host sweeps what the dead one left behind:
    # the setsid grandchild (no parent-death signal), the registry entry, the run's directory and that semaphore.
    nxt = supervise(["--nproc-per-node", "1"], fake_rank("--all", "finish", "--steps", "3"))
    assert nxt.wait(timeout=30) == 0, nxt.stderr[-3000:]
    swept = nxt.events("swept a run whose supervisor died")
    assert swept and sorted(swept[0]["killed"]) == sorted(left)
    assert not run_dir.exists() and not (Path("/dev/shm") / f"sem.{sem}").exists()
    assert wait_no_marked(supervise.mark, timeout=2.0) == []
    run.wait(timeout=10)


def test_restart_policy_relaunches_then_reports_crash_loop(supervise):
    run = supervise(
        ["--nproc-per-node", "2", "--kill-grace", "1", "--max-restarts", "2"],
        fake_rank("--all", "sleep", "--on", "1=exit:3", "--delay", "0.3"),
    )
    assert run.wait(timeout=60) == 80
    assert len(run.events("restarting the group")) == 2
    assert run.events("crash loop")
    assert len([b for b in run.bundles() if "rank_exit" in b.name]) == 3


def test_startup_timeout_names_the_ranks_that_never_became_ready(supervise):
    # Rank 1 declares itself instrumented (runtime.starting) and never calls ready().
    run = supervise(
        ["--nproc-per-node", "2", "--startup-timeout", "3", "--kill-grace", "1"],
        fake_rank("--all", "loop", "--on", "1=sleep"),
    )
    assert run.wait(timeout=60) == 83, run.stderr[-3000:]
    summary = run.summary("startup_timeout")
    assert summary["reason"] == "startup_timeout"
    assert summary["culprit_ranks"] == [1]
    assert "--startup-timeout" in summary["verdict"]
