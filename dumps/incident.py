"""One call for the supervisor: capture, flight recorder, verdict, bundle.

``write_incident`` never raises: a capture that fails still yields a
bundle whose summary says what failed, and a bundle that cannot be written
(disk full, permissions) yields ``ok=False`` with the reason.  Stack
capture and flight-recorder collection run at the same time, both bounded
by the same share of the deadline; the rest of the deadline is for the
verdict and the write.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import structlog

from . import flight
from .bundle import BundleWriter, fr_file, iso_utc, stack_file
from .capture import RankTarget, capture_all
from .diagnose import Diagnosis, diagnose
from .evidence import STATE_NAMES, CpuSamples, Evidence, RankEvidence
from .fr_analysis import FrFindings

log = structlog.get_logger()

# Share of ``deadline_s`` given to capture and flight-recorder collection;
# the remainder covers the verdict and writing the bundle.
CAPTURE_SHARE = 0.8
EVIDENCE_JSON = "evidence.json"


@dataclass(frozen=True)
class IncidentResult:
    path: Path | None  # the bundle, None when it could not be written
    diagnosis: Diagnosis | None
    duration_s: float
    ok: bool  # a bundle was written
    error: str | None = None
    samples: CpuSamples | None = None  # pass as ``previous_cpu`` next time


def _bare_evidence(targets: Sequence[RankTarget], error: str, started: float) -> Evidence:
    ranks = {
        t.rank: RankEvidence(
            rank=t.rank, slot=t.slot, pid=t.pid, alive=t.alive, exit=t.exit, heartbeat=t.heartbeat, error=error
        )
        for t in targets
    }
    return Evidence(ranks=ranks, started_at=started, duration_s=0.0, method="none", pyspy=None)


def _stack_file_text(ev: RankEvidence) -> str:
    state = ev.state or "-"
    head = [
        f"# rank {ev.rank} slot {ev.slot} pid {ev.pid} state {state} ({STATE_NAMES.get(state, '')})",
        f"# method: {ev.method}; attempts: {'; '.join(ev.attempts) or '-'}; took {ev.capture_s:.3f} s",
    ]
    if ev.error:
        head.append(f"# {ev.error}")
    return "\n".join(head) + "\n\n" + ev.stack_text


def _evidence_json(evidence: Evidence) -> str:
    ranks = {}
    for rank, ev in sorted(evidence.ranks.items()):
        ranks[str(rank)] = {
            "pid": ev.pid,
            "slot": ev.slot,
            "alive": ev.alive,
            "exit": ev.exit,
            "proc": ev.proc.to_dict() if ev.proc else None,
            "cpu_used_s": ev.cpu_used_s,
            "cpu_window_s": ev.cpu_window_s,
            "heartbeat": ev.heartbeat.to_dict() if ev.heartbeat else None,
            "stack_method": ev.method,
            "stack_attempts": list(ev.attempts),
            "stack_error": ev.error,
            "capture_s": round(ev.capture_s, 4),
            "threads": [
                {
                    "id": t.thread_id,
                    "name": t.name,
                    "main": t.is_main,
                    "frames": [[f.function, f.filename, f.line, f.native] for f in t.frames],
                }
                for t in ev.threads
            ],
        }
    doc = {"method": evidence.method, "pyspy": evidence.pyspy, "duration_s": evidence.duration_s, "ranks": ranks}
    return json.dumps(doc, indent=1, default=str) + "\n"


def _fallback_ranks(targets: Sequence[RankTarget]) -> dict:
    return {
        str(t.rank): {"pid": t.pid, "state": None, "exit": t.exit, "stack_signature": "", "alive": t.alive}
        for t in targets
    }


def write_incident(
    writer: BundleWriter,
    *,
    reason: str,
    run_id: str,
    targets: Sequence[RankTarget],
    run_dir: Path,
    method: str = "auto",
    native: bool = False,
    deadline_s: float,
    extra_summary: Mapping | None = None,
    extra_files: Mapping[str, bytes | str] | None = None,
    previous_cpu: CpuSamples | None = None,
    detected_at: datetime | None = None,
) -> IncidentResult:
    """Capture every rank, diagnose, and write one bundle; never raises."""
    start = time.monotonic()
    detected = detected_at or datetime.now(timezone.utc)
    errors: list[str] = []
    budget = max(0.0, deadline_s * CAPTURE_SHARE)

    fr_out: dict[str, dict] = {"traces": {}, "errors": {}}

    def fr_work() -> None:
        try:
            fr_out["traces"], fr_out["errors"] = flight.collect_detailed(targets, run_dir, budget)
        except Exception as exc:
            fr_out["errors"] = {t.rank: f"collection failed: {exc!r}" for t in targets}

    fr_thread = threading.Thread(target=fr_work, name="dump-flight", daemon=True)
    fr_thread.start()
    try:
        evidence = capture_all(
            targets,
            run_dir=run_dir,
            method=method,
            native=native,
            per_rank_timeout_s=budget,
            deadline_s=budget,
            previous=previous_cpu,
        )
    except Exception as exc:
        log.error("dump.capture_crashed", error=repr(exc))
        errors.append(f"stack capture failed: {exc!r}")
        evidence = _bare_evidence(targets, f"capture failed: {exc!r}", start)
    fr_thread.join(max(0.0, start + budget - time.monotonic()))
    traces: dict[int, dict] = dict(fr_out["traces"])
    findings: FrFindings | None = None
    if traces:
        try:
            findings = flight.analyze(traces)
        except Exception as exc:
            errors.append(f"flight-recorder analysis failed: {exc!r}")

    diagnosis: Diagnosis | None = None
    try:
        diagnosis = diagnose(evidence, reason=reason, fr_findings=findings)
    except Exception as exc:
        log.error("dump.diagnose_crashed", error=repr(exc))
        errors.append(f"diagnosis failed: {exc!r}")

    summary: dict = {
        "reason": reason,
        "run_id": run_id,
        "detected_at": iso_utc(detected),
    }
    if diagnosis is not None:
        summary.update(diagnosis.summary_fields())
    else:
        summary.update({"culprit_ranks": [], "verdict": "no verdict: " + "; ".join(errors), "ranks": _fallback_ranks(targets)})
    summary["capture"] = {
        "method": evidence.method,
        "pyspy": evidence.pyspy,
        "native": native,
        "duration_s": round(evidence.duration_s, 4),
    }
    fr_summary: dict = {"collected": sorted(traces), "errors": {str(r): e for r, e in sorted(fr_out["errors"].items())}}
    if findings is not None:
        fr_summary.update(findings.to_dict())
    summary["flight_recorder"] = fr_summary
    summary["errors"] = errors
    if extra_summary:
        summary.update(extra_summary)

    files: dict[str, bytes | str] = {}
    for rank, ev in sorted(evidence.ranks.items()):
        files[stack_file(rank)] = _stack_file_text(ev)
    for rank, trace in sorted(traces.items()):
        files[fr_file(rank)] = json.dumps(trace, indent=1) + "\n"
    try:
        files[EVIDENCE_JSON] = _evidence_json(evidence)
    except Exception as exc:
        errors.append(f"evidence.json failed: {exc!r}")
    if extra_files:
        files.update(extra_files)
    summary["duration_s"] = round(time.monotonic() - start, 4)

    try:
        path = writer.write(reason, summary, files, detected)
    except Exception as exc:
        duration = time.monotonic() - start
        log.error("dump.write_failed", reason=reason, error=repr(exc))
        return IncidentResult(None, diagnosis, duration, False, f"bundle not written: {exc!r}", evidence.samples)
    duration = time.monotonic() - start
    log.info(
        "dump.written",
        path=str(path),
        reason=reason,
        culprits=summary.get("culprit_ranks"),
        duration_s=round(duration, 3),
    )
    return IncidentResult(path, diagnosis, duration, True, None, evidence.samples)
