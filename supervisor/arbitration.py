"""Exit arbitration: what one rank's (or the tree-mode launcher's) exit means
for the run.

``exits`` classifies a single exit (the failure taxonomy); this module
decides what it means, from the attempt as the main thread knows it::

    the attempt already has an outcome,   → a consequence of that incident (or of
    or the supervisor is tearing down       our own stop): counted as "teardown"
    the launcher exits 0                  → the run is clean, unless a rank failed first
    an engine process (tree mode: between → a fault while ranks run (vLLM's engine core:
    the launcher and its ranks) exits       its workers die of it, it is the first failure);
                                            after the ranks, or with code 0, nothing by itself
    a rank exits 0 while its peers run    → look again after EARLY_EXIT_WINDOW_S: if the
                                            peers followed, the job finished; if not, a fault
    a rank exits 0, the last one          → the run is clean
    anything else                         → a fault whose root cause is the attempt's
                                            earliest failure (``root_cause``), unless the
                                            ranks diverged before it (``divergence_first``)

Functions of the attempt and the facts passed in; the main loop (``core``)
acts on the ``Ruling``: counts, logs, schedules the re-check, finishes.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable
from dataclasses import dataclass

from .events import DivergenceFound, EarlyExitCheck
from .outcome import TEARDOWN_EXIT
from .processes import exits
from .processes.attempt import LAUNCHER_SLOT, Attempt
from .processes.exits import ExitInfo, ExitStatus
from .processes.spawn import RankHandle
from .rank.heartbeat import RENDEZVOUS_PHASE, SlotSnapshot

# A rank that exits 0 is a fault only if its peers do not follow it within
# this window (all ranks of a finished job exit within moments of each other).
EARLY_EXIT_WINDOW_S = 0.5


class Meaning(enum.Enum):
    STALE = "stale"  # not this attempt's process, or already handled
    CONSEQUENCE = "consequence"  # of the incident being handled, or of our own stop
    RECHECK = "recheck"  # exit 0 while peers run: post EarlyExitCheck after EARLY_EXIT_WINDOW_S
    DONE = "done"  # a clean exit; others still run
    CLEAN = "clean"  # the run finished cleanly
    FAILED = "failed"  # a fault: find the root cause, dump, finish with EXIT_RANK


@dataclass(frozen=True)
class Ruling:
    meaning: Meaning
    handle: RankHandle | None = None
    info: ExitInfo | None = None
    count_as: str | None = None  # supervise_rank_exits_total{reason}; None: not counted
    message: str = ""  # CLEAN: the log line


STALE = Ruling(Meaning.STALE)
ALL_RANKS_CLEAN = "every rank finished with exit code 0"


def classify_exit(
    attempt: Attempt,
    handle: RankHandle,
    status: ExitStatus | None,
    *,
    read_slot: Callable[[int], SlotSnapshot],
    oom_said: Callable[[int], str],
) -> ExitInfo:
    """``status`` None: a process that was not our child (its parent owns the status)."""
    peers = [h for h in attempt.live_ranks() if h is not handle]
    # A rank that declared it was finishing (runtime.finished, or the hook
    # seeing it leave the group) is done, not lost or early, even while
    # its peers still run.
    slot = read_slot(handle.slot) if handle.slot >= 0 else None
    said_finished = slot is not None and slot.finished
    joining = slot is not None and slot.phase == RENDEZVOUS_PHASE and not said_finished
    if status is None:
        if said_finished:
            return ExitInfo(None, exits.CLEAN, "finished (its launcher owns the exit status)")
        # its parent read the status first (vLLM's engine core reaps its workers): the kernel may still say it
        # was the OOM killer's
        said = oom_said(handle.pid)
        if said:
            return exits.oom_killed_unseen(said)
        if handle.slot < LAUNCHER_SLOT:
            return exits.engine_process_gone()
        return exits.lost(joining=joining)
    info = exits.classify(
        status,
        peers_running=bool(peers) and not said_finished,
        oom_said=oom_said(handle.pid) if status.signal == signal.SIGKILL else "",
    )
    return exits.while_joining(info) if joining and info.failed else info


def rule_exit(attempt: Attempt, handle: RankHandle, info: ExitInfo, *, tearing_down: bool) -> Ruling:
    """An exit just recorded on ``handle`` (``Attempt.record_exit``)."""
    if attempt.outcome is not None or tearing_down:
        return Ruling(Meaning.CONSEQUENCE, handle, info, count_as=TEARDOWN_EXIT)
    if handle is attempt.launcher:
        if (not info.failed or info.reason == exits.EARLY_EXIT) and attempt.first_failure is None:
            return Ruling(Meaning.CLEAN, handle, info, info.reason, "launcher finished with exit code 0")
        return Ruling(Meaning.FAILED, handle, info, info.reason)
    if handle.slot < 0:  # an engine process: counted with the ranks' exits only when it is the fault
        if attempt.live_ranks() and (info.failed and info.reason != exits.EARLY_EXIT):
            return Ruling(Meaning.FAILED, handle, info, info.reason)
        return Ruling(Meaning.DONE, handle, info)
    if info.reason == exits.EARLY_EXIT:
        return Ruling(Meaning.RECHECK, handle, info)  # counted when the check decides
    if info.failed:
        return Ruling(Meaning.FAILED, handle, info, info.reason)
    if not attempt.live_ranks() and attempt.launcher is None:
        return Ruling(Meaning.CLEAN, handle, info, info.reason, ALL_RANKS_CLEAN)
    return Ruling(Meaning.DONE, handle, info, info.reason)


def rule_early_exit_check(attempt: Attempt, check: EarlyExitCheck) -> Ruling:
    """EARLY_EXIT_WINDOW_S after a rank exited 0 while its peers ran: did they follow?"""
    handle = attempt.ranks.get(check.slot)
    if handle is None or handle.pid != check.pid or handle.exit is None or attempt.outcome is not None:
        return STALE
    if attempt.live_ranks():
        return Ruling(Meaning.FAILED, handle, handle.exit, exits.EARLY_EXIT)
    if all(h.exit is not None and h.exit.reason in (exits.CLEAN, exits.EARLY_EXIT) for h in attempt.ranks.values()):
        return Ruling(Meaning.CLEAN, handle, handle.exit, exits.CLEAN, ALL_RANKS_CLEAN)
    return Ruling(Meaning.DONE, handle, handle.exit, exits.CLEAN)


def root_cause(attempt: Attempt, handle: RankHandle, info: ExitInfo) -> tuple[RankHandle, ExitInfo]:
    """The earliest failure of the attempt, which may be a rank whose early
    exit (code 0) was still inside its grace window; ``handle`` if none."""
    failed = [
        (h.exited_at, h)
        for h in attempt.processes()
        if h.exit is not None and h.exit.failed and h.exited_at is not None
    ]
    first = min(failed, key=lambda pair: pair[0])[1] if failed else handle
    return first, first.exit or info


def divergence_first(settle: Callable[[float], list], now: float) -> DivergenceFound | None:
    """Before blaming a death or a hang: did the ranks diverge first?

    A rank scheduling a batch of another size makes the next collective
    abort (gloo) or hang (NCCL); the disagreement still in flight
    (``settle``: the consensus monitor's last look) is the root cause.
    """
    verdicts = settle(now)
    return DivergenceFound(verdicts[0], now) if verdicts else None


# What a rank prints when it dies because a peer on another node went away (gloo, NCCL, the c10d store):
# the first failure is elsewhere, and its ruling waits briefly for the peer node's fault (multinode.py).
PEER_CONSEQUENCE_PATTERNS = (
    "connection reset by peer",
    "connection closed by peer",
    "connection refused",
    "broken pipe",
    "remote process exited or there was a network error",
    "ncclremoteerror",
    "remote error",
    "socket timeout",
    "recvvalue failed",
    "distnetworkerror",
    "diststoreerror",
    "failed to recv",
    "connection closed",
    "end of file",
    "timed out after",
)


def killed_here(status_signal: int | None) -> bool:
    """A rank killed by a signal other than SIGABRT (SIGKILL, SIGSEGV, ...) died of something on its own
    node, never of a peer's broken connection: its ruling waits for nobody."""
    return status_signal is not None and status_signal != signal.SIGABRT


def peer_consequence(status_signal: int | None, stderr_tail: str) -> str | None:
    """Why a failed rank looks like the consequence of a peer's failure (the matching line), else None.

    One that raised (or aborted) with a broken-connection error from its collectives or the store is a
    suspected consequence (``killed_here``: never)."""
    if killed_here(status_signal):
        return None
    for line in reversed(stderr_tail.splitlines()[-200:]):
        low = line.lower()
        if any(p in low for p in PEER_CONSEQUENCE_PATTERNS):
            return line.strip()[:300]
    return None
