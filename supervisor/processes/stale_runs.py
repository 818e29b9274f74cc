"""What a supervisor that died without a teardown (SIGKILL, OOM) left behind, ended by the next one.

Its ranks died with it (parent-death signal), but a stopped rank of a
launcher's tree or a setsid escapee (a process that left the rank's process
group) can remain, and so do the run's cgroup, shared-memory run
directory, registry entry and socket.  The registry says which runs are dead
(``observers.control_socket.dead_runs``: entries validated, everything derived
from the run id); this module does the killing and removing, as the teardown
does for a live run.  Only processes of this user carrying the run's marker,
or inside the run's cgroup, are killed.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
from dataclasses import dataclass
from pathlib import Path

import psutil
import structlog

from . import pidfds as procs
from . import shm
from .cgroup import RunCgroup

log = structlog.get_logger("supervise.control")


@dataclass(frozen=True)
class DeadRun:
    """A run whose supervisor is gone, and what it provably owns (our own directories and files)."""

    run_id: str
    pid: int
    run_dirs: tuple[Path, ...]
    files: tuple[Path, ...]  # its socket and registry entry


def sweep(dead: list[DeadRun]) -> list[str]:
    """Kill and remove what each dead run left.  Returns the run ids swept."""
    swept = []
    for run in dead:
        orphans = _kill_run_orphans(run.run_id)
        for cgroup in RunCgroup.existing(run.run_id):
            # Only our ranks' descendants can be in it, whatever they did to their environment.
            orphans |= cgroup.pids()
            cgroup.kill()
            cgroup.remove()
        # What its processes registered with Python's resource tracker (vLLM's semaphores), recorded in its run
        # directory by the hook: the tracker died with them, as the teardown would have, the sweep removes them.
        shm.remove(set().union(*(shm.registered(d) for d in run.run_dirs)))
        for run_dir in run.run_dirs:
            shutil.rmtree(run_dir, ignore_errors=True)
        for path in run.files:
            unlink_own(path)
        log.warning("swept a run whose supervisor died", stale_run_id=run.run_id, pid=run.pid, killed=sorted(orphans))
        swept.append(run.run_id)
    return swept


def unlink_own(path: Path) -> None:
    """Remove ``path`` if it is a file of ours (never a directory, never another user's)."""
    try:
        st = os.lstat(path)
        if st.st_uid == os.geteuid() and not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
    except OSError:
        pass


def _kill_run_orphans(run_id: str) -> set[int]:
    """SIGKILL the processes a dead run left: they carry its marker AND run as this user (never anyone else's).

    Each is held by a pidfd from the scan on (``procs.RunProcesses``: the
    marker was read after the pidfd was opened) and killed through it; its
    owner is read after that too, and the kill succeeds only if that very
    process still held its pid, so a pid reused since the scan is never
    signalled.  Returns the pids killed.
    """
    found = procs.RunProcesses(run_id, root_pid=os.getpid())
    killed = set()
    try:
        found.scan()
        ours = set(procs.descendants())  # our own children are no orphans of a dead run
        for pid, proc in found.held.items():
            if pid in ours or not _same_user(pid):
                continue
            if proc.send(signal.SIGKILL):
                killed.add(pid)
    finally:
        found.close()
    return killed


def _same_user(pid: int) -> bool:
    try:
        return psutil.Process(pid).uids().real == os.getuid()
    except psutil.Error:
        return False
