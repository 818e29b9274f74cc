"""The incident desk: turns the main loop's decisions into bundles.

It decides nothing; it knows *how* to ask ``dumps/`` for a bundle of the
right reason with the supervisor's own knowledge (the first failure, the
watchdog verdict, the consensus verdict) added to the evidence.

Nothing it does can hold a teardown back (docs/contracts.md, "Process tree": every dump has a
deadline).  Every bundle is made off the main thread:

* **fatal** incidents (rank exit, hard hang, startup timeout, enforced
  divergence, a straggler that ends the attempt) each get their own
  ``dump-<reason>`` thread, under the incident id the main thread announced.  The main thread
  waits for the *capture* (stacks must be taken while the ranks exist) at
  most ``--dump-timeout`` (less when a second stop signal comes), then
  tears down anyway.  The write (bundle, retention walk) finishes on that
  thread, during or after the teardown; a bundle whose capture was cut
  short says so in ``summary.json``'s ``incomplete`` (why, and which files
  lack what).  A hard hang and an enforced divergence freeze every rank
  first (``dumps.freeze``): one consistent snapshot, no rank racing to abort.
* **soft** ones (hang suspected, divergence observed, on demand) go to the
  ``dumper`` thread, in order, and never stop a rank.

Multi-node (``link_nodes``): once a fatal bundle is written, its dump thread shares it with the
other nodes' bundles of the same incident (``incident_exchange``: a summary to the store, the
originating node's merge), within the same deadline, before the job counts as done.

``settle()`` (after the teardown) waits for every dump in flight until its
deadline, ``--dump-timeout`` after it started (at least ``SETTLE_MIN_S``
more), and reports those that could not finish (a dump directory that
blocks): the supervisor exits anyway.  All dump threads are daemons, so a
write stuck in the kernel never keeps the process alive.

The desk holds only the run's fixed facts (spec, run id, run dir), a
heartbeat reader, the GPU sampler's cache (never NVML itself), ``hurry``
and ``on_dump`` (metrics); what changes (the attempt's ranks, its restart
count, the first failure) comes with each call from the main thread, as an
immutable ``AttemptView``, so a dump thread reads nothing the main thread
mutates.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from tp_supervise.dumps.bundle import BundleWriter
from tp_supervise.dumps.capture import RankTarget
from tp_supervise.dumps.incident import IncidentResult, capture_incident, write_captured, write_incident
from tp_supervise.dumps.procinfo import process_comm
from tp_supervise.watchdogs.gpu import gpus_busy_without_progress

from ..outcome import new_incident_id
from ..processes import output_pump as output
from ..processes.exits import ExitInfo
from ..processes.pidfds import helpers_below, named_thread
from ..processes.spawn import RANK_PACKAGE_DIR, error_file
from ..rank.engines import role_from_title, role_words
from . import hook_fault
from .error_file import last_traceback, read_error_file
from .exchange import IncidentExchange

if TYPE_CHECKING:
    from tp_supervise.dumps.evidence import CpuSamples
    from tp_supervise.watchdogs.gpu import GpuSampler

    from ..events import DivergenceFound, StragglerNamed, WatchdogVerdict
    from ..nodes.handshake import NodeGroup
    from ..processes.attempt import AttemptView, RankView
    from ..rank.heartbeat import SlotSnapshot
    from ..signals import Hurry
    from ..spec import LaunchSpec

log = structlog.get_logger("supervise.incident")

# Stack capture budget when a rank died: the bundle must not delay the
# teardown much (exit within --kill-grace + 1 s of the death).
RANK_EXIT_CAPTURE_S = 0.8
HANG_CAPTURE_S = 3.0
# After the teardown, a dump still writing gets at least this long (its
# capture may have used the whole --dump-timeout).
SETTLE_MIN_S = 1.0
# The main thread checks a second stop signal this often while it waits for a capture.
WAIT_SLICE_S = 0.02
SOFT_WORKER_JOIN_S = 0.5
# A dead rank's last stderr: the dump thread waits at most this long for the pump to reach its EOF.
STDERR_DRAIN_S = 0.5
# A fatal capture waits for a soft dump's capture still running (its py-spy attached to the ranks) this share
# of its own budget at most.
EARLIER_CAPTURE_WAIT_SHARE = 0.4
# The processes of a launcher's tree nobody holds that a bundle captures beside the ranks and the control plane.
MAX_HELPERS = 8


def _wall_clock(monotonic_at: float | None) -> datetime:
    now = datetime.now(timezone.utc)
    if monotonic_at is None:
        return now
    return now - timedelta(seconds=max(0.0, time.monotonic() - monotonic_at))


class DumpJob:
    """One bundle in the making; the main thread waits on its events, with deadlines."""

    def __init__(self, reason: str, timeout_s: float):
        self.reason = reason
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.captured = threading.Event()  # the ranks are no longer needed
        self.done = threading.Event()  # the bundle was written, or failed
        self.culprits: list[int] = []
        self.result: IncidentResult | None = None
        self._lock = threading.Lock()
        self._abandoned = False  # the teardown started before the capture ended
        self._reported = False  # on_dump was called for it

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True

    @property
    def abandoned(self) -> bool:
        with self._lock:
            return self._abandoned

    def claim_report(self) -> bool:
        """True once: whoever reports the dump's result (metrics) first."""
        with self._lock:
            first, self._reported = not self._reported, True
            return first


class _SoftWorker:
    """The ``dumper`` thread: soft dumps in order; a daemon, so a stuck write never blocks the exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = named_thread(self._run, "dumper")
        self._started = False

    def submit(self, work: Callable[[], None]) -> None:
        if not self._started:
            self._started = True
            self._thread.start()
        self._jobs.put(work)

    def stop(self, join_s: float) -> None:
        if self._started:
            self._jobs.put(None)
            self._thread.join(join_s)

    def _run(self) -> None:
        while True:
            work = self._jobs.get()
            if work is None:
                return
            try:
                work()
            except Exception:  # a dump never kills the worker
                log.exception("soft dump failed")


class IncidentDesk:
    def __init__(
        self,
        spec: LaunchSpec,
        run_id: str,
        run_dir: Path,
        read_heartbeats: Callable[[], list[SlotSnapshot]],
        on_dump: Callable[[str, bool, float], None],
        gpu: GpuSampler,
        hurry: Hurry,
        read_control: Callable[[], list[SlotSnapshot]] | None = None,
    ):
        """``on_dump(reason, ok, duration_s)``: called once per bundle, on the thread that
        wrote it (or on the main thread, ok=False, when it could not finish in time).
        ``hurry``: set by a second stop signal; no wait here outlives it.  ``read_control``: the control
        plane's slots (an engine's scheduler and front end)."""
        self.spec = spec
        self.run_id = run_id
        self.run_dir = run_dir
        self.read_heartbeats = read_heartbeats
        self.read_control = read_control
        self.on_dump = on_dump
        self.gpu = gpu
        self.hurry = hurry
        self.writer = BundleWriter(spec.dumps.dir, keep=spec.dumps.keep, max_bytes=spec.dumps.max_bytes)
        self.soft = _SoftWorker()
        self.jobs: list[DumpJob] = []  # in flight; main thread only
        self.previous_cpu: CpuSamples | None = None  # the last capture's CPU samples, handed to the next one
        self.exchange: IncidentExchange | None = None  # multi-node: fatal bundles are shared through the store
        # The requests an incident caught in flight (incidents/quarantine.py): incident id -> summary fields.
        self.requests_of: Callable[[str], dict] = lambda _incident_id: {}

    def link_nodes(self, group: NodeGroup) -> None:
        """Multi-node (main thread, before any rank starts): every fatal bundle's node summary goes to the
        other nodes through the supervisors' store, and the originating node merges theirs."""
        self.exchange = IncidentExchange(group, self.hurry) if group.nnodes > 1 else None

    def close(self) -> None:
        self.soft.stop(SOFT_WORKER_JOIN_S)

    def settle(self) -> None:
        """After the teardown: let the dumps in flight finish, each until its
        deadline (at least ``SETTLE_MIN_S`` from now); report those that could not."""
        floor = time.monotonic() + SETTLE_MIN_S
        for job in self.jobs:
            deadline = max(job.deadline, floor)
            while not job.done.is_set() and not self.hurry.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                job.done.wait(min(left, WAIT_SLICE_S))
            if job.done.is_set():
                continue
            waited = time.monotonic() - job.started
            log.error(
                "incident bundle not written within --dump-timeout; exiting without it "
                "(is the dump directory blocked?)",
                reason=job.reason,
                dump_dir=str(self.spec.dumps.dir),
                dump_timeout_s=self.spec.dumps.timeout,
                waited_s=round(waited, 3),
                captured=job.captured.is_set(),
            )
            if job.claim_report():
                self.on_dump(job.reason, False, waited)
        self.jobs = []

    # -------------------------------------------------------------- evidence
    def targets(self, attempt: AttemptView) -> list[RankTarget]:
        """The ranks as the main thread knew them at the decision, with their
        heartbeat slots as they read now."""
        snaps = {s.slot: s for s in self.read_heartbeats()}
        out = []
        for slot, r in sorted(attempt.ranks.items()):
            out.append(
                RankTarget(
                    rank=r.rank,
                    slot=slot,
                    pid=r.pid,
                    alive=r.alive,
                    exit=None if r.exit is None else dict(r.exit.to_dict(), at=r.exited_at),
                    heartbeat=snaps.get(slot),
                    title=r.title,
                )
            )
        if self.spec.tree and not out:
            for slot, snap in snaps.items():
                if snap.claimed:
                    out.append(RankTarget(snap.rank, slot, snap.pid, True, None, snap))
        return out + self.process_targets(attempt)

    def process_targets(self, attempt: AttemptView) -> list[RankTarget]:
        """Tree mode: every process of the run that is not a rank (the launcher, the engine's scheduler and
        front end), each under a negative key of the capture, with its control slot when it claimed one."""
        control = {}
        if self.read_control is not None:
            control = {s.pid: s for s in self.read_control() if s.claimed}
        out = []
        plane = attempt.control_plane()
        for i, view in enumerate(plane):
            out.append(
                RankTarget(
                    rank=-1 - i,
                    slot=view.slot,
                    pid=view.pid,
                    alive=view.alive,
                    exit=None if view.exit is None else dict(view.exit.to_dict(), at=view.exited_at),
                    heartbeat=control.get(view.pid),
                    title=view.title,
                    role=view.role,
                    words=view.who,  # "vLLM's engine core", else "the scheduler": the process's one phrase
                )
            )
        launcher = attempt.launcher
        if self.spec.tree and launcher is not None and launcher.alive:
            # The rest of the launcher's tree (vLLM's resource tracker, SGLang's detokenizer), not what runs
            # under a rank: role helper, or what the title says.
            for pid in helpers_below(launcher.pid, attempt.pids(), MAX_HELPERS):
                title = process_comm(pid)  # not the command line: reading it takes the process's mmap lock
                role = role_from_title(title)
                role = role if role not in ("", "rank") else "helper"
                out.append(RankTarget(-1 - len(out), -1, pid, True, None, None, title, role, role_words(role, title)))
        return out

    def _with_incident_id(self, extra: dict, incident_id: str | None) -> dict:
        """Every bundle names its incident: the id the main thread announced for it (to the other nodes, to
        the quarantine), given with the call that asks for the bundle; a fresh one when nobody was told."""
        return dict(extra, incident_id=incident_id or new_incident_id(self.run_id))

    def _base_summary(self, attempt: AttemptView) -> dict:
        spec = self.spec
        return {
            "run_id": self.run_id,
            "mode": "tree" if spec.tree else "spawn",
            "world_size": spec.world_size,
            "node_rank": spec.node_rank,
            "restarts": attempt.restarts,
            "attempt": attempt.number,
            "command": spec.rank_argv(),
        }

    def _report(self, job: DumpJob, result: IncidentResult, extra_summary: dict) -> None:
        job.result = result
        late = not job.claim_report()  # settle() already counted it as not written in time
        if not late:
            self.on_dump(job.reason, result.ok, result.duration_s)
        diag = result.diagnosis
        # Log what the bundle says: the supervisor's own verdict (first
        # failure, consensus) wins over the stack-based diagnosis.
        log.warning(
            "incident bundle written" if result.path else "incident bundle FAILED",
            reason=job.reason,
            bundle=str(result.path) if result.path else None,
            culprit_ranks=extra_summary.get("culprit_ranks", getattr(diag, "culprit_ranks", None)),
            culprit=extra_summary.get("culprit", getattr(diag, "culprit", None)),
            verdict=extra_summary.get("verdict", getattr(diag, "verdict", None)),
            duration_s=round(result.duration_s, 3),
            error=result.error,
            **({"late": True} if late else {}),
        )

    def _make(
        self,
        job: DumpJob,
        attempt: AttemptView,
        capture_s: float,
        extra_summary: dict,
        extra_files: dict | None,
        detected_at: float,
        freeze: bool,
        late: Callable[[], tuple[dict, dict]] | None = None,
        earlier: list[threading.Event] | None = None,
    ) -> None:
        """Capture (then ``job.captured``), write (then ``job.done``); on a dump thread, never raises.

        ``late()``: evidence taken after the capture, during the teardown (a dead rank's last stderr),
        as (summary fields, files).  ``earlier``: captures still running (a soft dump's) that this one waits
        for, at most ``EARLIER_CAPTURE_WAIT_SHARE`` of its budget."""
        if earlier:
            until = time.monotonic() + capture_s * EARLIER_CAPTURE_WAIT_SHARE
            for soft in earlier:
                soft.wait(max(0.0, until - time.monotonic()))
            capture_s = max(0.0, capture_s - (time.monotonic() - job.started))
        reason = job.reason
        summary = dict(self._base_summary(attempt), **extra_summary)
        try:
            targets = self.targets(attempt)
            captured = capture_incident(
                targets,
                reason=reason,
                run_dir=self.run_dir,
                method=self.spec.dumps.stack_method,
                native=self.spec.dumps.native_stacks,
                deadline_s=capture_s,
                previous_cpu=self.previous_cpu,
                freeze=freeze and not job.abandoned,  # never stop ranks the teardown is already ending
            )
            self.previous_cpu = captured.samples or self.previous_cpu
            job.culprits = list(getattr(captured.diagnosis, "culprit_ranks", []) or [])
        except Exception:  # capture_incident never raises; the heartbeat read or a bug might
            log.exception("incident capture failed", reason=reason)
            if job.claim_report():
                self.on_dump(reason, False, time.monotonic() - job.started)
            job.captured.set()
            job.done.set()
            return
        job.captured.set()
        try:
            if late is not None:
                late_summary, late_files = late()
                extra_summary = dict(extra_summary, **late_summary)
                summary.update(late_summary)
                extra_files = dict(extra_files or {}, **late_files)
            incomplete = None
            if job.abandoned:
                incomplete = {
                    "why": (
                        f"the capture took {captured.duration_s:.2f} s, longer than --dump-timeout "
                        f"{self.spec.dumps.timeout:g} s: the teardown started without waiting for it"
                    ),
                    "dump_timeout_s": self.spec.dumps.timeout,
                }
            result = write_captured(
                self.writer,
                captured,
                reason=reason,
                run_id=self.run_id,
                native=self.spec.dumps.native_stacks,
                extra_summary=summary,
                extra_files=extra_files or {},
                detected_at=_wall_clock(detected_at),
                incomplete=incomplete,
            )
            self._report(job, result, extra_summary)
            self._exchange(job, result.path, extra_summary, targets)
        except Exception:
            log.exception("incident bundle failed", reason=reason)
        finally:
            job.done.set()

    def _exchange(self, job: DumpJob, bundle: Path | None, extra: dict, targets: list[RankTarget]) -> None:
        """Multi-node, on the dump thread, within the dump's deadline: this node's bundle of the incident
        meets the other nodes' (``incident_exchange``).  A lost node publishes nothing: it cannot merge."""
        if self.exchange is None or bundle is None or job.reason == "node_lost":
            return
        origin = extra.get("culprit_node") if job.reason == "peer_failed" else self.spec.node_rank
        if isinstance(origin, int):
            self.exchange.share(bundle, job.deadline, origin, [t for t in targets if t.is_rank])

    def _fatal(
        self,
        reason: str,
        attempt: AttemptView,
        capture_s: float,
        extra: dict,
        incident_id: str | None,
        files: dict | None = None,
        detected_at: float | None = None,
        freeze: bool = False,
        late: Callable[[], tuple[dict, dict]] | None = None,
    ) -> DumpJob:
        """Start a fatal dump on its own thread; return once its capture ended, or
        after ``--dump-timeout`` (or a second stop signal) without it."""
        extra = self._with_incident_id(extra, incident_id)
        extra = dict(self.requests_of(extra["incident_id"]), **extra)
        detected_at = time.monotonic() if detected_at is None else detected_at
        timeout = self.spec.dumps.timeout
        job = DumpJob(reason, timeout)
        # The capture gets at most the dump timeout, its own share of which leaves room for the verdict.
        capture_s = min(capture_s, timeout)
        # A soft dump still capturing has its py-spy attached to the ranks (state t): the fatal capture waits
        # for it a little, or its freeze would read a rank traced by our own py-spy as held by a debugger.
        earlier = [j.captured for j in self.jobs if not j.captured.is_set()]
        thread = threading.Thread(
            target=self._make,
            args=(job, attempt, capture_s, extra, files, detected_at, freeze, late, earlier),
            name=f"dump-{reason}",
            daemon=True,
        )
        self.jobs.append(job)
        thread.start()
        while not job.captured.is_set() and not self.hurry.is_set():
            left = job.deadline - time.monotonic()
            if left <= 0:
                break
            job.captured.wait(min(left, WAIT_SLICE_S))
        if not job.captured.is_set():
            job.abandon()
            log.error(
                "incident capture did not finish in time: tearing down without it",
                reason=reason,
                dump_timeout_s=timeout,
                waited_s=round(time.monotonic() - job.started, 3),
                second_stop_signal=self.hurry.is_set(),
            )
        return job

    def _async(
        self,
        reason: str,
        attempt: AttemptView,
        capture_s: float,
        extra: dict,
        reply: queue.SimpleQueue | None = None,
        files: dict | None = None,
        detected_at: float | None = None,
    ) -> None:
        detected_at = time.monotonic() if detected_at is None else detected_at
        job = DumpJob(reason, self.spec.dumps.timeout)
        summary = dict(self._base_summary(attempt), **self._with_incident_id(extra, None))  # never announced

        def work() -> None:
            try:
                result = write_incident(
                    self.writer,
                    reason=reason,
                    run_id=self.run_id,
                    targets=self.targets(attempt),
                    run_dir=self.run_dir,
                    method=self.spec.dumps.stack_method,
                    native=self.spec.dumps.native_stacks,
                    deadline_s=capture_s,
                    extra_summary=summary,
                    extra_files=files or {},
                    previous_cpu=self.previous_cpu,
                    detected_at=_wall_clock(detected_at),
                )
                self.previous_cpu = result.samples or self.previous_cpu
                self._report(job, result, extra)
                if reply is not None:
                    reply.put({"ok": result.path is not None, "bundle": str(result.path) if result.path else None})
            except Exception as exc:
                log.exception("dump failed", reason=reason)
                if reply is not None:
                    reply.put({"ok": False, "error": repr(exc)})
            finally:
                job.captured.set()
                job.done.set()

        self.jobs = [j for j in self.jobs if not j.done.is_set()]
        self.jobs.append(job)
        self.soft.submit(work)

    # -------------------------------------------------------------- incidents
    def rank_exit(self, first: RankView, info: ExitInfo, attempt: AttemptView, incident_id: str | None = None) -> None:
        """``first``: the root cause (``attempt.launcher`` or one of ``attempt.ranks``); ``incident_id``, here and
        in every fatal incident below: the id the main thread announced (none given: a fresh one)."""
        who = first.who
        others = [r.rank for r in attempt.live_ranks() if r.slot != first.slot]
        verdict = f"{first.describe(who)} {info.description}"
        if others:
            peers = f"rank {others[0]} was" if len(others) == 1 else f"ranks {','.join(map(str, others))} were"
            verdict += f"; {peers} still running and torn down as a consequence"
        extra = {
            "culprit_ranks": [first.rank] if first.rank >= 0 else [],
            # whatever the capture finds dead or gone after it, the process that ended first is the culprit
            "culprit": {
                "role": first.role,
                "pid": first.pid,
                "title": first.title,
                "rank": first.rank if first.rank >= 0 else None,
            },
            "verdict": verdict,
            "first_failure": {
                "rank": first.rank,
                "role": first.role,
                "pid": first.pid,
                "title": first.title,
                **info.to_dict(),
            },
        }
        files = {}
        error = read_error_file(error_file(self.run_dir, first.rank)) if first.rank >= 0 else None
        if error is not None:
            raw, message, traceback_text = error
            files[f"logs/rank-{first.rank}.error.json"] = raw
            extra["error"] = {"message": message, "traceback": traceback_text, "source": "error_file"}
            if message:
                verdict = f"{verdict}: {message}"
                extra["verdict"] = verdict
        late = self._stderr_evidence(first, verdict, with_error=error is None)
        self._fatal(
            "rank_exit",
            attempt,
            RANK_EXIT_CAPTURE_S,
            extra,
            incident_id,
            files or None,
            detected_at=first.exited_at,
            late=late,
        )

    def _stderr_evidence(self, first: RankView, verdict: str, with_error: bool):
        """The failing process's last stderr (``logs/rank-<r>.txt``), read on the dump thread once the
        pump drained its pipe (at most ``STDERR_DRAIN_S``); without an ``@record`` error, its last Python
        traceback becomes the bundle's ``error`` and the verdict quotes the exception line.  In tree mode a
        rank's output is the launcher's: its tail is the evidence."""
        pump = output.installed()
        rank = None if first.is_launcher or self.spec.tree else first.rank
        tail = pump.stderr_tail(rank) if pump is not None else None
        if tail is None:
            return None
        name = "launcher" if rank is None else f"rank-{rank}"

        def late() -> tuple[dict, dict]:
            tail.wait_drained(STDERR_DRAIN_S)
            data = tail.data()
            if not data:
                return {}, {}
            files = {f"logs/{name}.txt": data}
            text = data.decode("utf-8", "replace")
            ours = hook_fault.find(text, RANK_PACKAGE_DIR)
            if ours is not None:  # our code raised, not the engine's: say so before anything the engine said
                return {
                    "hook_fault": ours.to_dict(),
                    "error": {"message": ours.exception, "traceback": ours.traceback, "source": "stderr"},
                    "verdict": f"{verdict}: {ours.words()}",
                }, files
            found = last_traceback(text) if with_error else None
            if found is None:
                return {}, files
            message, traceback_text = found
            return {
                "error": {"message": message, "traceback": traceback_text, "source": "stderr"},
                "verdict": f"{verdict}: {message}",
            }, files

        return late

    def _watchdog_extra(self, ev: WatchdogVerdict) -> dict:
        v = ev.verdict
        extra = {"watchdog": v.to_dict(), "stalled_s": round(ev.stalled_s, 3)}
        reading = self.gpu.latest()  # the sampler's cache: NVML is never called here
        if reading is not None:
            extra["gpu"] = {
                "samples": [s.to_dict() for s in reading.samples],
                "sampled_s_ago": round(reading.age_s(time.monotonic()), 3),
                # The signature of a hang that looks like work (spin-waiting kernels).
                "busy_without_progress": gpus_busy_without_progress(reading.samples, v),
            }
        return extra

    def soft_hang(self, ev: WatchdogVerdict, attempt: AttemptView) -> None:
        self._async("hang_suspected", attempt, HANG_CAPTURE_S, self._watchdog_extra(ev), detected_at=ev.at)

    def hard_hang(self, ev: WatchdogVerdict, attempt: AttemptView, incident_id: str | None = None) -> list[int]:
        """Freeze, capture (bounded by --dump-timeout), return the diagnosis' culprits (none if cut short)."""
        extra = self._watchdog_extra(ev)
        job = self._fatal("hang", attempt, HANG_CAPTURE_S, extra, incident_id, detected_at=ev.at, freeze=True)
        return list(job.culprits) if job.captured.is_set() else []

    def startup_timeout(self, ev: WatchdogVerdict, attempt: AttemptView, incident_id: str | None = None) -> None:
        extra = self._watchdog_extra(ev)
        pending = list(ev.verdict.pending_ranks)
        extra["culprit_ranks"] = pending
        extra["verdict"] = (
            f"rank{'s' if len(pending) > 1 else ''} {','.join(map(str, pending))} did not become ready within "
            f"--startup-timeout {self.spec.watchdog.startup_timeout:g} s: {ev.message}"
        )
        self._fatal("startup_timeout", attempt, HANG_CAPTURE_S, extra, incident_id, detected_at=ev.at)

    def divergence(
        self, ev: DivergenceFound, attempt: AttemptView, blocking: bool, incident_id: str | None = None
    ) -> None:
        """``blocking`` (enforce): fatal, the ranks frozen first; else a soft dump."""
        v = ev.verdict
        extra = {"culprit_ranks": list(v.culprit_ranks), "verdict": v.verdict, "divergence": v.to_dict()}
        files = v.bundle_files()
        if blocking:
            self._fatal(
                "divergence", attempt, HANG_CAPTURE_S, extra, incident_id, files, detected_at=ev.at, freeze=True
            )
        else:
            self._async("divergence", attempt, HANG_CAPTURE_S, extra, files=files, detected_at=ev.at)

    def straggler(self, ev: StragglerNamed, attempt: AttemptView, verdict: str, incident_id: str | None = None) -> None:
        """A straggler episode started: one bundle (reason ``straggler``), every rank's stacks (the slow one's
        and its peers', who wait for it), the detector's window and the /proc evidence.  Without
        ``incident_id`` nothing stops (a soft dump); with it, the straggler ends the attempt
        (``--on-straggler restart|kill``, announced under that id): fatal, captured before the teardown."""
        extra = {
            "culprit_ranks": [ev.event.rank],
            "verdict": verdict,
            "straggler": {"event": ev.event.to_dict(), "report": ev.report.to_dict(), "evidence": ev.evidence},
        }
        if incident_id is None:
            self._async("straggler", attempt, HANG_CAPTURE_S, extra, detected_at=ev.event.at)
        else:
            self._fatal("straggler", attempt, HANG_CAPTURE_S, extra, incident_id, detected_at=ev.event.at)

    def on_demand(self, reply: queue.SimpleQueue, attempt: AttemptView) -> None:
        self._async("on_demand", attempt, HANG_CAPTURE_S, {}, reply)

    def peer_incident(self, reason: str, extra: dict, attempt: AttemptView, incident_id: str) -> None:
        """Multi-node: another node failed or was lost (``peer_failed``, ``node_lost``): this node's
        evidence of the same incident (the other node's id), captured before its own teardown (fatal, bounded)."""
        self._fatal(reason, attempt, HANG_CAPTURE_S, extra, incident_id)
