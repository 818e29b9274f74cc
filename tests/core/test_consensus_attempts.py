"""Consensus events carry their attempt, and the main loop drops a stale one (issue 11).

A verdict of attempt 1 reaches the main loop after attempt 2 started only
when attempt 1 ends during one pass of the consensus thread (a few
milliseconds): no run of real ranks hits that window on purpose.  So the rule
is shown in its two halves, each with the real objects: the real consensus
thread over real digest rings tags what it posts with the attempt it read
before the pass, and the real main loop drops an event whose attempt is not
the current one (its handler never runs).
"""

from __future__ import annotations

import queue
import time
from types import MappingProxyType

import pytest

from tp_supervise.consensus.monitor import ConsensusMonitor
from tp_supervise.supervisor.processes.attempt import Attempt, AttemptView, Published
from tp_supervise.supervisor.core import ATTEMPT_EVENTS, Supervisor
from tp_supervise.supervisor.rank import encoding
from tp_supervise.supervisor.rank.channel import ring_path
from tp_supervise.supervisor.rank.ring import RingWriter
from tp_supervise.supervisor.spec import LaunchSpec, MetricsOptions
from tp_supervise.supervisor.observers.consensus_thread import CONSENSUS_AGREE_STEPS, ConsensusThread
from tp_supervise.supervisor.events import ConsensusAgreed, DivergenceFound

EVENT_WAIT_S = 10.0  # generous: the thread polls every 5 ms


def view(number: int) -> AttemptView:
    return AttemptView(started_at=float(number), ranks=MappingProxyType({}), launcher=None, restarts=number - 1,
                       finished=False, number=number)


class Ranks:
    """Two ranks' digest rings, written as the rank-side runtime writes them."""

    def __init__(self, run_dir):
        self.writers = [RingWriter(ring_path(run_dir, s), slot=s, rank=s, depth=256, log_bytes=1 << 16)
                        for s in range(2)]
        self.step = 0

    def step_with(self, tokens: tuple[int, int]) -> None:
        for w, token in zip(self.writers, tokens):
            line = encoding.event_bytes("sample", [self.step, token])
            w.append(line)
            w.publish(self.step, encoding.digest(line), False, time.monotonic())
        self.step += 1

    def close(self) -> None:
        for w in self.writers:
            w.close()


def next_event(events: queue.SimpleQueue, kind: type):
    deadline = time.monotonic() + EVENT_WAIT_S
    while time.monotonic() < deadline:
        try:
            ev = events.get(timeout=0.1)
        except queue.Empty:
            continue
        if isinstance(ev, kind):
            return ev
    pytest.fail(f"no {kind.__name__} within {EVENT_WAIT_S} s")


def test_consensus_thread_tags_what_it_posts_with_the_attempt(tmp_path):
    cell = Published(view(1))
    events: queue.SimpleQueue = queue.SimpleQueue()
    ranks = Ranks(tmp_path)
    monitor = ConsensusMonitor(tmp_path, 2)
    thread = ConsensusThread(monitor, events.put, cell)
    thread.start()
    try:
        ranks.step_with((7, 7))
        ranks.step_with((7, 8))  # rank 1 samples another token
        found = next_event(events, DivergenceFound)
        assert found.attempt == 1 and found.verdict.culprit_ranks == (1,)

        for _ in range(CONSENSUS_AGREE_STEPS + 1):
            ranks.step_with((5, 5))
        agreed = next_event(events, ConsensusAgreed)
        assert agreed.attempt == 1

        # What it posted stays readable for that attempt: a rank that gloo aborts on the diverged batch can
        # reach the main loop before this event does, and the decider then still rules the divergence first.
        assert [ev.verdict for ev in thread.posted(1)] == [found.verdict] and thread.posted(2) == []

        cell.set(view(2))  # the main thread started attempt 2
        time.sleep(0.05)  # a few passes: the thread has read the new attempt
        assert thread.posted(1) == [], "attempt 1's divergences are forgotten once attempt 2 runs"
        ranks.step_with((3, 4))
        assert next_event(events, DivergenceFound).attempt == 2
        assert [ev.attempt for ev in thread.posted(2)] == [2]
    finally:
        thread.stop()
        ranks.close()
        monitor.close()


@pytest.fixture
def supervisor():
    spec = LaunchSpec(command=("rank-binary",), nproc_per_node=2, zero_code_hook=False, metrics=MetricsOptions(addr=None),
                      consensus="enforce", max_restarts=1)
    sup = Supervisor(spec, {}, run_id="stale-events")
    sup.monitor.start()  # what __init__ opened is closed by stop()
    yield sup
    sup.monitor.stop()
    sup.hurry.close()


def test_main_loop_drops_consensus_events_of_an_earlier_attempt(supervisor, tmp_path):
    assert DivergenceFound in ATTEMPT_EVENTS and ConsensusAgreed in ATTEMPT_EVENTS
    sup = supervisor
    sup.attempt = Attempt(sup.attempt_view.set, started_at=time.monotonic(), restarts=1, number=2)  # as restart() does
    sup.case.suspicions = {"divergence"}

    # A real verdict, as attempt 1's ranks would have produced it.
    ranks = Ranks(tmp_path)
    monitor = ConsensusMonitor(tmp_path, 2)
    try:
        ranks.step_with((1, 2))
        verdicts = monitor.settle(time.monotonic())
    finally:
        ranks.close()
        monitor.close()
    assert len(verdicts) == 1

    # Handled, the divergence would end attempt 2 with exit 82 (enforce) and the
    # agreement would clear the open suspicion: neither happens.
    sup._dispatch(DivergenceFound(verdicts[0], time.monotonic(), attempt=1), sup.handlers)
    sup._dispatch(ConsensusAgreed(CONSENSUS_AGREE_STEPS, time.monotonic(), attempt=1), sup.handlers)
    assert sup.attempt.outcome is None
    assert sup.case.suspicions == {"divergence"}

    # The same event of the current attempt is acted on.
    sup._dispatch(ConsensusAgreed(CONSENSUS_AGREE_STEPS, time.monotonic(), attempt=2), sup.handlers)
    assert sup.case.suspicions == set()
