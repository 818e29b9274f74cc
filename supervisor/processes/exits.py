"""Classification of rank exits.

Failure taxonomy (the first failure is the root cause; later ones are
consequences of it, or of the teardown):

* ``clean``         exit code 0 after every rank finished (not a failure)
* ``early_exit``    exit code 0 while peers still run: in a TP group a rank
                    that leaves strands its peers inside the next collective
* ``nonzero``       exit code != 0 (a Python exception ends with 1)
* ``native_abort``  killed by SIGABRT: a C++ ``std::terminate`` or ``abort()``,
                    e.g. a NCCL watchdog timeout; no Python handler ran
* ``segfault``      SIGSEGV / SIGBUS / SIGILL / SIGFPE
* ``oom_killed``    SIGKILL while the cgroup's ``oom_kill`` counter rose
* ``signal``        any other signal (SIGKILL from outside, SIGTERM, ...)
* ``lost``          a tree-mode rank that is not our child vanished; its
                    status belongs to its own parent
"""

from __future__ import annotations

import os
import re
import signal
import stat
from dataclasses import dataclass
from pathlib import Path

CLEAN = "clean"
EARLY_EXIT = "early_exit"
NONZERO = "nonzero"
NATIVE_ABORT = "native_abort"
SEGFAULT = "segfault"
OOM_KILLED = "oom_killed"
SIGNALED = "signal"
LOST = "lost"

REASONS = (EARLY_EXIT, NONZERO, NATIVE_ABORT, SEGFAULT, OOM_KILLED, SIGNALED, LOST)

_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}


@dataclass(frozen=True)
class ExitStatus:
    """What the kernel told us about one process's end (from waitid)."""

    code: int | None  # exit code when it exited
    signal: int | None  # terminating signal when killed
    core_dumped: bool = False

    @classmethod
    def from_waitid(cls, result) -> ExitStatus:
        if result.si_code == os.CLD_EXITED:
            return cls(code=result.si_status, signal=None)
        return cls(code=None, signal=result.si_status, core_dumped=result.si_code == os.CLD_DUMPED)

    @classmethod
    def from_wait_status(cls, status: int) -> ExitStatus:
        """From a waitpid-style status word (``/proc/<pid>/stat``'s exit_code of a zombie)."""
        if os.WIFEXITED(status):
            return cls(code=os.WEXITSTATUS(status), signal=None)
        return cls(code=None, signal=os.WTERMSIG(status), core_dumped=os.WCOREDUMP(status))

    @property
    def returncode(self) -> int:
        """subprocess-style: the code, or minus the signal."""
        return self.code if self.code is not None else -(self.signal or 0)


@dataclass(frozen=True)
class ExitInfo:
    """A classified rank exit: the reason class and one sentence of cause."""

    status: ExitStatus | None
    reason: str
    description: str

    @property
    def failed(self) -> bool:
        return self.reason != CLEAN

    def to_dict(self) -> dict:
        st = self.status
        return {
            "code": None if st is None else st.code,
            "signal": None if st is None or st.signal is None else signal_name(st.signal),
            "core_dumped": False if st is None else st.core_dumped,
            "reason": self.reason,
            "description": self.description,
        }


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def classify(status: ExitStatus, *, peers_running: bool, oom_said: str = "") -> ExitInfo:
    """Pure: turn a kernel exit status into a reason and a sentence (``oom_said``: what says a SIGKILL was the OOM
    killer's, ``OomCounter.said``)."""
    if status.code is not None:
        if status.code == 0:
            if peers_running:
                return ExitInfo(status, EARLY_EXIT, "exited with code 0 while its peers were still running")
            return ExitInfo(status, CLEAN, "exited with code 0")
        return ExitInfo(status, NONZERO, f"exited with code {status.code}")
    sig = status.signal or 0
    name = signal_name(sig)
    core = " (core dumped)" if status.core_dumped else ""
    if sig == signal.SIGABRT:
        return ExitInfo(
            status,
            NATIVE_ABORT,
            f"was killed by SIGABRT{core}: a native abort (C++ std::terminate / abort(), e.g. a NCCL watchdog), "
            "no Python handler ran",
        )
    if sig in _CRASH_SIGNALS:
        return ExitInfo(status, SEGFAULT, f"crashed with {name}{core}")
    if sig == signal.SIGKILL and oom_said:
        return ExitInfo(status, OOM_KILLED, f"was killed by the OOM killer (SIGKILL; {oom_said})")
    return ExitInfo(status, SIGNALED, f"was killed by {name}{core}")


JOINING = "while joining the process group (inside init_process_group, before the rendezvous completed)"


def while_joining(info: ExitInfo) -> ExitInfo:
    """``info`` of a rank that ended inside ``init_process_group``: its sentence says where."""
    return ExitInfo(info.status, info.reason, f"{info.description} {JOINING}")


def lost(joining: bool = False) -> ExitInfo:
    """A tree-mode rank (not our child) ended without saying it was finishing: not by a clean return of its
    program (the hook marks that), so a signal, ``os._exit`` or a native crash; its parent holds the status.
    ``joining``: it ended inside ``init_process_group`` (an exception there too: nothing it did counts as done)."""
    if joining:
        return ExitInfo(
            None,
            LOST,
            f"ended {JOINING}; it was not our child, so its exit status is unknown",
        )
    return ExitInfo(
        None,
        LOST,
        "vanished without a clean exit (killed by a signal, os._exit or a native crash); it was not our child, "
        "so its exit status is unknown",
    )


def oom_killed_unseen(said: str) -> ExitInfo:
    """A process whose exit status someone else read (its parent reaped it), killed by the OOM killer: ``said``
    (``OomCounter.said``) says so."""
    return ExitInfo(None, OOM_KILLED, f"was killed by the OOM killer ({said}); it was not our child")


def engine_process_gone() -> ExitInfo:
    """A tree-mode process between the launcher and its ranks (vLLM's engine core) ended, and its own parent reaped
    it before its status could be read (the rank-side hook marks no clean exit for a process that is not a rank)."""
    return ExitInfo(
        None,
        LOST,
        "ended while its ranks were running; it was not our child and its parent reaped it first, so its exit "
        "status is unknown",
    )


KMSG = "/dev/kmsg"
KMSG_DEVICE = (1, 11)  # major, minor: the kernel's log (a container may put /dev/console there)
KMSG_MAX_RECORDS = 20_000  # the kernel's ring holds a few thousand: one pass reads it all
_OOM_KILLED = re.compile(r"[Oo]ut of memory: Killed process (\d+) \(([^)]*)\)")


def _in_initial_pid_namespace() -> bool:
    """The kernel logs pids as the initial namespace numbers them: only there are they ours."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return len(line.split()) == 2
    except OSError:
        pass
    return False


def kernel_oom_kills(after_seq: int, path: str = KMSG) -> list[tuple[int, int, str]]:
    """``(sequence number, pid, line)`` of the kernel's OOM-kill records after ``after_seq`` ("Memory cgroup out of
    memory: Killed process PID (COMM)", or "Out of memory: ..." for the node), and, last, ``(the last sequence
    number read, -1, "")``.  Reads /dev/kmsg without blocking, from its first record (one pass, bounded); where it
    cannot be read or is not the kernel's log (no root, a container, another pid namespace): ``[]``."""
    if not _in_initial_pid_namespace():
        return []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return []
    out: list[tuple[int, int, str]] = []
    last = after_seq
    try:
        st = os.fstat(fd)
        if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != KMSG_DEVICE:
            return []
        for _ in range(KMSG_MAX_RECORDS):
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue  # records overwritten while read: go on with the next
            except OSError:
                break
            if not record:
                break
            head, _, message = record.decode(errors="replace").partition(";")
            fields = head.split(",")
            if len(fields) < 2 or not fields[1].isdigit():
                continue
            seq = int(fields[1])
            last = max(last, seq)
            match = _OOM_KILLED.search(message) if seq > after_seq else None
            if match is not None:
                out.append((seq, int(match.group(1)), message.strip().split(" total-vm", 1)[0]))
    finally:
        os.close(fd)
    return [*out, (last, -1, "")]


class OomCounter:
    """Reads the ``oom_kill`` count of this process's cgroup (v2, or v1 memory); ``said`` adds the kernel's log."""

    def __init__(self, pid: int | None = None):
        self.path = _memory_events_path(pid or os.getpid())
        self.baseline = self.read()
        found = kernel_oom_kills(-1)
        self.kmsg_after = found[-1][0] if found else -1  # the kernel's records before the supervisor are not its
        self.kmsg_used: set[int] = set()  # records already given to a death (a pid reused later is not theirs)

    def said(self, pid: int) -> str:
        """What says ``pid`` (dead of SIGKILL) was the OOM killer's: the kernel's line for it (a limit of any
        cgroup, the node's memory), else this cgroup's count having risen; '' when nothing does."""
        for seq, killed, line in kernel_oom_kills(self.kmsg_after):
            if killed == pid and seq not in self.kmsg_used:
                self.kmsg_used.add(seq)
                return f"the kernel: {line}"
        return "the cgroup's oom_kill count rose" if self.rose() else ""

    def read(self) -> int | None:
        if self.path is None:
            return None
        try:
            for line in self.path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            return None
        return None

    def rose(self) -> bool:
        now = self.read()
        if now is None or self.baseline is None:
            return False
        rose = now > self.baseline
        self.baseline = now
        return rose


def _memory_events_path(pid: int) -> Path | None:
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, rel = parts
        if hier == "0" and controllers == "":
            candidate = Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.events"
            if candidate.exists():
                return candidate
        if "memory" in controllers.split(","):
            candidate = Path("/sys/fs/cgroup/memory") / rel.lstrip("/") / "memory.oom_control"
            if candidate.exists():
                return candidate
    fallback = Path("/sys/fs/cgroup/memory.events")
    return fallback if fallback.exists() else None
