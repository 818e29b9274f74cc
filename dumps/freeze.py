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

Stacks then come from ``py-spy --nonblocking`` (it reads a stopped
process's memory without ptrace-stopping it), or from the faulthandler
fallback, which must run inside the rank: ``resumed`` lets one rank run
only for its own capture.  ``thaw`` resumes the ranks stopped here (never
one the fault stopped); teardown sends SIGCONT to everything anyway.

The supervisor decides *when* to freeze (``supervisor.incidents``); the
soft watchdog, SIGUSR1 and ``supervise dump`` never do.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import structlog

from .evidence import ProcInfo
from .procinfo import proc_state, read_proc

log = structlog.get_logger()

# States in which a rank is not frozen by us: already stopped or traced, or gone.
_NOT_OURS = frozenset({"T", "t", "Z", "X"})
SETTLE_POLL_S = 0.001


@dataclass(frozen=True)
class Frozen:
    """What ``freeze`` did; ``stopped`` maps the ranks stopped here to their pids."""

    before: Mapping[int, ProcInfo | None]  # rank -> /proc with the state from before the stop (None: not running)
    read_at: float  # time.monotonic() of the reads in ``before`` (their CPU times)
    stopped: Mapping[int, int] = field(default_factory=dict)
    group: Mapping[int, bool] = field(default_factory=dict)  # rank -> whether its process group was signalled
    settled: bool = True  # every stopped rank read as stopped before the settle deadline
    signalled_s: float = 0.0  # from the start to the last SIGSTOP sent (what a racing abort must beat)
    duration_s: float = 0.0  # from the start to settled

    def to_dict(self) -> dict:
        return {
            "stopped_ranks": sorted(self.stopped),
            "already_stopped_ranks": sorted(r for r, p in self.before.items() if p is not None and p.state in ("T", "t")),
            "settled": self.settled,
            "signalled_s": round(self.signalled_s, 4),
            "duration_s": round(self.duration_s, 4),
        }


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _signal(pid: int, group: bool, signum: int) -> bool:
    try:
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan", "rb") as f:
            text = f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return "" if text == "0" else text


def freeze(targets: Sequence, settle_s: float) -> Frozen:
    """SIGSTOP every live rank of ``targets`` (``RankTarget``-like: rank, pid, alive)."""
    start = time.monotonic()
    live = [t for t in targets if t.alive and t.pid]
    first = {t.rank: (proc_state(t.pid), _wchan(t.pid)) for t in live}
    stopped: dict[int, int] = {}
    group: dict[int, bool] = {}
    for t in live:
        letter = first[t.rank][0]
        if letter is None or letter in _NOT_OURS:
            continue
        leads = _leads_group(t.pid)
        if _signal(t.pid, leads, signal.SIGSTOP):
            stopped[t.rank] = t.pid
            group[t.rank] = leads
    signalled_s = time.monotonic() - start
    before: dict[int, ProcInfo | None] = {t.rank: None for t in targets}
    for t in live:
        proc = read_proc(t.pid)
        letter, wchan = first[t.rank]
        if proc is not None and letter is not None:
            proc = replace(proc, state=letter, wchan=wchan)
        before[t.rank] = proc
    read_at = time.monotonic()
    deadline = time.monotonic() + max(0.0, settle_s)
    waiting = dict(stopped)
    while waiting:
        waiting = {r: pid for r, pid in waiting.items() if proc_state(pid) not in ("T", None, "Z", "X")}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(SETTLE_POLL_S)
    frozen = Frozen(before, read_at, stopped, group, settled=not waiting, signalled_s=signalled_s,
                    duration_s=time.monotonic() - start)
    log.info("dump frozen", **frozen.to_dict(), not_settled=sorted(waiting))
    return frozen


def thaw(frozen: Frozen | None) -> None:
    """SIGCONT the ranks ``freeze`` stopped (only those)."""
    if frozen is None:
        return
    for rank, pid in frozen.stopped.items():
        _signal(pid, frozen.group.get(rank, False), signal.SIGCONT)


@contextmanager
def resumed(frozen: Frozen | None, rank: int) -> Iterator[None]:
    """Let one rank we stopped run for the block (its faulthandler must run), then stop it again."""
    pid = frozen.stopped.get(rank) if frozen is not None else None
    if pid is None:
        yield
        return
    group = frozen.group.get(rank, False)
    _signal(pid, group, signal.SIGCONT)
    try:
        yield
    finally:
        _signal(pid, group, signal.SIGSTOP)
