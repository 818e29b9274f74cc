"""Issue 11: nothing the supervisor does before a teardown can block it (real processes).

The dump directory blocks every write, for real: it is a tmpfs mounted for
the test and watched by a fanotify listener that never answers the kernel's
permission request, so every open(2) of a file in it sleeps in the kernel,
as on a hung NFS mount (needs CAP_SYS_ADMIN; skipped without it).  The same
tests also run through tests/fakes/stall_dumps.py, whose bundle writer first
opens a FIFO that nobody reads: that works on any host.  A hang and a rank
exit must still be torn down within --kill-grace + --dump-timeout + a few
seconds of the fault being noticed, exit with the fault's code (81, 80) and
leave no process.

A GPU driver whose NVML calls never return (a stand-in ``pynvml`` on the
supervisor's path) must not stop the watchdog or the teardown either.

The blockers and the stand-in NVML are tests/support/blockers.py's, shared
with bench/bench_dump_deadline.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import MARK_VAR, ROOT, Run, fake_rank
from tests.live import wait_registry
from tests.support.blockers import BlockingMount, FifoStall, wedged_pynvml

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # tens of seconds of real time each: make test-slow

GLOO = str(ROOT / "tests" / "fakes" / "gloo_loop.py")
STALL_WRAPPER = ROOT / "tests" / "fakes" / "stall_dumps.py"
KILL_GRACE_S = 2.0
DUMP_TIMEOUT_S = 3.0
SLACK_S = 3.0  # thread wake-ups and the 2 s kill confirmation on a loaded 2-core machine
RUN_TIMEOUT_S = 120.0


@pytest.fixture(params=["mount", "fifo"])
def blocked_dumps(request, tmp_path):
    """(dump dir, blocker, entry point): the really blocking mount (skipped where the test may
    not mount or use fanotify), then the FIFO stall through the wrapper, which works anywhere."""
    dump_dir = tmp_path / "dumps"
    if request.param == "mount":
        try:
            blocker = BlockingMount(dump_dir)
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"cannot mount a blocking filesystem here ({exc}); the fifo variant covers this host")
        entry = None
    else:
        blocker = FifoStall(dump_dir)
        entry = STALL_WRAPPER
    yield dump_dir, blocker, entry
    blocker.close()


def start(supervise, dump_dir: Path, entry: Path | None, args: list[str], command: list[str]) -> Run:
    """The ``supervise`` fixture's run, through ``entry`` (a wrapper of the CLI) when given."""
    return supervise(args, command, dump_dir=dump_dir, entry=entry)


def start_blocked(supervise, tmp_path: Path, blocked_dumps: tuple, args: list[str], command: list[str]) -> Run:
    """``start`` with the ``blocked_dumps`` fixture's directory and entry point; its blocker armed once the
    supervisor registered (past the start-up check, which writes into the dump dir)."""
    dump_dir, blocker, entry = blocked_dumps
    run = start(supervise, dump_dir, entry, args, command)
    wait_registry(tmp_path / "registry")
    blocker.arm()
    return run


def ts(line: dict) -> datetime:
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00"))


def seconds_from(run: Run, first: dict) -> float:
    exited = run.events("supervise exiting")
    assert exited, run.stderr[-3000:]
    return (ts(exited[-1]) - ts(first)).total_seconds()


def finish(run: Run) -> int:
    try:
        return run.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate()


def gloo(*args: str) -> list[str]:
    return [sys.executable, GLOO, *args]


DEADLINE_ARGS = ["--kill-grace", str(KILL_GRACE_S), "--dump-timeout", str(DUMP_TIMEOUT_S)]


def test_a_hang_is_torn_down_although_the_dump_directory_blocks(supervise, tmp_path, blocked_dumps):
    run = start_blocked(
        supervise,
        tmp_path,
        blocked_dumps,
        ["--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", *DEADLINE_ARGS],
        gloo("--iters", "100000", "--fault", "stop", "--fault-at", "30"),
    )
    code = finish(run)
    assert code == 81, run.stderr[-4000:]
    hang = [line for line in run.lines if line.get("event") == "hang"]
    assert hang, run.stderr[-3000:]
    took = seconds_from(run, hang[0])
    assert took < KILL_GRACE_S + DUMP_TIMEOUT_S + SLACK_S, took
    assert run.events("teardown complete"), run.stderr[-3000:]
    # The bundles could not be written; the supervisor said so and exited anyway.
    assert run.events("not written within --dump-timeout"), run.stderr[-3000:]
    assert not run.events("incident bundle written")


def test_a_rank_exit_is_torn_down_although_the_dump_directory_blocks(supervise, tmp_path, blocked_dumps):
    run = start_blocked(
        supervise,
        tmp_path,
        blocked_dumps,
        ["--nproc-per-node", "3", *DEADLINE_ARGS],
        fake_rank("--all", "sleep", "--on", "1=sigkill", "--delay", "2"),
    )
    code = finish(run)
    assert code == 80, run.stderr[-4000:]
    death = [line for line in run.lines if line.get("level") == "error" and line.get("rank") == 1]
    assert death, run.stderr[-3000:]
    assert seconds_from(run, death[0]) < KILL_GRACE_S + DUMP_TIMEOUT_S + SLACK_S
    assert run.events("not written within --dump-timeout"), run.stderr[-3000:]


def test_a_wedged_gpu_driver_stops_neither_the_watchdog_nor_the_teardown(supervise, tmp_path):
    path = wedged_pynvml(tmp_path / "wedged-nvml", os.environ.get("PYTHONPATH", ""))
    run = supervise(
        ["--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", *DEADLINE_ARGS],
        gloo("--iters", "100000", "--fault", "stop", "--fault-at", "30"),
        env={"PYTHONPATH": path},
    )
    code = finish(run)
    assert code == 81, run.stderr[-4000:]
    assert run.events("gpu telemetry enabled"), "the stand-in NVML was not used"
    hang = [line for line in run.lines if line.get("event") == "hang"]
    assert hang and seconds_from(run, hang[0]) < KILL_GRACE_S + DUMP_TIMEOUT_S + SLACK_S
    summary = run.summary("-hang")
    assert summary["culprit_ranks"] == [1], summary["verdict"]
    assert "gpu" not in summary, "no NVML reading ever completed, so there is none to report"
    done = run.events("teardown complete")
    assert done and done[-1]["gpu_memory_verified"] is False  # not waited for: the sampler is stuck


# Each rank writes this much to its stderr first: as JSON records on the supervisor's stderr, ~15 times what a
# pipe holds (64 KiB), far below what the supervisor queues for a slow reader (supervisor/logs.py).
FLOOD_LINES = 2000
FLOOD = f"import sys\nfor i in range({FLOOD_LINES}): sys.stderr.write('chatter %d ' % i + 'x' * 200 + '\\n')"


def test_a_hang_is_ruled_and_torn_down_although_nobody_reads_the_supervisors_output(supervise):
    """The supervisor's stdout and stderr are pipes nobody reads (a paused terminal, a log agent that fell
    behind) and the ranks' chatter filled them before rank 1 stopped: the hang is ruled and torn down as if
    they were read, not when someone reads them (before: the output thread waited on the full pipe under the
    log handler's lock, and the main thread with it at its next log line, for as long as nobody read)."""
    ranks = ["bash", "-c", '"$0" -c "$1" && shift && exec "$@"', sys.executable, FLOOD,
             *gloo("--iters", "100000", "--fault", "stop", "--fault-at", "300")]
    run = supervise(["--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", *DEADLINE_ARGS], ranks)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while run.proc.poll() is None and time.monotonic() < deadline:  # poll() reads nothing of the pipes
        time.sleep(0.2)
    exited_unread = run.proc.poll() is not None
    code = finish(run)  # now reads them
    assert exited_unread, f"the supervisor was still running {RUN_TIMEOUT_S:.0f} s on, its output unread"
    assert code == 81, run.stderr[-4000:]
    assert run.summary("-hang")["culprit_ranks"] == [1]
