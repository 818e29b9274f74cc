"""Watchdog policy: is the TP group starting, idle, working, or hung?  Pure; time is an argument.

The supervisor's watchdog tick reads every heartbeat slot and calls::

    state, verdict = observe(state, snapshots, now, config, external, exited)

and acts on the verdicts that fire (``verdict.fired``); this module never
kills, dumps or sleeps.

Definitions (docs/watchdogs.md has the long form):

* **live rank**: a claimed slot that has not finished and whose process has
  not exited (``exited`` holds the slots the exit monitor saw die).
* **busy**: some live rank is inside a step or a collective (a slot read
  ``torn`` counts as busy: its rank stopped in the middle of an update), or
  a live control-plane process is inside a step (``control``: an engine's
  scheduler inside its step, its front end with requests in flight and no
  output since the last batch), or the engine's own metrics say requests
  are running (``external``).
* **progress**: any live rank's or control-plane process's step or
  collective counter changed since the previous observation (a slot newly
  claimed or re-claimed by another pid counts too), or the external token
  counter changed.
* **stall**: busy with no progress; the stall clock starts at the last
  progress or when the group became busy, whichever is later.  An idle group
  has no stall, however long it idles.
* **startup**: a rank must report ready when its slot is INSTRUMENTED or its
  phase is ``rendezvous``; unclaimed slots and other (zero-code) ranks count
  as ready.  While some rank must still report ready, steady-state timeouts do
  not apply and the startup timeout (counted from ``WatchdogState.initial``)
  does.

Verdict kinds that *fire* (once per incident; act on these):
``soft``, ``hard``, ``startup_timeout``, ``recovered``.  The others describe
the current condition: ``startup_wait``, ``startup_overdue`` (after
``startup_timeout`` fired), ``idle``, ``ok``, ``suspect`` (after ``soft``),
``hung`` (after ``hard``).  When a stall crosses both thresholds between two
ticks only ``hard`` fires (its action includes the soft one's dump).

Thresholds: an explicit ``soft_timeout``/``hard_timeout`` is used exactly as
given.  A missing one is adaptive (``watchdogs.adaptive``), bounded by the
explicit one so their order holds: an adaptive hard is never below an
explicit soft, an adaptive soft never above an explicit hard.  The learner is
fed here, in the steady state only: each rank's progress since the previous
observation (``adaptive.rank_progress``: its precise collective intervals and
step durations), the length of a stall that ended in progress, and when
neither exists the time between two progressing observations.

**A stall the CPU caused.**  A process that is ready to run and waits for a
CPU (a host whose cores are all taken, a container throttled by its cgroup's
CPU limit) makes no progress through no fault of its own: its step is slow,
not stuck.  The caller passes ``cpu_wait_s``, how long the watched processes
waited on a run queue since the stall reached its soft stage (the longest of
any of them, each process's main thread: where a step runs); that time is
counted out of the stall against the hard bar, at most the bar itself, so a
starved group is ruled no later than twice its bar and a stopped or spinning
process (which waits for no CPU, or gets one) exactly at it.  The soft stage
keeps the clock's stall: it only dumps and warns.

**A stall a helper worked through.**  A rank that runs a compiler inside
its step (Inductor builds the C++ of a kernel it meets for the first time in
a child process, and waits for it) makes no progress of its own while its
helper works.  The caller passes ``helper_work_s``: how long, in the stall at
hand, the processes the watched ones started (and the engine does not
watch) used a CPU.  That time is counted out of the stall against both bars,
at most ``startup_timeout`` (the time the operator gives a start, compiles
included): a compile is work, however long; a rank stopped or spinning
itself, or waiting on an idle child, is judged at its bar as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from enum import Enum

from tp_supervise.supervisor.rank.heartbeat import (
    RENDEZVOUS_PHASE,
    ROLE_FRONTEND,
    ROLE_SCHEDULER,
    SCHEDULE_PHASE,
    SlotSnapshot,
)

from . import adaptive
from .progress import ExternalProgress

DEFAULT_STARTUP_TIMEOUT = 600.0


class VerdictKind(str, Enum):
    STARTUP_WAIT = "startup_wait"
    STARTUP_TIMEOUT = "startup_timeout"
    STARTUP_OVERDUE = "startup_overdue"
    IDLE = "idle"
    OK = "ok"
    SOFT = "soft"
    SUSPECT = "suspect"
    HARD = "hard"
    HUNG = "hung"
    RECOVERED = "recovered"


FIRING_KINDS = frozenset({VerdictKind.SOFT, VerdictKind.HARD, VerdictKind.STARTUP_TIMEOUT, VerdictKind.RECOVERED})
STALLED_KINDS = frozenset({VerdictKind.SOFT, VerdictKind.SUSPECT, VerdictKind.HARD, VerdictKind.HUNG})

# A stall's CPU wait below this is not mentioned in the verdict's sentence (it is in ``to_dict`` all the same).
CPU_WAIT_WORTH_A_WORD_S = 0.5
SOURCE_EXPLICIT = "explicit"
SOURCE_LEARNED = "learned"
SOURCE_WARMUP = "warmup"


def _check_seconds(name: str, value: float | None, allow_none: bool) -> None:
    if value is None:
        if not allow_none:
            raise ValueError(f"{name} is required")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value}")


@dataclass(frozen=True)
class WatchdogConfig:
    """Timeouts in seconds.  ``None`` soft/hard = adaptive (see module docstring)."""

    soft_timeout: float | None = None
    hard_timeout: float | None = None
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    adaptive: adaptive.AdaptiveParams = field(default_factory=adaptive.AdaptiveParams)

    def __post_init__(self) -> None:
        _check_seconds("soft_timeout", self.soft_timeout, allow_none=True)
        _check_seconds("hard_timeout", self.hard_timeout, allow_none=True)
        _check_seconds("startup_timeout", self.startup_timeout, allow_none=False)
        if self.soft_timeout is not None and self.hard_timeout is not None and self.soft_timeout > self.hard_timeout:
            raise ValueError(
                f"soft timeout ({self.soft_timeout} s) must not exceed hard timeout ({self.hard_timeout} s)"
            )
        if not isinstance(self.adaptive, adaptive.AdaptiveParams):
            raise ValueError("adaptive must be an AdaptiveParams")


@dataclass(frozen=True)
class CollectiveView:
    """A rank inside a collective, as the verdict reports it."""

    rank: int
    slot: int
    pid: int
    op: str
    desc: str
    coll_seq: int
    waiting_s: float  # time since it entered this collective

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "slot": self.slot,
            "pid": self.pid,
            "op": self.op,
            "desc": self.desc,
            "collective_seq": self.coll_seq,
            "waiting_seconds": round(self.waiting_s, 3),
        }


@dataclass(frozen=True)
class Verdict:
    """One observation's decision plus the evidence a dump or a log line needs."""

    kind: VerdictKind
    at: float
    message: str
    stalled_s: float
    soft_timeout: float
    hard_timeout: float
    soft_source: str  # explicit | learned | warmup
    hard_source: str
    thresholds_changed: bool
    adaptive: adaptive.Thresholds  # what the learner derived (in force only where the source is not explicit)
    busy_ranks: tuple[int, ...]
    in_collective: tuple[CollectiveView, ...]
    outside_collective: tuple[int, ...]  # live ranks not inside a collective
    pending_ranks: tuple[int, ...]  # ranks that must still report ready
    rank_pids: tuple[tuple[int, int], ...]  # (rank, pid) of live ranks
    min_step: int
    max_step: int
    min_coll_seq: int
    max_coll_seq: int
    external: ExternalProgress | None
    control: tuple[SlotSnapshot, ...] = ()  # the live control-plane slots (scheduler, front end) as read
    step_tokens: int = 0  # the thresholds are those of a step of this size (0: the window's)
    # The ranks of this node found elsewhere, the first of them the culprit named to the other nodes: for
    # another node's hang query, those stopped, outside collectives or behind its sequence number; on this
    # node's own hard verdict, those stopped (state T/t, read by the caller: a stop inside a collective too)
    elsewhere_ranks: tuple[int, ...] = ()
    cpu_wait_s: float = 0.0  # of the stall, time its processes waited for a CPU (counted out of the hard bar)
    helper_work_s: float = 0.0  # of the stall, time processes they started worked (counted out of both bars)
    outside_in_step: tuple[int, ...] = ()  # of outside_collective, the ranks inside a step (compiled: its
    # collectives run in the compiled graph, unseen)

    @property
    def counted_out(self) -> bool:
        """The stall is past the hard bar by the clock, short of it once the time its processes waited for a
        CPU is counted out: a starved host, not (yet) a hang."""
        return (
            self.kind in (VerdictKind.SOFT, VerdictKind.SUSPECT)
            and self.stalled_s - self.helper_work_s >= self.hard_timeout
        )

    @property
    def fired(self) -> bool:
        """True on the one observation where the supervisor must act."""
        return self.kind in FIRING_KINDS

    @property
    def stalled(self) -> bool:
        return self.kind in STALLED_KINDS

    def to_dict(self) -> dict:
        return {
            "kind": self.kind.value,
            "message": self.message,
            "stalled_seconds": round(self.stalled_s, 3),
            "soft_timeout_seconds": self.soft_timeout,
            "hard_timeout_seconds": self.hard_timeout,
            "soft_source": self.soft_source,
            "hard_source": self.hard_source,
            "adaptive": {
                "learned": self.adaptive.learned,
                "basis_seconds": self.adaptive.basis_s,
                "window_max_seconds": self.adaptive.window_max_s,
                "samples": self.adaptive.samples,
                "events": self.adaptive.events,
                "steps": self.adaptive.steps,
            },
            "busy_ranks": list(self.busy_ranks),
            "in_collective": [c.to_dict() for c in self.in_collective],
            "outside_collective": list(self.outside_collective),
            "pending_ranks": list(self.pending_ranks),
            "step_range": [self.min_step, self.max_step],
            "collective_seq_range": [self.min_coll_seq, self.max_coll_seq],
            "external": None if self.external is None else self.external.to_dict(),
            "control": [_control_dict(c, self.at) for c in self.control],
            "thresholds_of_step_tokens": self.step_tokens,
            "cpu_wait_seconds": round(self.cpu_wait_s, 3),
            "helper_work_seconds": round(self.helper_work_s, 3),
        }


def _control_dict(c: SlotSnapshot, now: float) -> dict:
    return {
        "role": c.role_name,
        "pid": c.pid,
        "in_step": c.in_step,
        "steps": c.step,
        "phase": c.phase,
        "step_tokens": c.step_tokens,
        "in_step_seconds": round(max(0.0, now - c.ts_step_begin), 3) if c.in_step else None,
    }


# (slot, pid, step, coll_seq) per live slot: what "progress" compares.
Counters = tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class WatchdogState:
    """Everything ``observe`` remembers between ticks.  Create with ``initial(now)``."""

    started_at: float
    counters: Counters = ()
    external_tokens: float | None = None
    external_running: bool = False
    stall_start: float | None = None  # None: not busy
    soft_fired: bool = False
    hard_fired: bool = False
    startup_fired: bool = False
    learned: adaptive.Learned = adaptive.Learned()
    thresholds: adaptive.Thresholds | None = None  # cache: recomputed when what it depends on changes
    reports_steps: bool = False  # some live rank reports steps (the cache's other input)
    reported: tuple[float, float] | None = None  # thresholds last flagged as changed
    # Each live slot's progress as last observed: where its next interval starts.
    marks: tuple[tuple[int, adaptive.Mark], ...] = ()
    # The latest observation in startup, or idle without progress: no interval
    # the learner measures may span it (idling is not a gap between progress events).
    quiet_at: float = -math.inf
    # When the previous observation also saw progress: its time (the fallback
    # sample when progress carries no rank-reported timestamps).
    progressed_at: float | None = None

    @classmethod
    def initial(cls, now: float) -> WatchdogState:
        """State at launch: the startup clock starts ``now``."""
        return cls(started_at=now)

    def next_attempt(self, now: float) -> WatchdogState:
        """State for the ranks' next attempt (a restart): progress history and claims forgotten; what was learned
        of the engine's rhythm (the window) kept, its warm-up counted again: new processes pay their first steps
        again (a compile, a cold allocator, the first prefill), which the window does not know."""
        return WatchdogState(started_at=now, learned=adaptive.Learned(self.learned.window, shapes=self.learned.shapes))


def is_pending(snap: SlotSnapshot) -> bool:
    """A live rank the startup watchdog still waits for."""
    if snap.phase == RENDEZVOUS_PHASE and not snap.ready:
        return True
    return snap.instrumented and not snap.ready


def effective_thresholds(config: WatchdogConfig, learned: adaptive.Thresholds) -> tuple[float, float, str, str]:
    """(soft, hard, soft_source, hard_source) in force."""
    auto = SOURCE_LEARNED if learned.learned else SOURCE_WARMUP
    soft = config.soft_timeout if config.soft_timeout is not None else learned.soft
    hard = config.hard_timeout if config.hard_timeout is not None else learned.hard
    if config.soft_timeout is not None and config.hard_timeout is None:
        hard = max(hard, soft)
    if config.hard_timeout is not None and config.soft_timeout is None:
        soft = min(soft, hard)
    soft_src = SOURCE_EXPLICIT if config.soft_timeout is not None else auto
    hard_src = SOURCE_EXPLICIT if config.hard_timeout is not None else auto
    return soft, hard, soft_src, hard_src


def missing_ranks(live: Sequence[SlotSnapshot]) -> tuple[int, ...]:
    """Ranks that have not arrived at the collective every other waiting rank is in: live ranks outside
    collectives, behind the sequence number at which all the ranks inside one wait (one number: ranks whose
    sequences differ, pipeline stages, are not compared).  Empty when nobody waits, or nobody is missing."""
    waiting = {s.coll_seq for s in live if s.in_collective and not s.torn}
    if len(waiting) != 1:
        return ()
    seq = waiting.pop()
    return tuple(sorted(s.rank for s in live if not s.in_collective and not s.torn and s.coll_seq < seq))


def step_at_hand(slots: Sequence[SlotSnapshot]) -> int:
    """The size (tokens) of the step the group is in: the largest a slot inside a step was given; 0 when no
    slot inside a step reports one (between steps nothing says what should come next: the window's
    thresholds judge a stall there, e.g. an engine core busy with a utility call while requests wait)."""
    return max((s.step_tokens for s in slots if s.in_step and s.step_tokens > 0), default=0)


def _marks(live: Sequence[SlotSnapshot], before: dict[int, adaptive.Mark]) -> tuple[tuple[int, adaptive.Mark], ...]:
    """Each live slot's mark; a slot read torn keeps its previous one (its timestamps may be half-written)."""
    out = [(s.slot, adaptive.Mark.of(s)) for s in live if not s.torn]
    out += [(s.slot, before[s.slot]) for s in live if s.torn and s.slot in before]
    return tuple(sorted(out, key=lambda item: item[0]))


def _steady_kind(
    now: float,
    stall_start: float | None,
    progress: bool,
    busy: bool,
    soft: float,
    hard: float,
    soft_fired: bool,
    hard_fired: bool,
    cpu_wait_s: float = 0.0,
    helper_work_s: float = 0.0,
) -> tuple[VerdictKind, float, bool, bool]:
    """(kind, stalled seconds, soft_fired, hard_fired) after startup.  Fired kinds are edge-triggered.  Both bars
    are met by the stall less ``helper_work_s`` (already capped), the hard bar less ``cpu_wait_s`` too (at most
    ``hard``): time the processes could not run."""
    if stall_start is None or progress:
        kind = VerdictKind.RECOVERED if (soft_fired or hard_fired) else (VerdictKind.OK if busy else VerdictKind.IDLE)
        return kind, 0.0, False, False
    stalled = now - stall_start
    own = stalled - helper_work_s
    if own - min(cpu_wait_s, hard) >= hard or hard_fired and stalled >= hard:
        return (VerdictKind.HUNG if hard_fired else VerdictKind.HARD), stalled, soft_fired, True
    if own >= soft or soft_fired:
        return (VerdictKind.SUSPECT if soft_fired else VerdictKind.SOFT), stalled, True, hard_fired
    return VerdictKind.OK, stalled, soft_fired, hard_fired


def observe(
    state: WatchdogState,
    snapshots: Sequence[SlotSnapshot],
    now: float,
    config: WatchdogConfig,
    external: ExternalProgress | None = None,
    exited: Set[int] = frozenset(),
    control: Sequence[SlotSnapshot] = (),
    cpu_wait_s: float = 0.0,
    helper_work_s: float = 0.0,
) -> tuple[WatchdogState, Verdict]:
    """Fold one reading of the heartbeat slots into the state and decide.

    ``now`` is ``time.monotonic()``; ``exited`` holds slot indices whose
    process is known dead (their stale flags must not make the group busy);
    ``control``: the live control-plane slots (numbered apart from the ranks');
    ``cpu_wait_s``: how long, in this stall since its soft stage, the watched
    processes were ready to run and waited for a CPU (a starved host, a
    throttled cgroup): counted out of the stall against the hard bar, at most
    the bar itself (module docstring: "A stall the CPU caused"); ``helper_work_s``:
    how long, in this stall, the processes they started worked (module
    docstring: "A stall a helper worked through").
    """
    live = [s for s in snapshots if s.claimed and not s.finished and s.slot not in exited]
    plane = [c for c in control if c.claimed and not c.finished]
    previous = {slot: (pid, step, coll) for slot, pid, step, coll in state.counters}
    counters: Counters = tuple(sorted((s.slot, s.pid, s.step, s.coll_seq) for s in (*live, *plane)))
    hb_progress = any(previous.get(slot) != (pid, step, coll) for slot, pid, step, coll in counters)

    ext_tokens, ext_running, ext_progress = state.external_tokens, state.external_running, False
    if external is not None and external.ok:
        ext_progress = ext_tokens is not None and external.tokens_total != ext_tokens
        ext_tokens = external.tokens_total
        ext_running = external.running > 0
    progress = hb_progress or ext_progress

    busy_ranks = tuple(sorted(s.rank for s in live if s.busy or s.torn))
    busy = bool(busy_ranks) or ext_running or any(c.in_step or c.torn for c in plane)
    pending = tuple(sorted(s.rank for s in live if is_pending(s)))

    before = dict(state.marks)
    # The learner's samples come from steps: the ranks' and the scheduler's, not the front end's waits
    # (a request's queueing before its first token is no step time).
    marks = _marks([*live, *(c for c in plane if c.role != ROLE_FRONTEND)], before)
    learned = state.learned
    quiet_at = state.quiet_at
    stall_start: float | None
    kind: VerdictKind
    soft_fired, hard_fired, startup_fired = state.soft_fired, state.hard_fired, state.startup_fired

    if pending:
        # Startup: steady-state rules wait until every rank that must report ready did.
        stall_start = None
        quiet_at = now
        if now - state.started_at >= config.startup_timeout:
            kind = VerdictKind.STARTUP_OVERDUE if startup_fired else VerdictKind.STARTUP_TIMEOUT
            startup_fired = True
        else:
            kind = VerdictKind.STARTUP_WAIT
    else:
        stall_s = gap_s = None
        if progress and state.stall_start is not None and state.progressed_at is None:
            stall_s = now - state.stall_start  # a busy stall of at least one tick ended in progress
        if ext_progress and not hb_progress and state.progressed_at is not None:
            gap_s = now - state.progressed_at  # progress that no rank timestamped: tick resolution
        steady = state.thresholds is not None and state.thresholds.learned
        if not steady and any(s.instrumented for s in live):
            # An engine that reports its steps: the stalls of its warm-up that ended in progress (a cold engine's
            # first requests wait seconds for their first prefill: 3.3 s for vLLM on CPU) teach nothing either;
            # as the window's longest they would set the bar of every stall whose step size is unknown (a rank
            # stopped in a collective waited 14.6 s).  Its long steps later have classes of their own.  Without
            # steps the window is all there is, and a first compile stays in it (the max term).
            stall_s = None
        observed = adaptive.observation(before, marks, state.quiet_at, stall_s=stall_s, untimed_gap_s=gap_s)
        if not steady:
            # Steps of the warm-up (a cold start's first decode steps take seconds) would stay in their size
            # class long after the window forgot them: the classes learn from the steady state only.
            observed = replace(observed, shaped=())
        learned = adaptive.learn(learned, observed, config.adaptive)
        if progress:
            stall_start = now if busy else None
        elif busy:
            stall_start = state.stall_start if state.stall_start is not None else now
        else:
            stall_start = None
            quiet_at = now
        kind = VerdictKind.OK  # decided by _steady_kind once the thresholds are known

    reports_steps = any(s.instrumented for s in live)
    derived = state.thresholds
    if derived is None or learned is not state.learned or reports_steps != state.reports_steps:
        derived = adaptive.thresholds(learned, config.adaptive, reports_steps)
    soft, hard, soft_src, hard_src = effective_thresholds(config, derived)
    changed = adaptive.changed_materially(state.reported, (soft, hard), config.adaptive.change_ratio)
    reported = (soft, hard) if changed else state.reported
    tokens = 0
    if derived.learned and not pending:
        # The step at hand judged by its own size (module docstring: "Steps judged by their shape").
        tokens = step_at_hand([*live, *plane])
        if not tokens and any(c.role == ROLE_SCHEDULER and c.in_step and c.phase == SCHEDULE_PHASE for c in plane):
            # The scheduler's scheduling call has not returned: no step size yet, but it is part of every step,
            # the smallest included, so the smallest step class judges it (not the window, whose longest is a
            # cold start's wait: a stuck scheduler waited 4x that, 43 s, in the drill's stuck_scheduler).
            tokens = 1
        bars = adaptive.shape_thresholds(learned, config.adaptive, tokens)
        if bars is None:
            tokens = 0
        else:
            soft, hard, _src, _src = effective_thresholds(config, replace(derived, soft=bars[0], hard=bars[1]))
    missing: tuple[int, ...] = ()
    # Only where the step at hand's size class is learned, and the thresholds are both adaptive (a soft timeout
    # given keeps its own stage: a dump before any kill).
    if tokens and config.hard_timeout is None and config.soft_timeout is None:
        missing = missing_ranks(live)
        if missing:  # the peers wait for it in a collective: its lateness is the stall itself
            hard = max(soft, min(hard, config.adaptive.arrival_floor))

    stalled = 0.0
    helper_work_s = min(helper_work_s, config.startup_timeout) if stall_start is not None and not progress else 0.0
    if not pending:
        kind, stalled, soft_fired, hard_fired = _steady_kind(
            now, stall_start, progress, busy, soft, hard, soft_fired, hard_fired, cpu_wait_s, helper_work_s
        )

    new_state = WatchdogState(
        started_at=state.started_at,
        counters=counters,
        external_tokens=ext_tokens,
        external_running=ext_running,
        stall_start=stall_start,
        soft_fired=soft_fired,
        hard_fired=hard_fired,
        startup_fired=startup_fired,
        learned=learned,
        thresholds=derived,
        reports_steps=reports_steps,
        reported=reported,
        marks=marks,
        quiet_at=quiet_at,
        progressed_at=now if progress and not pending else None,
    )
    verdict = _verdict(
        kind,
        now,
        live,
        stalled,
        (soft, hard, soft_src, hard_src),
        changed,
        derived,
        busy_ranks,
        pending,
        external,
        recovered_by_progress=progress,
        startup_elapsed=now - state.started_at,
        config=config,
        control=tuple(plane),
        step_tokens=tokens,
        missing=missing,
        cpu_wait_s=cpu_wait_s if stall_start is not None and not progress else 0.0,
        helper_work_s=helper_work_s,
    )
    return new_state, verdict


def _verdict(
    kind: VerdictKind,
    now: float,
    live: Sequence[SlotSnapshot],
    stalled: float,
    limits: tuple[float, float, str, str],
    changed: bool,
    learned: adaptive.Thresholds,
    busy_ranks: tuple[int, ...],
    pending: tuple[int, ...],
    external: ExternalProgress | None,
    *,
    recovered_by_progress: bool,
    startup_elapsed: float,
    config: WatchdogConfig,
    control: tuple[SlotSnapshot, ...] = (),
    step_tokens: int = 0,
    missing: tuple[int, ...] = (),
    cpu_wait_s: float = 0.0,
    helper_work_s: float = 0.0,
) -> Verdict:
    soft, hard, soft_src, hard_src = limits
    ordered = sorted(live, key=lambda s: (s.rank, s.slot))
    colls = tuple(
        CollectiveView(s.rank, s.slot, s.pid, s.coll_op, s.coll_desc, s.coll_seq, max(0.0, now - s.ts_coll_begin))
        for s in ordered
        if s.in_collective
    )
    outside = tuple(s.rank for s in ordered if not s.in_collective)
    steps = [s.step for s in ordered] or [0]
    seqs = [s.coll_seq for s in ordered] or [0]
    message = _message(
        kind, stalled, soft, hard, colls, ordered, pending, external, recovered_by_progress, startup_elapsed, config
    )
    if kind in STALLED_KINDS and step_tokens:
        message += f"; thresholds of a step of {step_tokens} tokens"
    if kind in STALLED_KINDS and missing:
        ranks = ",".join(map(str, missing))
        message += f"; rank {ranks} has not arrived at the collective its peers wait in (hard {hard:.2f} s)"
    if kind in STALLED_KINDS and control:
        message += "; " + _control_where(control, now)
    if kind in STALLED_KINDS and cpu_wait_s >= CPU_WAIT_WORTH_A_WORD_S:
        message += f"; its processes waited {cpu_wait_s:.1f} s for a CPU meanwhile (not counted against the hard bar)"
    if kind in STALLED_KINDS and helper_work_s:
        message += f"; processes they started worked {helper_work_s:.1f} s of it (a compiler: counted out)"
    return Verdict(
        kind=kind,
        at=now,
        message=message,
        stalled_s=stalled,
        soft_timeout=soft,
        hard_timeout=hard,
        soft_source=soft_src,
        hard_source=hard_src,
        thresholds_changed=changed,
        adaptive=learned,
        busy_ranks=busy_ranks,
        in_collective=colls,
        outside_collective=outside,
        pending_ranks=pending,
        rank_pids=tuple((s.rank, s.pid) for s in ordered),
        min_step=min(steps),
        max_step=max(steps),
        min_coll_seq=min(seqs),
        max_coll_seq=max(seqs),
        external=external,
        control=control,
        step_tokens=step_tokens,
        cpu_wait_s=cpu_wait_s,
        helper_work_s=helper_work_s,
        outside_in_step=tuple(s.rank for s in ordered if not s.in_collective and s.in_step),
    )


def _where(colls: tuple[CollectiveView, ...], live: Sequence[SlotSnapshot]) -> str:
    """'rank 0 in all_reduce #41 (64x256 float32); rank 1 outside collectives at step 40 (phase decode)'."""
    parts = []
    for c in colls:
        desc = f" ({c.desc})" if c.desc else ""
        parts.append(f"rank {c.rank} in {c.op or 'collective'} #{c.coll_seq}{desc} for {c.waiting_s:.1f} s")
    for s in live:
        if not s.in_collective:
            where = "in a step" if s.in_step else "outside steps"
            phase = f", phase {s.phase}" if s.phase else ""
            parts.append(f"rank {s.rank} outside collectives, {where} at step {s.step}{phase}")
    return "; ".join(parts)


def _control_where(control: Sequence[SlotSnapshot], now: float) -> str:
    """'scheduler (pid 12) in its step for 9.8 s, phase schedule; frontend (pid 10) waiting for output for 9.9 s'."""
    parts = []
    for c in control:
        who = f"{c.role_name} (pid {c.pid})"
        if not c.in_step:
            parts.append(f"{who} between steps" + (f", phase {c.phase}" if c.phase else ""))
        elif c.role_name == "frontend":
            parts.append(f"{who} has requests in flight, no output for {max(0.0, now - c.ts_step_begin):.1f} s")
        else:
            phase = f", phase {c.phase}" if c.phase else ""
            parts.append(f"{who} in its step for {max(0.0, now - c.ts_step_begin):.1f} s{phase}")
    return "; ".join(parts)


def _message(
    kind: VerdictKind,
    stalled: float,
    soft: float,
    hard: float,
    colls: tuple[CollectiveView, ...],
    live: Sequence[SlotSnapshot],
    pending: tuple[int, ...],
    external: ExternalProgress | None,
    recovered_by_progress: bool,
    startup_elapsed: float,
    config: WatchdogConfig,
) -> str:
    if kind in (VerdictKind.STARTUP_WAIT, VerdictKind.STARTUP_TIMEOUT, VerdictKind.STARTUP_OVERDUE):
        ranks = ", ".join(str(r) for r in pending)
        return (
            f"waiting {startup_elapsed:.1f} s (startup timeout {config.startup_timeout:g} s) "
            f"for rank(s) {ranks} to report ready"
        )
    if kind is VerdictKind.IDLE:
        return "idle: no rank is inside a step or a collective"
    if kind is VerdictKind.RECOVERED:
        return "progress resumed" if recovered_by_progress else "group went idle without progress"
    if kind is VerdictKind.OK:
        return f"making progress (soft {soft:.2f} s, hard {hard:.2f} s)"
    limit = f"hard {hard:.2f} s" if kind in (VerdictKind.HARD, VerdictKind.HUNG) else f"soft {soft:.2f} s"
    ext = ""
    if external is not None:
        ext = (
            f"; engine reports {external.running:g} running request(s), {external.tokens_total:g} tokens"
            if external.ok
            else f"; engine metrics unavailable ({external.error})"
        )
    return f"no progress for {stalled:.1f} s while busy ({limit}): {_where(colls, live)}{ext}"


def answer_hang_query(
    seq: int,
    node: int,
    verdict: Verdict,
    snaps: Sequence[SlotSnapshot],
    states: Mapping[int, str | None],
    inside_step: bool = False,
) -> tuple[Verdict, list[str]]:
    """Multi-node: every rank of ``node`` waits in collective #``seq``.  Is the missing rank here?

    A rank of this node is elsewhere when it is stopped (``states``: pid -> the
    scheduler state the caller read), outside collectives, or behind ``seq``.
    ``inside_step``: the asking node's ranks are inside step ``seq`` with no
    collective in view (an engine that compiled its model: its collectives
    run unseen); a rank here is then elsewhere when it is stopped, outside any
    step, or behind that step (inside a step outside collectives is where its
    peers are).  Returns the verdict, made HARD naming those ranks when there
    are any, and the list of what is elsewhere (empty: every rank here is in
    that collective too, and the verdict is unchanged)."""
    elsewhere, ranks = [], []
    for s in snaps:
        if not s.claimed or s.finished:
            continue
        state = states.get(s.pid)
        if state in ("T", "t"):
            elsewhere.append(f"rank {s.rank} is stopped (state {state})")
        elif inside_step and not s.in_step and not s.in_collective:
            elsewhere.append(f"rank {s.rank} is outside steps at step {s.step}")
        elif inside_step and s.step < seq:
            elsewhere.append(f"rank {s.rank} is behind, at step {s.step}")
        elif inside_step:
            continue
        elif not s.in_collective:
            elsewhere.append(f"rank {s.rank} is outside collectives at step {s.step}")
        elif s.coll_seq < seq:
            elsewhere.append(f"rank {s.rank} is behind, in {s.coll_op or 'collective'} #{s.coll_seq}")
        else:
            continue
        ranks.append(s.rank)
    if not elsewhere:
        return verdict, elsewhere
    where = f"step {seq} (its collectives unseen)" if inside_step else f"collective #{seq}"
    message = f"every rank of node {node} waits in {where}; here {'; '.join(elsewhere)}"
    return replace(verdict, kind=VerdictKind.HARD, message=message, elsewhere_ranks=tuple(ranks)), elsewhere
