"""Engine state as one enum and a pure transition function.

::

    starting ──all ready──▶ ready ──soft watchdog──▶ suspect ──progress──▶ ready
       │                      │                        │
       │                      ├──divergence(observe)──▶ suspect
       │                      │
       ├─startup timeout─┐    ├──hard watchdog────────▶ hung ─────┐
       │                 ▼    ├──divergence(enforce)──▶ diverged ─┤
       └──rank exit────▶ failed ◀──rank exit──────────────────────┤
                             │                                    ▼
                             └─────────teardown──────────▶ tearing_down ──▶ stopped
                                                                 │
                                                           restart ──▶ starting

A fault state (hung, diverged, failed) never goes back to ready without a
teardown and a restart.  Unknown (state, event) pairs leave the state as it is:
a late event about an incident already being handled changes nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .incidents.quarantine import AttemptRequests

if TYPE_CHECKING:
    from .events import WatchdogVerdict
    from .nodes.messages import HangQuery
    from .processes.exits import ExitInfo
    from .processes.spawn import RankHandle


class EngineState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    SUSPECT = "suspect"
    HUNG = "hung"
    DIVERGED = "diverged"
    FAILED = "failed"
    TEARING_DOWN = "tearing_down"
    STOPPED = "stopped"


class Event(str, enum.Enum):
    ALL_READY = "all_ready"
    SOFT_HANG = "soft_hang"
    PROGRESS = "progress"
    HARD_HANG = "hard_hang"
    DIVERGENCE_OBSERVED = "divergence_observed"
    DIVERGENCE_ENFORCED = "divergence_enforced"
    RANK_EXIT = "rank_exit"
    STARTUP_TIMEOUT = "startup_timeout"
    TEARDOWN = "teardown"
    STOPPED = "stopped"
    RESTART = "restart"


S, E = EngineState, Event

_LIVE = (S.STARTING, S.READY, S.SUSPECT)
_FAULT = (S.HUNG, S.DIVERGED, S.FAILED)

_TABLE: dict[tuple[EngineState, Event], EngineState] = {
    (S.STARTING, E.ALL_READY): S.READY,
    (S.STARTING, E.STARTUP_TIMEOUT): S.FAILED,
    (S.READY, E.SOFT_HANG): S.SUSPECT,
    (S.READY, E.DIVERGENCE_OBSERVED): S.SUSPECT,
    (S.SUSPECT, E.PROGRESS): S.READY,
    (S.SUSPECT, E.SOFT_HANG): S.SUSPECT,
    (S.SUSPECT, E.DIVERGENCE_OBSERVED): S.SUSPECT,
    (S.STOPPED, E.RESTART): S.STARTING,
}
for _s in _LIVE:
    _TABLE[(_s, E.HARD_HANG)] = S.HUNG
    _TABLE[(_s, E.DIVERGENCE_ENFORCED)] = S.DIVERGED
    _TABLE[(_s, E.RANK_EXIT)] = S.FAILED
for _s in _LIVE + _FAULT:
    _TABLE[(_s, E.TEARDOWN)] = S.TEARING_DOWN
_TABLE[(S.TEARING_DOWN, E.STOPPED)] = S.STOPPED
_TABLE[(S.STARTING, E.STOPPED)] = S.STOPPED


def next_state(state: EngineState, event: Event) -> EngineState:
    """The state after ``event``; unknown pairs keep the current state."""
    return _TABLE.get((state, event), state)


def is_fault(state: EngineState) -> bool:
    return state in _FAULT


def healthy(state: EngineState) -> bool:
    """/healthz: ready and no confirmed fault (a suspected hang is still healthy)."""
    return state in (S.READY, S.SUSPECT)


def ready(state: EngineState) -> bool:
    """/readyz: serving, with nothing suspected."""
    return state is S.READY


@dataclass
class AttemptCase:
    """What the decider holds about one attempt while it runs, built when the attempt is launched (the next
    attempt gets a new one: nothing of this is reset by hand)."""

    suspicions: set[str] = field(default_factory=set)  # why the engine is SUSPECT: "hang", "divergence"
    # multi-node: a rank failure that looks like a consequence of another node's, waiting for its news
    suspect: tuple[RankHandle, ExitInfo, float, str | None] | None = None
    hang_query: HangQuery | None = None  # this node asked the others where the missing rank is
    peer_hang_query: HangQuery | None = None  # another node asked this one
    deferred_hang: WatchdogVerdict | None = None  # the hard verdict waiting for the answer
    # what its failure caught (its incident, its requests in flight): the quarantine's record of this attempt
    requests: AttemptRequests = field(default_factory=AttemptRequests)
