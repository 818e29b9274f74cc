"""Finding every process of a run, holding each by a pidfd, reaping what reparents to us.

A process belongs to the run by what a rank cannot rewrite (``RunIdentity``):
it is in the run's cgroup, or it descends from the supervisor (we are a
child subreaper, so double-forked and ``setsid`` escapees reparent to us).
Its environment carrying ``SUPERVISE_RUN_KEY=<run key>`` is the last and
weakest signal (it covers a process that left both some other way): engines
call ``setproctitle`` (vLLM's ``VLLM::Worker_TP0``, SGLang's
``sglang::scheduler``), which overwrites the environment block that
``/proc/<pid>/environ`` shows, so a process whose marker is gone stays the
run's when either of the first two holds.  The key is the run id, plus the
node rank when the run spans nodes, so two nodes of one run on one host never
touch each other's processes.

Every process found is held by a pidfd (``Pidfd``) and signalled through it
(``pidfd_send_signal``): once a process is reaped its pidfd names nobody, so
a pid reused by an unrelated process is never signalled.  A pidfd is trusted
only when the evidence that the process is ours was read *after* the pidfd
was opened and the process still held its pid after the read::

    fd = pidfd_open(pid)  →  evidence from /proc/<pid>  →  pidfd_send_signal(fd, 0) ok
                              (marker, cgroup, parent)      (it never let go of the pid,
                                                             so /proc/<pid> was that process)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import select
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
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
    """Called in the child between fork and exec (see spawn.py)."""
    return _prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)


def name_this_thread(name: str) -> None:
    """Name the calling OS thread ``tps-<name>`` (15 bytes at most), so that ``top -H``, ``ps -L`` and
    ``/proc/<pid>/task/*/comm`` say which of the supervisor's threads uses the CPU.  Best effort."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(f"tps-{name}"[:15])
    except OSError:
        pass


def named_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A daemon thread called ``name`` in Python and ``tps-<name>`` for the kernel (see name_this_thread)."""

    def run() -> None:
        name_this_thread(name)
        target()

    return threading.Thread(target=run, name=name, daemon=True)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    state: str  # R S D T t Z X
    name: str
    wchan: str = ""
    session: int = 0
    group: int = 0  # its process group

    def describe(self) -> str:
        wchan = f", wchan {self.wchan}" if self.wchan and self.wchan != "0" else ""
        return f"pid {self.pid} ({self.name}, state {self.state}{wchan})"


def _stat(pid: int | str) -> tuple[str, list[str]] | None:
    """(name, fields after the name) of /proc/<pid>/stat (``pid`` may be ``"<pid>/task/<tid>"``); parsed past
    the parenthesised name."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    close = raw.rfind(")")
    fields = raw[close + 2 :].split()
    if len(fields) < 4:
        return None
    return raw[raw.find("(") + 1 : close], fields


def proc_info(pid: int, wchan: bool = True) -> ProcInfo | None:
    parsed = _stat(pid)
    if parsed is None:
        return None
    name, fields = parsed
    where = ""
    if wchan:
        try:
            with open(f"/proc/{pid}/wchan") as f:
                where = f.read().strip()
        except OSError:
            pass
    return ProcInfo(
        pid=pid,
        ppid=int(fields[1]),
        state=fields[0],
        name=name,
        wchan=where,
        session=int(fields[3]),
        group=int(fields[2]),
    )


def has_run_marker(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def run_marker(run_key: str) -> bytes:
    return f"SUPERVISE_RUN_KEY={run_key}".encode()  # supervisor.processes.spawn.ENV_RUN_KEY


# Deeper than any launcher tree (torchrun → agent → rank, vLLM api_server → engine core → worker → helper).
ANCESTRY_MAX_DEPTH = 64


def _parents(pid: int) -> Iterator[int]:
    """The parent chain of ``pid`` (its parent first), up to init or ANCESTRY_MAX_DEPTH, as /proc says now."""
    for _ in range(ANCESTRY_MAX_DEPTH):
        parsed = _stat(pid)
        if parsed is None:
            return
        pid = int(parsed[1][1])
        if pid <= 1:
            return
        yield pid


def descends_from(pid: int, root: int) -> bool:
    """``root`` is an ancestor of ``pid`` now (the parent chain of /proc/<pid>/stat).

    While the supervisor is a child subreaper, everything it started stays
    below it: a process whose parent dies reparents to the supervisor.
    """
    return root in _parents(pid)


def ancestors_below(pid: int, top: int) -> list[int] | None:
    """The processes between ``top`` and ``pid``, nearest ``pid`` first (``[]``: ``top`` is its parent);
    None when ``top`` is not above it (it reparented, or it is gone)."""
    between: list[int] = []
    for parent in _parents(pid):
        if parent == top:
            return between
        between.append(parent)
    return None


# /proc/<pid>/stat field 52 (exit_code, Linux 3.5+), counted after the parenthesised name: index 49.
_STAT_EXIT_CODE = 49


def zombie_wait_status(pid: int) -> int | None:
    """The wait status of ``pid`` if it is a zombie not yet reaped by its parent (a process that is not our
    child: its status is its parent's, readable here only until the parent reaps it); None otherwise.

    While the zombie exists its pid cannot be reused, so a ``Z`` read here is the process that exited."""
    parsed = _stat(pid)
    if parsed is None or parsed[1][0] != "Z" or len(parsed[1]) <= _STAT_EXIT_CODE:
        return None
    try:
        return int(parsed[1][_STAT_EXIT_CODE])
    except ValueError:
        return None


class RunIdentity:
    """Is this process one of the run's?  By what a rank cannot rewrite, best first.

    ``in_cgroup``: membership of the run's cgroup (v2 or v1; only root moves a
    process out); ancestry: the supervisor (``root``) above it; the run marker
    in its environment last (``setproctitle`` wipes it, see the module
    docstring).  Read each time: the caller opens the pidfd first
    (``open_verified``), so what is read here is about the process it names.
    """

    __slots__ = ("marker", "root", "in_cgroup")

    def __init__(self, run_key: str, root: int | None = None, in_cgroup: Callable[[int], bool] | None = None):
        self.marker = run_marker(run_key)
        self.root = root or os.getpid()
        self.in_cgroup = in_cgroup

    def owns(self, pid: int) -> bool:
        if self.in_cgroup is not None and self.in_cgroup(pid):
            return True
        return descends_from(pid, self.root) or has_run_marker(pid, self.marker)


class Pidfd:
    """One process, by pidfd: a signal reaches it or nobody.

    ``child``: we started it, so it is ours to reap.  While such a child is
    not reaped its pid (and the process group it leads) cannot be reused, which
    is what makes ``killpg`` by number safe (``launch.signal_group``).  The
    owner closes it.
    """

    __slots__ = ("pid", "fd", "child", "reaped")

    def __init__(self, pid: int, fd: int, child: bool = False):
        self.pid = pid
        self.fd = fd
        self.child = child
        self.reaped = False

    @classmethod
    def open(cls, pid: int, child: bool = False) -> Pidfd | None:
        try:
            return cls(pid, os.pidfd_open(pid), child)
        except OSError:
            return None

    def __repr__(self) -> str:
        return f"Pidfd(pid={self.pid}, fd={self.fd})"

    def fileno(self) -> int:
        return self.fd

    def send(self, signum: int) -> bool:
        """Signal the process; False once it is gone (0: does it still hold its pid, zombie or not)."""
        if self.fd < 0:
            return False
        try:
            signal.pidfd_send_signal(self.fd, signum)
            return True
        except OSError:
            return False

    def exited(self) -> bool:
        """It ended (a zombie or reaped): the pidfd is readable."""
        if self.fd < 0:
            return True
        return bool(select.select([self.fd], [], [], 0)[0])

    def wait(self, reap: bool):
        """``waitid`` on the pidfd without blocking: the result, or None while it runs.

        ``reap=False`` leaves the zombie (and with it the pid) in place.
        Raises ChildProcessError when it is not (or no longer) our child.
        """
        flags = os.WEXITED | os.WNOHANG | (0 if reap else os.WNOWAIT)
        result = os.waitid(os.P_PIDFD, self.fd, flags)
        if reap and result is not None:
            self.reaped = True
        return result

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_verified(pid: int, evidence: Callable[[int], bool], child: bool = False) -> Pidfd | None:
    """A pidfd for ``pid`` if ``evidence(pid)`` holds for the very process the pidfd names."""
    proc = Pidfd.open(pid, child)
    if proc is None:
        return None
    if evidence(pid) and proc.send(0):
        return proc
    proc.close()
    return None


# Reading /proc/<pid>/environ takes the target's mmap lock: a process stuck in
# uninterruptible sleep while holding it would block the reader.  The marker
# scan therefore runs on a worker thread with this deadline.
MARKER_SCAN_TIMEOUT_S = 2.0


class _MarkerScan:
    """One walk of /proc for the run marker, on a worker thread that may be left behind."""

    def __init__(self, marker: bytes, skip: set[int]):
        self._marker = marker
        self._skip = skip
        self._lock = threading.Lock()
        self._found: list[Pidfd] = []
        self._taken = False
        self._done = threading.Event()

    def run(self, timeout: float) -> tuple[list[Pidfd], bool]:
        thread = threading.Thread(target=self._walk, name="marker-scan", daemon=True)
        thread.start()
        complete = self._done.wait(timeout)
        with self._lock:
            self._taken = True  # what it finds from now on, it closes itself
            return list(self._found), complete

    def _walk(self) -> None:
        try:
            for entry in os.listdir("/proc"):
                if self._taken:
                    return  # given up on: nobody reads what comes next
                if not entry.isdigit() or int(entry) in self._skip:
                    continue
                proc = open_verified(int(entry), lambda pid: has_run_marker(pid, self._marker))
                if proc is None:
                    continue
                with self._lock:
                    if self._taken:
                        proc.close()
                        return
                    self._found.append(proc)
        finally:
            self._done.set()


def _children_map() -> dict[int, list[int]]:
    """ppid → pids of every live (non-zombie) process, from /proc/<pid>/stat."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        parsed = _stat(int(entry))
        if parsed is None or parsed[1][0] in ("Z", "X"):
            continue
        out.setdefault(int(parsed[1][1]), []).append(int(entry))
    return out


# The supervisor's own long-lived helper processes (node 0's store host): children of the supervisor, but not
# processes of the run: the teardown never signals them and the orphan reaper never reaps them (their owner
# waits for them).
OWN_HELPERS: set[int] = set()


class RunProcesses:
    """The processes of one run, each held by a verified pidfd (``close()`` releases them).

    ``scan()`` is the one walk of /proc for the run marker (it reads every
    process's environment: up to MARKER_SCAN_TIMEOUT_S); ``refresh()`` adds what
    appeared since from the cheap sources only: the supervisor's descendants
    (/proc/<pid>/stat) and the run's cgroup.
    """

    def __init__(
        self,
        run_key: str,
        root_pid: int | None = None,
        cgroup_pids: Callable[[], set[int]] | None = None,
        in_cgroup: Callable[[int], bool] | None = None,
    ):
        self.marker = run_marker(run_key)
        self.root = root_pid or os.getpid()
        self._cgroup_pids = cgroup_pids
        self._in_cgroup = in_cgroup
        self.held: dict[int, Pidfd] = {}
        self.marker_scans = 0

    def scan(self, timeout: float = MARKER_SCAN_TIMEOUT_S) -> list[Pidfd]:
        """Descendants, cgroup members, then every marked process: the new ones."""
        new = self.refresh()
        self.marker_scans += 1
        found, complete = _MarkerScan(self.marker, set(self.held) | {self.root}).run(timeout)
        if not complete:
            log.warning(
                "process scan for the run marker timed out; using descendants and the cgroup only", timeout_s=timeout
            )
        for proc in found:
            if proc.pid in self.held:
                proc.close()
            else:
                self.held[proc.pid] = proc
                new.append(proc)
        return new

    def refresh(self) -> list[Pidfd]:
        """Descendants and cgroup members not held yet (no environment is read)."""
        new: list[Pidfd] = []
        children = _children_map()
        parents = [self.root]
        while parents:
            parent = parents.pop()
            for pid in children.get(parent, ()):
                if pid in OWN_HELPERS:
                    continue  # nor anything below it
                parents.append(pid)
                if pid in self.held:
                    continue
                proc = open_verified(pid, functools.partial(self._child_of, parent=parent))
                if proc is not None:
                    self.held[pid] = proc
                    new.append(proc)
        if self._cgroup_pids is not None and self._in_cgroup is not None:
            for pid in self._cgroup_pids() - set(self.held) - {self.root}:
                proc = open_verified(pid, self._in_cgroup)
                if proc is not None:
                    self.held[pid] = proc
                    new.append(proc)
        return new

    def _child_of(self, pid: int, parent: int) -> bool:
        """``pid``'s parent is ``parent``, and that is the process we hold (or the root)."""
        info = proc_info(pid, wchan=False)
        if info is None or info.ppid != parent:
            return False
        if parent == self.root:
            return True
        held = self.held.get(parent)
        return held is not None and held.send(0)

    def live(self) -> list[Pidfd]:
        return [p for p in self.held.values() if not p.exited()]

    def close(self) -> None:
        for proc in self.held.values():
            proc.close()
        self.held.clear()


def descendants(pid: int | None = None) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid or os.getpid()).children(recursive=True)]
    except psutil.Error:
        return []


def helpers_below(root: int, skip: set[int], limit: int) -> list[int]:
    """The descendants of ``root`` that are neither in ``skip`` nor below one of them (a rank's own children:
    a compile worker), oldest first, at most ``limit``: the processes of a launcher's tree that nobody holds
    (vLLM's resource tracker, SGLang's detokenizer).  One read of the process table."""
    try:
        parent = {p.info["pid"]: p.info["ppid"] for p in psutil.process_iter(["pid", "ppid"])}
    except psutil.Error:
        return []
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    out, stack = [], list(children.get(root, ()))
    while stack:
        pid = stack.pop()
        if pid in skip:
            continue
        out.append(pid)
        stack.extend(children.get(pid, ()))
    return sorted(out)[:limit]


def child_pids() -> list[int]:
    """Our direct children (every thread's: each thread is a parent of what it forked)."""
    me = os.getpid()
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{me}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{me}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def reap_orphans(keep: Iterable[int]) -> int:
    """Reap our zombie children that are processes of the run we did not start.

    Never ``waitpid(-1)``: each zombie is reaped by its pid (``waitid(P_PID)``),
    and only when it is not in ``keep`` (ranks and the launcher: their status
    belongs to the exit monitor) and not in our own process group.  The
    supervisor's own helpers (py-spy, ...) share its process group and are
    waited for by whoever started them; every process of the run lives in a
    rank's group (each rank leads one) or in a group or session it made
    itself, never in ours.  A zombie stays a zombie until reaped, so its pid
    cannot change hands between the check and the reap.  Returns how many were
    reaped.
    """
    keep = set(keep)
    own_group = os.getpgid(0)
    reaped = 0
    for pid in child_pids():
        if pid in keep or pid in OWN_HELPERS:
            continue
        info = proc_info(pid, wchan=False)
        if info is None or info.state != "Z" or info.group == own_group:
            continue
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG) is not None:
                reaped += 1
        except ChildProcessError:
            continue
    return reaped


# /proc/<pid>/stat field 9 (flags), counted after the parenthesised name: index 6; PF_EXITING is set by the
# first step of a thread's exit (do_exit) and stays set.
_STAT_FLAGS = 6
PF_EXITING = 0x4


def is_exiting(pid: int) -> bool:
    """True when ``pid`` is gone or on its way out: any of its threads has begun to exit (a zombie's leader
    too: the flag stays set).  A process killed by a signal can take a while to finish (every thread exits, the
    last one frees the memory): its children's parent-death signal arrives at the first thread's exit, so a
    child can be gone before the parent's exit is readable."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True  # reaped
    live = False
    for tid in tids:
        parsed = _stat(f"{pid}/task/{tid}")
        if parsed is None or len(parsed[1]) <= _STAT_FLAGS:
            continue  # gone since the listing
        try:
            if int(parsed[1][_STAT_FLAGS]) & PF_EXITING:
                return True
        except ValueError:
            continue
        live = True
    return not live


def is_gone(pid: int) -> bool:
    """True when the pid no longer names a live process (zombies count as gone)."""
    info = proc_info(pid, wchan=False)
    return info is None or info.state in ("Z", "X")
