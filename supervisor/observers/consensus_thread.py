"""Consensus pollers: the ranks' digest rings on this node, and the other nodes' through the store.

They read shared memory (and, across nodes, the store through their own
client), run ``consensus/``'s comparison and post ``DivergenceFound`` /
``ConsensusAgreed``; they never act on a verdict.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from ..events import ConsensusAgreed, DivergenceFound
from ..processes.attempt import PerAttempt
from ..processes.pidfds import named_thread

if TYPE_CHECKING:
    from tp_supervise.consensus.across_nodes import NodeDigests

    from ..nodes.store import Store
    from ..processes.attempt import AttemptView

log = structlog.get_logger("supervise.consensus")

THREAD_JOIN_S = 2.0
CONSENSUS_POLL_S = 0.005


# No rank records consensus events (a program that is not the built-in engine, or ranks not started yet):
# look for their rings this often instead, so a supervisor of such ranks costs ~0.1 % of a core, not 3 %.
CONSENSUS_IDLE_POLL_S = 0.1


CONSENSUS_ERROR_BACKOFF_S = 0.5


# Steps compared without a mismatch before an observed divergence counts as over.
CONSENSUS_AGREE_STEPS = 20


@dataclass
class ConsensusWatch:
    """What the consensus thread keeps of one attempt (a fresh one per attempt: ``PerAttempt``): an open
    divergence's counts (its agreement belongs to this attempt only) and the divergences it posted."""

    number: int
    open_at: tuple[int, int] | None = None  # (comparisons, mismatches) at the last divergence
    posted: list[DivergenceFound] = field(default_factory=list)  # in the order posted


class ConsensusThread:
    """Polls the consensus monitor every few ms and posts divergences.

    Each pass reads ``attempt()`` (the main thread's latest ``AttemptView``)
    once, before it polls, and tags what it posts with that number: a verdict
    of an attempt that ended while the pass ran reaches the main loop as a
    stale event and is dropped there.  A new attempt also forgets an open
    divergence (its agreement would belong to the attempt that ended).
    """

    def __init__(self, monitor, post: Callable[[object], None], attempt: Callable[[], AttemptView]):
        self.monitor = monitor
        self.post = post
        self.attempt = attempt
        self._stop = threading.Event()
        self._thread = named_thread(self._run, "consensus")
        self._lock = threading.Lock()
        self.watches: PerAttempt[ConsensusWatch] = PerAttempt(lambda view, _ended: ConsensusWatch(view.number))
        self._watch = ConsensusWatch(0)  # the attempt being watched; the main thread reads its divergences

    def start(self) -> None:
        self._thread.start()

    def posted(self, attempt: int) -> list[DivergenceFound]:
        """The divergences this thread posted for ``attempt``: one may still wait in the main loop's queue
        behind the exit it caused (gloo aborts a rank on a batch of another size the moment it is compared)."""
        with self._lock:
            watch = self._watch
        return list(watch.posted) if watch.number == attempt else []

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=THREAD_JOIN_S)

    def _run(self) -> None:
        interval = CONSENSUS_IDLE_POLL_S
        while not self._stop.wait(interval):
            try:
                watch = self.watches.of(self.attempt())
                with self._lock:
                    self._watch = watch
                number = watch.number
                verdicts = self.monitor.poll(time.monotonic())
                for verdict in verdicts:
                    found = DivergenceFound(verdict, time.monotonic(), number)
                    with self._lock:
                        watch.posted.append(found)
                    self.post(found)
                comparisons, mismatches = self.monitor.counts()
                open_at = watch.open_at
                if verdicts:
                    watch.open_at = (comparisons, mismatches)
                elif open_at is not None and mismatches > open_at[1]:
                    watch.open_at = (comparisons, mismatches)  # still disagreeing
                elif open_at is not None and comparisons - open_at[0] >= CONSENSUS_AGREE_STEPS:
                    self.post(ConsensusAgreed(comparisons - open_at[0], time.monotonic(), number))
                    watch.open_at = None
                interval = CONSENSUS_POLL_S if self.monitor.rings_open() else CONSENSUS_IDLE_POLL_S
            except Exception as exc:
                log.error("consensus pass failed", error=repr(exc))
                self._stop.wait(CONSENSUS_ERROR_BACKOFF_S)


NODE_CONSENSUS_TICK_S = 0.05


NODE_CONSENSUS_ERROR_BACKOFF_S = 1.0


class NodeConsensusThread:
    """Multi-node: the steps this node's ranks agreed on, compared with the other nodes' (consensus.across_nodes).

    Its own store client on its own thread: a slow store delays this
    comparison only, never the local one, the fault bus or a teardown.  A
    divergence is posted (and acted on) only by a node that holds a culprit
    rank; the reference nodes log it and learn the end from the fault bus.
    """

    def __init__(
        self,
        monitor,
        connect: Callable[[], Store],
        node_rank: int,
        nnodes: int,
        nproc_per_node: int,
        post: Callable[[object], None],
        attempt: Callable[[], AttemptView],
    ):
        self.monitor = monitor
        self.connect = connect
        self.node_rank, self.nnodes, self.nproc_per_node = node_rank, nnodes, nproc_per_node
        self.post = post
        self.attempt = attempt  # read once per pass: its number tags the divergences posted (as ConsensusThread)
        self.exchange: NodeDigests | None = None
        self.exchange_attempt = 0
        self.store: Store | None = None
        self._stop = threading.Event()
        self._thread = named_thread(self._run, "node-consensus")

    def start(self) -> None:
        self.monitor.keep_agreed()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=THREAD_JOIN_S)  # a store call in flight has its own timeout; daemon otherwise

    def _run(self) -> None:
        from tp_supervise.consensus.across_nodes import NodeDigests

        failed_with = None
        while not self._stop.wait(NODE_CONSENSUS_TICK_S):
            try:
                number = self.attempt().number
                if self.exchange is None or self.exchange_attempt != number:
                    # a new group attempt counts steps from 0 again: a fresh comparison under its own keys
                    self.store = self.store or self.connect()
                    self.exchange = NodeDigests(
                        self.store, self.node_rank, self.nnodes, self.nproc_per_node, attempt=number
                    )
                    self.exchange_attempt = number
                    self.monitor.take_agreed()  # steps of the attempt that ended are not compared with this one's
                now = time.monotonic()
                self.exchange.agreed(self.monitor.take_agreed(), now)
                for verdict in self.exchange.tick(now):
                    mine = [r for r in verdict.culprit_ranks if r // self.nproc_per_node == self.node_rank]
                    log.warning(
                        "divergence across nodes",
                        step=verdict.step,
                        culprit_ranks=list(verdict.culprit_ranks),
                        verdict=verdict.verdict,
                        acted_on_here=bool(mine),
                    )
                    if mine:
                        self.post(DivergenceFound(verdict, time.monotonic(), number))
                failed_with = None
            except Exception as exc:  # the store went away or answered late: say so once, keep trying
                if type(exc) is not failed_with:
                    log.warning("cross-node consensus pass failed", error=repr(exc))
                    failed_with = type(exc)
                self._stop.wait(NODE_CONSENSUS_ERROR_BACKOFF_S)
