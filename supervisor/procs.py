"""Finding every process of a run and reaping what reparents to us.

A process belongs to the run when it descends from the supervisor (we are a
child subreaper, so double-forked and ``setsid`` escapees reparent to us) or
when its environment carries ``SUPERVISE_RUN_KEY=<run key>`` (covers processes
that left the tree some other way; the key is the run id, plus the node rank
when the run spans nodes, so two nodes of one run on one host never touch each
other's processes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from dataclasses import dataclass

import psutil
import structlog

log = structlog.get_logger("supervise.procs")

PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def make_subreaper() -> bool:
    """Orphans of our subtree reparent to us instead of init."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def set_parent_death_signal(signum: int) -> int:
    """Called in the child between fork and exec (see launch.py)."""
    return _prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    state: str  # R S D T t Z X
    name: str
    wchan: str = ""

    def describe(self) -> str:
        wchan = f", wchan {self.wchan}" if self.wchan and self.wchan != "0" else ""
        return f"pid {self.pid} ({self.name}, state {self.state}{wchan})"


def proc_info(pid: int) -> ProcInfo | None:
    """State from /proc/<pid>/stat (parsed past the parenthesised name)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    close = raw.rfind(")")
    name = raw[raw.find("(") + 1 : close]
    fields = raw[close + 2 :].split()
    if len(fields) < 2:
        return None
    try:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip()
    except OSError:
        wchan = ""
    return ProcInfo(pid=pid, ppid=int(fields[1]), state=fields[0], name=name, wchan=wchan)


def has_run_marker(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


# Reading /proc/<pid>/environ takes the target's mmap lock: a process stuck in
# uninterruptible sleep while holding it would block the reader.  The marker
# scan therefore runs on a worker thread with this deadline.
MARKER_SCAN_TIMEOUT_S = 2.0


def _marked(run_id: str, skip: set[int]) -> set[int]:
    marker = f"SUPERVISE_RUN_KEY={run_id}".encode()  # supervisor.launch.ENV_RUN_KEY
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in skip and has_run_marker(int(entry), marker):
            found.add(int(entry))
    return found


def run_processes(run_id: str, root_pid: int | None = None) -> set[int]:
    """Every live (or zombie) process of the run, excluding the supervisor."""
    me = root_pid or os.getpid()
    found = set(descendants(me))
    result: list[set[int]] = []
    scan = threading.Thread(
        target=lambda: result.append(_marked(run_id, found | {me})), name="marker-scan", daemon=True
    )
    scan.start()
    scan.join(MARKER_SCAN_TIMEOUT_S)
    if result:
        found |= result[0]
    else:
        log.warning("process scan for the run marker timed out; using descendants only",
                    timeout_s=MARKER_SCAN_TIMEOUT_S)
    found.discard(me)
    return found


def descendants(pid: int | None = None) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid or os.getpid()).children(recursive=True)]
    except psutil.Error:
        return []


def direct_children(pid: int | None = None) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid or os.getpid()).children(recursive=False)]
    except psutil.Error:
        return []


def reap_children(exclude: set[int]) -> list[tuple[int, int]]:
    """Reap exited direct children (orphans reparented to us) not in ``exclude``.

    Ranks are reaped by the exit monitor, which needs their status; everything
    else that reparented to the subreaper is reaped here so no zombie stays.
    """
    reaped = []
    for pid in direct_children():
        if pid in exclude:
            continue
        try:
            wpid, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if wpid:
            reaped.append((wpid, status))
    return reaped


def is_gone(pid: int) -> bool:
    """True when the pid no longer names a live process (zombies count as gone)."""
    info = proc_info(pid)
    return info is None or info.state in ("Z", "X")
