"""The engine loops, one per role.

=====================  =======================================================
BroadcastLeader        rank 0, broadcast plane: drain requests, schedule,
                       publish the plan, execute it, deliver outputs
BroadcastWorker        rank > 0, broadcast plane: receive plans and execute
                       them; no scheduler (rank 0's tokens are authoritative)
ReplicatedRank         every rank, replicated plane: exchange rank 0's inputs
                       over gloo, schedule locally, execute, apply own tokens
=====================  =======================================================

One engine step = one loop iteration that runs a batch.  Each step is
reported through ``instrument.step(index)`` (same index on every rank) with
the consensus events of the step: ``batch`` (seq id, start, tokens per item)
and ``tokens`` (this rank's sampled ids) on every rank, plus ``requests`` and
``stops`` in the replicated plane, where every rank decides them.

Idle loops block (queue wait, zmq poll, or the gloo broadcast that rank 0
sends every ``REPLICATED_IDLE_TICK_S``); none of them spins.

Rank 0 also keeps the in-flight fingerprints (engine/runfiles.py): a request
is recorded when a step first schedules it and removed when it finished or
was aborted.  An exception out of a loop (a collective raised because a peer
died, an injected crash) leaves the record as it was for the supervisor; the
caller (engine/app.py) answers the frontend's requests.
"""

from __future__ import annotations

from . import instrument
from .bridge import ControlMessage, EngineBridge
from .comm import TPComm
from .inject import FaultInjector
from .log import get_logger
from .planes import PlanPublisher, PlanSubscriber, RequestExchange, Shutdown
from .runfiles import InflightRequests
from .runner import ModelRunner
from .scheduler import Scheduler, StepPlan

IDLE_WAIT_S = 0.5  # how long an idle rank 0 / worker blocks before looking again
REPLICATED_IDLE_TICK_S = 0.25  # idle period between request broadcasts (replicated plane)
SHUTDOWN_MESSAGE = "engine is shutting down"

log = get_logger()


def _diverged(plan: StepPlan, injector: FaultInjector) -> StepPlan:
    """The plan this rank actually runs (diverge_batch drops the newest sequence)."""
    if injector.diverge_batch() and plan.items:
        log.warning("inject: diverging batch", kind="diverge_batch", step=plan.index, dropped=plan.items[-1].seq_id)
        return plan.without_last()
    return plan


def _apply(scheduler: Scheduler, msg: ControlMessage) -> list[str]:
    """Feed a control message to a scheduler; returns ids of requests it refused."""
    refused = []
    for req in msg.requests:
        try:
            scheduler.add(req)
        except ValueError as exc:
            log.warning("request refused", request_id=req.request_id, error=str(exc))
            refused.append(req.request_id)
    for seq_id in msg.aborts:
        scheduler.abort(seq_id)
    return refused


def _next_plan(
    scheduler: Scheduler, msg: ControlMessage, bridge: EngineBridge | None, inflight: InflightRequests
) -> StepPlan | None:
    """Apply ``msg``, fail what the scheduler refused, then schedule unless ``msg`` shuts down.

    ``None`` means nothing to run or shutdown; callers test ``msg.shutdown`` first
    to leave their loop.  Shared so both schedulers admit requests identically.
    """
    refused = _apply(scheduler, msg)
    inflight.arrived(msg.requests)
    inflight.done([*msg.aborts, *refused])
    if bridge is not None and refused:
        bridge.fail(refused, "request refused by the scheduler")
    if msg.shutdown:
        return None
    instrument.phase("schedule")
    return scheduler.schedule()


def _execute(
    plan: StepPlan, runner: ModelRunner, injector: FaultInjector, publisher: PlanPublisher | None = None
) -> tuple[StepPlan, list[int]]:
    """Run one step's batch on this rank, inside the caller's ``instrument.step``.

    One sequence for every role so the consensus events and inject hooks stay in
    the same order everywhere; a broadcast leader publishes the full plan after
    ``begin_step`` and before it diverges.  Returns the plan this rank ran and its tokens.
    """
    injector.begin_step(plan.has_decode)
    if injector.wants_prompts:
        injector.check_prompts([it.token_ids for it in plan.items if it.is_prefill])
    if publisher is not None:
        publisher.publish(plan)
    mine = _diverged(plan, injector)
    instrument.record("batch", mine.describe())
    tokens = runner.execute(mine)
    instrument.record("tokens", tokens)
    return mine, tokens


class BroadcastLeader:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        bridge: EngineBridge,
        publisher: PlanPublisher | None,
        injector: FaultInjector,
        inflight: InflightRequests,
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.bridge = bridge
        self.publisher = publisher
        self.injector = injector
        self.inflight = inflight

    def run(self) -> None:
        while True:
            busy = self.scheduler.has_work()
            if not busy:
                instrument.phase("idle")
            msg = self.bridge.drain(0 if busy else IDLE_WAIT_S)
            plan = _next_plan(self.scheduler, msg, self.bridge, self.inflight)
            if msg.shutdown:
                break
            if plan is None:
                continue
            self.inflight.running(plan)
            with instrument.step(plan.index):
                mine, tokens = _execute(plan, self.runner, self.injector, self.publisher)
                outputs = self.scheduler.complete(mine, tokens)
            self.inflight.finished(outputs)  # before the clients hear of it
            self.bridge.deliver(outputs)
        if self.publisher is not None:
            self.publisher.publish(Shutdown(SHUTDOWN_MESSAGE))
        self.bridge.fail_all(SHUTDOWN_MESSAGE)
        self.inflight.clear()


class BroadcastWorker:
    def __init__(self, runner: ModelRunner, subscriber: PlanSubscriber, injector: FaultInjector):
        self.runner = runner
        self.subscriber = subscriber
        self.injector = injector

    def run(self) -> None:
        while True:
            instrument.phase("wait_plan")
            msg = self.subscriber.recv(IDLE_WAIT_S)
            if msg is None:
                continue
            if isinstance(msg, Shutdown):
                break
            with instrument.step(msg.index):
                _execute(msg, self.runner, self.injector)


class ReplicatedRank:
    def __init__(
        self,
        rank: int,
        runner: ModelRunner,
        scheduler: Scheduler,
        exchange: RequestExchange,
        comm: TPComm,
        injector: FaultInjector,
        bridge: EngineBridge | None,
        sync_token_ids: bool,
        inflight: InflightRequests,
    ):
        self.rank = rank
        self.inflight = inflight
        self.runner = runner
        self.scheduler = scheduler
        self.exchange = exchange
        self.comm = comm
        self.injector = injector
        self.bridge = bridge
        self.sync_token_ids = sync_token_ids

    def _receive(self) -> ControlMessage:
        local = None
        if self.bridge is not None:
            local = self.bridge.drain(0 if self.scheduler.has_work() else REPLICATED_IDLE_TICK_S)
        instrument.phase("recv_requests")
        return self.exchange.exchange(local)

    def run(self) -> None:
        while True:
            msg = self._receive()
            if not msg.empty:
                instrument.record(
                    "requests",
                    {
                        "new": [[r.request_id, len(r.prompt_ids)] for r in msg.requests],
                        "aborts": list(msg.aborts),
                        "shutdown": msg.shutdown,
                    },
                )
            plan = _next_plan(self.scheduler, msg, self.bridge, self.inflight)
            if msg.shutdown:
                break
            if plan is None:
                continue
            self.inflight.running(plan)
            with instrument.step(plan.index):
                mine, tokens = _execute(plan, self.runner, self.injector)
                if self.sync_token_ids:
                    tokens = self.comm.min_ids(tokens, self.runner.device)
                outputs = self.scheduler.complete(mine, tokens)
                instrument.record("stops", [[o.seq_id, o.finish_reason] for o in outputs if o.finished])
            self.inflight.finished(outputs)  # before the clients hear of it
            if self.bridge is not None:
                self.bridge.deliver(outputs)
        if self.bridge is not None:
            self.bridge.fail_all(SHUTDOWN_MESSAGE)
        self.inflight.clear()
