"""The incident desk: turns the main loop's decisions into bundles.

It decides nothing; it knows *how* to ask ``dumps/`` for a bundle of the
right reason with the supervisor's own knowledge (the first failure, the
watchdog verdict, the consensus verdict) added to the evidence.  Incidents
that end the run are written synchronously, before the teardown changes the
evidence; soft ones (hang suspected, divergence observed, on demand) on the
``dumper`` thread, so the main loop keeps reacting.

The desk holds only the run's fixed facts (spec, run id, run dir), a
heartbeat reader, the GPU sampler and ``on_dump`` (metrics); what changes
(the attempt's ranks, its restart count, the first failure) comes with each
call from the main thread, as an immutable ``AttemptView``, so a dump on the
worker thread reads nothing the main thread mutates.
"""

from __future__ import annotations

import queue
import time
from datetime import datetime, timedelta, timezone
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import structlog

from tp_supervise.dumps.bundle import BundleWriter
from tp_supervise.dumps.capture import RankTarget
from tp_supervise.dumps.incident import write_incident
from .exits import ExitInfo
from tp_supervise.watchdogs.gpu import gpus_busy_without_progress

if TYPE_CHECKING:
    from tp_supervise.watchdogs.gpu import GpuTelemetry

    from .attempt import AttemptView, RankView
    from .rank.heartbeat import SlotSnapshot
    from .spec import LaunchSpec
    from .watch import DivergenceFound, WatchdogVerdict

log = structlog.get_logger("supervise.incident")

# Stack capture budget when a rank died: the bundle must not delay the
# teardown much (exit within --kill-grace + 1 s of the death).
RANK_EXIT_CAPTURE_S = 0.8
HANG_CAPTURE_S = 3.0


def _wall_clock(monotonic_at: float | None) -> datetime:
    now = datetime.now(timezone.utc)
    if monotonic_at is None:
        return now
    return now - timedelta(seconds=max(0.0, time.monotonic() - monotonic_at))


class IncidentDesk:
    def __init__(
        self,
        spec: "LaunchSpec",
        run_id: str,
        run_dir: Path,
        read_heartbeats: Callable[[], "list[SlotSnapshot]"],
        on_dump: Callable[[str, bool, float], None],
        gpu: "GpuTelemetry",
    ):
        """``on_dump(reason, ok, duration_s)``: called for every bundle, on the thread that wrote it."""
        self.spec = spec
        self.run_id = run_id
        self.run_dir = run_dir
        self.read_heartbeats = read_heartbeats
        self.on_dump = on_dump
        self.gpu = gpu
        self.writer = BundleWriter(spec.dump_dir, keep=spec.dump_keep, max_bytes=spec.dump_max_bytes)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dumper")
        self.pending: list[Future] = []
        self.previous_cpu = None

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def wait_idle(self, timeout_s: float = HANG_CAPTURE_S * 2) -> None:
        deadline = time.monotonic() + timeout_s
        for fut in self.pending:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
        self.pending = []

    # -------------------------------------------------------------- evidence
    def targets(self, attempt: "AttemptView") -> list[RankTarget]:
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
                )
            )
        if self.spec.tree and not out:
            for slot, snap in snaps.items():
                if snap.claimed:
                    out.append(RankTarget(snap.rank, slot, snap.pid, True, None, snap))
        return out

    def _base_summary(self, attempt: "AttemptView") -> dict:
        spec = self.spec
        return {
            "run_id": self.run_id,
            "mode": "tree" if spec.tree else "spawn",
            "world_size": spec.world_size,
            "node_rank": spec.node_rank,
            "restarts": attempt.restarts,
            "command": spec.rank_argv(),
        }

    def _write(
        self,
        reason: str,
        attempt: "AttemptView",
        deadline_s: float,
        extra_summary: dict,
        extra_files: dict | None = None,
        detected_at: float | None = None,
    ):
        """``detected_at``: monotonic time the fault was detected (default: now)."""
        summary = dict(self._base_summary(attempt), **extra_summary)
        result = write_incident(
            self.writer,
            reason=reason,
            run_id=self.run_id,
            targets=self.targets(attempt),
            run_dir=self.run_dir,
            method=self.spec.stack_method,
            native=self.spec.native_stacks,
            deadline_s=deadline_s,
            extra_summary=summary,
            extra_files=extra_files or {},
            previous_cpu=self.previous_cpu,
            detected_at=_wall_clock(detected_at),
        )
        self.previous_cpu = result.samples or self.previous_cpu
        self.on_dump(reason, result.ok, result.duration_s)
        diag = result.diagnosis
        # Log what the bundle says: the supervisor's own verdict (first
        # failure, consensus) wins over the stack-based diagnosis.
        log.warning(
            "incident bundle written" if result.path else "incident bundle FAILED",
            reason=reason,
            bundle=str(result.path) if result.path else None,
            culprit_ranks=extra_summary.get("culprit_ranks", getattr(diag, "culprit_ranks", None)),
            verdict=extra_summary.get("verdict", getattr(diag, "verdict", None)),
            duration_s=round(result.duration_s, 3),
            error=result.error,
        )
        return result

    def _async(
        self,
        reason: str,
        attempt: "AttemptView",
        deadline_s: float,
        extra: dict,
        reply: "queue.SimpleQueue | None" = None,
        files: dict | None = None,
        detected_at: float | None = None,
    ) -> None:
        detected_at = time.monotonic() if detected_at is None else detected_at

        def job():
            try:
                result = self._write(reason, attempt, deadline_s, extra, files, detected_at)
                if reply is not None:
                    reply.put({"ok": result.path is not None, "bundle": str(result.path) if result.path else None})
            except Exception as exc:
                log.exception("dump failed", reason=reason)
                if reply is not None:
                    reply.put({"ok": False, "error": repr(exc)})

        self.pending = [f for f in self.pending if not f.done()]
        self.pending.append(self.pool.submit(job))

    # -------------------------------------------------------------- incidents
    def rank_exit(self, first: "RankView", info: ExitInfo, attempt: "AttemptView") -> None:
        """``first``: the root cause (``attempt.launcher`` or one of ``attempt.ranks``)."""
        who = "the launcher" if first.is_launcher else f"rank {first.rank}"
        others = [r.rank for r in attempt.live_ranks() if r.slot != first.slot]
        verdict = f"{who} (pid {first.pid}) {info.description}"
        if others:
            peers = f"rank {others[0]} was" if len(others) == 1 else f"ranks {','.join(map(str, others))} were"
            verdict += f"; {peers} still running and torn down as a consequence"
        extra = {
            "culprit_ranks": [first.rank] if first.rank >= 0 else [],
            "verdict": verdict,
            "first_failure": {"rank": first.rank, "pid": first.pid, **info.to_dict()},
        }
        self._write("rank_exit", attempt, RANK_EXIT_CAPTURE_S, extra, detected_at=first.exited_at)

    def _watchdog_extra(self, ev: "WatchdogVerdict") -> dict:
        v = ev.verdict
        extra = {"watchdog": v.to_dict(), "stalled_s": round(ev.stalled_s, 3)}
        gpu = self.gpu
        if gpu.available:
            samples = gpu.sample()
            extra["gpu"] = {
                "samples": [s.to_dict() for s in samples],
                # The signature of a hang that looks like work (spin-waiting kernels).
                "busy_without_progress": gpus_busy_without_progress(samples, v),
            }
        return extra

    def soft_hang(self, ev: "WatchdogVerdict", attempt: "AttemptView") -> None:
        self._async("hang_suspected", attempt, HANG_CAPTURE_S, self._watchdog_extra(ev), detected_at=ev.at)

    def hard_hang(self, ev: "WatchdogVerdict", attempt: "AttemptView") -> list[int]:
        self.wait_idle()
        result = self._write("hang", attempt, HANG_CAPTURE_S, self._watchdog_extra(ev), detected_at=ev.at)
        return list(getattr(result.diagnosis, "culprit_ranks", []) or [])

    def startup_timeout(self, ev: "WatchdogVerdict", attempt: "AttemptView") -> None:
        extra = self._watchdog_extra(ev)
        pending = list(ev.verdict.pending_ranks)
        extra["culprit_ranks"] = pending
        extra["verdict"] = (
            f"rank{'s' if len(pending) > 1 else ''} {','.join(map(str, pending))} did not become ready within "
            f"--startup-timeout {self.spec.startup_timeout:g} s: {ev.message}"
        )
        self._write("startup_timeout", attempt, HANG_CAPTURE_S, extra, detected_at=ev.at)

    def divergence(self, ev: "DivergenceFound", attempt: "AttemptView", blocking: bool) -> None:
        v = ev.verdict
        extra = {"culprit_ranks": list(v.culprit_ranks), "verdict": v.verdict, "divergence": v.to_dict()}
        files = v.bundle_files()
        if blocking:
            self.wait_idle()
            self._write("divergence", attempt, HANG_CAPTURE_S, extra, files, detected_at=ev.at)
        else:
            self._async("divergence", attempt, HANG_CAPTURE_S, extra, files=files, detected_at=ev.at)

    def on_demand(self, reply: "queue.SimpleQueue", attempt: "AttemptView") -> None:
        self._async("on_demand", attempt, HANG_CAPTURE_S, {}, reply)
