"""Process handling: pidfds, continuous reaping, one marker scan, attempts, fds, exit 85.

Real processes throughout; the survivor of SIGKILL is a real one: a process
in a frozen cgroup v1 ``freezer`` keeps SIGKILL pending (state D) until it is
thawed, which is exactly what teardown must report as exit 85.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tests.conftest import marked_pids
from tests.live import wait_for
from tests.support.freezer import FROZEN_CHILD, freeze_survivor, remove_run_cgroups, thaw, wait_empty

CHILD_LIMIT_S = 20.0  # until rank 0's child is in the freezer
POLL_S = 0.05

# A rank that keeps leaving orphans: each child double-forks a grandchild that
# lives briefly; the grandchild reparents to the supervisor (subreaper) and dies.
ORPHAN_MAKER = """
import os, sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    if os.fork() == 0:
        if os.fork() == 0:
            time.sleep(0.05)
            os._exit(0)
        os._exit(0)
    os.wait()
    time.sleep(0.05)
open(sys.argv[2], "w").write("done")
while True:
    time.sleep(3600)
"""


def _script(tmp_path: Path, name: str, code: str) -> str:
    path = tmp_path / name
    path.write_text(code)
    return str(path)


def _zombie_children(pid: int) -> int:
    count = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                stat = Path(f"/proc/{child}/stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                count += 1
    return count


def test_orphans_are_reaped_while_the_run_goes_on(supervise, tmp_path):
    done = tmp_path / "done"
    run = supervise(
        ["--nproc-per-node", "1", "--kill-grace", "1"],
        [sys.executable, _script(tmp_path, "orphans.py", ORPHAN_MAKER), "4", str(done)],
    )
    wait_for(lambda: run.proc.poll() is not None or len(marked_pids(supervise.mark)) >= 2, 30, "the rank", POLL_S)
    most = 0
    while not done.exists() and run.proc.poll() is None:
        most = max(most, _zombie_children(run.proc.pid))
        time.sleep(0.1)
    assert run.proc.poll() is None, run.stderr
    # ~40 orphans were made; without continuous reaping every one would still be a zombie here.
    time.sleep(1.0)
    left = _zombie_children(run.proc.pid)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=20) == 0, run.stderr[-3000:]
    assert left == 0, f"{left} zombie children after the orphans ended"
    assert most <= 10, f"up to {most} zombie children while the rank made orphans"


def test_one_marker_scan_per_teardown(supervise, tmp_path):
    run = supervise(
        ["--nproc-per-node", "2", "--kill-grace", "1"],
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1); raise SystemExit(3)",
        ],
    )
    assert run.wait(timeout=30) == 80, run.stderr[-3000:]
    done = run.events("teardown complete")
    assert done and done[-1]["marker_scans"] == 1, done


def test_a_process_that_survives_sigkill_is_exit_85(supervise, tmp_path, freezer):
    grace = 1.0
    run = supervise(
        ["--nproc-per-node", "2", "--kill-grace", str(grace)],
        [sys.executable, _script(tmp_path, "frozen.py", FROZEN_CHILD), str(freezer)],
    )
    survivor = freeze_survivor(freezer, CHILD_LIMIT_S)
    try:
        t0 = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        code = run.wait(timeout=30)
        stop_to_exit = time.monotonic() - t0
        assert code == 85, run.stderr[-3000:]
        incomplete = run.events("teardown incomplete")
        assert incomplete, run.stderr[-3000:]
        assert any(f"pid {survivor} " in s and "state D" in s for s in incomplete[0]["survivors"]), incomplete
        assert incomplete[0]["marker_scans"] == 1
        # One scan, the grace, one kill-confirm deadline: nothing waits twice on the survivor.
        assert incomplete[0]["duration_s"] < grace + 2.0 + 1.5, incomplete
        print(f"teardown with a survivor: {incomplete[0]['duration_s']:.3f} s; SIGTERM to exit {stop_to_exit:.3f} s")
    finally:
        thaw(freezer)
    wait_empty(freezer)
    run_id = run.run_id()
    if run_id:  # the run's cgroup could not be removed while the survivor was in it
        assert remove_run_cgroups(run_id) == []


def _fds(pid: int) -> set[int]:
    return {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


def _fd_targets(pid: int) -> dict[int, str]:
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
    return out


def test_no_fd_leak_across_restarts_and_ranks_inherit_only_what_they_should(supervise):
    # Each attempt's ranks (a shell: no Python start-up hook opens anything) live 1.5 s, then exit 3:
    # a fault, so --max-restarts launches the group again.
    run = supervise(
        ["--nproc-per-node", "2", "--kill-grace", "1", "--max-restarts", "2"], ["/bin/sh", "-c", "sleep 1.5; exit 3"]
    )
    supervisor_fds: list[int] = []  # per attempt, while its ranks run
    rank_fds: dict[int, dict[int, str]] = {}
    attempts: list[set[int]] = []
    while run.proc.poll() is None:
        try:
            ranks = {pid for pid in _children(run.proc.pid) if Path(f"/proc/{pid}/cmdline").read_bytes()[:2] == b"/b"}
            if len(ranks) == 2 and (not attempts or not ranks & attempts[-1]):
                time.sleep(0.3)  # past the spawn: the supervisor holds what an attempt holds
                attempts.append(ranks)
                supervisor_fds.append(len(_fd_targets(run.proc.pid)))
                for pid in ranks:
                    rank_fds[pid] = _fd_targets(pid)
        except OSError:
            pass
        time.sleep(0.02)
    assert run.wait(timeout=60) == 80, run.stderr[-3000:]
    assert len(attempts) == 3, attempts
    assert supervisor_fds[2] <= supervisor_fds[0], f"the supervisor gained fds across restarts: {supervisor_fds}"
    for pid, fds in rank_fds.items():
        extra = {fd: target for fd, target in fds.items() if fd > 2}
        # Beyond 0, 1, 2 (stdout/stderr: pipes to the output pump) a rank inherits the death pipe only
        # (SUPERVISE_DEATH_FD, docs/supervisor.md).
        assert len(extra) == 1 and next(iter(extra.values())).startswith("pipe:"), (pid, fds)


def test_log_lines_and_bundles_name_their_attempt(supervise):
    run = supervise(
        ["--nproc-per-node", "1", "--kill-grace", "1", "--max-restarts", "1"], ["/bin/sh", "-c", "sleep 0.5; exit 3"]
    )
    assert run.wait(timeout=60) == 80, run.stderr[-3000:]
    assert [line["attempt"] for line in run.events("rank started")] == [1, 2]
    assert [line["attempt"] for line in run.events("teardown complete")] == [1, 2]
    summaries = sorted(json.loads((b / "summary.json").read_text())["attempt"] for b in run.bundles())
    assert summaries == [1, 2]
