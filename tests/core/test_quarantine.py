"""The supervisor's side of the run-dir files (supervisor/incidents/quarantine.py), against the engine's own writer.

Real files: ``inflight-rank0`` written by ``engine.runfiles.InflightFile`` (the
mmap rank 0 uses), ``quarantine.json`` read back by the engine's parser,
``incident`` by its reader.  The attempts are ``AttemptView`` values as the
main loop publishes them; rank 0 is this process (the file's writer pid).
"""

from __future__ import annotations

import os
import time
from types import MappingProxyType

import pytest

from tp_supervise.engine import runfiles
from tp_supervise.supervisor.incidents.quarantine import RequestQuarantine
from tp_supervise.supervisor.processes.attempt import AttemptView, RankView
from tp_supervise.supervisor.restart import RESTART_STABLE_S, crash_loop_over

STEP_S = 0.03  # between two engine steps: a forward pass of the CPU engine
POISON, B1, B2, B3 = "aa" * 16, "b1" * 16, "b2" * 16, "b3" * 16


def view(restarts: int, started_at: float = 1.0, rank0: int | None = None) -> AttemptView:
    """An attempt of two ranks on this node; rank 0's pid is this process (the in-flight file's writer)."""
    ranks = {0: RankView(0, 0, os.getpid() if rank0 is None else rank0, started_at),
             1: RankView(1, 1, 1, started_at)}
    return AttemptView(started_at, MappingProxyType(ranks), None, restarts, finished=True, number=restarts + 1)


def in_flight(run_dir, attempt: int, *steps: tuple[str, ...], record_steps: bool = True) -> runfiles.InflightFile:
    """The engine's writer: each tuple is one engine step's new requests, a step apart (with the step's index, or,
    ``record_steps`` False, as an engine that records none)."""
    f = runfiles.InflightFile(runfiles.inflight_path(run_dir, 0), nslots=8, attempt=attempt)
    for i, step in enumerate(steps):
        if i:
            time.sleep(STEP_S)
        for fp in step:
            f.add(f"req-{fp}", fp, step=i + 1 if record_steps else 0)
    return f


def listed(run_dir) -> tuple[dict, list[str]]:
    """``quarantine.json`` as the engine reads it: the quarantined fingerprints and the suspects."""
    entries, suspects = runfiles.parse_quarantine_file((run_dir / runfiles.QUARANTINE_FILE).read_bytes())
    return entries, sorted(suspects)


@pytest.fixture
def book(tmp_path):
    counted: list[int] = []
    q = RequestQuarantine(tmp_path, after=2, crash_loop_over=crash_loop_over, on_quarantined=counted.append)
    q.counted = counted
    return q


@pytest.mark.parametrize("record_steps", [True, False], ids=["step-index", "start-time"])
def test_only_the_request_the_failing_step_started_twice_is_quarantined(book, tmp_path, record_steps):
    req = book.before_attempt()
    f = in_flight(tmp_path, 0, (B1, B2), (POISON,), record_steps=record_steps)  # bystanders decoding, the poison new
    book.fault(req, "inc-1", view(0), now=2.0)
    assert runfiles.read_incident(tmp_path) == "inc-1"
    f.close()
    book.attempt_ended(req)
    assert listed(tmp_path) == ({}, [POISON])  # suspected, not yet quarantined: the engine prefills it alone
    evidence = book.evidence("inc-1")["requests"]
    assert evidence["suspects"] == [POISON] and evidence["in_flight"] == [B1, B2, POISON]
    assert evidence["started_ms_before_newest"][POISON] == 0.0

    req = book.before_attempt()
    assert runfiles.read_incident(tmp_path) is None
    # the clients retried all three: the next attempt's first step schedules them together
    f = in_flight(tmp_path, 1, (B1, B2, POISON), record_steps=record_steps)
    book.fault(req, "inc-2", view(1), now=2.0)
    f.close()
    book.attempt_ended(req)
    assert listed(tmp_path) == ({POISON: ("inc-1", "inc-2")}, [B1, B2])  # suspects of inc-2 only: not quarantined
    assert book.counted == [1]
    assert book.evidence("inc-2")["requests"]["quarantined"] == {POISON: ["inc-1", "inc-2"]}


def test_the_relay_is_told_what_the_files_say_when_it_changes(book, tmp_path):
    """The relay polls none of the files: ``on_change`` gets the incident at the ruling and None before the next
    attempt, and the quarantine whenever quarantine.json's content changes (the same content)."""
    told: list[tuple] = []
    book.on_change = lambda incident, quarantined, suspects: told.append((incident, quarantined, suspects))
    req = book.before_attempt()
    in_flight(tmp_path, 0, (B1,), (POISON,)).close()
    book.fault(req, "inc-1", view(0), now=2.0)
    book.attempt_ended(req)
    req = book.before_attempt()
    in_flight(tmp_path, 1, (POISON,)).close()
    book.fault(req, "inc-2", view(1), now=2.0)
    book.attempt_ended(req)
    req = book.before_attempt()
    assert told == [
        (None, {}, []),
        ("inc-1", {}, []),
        ("inc-1", {}, [POISON]),  # suspected at the ruling's first read
        (None, {}, [POISON]),
        ("inc-2", {}, [POISON]),
        ("inc-2", {POISON: ["inc-1", "inc-2"]}, []),
        (None, {POISON: ["inc-1", "inc-2"]}, []),
    ], told
    entries, suspects = listed(tmp_path)
    assert (entries, suspects) == ({POISON: ("inc-1", "inc-2")}, [])


def test_co_arrivals_are_suspects_once_and_only_the_poison_request_fails_alone_again(book, tmp_path):
    """The bystanders that arrived with the poison request share its step in the first failure; the engine then
    prefills each suspect alone, so the second failing step started only the poison request."""
    req = book.before_attempt()
    in_flight(tmp_path, 0, (B3,), (B1, B2, POISON)).close()
    book.fault(req, "inc-1", view(0), now=2.0)
    book.attempt_ended(req)
    assert listed(tmp_path) == ({}, sorted([B1, B2, POISON]))
    req = book.before_attempt()
    in_flight(tmp_path, 1, (B3,), (B1,), (POISON,)).close()  # B1 ran alone and decodes; the poison fails alone
    book.fault(req, "inc-2", view(1), now=2.0)
    book.attempt_ended(req)
    assert book.evidence("inc-2")["requests"]["suspects"] == [POISON]
    assert listed(tmp_path) == ({POISON: ("inc-1", "inc-2")}, sorted([B1, B2]))  # still suspected: still alone
    assert book.counted == [1]


def test_co_arrivals_scheduled_together_again_are_quarantined_with_it(book, tmp_path):
    """The limit the suspects list removes: an engine that ignores it schedules the retried co-arrivals together."""
    for n in range(2):
        req = book.before_attempt()
        in_flight(tmp_path, n, (B1, POISON)).close()
        book.fault(req, f"inc-{n}", view(n), now=2.0)
        book.attempt_ended(req)
    assert listed(tmp_path) == ({B1: ("inc-0", "inc-1"), POISON: ("inc-0", "inc-1")}, [])


def test_an_earlier_attempts_file_is_no_evidence(book, tmp_path):
    req = book.before_attempt()
    f = in_flight(tmp_path, 0, (POISON,))
    f.close()
    book.fault(req, "inc-1", view(0), now=2.0)
    req = book.before_attempt()
    book.fault(req, "inc-2", view(1), now=2.0)  # rank 0 of attempt 1 never wrote its file: attempt 0's is still there
    book.attempt_ended(req)
    evidence = book.evidence("inc-2")["requests"]
    assert evidence["in_flight"] == [] and "earlier attempt" in evidence["note"]
    assert listed(tmp_path) == ({}, [POISON])  # the suspect of inc-1 only
    f = in_flight(tmp_path, 2, (POISON,))
    req = book.before_attempt()
    book.fault(req, "inc-3", view(2, rank0=os.getpid() + 1), now=2.0)  # right attempt, another writer
    f.close()
    assert "earlier attempt" in book.evidence("inc-3")["requests"]["note"]


def test_an_attempt_that_stayed_up_starts_a_new_crash_loop(book, tmp_path):
    req = book.before_attempt()
    in_flight(tmp_path, 0, (POISON,)).close()
    book.fault(req, "inc-1", view(0, started_at=1.0), now=2.0)
    req = book.before_attempt()
    in_flight(tmp_path, 1, (POISON,)).close()
    book.fault(req, "inc-2", view(1, started_at=10.0), now=10.0 + RESTART_STABLE_S)
    assert listed(tmp_path) == ({}, [POISON])  # suspected again in a new loop, not quarantined
    req = book.before_attempt()
    in_flight(tmp_path, 2, (POISON,)).close()
    book.fault(req, "inc-3", view(2, started_at=1000.0), now=1001.0)
    assert listed(tmp_path) == ({POISON: ("inc-2", "inc-3")}, [])


def test_zero_never_quarantines_and_a_missing_file_is_said(tmp_path):
    q = RequestQuarantine(tmp_path, after=0, crash_loop_over=crash_loop_over, on_quarantined=lambda n: None)
    for n in range(3):
        req = q.before_attempt()
        in_flight(tmp_path, n, (POISON,)).close()
        q.fault(req, f"inc-{n}", view(n), now=2.0)
    assert not (tmp_path / runfiles.QUARANTINE_FILE).exists()
    os.unlink(runfiles.inflight_path(tmp_path, 0))
    q.fault(q.before_attempt(), "inc-9", view(9), now=2.0)
    assert "no in-flight file" in q.evidence("inc-9")["requests"]["note"]


def test_the_first_incident_of_an_attempt_stays_and_a_node_without_rank_0_reads_nothing(book, tmp_path):
    req = book.before_attempt()
    node1 = AttemptView(1.0, MappingProxyType({1: RankView(1, 1, 1, 1.0)}), None, 0, finished=True, number=1)
    book.fault(req, "inc-1", node1, now=2.0)
    book.fault(req, "inc-2", view(0), now=2.0)
    assert runfiles.read_incident(tmp_path) == "inc-1"
    assert book.evidence("inc-1") == {} and book.evidence("inc-2") == {}
