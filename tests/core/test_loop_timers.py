"""The main loop's timers: one deadline heap, a clock passed in (supervisor/loop.py; issue 37).

A window is driven by moving a fake clock: nothing sleeps, so the tests show the
window's edges exactly (a moment before: nothing; at its end: the event), which
a test with real timers could only bound.  The hold is the real one: a rank of
a group of nodes that failed with a broken peer connection on its stderr (a real
pipe read by the real output pump) waits CONSEQUENCE_WAIT_S from its exit for
the other nodes' news, through the real decider's dispatch and rules.
"""

from __future__ import annotations

import os
import time

import pytest

from tp_supervise.supervisor.core import Supervisor
from tp_supervise.supervisor.events import ConsequenceWindowOver, StderrCheck
from tp_supervise.supervisor.loop import Loop
from tp_supervise.supervisor.multinode import CONSEQUENCE_WAIT_S, STDERR_READ_S, GroupOfNodes
from tp_supervise.supervisor.processes import output_pump
from tp_supervise.supervisor.processes.attempt import Attempt
from tp_supervise.supervisor.processes.exits import ExitInfo, ExitStatus
from tp_supervise.supervisor.processes.output_pump import Source
from tp_supervise.supervisor.processes.spawn import RankHandle, RankSpec
from tp_supervise.supervisor.spec import LaunchSpec, MetricsOptions, OutputOptions

DRAIN_WAIT_S = 10.0  # real time for the pump thread to read a closed pipe (milliseconds, generous)


class FakeClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_timers_come_out_at_their_time_earliest_first_before_posted_events_and_cancelled_ones_never():
    clock = FakeClock(100.0)
    loop = Loop(clock)
    late = loop.after(2.0, "late")
    loop.after(1.0, "early")
    dropped = loop.at(100.5, "cancelled")
    dropped.cancel()
    assert loop.due() is None and loop.next_deadline() == 101.0
    clock.now = 100.999
    assert loop.due() is None
    clock.now = 102.0
    loop.post("posted")
    assert [loop.next(), loop.next(), loop.next()] == ["early", "late", "posted"], "due timers first"
    assert late.when == 102.0 and loop.next_deadline() is None
    t0 = time.monotonic()
    assert loop.next(until=clock.now) is None, "nothing due, nothing posted: the wait ends at `until`"
    assert time.monotonic() - t0 < 1.0


@pytest.fixture
def pump():
    with output_pump.install(OutputOptions(), "json") as pump:
        yield pump


def rank_died_saying(pump, rank: int, text: bytes) -> None:
    streams = pump.open(Source(rank=rank, local_rank=rank), "timers")
    os.write(streams.stderr, text)
    streams.started()  # our write ends closed: the pump reads to EOF
    tail = pump.stderr_tail(rank)
    deadline = time.monotonic() + DRAIN_WAIT_S
    while not tail.drained():
        assert time.monotonic() < deadline, "the pump never drained a closed pipe"
        time.sleep(0.01)


def group_supervisor(clock: FakeClock) -> Supervisor:
    spec = LaunchSpec(command=("rank-binary",), nproc_per_node=2, zero_code_hook=False,
                      metrics=MetricsOptions(addr=None))  # fmt: skip
    sup = Supervisor(spec, {}, run_id="timers", clock=clock)
    sup.monitor.start()  # what __init__ opened is closed by stop()
    sup.node_rules = GroupOfNodes(spec, sup.run_id, link=None, transport=None)  # no news comes: nothing is sent
    sup.attempt = Attempt(sup.attempt_view.set, started_at=clock(), number=1)
    return sup


def fail(sup: Supervisor, handle: RankHandle, info: ExitInfo) -> None:
    """What the decider does with a failed rank of a group of nodes (``_rank_failed`` past its divergence check):
    the rules hold it, the loop executes the hold."""
    sup._act_on_nodes(sup.node_rules.hold_failure(handle, info, sup.case, sup.attempt.number, sup.clock()))


def test_a_failure_held_for_the_other_nodes_news_is_ruled_at_the_end_of_its_window(pump):
    clock = FakeClock(500.0)
    sup = group_supervisor(clock)
    try:
        ruled: list[int] = []
        sup._rule_rank_failure = lambda handle, info: ruled.append(handle.rank)  # the ruling's effect: a bundle
        handle = RankHandle(spec=RankSpec(slot=1, rank=1, argv=(), env={}), pid=4_000_001, started_at=clock())
        handle.exited_at = exited_at = clock()
        info = ExitInfo(ExitStatus(code=1, signal=None), "exited", "exited with code 1")
        rank_died_saying(pump, 1, b"Traceback ...\nRuntimeError: [gloo] Connection reset by peer\n")

        fail(sup, handle, info)
        check = sup.loop.due()  # armed for now: the stderr is read at once
        assert isinstance(check, StderrCheck) and check.until == exited_at + STDERR_READ_S
        assert sup.loop.next_deadline() is None, "one timer armed"
        sup._dispatch(check, sup.handlers)  # the stderr says: a peer's connection broke
        assert sup.loop.next_deadline() == exited_at + CONSEQUENCE_WAIT_S

        clock.now = exited_at + CONSEQUENCE_WAIT_S - 0.001
        assert sup.loop.due() is None and ruled == [], "inside the window: held for another node's fault"
        clock.now = exited_at + CONSEQUENCE_WAIT_S
        window = sup.loop.due()
        assert isinstance(window, ConsequenceWindowOver) and sup.loop.next_deadline() is None, "one timer armed"
        sup._dispatch(window, sup.handlers)
        assert ruled == [1], "no news by the end of the window: this node's own failure"
    finally:
        sup.monitor.stop()
        sup.hurry.close()


def test_a_failure_whose_stderr_blames_no_peer_is_ruled_at_once_and_one_never_drained_waits_at_most_its_read_time(pump):
    clock = FakeClock(700.0)
    sup = group_supervisor(clock)
    try:
        ruled: list[int] = []
        sup._rule_rank_failure = lambda handle, info: ruled.append(handle.rank)
        info = ExitInfo(ExitStatus(code=1, signal=None), "exited", "exited with code 1")
        own = RankHandle(spec=RankSpec(slot=0, rank=0, argv=(), env={}), pid=4_000_000, started_at=clock())
        own.exited_at = clock()
        rank_died_saying(pump, 0, b"ValueError: a bug of its own\n")
        fail(sup, own, info)
        sup._dispatch(sup.loop.due(), sup.handlers)
        assert ruled == [0] and sup.loop.next_deadline() is None

        # A rank whose stderr is still open (a child of it holds the pipe): looked at again until its read time.
        streams = pump.open(Source(rank=1, local_rank=1), "timers")
        keep = os.dup(streams.stderr)
        streams.started()
        try:
            late = RankHandle(spec=RankSpec(slot=1, rank=1, argv=(), env={}), pid=4_000_001, started_at=clock())
            late.exited_at = clock()
            fail(sup, late, info)
            looks = 0
            while (when := sup.loop.next_deadline()) is not None:
                clock.now = when
                look = sup.loop.due()
                assert isinstance(look, StderrCheck), look
                sup._dispatch(look, sup.handlers)
                looks += 1
            assert ruled == [0, 1] and clock.now >= late.exited_at + STDERR_READ_S
            assert looks < 100, "looked again every few tens of milliseconds, not in a busy loop"
        finally:
            os.close(keep)
    finally:
        sup.monitor.stop()
        sup.hurry.close()

