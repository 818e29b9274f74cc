"""A survivor of SIGKILL: a rank's child in a frozen cgroup v1 freezer (state D, SIGKILL stays pending).

``FROZEN_CHILD`` is the rank program (``python frozen.py FREEZER_DIR``): rank 0
forks a child that moves itself into the freezer cgroup ``FREEZER_DIR``, then
both sleep.  ``freeze_survivor`` freezes the cgroup once the child is in it;
``thaw`` lets the pending SIGKILL take the child, ``wait_empty`` sees it gone.
The run's own cgroups cannot be removed while the survivor is in one:
``remove_run_cgroups`` does it afterwards.
"""

from __future__ import annotations

from pathlib import Path

from tests.live import wait_for

FREEZER_ROOT = Path("/sys/fs/cgroup/freezer")
FREEZE_LIMIT_S = 5.0
EMPTY_LIMIT_S = 10.0
WAIT_INTERVAL_S = 0.05
RUN_CGROUP_BASES = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/pids"))

FROZEN_CHILD = """
import os, sys, time
if os.environ.get("RANK") == "0" and os.fork() == 0:
    with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
while True:
    time.sleep(3600)
"""


def freeze_survivor(freezer: Path, child_limit_s: float) -> int:
    """Wait (up to ``child_limit_s``) for the rank's child in ``freezer``, freeze the cgroup and wait until it
    reads FROZEN; the child's pid."""
    pids = wait_for(lambda: _members(freezer), child_limit_s, "the child in the freezer", WAIT_INTERVAL_S)
    (freezer / "freezer.state").write_text("FROZEN")
    wait_for(lambda: _state(freezer) == "FROZEN", FREEZE_LIMIT_S, "the freeze", WAIT_INTERVAL_S)
    return int(pids[0])


def freeze_thread(freezer: Path, tid: int) -> None:
    """Move one thread (by its id) into ``freezer`` and freeze it: it cannot run, nor exit, until thawed."""
    (freezer / "tasks").write_text(str(tid))
    (freezer / "freezer.state").write_text("FROZEN")
    wait_for(lambda: _state(freezer) == "FROZEN", FREEZE_LIMIT_S, "the freeze", WAIT_INTERVAL_S)


def thaw(freezer: Path) -> None:
    """Thaw ``freezer``: the survivor's pending SIGKILL takes it now."""
    (freezer / "freezer.state").write_text("THAWED")


def wait_empty(freezer: Path) -> None:
    """Wait until nothing is left in the thawed ``freezer``."""
    wait_for(lambda: not _members(freezer), EMPTY_LIMIT_S, "the survivor to die once thawed", WAIT_INTERVAL_S)


def _members(freezer: Path) -> list[str]:
    return (freezer / "cgroup.procs").read_text().split()


def _state(freezer: Path) -> str:
    return (freezer / "freezer.state").read_text().strip()


def remove_run_cgroups(run_id: str) -> list[str]:
    """Remove the cgroups the run's supervisor left behind (the survivor was in them at its teardown).

    Returns what could not be removed, one ``"path: error"`` each."""
    failed = []
    for base in RUN_CGROUP_BASES:
        leftover = base / f"tp-supervise-{run_id}"
        if leftover.is_dir():
            try:
                leftover.rmdir()
            except OSError as exc:
                failed.append(f"{leftover}: {exc}")
    return failed
