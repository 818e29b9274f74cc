"""Every event the main loop handles, in one place.

Threads (the exit monitor, the watchdog tick, the consensus pollers, the node
link, the HTTP and control servers, the signal hand-off) only observe and
post one of these to the main loop's queue; ``core.Supervisor.handlers`` maps
each type to the one method that acts on it.  Events that belong to a group
attempt carry its number, and the main loop drops those of an attempt that
has ended.  Plain frozen dataclasses: no I/O, no behaviour.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from tp_supervise.consensus.verdict import DivergenceVerdict
from tp_supervise.watchdogs.policy import Verdict, VerdictKind
from tp_supervise.watchdogs.straggler import StragglerEvent, StragglerReport

from .nodes.messages import Fault, HangQuery
from .processes.exits import ExitStatus
from .rank.heartbeat import SlotSnapshot


@dataclass(frozen=True)
class RelayRestart:
    """The main loop's timer: start the relay again (it died on its own a moment ago)."""


@dataclass(frozen=True)
class LoopTick:
    """The main loop's own timer, every second: taking it proves the loop goes round (/livez)."""


@dataclass(frozen=True)
class SignalReceived:
    signum: int


@dataclass(frozen=True)
class ControlRequest:
    request: dict
    reply: queue.SimpleQueue[dict]


@dataclass(frozen=True)
class EarlyExitCheck:
    """Event: look again at a rank that exited 0 while its peers ran."""

    slot: int
    pid: int
    attempt: int = 0  # the attempt the rank belongs to


@dataclass(frozen=True)
class ProcessExited:
    """Event: a watched process ended.  ``status`` is None when it was not our child.

    ``attempt``: the number of the attempt the process belongs to."""

    key: object
    pid: int
    status: ExitStatus | None
    at: float
    attempt: int = 0


@dataclass(frozen=True)
class WatchdogVerdict:
    """Event: a watchdog verdict the main loop must act on (``policy.FIRING_KINDS``: soft, recovered, hard,
    startup_timeout)."""

    kind: VerdictKind
    stalled_s: float
    message: str
    verdict: Verdict
    snapshots: tuple[SlotSnapshot, ...]
    at: float
    attempt: int = 0  # number of the attempt whose ranks were judged

    @property
    def log_fields(self) -> dict:
        v = self.verdict
        return {"soft_timeout_s": round(v.soft_timeout, 2), "hard_timeout_s": round(v.hard_timeout, 2)}


@dataclass(frozen=True)
class AllRanksReady:
    """Event: every rank of the attempt showed up ready (claimed its slot, or ran through the grace period)."""

    snapshots: tuple[SlotSnapshot, ...]
    at: float
    attempt: int = 0


@dataclass(frozen=True)
class HangQueryUnanswered:
    """Event (multi-node): no other node raised the hang this node asked about in time; rule it here."""

    attempt: int


@dataclass(frozen=True)
class RankClaimed:
    """Event (tree mode): a process claimed a heartbeat slot."""

    slot: int
    rank: int
    pid: int
    attempt: int = 0  # number of the attempt being watched
    joining: bool = False  # claimed inside init_process_group, before the rendezvous completed


@dataclass(frozen=True)
class ControlClaimed:
    """Event (tree mode): an engine's control-plane process (its scheduler, its front end) claimed the control
    slot of its role (docs/supervisor.md, "Roles")."""

    role: str
    pid: int
    attempt: int = 0


@dataclass(frozen=True)
class DivergenceFound:
    """Event: the ranks disagreed (a consensus verdict)."""

    verdict: DivergenceVerdict
    at: float
    # Number of the attempt whose digests were compared (the consensus threads
    # read it before each pass); 0 only for the one the main thread builds
    # and handles at once (arbitration.divergence_first), never queued.
    attempt: int = 0


@dataclass(frozen=True)
class ConsensusAgreed:
    """Event: after an observed divergence, the ranks agreed again for a while."""

    steps: int
    at: float
    attempt: int = 0  # number of the attempt whose ranks agreed


@dataclass(frozen=True)
class PeerHangQuery:
    """Event: another node's ranks all wait in a collective; is the missing rank here?"""

    query: HangQuery
    at: float


@dataclass(frozen=True)
class StoreKeySeen:
    """Event: a key the main thread asked the node link to watch (``NodeLink.watch``) reached what it waited for."""

    key: str
    value: bytes


@dataclass(frozen=True)
class PeerFailed:
    """Event: another node published a fatal incident (or stopped: reason ``shutdown``)."""

    fault: Fault
    at: float
    attempt: int = 1  # the group attempt whose fault key held it


@dataclass(frozen=True)
class NodeLost:
    """Event: a node's supervisor stopped beating (or node 0's store is gone)."""

    node: int
    detail: str
    at: float


@dataclass(frozen=True)
class StderrCheck:
    """Timer (multi-node): read the stderr of a failed rank whose ruling is held, once the output pump has all of
    it or at ``until``: a line that says it died of a broken peer connection makes it a suspected consequence of
    another node's failure.  ``signal``: the signal it died of, or None."""

    slot: int
    rank: int
    signal: int | None
    until: float
    attempt: int = 0


@dataclass(frozen=True)
class ConsequenceWindowOver:
    """Event (multi-node): no peer node's fault or loss arrived while a suspected consequence waited."""

    slot: int
    attempt: int = 0


@dataclass(frozen=True)
class StragglerNamed:
    """Event: a rank started holding the group back (a straggler episode; ``watchdogs.straggler``).

    ``evidence``: its and one peer's /proc counters over the window (``dumps.slowness``) and the sentence
    fragment they support ("its CPU was throttled by its cgroup for 38 % of the window")."""

    event: StragglerEvent
    report: StragglerReport
    evidence: dict
    attempt: int = 0


@dataclass(frozen=True)
class StragglerCleared:
    """Event: the straggler episode of ``event.rank`` ended."""

    event: StragglerEvent
    attempt: int = 0


@dataclass(frozen=True)
class StragglerAcrossNodes:
    """Event (multi-node): merged node summaries name a rank (by global rank and node) or a whole node that
    the group waits for; ``sentences`` are new since the last one posted in this attempt."""

    sentences: tuple[str, ...]
    ranks: tuple[int, ...]
    nodes: tuple[int, ...]
    attempt: int = 0
