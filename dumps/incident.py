"""One call for the supervisor: capture, flight recorder, verdict, bundle.

Two phases, so that a fatal incident never holds the teardown back:

``capture_incident``  everything that needs the ranks alive: ``/proc``,
                      stacks, the flight recorder, then the (pure) verdict;
                      bounded by ``deadline_s``.  With ``freeze=True`` every
                      rank is stopped first (``dumps.freeze``), the stacks are
                      taken from the frozen ranks, then the ranks stopped here
                      are resumed and their flight recorders read (a stopped
                      rank's worker server cannot answer).  Without a freeze,
                      stacks and flight recorder are collected at the same time.
                      The files torch wrote itself on a NCCL timeout are
                      copied from the run dir last.
``write_captured``    the summary, the files, the atomic write and retention:
                      disk only, so it may run after the teardown; an
                      ``incomplete`` note (the supervisor's) goes into the
                      summary when the capture was cut short.

``write_incident`` is both in one call (soft and on-demand dumps).  None of
them raises: a capture that fails still yields a bundle whose summary says
what failed, and a bundle that cannot be written (disk full, permissions)
yields ``ok=False`` with the reason.  Of ``deadline_s``, ``CAPTURE_SHARE``
is for the capture; the rest covers the verdict and the write.
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

from . import flight_capture as flight
from .bundle import BundleWriter, fr_file, fr_json_file, iso_utc, process_stack_file, stack_file, torch_dump_file
from .capture import RankTarget, capture_all
from .diagnose import Diagnosis, diagnose
from .evidence import STATE_NAMES, CpuSamples, Evidence, RankEvidence
from .fr_analysis import FrFindings
from .freeze import Frozen, thaw
from .freeze import freeze as freeze_ranks

log = structlog.get_logger()

# Share of ``deadline_s`` given to capture and flight-recorder collection;
# the remainder covers the verdict and writing the bundle.
CAPTURE_SHARE = 0.8
# Frozen ranks: share of the capture budget for the stacks; the rest is for
# the flight recorders, read once the ranks run again.
FROZEN_STACKS_SHARE = 0.7
# How long a freeze waits for every rank to read as stopped (at most this share of the budget).
FREEZE_SETTLE_S = 0.2
FREEZE_SETTLE_SHARE = 0.1
# Floor for copying torch's own dump files when the capture used up its share (local disk reads).
TORCH_DUMPS_MIN_S = 0.5
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
    ranks = {t.rank: t.evidence(error=error) for t in targets}
    return Evidence(ranks=ranks, started_at=started, duration_s=0.0, method="none", pyspy=None)


def _stack_file_name(ev: RankEvidence) -> str:
    return stack_file(ev.rank) if ev.rank >= 0 else process_stack_file(ev.role, ev.pid)


def _stack_file_text(ev: RankEvidence) -> str:
    state = ev.state or "-"
    who = f"rank {ev.rank} slot {ev.slot}" if ev.rank >= 0 else f"{ev.role or 'process'} ({ev.title or '-'})"
    head = [
        f"# {who} pid {ev.pid} state {state} ({STATE_NAMES.get(state, '')})",
        f"# method: {ev.method}; attempts: {'; '.join(ev.attempts) or '-'}; took {ev.capture_s:.3f} s",
    ]
    if ev.error:
        head.append(f"# {ev.error}")
    return "\n".join(head) + "\n\n" + ev.stack_text


def _evidence_json(evidence: Evidence) -> str:
    ranks: dict[str, dict] = {}
    processes: dict[str, dict] = {}
    for rank, ev in sorted(evidence.ranks.items()):
        entry = ranks if rank >= 0 else processes
        entry[str(rank) if rank >= 0 else str(ev.pid)] = {
            "role": ev.role or "rank",
            "title": ev.title,
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
    doc = {
        "method": evidence.method,
        "pyspy": evidence.pyspy,
        "duration_s": evidence.duration_s,
        "ranks": ranks,
        "processes": processes,
    }
    return json.dumps(doc, indent=1, default=str) + "\n"


def _fallback_ranks(targets: Sequence[RankTarget]) -> dict:
    targets = [t for t in targets if t.is_rank]
    return {
        str(t.rank): {
            "pid": t.pid,
            "title": t.title,
            "state": None,
            "exit": t.exit,
            "stack_signature": "",
            "alive": t.alive,
        }
        for t in targets
    }


@dataclass(frozen=True)
class Captured:
    """What the capture phase got while the ranks existed, and the verdict over it."""

    targets: tuple[RankTarget, ...]
    evidence: Evidence
    traces: Mapping[int, dict]
    fr_errors: Mapping[int, str]
    findings: FrFindings | None
    diagnosis: Diagnosis | None
    errors: tuple[str, ...]
    frozen: Frozen | None
    started: float  # time.monotonic()
    duration_s: float
    samples: CpuSamples | None = None
    torch_dumps: tuple[flight.TorchDump, ...] = ()

    def missing(self) -> dict[str, str]:
        """Bundle file -> why it is absent, for each part a live rank did not give."""
        out = {}
        for t in self.targets:
            if not t.alive:
                continue
            ev = self.evidence.ranks.get(t.rank)
            if ev is None or not ev.has_stacks:
                name = stack_file(t.rank) if t.is_rank else process_stack_file(t.role, t.pid)
                out[name] = (ev.error if ev is not None else None) or "not captured"
            if t.is_rank and t.rank not in self.traces:
                out[fr_file(t.rank)] = self.fr_errors.get(t.rank) or "not collected"
        return out


def capture_incident(
    targets: Sequence[RankTarget],
    *,
    reason: str,
    run_dir: Path,
    method: str = "auto",
    native: bool = False,
    deadline_s: float,
    previous_cpu: CpuSamples | None = None,
    freeze: bool = False,
) -> Captured:
    """Stacks, flight recorder and verdict of every rank, within ``deadline_s * CAPTURE_SHARE``; never raises."""
    start = time.monotonic()
    budget = max(0.0, deadline_s * CAPTURE_SHARE)
    end = start + budget
    targets = tuple(targets)
    ranks = tuple(t for t in targets if t.is_rank)  # the flight recorders are the ranks' (torch.distributed)
    errors: list[str] = []
    frozen: Frozen | None = None
    if freeze:
        try:
            frozen = freeze_ranks(targets, settle_s=min(FREEZE_SETTLE_S, budget * FREEZE_SETTLE_SHARE))
        except Exception as exc:  # capture what we can, running
            errors.append(f"freeze failed: {exc!r}")
            log.error("dump freeze failed", error=repr(exc))

    fr_out: dict[str, dict] = {"traces": {}, "errors": {}}

    def fr_work() -> None:
        try:
            fr_out["traces"], fr_out["errors"] = flight.collect_detailed(
                ranks, run_dir, max(0.0, end - time.monotonic())
            )
        except Exception as exc:
            fr_out["errors"] = {t.rank: f"collection failed: {exc!r}" for t in ranks}

    fr_thread = threading.Thread(target=fr_work, name="dump-flight", daemon=True)
    if frozen is None:
        fr_thread.start()  # at the same time as the stacks
    stack_budget = budget * (FROZEN_STACKS_SHARE if frozen is not None else 1.0)
    stack_budget = max(0.0, min(stack_budget, end - time.monotonic()))
    try:
        evidence = capture_all(
            targets,
            run_dir=run_dir,
            method=method,
            native=native,
            per_rank_timeout_s=stack_budget,
            deadline_s=stack_budget,
            previous=previous_cpu,
            frozen=frozen,
        )
    except Exception as exc:
        log.error("dump capture crashed", error=repr(exc))
        errors.append(f"stack capture failed: {exc!r}")
        evidence = _bare_evidence(targets, f"capture failed: {exc!r}", start)
    if frozen is not None:
        thaw(frozen)  # the flight recorders answer from inside the ranks
        fr_thread.start()
    fr_thread.join(max(0.0, end - time.monotonic()))
    traces: dict[int, dict] = dict(fr_out["traces"])
    torch_dumps: tuple[flight.TorchDump, ...] = ()
    try:
        torch_dumps = tuple(flight.collect_torch_dumps(run_dir, max(TORCH_DUMPS_MIN_S, end - time.monotonic())))
    except Exception as exc:
        errors.append(f"torch dump files not collected: {exc!r}")
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
        log.error("dump diagnose crashed", error=repr(exc))
        errors.append(f"diagnosis failed: {exc!r}")
    return Captured(
        targets=targets,
        evidence=evidence,
        traces=traces,
        fr_errors=dict(fr_out["errors"]),
        findings=findings,
        diagnosis=diagnosis,
        errors=tuple(errors),
        frozen=frozen,
        started=start,
        duration_s=time.monotonic() - start,
        samples=evidence.samples,
        torch_dumps=torch_dumps,
    )


def write_captured(
    writer: BundleWriter,
    captured: Captured,
    *,
    reason: str,
    run_id: str,
    native: bool = False,
    extra_summary: Mapping | None = None,
    extra_files: Mapping[str, bytes | str] | None = None,
    detected_at: datetime | None = None,
    incomplete: Mapping | None = None,
) -> IncidentResult:
    """The bundle of one capture; never raises.  ``incomplete``: why parts are
    missing (the summary gets it under ``incomplete``, with the missing files)."""
    start = captured.started
    detected = detected_at or datetime.now(timezone.utc)
    errors = list(captured.errors)
    evidence, diagnosis, traces, findings = captured.evidence, captured.diagnosis, captured.traces, captured.findings
    summary: dict = {
        "reason": reason,
        "run_id": run_id,
        "detected_at": iso_utc(detected),
    }
    if diagnosis is not None:
        summary.update(diagnosis.summary_fields())
    else:
        summary.update(
            {
                "culprit_ranks": [],
                "verdict": "no verdict: " + "; ".join(errors),
                "ranks": _fallback_ranks(captured.targets),
            }
        )
    summary["capture"] = {
        "method": evidence.method,
        "pyspy": evidence.pyspy,
        "native": native,
        "duration_s": round(evidence.duration_s, 4),
    }
    if captured.frozen is not None:
        summary["capture"]["freeze"] = captured.frozen.to_dict()
    fr_summary: dict = {
        "collected": sorted(traces),
        "errors": {str(r): e for r, e in sorted(captured.fr_errors.items())},
    }
    if findings is not None:
        fr_summary.update(findings.to_dict())
    if captured.torch_dumps:
        fr_summary["torch_dumps"] = {str(d.rank): d.to_dict() for d in captured.torch_dumps}
    summary["flight_recorder"] = fr_summary
    summary["errors"] = errors
    if extra_summary:
        summary.update(extra_summary)
    if incomplete is not None:
        summary["incomplete"] = dict(incomplete, missing=captured.missing())

    files: dict[str, bytes | str] = {}
    for _rank, ev in sorted(evidence.ranks.items()):
        files[_stack_file_name(ev)] = _stack_file_text(ev)
    for rank, trace in sorted(traces.items()):
        files[fr_json_file(rank)] = json.dumps(trace, indent=1) + "\n"
    try:
        world = sorted(t.rank for t in captured.targets if t.is_rank)
        for rank, data in flight.fr_pickles({r: t for r, t in traces.items() if r >= 0}, world).items():
            files[fr_file(rank)] = data
    except Exception as exc:  # the traces still have their JSON
        errors.append(f"fr/ not written: {exc!r}")
    for dump in captured.torch_dumps:
        if dump.data is not None:
            files[torch_dump_file(dump.rank)] = dump.data
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
        log.error("dump write failed", reason=reason, error=repr(exc))
        return IncidentResult(None, diagnosis, duration, False, f"bundle not written: {exc!r}", captured.samples)
    duration = time.monotonic() - start
    log.info(
        "dump written",
        path=str(path),
        reason=reason,
        culprits=summary.get("culprit_ranks"),
        duration_s=round(duration, 3),
    )
    return IncidentResult(path, diagnosis, duration, True, None, captured.samples)


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
    freeze: bool = False,
) -> IncidentResult:
    """Capture every rank, diagnose, and write one bundle; never raises."""
    captured = capture_incident(
        targets,
        reason=reason,
        run_dir=run_dir,
        method=method,
        native=native,
        deadline_s=deadline_s,
        previous_cpu=previous_cpu,
        freeze=freeze,
    )
    return write_captured(
        writer,
        captured,
        reason=reason,
        run_id=run_id,
        native=native,
        extra_summary=extra_summary,
        extra_files=extra_files,
        detected_at=detected_at,
    )
