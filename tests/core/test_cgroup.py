"""A cgroup per run (issue 14): an escapee that scrubbed its environment is still found.

The escapee double-forks, calls setsid and execs `env -i`: no process group,
no parent chain and no run marker lead to it.  Where the host lets the
supervisor create a cgroup, teardown finds it there, also after the
supervisor itself was SIGKILLed and the next run swept its cgroup.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import fake_rank
from tests.live import wait_for
from tests.support.procs import alive
from tp_supervise.supervisor.processes.cgroup import RunCgroup


def _cgroups_usable() -> bool:
    probe, _why = RunCgroup.create(f"probe-{os.getpid()}")
    if probe is None:
        return False
    probe.remove()
    return True


pytestmark = pytest.mark.skipif(not _cgroups_usable(), reason="no writable cgroup hierarchy on this host")


def _escapee(path) -> int:
    wait_for(lambda: path.exists() and path.read_text().strip(), 30, "the escapee's pid file")
    return int(path.read_text())


def test_teardown_kills_an_escapee_that_scrubbed_its_environment(supervise, tmp_path):
    pidfile = tmp_path / "escapee.pid"
    run = supervise(
        ["--nproc-per-node", "2", "--kill-grace", "1"],
        fake_rank("--all", "sleep", "--on", "1=scrubbed"),
        env={"FAKE_ESCAPEE_FILE": str(pidfile)},
    )
    pid = _escapee(pidfile)
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"SUPERVISE_RUN_ID" not in f.read()  # the marker scan cannot find it
        run.proc.send_signal(signal.SIGINT)
        assert run.wait(60) == 0, run.stderr[-3000:]
        wait_for(lambda: not alive(pid), 5, "the escapee to be gone")
        tracking = run.events("process tracking")
        assert tracking and tracking[0]["mechanism"].startswith("cgroup"), run.stderr[-2000:]
        assert not RunCgroup.existing(run.run_id()), "the run's cgroup was left behind"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_the_next_run_sweeps_the_cgroup_of_a_sigkilled_supervisor(supervise, tmp_path):
    pidfile = tmp_path / "escapee.pid"
    run = supervise(["--nproc-per-node", "1"], fake_rank("--all", "scrubbed"), env={"FAKE_ESCAPEE_FILE": str(pidfile)})
    pid = _escapee(pidfile)
    try:
        time.sleep(0.5)
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=10)
        time.sleep(1.0)
        assert alive(pid), "nothing but the cgroup could have found it"
        nxt = supervise(["--nproc-per-node", "1"], fake_rank("--all", "finish", "--steps", "3"))
        assert nxt.wait(60) == 0, nxt.stderr[-3000:]
        swept = nxt.events("swept a run whose supervisor died")
        assert swept and pid in swept[0]["killed"], nxt.stderr[-3000:]
        wait_for(lambda: not alive(pid), 5, "the escapee to be gone")
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        run.wait(timeout=10)
