"""The supervisor's event loop: the one place that decides.

Threads only observe and post events to one queue (``SimpleQueue``: safe to
put from signal handlers); the main thread takes them one at a time and is the
only code that changes state, starts dumps, kills or restarts::

    exit-monitor   ProcessExited        (pidfds: a death, the moment it happens)
    early-exit     EarlyExitCheck       (a timer: did the peers of a rank that exited 0 follow?)
    watchdog       WatchdogVerdict      (heartbeat slots → watchdogs.policy)
                   RankClaimed          (tree mode: a process joined the group)
    consensus      DivergenceFound      (consensus.monitor)
                   ConsensusAgreed
    control-socket ControlRequest       (`supervise dump`)
    signal handler SignalReceived

No thread gets the supervisor: each gets ``post`` (the queue's put) and what
it reads (a heartbeat reader, the published ``AttemptView``), and nothing it
can change.  ``handlers`` maps each event type to the one method that acts on
it, so a new event source (multi-node's node link) is one thread class given
``post``, one entry in ``handlers`` and one in ``sources``.

What an exit means is decided in ``arbitration``, whether and when to launch
again in ``restart``; the attempt's live state is in ``attempt``.  Ranks are
spawned only from the main thread (parent-death signals fire when the forking
*thread* exits).
"""

from __future__ import annotations

import itertools
import os
import queue
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import structlog

from tp_supervise.watchdogs.policy import VerdictKind

from . import arbitration, events, logs, signals
from .arbitration import EARLY_EXIT_WINDOW_S, Meaning, Ruling
from .events import (
    AllRanksReady,
    ConsensusAgreed,
    ControlRequest,
    DivergenceFound,
    EarlyExitCheck,
    HangQueryUnanswered,
    LoopTick,
    ProcessExited,
    RankClaimed,
    RelayRestart,
    SignalReceived,
    WatchdogVerdict,
)
from .incidents.desk import IncidentDesk
from .incidents.quarantine import RequestQuarantine
from .loop import TICK_S as LOOP_TICK_S
from .loop import Loop
from .multinode import (
    Between,
    GroupOfNodes,
    Hold,
    NodeRules,
    NodeRuling,
    PeerIncident,
    RuleFailure,
    RuleHang,
    SingleNode,
    StopToo,
    WaitForKey,
)
from .nodes import handshake, link, messages
from .nodes.transport import NodeTransport
from .observers import control_socket
from .observers.services import Services
from .observers.straggler_thread import StragglerThread
from .observers.watchdog_thread import WatchdogThread
from .outcome import (
    EXIT_DIVERGENCE,
    EXIT_HANG,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_RANK,
    EXIT_STARTUP,
    EXIT_TEARDOWN,
    LAUNCHER_KEY,
    RELAY_KEY,
    Outcome,
    new_incident_id,
    new_run_id,
    run_dir_for,
)
from .processes import exits, shm, stale_runs
from .processes import pidfds as procs
from .processes import spawn as launch
from .processes.attempt import ENGINE_PROCESS, LAUNCHER_SLOT, NOT_STARTED, Attempt, AttemptView, Published, RankView
from .processes.cgroup import RunCgroup
from .processes.exit_monitor import ExitMonitor
from .processes.exits import ExitInfo
from .processes.listen_socket import ListenSocket
from .processes.spawn import RankHandle, RankSpec, RunContext
from .processes.teardown import KillPolicy, TeardownResult, teardown
from .rank.drill_lane import ENV_DRILL
from .rank.heartbeat import CONTROL_SLOTS, HeartbeatSegment
from .rank.listen import RELAY_URL_ENV
from .rank.net import free_port
from .relay.process import RelayProcess
from .restart import RestartPolicy, crash_loop_over
from .signals import Hurry
from .spec import DEFAULT_FAULT_LINGER_S, LaunchSpec
from .state import AttemptCase, EngineState, Event, next_state

# Events produced for one attempt (they carry its number): acted on only in that attempt.
ATTEMPT_EVENTS = (
    events.StragglerAcrossNodes,
    events.StragglerNamed,
    events.StragglerCleared,
    events.StderrCheck,
    events.ConsequenceWindowOver,
    ProcessExited,
    EarlyExitCheck,
    WatchdogVerdict,
    AllRanksReady,
    RankClaimed,
    HangQueryUnanswered,
    DivergenceFound,
    ConsensusAgreed,
)

# How often the live processes' /dev/shm maps are noted (what a worker that dies before the teardown leaves).
# A look reads /proc/<pid>/maps of each process of the attempt (~0.2-1 ms of CPU each, off the main thread);
# every 10 s missed vLLM's shm all-reduce buffers when its engine core died within 10 s of making them.
SHM_LOOK_EVERY_S = 2.0

log = structlog.get_logger("supervise")

T = TypeVar("T")
R = TypeVar("R")


def _set_up(value: T | None, name: str) -> T:
    if value is None:
        raise RuntimeError(f"Supervisor.{name} used before _setup")
    return value


class Supervisor:
    def __init__(
        self,
        spec: LaunchSpec,
        base_env: Mapping[str, str],
        run_id: str | None = None,
        nodes: tuple[NodeTransport, handshake.NodeGroup] | None = None,
        listener: ListenSocket | None = None,
        public: ListenSocket | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.spec = spec
        self.listener = (
            listener  # rank 0's listening socket, the caller's for the whole run (processes/listen_socket.py)
        )
        self.public = public  # the relay's public port: the built-in engine's, or a COMMAND's --relay
        self.relay: RelayProcess | None = None
        self.base_env = dict(base_env)
        self.run_id = run_id or new_run_id()
        # What this node's run owns on this host (run dir, cgroup, registry entry, process marker): the run id
        # alone on one node; with several nodes (several may share a host) the node rank too.
        self.run_key = self.run_id if spec.nnodes == 1 else f"{self.run_id}.n{spec.node_rank}"
        self.nodes = nodes
        # The other nodes (multi-node rules, decided there, acted on here); a run of one node has none.
        self.node_rules: NodeRules = SingleNode()
        # The one wait of the main thread: what other threads post, and the loop's own timers (supervisor/loop.py).
        self.loop = Loop(clock)
        self.clock = clock
        self.post: Callable[[object], None] = self.loop.post
        self.state = EngineState.STARTING
        # What other threads may know of the attempt; only self.attempt changes it.
        self.attempt_view: Published[AttemptView] = Published(NOT_STARTED)
        self.attempt: Attempt[AttemptCase] = Attempt(self.attempt_view.set, case=AttemptCase())
        self.restart = RestartPolicy(spec.max_restarts)
        self.stopping: SignalReceived | None = None
        self.stop_requested = False  # set by the signal handler itself: a second stop signal hurries
        self.hurry = Hurry()
        self.cgroup: RunCgroup | None = None
        self.oom = exits.OomCounter()
        self._run_dir: Path | None = None
        self._heartbeat: HeartbeatSegment | None = None
        self._control: HeartbeatSegment | None = None  # the control plane's slots (an engine's scheduler, front end)
        self.death_r = self.death_w = -1
        self._ctx: RunContext | None = None
        self.monitor = ExitMonitor(self.post)
        self._watchdog: WatchdogThread | None = None
        self._desk: IncidentDesk | None = None
        self._services: Services | None = None  # metrics, health, control socket, consensus poller
        self._quarantine: RequestQuarantine | None = None  # incident file, in-flight requests, quarantine.json
        # Threads that post events: started in this order, stopped in reverse.
        self.sources: list = [self.monitor]
        # One dispatcher (_dispatch), one handler table per phase: while an attempt runs, and between attempts
        # (a backoff, node 0's restart decision, the group's barrier).
        self.handlers: dict[type, Callable[[Any], None]] = {
            ProcessExited: self._on_exit,
            EarlyExitCheck: self._on_early_exit_check,
            WatchdogVerdict: self._on_watchdog,
            AllRanksReady: self._on_all_ready,
            events.StragglerNamed: self._on_straggler,
            events.StragglerCleared: self._on_straggler_cleared,
            events.StragglerAcrossNodes: self._on_straggler_across_nodes,
            RankClaimed: self._on_claimed,
            events.ControlClaimed: self._on_control_claimed,
            DivergenceFound: self._on_divergence,
            ConsensusAgreed: self._on_agreed,
            ControlRequest: self._on_control,
            SignalReceived: self._on_signal_event,
            LoopTick: self._on_loop_tick,
            RelayRestart: self._on_relay_restart,
            events.PeerFailed: self._on_peer_failed,
            events.PeerHangQuery: self._on_peer_hang_query,
            HangQueryUnanswered: self._on_hang_query_unanswered,
            events.NodeLost: self._on_node_lost,
            events.StderrCheck: self._on_stderr_check,
            events.ConsequenceWindowOver: self._on_consequence_window_over,
        }
        self.between_handlers: dict[type, Callable[[Any], None]] = {
            LoopTick: self._tick_between,
            RelayRestart: self._on_relay_restart,
            SignalReceived: self._stop_between,
            ControlRequest: self._refuse_between,
            events.NodeLost: self._nodes_between,
            events.PeerFailed: self._nodes_between,
            events.StoreKeySeen: self._key_between,
        }
        self._awaited: tuple[str | None, bytes | None] = (None, None)  # between attempts: the key waited for
        self.last_teardown: TeardownResult | None = None

    @property
    def case(self) -> AttemptCase:
        """What the decider holds about the attempt that runs: the attempt's own (a new one per launch)."""
        case = self.attempt.case
        if case is None:  # an Attempt made without one (a test's): made on first use
            case = self.attempt.case = AttemptCase()
        return case

    def _arm(self, when: float, event: object) -> None:
        """A timer of the attempt that runs: its event comes back at ``when`` unless the attempt was torn down."""
        self.attempt.timers.append(self.loop.at(when, event))

    # What _setup creates (run() calls it first): reading one before is a bug, said as one.
    @property
    def run_dir(self) -> Path:
        return _set_up(self._run_dir, "run_dir")

    @property
    def heartbeat(self) -> HeartbeatSegment:
        return _set_up(self._heartbeat, "heartbeat")

    @property
    def ctx(self) -> RunContext:
        return _set_up(self._ctx, "ctx")

    @property
    def watchdog(self) -> WatchdogThread:
        return _set_up(self._watchdog, "watchdog")

    @property
    def desk(self) -> IncidentDesk:
        return _set_up(self._desk, "desk")

    @property
    def services(self) -> Services:
        return _set_up(self._services, "services")

    @property
    def quarantine(self) -> RequestQuarantine:
        return _set_up(self._quarantine, "quarantine")

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        procs.make_subreaper()
        self._run_dir = run_dir_for(self.run_key)
        nslots = self.spec.nproc_per_node
        self._heartbeat = HeartbeatSegment(self.run_dir / "heartbeat", nslots, self.run_id, time.monotonic())
        self._control = HeartbeatSegment(self.run_dir / "control", CONTROL_SLOTS, self.run_id, time.monotonic())
        self.death_r, self.death_w = os.pipe()
        os.set_inheritable(self.death_r, False)
        os.set_inheritable(self.death_w, False)
        master_port = self.spec.master_port or free_port(self.spec.master_addr)
        self.cgroup, why_not = RunCgroup.create(self.run_key)
        if self.cgroup is not None:
            log.info("process tracking", mechanism=self.cgroup.describe())
        else:
            log.info("process tracking", mechanism="run-marker scan only (no cgroup)", why=why_not)
        self._ctx = RunContext(
            run_id=self.run_id,
            run_dir=self.run_dir,
            heartbeat_path=self.heartbeat.path,
            control_path=self._control.path,
            death_fd=self.death_r,
            supervisor_pid=os.getpid(),
            world_size=self.spec.world_size,
            nproc_per_node=self.spec.nproc_per_node,
            node_rank=self.spec.node_rank,
            master_addr=self.spec.master_addr,
            master_port=master_port,
            zero_code_hook=self.spec.zero_code_hook,
            max_restarts=self.spec.max_restarts,
            run_key=self.run_key,
            cgroup_procs=self.cgroup.procs_file if self.cgroup is not None else None,
        )
        self._services = Services(
            self.spec, self.run_id, self.run_dir, self.post, self.attempt_view, run_key=self.run_key
        )
        self._desk = IncidentDesk(
            self.spec,
            self.run_id,
            self.run_dir,
            read_heartbeats=self.heartbeat.read_all,
            on_dump=self.services.on_dump,
            gpu=self.services.gpu,
            hurry=self.hurry,
            read_control=self._control.read_all,
        )
        self._quarantine = RequestQuarantine(
            self.run_dir,
            self.spec.quarantine_after,
            crash_loop_over=crash_loop_over,
            on_quarantined=self.services.metrics.record_quarantined,
            from_relay=self.spec.relay.address is not None and self.public is not None,
        )
        self.desk.requests_of = self.quarantine.evidence
        self._watchdog = WatchdogThread(
            self.spec,
            read_heartbeats=self.heartbeat.read_all,
            read_control=self._control.read_all,
            attempt=self.attempt_view,
            post=self.post,
            on_tick=self.services.on_tick,
        )
        if self.nodes is not None:
            transport, group = self.nodes
            node_link = link.NodeLink(
                transport.store,
                group,
                self.post,
                on_peers=self.services.metrics.set_nodes,
                on_store_latency=self.services.metrics.observe_store_latency,
                transport=transport,
                world_size=self.spec.world_size,
                node_lost_s=self.spec.nodes.node_timeout,
            )
            self.node_rules = GroupOfNodes(self.spec, self.run_id, node_link, transport)
            self.sources += self.node_rules.sources()
            self.services.compare_across_nodes(self.nodes[1])
            self.desk.link_nodes(self.nodes[1])
        if self.spec.straggler.threshold is not None:
            self.sources.append(
                StragglerThread(
                    self.spec.straggler.config(),
                    self.heartbeat,
                    self.attempt_view,
                    self.post,
                    self.services.on_straggler_report,
                    nodes=self.node_rules.stragglers(),
                    gpu=self.services.gpu.latest,
                )
            )
        # What supervisors that died without a teardown left (escapees, cgroups, run dirs): ended before this run
        # registers, by the decider, which kills (the registry, an observer's, only says which runs are dead).
        stale_runs.sweep(control_socket.dead_runs())
        self.sources += [self.services, self.watchdog]
        for source in self.sources:
            source.start()
        if self.public is not None:  # the built-in engine's port (upstream: rank 0's), or a COMMAND's --relay
            builtin = self.listener is not None
            self.relay = RelayProcess(
                self.public,
                self.listener.address if self.listener is not None else str(self.spec.relay.upstream),
                str(self.run_dir),
                self.spec.log_format,
                self.spec.engine.read_timeout if builtin else None,
                engine="builtin" if builtin else self.spec.relay.engine,
                hold_s=self.spec.relay.hold_s(builtin),
                max_held=self.spec.relay.max_held,
            )
            self._watch_relay(self.relay.start())
            self.services.relay_counts = self.relay.counts
            self.quarantine.on_change = self.relay.tell  # the incident and the quarantine, told over its stdin
        for signum in signals.HANDLED:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        """Record and hand off only (see supervisor/signals.py for what each signal means)."""
        if signum in signals.STOP_SIGNALS or signum == signals.DUMP_THEN_STOP_SIGNAL:
            if self.stop_requested and signum in signals.STOP_SIGNALS:
                self.hurry.set()  # a second stop signal, whatever the main thread is doing: SIGKILL now
            self.stop_requested = True
        self.post(SignalReceived(signum))

    def _cleanup(self) -> None:
        closers = [self._stop_relay] if self.relay is not None else []
        closers += [source.stop for source in reversed(self.sources)]
        closers += [part.close for part in (self._desk, self._heartbeat, self._control) if part is not None]
        for closer in closers:
            try:
                closer()
            except Exception as exc:
                log.warning("cleanup step failed", error=repr(exc))
        for fd in (self.death_r, self.death_w):
            if fd >= 0:
                os.close(fd)
        if self._run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.cgroup is not None:
            self.cgroup.kill()  # nothing should be left; if something is, it goes now
            if not self.cgroup.remove():
                log.warning("run cgroup not removed", path=str(self.cgroup.path))
        self.hurry.close()

    # ------------------------------------------------------------------ state
    def transition(self, event: Event) -> None:
        new = next_state(self.state, event)
        if new is not self.state:
            log.debug("state", old=self.state.value, new=new.value, cause=event.value)
            self.state = new
            if self._services is not None:
                self.services.on_state(new)

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        logs.bind_run(self.run_id)
        log.info(
            "supervise starting",
            run_id=self.run_id,
            mode="tree" if self.spec.tree else "spawn",
            ranks=self.spec.nproc_per_node,
            world_size=self.spec.world_size,
            command=" ".join(self.spec.rank_argv()),
        )
        if os.environ.get(ENV_DRILL):
            log.warning(
                "drill injection lane open: this run was started by supervise drill, which may arm faults in its "
                "processes (docs/drills.md)",
                event_name="drill_lane_open",
            )
        try:
            self._setup()
            self.loop.after(LOOP_TICK_S, LoopTick())  # re-armed by its handler: /livez beats while the loop turns
            return self._run_attempts()
        except Exception:
            log.exception("supervisor internal error: tearing down every rank")
            self._teardown(immediate=False)
            return EXIT_INTERNAL
        finally:
            self._cleanup()

    def _run_attempts(self) -> int:
        while True:
            outcome = self._run_attempt()
            if outcome.code != EXIT_OK:
                self.quarantine.attempt_ended(self.case.requests)  # quarantine.json before any next attempt
            between = Between(
                number=self.attempt.number,
                uptime_s=self.clock() - self.attempt.started_at,
                stopping=lambda: self.stopping is not None,
            )
            # The restart decision, in one place: this node's policy, or node 0's for a group of nodes.
            delay = self._settle(self.node_rules.restart_delay(outcome, self.restart, between))
            if delay is None:
                outcome = self.node_rules.end or outcome
                break
            self._between_attempts(delay)  # the backoff
            if self.node_rules.end is not None or not self._settle(self.node_rules.meet(between)):
                outcome = self.node_rules.end or Outcome(EXIT_OK, "shutdown")
                break
            self.transition(Event.RESTART)
            self.services.on_restart()  # counted once every node is back, not on a barrier that failed
        code = outcome.code
        if self.last_teardown is not None and not self.last_teardown.complete:
            code = EXIT_TEARDOWN
        if self.relay is not None:
            self._stop_relay()  # no attempt follows: what it holds gets its 503 now, naming the incident
            self.services.metrics.set_relay_counts(self.relay.counts())  # its last counts, for the final scrape
            if self.public is not None:
                self.public.close()  # from now on a client is refused at once, not held in a backlog no one reads
        log.info("supervise exiting", code=code, reason=outcome.reason, restarts=self.restart.restarts)
        linger = self.spec.metrics.linger
        if linger is None:  # the default: only while someone scrapes, until the final state was scraped
            linger = DEFAULT_FAULT_LINGER_S if code != EXIT_OK else 0.0
        self.services.linger(linger, self.hurry, until_scraped=self.spec.metrics.linger is None)
        return code

    def _settle(self, ruling: R | WaitForKey[R]) -> R:
        """A ruling between attempts, its waits done: each ``WaitForKey`` is waited for in the between-attempts
        phase, and what the rules make of the value (or of its absence) is the next ruling."""
        while isinstance(ruling, WaitForKey):
            ruling = ruling.then(self._between_attempts(ruling.seconds, ruling.key))
        return ruling

    def _between_attempts(self, seconds: float, key: str | None = None) -> bytes | None:
        """Read events for ``seconds`` (or, given ``key``, until the node link reports it: its value), with the
        between-attempts handlers: a stop signal ends the run (``self.stopping``); multi-node, a lost node or a
        stop elsewhere ends it too (``node_rules.end``: a group cannot restart without it); a control request
        is refused; anything else belongs to the attempt that ended."""
        deadline = self.clock() + seconds
        self._awaited = (key, None)
        try:
            while self.clock() < deadline and self.stopping is None and self.node_rules.end is None:
                ev = self.loop.next(until=deadline)
                if ev is None:
                    continue
                self._dispatch(ev, self.between_handlers)
                if self._awaited[1] is not None:
                    return self._awaited[1]
            return None
        finally:
            self._awaited = (None, None)

    def _stop_between(self, ev: SignalReceived) -> None:
        if ev.signum != signals.DUMP_SIGNAL:
            self.stopping = ev

    def _refuse_between(self, ev: ControlRequest) -> None:
        ev.reply.put({"ok": False, "error": "the group is restarting; no rank to dump right now"})

    def _nodes_between(self, ev: events.NodeLost | events.PeerFailed) -> None:
        self.node_rules.between(ev, self.attempt.number)

    def _key_between(self, ev: events.StoreKeySeen) -> None:
        if ev.key is not None and ev.key == self._awaited[0]:
            self._awaited = (ev.key, ev.value)

    def _launch(self) -> None:
        self.attempt = Attempt(
            self.attempt_view.set,
            started_at=time.monotonic(),
            restarts=self.restart.restarts,
            number=self.attempt.number + 1,
            case=AttemptCase(),  # what the decider holds about it: dropped with it, never reset by hand
        )
        logs.bind_attempt(self.attempt.number)
        if self.attempt.number > 1:  # torch's own dump files of the attempt that ended are not this one's
            shutil.rmtree(self.run_dir / "fr-dump", ignore_errors=True)
        self.case.requests = self.quarantine.before_attempt()
        extra_env = self.services.rank_env
        if self.spec.tree:
            env = launch.rank_env(self.base_env, self.ctx, None, extra_env(None))
            spec = RankSpec(slot=LAUNCHER_SLOT, rank=-1, argv=tuple(self.spec.rank_argv()), env=env)
            with self.monitor.spawning():
                handle, proc = self._spawn(spec)
                self.attempt.set_launcher(handle)
                self.monitor.watch(LAUNCHER_KEY, proc, self.attempt.number)
            log.info("launcher started", pid=handle.pid)
            return
        fds: tuple[int, ...]
        for slot in range(self.spec.nproc_per_node):
            rank = self.spec.rank_offset + slot
            env = launch.rank_env(self.base_env, self.ctx, slot, extra_env(slot), restart_count=self.restart.restarts)
            argv, fds = tuple(self.spec.rank_argv()), ()
            if rank == 0 and self.listener is not None:  # the serving port outlives the attempt
                argv, env, fds = self.listener.hand_to(argv, env, keep=(self.ctx.death_fd,))
                if self.relay is not None:  # the ready line names the port clients use
                    env[RELAY_URL_ENV] = f"http://{self.public.address}" if self.public is not None else ""
            spec = RankSpec(slot=slot, rank=rank, argv=argv, env=env, pass_fds=fds)
            with self.monitor.spawning():
                handle, proc = self._spawn(spec)
                self.attempt.add_rank(handle)
                self.monitor.watch(("rank", slot), proc, self.attempt.number)
            log.info("rank started", rank=rank, pid=handle.pid)

    def _spawn(self, spec: RankSpec) -> tuple[RankHandle, procs.Pidfd]:
        """Start one process and hold it by pidfd from now on.  Opening the pidfd after the fork
        is race-free: the process is our unreaped child, its pid cannot change hands."""
        handle = launch.spawn(spec, self.ctx)
        proc = handle.proc = procs.Pidfd(handle.pid, os.pidfd_open(handle.pid), child=True)
        return handle, proc

    def _run_attempt(self) -> Outcome:
        if self.stopping is not None:
            return Outcome(EXIT_OK, "shutdown")
        self._launch()
        for ev in self.node_rules.carried():  # what another node said of this attempt before this node launched it
            self.post(ev)
        while self.attempt.outcome is None:
            ev = self.loop.next()
            if ev is None:
                continue
            try:
                self._dispatch(ev, self.handlers)
            except Exception:  # a bug of ours: this attempt's state is not to be trusted, it ends here
                log.exception("event handling failed: ending the attempt", kind=type(ev).__name__)
                self._end_on_internal_error(type(ev).__name__)
        outcome = self.attempt.outcome
        for timer in self.attempt.timers:
            timer.cancel()  # what it waited for is moot: the attempt is over
        self._teardown(immediate=self.hurry.is_set())
        return outcome

    # -- the relay: a process of the run, not of an attempt; restarted by the main loop (supervisor/relay/process.py)
    def _watch_relay(self, pidfd: procs.Pidfd | None) -> None:
        if pidfd is not None:
            self.monitor.watch(RELAY_KEY, pidfd)

    def _unwatch_relay(self) -> RelayProcess | None:
        """The relay, no longer watched by the exit monitor (its pidfd is closed next)."""
        relay = self.relay
        if relay is not None and relay.pidfd is not None:
            self.monitor.release([relay.pidfd])
        return relay

    def _on_relay_exit(self) -> None:
        relay = self._unwatch_relay()
        if relay is None:
            return
        pause = relay.exited(self.clock())
        if pause is not None:
            self.loop.after(pause, RelayRestart())

    def _on_relay_restart(self, ev: RelayRestart) -> None:
        if self.relay is not None:
            self._watch_relay(self.relay.respawn())

    def _stop_relay(self) -> None:
        relay = self._unwatch_relay()
        if relay is not None:
            relay.stop()

    # ------------------------------------------------------------------ events
    def _dispatch(self, ev: object, handlers: Mapping[type, Callable[[Any], None]]) -> None:
        """The one dispatcher: ``handlers`` is the table of the phase the run is in."""
        if isinstance(ev, ProcessExited) and ev.key == RELAY_KEY:
            self._on_relay_exit()  # in every phase: the relay lives across attempts
            return
        handler = handlers.get(type(ev))
        if handler is None:
            log.debug("ignored event", kind=type(ev).__name__)
            return
        if isinstance(ev, ATTEMPT_EVENTS) and ev.attempt != self.attempt.number:
            log.debug("stale event dropped", kind=type(ev).__name__, event_attempt=ev.attempt)
            return
        handler(ev)

    def _finish(self, outcome: Outcome) -> None:
        first = self.attempt.outcome is None
        self.attempt.finish(outcome)
        if first:
            self.node_rules.attempt_ended(outcome)

    def _end_on_internal_error(self, during: str) -> None:
        """A handler raised: the attempt ends with the internal-error exit and is torn down (not restarted),
        whatever state the handler left it in (a hard hang moved to HUNG before its bundle, say): left running,
        it would wait for a verdict no watchdog gives twice."""
        outcome = Outcome(EXIT_INTERNAL, "internal_error", final=True)
        try:
            self._finish(outcome)
        except Exception:  # telling the other nodes failed too: this node still ends its attempt
            log.exception("ending the attempt after an internal error failed", during=during)
            if self.attempt.outcome is None:
                self.attempt.finish(outcome)

    # -- multi-node: this node's fate goes on the fault bus; the others' arrives as events
    def _announce_fault(
        self, reason: str, rank: int | None, verdict: str, incident_id: str | None = None, final: bool = False
    ) -> str:
        """A fatal incident here: its id is minted now (or is the one a hang query named), and the other
        nodes hear of it before this node's capture (which may take up to --dump-timeout), so they tear down
        at once instead of blaming ranks of their own when the collectives break.  Returns the id: the caller
        hands it to the desk call that writes this node's bundle of the incident.  ``final``: no node restarts
        after it."""
        incident_id = incident_id or new_incident_id(self.run_id)
        self.node_rules.publish_fault(
            messages.Fault(
                node=self.spec.node_rank,
                rank=rank,
                reason=reason,
                incident_id=incident_id,
                verdict=verdict[:500],
                final=final,
            )
        )
        # Before the teardown signals any rank: rank 0 names the incident in the 503s it answers.
        self.quarantine.fault(self.case.requests, incident_id, self.attempt.view)
        return incident_id

    def _on_signal_event(self, ev: SignalReceived) -> None:
        name = exits.signal_name(ev.signum)
        if ev.signum == signals.DUMP_SIGNAL:
            log.info("on-demand dump requested by signal", signal=name)
            self.desk.on_demand(queue.SimpleQueue(), self.attempt.view)
            return
        if self.stopping is None:
            if ev.signum == signals.DUMP_THEN_STOP_SIGNAL:
                log.info("dump, then graceful shutdown, requested by signal", signal=name)
                self._dump_before_stop()
            self.stopping = ev
            log.info("stopping on signal: graceful shutdown of every rank", signal=name, grace_s=self.spec.kill_grace)
            self._finish(Outcome(EXIT_OK, "shutdown"))
        elif ev.signum in signals.STOP_SIGNALS:
            log.warning("second stop signal: killing every rank now", signal=name)

    def _dump_before_stop(self) -> None:
        """SIGQUIT: the bundle first (at most --dump-timeout), then the stop; a second stop signal cuts the wait."""
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self.desk.on_demand(reply, self.attempt.view)
        wait_s = self.spec.dumps.timeout
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not self.hurry.is_set():
            try:
                answer = reply.get(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                continue
            log.info("dump before stop", **{k: v for k, v in answer.items() if k in ("ok", "bundle", "error")})
            return
        log.warning("dump before stop did not finish in time; stopping anyway", waited_s=wait_s)

    # -- exits: arbitration decides what one means, this acts on the ruling
    def _on_exit(self, ev: ProcessExited) -> None:
        handle = self.attempt.handle_for(ev.key)
        if handle is None or handle.exit is not None or handle.pid != ev.pid:
            return  # unknown, already handled, or a late exit of a previous attempt
        if ev.status is not None and handle.popen is not None:
            handle.popen.returncode = ev.status.returncode  # keep Popen from reaping a reused pid
        info = arbitration.classify_exit(
            self.attempt, handle, ev.status, read_slot=self.heartbeat.read, oom_said=self.oom.said
        )
        self.attempt.record_exit(handle, info, ev.at)
        tearing_down = self.state is EngineState.TEARING_DOWN
        self._act_on(arbitration.rule_exit(self.attempt, handle, info, tearing_down=tearing_down))

    def _on_early_exit_check(self, ev: EarlyExitCheck) -> None:
        self._act_on(arbitration.rule_early_exit_check(self.attempt, ev))

    def _act_on(self, ruling: Ruling) -> None:
        if ruling.meaning is Meaning.STALE:
            return
        if ruling.count_as is not None:
            self.services.on_rank_exit(ruling.count_as)
        handle, info = ruling.handle, ruling.info
        if handle is None or info is None:  # only a STALE ruling names no exit
            return
        if ruling.meaning is Meaning.CONSEQUENCE:
            log.debug("rank exited during shutdown", rank=handle.rank, pid=handle.pid, cause=info.description)
        elif ruling.meaning is Meaning.RECHECK:
            # Peers of a finishing job exit within moments: check again shortly.
            self._arm(self.clock() + EARLY_EXIT_WINDOW_S, EarlyExitCheck(handle.slot, handle.pid, self.attempt.number))
        elif ruling.meaning is Meaning.CLEAN:
            log.info(ruling.message, event_name="run_finished")
            self._finish(Outcome(EXIT_OK, "clean"))
        elif ruling.meaning is Meaning.FAILED:
            self._rank_failed(handle, info)

    def _divergence_was_first(self) -> bool:
        """A divergence still in flight is the root cause: handle it first."""
        found = arbitration.divergence_first(self.services.settle_consensus, time.monotonic())
        if found is None and self.spec.consensus == "enforce":
            # Found by the consensus thread a moment before this exit and still queued behind it (observed
            # only, it was handled already: a divergence never ends an observed attempt).
            posted = self.services.divergences_posted(self.attempt.number)
            found = posted[0] if posted else None
        if found is None:
            return False
        self._on_divergence(found)
        return self.attempt.outcome is not None

    def _rank_failed(self, handle: RankHandle, info: ExitInfo) -> None:
        if self._divergence_was_first():
            return
        if self.attempt.outcome is None:  # multi-node: it may be a consequence of another node's failure
            held = self.node_rules.hold_failure(handle, info, self.case, self.attempt.number, self.clock())
            if held is not None:
                self._act_on_nodes(held)
                return
        self._rule_rank_failure(handle, info)

    def _rule_rank_failure(self, handle: RankHandle, info: ExitInfo) -> None:
        first, first_info = arbitration.root_cause(self.attempt, handle, info)
        self.attempt.first_failure = (first, first_info)
        who = RankView.of(first).who
        log.error(
            f"{RankView.of(first).describe(who)} {first_info.description}",
            event_name="rank_exited",
            rank=None if first.rank < 0 else first.rank,
            pid=first.pid,
            **first_info.to_dict(),
        )
        self.transition(Event.RANK_EXIT)
        incident_id = self._announce_fault(
            "rank_exit", None if first.rank < 0 else first.rank, f"{who} {first_info.description}"
        )
        self.desk.rank_exit(RankView.of(first), first_info, self.attempt.view, incident_id)
        self._finish(Outcome(EXIT_RANK, "rank_exit", culprit=first.rank))

    # -- observations of the watchdog and the consensus poller
    def _on_claimed(self, ev: RankClaimed) -> None:
        """Tree mode: a process of the launcher's tree joined the group."""
        existing = self.attempt.ranks.get(ev.slot)
        if existing is not None and existing.pid == ev.pid:
            return
        spec = RankSpec(slot=ev.slot, rank=ev.rank, argv=(), env={})
        handle = RankHandle(spec=spec, pid=ev.pid, started_at=time.monotonic())
        # Held by pidfd from the claim on: the process the pidfd names is the run's by its cgroup or its
        # ancestry (an engine's setproctitle wipes the environment marker: docs/supervisor.md).
        identity = self._run_identity()
        handle.proc = procs.open_verified(ev.pid, identity.owns)
        handle.read_title()
        self.attempt.add_rank(handle)
        # Found at its claim: inside init_process_group (rendezvous=True) when the rank was known before the join.
        log.info("rank joined the group", rank=ev.rank, pid=ev.pid, title=handle.title, rendezvous=ev.joining)
        if handle.proc is None:  # gone already (or not ours): its exit is all there is to report
            self.post(ProcessExited(("tree-rank", ev.slot), ev.pid, None, time.monotonic(), self.attempt.number))
            return
        launcher = self.attempt.launcher
        between = procs.ancestors_below(ev.pid, launcher.pid) if launcher is not None else None
        # Its parent (an engine process, or the launcher) is watched too: when both die of one kill, the
        # parent's exit is reported first (the rank dies of its parent-death signal).
        lineage = [*between, launcher.pid] if between is not None and launcher is not None else []
        parent = lineage[0] if lineage else None
        self.monitor.watch(("tree-rank", ev.slot), handle.proc, self.attempt.number, parent=parent)
        self._hold_engine_processes(ev.pid, lineage, identity)

    def _run_identity(self) -> procs.RunIdentity:
        """What makes a process the run's: its cgroup, or its ancestry and marker (docs/supervisor.md)."""
        return procs.RunIdentity(self.run_key, in_cgroup=self.cgroup.holds if self.cgroup is not None else None)

    def _on_control_claimed(self, ev: events.ControlClaimed) -> None:
        """A process of the engine said what it is (it claimed the control slot of its role): a process already
        held gets that role (a rank that is also the scheduler, TP=1, stays a rank); one not yet held (an engine
        core whose workers have not joined) is held from now on, as the processes above a rank are."""
        if ev.attempt != self.attempt.number or self.attempt.outcome is not None:
            return
        for handle in self.attempt.processes():
            if handle.pid == ev.pid and handle.slot < 0:
                handle.read_title()  # the launcher's is its command line since its exec: its engine's words
        if not self.attempt.set_role(ev.pid, ev.role):
            self._hold_engine_process(ev.pid, None, self._run_identity(), role=ev.role)
        log.info("control plane claimed", event_name="control_plane_claimed", role=ev.role, pid=ev.pid)

    def _hold_engine_processes(self, rank_pid: int, lineage: list[int], identity: procs.RunIdentity) -> None:
        """The processes between the launcher and a rank that joined (vLLM's ``VLLM::EngineCore``; ``lineage``:
        those, nearest the rank first, then the launcher) are held and watched too: the death of one is the
        first failure, not the ranks that die of it."""
        for pid, parent in itertools.pairwise(lineage):
            if not self.attempt.holds_process(pid):
                self._hold_engine_process(pid, parent, identity, above_rank_pid=rank_pid)

    def _hold_engine_process(
        self, pid: int, parent: int | None, identity: procs.RunIdentity, role: str = "", above_rank_pid: int = 0
    ) -> None:
        """Hold and watch one process of the run's tree that is not a rank (only if it is the run's)."""
        slot = -2 - len(self.attempt.engine_processes)
        handle = RankHandle(spec=RankSpec(slot=slot, rank=-1, argv=(), env={}), pid=pid, started_at=time.monotonic())
        handle.role = role
        handle.proc = procs.open_verified(pid, identity.owns)
        if handle.proc is None:
            return
        handle.read_title()
        key = self.attempt.add_engine_process(handle)
        log.info(
            "engine process held",
            pid=pid,
            title=handle.title,
            role=RankView.of(handle).role,
            above_rank_pid=above_rank_pid or None,
        )
        self.monitor.watch(key, handle.proc, self.attempt.number, parent=parent)

    def _tick_between(self, ev: LoopTick) -> None:
        self.services.liveness.beat()  # the loop turns (restarting on purpose is alive too)
        self.loop.after(LOOP_TICK_S, ev)

    def _on_loop_tick(self, ev: LoopTick) -> None:
        self._tick_between(ev)
        # What the engine sets up in /dev/shm (vLLM's shm all-reduce buffers, made after the workers joined).
        self.attempt.look_at_shm(time.monotonic(), every_s=SHM_LOOK_EVERY_S)
        for handle in self.attempt.ranks.values():
            if handle.renamed():  # an engine renamed its worker (VLLM::Worker -> VLLM::Worker_TP1)
                handle.read_title()

    def _on_all_ready(self, ev: AllRanksReady) -> None:
        for handle in self.attempt.processes():
            handle.read_title()  # an engine names its workers once they are set up (setproctitle)
        self.attempt.look_at_shm(time.monotonic(), every_s=0.0)
        if self.attempt.outcome is None:
            self.transition(Event.ALL_READY)
            self.services.on_ready(len(self.attempt.ranks))

    def _on_watchdog(self, ev: WatchdogVerdict) -> None:
        if self.attempt.outcome is not None:
            return
        kind = ev.kind
        if kind is VerdictKind.SOFT:
            self.case.suspicions.add("hang")
            self.transition(Event.SOFT_HANG)
            self.services.on_hang("soft")
            log.warning("hang suspected: " + ev.message, stalled_s=round(ev.stalled_s, 2), **ev.log_fields)
            self.desk.soft_hang(ev, self.attempt.view)
        elif kind is VerdictKind.RECOVERED:
            log.info("progress resumed", stalled_s=round(ev.stalled_s, 2))
            self._clear_suspicion("hang")
            if self.case.deferred_hang is not None:  # asked the other nodes, then progress came back: no hang
                self.case.deferred_hang = self.case.hang_query = None
        elif kind is VerdictKind.HARD:
            if self._divergence_was_first():
                return
            asked = self.node_rules.ask_where(ev, self.case, self.attempt.number, self.clock())
            if asked is not None:
                self._act_on_nodes(asked)  # the verdict waits for the other nodes' answer
                return
            self._rule_hang(ev)
        elif kind is VerdictKind.STARTUP_TIMEOUT:
            self.transition(Event.STARTUP_TIMEOUT)
            log.error("startup timeout: " + ev.message, startup_timeout_s=self.spec.watchdog.startup_timeout)
            incident_id = self._announce_fault("startup_timeout", None, "startup timeout: " + ev.message)
            self.desk.startup_timeout(ev, self.attempt.view, incident_id)
            self._finish(Outcome(EXIT_STARTUP, "startup_timeout"))

    def _rule_hang(self, ev: WatchdogVerdict) -> None:
        self.transition(Event.HARD_HANG)
        self.services.on_hang("hard")
        log.error("hang: " + ev.message, stalled_s=round(ev.stalled_s, 2), **ev.log_fields)
        asked = self.case.hang_query or self.case.peer_hang_query
        # The rank that is elsewhere is known before any capture when one is stopped here, or when answering
        # another node's query (stopped, outside collectives, behind): the other nodes name it.
        v = ev.verdict
        outside = v.outside_collective if self.case.peer_hang_query else ()
        elsewhere = v.elsewhere_ranks or outside
        rank = elsewhere[0] if elsewhere else None
        incident_id = self._announce_fault(
            "hang", rank, "hang: " + ev.message, incident_id=asked.incident_id if asked else None
        )
        culprits = self.desk.hard_hang(ev, self.attempt.view, incident_id)
        self._finish(Outcome(EXIT_HANG, "hang", culprit=culprits[0] if culprits else None))

    # -- stragglers: the group waits for a rank that is slow, not stopped (docs/watchdogs.md)
    def _on_straggler(self, ev: events.StragglerNamed) -> None:
        if self.attempt.outcome is not None:
            return
        rank = ev.event.rank
        verdict = ev.event.sentence()
        if ev.evidence.get("explanation"):
            verdict += f"; {ev.evidence['explanation']}"
        log.warning(
            "straggler: " + verdict,
            event_name="straggler_named",
            rank=rank,
            action=self.spec.straggler.action,
            wait_share=round(ev.event.lag.wait_share, 4),
            late_lag_s=round(ev.event.lag.late_lag_s, 6),
        )
        if self.spec.straggler.action == "dump":
            self.desk.straggler(ev, self.attempt.view, verdict)
            return
        # restart|kill: the attempt ends, announced first (the bundle carries the id the other nodes and the
        # quarantine were given); kill is final on every node, whatever --max-restarts says
        final = self.spec.straggler.action == "kill"
        self.transition(Event.RANK_EXIT)
        incident_id = self._announce_fault("straggler", rank, "straggler: " + verdict, final=final)
        self.desk.straggler(ev, self.attempt.view, verdict, incident_id)
        self._finish(Outcome(EXIT_RANK, "straggler", culprit=rank, final=final))

    def _on_straggler_across_nodes(self, ev: events.StragglerAcrossNodes) -> None:
        for text in ev.sentences:
            log.warning(
                "straggler across nodes: " + text,
                event_name="straggler_across_nodes",
                ranks=list(ev.ranks),
                nodes=list(ev.nodes),
            )

    def _on_straggler_cleared(self, ev: events.StragglerCleared) -> None:
        log.info("straggler cleared: " + ev.event.sentence(), event_name="straggler_cleared", rank=ev.event.rank)

    def _on_divergence(self, ev: DivergenceFound) -> None:
        if self.attempt.outcome is not None:
            return
        enforce = self.spec.consensus == "enforce"
        if not enforce:
            self.case.suspicions.add("divergence")
        self.transition(Event.DIVERGENCE_ENFORCED if enforce else Event.DIVERGENCE_OBSERVED)
        self.services.on_divergence()
        log.error("divergence: " + ev.verdict.verdict, step=ev.verdict.step, culprit_ranks=ev.verdict.culprit_ranks)
        incident_id = None  # observed only: a soft bundle, nobody told
        if enforce:
            culprits = ev.verdict.culprit_ranks
            incident_id = self._announce_fault("divergence", culprits[0] if culprits else None, ev.verdict.verdict)
        self.desk.divergence(ev, self.attempt.view, blocking=enforce, incident_id=incident_id)
        if enforce:
            culprit = ev.verdict.culprit_ranks[0] if ev.verdict.culprit_ranks else None
            self._finish(Outcome(EXIT_DIVERGENCE, "divergence", culprit=culprit))

    def _on_agreed(self, ev: ConsensusAgreed) -> None:
        log.info("ranks agree again after the observed divergence", steps=ev.steps)
        self._clear_suspicion("divergence")

    def _clear_suspicion(self, reason: str) -> None:
        """/readyz stays 503 while any suspicion (soft hang, observed
        divergence) is open; each clears on its own evidence."""
        self.case.suspicions.discard(reason)
        if not self.case.suspicions:
            self.transition(Event.PROGRESS)

    # -- the other nodes' news: the multi-node rules decide (supervisor/multinode.py), this acts on the ruling
    def _on_peer_failed(self, ev: events.PeerFailed) -> None:
        if self.attempt.outcome is None:
            self._act_on_nodes(self.node_rules.peer_failed(ev, self.case))

    def _on_node_lost(self, ev: events.NodeLost) -> None:
        if self.attempt.outcome is None:
            self._act_on_nodes(self.node_rules.node_lost(ev, self.case))

    def _on_peer_hang_query(self, ev: events.PeerHangQuery) -> None:
        if self.attempt.outcome is None and self.node_rules.peer_hang_query(ev, self.case):
            self.watchdog.answer_hang_query(ev.query.seq, ev.query.node, ev.query.inside_step)

    def _on_hang_query_unanswered(self, ev: HangQueryUnanswered) -> None:
        if self.attempt.outcome is None:
            self._act_on_nodes(self.node_rules.hang_query_unanswered(self.case))

    def _on_stderr_check(self, ev: events.StderrCheck) -> None:
        if self.attempt.outcome is None:
            self._act_on_nodes(self.node_rules.stderr_check(ev, self.case, self.clock()))

    def _on_consequence_window_over(self, ev: events.ConsequenceWindowOver) -> None:
        if self.attempt.outcome is None:
            self._act_on_nodes(self.node_rules.consequence_window_over(ev, self.case))

    def _act_on_nodes(self, ruling: NodeRuling) -> None:
        if isinstance(ruling, Hold):
            if ruling.event is not None:
                self._arm(ruling.when, ruling.event)
        elif isinstance(ruling, StopToo):
            self._finish(Outcome(EXIT_OK, "shutdown"))
        elif isinstance(ruling, RuleFailure):
            self._rule_rank_failure(ruling.handle, ruling.info)
        elif isinstance(ruling, RuleHang):
            self._rule_hang(ruling.verdict)
        elif isinstance(ruling, PeerIncident):
            self.transition(Event.RANK_EXIT)
            # before this node's teardown: its rank 0 names the incident in the 503s it answers
            self.quarantine.fault(self.case.requests, ruling.incident_id, self.attempt.view)
            extra = {
                "culprit_ranks": [ruling.rank] if ruling.rank is not None else [],
                "verdict": ruling.verdict,
                "culprit_node": ruling.node,
            }
            self.desk.peer_incident(ruling.reason, extra, self.attempt.view, ruling.incident_id)
            self._finish(Outcome(ruling.code, ruling.reason, culprit=ruling.rank, final=ruling.final))

    def _on_control(self, ev: ControlRequest) -> None:
        if ev.request.get("cmd") != "dump":
            ev.reply.put({"ok": False, "error": f"unknown command {ev.request.get('cmd')!r}"})
            return
        self.desk.on_demand(ev.reply, self.attempt.view)

    # ------------------------------------------------------------------ teardown
    def _teardown(self, immediate: bool) -> None:
        self.transition(Event.TEARDOWN)
        handles = self.attempt.processes()
        kind = "tree-rank" if self.spec.tree else "rank"  # the keys _launch/_on_claimed watch under
        keys: set[object] = {(kind, h.slot) for h in self.attempt.ranks.values()} | {LAUNCHER_KEY}
        keys |= {(ENGINE_PROCESS, h.pid) for h in self.attempt.engine_processes}
        policy = KillPolicy(grace_s=self.spec.kill_grace, immediate=immediate, hurry=self.hurry)
        try:
            result = teardown(
                handles,
                self.run_key,
                policy,
                wait_ranks_reported=lambda deadline: self.monitor.wait_all_exited(keys, deadline),
                gpu_holders=self.services.gpu_check() if self._services is not None else None,
                cgroup=self.cgroup,
                keep=self.monitor.kept_pids,
                shm_seen=self.attempt.shm.seen() | shm.registered(self.run_dir),
            )
        finally:
            # The attempt's pidfds end with it (reaped, or survivors reported): no fd outlives an attempt.
            held = [h.proc for h in handles if h.proc is not None]
            self.monitor.release(held)
            for proc in held:
                proc.close()
        self.last_teardown = result
        if self.hurry.is_set() and not immediate:
            log.warning("second stop signal: grace period cut short, remaining processes were killed")
        if self._services is not None:
            self.services.on_teardown(result)
        if self._desk is not None:
            self.desk.settle()  # dumps still writing: each until its --dump-timeout deadline
        fields = {
            "duration_s": round(result.duration_s, 3),
            "escalated": result.escalated,
            "gpu_memory_verified": result.gpu_checked,
            "marker_scans": result.marker_scans,
        }
        if result.survivors:
            log.error(
                "teardown incomplete: processes survived SIGKILL",
                survivors=[s.describe() for s in result.survivors],
                **fields,
            )
        elif result.gpu_holders:
            log.error(
                "teardown incomplete: GPU memory still held",
                holders=[{"gpu": g, "pid": p, "bytes": b} for g, p, b in result.gpu_holders],
                **fields,
            )
        else:
            log.info("teardown complete: no process of the run remains", **fields)
        self.transition(Event.STOPPED)
