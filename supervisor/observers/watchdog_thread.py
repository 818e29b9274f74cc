"""The watchdog's threads.

``WatchdogThread`` ticks every ``TICK_S``: it reads every heartbeat and
control slot, runs the pure policy of ``watchdogs/policy.py``, feeds the
metrics through ``on_tick``, and posts what needs action (verdicts, the
claims of tree-mode ranks and control-plane processes, every rank ready).
``AdapterThread`` scrapes an engine's own Prometheus endpoint
(``--engine-metrics-url``) on its own thread, so a slow scrape never delays
a tick.

Neither kills or dumps anything, and neither holds the supervisor: each
gets what it reads (a heartbeat reader, the published ``AttemptView``, a
URL) and ``post``, so the constructors say what a thread can touch.  The
watchdog thread never reads a rank's socket or pipe (shared memory and
/proc only); the adapter's one socket is the engine's /metrics, with a
timeout.  The consensus poller is ``consensus_thread``, the straggler
detector ``straggler_thread``.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import psutil
import structlog

from tp_supervise.dumps.procinfo import helper_cpu, proc_state, runq_wait_ns
from tp_supervise.watchdogs import policy

from ..events import AllRanksReady, ControlClaimed, RankClaimed, WatchdogVerdict
from ..processes.attempt import PerAttempt
from ..processes.pidfds import named_thread
from ..rank.engines import several_control
from ..rank.heartbeat import CONTROL_SLOT_BASE, RENDEZVOUS_PHASE, ROLE_FRONTEND, SlotSnapshot, empty_slot

if TYPE_CHECKING:
    from tp_supervise.watchdogs.progress import ExternalProgress

    from ..processes.attempt import AttemptView
    from ..spec import LaunchSpec

log = structlog.get_logger("supervise.watchdog")

TICK_S = 0.1  # one watchdog tick: /healthz follows a fault within this
THREAD_JOIN_S = 2.0
ADAPTER_INTERVAL_S = 0.5  # engine /metrics scrape period (tree mode adapters)
ADAPTER_TIMEOUT_S = 2.0
# A spawned rank that does not report readiness (no slot: not Python or no
# hook; or a claimed slot without the READY flag and not instrumented) counts
# as ready after this long.  Instrumented ranks are held back by the policy's
# pending check until they call ready().
UNCLAIMED_READY_GRACE_S = 2.0


@dataclass
class AttemptWatch:
    """What the watchdog thread keeps of one attempt (a fresh one per attempt: ``PerAttempt``)."""

    all_ready_posted: bool = False
    known_pids: dict[int, int] = field(default_factory=dict)  # slot -> the pid whose claim was posted
    known_control: dict[int, int] = field(default_factory=dict)  # control slot -> the pid whose claim was posted
    # (slot pid, rank pid) -> whether the slot's writer descends from the rank (a wrapper script's python); the
    # process tree of a pid never changes that.
    descends: dict[tuple[int, int], bool] = field(default_factory=dict)
    cpu_wait: CpuWait = field(default_factory=lambda: CpuWait())
    helper_work: HelperWork = field(default_factory=lambda: HelperWork())


class CpuWait:
    """How long the watched processes waited for a CPU in the stall at hand, since its soft stage (the policy
    counts it out of the stall against the hard bar: watchdogs/policy.py, "A stall the CPU caused").  Read from
    each process's main thread (``/proc/<pid>/schedstat``) on the ticks of a stall past its soft stage only: one
    small read per process then, none otherwise."""

    def __init__(self) -> None:
        self.base: dict[int, int] = {}  # pid -> its run-queue wait when the stall reached its soft stage
        self.said = False  # the stall at hand was said to be counted out (once per stall)

    def seconds(self, soft_fired: bool, pids: Callable[[], list[int]]) -> float:
        """``pids()`` is asked only past the soft stage: a tick of a healthy group builds nothing here."""
        if not soft_fired:
            if self.base or self.said:
                self.base.clear()
                self.said = False
            return 0.0
        longest = 0
        for pid in pids():
            now = runq_wait_ns(pid)
            if now is None:
                continue
            before = self.base.setdefault(pid, now)
            longest = max(longest, now - before)
        return longest / 1e9


class HelperWork:
    """How long, in the stall at hand, the watched processes' helpers worked: the processes a rank or the
    scheduler started that the engine does not watch (a compiler Inductor runs inside a step, its compile
    workers), read as their CPU time (``procinfo.helper_cpu``).  An interval counts when they used at least
    ``BUSY_FRACTION`` of a CPU in it; the policy counts it out of the stall (watchdogs/policy.py, "A stall a
    helper worked through").  Read only in a stall that has lasted ``LOOK_AFTER_S``, every ``EVERY_S`` (one pass
    over /proc each): a healthy group's steps never pay for it."""

    LOOK_AFTER_S = 0.5
    EVERY_S = 0.25
    BUSY_FRACTION = 0.2

    def __init__(self) -> None:
        self._begin(None)

    def _begin(self, stall_start: float | None) -> None:
        self.stall_start = stall_start  # the stall being measured
        self.at: float | None = None  # the last read
        self.cpu: dict[int, float] = {}  # root -> its helpers' CPU seconds at the last read
        self.live: dict[int, float] = {}  # helper pid -> its CPU seconds at the last read
        self.worked_s = 0.0
        self.busiest: tuple[int, int, str] | None = None  # (root, pid, comm) of the latest interval's busiest
        self.said = False  # the stall at hand was said to be counted out (once per stall)

    def seconds(
        self, stall_start: float | None, now: float, roots: Callable[[], list[int]], known: Callable[[], set[int]]
    ) -> float:
        """``roots()`` and ``known()`` are asked only in a stall past ``LOOK_AFTER_S``."""
        if stall_start != self.stall_start:
            self._begin(stall_start)  # a new stall, or none: nothing of the last one holds
        if stall_start is None or now - stall_start < self.LOOK_AFTER_S:
            return 0.0
        if self.at is not None and now - self.at < self.EVERY_S:
            return self.worked_s
        read = helper_cpu(roots(), known())
        if self.at is not None:
            used = sum(h.cpu_s - self.cpu[root] for root, h in read.items() if root in self.cpu)
            if used >= self.BUSY_FRACTION * (now - self.at):
                self.worked_s += now - self.at
                gains = [
                    (cpu - self.live.get(pid, 0.0), root, pid, name)
                    for root, h in read.items()
                    for pid, (name, cpu) in h.live.items()
                ]
                self.busiest = max(gains)[1:] if gains else None
        self.at = now
        self.cpu = {root: h.cpu_s for root, h in read.items()}
        self.live = {pid: cpu for h in read.values() for pid, (_name, cpu) in h.live.items()}
        return self.worked_s


class WatchdogThread:
    """Every TICK_S: read all heartbeat slots, run ``watchdogs.policy``, post
    the verdicts that need action, feed ``on_tick`` (metrics).

    ``attempt()`` returns the main thread's latest ``AttemptView``; a new
    ``started_at`` there starts a new attempt's watch (progress history and
    claims forgotten, learned step times kept).
    """

    def __init__(
        self,
        spec: LaunchSpec,
        read_heartbeats: Callable[[], list[SlotSnapshot]],
        attempt: Callable[[], AttemptView],
        post: Callable[[object], None],
        on_tick: Callable[[list[SlotSnapshot], object, float, Mapping[int, bool]], None],
        read_control: Callable[[], list[SlotSnapshot]] | None = None,
    ):
        self.spec = spec
        self.read_heartbeats = read_heartbeats
        self.read_control = read_control
        self.attempt = attempt
        self.post = post
        self.on_tick = on_tick
        self.config = policy.WatchdogConfig(
            soft_timeout=spec.watchdog.soft_timeout,
            hard_timeout=spec.watchdog.hard_timeout,
            startup_timeout=spec.watchdog.startup_timeout,
            adaptive=spec.watchdog.adaptive_params(),
        )
        # Only the watchdog thread touches what follows.
        self.state = policy.WatchdogState.initial(time.monotonic())
        self.watches: PerAttempt[AttemptWatch] = PerAttempt(self._begin)
        self.watch = AttemptWatch()  # the attempt being watched (this tick's)
        self.retired: set[int] = set()  # pids that claimed a slot in an earlier attempt
        # (seq, node) other nodes asked about: put by the main thread, taken by this one (a queue: none is lost
        # between a read and a clear, nor overwritten by another node's)
        self._hang_queries: queue.SimpleQueue[tuple[int, int, bool]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = named_thread(self._run, "watchdog")
        self.adapter = (
            AdapterThread(spec.watchdog.engine_metrics_url, spec.watchdog.engine_kind)
            if spec.watchdog.engine_metrics_url
            else None
        )
        argv0 = os.path.basename(spec.rank_argv()[0])
        self.expect_claim = spec.zero_code_hook and "python" in argv0
        # The front end's control slot speaks for the engine's requests only where it is the one front end.
        self.may_pause_scrape = not several_control(tuple(spec.rank_argv()))

    def start(self) -> None:
        self._thread.start()
        if self.adapter is not None:
            log.info(
                "engine metrics read as progress",
                event_name="engine_metrics_source",
                url=self.adapter.scraper.url,
                engines=[m.engine for m in self.adapter.scraper.engines],
            )
            self.adapter.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=THREAD_JOIN_S)
        if self.adapter is not None:
            self.adapter.stop()

    def _begin(self, attempt: AttemptView, ended: AttemptWatch | None) -> AttemptWatch:
        """A new attempt is watched: a fresh watch; the ended attempt's processes are retired (a slot still naming
        one is stale), and the policy forgets progress history but keeps what it learned about step times."""
        if ended is not None:
            self.retired |= set(ended.known_pids.values()) | set(ended.known_control.values())
        self.state = self.state.next_attempt(attempt.started_at)
        return AttemptWatch()

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                self.tick(time.monotonic())
            except Exception as exc:  # a watchdog never dies of one bad pass
                log.error("watchdog pass failed", error=repr(exc))
            next_tick += TICK_S
            delay = next_tick - time.monotonic()
            if delay < 0:
                next_tick = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def live_slots(self, raw: list[SlotSnapshot], attempt: AttemptView) -> list[SlotSnapshot]:
        """Slots of live ranks; slots of dead or stale processes read as empty."""
        ranks = attempt.ranks
        out = []
        for snap in raw:
            rank = ranks.get(snap.slot)
            if not snap.claimed:
                out.append(snap)
                continue
            if self.spec.tree:
                stale = rank is None and snap.pid in self.retired  # an earlier attempt's rank, not yet replaced
                if stale or rank is not None and (rank.pid != snap.pid or not rank.alive):
                    out.append(empty_slot(snap.slot))
                    continue
            elif rank is None or rank.pid != snap.pid and not self._descends(snap.pid, rank.pid) or not rank.alive:
                out.append(empty_slot(snap.slot))
                continue
            out.append(snap)
        return out

    def tick(self, now: float) -> None:
        attempt = self.attempt()  # one read: this pass sees one consistent attempt
        if attempt.finished or not attempt.launched:
            return
        self.watch = self.watches.of(attempt)
        raw = self.read_heartbeats()
        if self.spec.tree:
            self._discover(raw, attempt.number)
        snaps = self.live_slots(raw, attempt)
        control = self.control_slots(attempt)
        external = self._external(control)
        exited = {slot for slot, r in attempt.ranks.items() if not r.alive}
        waited = self.watch.cpu_wait.seconds(
            self.state.soft_fired and not self.state.hard_fired,
            lambda: [s.pid for s in (*snaps, *control) if _watched(s, exited)],
        )
        worked = self.watch.helper_work.seconds(
            self.state.stall_start,
            now,
            lambda: [s.pid for s in (*snaps, *control) if _watched(s, exited) and s.role != ROLE_FRONTEND],
            lambda: attempt.pids() | {s.pid for s in control if s.claimed},
        )
        self.state, verdict = policy.observe(
            self.state, snaps, now, self.config, external, exited, control, cpu_wait_s=waited, helper_work_s=worked
        )
        helpers = self.watch.helper_work
        if verdict.helper_work_s and not helpers.said:
            helpers.said = True
            root, pid, name = helpers.busiest or (None, None, "")
            log.info(
                "a stall while a process the engine started works (a compiler): counted out of the stall",
                event_name="stall_helper_working",
                stalled_s=round(verdict.stalled_s, 2),
                helper_work_s=round(verdict.helper_work_s, 2),
                helper_pid=pid,
                helper=name,
                of_pid=root,
            )
        if verdict.counted_out and not self.watch.cpu_wait.said:
            self.watch.cpu_wait.said = True
            log.warning(
                "stall past the hard bar while its processes waited for a CPU: counted out, not a hang yet",
                event_name="stall_cpu_starved",
                stalled_s=round(verdict.stalled_s, 2),
                cpu_wait_s=round(verdict.cpu_wait_s, 2),
                hard_s=round(verdict.hard_timeout, 2),
            )
        verdict = self._answer_hang_queries(verdict, snaps)
        if verdict.kind is policy.VerdictKind.HARD and not verdict.elsewhere_ranks:
            # a rank stopped by a signal is the culprit here, even inside a collective: no other node is asked
            stopped = tuple(s.rank for s in snaps if s.claimed and not s.finished and proc_state(s.pid) in ("T", "t"))
            verdict = replace(verdict, elsewhere_ranks=stopped) if stopped else verdict
        self._post(verdict, snaps, now, attempt)
        try:
            self.on_tick(snaps, verdict, now, {slot: r.alive for slot, r in attempt.ranks.items()})
        except Exception as exc:  # metrics must never cost a verdict
            log.error("metrics update failed", error=repr(exc))

    def control_slots(self, attempt: AttemptView) -> list[SlotSnapshot]:
        """The control plane's claimed slots (the engine's scheduler and front end) whose process is alive and
        belongs to this attempt, numbered ``CONTROL_SLOT_BASE + i`` (never a rank's slot).  A new claim is
        posted (``ControlClaimed``): the main thread holds that process and knows its role."""
        if self.read_control is None:
            return []
        out = []
        for snap in self.read_control():
            if not snap.claimed or not snap.pid or snap.pid in self.retired:
                continue
            if self.watch.known_control.get(snap.slot) != snap.pid and not _gone(snap.pid):
                self.watch.known_control[snap.slot] = snap.pid
                self.post(ControlClaimed(snap.role_name, snap.pid, attempt.number))
            view = attempt.process(snap.pid)
            if view is None or not view.alive or snap.finished:
                continue
            out.append(replace(snap, slot=CONTROL_SLOT_BASE + snap.slot))
        return out

    def _external(self, control: list[SlotSnapshot]) -> ExternalProgress | None:
        """The engine's metrics as progress, while they are needed: a live front end's control slot says what
        they say (requests in flight, outputs coming) without costing the engine a /metrics render twice a
        second in its API server's event loop, so the scrape pauses while one reports (docs/watchdogs.md)."""
        if self.adapter is None:
            return None
        paused = self.may_pause_scrape and any(c.role == ROLE_FRONTEND for c in control)
        if paused != self.adapter.paused:
            self.adapter.pause(paused)
            if paused:
                # What the last scrape said no longer stands for now: a "requests running" kept from it would
                # make an engine that went idle look busy for ever (the policy keeps the last reading through a
                # failed scrape, on purpose, but a pause is no failure).
                self.state = replace(self.state, external_running=False, external_tokens=None)
                log.info(
                    "engine metrics scrape paused: the engine's front end reports progress itself",
                    event_name="engine_metrics_paused",
                )
            else:
                log.info("engine metrics scrape resumed", event_name="engine_metrics_resumed")
        return None if paused else self.adapter.latest

    def answer_hang_query(self, seq: int, node: int, inside_step: bool = False) -> None:
        """Multi-node: every rank of ``node`` waits in collective #``seq`` (``inside_step``: inside step ``seq``,
        its collectives unseen).  On the next tick, rule a hard hang here if a rank of this node is elsewhere:
        stopped, outside collectives (outside steps), or behind ``seq`` (policy.answer_hang_query)."""
        self._hang_queries.put((seq, node, inside_step))

    def _answer_hang_queries(self, verdict: policy.Verdict, snaps: list[SlotSnapshot]) -> policy.Verdict:
        """Every query asked since the last tick, in order, until one rules a hard hang here."""
        while True:
            try:
                seq, node, inside_step = self._hang_queries.get_nowait()
            except queue.Empty:
                return verdict
            if self.state.hard_fired:
                continue  # ruled already: the other nodes hear of it as a fault
            states = {s.pid: proc_state(s.pid) for s in snaps if s.claimed and not s.finished}
            verdict, elsewhere = policy.answer_hang_query(seq, node, verdict, snaps, states, inside_step)
            if not elsewhere:
                log.info(
                    "hang query of another node: every rank here is in that collective too",
                    event_name="hang_query_not_here",
                    node=node,
                    seq=seq,
                )
            if verdict.kind is policy.VerdictKind.HARD:
                self.state = replace(self.state, hard_fired=True)

    def _post(self, verdict, snaps: list[SlotSnapshot], now: float, attempt: AttemptView) -> None:
        """Hand the verdicts that need action to the main loop (before anything
        else of this tick can fail: soft/hard/startup fire only once)."""
        if verdict.thresholds_changed:
            log.info(
                "watchdog thresholds",
                soft_s=round(verdict.soft_timeout, 2),
                hard_s=round(verdict.hard_timeout, 2),
                soft_source=verdict.soft_source,
                hard_source=verdict.hard_source,
            )
        kind = verdict.kind
        if kind in policy.FIRING_KINDS:
            self.post(
                WatchdogVerdict(kind, verdict.stalled_s, verdict.message, verdict, tuple(snaps), now, attempt.number)
            )
        if not self.watch.all_ready_posted and kind not in (
            policy.VerdictKind.STARTUP_WAIT,
            policy.VerdictKind.STARTUP_TIMEOUT,
            policy.VerdictKind.STARTUP_OVERDUE,
        ):
            if self._have_ranks(snaps, now, attempt):
                self.watch.all_ready_posted = True
                self.post(AllRanksReady(tuple(snaps), now, attempt.number))

    def _have_ranks(self, snaps: list[SlotSnapshot], now: float, attempt: AttemptView) -> bool:
        """Every rank showed up: claimed its slot, or (a rank that cannot
        claim one, e.g. not Python or no hook) has run for a grace period."""
        spec = self.spec
        by_slot = {s.slot: s for s in snaps if s.claimed}
        if spec.tree:
            return len(by_slot) >= spec.nproc_per_node
        for slot, rank in attempt.ranks.items():
            snap = by_slot.get(slot)
            if snap is not None and snap.ready:
                continue
            # Claimed but silent (the hook claims before user code runs, and
            # the program may still declare itself instrumented), or never
            # claimed: ready only after the grace period.
            if (snap is None and self.expect_claim) or now - rank.started_at < UNCLAIMED_READY_GRACE_S:
                return False
        return True

    def _descends(self, pid: int, ancestor: int) -> bool:
        """A slot claimed by a child of the rank (e.g. a wrapper script's python)."""
        key = (pid, ancestor)
        if key not in self.watch.descends:
            try:
                self.watch.descends[key] = any(p.pid == ancestor for p in psutil.Process(pid).parents())
            except psutil.Error:
                return False
        return self.watch.descends[key]

    def _discover(self, raw: list[SlotSnapshot], attempt: int) -> None:
        """Claims as written (a restarted rank's new pid must be seen even
        though its slot still names the old one's handle)."""
        for snap in raw:
            if snap.claimed and snap.pid and self.watch.known_pids.get(snap.slot) != snap.pid:
                if snap.pid in self.retired and _gone(snap.pid):
                    # The slot still names a rank of an earlier attempt (the teardown verified it gone) until this
                    # attempt's rank claims it: tree mode, where the launcher's ranks claim tens of seconds after
                    # the restart (vLLM).  A live process with that pid is a new one that reused it.
                    continue
                self.watch.known_pids[snap.slot] = snap.pid
                self.post(RankClaimed(snap.slot, snap.rank, snap.pid, attempt, snap.phase == RENDEZVOUS_PHASE))


def _watched(snap: SlotSnapshot, exited: set[int]) -> bool:
    """A slot of a live process this pass watches."""
    return snap.claimed and not snap.finished and snap.slot not in exited


def _gone(pid: int) -> bool:
    """No such process, or only its zombie."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


class AdapterThread:
    """Scrapes an engine's own Prometheus endpoint (progress for engines whose
    collectives never reach Python, e.g. CUDA graphs) on its own named thread,
    so a slow scrape never delays a watchdog tick; the tick reads ``latest``."""

    def __init__(self, url: str, engine: str):
        from tp_supervise.watchdogs.adapters import PrometheusProgress

        self.scraper = PrometheusProgress(url, engine=engine, timeout=ADAPTER_TIMEOUT_S)
        self.latest: ExternalProgress | None = None  # None until the first scrape
        # Set by the watchdog thread (``pause``) while the engine's front end reports through its control slot.
        self.paused = False
        self._generation = 0  # a scrape begun before the latest pause or resume is not stored
        self._stop = threading.Event()
        self._thread = named_thread(self._run, "engine-adapter")

    def start(self) -> None:
        self._thread.start()

    def pause(self, paused: bool) -> None:
        """No scrape while ``paused``; either way, no reading taken before this call is handed on after it."""
        self._generation += 1
        self.paused = paused
        self.latest = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * ADAPTER_TIMEOUT_S + THREAD_JOIN_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.paused:
                self._stop.wait(ADAPTER_INTERVAL_S)
                continue
            generation = self._generation
            try:
                reading = self.scraper.scrape()
                if generation == self._generation:  # no pause or resume while it ran
                    self.latest = reading
            except Exception as exc:
                log.error("engine metrics scrape failed", error=repr(exc))
            self._stop.wait(ADAPTER_INTERVAL_S)
