"""The supervisor: the one place that decides.

Threads only observe and post events to one queue (``SimpleQueue``: safe to
put from signal handlers); the main thread takes them one at a time and is the
only code that changes state, starts dumps, kills or restarts::

    exit-monitor   ProcessExited        (pidfds: a death, the moment it happens)
    watchdog       WatchdogVerdict      (heartbeat slots → watchdogs.policy)
                   RankClaimed          (tree mode: a process joined the group)
    consensus      DivergenceFound      (consensus.monitor)
    control-socket ControlRequest       (`supervise dump`)
    signal handler SignalReceived

Ranks are spawned only from the main thread (parent-death signals fire when
the forking *thread* exits).
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Mapping

import structlog

from . import exits, launch, logs, procs
from .exits import ExitInfo
from .rank.heartbeat import HeartbeatSegment
from .incidents import IncidentDesk
from .launch import RankHandle, RankSpec, RunContext
from .monitor import ExitMonitor, ProcessExited
from .rank.net import free_port
from .spec import LaunchSpec
from .state import EngineState, Event, next_state
from .teardown import KillPolicy, TeardownResult, teardown
from .watch import ConsensusAgreed, DivergenceFound, RankClaimed, WatchdogThread, WatchdogVerdict

log = structlog.get_logger("supervise")

from .outcome import (
    EARLY_EXIT_WINDOW_S,
    EXIT_DIVERGENCE,
    EXIT_HANG,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_RANK,
    EXIT_STARTUP,
    EXIT_TEARDOWN,
    LAUNCHER_KEY,
    RESTART_BACKOFF_BASE_S,
    RESTART_BACKOFF_MAX_S,
    RESTART_STABLE_S,
    TEARDOWN_EXIT,
    Attempt,
    ControlRequest,
    EarlyExitCheck,
    Outcome,
    SignalReceived,
    new_run_id,
    run_dir_for,
)


class Supervisor:
    def __init__(self, spec: LaunchSpec, base_env: Mapping[str, str], run_id: str | None = None):
        self.spec = spec
        self.base_env = dict(base_env)
        self.run_id = run_id or new_run_id()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.state = EngineState.STARTING
        self.attempt = Attempt()
        self.restarts = 0
        self.stopping: SignalReceived | None = None
        self.hurry = threading.Event()
        self.oom = exits.OomCounter()
        self.run_dir: Path | None = None
        self.heartbeat: HeartbeatSegment | None = None
        self.death_r = self.death_w = -1
        self.ctx: RunContext | None = None
        self.monitor = ExitMonitor(self.events.put)
        self.watchdog: WatchdogThread | None = None
        self.desk: IncidentDesk | None = None
        self.services = None  # supervisor.services.Services (metrics, control, consensus)
        self.last_teardown: TeardownResult | None = None
        self.suspicions: set[str] = set()  # why the engine is SUSPECT: "hang", "divergence"

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        from .services import Services

        procs.make_subreaper()
        self.run_dir = run_dir_for(self.run_id)
        nslots = self.spec.nproc_per_node
        self.heartbeat = HeartbeatSegment(self.run_dir / "heartbeat", nslots, self.run_id, time.monotonic())
        self.death_r, self.death_w = os.pipe()
        os.set_inheritable(self.death_r, False)
        os.set_inheritable(self.death_w, False)
        master_port = self.spec.master_port or free_port(self.spec.master_addr)
        self.ctx = RunContext(
            run_id=self.run_id,
            run_dir=self.run_dir,
            heartbeat_path=self.heartbeat.path,
            death_fd=self.death_r,
            supervisor_pid=os.getpid(),
            world_size=self.spec.world_size,
            nproc_per_node=self.spec.nproc_per_node,
            node_rank=self.spec.node_rank,
            master_addr=self.spec.master_addr,
            master_port=master_port,
            zero_code_hook=self.spec.zero_code_hook,
        )
        self.services = Services(self)
        self.desk = IncidentDesk(self)
        self.watchdog = WatchdogThread(self)
        self.monitor.start()
        self.services.start()
        self.watchdog.start()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        # Hand off only; a second Ctrl-C also cuts the grace period short.
        if self.stopping is not None and signum == signal.SIGINT:
            self.hurry.set()
        self.events.put(SignalReceived(signum))

    def _cleanup(self) -> None:
        for closer in (
            lambda: self.watchdog and self.watchdog.stop(),
            lambda: self.services and self.services.stop(),
            lambda: self.desk and self.desk.close(),
            self.monitor.stop,
            lambda: self.heartbeat and self.heartbeat.close(),
        ):
            try:
                closer()
            except Exception as exc:
                log.warning("cleanup step failed", error=repr(exc))
        for fd in (self.death_r, self.death_w):
            if fd >= 0:
                os.close(fd)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # ------------------------------------------------------------------ state
    def transition(self, event: Event) -> None:
        new = next_state(self.state, event)
        if new is not self.state:
            log.debug("state", old=self.state.value, new=new.value, cause=event.value)
            self.state = new
            if self.services is not None:
                self.services.on_state(new)

    def live_ranks(self) -> list[RankHandle]:
        return [h for h in self.attempt.ranks.values() if h.alive]

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
        try:
            self._setup()
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
            if outcome.restartable and self.stopping is None and self.restarts < self.spec.max_restarts:
                self._restart_backoff(outcome)
                continue
            if outcome.restartable and self.spec.max_restarts > 0:
                log.error(
                    "crash loop: giving up",
                    restarts=self.restarts,
                    max_restarts=self.spec.max_restarts,
                    last_reason=outcome.reason,
                )
            code = outcome.code
            if self.last_teardown is not None and not self.last_teardown.complete:
                code = EXIT_TEARDOWN
            log.info("supervise exiting", code=code, reason=outcome.reason, restarts=self.restarts)
            self.services.linger(self.spec.metrics_linger, self.hurry)
            return code

    def _restart_backoff(self, outcome: Outcome) -> None:
        uptime = time.monotonic() - self.attempt.started_at
        if uptime >= RESTART_STABLE_S:
            self.restarts = 0
        delay = min(RESTART_BACKOFF_BASE_S * (2**self.restarts), RESTART_BACKOFF_MAX_S)
        self.restarts += 1
        self.services.on_restart()
        log.warning(
            "restarting the group",
            restart=self.restarts,
            max_restarts=self.spec.max_restarts,
            backoff_s=delay,
            after=outcome.reason,
        )
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            try:
                ev = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(ev, SignalReceived):
                self.stopping = ev
                return
            if isinstance(ev, ControlRequest):
                ev.reply.put({"ok": False, "error": "the group is restarting; no rank to dump right now"})
        self.transition(Event.RESTART)

    def _launch(self) -> None:
        assert self.ctx is not None
        self.attempt = Attempt(started_at=time.monotonic())
        self.suspicions = set()
        self.watchdog.reset(self.attempt.started_at)
        extra_env = self.services.rank_env
        if self.spec.tree:
            env = launch.rank_env(self.base_env, self.ctx, None, extra_env(None))
            spec = RankSpec(slot=-1, rank=-1, argv=tuple(self.spec.rank_argv()), env=env)
            handle = launch.spawn(spec, self.ctx)
            self.attempt.launcher = handle
            self.monitor.watch(LAUNCHER_KEY, handle.pid, os.pidfd_open(handle.pid), child=True)
            log.info("launcher started", pid=handle.pid)
            return
        for slot in range(self.spec.nproc_per_node):
            rank = self.spec.rank_offset + slot
            env = launch.rank_env(self.base_env, self.ctx, slot, extra_env(slot))
            spec = RankSpec(slot=slot, rank=rank, argv=tuple(self.spec.rank_argv()), env=env)
            handle = launch.spawn(spec, self.ctx)
            self.attempt.ranks[slot] = handle
            self.monitor.watch(("rank", slot), handle.pid, os.pidfd_open(handle.pid), child=True)
            log.info("rank started", rank=rank, pid=handle.pid)

    def _run_attempt(self) -> Outcome:
        if self.stopping is not None:
            return Outcome(EXIT_OK, "shutdown")
        self._launch()
        while self.attempt.outcome is None:
            ev = self.events.get()
            try:
                self._handle(ev)
            except Exception:
                log.exception("event handling failed", kind=type(ev).__name__)
        outcome = self.attempt.outcome
        self._teardown(immediate=self.hurry.is_set())
        return outcome

    # ------------------------------------------------------------------ events
    def _handle(self, ev: object) -> None:
        if isinstance(ev, ProcessExited):
            self._on_exit(ev)
        elif isinstance(ev, WatchdogVerdict):
            self._on_watchdog(ev)
        elif isinstance(ev, DivergenceFound):
            self._on_divergence(ev)
        elif isinstance(ev, ConsensusAgreed):
            log.info("ranks agree again after the observed divergence", steps=ev.steps)
            self._clear_suspicion("divergence")
        elif isinstance(ev, RankClaimed):
            self._on_claimed(ev)
        elif isinstance(ev, EarlyExitCheck):
            self._on_early_exit_check(ev)
        elif isinstance(ev, SignalReceived):
            self._on_stop_signal(ev)
        elif isinstance(ev, ControlRequest):
            self._on_control(ev)
        else:
            log.debug("ignored event", kind=type(ev).__name__)

    def _finish(self, outcome: Outcome) -> None:
        if self.attempt.outcome is None:
            self.attempt.outcome = outcome

    def _on_stop_signal(self, ev: SignalReceived) -> None:
        name = exits.signal_name(ev.signum)
        if self.stopping is None:
            self.stopping = ev
            log.info("stopping on signal: graceful shutdown of every rank", signal=name, grace_s=self.spec.kill_grace)
            self._finish(Outcome(EXIT_OK, "shutdown"))
        elif ev.signum == signal.SIGINT:
            log.warning("second SIGINT: killing every rank now", signal=name)

    def _rank_for_key(self, key: object) -> RankHandle | None:
        if key == LAUNCHER_KEY:
            return self.attempt.launcher
        if isinstance(key, tuple) and key[0] in ("rank", "tree-rank"):
            return self.attempt.ranks.get(key[1])
        return None

    def _on_exit(self, ev: ProcessExited) -> None:
        handle = self._rank_for_key(ev.key)
        if handle is None or handle.exit is not None or handle.pid != ev.pid:
            return  # unknown, already handled, or a late exit of a previous attempt
        if ev.status is not None and handle.popen is not None:
            handle.popen.returncode = ev.status.returncode  # keep Popen from reaping a reused pid
        peers = [h for h in self.live_ranks() if h is not handle]
        # A rank that declared it was finishing (runtime.finished, or the hook
        # seeing it leave the group) is done, not lost or early, even while
        # its peers still run.
        said_finished = handle.slot >= 0 and self.heartbeat.read(handle.slot).finished
        if ev.status is None:
            info = exits.lost(ev.pid)
            if said_finished:
                info = ExitInfo(None, exits.CLEAN, "finished (its launcher owns the exit status)")
        else:
            info = exits.classify(
                ev.status,
                peers_running=bool(peers) and not said_finished,
                oom_kills_rose=ev.status.signal == signal.SIGKILL and self.oom.rose(),
            )
        handle.exit, handle.exited_at = info, ev.at
        if self.attempt.outcome is not None or self.state is EngineState.TEARING_DOWN:
            # A consequence of the incident being handled (or of our own stop).
            self.services.on_rank_exit(TEARDOWN_EXIT)
            log.debug("rank exited during shutdown", rank=handle.rank, pid=ev.pid, cause=info.description)
            return
        if handle is self.attempt.launcher:
            self._on_launcher_exit(handle, info)
            return
        if info.reason == exits.EARLY_EXIT:
            # Peers of a finishing job exit within moments: check again shortly.
            timer = threading.Timer(EARLY_EXIT_WINDOW_S, self.events.put, args=(EarlyExitCheck(handle.slot),))
            timer.name = f"early-exit-check-{handle.slot}"
            timer.daemon = True
            timer.start()
            return
        self.services.on_rank_exit(info.reason)
        if not info.failed:
            if not self.live_ranks() and self.attempt.launcher is None:
                log.info("every rank finished with exit code 0")
                self._finish(Outcome(EXIT_OK, "clean"))
            return
        self._rank_failed(handle, info)

    def _on_early_exit_check(self, ev: EarlyExitCheck) -> None:
        handle = self.attempt.ranks.get(ev.slot)
        if handle is None or self.attempt.outcome is not None:
            return
        if self.live_ranks():
            self.services.on_rank_exit(exits.EARLY_EXIT)
            self._rank_failed(handle, handle.exit)
            return
        self.services.on_rank_exit(exits.CLEAN)
        if all(h.exit.reason in (exits.CLEAN, exits.EARLY_EXIT) for h in self.attempt.ranks.values()):
            log.info("every rank finished with exit code 0")
            self._finish(Outcome(EXIT_OK, "clean"))

    def _on_launcher_exit(self, handle: RankHandle, info: ExitInfo) -> None:
        self.services.on_rank_exit(info.reason)
        if not info.failed or info.reason == exits.EARLY_EXIT:
            if self.attempt.first_failure is None:
                log.info("launcher finished with exit code 0")
                self._finish(Outcome(EXIT_OK, "clean"))
                return
        self._rank_failed(handle, info)

    def _divergence_was_first(self) -> bool:
        """Before blaming a death or a hang: did the ranks diverge first?

        A rank scheduling a batch of another size makes the next collective
        abort (gloo) or hang (NCCL); the disagreement is the root cause.
        """
        verdicts = self.services.settle_consensus(time.monotonic())
        if not verdicts:
            return False
        self._on_divergence(DivergenceFound(verdicts[0], time.monotonic()))
        return self.attempt.outcome is not None

    def _rank_failed(self, handle: RankHandle, info: ExitInfo) -> None:
        if self._divergence_was_first():
            return
        # The root cause is the earliest failure, which may be a rank whose
        # early exit (code 0) was still inside its grace window.
        handles = list(self.attempt.ranks.values()) + [self.attempt.launcher]
        failed = [h for h in handles if h is not None and h.exit is not None and h.exit.failed]
        first = min(failed, key=lambda h: h.exited_at) if failed else handle
        first_info = first.exit or info
        self.attempt.first_failure = (first, first_info)
        who = "launcher" if first is self.attempt.launcher else f"rank {first.rank}"
        log.error(
            f"{who} (pid {first.pid}) {first_info.description}",
            rank=None if first.rank < 0 else first.rank,
            pid=first.pid,
            **first_info.to_dict(),
        )
        self.transition(Event.RANK_EXIT)
        self.desk.rank_exit(first, first_info)
        self._finish(Outcome(EXIT_RANK, "rank_exit", culprit=first.rank))

    def _on_claimed(self, ev: RankClaimed) -> None:
        """Tree mode: a process of the launcher's tree joined the group."""
        existing = self.attempt.ranks.get(ev.slot)
        if existing is not None and existing.pid == ev.pid:
            return
        spec = RankSpec(slot=ev.slot, rank=ev.rank, argv=(), env={})
        handle = RankHandle(spec=spec, pid=ev.pid, started_at=time.monotonic())
        self.attempt.ranks[ev.slot] = handle
        log.info("rank joined the group", rank=ev.rank, pid=ev.pid)
        self.monitor.watch(("tree-rank", ev.slot), ev.pid, child=False)

    def _on_watchdog(self, ev: WatchdogVerdict) -> None:
        if self.attempt.outcome is not None:
            return
        kind = ev.kind
        if kind == "all_ready":
            self.transition(Event.ALL_READY)
            self.services.on_ready()
        elif kind == "soft":
            self.suspicions.add("hang")
            self.transition(Event.SOFT_HANG)
            self.services.on_hang("soft")
            log.warning("hang suspected: " + ev.message, stalled_s=round(ev.stalled_s, 2), **ev.log_fields)
            self.desk.soft_hang(ev)
        elif kind == "recovered":
            log.info("progress resumed", stalled_s=round(ev.stalled_s, 2))
            self._clear_suspicion("hang")
        elif kind == "hard":
            if self._divergence_was_first():
                return
            self.transition(Event.HARD_HANG)
            self.services.on_hang("hard")
            log.error("hang: " + ev.message, stalled_s=round(ev.stalled_s, 2), **ev.log_fields)
            culprits = self.desk.hard_hang(ev)
            self._finish(Outcome(EXIT_HANG, "hang", culprit=culprits[0] if culprits else None))
        elif kind == "startup_timeout":
            self.transition(Event.STARTUP_TIMEOUT)
            log.error("startup timeout: " + ev.message, startup_timeout_s=self.spec.startup_timeout)
            self.desk.startup_timeout(ev)
            self._finish(Outcome(EXIT_STARTUP, "startup_timeout"))

    def _on_divergence(self, ev: DivergenceFound) -> None:
        if self.attempt.outcome is not None:
            return
        enforce = self.spec.consensus == "enforce"
        if not enforce:
            self.suspicions.add("divergence")
        self.transition(Event.DIVERGENCE_ENFORCED if enforce else Event.DIVERGENCE_OBSERVED)
        self.services.on_divergence()
        log.error("divergence: " + ev.verdict.verdict, step=ev.verdict.step, culprit_ranks=ev.verdict.culprit_ranks)
        self.desk.divergence(ev, blocking=enforce)
        if enforce:
            culprit = ev.verdict.culprit_ranks[0] if ev.verdict.culprit_ranks else None
            self._finish(Outcome(EXIT_DIVERGENCE, "divergence", culprit=culprit))

    def _clear_suspicion(self, reason: str) -> None:
        """/readyz stays 503 while any suspicion (soft hang, observed
        divergence) is open; each clears on its own evidence."""
        self.suspicions.discard(reason)
        if not self.suspicions:
            self.transition(Event.PROGRESS)

    def _on_control(self, ev: ControlRequest) -> None:
        if ev.request.get("cmd") != "dump":
            ev.reply.put({"ok": False, "error": f"unknown command {ev.request.get('cmd')!r}"})
            return
        self.desk.on_demand(ev.reply)

    # ------------------------------------------------------------------ teardown
    def _teardown(self, immediate: bool) -> None:
        self.transition(Event.TEARDOWN)
        handles = list(self.attempt.ranks.values())
        if self.attempt.launcher is not None:
            handles.append(self.attempt.launcher)
        kind = "tree-rank" if self.spec.tree else "rank"  # the keys _launch/_on_claimed watch under
        keys = {(kind, h.slot) for h in self.attempt.ranks.values()} | {LAUNCHER_KEY}
        policy = KillPolicy(grace_s=self.spec.kill_grace, immediate=immediate, hurry=self.hurry)
        result = teardown(
            handles,
            self.run_id,
            policy,
            wait_ranks_reaped=lambda deadline: self.monitor.wait_all_exited(keys, deadline),
            gpu_holders=self.services.gpu_holders if self.services.gpu.available else None,
        )
        self.last_teardown = result
        if self.hurry.is_set() and not immediate:
            log.warning("second SIGINT: grace period cut short, remaining processes were killed")
        self.services.on_teardown(result)
        self.desk.wait_idle()
        fields = {
            "duration_s": round(result.duration_s, 3),
            "escalated": result.escalated,
            "gpu_memory_verified": result.gpu_checked,
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
