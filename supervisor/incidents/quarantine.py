"""Serving through faults, the supervisor's side: the incident file, the requests in flight, the quarantine.

The engine and the supervisor share three files in ``$SUPERVISE_RUN_DIR``
(their format is the engine's, ``tp_supervise.engine.runfiles``; docs/engine.md,
"Files in $SUPERVISE_RUN_DIR")::

    incident          written here when a fault is ruled, before any rank is signalled
                      (the engine names it in the 503s of the requests it had in flight);
                      removed before the next attempt starts
    inflight-rank0    written by rank 0: fingerprints of the requests it has in flight,
                      each with the time it was first scheduled; read here at the ruling
                      and again after the teardown (the writer is dead by then)
    quarantine.json   written here: fingerprints the engine answers 400 for the rest of the run,
                      and the suspects of the current crash loop, which it prefills alone

**Which requests are blamed.**  Every request running when the group fails
was "in flight", but most of them are bystanders: the client retries them
(the standard SDKs retry a 503) and, after a restart, the retried bystanders
and the poison request are scheduled together in the first step of the new
attempt.  Counting every in-flight fingerprint would quarantine the
bystanders with the poison.  What sets a request that kills the group apart
is that it was *started by the step that failed*: the suspects of a failure
are the in-flight requests first scheduled by the newest engine step the
file records (each slot holds the index of the step that first scheduled
it; an engine that records none: those first scheduled within
``SAME_STEP_S`` of the newest, as one step schedules its new requests back
to back and a step later is at least one forward pass later).

**Co-arrivals.**  Requests that arrived with the poison one are scheduled in
the same step and are suspects of the first failure as well.  So the
suspects of the current crash loop go to ``quarantine.json`` (``suspects``)
before the next attempt starts, and the engine prefills each of them alone
in its step: when the poison request kills the group again, the failing step
started nothing else, and only it is a suspect twice.  A fingerprint that
was a suspect in ``--quarantine-after`` failed attempts of one crash loop is
quarantined for the run: ``request_quarantined`` in the log, the counter
``supervise_quarantined_requests_total``, ``quarantine.json`` rewritten
before the next attempt.  An attempt that stayed up long enough before failing
(``crash_loop_over``: the restart policy's window, given by the decider) starts a new crash loop: older suspicions are forgotten (and leave
the file at the next failure).

Limits: a request that fails the group later in its life than its first
step (a crash at its 50th token) is never a suspect, so it is not
quarantined (the restarts are bounded by ``--max-restarts`` as before).  An
engine that reads no ``suspects`` schedules co-arrivals together again, and
a bystander scheduled in the very same step as the poison request, in each
of the failures, is then quarantined with it.

**The relay** (in front of the group) is told what these files say, as
they change (``on_change``: the incident ruled or cleared, the quarantine;
supervisor/relay/protocol.py), so it polls none of them; the built-in
engine's frontend reads the files.

Main thread only (the ruling, the end of an attempt, the next launch); the
desk's dump threads read ``evidence()``'s frozen dicts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from tp_supervise.engine import runfiles

from ..relay.protocol import RELAY_INFLIGHT_FILE

if TYPE_CHECKING:
    from ..processes.attempt import AttemptView

log = structlog.get_logger("supervise")

# An engine that records no step index: new requests of one engine step are recorded back to back (microseconds
# apart); the step before ran a forward pass in between (milliseconds).  Requests first scheduled within this of
# the newest are the suspects.
SAME_STEP_S = 0.002


# -- the incident file ------------------------------------------------------------------------------------------
def write_incident(run_dir: Path, incident_id: str) -> bool:
    """``incident``, atomically (temporary file, rename); False when it could not be written (logged)."""
    path = Path(run_dir) / runfiles.INCIDENT_FILE
    tmp = path.with_name(f".{runfiles.INCIDENT_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(incident_id[: runfiles.MAX_INCIDENT_CHARS] + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning(
            "run file not written: the engine's 503s will not name the incident",
            event_name="run_file_write_failed",
            file=str(path),
            error=repr(exc),
        )
        return False
    return True


def clear_incident(run_dir: Path) -> None:
    try:
        os.unlink(Path(run_dir) / runfiles.INCIDENT_FILE)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning(
            "run file not removed: the next attempt may name the last incident",
            event_name="run_file_write_failed",
            file=str(Path(run_dir) / runfiles.INCIDENT_FILE),
            error=repr(exc),
        )


# -- inflight-rank0 with each request's start time --------------------------------------------------------------
@dataclass(frozen=True)
class InFlight:
    """One read of an in-flight file: the writer, its attempt, fingerprint → first scheduled (monotonic ns) and
    fingerprint → the engine step that first scheduled it (0: not recorded)."""

    pid: int
    attempt: int
    started_ns: dict[str, int]
    step: dict[str, int] = field(default_factory=dict)

    def suspects(self) -> set[str]:
        """The requests the last step started: those of the newest recorded step, or, when a request has no step,
        those first scheduled within SAME_STEP_S of the newest."""
        return suspects_of(self.started_ns, self.step)


def suspects_of(started_ns: dict[str, int], step: dict[str, int]) -> set[str]:
    if not started_ns:
        return set()
    if all(step.get(fp, 0) > 0 for fp in started_ns):
        last = max(step[fp] for fp in started_ns)
        return {fp for fp in started_ns if step[fp] == last}
    newest = max(started_ns.values())
    return {fp for fp, ns in started_ns.items() if newest - ns <= SAME_STEP_S * 1e9}


def read_in_flight(path: Path) -> InFlight | None:
    """The file's requests with their start times (``runfiles.read_inflight``, the one parser of its layout).
    None: no file.  Raises ``runfiles.InflightFormatError`` for a file that is not one."""
    try:
        snap = runfiles.read_inflight(path)
    except FileNotFoundError:
        return None
    return InFlight(snap.pid, snap.attempt, snap.started_ns, snap.step)


# -- the quarantine ---------------------------------------------------------------------------------------------
@dataclass
class FailedAttempt:
    incident_id: str
    attempt: int  # TORCHELASTIC_RESTART_COUNT of the attempt
    rank0_pid: int
    started_ns: dict[str, int] = field(default_factory=dict)  # fingerprint → first scheduled
    step: dict[str, int] = field(default_factory=dict)  # fingerprint → the engine step that first scheduled it
    suspects: set[str] = field(default_factory=set)
    note: str | None = None  # why nothing was read (no file, a stale file, ...)


@dataclass
class AttemptRequests:
    """What one attempt's failure caught: its incident (the first ruled) and, when rank 0 (or the relay) is on this
    node, its requests in flight."""

    incident: str | None = None
    failed: FailedAttempt | None = None


class RequestQuarantine:
    """Per run: the suspects of each failed attempt, the fingerprints quarantined, the files the engine reads."""

    def __init__(
        self,
        run_dir: Path,
        after: int,
        crash_loop_over: Callable[[float], bool],
        on_quarantined: Callable[[int], None],
        from_relay: bool = False,
        on_change: Callable[[str | None, dict[str, list[str]], list[str]], None] | None = None,
    ):
        self.run_dir = Path(run_dir)
        # The relay's record (a COMMAND's engine behind --relay) instead of rank 0's: written by a process that
        # outlives the attempts, its step is the relay's epoch (supervisor/relay/hold.py).
        self.from_relay = from_relay
        self._relay_epoch: tuple[int, str] | None = None  # (the newest epoch blamed, for which incident)
        self.after = after  # 0: never quarantine (the in-flight requests still go into the bundles)
        self.crash_loop_over = crash_loop_over  # (seconds an attempt ran) -> it was no crash loop
        self.on_quarantined = on_quarantined
        self.loop: list[FailedAttempt] = []  # failed attempts of the current crash loop
        self._incident: str | None = None  # the incident the relay was told (the attempt that runs has none)
        self.quarantined: dict[str, list[str]] = {}  # fingerprint → the incidents it was a suspect in
        self.decided: dict[str, list[str]] = {}  # incident id → fingerprints it quarantined
        self._written: tuple[dict[str, list[str]], list[str]] | None = None  # quarantine.json as last written
        self._said: tuple[dict[str, list[str]], list[str]] = ({}, [])  # what the quarantine says now
        # Called with (incident, quarantined, suspects) whenever one of them changes: the relay's notices
        # (RelayProcess.tell), set once the relay runs.
        self.on_change = on_change
        self._evidence: dict[str, dict] = {}

    @property
    def inflight_path(self) -> Path:
        if self.from_relay:
            return self.run_dir / RELAY_INFLIGHT_FILE
        return runfiles.inflight_path(self.run_dir, 0)

    def before_attempt(self) -> AttemptRequests:
        """The next attempt starts: its requests are not part of the last incident.  Its record, owned by the
        attempt (the decider's case): a new one per attempt, never reset."""
        self._incident = None
        clear_incident(self.run_dir)
        self._tell()
        return AttemptRequests()

    def fault(self, requests: AttemptRequests, incident_id: str, view: AttemptView, now: float | None = None) -> None:
        """A fault was ruled (before the teardown signals anything): the incident file, then the requests in flight,
        read while rank 0 may still be answering them, then the quarantine."""
        now = time.monotonic() if now is None else now
        if requests.incident is not None:
            return  # the attempt already failed: its first incident is the one
        requests.incident = self._incident = incident_id
        write_incident(self.run_dir, incident_id)
        self._tell()
        if view.started_at and self.crash_loop_over(now - view.started_at):
            self.loop = []  # it stayed up: not a crash loop, what came before is no evidence against a request
        rank0 = next((r.pid for r in view.ranks.values() if r.rank == 0), None)
        if rank0 is None and not self.from_relay:
            return  # rank 0 is on another node (or never started): its requests are that node's to read
        failed = requests.failed = FailedAttempt(incident_id, view.restarts, rank0 or 0)
        self.loop.append(failed)
        self._read_into(failed)
        self._decide(failed)

    def attempt_ended(self, requests: AttemptRequests) -> None:
        """After the teardown, before the next attempt: the file once more (its writer is gone: requests it
        recorded after the ruling count too), then the quarantine, written before the next attempt starts."""
        if requests.failed is not None:
            self._read_into(requests.failed)
            self._decide(requests.failed)

    def evidence(self, incident_id: str) -> dict:
        """The bundle's ``requests`` field for an incident ruled here ({} when none)."""
        return self._evidence.get(incident_id, {})

    # ------------------------------------------------------------------ internals
    def _read_into(self, failed: FailedAttempt) -> None:
        path = self.inflight_path
        note = None
        try:
            snap = read_in_flight(path)
        except (OSError, runfiles.InflightFormatError) as exc:
            log.warning(
                "in-flight requests unreadable: no quarantine evidence from this failure",
                event_name="inflight_unreadable",
                path=str(path),
                error=str(exc)[:200],
            )
            snap, note = None, f"unreadable: {str(exc)[:200]}"
        if snap is None:
            note = note or "no in-flight file (the engine does not write one, or rank 0 never served)"
        elif not self.from_relay and (snap.attempt != failed.attempt or snap.pid != failed.rank0_pid):
            note = (
                f"the in-flight file is an earlier attempt's (attempt {snap.attempt}, pid {snap.pid}; "
                f"this attempt {failed.attempt}, rank 0 pid {failed.rank0_pid})"
            )
            snap = None
        if snap is not None:
            failed.started_ns.update(snap.started_ns)
            failed.step.update(snap.step)
            failed.suspects = suspects_of(failed.started_ns, failed.step)
            failed.note = None
            if self.from_relay:
                self._one_blame_per_epoch(failed)
        elif not failed.started_ns:  # a failed second read takes nothing away from the first
            failed.note = note
        self._evidence[failed.incident_id] = self._describe(failed)

    def _one_blame_per_epoch(self, failed: FailedAttempt) -> None:
        """The relay's requests of one epoch are blamed for one failure only: an attempt that failed before the
        relay saw it serve (it crashed during its start) was sent nothing, and what the relay still holds from
        the last failure is not evidence against it."""
        epoch = max((failed.step.get(fp, 0) for fp in failed.suspects), default=0)
        if (
            self._relay_epoch is not None
            and epoch <= self._relay_epoch[0]
            and self._relay_epoch[1] != failed.incident_id
        ):
            failed.suspects = set()
            failed.note = "the relay sent no request to this attempt (it failed before it served)"
            return
        if failed.suspects:
            self._relay_epoch = (epoch, failed.incident_id)

    def _decide(self, failed: FailedAttempt) -> None:
        if self.after <= 0:
            return
        new = []
        for fp in sorted(failed.suspects):
            if fp in self.quarantined:
                continue
            incidents = [f.incident_id for f in self.loop if fp in f.suspects]
            if len(incidents) >= self.after:
                self.quarantined[fp] = incidents
                new.append(fp)
                log.warning(
                    "request quarantined: it was scheduled in the failing step of every one of these failed "
                    "attempts; the engine answers it 400 for the rest of the run",
                    event_name="request_quarantined",
                    fingerprint=fp,
                    incident_ids=incidents,
                )
        self._write()
        if not new:
            return
        self.decided.setdefault(failed.incident_id, []).extend(new)
        self.on_quarantined(len(new))
        self._evidence[failed.incident_id] = self._describe(failed)

    def suspects(self) -> list[str]:
        """The current crash loop's suspects not quarantined: the engine prefills each alone in its step."""
        return sorted({fp for f in self.loop for fp in f.suspects} - self.quarantined.keys())

    def _tell(self) -> None:
        if self.on_change is not None:
            self.on_change(self._incident, *self._said)

    def _write(self) -> None:
        """``quarantine.json`` when what it would say changed: before the next attempt starts (the relay is told
        at once)."""
        content = ({fp: list(ids) for fp, ids in self.quarantined.items()}, self.suspects())
        if content != self._said:
            self._said = content
            self._tell()
        if content == self._written:
            return
        try:
            runfiles.write_quarantine(self.run_dir, *content)
        except OSError as exc:
            log.warning(
                "run file not written: quarantined requests may run again",
                event_name="run_file_write_failed",
                file=str(self.run_dir / runfiles.QUARANTINE_FILE),
                error=repr(exc),
            )
            return
        self._written = content

    def _describe(self, failed: FailedAttempt) -> dict:
        started = failed.started_ns
        newest = max(started.values(), default=0)
        requests: dict = {
            "attempt": failed.attempt,
            "in_flight": sorted(started, key=lambda fp: (started[fp], fp)),
            # how long before the newest request each one was first scheduled (what makes the suspects)
            "started_ms_before_newest": {fp: round((newest - ns) / 1e6, 3) for fp, ns in started.items()},
            "suspects": sorted(failed.suspects),
            "quarantined": {fp: list(self.quarantined[fp]) for fp in self.decided.get(failed.incident_id, [])},
            "quarantine_after": self.after,
        }
        if failed.note:
            requests["note"] = failed.note
        return {"requests": requests}
