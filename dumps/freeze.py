"""Freeze, then dump: stop every rank before any evidence is taken from it.

On a fatal verdict (hard hang, enforced divergence) the bundle must be one
consistent snapshot, and no rank may race ahead while the others are read:
after a diverged batch, gloo aborts both ranks within a millisecond of the
mismatched collective, long before py-spy has attached.  So, in this order:

1. the scheduler state and wait channel of every live rank are read (two
   small ``/proc`` files per rank, microseconds): a rank that was already
   stopped (``T``: the fault itself) or blocked in the kernel (``D``) must
   still read that way in the bundle, not as "stopped by us";
2. every live rank's process group gets SIGSTOP (the rank and its children;
   a tree-mode rank that does not lead its group: the rank alone);
3. the full ``/proc`` reading (CPU time, every thread: about 0.7 ms for a
   rank of 20 threads) is taken, with the state and wait channel of step 1
   (``Frozen.before``; its per-thread states are those after the stop);
4. the caller waits, at most ``settle_s``, until each reads ``T``.

Every signal goes through a pidfd opened before the rank's first ``/proc``
read (``Held``): from then on it reaches that process or nobody, even once
the capture outlives its deadline and the teardown has reaped the rank and
its pid was handed out again.  The pid itself is the one the supervisor
knew at the decision, moments earlier: a spawned rank is its unreaped child
until the teardown, so that pid cannot have been reused; a tree-mode rank's
pid comes from its claim of a heartbeat slot.

Stacks then come from ``py-spy --nonblocking`` (it reads a stopped
process's memory without ptrace-stopping it), or from the faulthandler
fallback, which must run inside the rank: ``resumed`` lets one rank run
only for its own capture.  ``thaw`` resumes the ranks stopped here (never
one the fault stopped); teardown sends SIGCONT to everything anyway.

The supervisor decides *when* to freeze (``supervisor.incidents.desk``); the
soft watchdog, SIGUSR1 and ``supervise dump`` never do.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

import structlog

from .evidence import ProcInfo
from .procinfo import proc_state, read_proc, send_to_group

log = structlog.get_logger()

# States in which a rank is not frozen by us: already stopped or traced, or gone.
_NOT_OURS = frozenset({"T", "t", "Z", "X"})
SETTLE_POLL_S = 0.001


class Held:
    """A rank held by a pidfd, with whether the signals go to the process group it leads.

    ``send`` reaches the rank (or its group) or nobody: the group through
    ``procinfo.send_to_group`` (why that is safe is said there).
    The owner closes it.
    """

    __slots__ = ("pid", "fd", "group", "_lock")

    def __init__(self, pid: int, fd: int, group: bool = False):
        self.pid = pid
        self.fd = fd
        self.group = group
        # A capture thread left behind by its deadline may still signal while ``thaw`` closes: never a
        # closed descriptor whose number the teardown's next pidfd took.
        self._lock = threading.Lock()

    @classmethod
    def open(cls, pid: int | None) -> Held | None:
        if not pid:
            return None
        try:
            return cls(pid, os.pidfd_open(pid))
        except OSError:  # gone (or no pidfds: Linux < 5.3)
            return None

    def send(self, signum: int) -> bool:
        """Signal the rank (or its group); False once it is gone (or closed)."""
        with self._lock:
            return self.fd >= 0 and self._send(signum)

    def _send(self, signum: int) -> bool:
        if self.group:
            return send_to_group(self.fd, self.pid, signum)
        try:
            signal.pidfd_send_signal(self.fd, signum)
            return True
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        with self._lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


@dataclass(frozen=True)
class Frozen:
    """What ``freeze`` did; ``stopped`` maps the ranks stopped here to their pids."""

    before: Mapping[int, ProcInfo | None]  # rank -> /proc with the state from before the stop (None: not running)
    read_at: float  # time.monotonic() of the reads in ``before`` (their CPU times)
    stopped: Mapping[int, int] = field(default_factory=dict)
    group: Mapping[int, bool] = field(default_factory=dict)  # rank -> whether its process group was signalled
    held: Mapping[int, Held] = field(default_factory=dict, repr=False, compare=False)  # the stopped ranks, until thaw
    settled: bool = True  # every stopped rank read as stopped before the settle deadline
    signalled_s: float = 0.0  # from the start to the last SIGSTOP sent (what a racing abort must beat)
    duration_s: float = 0.0  # from the start to settled

    def to_dict(self) -> dict:
        return {
            "stopped_ranks": sorted(self.stopped),
            "already_stopped_ranks": sorted(
                r for r, p in self.before.items() if p is not None and p.state in ("T", "t")
            ),
            "settled": self.settled,
            "signalled_s": round(self.signalled_s, 4),
            "duration_s": round(self.duration_s, 4),
        }


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan", "rb") as f:
            text = f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return "" if text == "0" else text


class FreezeTarget(Protocol):
    """What ``freeze`` reads of a rank (``capture.RankTarget`` has it)."""

    @property
    def rank(self) -> int: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def alive(self) -> bool: ...


def freeze(targets: Sequence[FreezeTarget], settle_s: float) -> Frozen:
    """SIGSTOP every live rank of ``targets``."""
    start = time.monotonic()
    procs: dict[int, Held] = {}
    for t in targets:
        opened = Held.open(t.pid) if t.alive else None
        if opened is not None:
            procs[t.rank] = opened
    live = [(rank, proc.pid) for rank, proc in procs.items()]  # (rank, pid): the pidfd is open
    first = {rank: (proc_state(pid), _wchan(pid)) for rank, pid in live}
    stopped: dict[int, int] = {}
    group: dict[int, bool] = {}
    held: dict[int, Held] = {}
    for rank, pid in live:
        proc = procs[rank]
        letter = first[rank][0]
        if letter is None or letter in _NOT_OURS:
            continue
        # Read after the pidfd was opened; the signal through it succeeds only if that very process still runs.
        # A process that is not a rank (negative key: the launcher, an engine core) is stopped alone: the
        # launcher leads the group of the whole tree, and its thaw must not resume a process the fault stopped.
        proc.group = rank >= 0 and _leads_group(pid)
        if proc.send(signal.SIGSTOP):
            stopped[rank] = pid
            group[rank] = proc.group
            held[rank] = procs.pop(rank)
    for proc in procs.values():
        proc.close()
    signalled_s = time.monotonic() - start
    before: dict[int, ProcInfo | None] = {t.rank: None for t in targets}
    for rank, pid in live:
        info = read_proc(pid)
        letter, wchan = first[rank]
        if info is not None and letter is not None:
            info = replace(info, state=letter, wchan=wchan)
        before[rank] = info
    read_at = time.monotonic()
    deadline = time.monotonic() + max(0.0, settle_s)
    waiting = dict(stopped)
    while waiting:
        waiting = {r: pid for r, pid in waiting.items() if proc_state(pid) not in ("T", None, "Z", "X")}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(SETTLE_POLL_S)
    frozen = Frozen(
        before,
        read_at,
        stopped,
        group,
        held,
        settled=not waiting,
        signalled_s=signalled_s,
        duration_s=time.monotonic() - start,
    )
    log.info("dump frozen", **frozen.to_dict(), not_settled=sorted(waiting))
    return frozen


def thaw(frozen: Frozen | None) -> None:
    """SIGCONT the ranks ``freeze`` stopped (only those), and let go of them (the freeze is over)."""
    if frozen is None:
        return
    for proc in frozen.held.values():
        proc.send(signal.SIGCONT)
        proc.close()


@contextmanager
def resumed(frozen: Frozen | None, rank: int) -> Iterator[None]:
    """Let one rank we stopped run for the block (its faulthandler must run), then stop it again."""
    proc = frozen.held.get(rank) if frozen is not None else None
    if proc is None:
        yield
        return
    proc.send(signal.SIGCONT)
    try:
        yield
    finally:
        proc.send(signal.SIGSTOP)


def held_by(frozen: Frozen | None, rank: int) -> Held | None:
    """The pidfd of a rank the freeze stopped (None otherwise, or after ``thaw``)."""
    return frozen.held.get(rank) if frozen is not None else None
