"""``supervise status``: what every rank of a running job is doing, now.

The supervisor side (``StatusBoard``) answers ``{"cmd": "status"}`` on the
control socket's own thread, never through the main loop, so a job answers
while its main loop is busy (a teardown, a fatal capture).  It reads only what
other threads publish or what the kernel says:

* the published ``AttemptView`` (ranks, pids, exits; one reference read);
* the heartbeat segment, attached read-only (step, collective in flight and
  since when, heartbeat age);
* the latest ``StragglerReport`` the straggler thread handed to
  ``on_straggler_report`` (lag p50/p99, wait share, named ranks);
* the GPU sampler's cached reading (NVML is never called here);
* the engine state the main loop last set (``on_state``);
* psutil for each rank's process state, CPU % and RSS (a few syscalls a rank).

The reply is small, versioned JSON (docs/supervisor.md, "supervise status")::

    ← {"v": 1, "ok": true, "status": {"version": 1, "run_id": ..., "engine_state": ...,
                                       "incident_open": false, "straggler": {...}, "ranks": [...]}}

The rendering (a rich table, once or live) is ``observers.status_view``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from tp_supervise.dumps.procinfo import process_title

from .. import state as engine_state

if TYPE_CHECKING:
    from tp_supervise.watchdogs.gpu import GpuSampler
    from tp_supervise.watchdogs.straggler import StragglerReport

    from ..processes.attempt import AttemptView, RankView
    from ..rank.heartbeat import HeartbeatSegment, SlotSnapshot

STATUS_VERSION = 1
# First sight of a rank: CPU % needs two readings; the one wait for all ranks together is this long.
CPU_FIRST_SAMPLE_S = 0.1
# GPU readings older than this are not shown (the sampler reads every second).
GPU_STALE_S = 10.0


def _attach(path: Path) -> HeartbeatSegment | None:
    from ..rank.heartbeat import HeartbeatLayoutError, HeartbeatSegment

    try:
        return HeartbeatSegment.attach(path)
    except (OSError, HeartbeatLayoutError, ValueError):
        return None


class StatusBoard:
    """Builds the status snapshot; any thread may call ``snapshot`` (requests are serialised by a lock)."""

    def __init__(
        self,
        run_id: str,
        node: int,
        heartbeat_path: Path,
        attempt: Callable[[], AttemptView],
        gpu: GpuSampler | None = None,
        control_path: Path | None = None,
    ):
        self.run_id = run_id
        self.node = node
        self.heartbeat_path = heartbeat_path
        self.control_path = control_path  # the control plane's slots (an engine's scheduler, front end)
        self.attempt = attempt
        self.gpu = gpu
        # Written by one thread each, read here: single reference assignments.
        self.engine_state = engine_state.EngineState.STARTING
        self.incident_open = False
        self.straggler: StragglerReport | None = None
        self._lock = threading.Lock()
        self._heartbeat: HeartbeatSegment | None = None
        self._control: HeartbeatSegment | None = None
        self._procs: dict[int, psutil.Process] = {}  # pid → the Process whose cpu_percent has a reading

    # ------------------------------------------------------------ writers (other threads)
    def set_state(self, state: engine_state.EngineState) -> None:
        """An incident opens with a suspected or confirmed fault and stays open through its teardown."""
        if engine_state.is_fault(state) or state is engine_state.EngineState.SUSPECT:
            self.incident_open = True
        elif state in (engine_state.EngineState.READY, engine_state.EngineState.STARTING):
            self.incident_open = False
        self.engine_state = state

    def set_straggler_report(self, report: StragglerReport) -> None:
        self.straggler = report

    # ------------------------------------------------------------ the snapshot
    def snapshot(self) -> dict:
        with self._lock:
            return self._build()

    def close(self) -> None:
        with self._lock:
            for segment in (self._heartbeat, self._control):
                if segment is not None:
                    segment.close(unlink=False)
            self._heartbeat = self._control = None

    def _slots(self) -> dict[int, SlotSnapshot]:
        if self._heartbeat is None:
            self._heartbeat = _attach(self.heartbeat_path)
        return {s.slot: s for s in self._heartbeat.read_all()} if self._heartbeat is not None else {}

    def _control_slots(self) -> dict[int, SlotSnapshot]:
        """pid -> the control slot it claimed."""
        if self._control is None and self.control_path is not None:
            self._control = _attach(self.control_path)
        return {s.pid: s for s in self._control.read_all() if s.claimed} if self._control is not None else {}

    def _build(self) -> dict:
        attempt = self.attempt()  # one read: one consistent attempt
        ranks = sorted((r for r in attempt.ranks.values() if not r.is_launcher), key=lambda r: (r.rank, r.slot))
        plane = attempt.control_plane()
        procs = self._processes([r for r in (*ranks, *plane) if r.alive])  # first: it may wait for a CPU reading
        slots = self._slots()  # then the slots
        control = self._control_slots()
        now = time.monotonic()  # after them: no age comes out negative
        report = self.straggler
        named = set(report.named) if report is not None else set()
        state = self.engine_state
        gpus = self._gpus(now)
        out_ranks = [self._rank(r, slots.get(r.slot), procs.get(r.pid), report, named, gpus, now) for r in ranks]
        return {
            "version": STATUS_VERSION,
            "run_id": self.run_id,
            "node": self.node,
            "engine_state": state.value,
            "incident_open": self.incident_open,
            "attempt": attempt.number,
            "restarts": attempt.restarts,
            "uptime_seconds": round(now - attempt.started_at, 3) if attempt.started_at else None,
            "straggler": None
            if report is None
            else {
                "state": report.state,
                "named": sorted(report.named),
                "step_seconds": report.step_s,
                "sentences": {str(r): report.sentence(r) for r in sorted(report.named)},
                "age_seconds": round(max(0.0, now - report.at), 3),
            },
            "gpu": None if self.gpu is None else {"available": self.gpu.available, "reason": self.gpu.reason},
            "ranks": out_ranks,
            "processes": [self._process(v, control.get(v.pid), procs.get(v.pid), now) for v in plane],
        }

    def _process(self, v: RankView, snap: SlotSnapshot | None, proc: dict | None, now: float) -> dict:
        """A process of the run that is not a rank: its role and, from its control slot, where it is."""
        out: dict = {"role": v.role, "pid": v.pid, "alive": v.alive, "title": (proc or {}).get("title") or v.title}
        out["state"] = (proc or {}).get("state", "unknown") if v.alive else "exited"
        out["cpu_percent"] = proc["cpu_percent"] if proc else None
        out["rss_bytes"] = proc["rss_bytes"] if proc else None
        out.update(steps=None, in_step=None, phase=None, step_tokens=None, in_step_seconds=None)
        out["heartbeat_age_seconds"] = None
        if snap is None:  # no control slot claimed: the role is known from its title, or not at all
            return out
        inside = snap.in_step
        out.update(steps=snap.step, in_step=inside, phase=snap.phase)
        if inside:
            out["step_tokens"] = snap.step_tokens
            out["in_step_seconds"] = round(max(0.0, now - snap.ts_step_begin), 6)
        if snap.ts_heartbeat > 0:
            out["heartbeat_age_seconds"] = round(max(0.0, now - snap.ts_heartbeat), 6)
        return out

    def _processes(self, ranks: list[RankView]) -> dict[int, dict]:
        """pid → state, CPU % (since the previous request; a short wait the first time) and RSS."""
        fresh = []
        live: dict[int, psutil.Process] = {}
        for r in ranks:
            proc = self._procs.get(r.pid)
            if proc is None:
                try:
                    proc = psutil.Process(r.pid)
                    proc.cpu_percent(None)
                except psutil.Error:
                    continue
                fresh.append(r.pid)
            live[r.pid] = proc
        self._procs = live  # exited ranks' Process objects are dropped
        if fresh:
            time.sleep(CPU_FIRST_SAMPLE_S)
        out = {}
        for pid, proc in live.items():
            try:
                with proc.oneshot():
                    out[pid] = {
                        "title": process_title(pid),
                        "state": proc.status(),
                        "cpu_percent": round(proc.cpu_percent(None), 1),
                        "rss_bytes": proc.memory_info().rss,
                    }
            except psutil.Error:
                out[pid] = {"state": "gone", "cpu_percent": None, "rss_bytes": None}
        return out

    def _gpus(self, now: float) -> dict[int, dict]:
        """pid → its GPU's cached reading (the sampler's cache only; nothing stale)."""
        reading = self.gpu.latest() if self.gpu is not None else None
        if reading is None or now - reading.at > GPU_STALE_S:
            return {}
        out = {}
        for sample in reading.samples:
            for proc in sample.processes:
                out[proc.pid] = {
                    "index": sample.index,
                    "utilization_pct": sample.utilization_pct,
                    "memory_used_bytes": sample.memory_used,
                    "memory_total_bytes": sample.memory_total,
                    "power_w": sample.power_w,
                    "process_used_bytes": proc.used_bytes,
                    "sm_clock_mhz": sample.sm_clock_mhz,
                    "sm_clock_max_mhz": sample.sm_clock_max_mhz,
                    "temperature_c": sample.temperature_c,
                    "clock_reasons": None if sample.clock_reasons is None else list(sample.clock_reasons),
                }
        return out

    def _rank(
        self,
        r: RankView,
        snap: SlotSnapshot | None,
        proc: dict | None,
        report: StragglerReport | None,
        named: set[int],
        gpus: dict[int, dict],
        now: float,
    ) -> dict:
        out: dict = {"rank": r.rank, "slot": r.slot, "pid": r.pid, "alive": r.alive}
        out["title"] = (proc or {}).get("title") or r.title
        if not r.alive:
            exit_ = r.exit.to_dict() if r.exit is not None else {}
            out["state"] = f"exited ({exit_.get('reason', '?')})"
            out["exit"] = exit_
        else:
            out["state"] = proc["state"] if proc is not None else "unknown"
        out["cpu_percent"] = proc["cpu_percent"] if proc else None
        out["rss_bytes"] = proc["rss_bytes"] if proc else None
        if snap is not None and snap.claimed:
            out["step"] = snap.step
            out["phase"] = snap.phase
            out["ready"] = snap.ready
            out["heartbeat_age_seconds"] = (
                round(max(0.0, now - snap.ts_heartbeat), 6) if snap.ts_heartbeat > 0 else None
            )
            out["collective"] = (
                {
                    "op": snap.coll_op,
                    "desc": snap.coll_desc,
                    "seq": snap.coll_seq,
                    "for_seconds": round(max(0.0, now - snap.ts_coll_begin), 6) if snap.ts_coll_begin > 0 else None,
                }
                if snap.in_collective
                else None
            )
            out["collectives"] = snap.coll_seq
            out["last_step_seconds"] = snap.last_step_s or None
        else:
            out.update(
                step=None,
                phase=None,
                ready=False,
                heartbeat_age_seconds=None,
                collective=None,
                collectives=None,
                last_step_seconds=None,
            )
        lag = report.ranks.get(r.rank) if report is not None else None
        out["lag"] = (
            None
            if lag is None
            else {
                "p50_seconds": lag.lag_p50_s,
                "p99_seconds": lag.lag_p99_s,
                "wait_share": lag.wait_share,
                "late_fraction": lag.late_fraction,
            }
        )
        out["straggler"] = r.rank in named
        out["gpu"] = gpus.get(r.pid)
        return out
