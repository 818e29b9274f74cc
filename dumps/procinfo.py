"""What ``/proc`` says about a rank: scheduler state, wait channel, CPU, threads.

Read *before* any stack capture: ``py-spy`` attaches with ptrace and the
target then reads as ``t`` (tracing stop) for a moment, which would hide a
real ``T`` (SIGSTOP) or ``D`` (uninterruptible I/O).

CPU time is the sum of every thread's on-CPU nanoseconds
(``/proc/<pid>/task/*/schedstat``), falling back to ``utime + stime`` of
``/proc/<pid>/stat`` (clock ticks) where schedstat is absent or zero.

The values read here (``ProcInfo``, ``CpuSamples``) and the state letters'
names (``STATE_NAMES``) are plain data in ``dumps.evidence``, which the pure
diagnosis reads without importing this reader.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from .evidence import CpuSamples, ProcInfo

NS_PER_S = 1e9
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Fields of /proc/<pid>/stat after the ")" that ends comm (0-based): state, utime, stime, num_threads.
_STAT_STATE, _STAT_UTIME, _STAT_STIME, _STAT_THREADS = 0, 11, 12, 17


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")


def _stat_fields(text: str) -> list[str]:
    # comm may contain spaces and parentheses: split after the last ")".
    return text[text.rindex(")") + 2 :].split()


def _status_field(pid: int, name: str) -> str:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def held_by_our_capture(pid: int) -> bool:
    """Whether ``pid``'s tracer is this process or one of its children: the stack capture's py-spy, attached for
    a moment (a tracing stop, state t, that is no fault of the process's)."""
    try:
        tracer = int(_status_field(pid, "TracerPid") or 0)
        if tracer == 0:
            return False
        return tracer == os.getpid() or int(_status_field(tracer, "PPid") or 0) == os.getpid()
    except (OSError, ValueError):
        return False


# What a process held in a tracing stop by our own capture is said to be: its state before is not known, and it
# was running its program (a stop of its own would show as T, a debugger's as t).
CAPTURE_HELD = "S"


def _state(pid: int, letter: str) -> str:
    return CAPTURE_HELD if letter == "t" and held_by_our_capture(pid) else letter


def proc_state(pid: int | None) -> str | None:
    """The scheduler state letter of ``pid`` (R, S, D, T, Z, ...), or None when it is gone; a tracing stop of our
    own stack capture is not the process's (``held_by_our_capture``)."""
    if not pid:
        return None
    try:
        return _state(pid, _stat_fields(_read(f"/proc/{pid}/stat"))[_STAT_STATE])
    except (OSError, ValueError, IndexError):
        return None


def runq_wait_ns(pid: int) -> int | None:
    """How long, in all, the process's main thread has been ready to run and waited for a CPU (nanoseconds, the
    second field of ``/proc/<pid>/schedstat``; a cgroup's CPU throttling counts: the thread waits on the run
    queue through it); None when it is gone or the kernel keeps no such count.  One small read, no lock of the
    process: the watchdog reads it on its tick while a stall lasts."""
    try:
        return int(_read(f"/proc/{pid}/schedstat").split()[1])
    except (OSError, ValueError, IndexError):
        return None


# Fields of /proc/<pid>/stat after comm (0-based): ppid, then the CPU of the process (utime, stime) and of its
# children it has reaped (cutime, cstime: theirs and their own reaped children's), in clock ticks.
_STAT_PPID, _STAT_CUTIME, _STAT_CSTIME = 1, 13, 14


@dataclass(frozen=True)
class Helpers:
    """What the processes a watched process started (and the engine does not watch) have used of the CPU:
    ``cpu_s`` in all (the live ones and those already reaped), ``live`` each live one's (pid -> (comm, cpu_s))."""

    cpu_s: float
    live: Mapping[int, tuple[str, float]]


def helper_cpu(roots: Iterable[int], known: Collection[int]) -> dict[int, Helpers]:
    """For each root pid, the CPU used by its helper processes: its descendants that are not ``known`` (the
    engine's watched processes: a worker below vLLM's engine core is no helper of it) nor below one, live, plus
    the children it has reaped (a compiler that ended between two reads is counted through the root's
    ``cutime``).  One pass over /proc (each process's ``stat``: no lock of any process); a gone root is
    absent.  A compiler the rank runs inside a step (Inductor's C++ build) is such a helper."""
    parent: dict[int, int] = {}
    comm: dict[int, str] = {}
    own: dict[int, float] = {}  # its CPU and its reaped children's
    reaped: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            text = _read(f"/proc/{name}/stat")
            fields = _stat_fields(text)
            pid = int(name)
            parent[pid] = int(fields[_STAT_PPID])
            comm[pid] = text[text.index("(") + 1 : text.rindex(")")]
            kids = int(fields[_STAT_CUTIME]) + int(fields[_STAT_CSTIME])
            reaped[pid] = kids / _CLK_TCK
            own[pid] = (int(fields[_STAT_UTIME]) + int(fields[_STAT_STIME]) + kids) / _CLK_TCK
        except (OSError, ValueError, IndexError):
            continue
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for root in roots:
        if root not in reaped:
            continue
        live = {}
        todo = [c for c in children.get(root, ()) if c not in known]
        while todo:
            pid = todo.pop()
            live[pid] = (comm[pid], own[pid])
            todo += [c for c in children.get(pid, ()) if c not in known]
        out[root] = Helpers(reaped[root] + sum(cpu for _comm, cpu in live.values()), live)
    return out


def _task_cpu_ns(pid: int, tid: str) -> int:
    try:
        return int(_read(f"/proc/{pid}/task/{tid}/schedstat").split()[0])
    except (OSError, ValueError, IndexError):
        return 0


TITLE_LIMIT = 80


def process_comm(pid: int) -> str:
    """The process's kernel name (``/proc/<pid>/comm``: an engine's setproctitle sets it too); empty when it is
    gone.  No lock of the process is taken, unlike its command line (its mmap lock), so a process stuck in the
    kernel cannot block the reader."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_title(pid: int, limit: int = TITLE_LIMIT, comm_fallback: bool = True) -> str:
    """What the process calls itself now: its command line as ``ps`` shows it (``VLLM::Worker_TP1`` once the
    engine called setproctitle), else (``comm_fallback``) its kernel name; empty when it is gone.  A process
    that is exiting has released its memory, command line included: its kernel name is all that is left."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(4 * limit)
    except OSError:
        raw = b""
    text = " ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part).strip()
    if not text and comm_fallback:
        try:
            stat = _read(f"/proc/{pid}/stat")
            text = stat[stat.find("(") + 1 : stat.rfind(")")]
        except OSError:
            text = ""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def read_proc(pid: int) -> ProcInfo | None:
    """``None`` when the process is gone (or never existed)."""
    try:
        fields = _stat_fields(_read(f"/proc/{pid}/stat"))
    except (OSError, ValueError):
        return None
    state = _state(pid, fields[_STAT_STATE])
    ticks_s = (int(fields[_STAT_UTIME]) + int(fields[_STAT_STIME])) / _CLK_TCK
    try:
        wchan = _read(f"/proc/{pid}/wchan").strip()
    except OSError:
        wchan = ""
    if wchan == "0":
        wchan = ""
    states: dict[str, int] = {}
    cpu_ns = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            letter = _stat_fields(_read(f"/proc/{pid}/task/{tid}/stat"))[_STAT_STATE]
        except (OSError, ValueError, IndexError):
            continue
        states[letter] = states.get(letter, 0) + 1
        cpu_ns += _task_cpu_ns(pid, tid)
    cpu_s = cpu_ns / NS_PER_S if cpu_ns else ticks_s
    return ProcInfo(
        pid=pid,
        state=state,
        wchan=wchan,
        cpu_s=cpu_s,
        num_threads=int(fields[_STAT_THREADS]),
        thread_states=states,
        title=process_title(pid),
    )


def cpu_delta(pid: int, now_cpu_s: float, now: float, previous: CpuSamples | None) -> tuple[float | None, float | None]:
    """(CPU seconds used, wall seconds elapsed) since ``previous``; Nones when unknown."""
    if previous is None or pid not in previous.cpu_s:
        return None, None
    window = now - previous.at
    if window <= 0:
        return None, None
    return max(0.0, now_cpu_s - previous.cpu_s[pid]), window


PIDFD_SIGNAL_PROCESS_GROUP = 1 << 2  # linux/pidfd.h (Linux 6.9): the group of the pidfd's process
_group_by_pidfd = [True]  # what the kernel supports, learnt at the first try


def send_to_group(fd: int, pid: int, signum: int) -> bool:
    """Signal the process group led by the process behind pidfd ``fd`` (whose pid is ``pid``).

    Through the pidfd (``PIDFD_SIGNAL_PROCESS_GROUP``: the group the kernel
    knows by that process, never a number handed out again).  On kernels
    before 6.9, the leader's pidfd first, which succeeds only while the leader
    still holds its pid (running, stopped, or a zombie not yet reaped), then
    ``killpg`` by number at once: a pid that names a process or a group is
    never handed out to another while it is held.  False once the leader is
    gone.  The one implementation for the teardown (``supervisor.processes.spawn.signal_group``)
    and the freeze (``dumps.freeze.Held``).
    """
    try:
        if _group_by_pidfd[0]:
            try:
                signal.pidfd_send_signal(fd, signum, None, PIDFD_SIGNAL_PROCESS_GROUP)
                return True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    return False
                _group_by_pidfd[0] = False  # an older kernel: the fallback below from now on
        signal.pidfd_send_signal(fd, signum)
        os.killpg(pid, signum)
        return True
    except (OSError, ValueError):
        return False
