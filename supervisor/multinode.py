"""The multi-node decisions of the main loop: one group attempt on every node, one fate for the group.

``NodeGroupRules`` is mixed into ``core.Supervisor`` and runs on its main
thread only.  It decides what the other nodes' news means for this node (a
peer's fault, a lost node, a hang query), what this node tells them (its
fault, its clean end, its stop), and how a group restarts together (node 0's
policy decides, every node meets at the barrier).  The mechanism (the store,
the handshake, the node-link thread) is in ``nodes/``; the keys are in
docs/multinode.md.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import structlog

from . import events
from .arbitration import killed_here, peer_consequence
from .events import ConsequenceChecked, ConsequenceWindowOver, HangQueryUnanswered, WatchdogVerdict
from .nodes import messages
from .outcome import EXIT_OK, EXIT_PEER, Outcome, new_incident_id
from .processes import output_pump
from .restart import RESTART_BACKOFF_MAX_S
from .state import Event

if TYPE_CHECKING:
    from collections.abc import Callable

    from .events import SignalReceived
    from .incidents.desk import IncidentDesk
    from .incidents.quarantine import RequestQuarantine
    from .nodes.handshake import NodeGroup
    from .nodes.link import NodeLink
    from .nodes.transport import NodeTransport
    from .observers.watchdog_thread import WatchdogThread
    from .processes.attempt import Attempt
    from .processes.exits import ExitInfo
    from .processes.spawn import RankHandle
    from .restart import RestartPolicy
    from .spec import LaunchSpec
    from .state import AttemptCase

log = structlog.get_logger("supervise")

# A rank of this node that died of a broken peer connection waits this long (from its exit) for another
# node's fault or loss before it is ruled as this node's own failure (docs/multinode.md).
CONSEQUENCE_WAIT_S = 1.0
STDERR_READ_S = 0.3  # how long the check waits for the pump to drain the rank's last stderr


class NodeGroupRules:
    """Multi-node handlers and group-restart steps of ``Supervisor`` (main thread only)."""

    if TYPE_CHECKING:  # what these rules use of the supervisor they are mixed into (core.Supervisor)
        spec: LaunchSpec
        run_id: str
        attempt: Attempt
        restart: RestartPolicy
        node_link: NodeLink | None
        stopping: SignalReceived | None
        group_end: Outcome | None
        case: AttemptCase
        post: Callable[[object], None]
        nodes: tuple[NodeTransport, NodeGroup] | None

        @property
        def desk(self) -> IncidentDesk: ...
        @property
        def watchdog(self) -> WatchdogThread: ...
        @property
        def quarantine(self) -> RequestQuarantine: ...
        def transition(self, event: Event) -> None: ...
        def _finish(self, outcome: Outcome) -> None: ...
        def _between_attempts(self, seconds: float, key: str | None = None) -> bytes | None: ...
        def _rule_hang(self, ev: WatchdogVerdict) -> None: ...
        def _rule_rank_failure(self, handle: RankHandle, info: ExitInfo) -> None: ...

    # -- multi-node restarts: one group attempt on every node, node 0 decides
    @property
    def _link(self) -> NodeLink:
        if self.node_link is None:
            raise RuntimeError("a multi-node rule ran in a single-node run")
        return self.node_link

    def _restarts_as_group(self) -> bool:
        return self.node_link is not None and self.spec.max_restarts > 0

    def _group_restart(self, outcome: Outcome) -> float | None:
        """After attempt n ended on this node: node 0 decides for the group (its restart policy, so the
        crash-loop limit counts group attempts) and publishes restart/<n>; the others wait for it."""
        n = self.attempt.number
        if self.stopping is not None and outcome.reason != "shutdown":
            # stopped while the attempt was ending: every node stops, wherever it is (the run-level stop key)
            self._tell_the_nodes(Outcome(EXIT_OK, "shutdown"))
            self.group_end = Outcome(EXIT_OK, "shutdown")
            return None
        if outcome.reason in ("node_lost", "shutdown"):
            return None  # a lost node cannot be restarted; a stop stops every node (the stop key said so)
        key = f"restart/{n}"
        if self.spec.node_rank == 0:
            delay = self.restart.after(
                outcome, stopping=False, uptime_s=time.monotonic() - self.attempt.started_at, group=True
            )
            decision = messages.RestartDecision(delay is not None, delay or 0.0, self.restart.restarts)
            self._link.set(key, decision.encode())
            return delay
        self._link.watch(key, self._decided)
        raw = self._between_attempts(self.spec.rendezvous_timeout, key=key)
        if raw is None:
            if self.stopping is not None:
                self._tell_the_nodes(Outcome(EXIT_OK, "shutdown"))
                self.group_end = Outcome(EXIT_OK, "shutdown")
            elif self.group_end is None:
                log.error(
                    "node 0 never said whether the group restarts: giving up",
                    event_name="group_restart_no_decision",
                    waited_s=self.spec.rendezvous_timeout,
                )
            return None
        decision = self._decision(raw)  # it passed _decided on the link: it decodes
        if not decision.restart:
            log.error(
                "node 0 ends the group: no restart",
                event_name="group_restart_declined",
                restarts=decision.restarts,
            )
            return None
        self.restart.restarts = decision.restarts
        log.warning(
            "restarting the group with node 0",
            event_name="group_restart",
            restart=self.restart.restarts,
            max_restarts=self.spec.max_restarts,
            backoff_s=decision.delay_s,
            after=outcome.reason,
        )
        return decision.delay_s

    def _decided(self, raw: bytes) -> bool:
        """The link's check of ``restart/<n>`` (on its thread): empty is not decided yet; a value node 0's policy
        could not have written raises ``BadValue``, which the link logs and drops, and it watches on."""
        if not raw:
            return False
        self._decision(raw)
        return True

    def _decision(self, raw: bytes) -> messages.RestartDecision:
        """Node 0's ``restart/<n>``, held to what this node's own policy could decide: a backoff of at most
        its longest, a count within its --max-restarts (the handshake made both the same on every node)."""
        return messages.RestartDecision.decode(raw, RESTART_BACKOFF_MAX_S, self.spec.max_restarts)

    def _group_barrier(self) -> bool:
        """Every node is ready to launch attempt n+1 before any does (the ranks rendezvous across nodes)."""
        n = self.attempt.number + 1
        key, nnodes = f"ready/{n}", self.spec.nnodes
        self._link.begin_attempt(n)
        if self.stopping is None and self.group_end is None:
            self._link.add(key, 1)
            self._link.watch(key, lambda raw: messages.counter(raw) >= nnodes)  # junk: dropped by the link
            if self._between_attempts(self.spec.rendezvous_timeout, key=key) is not None:
                log.info("every node is ready for the next attempt", event_name="group_restart_ready", attempt=n)
                return True
        if self.stopping is not None:
            self._tell_the_nodes(Outcome(EXIT_OK, "shutdown"))  # the others, waiting at the barrier, stop too
        elif self.group_end is None:
            log.error(
                "the other nodes did not come back for the restart",
                event_name="group_restart_timeout",
                attempt=n,
                waited_s=self.spec.rendezvous_timeout,
            )
            self.group_end = Outcome(EXIT_PEER, "node_lost")
        return False

    def _tell_the_nodes(self, outcome: Outcome) -> None:
        """The end of this node's attempt, for the others: done, or a stop they should follow."""
        if outcome.code == EXIT_OK and outcome.reason == "clean":
            self._link.finished()
        elif outcome.reason == "shutdown":
            self._link.publish_stop(
                messages.Fault(
                    node=self.spec.node_rank,
                    rank=None,
                    reason="shutdown",
                    incident_id="",
                    verdict="stopped on a signal",
                )
            )

    def _on_peer_failed(self, ev: events.PeerFailed) -> None:
        fault = ev.fault
        if self.attempt.outcome is not None:
            return
        if fault.reason == "shutdown":
            log.info("node stopped on a signal: graceful shutdown of this node too", node=fault.node)
            self._finish(Outcome(EXIT_OK, "shutdown"))
            return
        who = f"rank {fault.rank} on node {fault.node}" if fault.rank is not None else f"node {fault.node}"
        verdict = f"{who} failed first ({fault.reason}); this node's ranks were torn down with the group"
        if fault.verdict:
            verdict += f". Node {fault.node} said: {fault.verdict}"
        log.error(
            "peer node failed: tearing this node down",
            node=fault.node,
            rank=fault.rank,
            reason=fault.reason,
            incident_id=fault.incident_id,
            final=fault.final,
        )
        # A fault that names no incident gets this node's own id: one id in its quarantine and its bundle.
        incident_id = fault.incident_id or new_incident_id(self.run_id)
        self._peer_incident("peer_failed", fault.node, fault.rank, verdict, incident_id, final=fault.final)

    def _on_node_lost(self, ev: events.NodeLost) -> None:
        if self.attempt.outcome is not None:
            return
        verdict = f"node {ev.node} was lost: {ev.detail}; this node's ranks were torn down with the group"
        log.error("peer node lost: tearing this node down", node=ev.node, detail=ev.detail)
        self._peer_incident("node_lost", ev.node, None, verdict, new_incident_id(self.run_id))

    def _peer_incident(
        self, reason: str, node: int, rank: int | None, verdict: str, incident_id: str, final: bool = False
    ) -> None:
        """``incident_id``: the other node's (a lost node told nothing: this node's own); ``final``: that node
        said no node restarts after it (node 0's restart policy honours it)."""
        if self.case.suspect is not None:  # this node's rank died first here, but of the peer's failure
            handle, info, _at, why = self.case.suspect
            self.case.suspect = None
            verdict += (
                f"; rank {handle.rank} of this node died of it first ({info.description}"
                + (f": {why}" if why else "")
                + "), a consequence"
            )
            log.warning(
                "rank death was a consequence of another node's failure",
                event_name="rank_exit_consequence",
                rank=handle.rank,
                node=node,
                reason=reason,
            )
        self.transition(Event.RANK_EXIT)
        self.quarantine.fault(incident_id, self.attempt.view)  # before this node's teardown: its rank 0 names it
        extra = {"culprit_ranks": [rank] if rank is not None else [], "verdict": verdict, "culprit_node": node}
        self.desk.peer_incident(reason, extra, self.attempt.view, incident_id)
        self._finish(Outcome(EXIT_PEER, reason, culprit=rank, final=final))

    def _ask_the_other_nodes(self, ev: WatchdogVerdict) -> bool:
        """Multi-node: when every rank of this node waits inside a collective, the rank that is elsewhere is on
        another node, whose own watchdog may see nothing (a stopped rank outside collectives looks idle there).
        Ask the others (nodes.HangQuery); the node that holds it raises the hang under this incident id and
        this node follows it (84).  Nobody within HANG_QUERY_WAIT_S: rule here on this node's evidence."""
        v = ev.verdict
        if (
            self.node_link is None
            or self.case.hang_query is not None
            or self.case.peer_hang_query is not None
            or v.outside_collective
            or not v.in_collective
        ):
            return False
        seq = max(c.coll_seq for c in v.in_collective)
        self.case.hang_query = messages.HangQuery(
            self.spec.node_rank, new_incident_id(self.run_id), seq, ev.message[:500]
        )
        self.case.deferred_hang = ev
        self._link.ask_where(self.case.hang_query)
        log.warning(
            "hang here, cause elsewhere: every rank of this node waits in a collective; asking the other nodes",
            event_name="hang_query_sent",
            seq=seq,
            wait_s=messages.HANG_QUERY_WAIT_S,
            incident_id=self.case.hang_query.incident_id,
        )
        timer = threading.Timer(messages.HANG_QUERY_WAIT_S, self.post, args=(HangQueryUnanswered(self.attempt.number),))
        timer.daemon = True
        timer.start()
        return True

    def _on_hang_query_unanswered(self, ev: HangQueryUnanswered) -> None:
        if self.attempt.outcome is None and self.case.deferred_hang is not None:
            log.warning(
                "no other node holds the missing rank: ruling the hang on this node's evidence",
                event_name="hang_query_unanswered",
                incident_id=self.case.hang_query.incident_id if self.case.hang_query else None,
            )
            self._rule_hang(self.case.deferred_hang)

    def _on_peer_hang_query(self, ev: events.PeerHangQuery) -> None:
        if self.attempt.outcome is not None or self.case.hang_query is not None:
            return
        log.warning(
            "another node's ranks all wait in a collective: looking for the missing rank here",
            event_name="hang_query_received",
            node=ev.query.node,
            seq=ev.query.seq,
            incident_id=ev.query.incident_id,
        )
        self.case.peer_hang_query = ev.query
        self.watchdog.answer_hang_query(ev.query.seq, ev.query.node)

    # -- cause before consequence: a rank that died of a broken peer connection waits for the peer's news
    def _maybe_a_consequence(self, handle: RankHandle, info: ExitInfo) -> bool:
        """Multi-node: hold the ruling of a failed rank until its stderr was read (off this thread); if it died
        of a broken peer connection, until CONSEQUENCE_WAIT_S after its exit.  True: the ruling is held."""
        if self.node_link is None or self.attempt.outcome is not None or handle.rank < 0:
            return False
        if self.case.suspect is not None:
            return True  # already waiting: the first failure decides, and root_cause names it
        status_signal = info.status.signal if info.status is not None else None
        if killed_here(status_signal):
            return False  # ruled now: no stderr makes it a consequence, so nothing is waited for
        exited_at = handle.exited_at or time.monotonic()
        self.case.suspect = (handle, info, exited_at, None)
        attempt, slot, rank, post = self.attempt.number, handle.slot, handle.rank, self.post

        def check() -> None:
            why = None
            try:
                pump = output_pump.installed()
                tail = pump.stderr_tail(rank) if pump is not None else None
                if tail is not None:
                    tail.wait_drained(STDERR_READ_S)
                    why = peer_consequence(status_signal, tail.data()[-65536:].decode("utf-8", "replace"))
            finally:
                post(ConsequenceChecked(slot, why, attempt))

        threading.Thread(target=check, name=f"consequence-check-{slot}", daemon=True).start()
        return True

    def _on_consequence_checked(self, ev: ConsequenceChecked) -> None:
        if self.case.suspect is None or self.attempt.outcome is not None or ev.slot != self.case.suspect[0].slot:
            return
        handle, info, exited_at, _ = self.case.suspect
        if ev.why is None:
            self.case.suspect = None
            self._rule_rank_failure(handle, info)
            return
        self.case.suspect = (handle, info, exited_at, ev.why)
        wait_s = max(0.0, exited_at + CONSEQUENCE_WAIT_S - time.monotonic())
        log.warning(
            "rank died of a broken peer connection: waiting for the other nodes' news before ruling",
            event_name="rank_exit_suspected_consequence",
            rank=handle.rank,
            wait_s=round(wait_s, 3),
            line=ev.why,
        )
        timer = threading.Timer(wait_s, self.post, args=(ConsequenceWindowOver(ev.slot, self.attempt.number),))
        timer.name = f"consequence-window-{ev.slot}"
        timer.daemon = True
        timer.start()

    def _on_consequence_window_over(self, ev: ConsequenceWindowOver) -> None:
        if self.case.suspect is None or self.attempt.outcome is not None or ev.slot != self.case.suspect[0].slot:
            return
        handle, info, _, _ = self.case.suspect
        self.case.suspect = None
        log.info("no other node failed: the rank's death is ruled as this node's own", rank=handle.rank)
        self._rule_rank_failure(handle, info)

    # -- stragglers across nodes: the straggler thread's view of the link
    def _node_stragglers(self) -> NodeStragglerLink | None:
        if self.node_link is None or self.nodes is None:
            return None
        return NodeStragglerLink(self.node_link, self.nodes[0], self.spec.node_rank)


class NodeStragglerLink:
    """``observers.straggler_thread.NodeStragglers`` over the node link (summaries through the store) and the
    transport (node 0's clock offset from the link's pings)."""

    def __init__(self, link: NodeLink, transport: NodeTransport, node_rank: int):
        self.link, self.transport, self.node_rank = link, transport, node_rank

    def publish(self, summary: bytes) -> None:
        self.link.publish_straggler(summary)

    def peers(self) -> dict[int, bytes]:
        return self.link.peer_stragglers()

    def clock_offset(self) -> tuple[float, float] | None:
        return self.transport.clock_offset()
