"""The incident desk's deadlines (issue 11), with stalls injected into a real desk.

A capture or a write that never returns costs the main thread at most
--dump-timeout; a second stop signal cuts even that; the bundle of a
capture cut short says it is incomplete; nothing the desk started keeps
the supervisor from exiting.  (tests/e2e/test_dump_deadline.py does the
same with real processes and a dump directory that really blocks.)
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
import structlog

from tp_supervise.supervisor.incidents import desk as incidents
from tp_supervise.supervisor.processes.attempt import AttemptView, RankView
from tp_supervise.supervisor.processes.exits import ExitInfo
from tp_supervise.supervisor.incidents.desk import SETTLE_MIN_S, SOFT_WORKER_JOIN_S, IncidentDesk
from tp_supervise.supervisor.signals import Hurry
from tp_supervise.supervisor.spec import DumpOptions, LaunchSpec, MetricsOptions

DUMP_TIMEOUT_S = 0.5
SLACK_S = 0.5  # a loaded 2-core machine
RELEASE_WAIT_S = 10.0


class NoGpu:
    available = False

    def latest(self):
        return None


@pytest.fixture
def rank():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def hurry():
    h = Hurry()
    yield h
    h.close()


def make_desk(tmp_path, hurry, dumps: list, dump_timeout: float = DUMP_TIMEOUT_S) -> IncidentDesk:
    spec = LaunchSpec(command=("sleep", "60"), nproc_per_node=1, metrics=MetricsOptions(addr=None),
                      dumps=DumpOptions(dir=tmp_path / "dumps", timeout=dump_timeout, stack_method="none"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return IncidentDesk(spec, "run-1", run_dir, read_heartbeats=list,
                        on_dump=lambda *a: dumps.append(a), gpu=NoGpu(), hurry=hurry)


def attempt_of(proc) -> AttemptView:
    return AttemptView(started_at=1.0, ranks={0: RankView(0, 0, proc.pid, 1.0)}, launcher=None, restarts=0,
                       finished=False)


def exit_info() -> ExitInfo:
    return ExitInfo(status=None, reason="nonzero", description="exited with code 1")


def hang_verdict():
    return SimpleNamespace(verdict=SimpleNamespace(to_dict=lambda: {"kind": "hard"}), stalled_s=6.0,
                           at=time.monotonic(), message="no progress")


def stall(release: threading.Event, fn):
    def stalled(*args, **kwargs):
        release.wait(RELEASE_WAIT_S)
        return fn(*args, **kwargs)

    return stalled


def timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def bundle_summary(tmp_path) -> dict:
    [bundle] = [p for p in (tmp_path / "dumps").iterdir() if not p.name.startswith(".")]
    return json.loads((bundle / "summary.json").read_text())


def test_a_capture_that_never_returns_costs_at_most_dump_timeout(tmp_path, hurry, rank, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(incidents, "capture_incident", stall(release, incidents.capture_incident))
    dumps: list = []
    desk = make_desk(tmp_path, hurry, dumps)
    try:
        culprits, took = timed(lambda: desk.hard_hang(hang_verdict(), attempt_of(rank)))
        assert culprits == []  # no verdict yet: the outcome names none
        assert DUMP_TIMEOUT_S <= took < DUMP_TIMEOUT_S + SLACK_S
        release.set()  # the capture ends after the teardown started: the bundle is finished, marked incomplete
        desk.settle()
        summary = bundle_summary(tmp_path)
        assert summary["reason"] == "hang"
        assert f"--dump-timeout {DUMP_TIMEOUT_S:g} s" in summary["incomplete"]["why"]
        assert "stacks/rank-0.txt" in summary["incomplete"]["missing"]  # stack method none: no stacks
        assert [d[:2] for d in dumps] == [("hang", True)]
    finally:
        release.set()
        desk.close()


def test_a_write_that_never_returns_does_not_hold_the_exit(tmp_path, hurry, rank):
    release = threading.Event()
    dumps: list = []
    desk = make_desk(tmp_path, hurry, dumps)
    desk.writer.write = stall(release, desk.writer.write)
    try:
        with structlog.testing.capture_logs() as logs:
            _, took = timed(lambda: desk.rank_exit(RankView(0, 0, rank.pid, 1.0), exit_info(), attempt_of(rank)))
            assert took < DUMP_TIMEOUT_S, "the main thread waited for the write"
            _, took = timed(desk.settle)
            assert took < max(DUMP_TIMEOUT_S, SETTLE_MIN_S) + SLACK_S
        assert [d[:2] for d in dumps] == [("rank_exit", False)]
        assert any("not written within --dump-timeout" in e["event"] for e in logs)
        with structlog.testing.capture_logs() as logs:
            release.set()  # the disk comes back while the process still runs: the bundle lands late
            end = time.monotonic() + RELEASE_WAIT_S
            while not any(e["event"] == "incident bundle written" for e in logs) and time.monotonic() < end:
                time.sleep(0.02)
        assert any(e.get("late") for e in logs if e["event"] == "incident bundle written")
        assert len(dumps) == 1, "a late bundle is not counted twice"
        assert bundle_summary(tmp_path)["culprit_ranks"] == [0]
    finally:
        release.set()
        desk.close()


def test_a_second_stop_signal_cuts_the_wait_for_the_capture(tmp_path, hurry, rank, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(incidents, "capture_incident", stall(release, incidents.capture_incident))
    desk = make_desk(tmp_path, hurry, [], dump_timeout=30.0)
    timer = threading.Timer(0.1, hurry.set)
    timer.start()
    try:
        _, took = timed(lambda: desk.hard_hang(hang_verdict(), attempt_of(rank)))
        assert took < 0.1 + SLACK_S
        _, took = timed(desk.settle)
        assert took < SLACK_S, "settle waited although a second stop signal came"
    finally:
        timer.cancel()
        release.set()
        desk.close()


def test_a_stuck_soft_dump_blocks_neither_settle_nor_close(tmp_path, hurry, rank):
    release = threading.Event()
    dumps: list = []
    desk = make_desk(tmp_path, hurry, dumps)
    desk.writer.write = stall(release, desk.writer.write)
    try:
        reply: queue.SimpleQueue = queue.SimpleQueue()
        _, took = timed(lambda: desk.on_demand(reply, attempt_of(rank)))
        assert took < 0.05
        _, took = timed(desk.settle)
        assert took < max(DUMP_TIMEOUT_S, SETTLE_MIN_S) + SLACK_S
        _, took = timed(desk.close)
        assert took < SOFT_WORKER_JOIN_S + SLACK_S
        assert [d[:2] for d in dumps] == [("on_demand", False)]
    finally:
        release.set()
    assert reply.get(timeout=RELEASE_WAIT_S)["ok"]
