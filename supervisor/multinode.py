"""The multi-node rules of the decider: one group attempt on every node, one fate for the group.

``core.Supervisor`` holds one ``NodeRules``: ``SingleNode`` when the run has one
node (nothing to tell, ask or wait for), ``GroupOfNodes`` otherwise.  Like
``arbitration``, the rules decide and return rulings; the supervisor acts on
them (its transitions, the desk, the quarantine, the end of the attempt) on
its main thread, the only thread that calls them.  They decide what the other
nodes' news means for this node (a peer's fault, a lost node, a hang query),
what this node tells them (its fault, its clean end, its stop), and how a
group restarts together (node 0's policy decides, every node meets at the
barrier).  The mechanism (the store, the handshake, the node-link thread) is
in ``nodes/``; the keys are in docs/multinode.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import structlog

from . import events
from .arbitration import killed_here, peer_consequence
from .events import ConsequenceWindowOver, HangQueryUnanswered, StderrCheck, WatchdogVerdict
from .nodes import messages
from .outcome import EXIT_HANG, EXIT_OK, EXIT_PEER, Outcome, new_incident_id
from .processes import output_pump
from .rank.engines.launcher_flags import compiles_model
from .restart import RESTART_BACKOFF_MAX_S, RestartPolicy

if TYPE_CHECKING:
    from .nodes.link import NodeLink
    from .nodes.transport import NodeTransport
    from .processes.exits import ExitInfo
    from .processes.spawn import RankHandle
    from .spec import LaunchSpec
    from .state import AttemptCase

log = structlog.get_logger("supervise")

R = TypeVar("R")

# A rank of this node that died of a broken peer connection waits this long (from its exit) for another
# node's fault or loss before it is ruled as this node's own failure (docs/multinode.md).
CONSEQUENCE_WAIT_S = 1.0
STDERR_READ_S = 0.3  # how long the check waits for the pump to drain the rank's last stderr
STDERR_LOOK_S = 0.02  # how often it looks whether the pump has drained it


@dataclass(frozen=True)
class Between:
    """The supervisor between two attempts, as the rules see it: the attempt that ended (its number, how long it
    ran) and whether a stop signal came."""

    number: int
    uptime_s: float
    stopping: Callable[[], bool]


@dataclass(frozen=True)
class WaitForKey(Generic[R]):
    """A ruling between attempts: wait in the loop's between-attempts phase until the node link reports ``key`` (its
    value) or ``seconds`` pass (None), or the run ends; then ``then(value)`` is the ruling."""

    key: str
    seconds: float
    then: Callable[[bytes | None], R | WaitForKey[R]]


# -- rulings: what the supervisor does with the other nodes' news
@dataclass(frozen=True)
class PeerIncident:
    """Tear this node down under another node's incident (``incident_id``: that node's, or this node's own for a
    lost node that told nothing); ``final``: that node said no node restarts after it."""

    reason: str  # "peer_failed" | "node_lost"
    node: int
    rank: int | None
    verdict: str
    incident_id: str
    final: bool = False
    kind: str = ""  # the fault's own reason on the node it came from ("hang", "rank_exit", ...)

    @property
    def code(self) -> int:
        """A hang is the whole group's (every rank waited on the culprit): 81 on every node; any other fault
        elsewhere is 84 here (docs/multinode.md, "Fault bus and liveness")."""
        return EXIT_HANG if self.kind == "hang" else EXIT_PEER


@dataclass(frozen=True)
class StopToo:
    """Another node stopped on a signal: this node stops gracefully too."""


@dataclass(frozen=True)
class RuleFailure:
    """A rank failure held for the other nodes' news is this node's own after all: rule it now."""

    handle: RankHandle
    info: ExitInfo


@dataclass(frozen=True)
class RuleHang:
    """The hard verdict held for a hang query: nobody else holds the missing rank, rule it here."""

    verdict: WatchdogVerdict


@dataclass(frozen=True)
class Hold:
    """Nothing is ruled yet: ``event`` comes back to the decider at ``when`` (its loop's clock), unless the attempt
    ended meanwhile (a timer of the main loop, supervisor/loop.py); ``event`` None: held by a timer armed before."""

    when: float
    event: object


NodeRuling = PeerIncident | StopToo | RuleFailure | RuleHang | Hold | None


class NodeRules(Protocol):
    """What the decider asks of the other nodes; ``SingleNode`` answers for a run that has none."""

    end: Outcome | None  # why the group could not go on between attempts (a lost node, a stop elsewhere)

    def sources(self) -> list: ...
    def stragglers(self) -> NodeStragglerLink | None: ...
    def publish_fault(self, fault: messages.Fault) -> None: ...
    def attempt_ended(self, outcome: Outcome) -> None: ...
    def restart_delay(
        self, outcome: Outcome, policy: RestartPolicy, attempt: Between
    ) -> float | None | WaitForKey[float | None]: ...
    def meet(self, attempt: Between) -> bool | WaitForKey[bool]: ...
    def carried(self) -> list: ...
    def between(self, ev: object, attempt: int) -> None: ...
    def peer_failed(self, ev: events.PeerFailed, case: AttemptCase) -> NodeRuling: ...
    def node_lost(self, ev: events.NodeLost, case: AttemptCase) -> NodeRuling: ...
    def ask_where(self, ev: WatchdogVerdict, case: AttemptCase, attempt: int, now: float) -> Hold | None: ...
    def hang_query_unanswered(self, case: AttemptCase) -> NodeRuling: ...
    def peer_hang_query(self, ev: events.PeerHangQuery, case: AttemptCase) -> bool: ...
    def hold_failure(
        self, handle: RankHandle, info: ExitInfo, case: AttemptCase, attempt: int, now: float
    ) -> NodeRuling: ...
    def stderr_check(self, ev: StderrCheck, case: AttemptCase, now: float) -> NodeRuling: ...
    def consequence_window_over(self, ev: ConsequenceWindowOver, case: AttemptCase) -> NodeRuling: ...


class SingleNode:
    """The one node of the run: nobody to tell, to ask or to meet; this node's restart policy decides alone."""

    end: Outcome | None = None

    def sources(self) -> list:
        return []

    def stragglers(self) -> NodeStragglerLink | None:
        return None

    def publish_fault(self, fault: messages.Fault) -> None:
        pass

    def attempt_ended(self, outcome: Outcome) -> None:
        pass

    def restart_delay(self, outcome: Outcome, policy: RestartPolicy, attempt: Between) -> float | None:
        return policy.after(outcome, stopping=attempt.stopping(), uptime_s=attempt.uptime_s)

    def meet(self, attempt: Between) -> bool:
        return not attempt.stopping()

    def carried(self) -> list:
        return []

    def between(self, ev: object, attempt: int) -> None:
        pass

    def peer_failed(self, ev: events.PeerFailed, case: AttemptCase) -> NodeRuling:
        return None

    def node_lost(self, ev: events.NodeLost, case: AttemptCase) -> NodeRuling:
        return None

    def ask_where(self, ev: WatchdogVerdict, case: AttemptCase, attempt: int, now: float) -> Hold | None:
        return None

    def hang_query_unanswered(self, case: AttemptCase) -> NodeRuling:
        return None

    def peer_hang_query(self, ev: events.PeerHangQuery, case: AttemptCase) -> bool:
        return False

    def hold_failure(
        self, handle: RankHandle, info: ExitInfo, case: AttemptCase, attempt: int, now: float
    ) -> NodeRuling:
        return None

    def stderr_check(self, ev: StderrCheck, case: AttemptCase, now: float) -> NodeRuling:
        return None

    def consequence_window_over(self, ev: ConsequenceWindowOver, case: AttemptCase) -> NodeRuling:
        return None


class GroupOfNodes:
    """This node's part in a group of nodes, over the node link (main thread only)."""

    def __init__(self, spec: LaunchSpec, run_id: str, link: NodeLink, transport: NodeTransport):
        self.spec, self.run_id, self.link, self.transport = spec, run_id, link, transport
        # the engine runs its model compiled: its ranks wait in collectives the hook does not see (ask_where)
        self.compiled = spec.tree and bool(compiles_model(spec.command))
        self.end: Outcome | None = None  # why the group could not go on between attempts
        self._carried: list = []  # faults of the next attempt that arrived while this node was between attempts

    def sources(self) -> list:
        return [self.link]

    def stragglers(self) -> NodeStragglerLink | None:
        return NodeStragglerLink(self.link, self.transport, self.spec.node_rank)

    # -- what this node tells the others
    def publish_fault(self, fault: messages.Fault) -> None:
        self.link.publish_fault(fault)

    def attempt_ended(self, outcome: Outcome) -> None:
        """This node's attempt ended (its first outcome): done, or a stop the others follow.  A fault was
        published when it was ruled; another node's incident is that node's to tell."""
        if outcome.reason in ("peer_failed", "node_lost"):
            return
        if outcome.code == EXIT_OK and outcome.reason == "clean":
            self.link.finished()
        elif outcome.reason == "shutdown":
            self._publish_stop()

    def _publish_stop(self) -> None:
        self.link.publish_stop(
            messages.Fault(
                node=self.spec.node_rank, rank=None, reason="shutdown", incident_id="", verdict="stopped on a signal"
            )
        )

    def _stop_everywhere(self) -> None:
        """Stopped while the group is between attempts: every node stops, wherever it is (the run's stop key)."""
        self._publish_stop()
        self.end = Outcome(EXIT_OK, "shutdown")

    # -- restarts: one group attempt on every node, node 0 decides
    def restart_delay(
        self, outcome: Outcome, policy: RestartPolicy, attempt: Between
    ) -> float | None | WaitForKey[float | None]:
        """After attempt n ended on this node: node 0 decides for the group (its restart policy, so the
        crash-loop limit counts group attempts) and publishes restart/<n>; the others wait for it."""
        if self.spec.max_restarts == 0:  # nothing to agree on: no node restarts
            return policy.after(outcome, stopping=attempt.stopping(), uptime_s=attempt.uptime_s)
        if attempt.stopping() and outcome.reason != "shutdown":
            self._stop_everywhere()  # stopped while the attempt was ending
            return None
        if outcome.reason in ("node_lost", "shutdown"):
            return None  # a lost node cannot be restarted; a stop stops every node (the stop key said so)
        key = f"restart/{attempt.number}"
        if self.spec.node_rank == 0:
            delay = policy.after(outcome, stopping=False, uptime_s=attempt.uptime_s, group=True)
            self.link.set(key, messages.RestartDecision(delay is not None, delay or 0.0, policy.restarts).encode())
            return delay
        self.link.watch(key, self._decided)
        return WaitForKey(
            key, self.spec.nodes.rendezvous_timeout, lambda raw: self._follow(raw, outcome, policy, attempt)
        )

    def _follow(self, raw: bytes | None, outcome: Outcome, policy: RestartPolicy, attempt: Between) -> float | None:
        """Node 0's decision (``raw``; None: it never came) as this node's: the backoff, or no restart."""
        if raw is None:
            if attempt.stopping():
                self._stop_everywhere()
            elif self.end is None:
                log.error(
                    "node 0 never said whether the group restarts: giving up",
                    event_name="group_restart_no_decision",
                    waited_s=self.spec.nodes.rendezvous_timeout,
                )
            return None
        decision = self._decision(raw)  # it passed _decided on the link: it decodes
        if not decision.restart:
            log.error(
                "node 0 ends the group: no restart", event_name="group_restart_declined", restarts=decision.restarts
            )
            return None
        policy.follow(decision.restarts)
        log.warning(
            "restarting the group with node 0",
            event_name="group_restart",
            restart=policy.restarts,
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

    def meet(self, attempt: Between) -> bool | WaitForKey[bool]:
        """Every node is ready to launch attempt n+1 before any does (the ranks rendezvous across nodes)."""
        if self.spec.max_restarts == 0:
            return not attempt.stopping()
        n = attempt.number + 1
        key, nnodes = f"ready/{n}", self.spec.nnodes
        self.link.begin_attempt(n)
        if not attempt.stopping() and self.end is None:
            self.link.add(key, 1)
            self.link.watch(key, lambda raw: messages.counter(raw) >= nnodes)  # junk: dropped by the link
            return WaitForKey(key, self.spec.nodes.rendezvous_timeout, lambda raw: self._met(raw, attempt))
        return self._met(None, attempt)

    def _met(self, raw: bytes | None, attempt: Between) -> bool:
        """The barrier's end: every node came (``raw``), or not by the rendezvous timeout, or the run is ending."""
        n = attempt.number + 1
        if raw is not None:
            log.info("every node is ready for the next attempt", event_name="group_restart_ready", attempt=n)
            return True
        if attempt.stopping():
            self._stop_everywhere()  # the others, waiting at the barrier, stop too
        elif self.end is None:
            log.error(
                "the other nodes did not come back for the restart",
                event_name="group_restart_timeout",
                attempt=n,
                waited_s=self.spec.nodes.rendezvous_timeout,
            )
            self.end = Outcome(EXIT_PEER, "node_lost")
        return False

    def carried(self) -> list:
        """What another node said of the attempt this node launches now, heard before it launched it."""
        out, self._carried = self._carried, []
        return out

    def between(self, ev: object, attempt: int) -> None:
        """The other nodes' news while this node is between attempts (``attempt``: the one that ended)."""
        if isinstance(ev, events.NodeLost):
            log.error(
                "peer node lost between attempts: the group cannot restart without it",
                event_name="group_restart_node_lost",
                node=ev.node,
                detail=ev.detail,
            )
            self.end = Outcome(EXIT_PEER, "node_lost")
        elif isinstance(ev, events.PeerFailed) and ev.fault.reason == "shutdown":
            log.info(
                "node stopped on a signal between attempts: this node stops too",
                event_name="group_restart_stopped",
                node=ev.fault.node,
            )
            self.end = Outcome(EXIT_OK, "shutdown")
        elif isinstance(ev, events.PeerFailed) and ev.attempt > attempt:
            self._carried.append(ev)  # a fault of the next attempt, read while this node was at the barrier

    # -- the other nodes' news during an attempt
    def peer_failed(self, ev: events.PeerFailed, case: AttemptCase) -> NodeRuling:
        fault = ev.fault
        if fault.reason == "shutdown":
            log.info("node stopped on a signal: graceful shutdown of this node too", node=fault.node)
            return StopToo()
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
        return self._peer_incident(
            case, "peer_failed", fault.node, fault.rank, verdict, incident_id, fault.final, kind=fault.reason
        )

    def node_lost(self, ev: events.NodeLost, case: AttemptCase) -> NodeRuling:
        verdict = f"node {ev.node} was lost: {ev.detail}; this node's ranks were torn down with the group"
        log.error("peer node lost: tearing this node down", node=ev.node, detail=ev.detail)
        return self._peer_incident(case, "node_lost", ev.node, None, verdict, new_incident_id(self.run_id))

    def _peer_incident(
        self,
        case: AttemptCase,
        reason: str,
        node: int,
        rank: int | None,
        verdict: str,
        incident_id: str,
        final: bool = False,
        kind: str = "",
    ) -> PeerIncident:
        if case.suspect is not None:  # this node's rank died first here, but of the peer's failure
            handle, info, _at, why = case.suspect
            case.suspect = None
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
        return PeerIncident(reason, node, rank, verdict, incident_id, final, kind or reason)

    # -- a hang here whose cause is elsewhere
    def ask_where(self, ev: WatchdogVerdict, case: AttemptCase, attempt: int, now: float) -> Hold | None:
        """When every rank of this node waits inside a collective, the rank that is elsewhere is on another node,
        whose own watchdog may see nothing (a stopped rank outside collectives looks idle there).  Ask the
        others (nodes.HangQuery); the node that holds it raises the hang under this incident id and this node
        follows it (81: the group hung).  Nobody within HANG_QUERY_WAIT_S: rule here on this node's evidence.  A hold:
        the hard verdict waits for the answer; None: rule it now.

        An engine that compiled its model runs the collectives of its forward in the compiled graph, unseen: its
        ranks waiting for a peer show as inside a step, outside collectives.  There every rank of this node inside
        a step (none stopped) asks too, by step (``HangQuery.inside_step``; docs/multinode.md)."""
        v = ev.verdict
        if case.hang_query is not None or case.peer_hang_query is not None:
            return None
        blind = self.compiled and bool(v.outside_collective) and set(v.outside_collective) <= set(v.outside_in_step)
        if v.outside_collective and not blind:
            return None
        if v.elsewhere_ranks:  # a rank of this node is stopped: the culprit is here
            return None
        if not blind and not v.in_collective:
            return None
        seq = v.max_step if blind else max(c.coll_seq for c in v.in_collective)
        case.hang_query = messages.HangQuery(
            self.spec.node_rank, new_incident_id(self.run_id), seq, ev.message[:500], inside_step=blind
        )
        case.deferred_hang = ev
        self.link.ask_where(case.hang_query)
        log.warning(
            "hang here, cause elsewhere: every rank of this node waits in a collective; asking the other nodes",
            event_name="hang_query_sent",
            seq=seq,
            inside_step=blind,
            wait_s=messages.HANG_QUERY_WAIT_S,
            incident_id=case.hang_query.incident_id,
        )
        return Hold(now + messages.HANG_QUERY_WAIT_S, HangQueryUnanswered(attempt))

    def hang_query_unanswered(self, case: AttemptCase) -> NodeRuling:
        if case.deferred_hang is None:
            return None
        log.warning(
            "no other node holds the missing rank: ruling the hang on this node's evidence",
            event_name="hang_query_unanswered",
            incident_id=case.hang_query.incident_id if case.hang_query else None,
        )
        return RuleHang(case.deferred_hang)

    def peer_hang_query(self, ev: events.PeerHangQuery, case: AttemptCase) -> bool:
        """True: look for the missing rank here (the watchdog answers the query)."""
        if case.hang_query is not None:
            return False
        log.warning(
            "another node's ranks all wait in a collective: looking for the missing rank here",
            event_name="hang_query_received",
            node=ev.query.node,
            seq=ev.query.seq,
            incident_id=ev.query.incident_id,
        )
        case.peer_hang_query = ev.query
        return True

    # -- cause before consequence: a rank that died of a broken peer connection waits for the peer's news
    def hold_failure(
        self, handle: RankHandle, info: ExitInfo, case: AttemptCase, attempt: int, now: float
    ) -> NodeRuling:
        """Hold the ruling of a failed rank until its stderr was read (the pump drains it; at most STDERR_READ_S);
        if it died of a broken peer connection, until CONSEQUENCE_WAIT_S after its exit.  None: rule it now."""
        if handle.rank < 0:
            return None
        if case.suspect is not None:
            return Hold(now, None)  # already waiting: the first failure decides, and root_cause names it
        status_signal = info.status.signal if info.status is not None else None
        if killed_here(status_signal):
            return None  # ruled now: no stderr makes it a consequence, so nothing is waited for
        exited_at = handle.exited_at or now
        case.suspect = (handle, info, exited_at, None)
        return Hold(now, StderrCheck(handle.slot, handle.rank, status_signal, now + STDERR_READ_S, attempt))

    def stderr_check(self, ev: StderrCheck, case: AttemptCase, now: float) -> NodeRuling:
        """The held rank's stderr, once the pump has all of it (or its time is up): a broken peer connection
        waits for the other nodes' news; anything else is this node's own failure."""
        if case.suspect is None or ev.slot != case.suspect[0].slot:
            return None
        pump = output_pump.installed()
        tail = pump.stderr_tail(ev.rank) if pump is not None else None
        if tail is not None and not tail.drained() and now < ev.until:
            return Hold(now + STDERR_LOOK_S, ev)
        why = peer_consequence(ev.signal, tail.data()[-65536:].decode("utf-8", "replace")) if tail is not None else None
        handle, info, exited_at, _ = case.suspect
        if why is None:
            case.suspect = None
            return RuleFailure(handle, info)
        case.suspect = (handle, info, exited_at, why)
        wait_s = max(0.0, exited_at + CONSEQUENCE_WAIT_S - now)
        log.warning(
            "rank died of a broken peer connection: waiting for the other nodes' news before ruling",
            event_name="rank_exit_suspected_consequence",
            rank=handle.rank,
            wait_s=round(wait_s, 3),
            line=why,
        )
        return Hold(exited_at + CONSEQUENCE_WAIT_S, ConsequenceWindowOver(ev.slot, ev.attempt))

    def consequence_window_over(self, ev: ConsequenceWindowOver, case: AttemptCase) -> NodeRuling:
        if case.suspect is None or ev.slot != case.suspect[0].slot:
            return None
        handle, info, _, _ = case.suspect
        case.suspect = None
        log.info("no other node failed: the rank's death is ruled as this node's own", rank=handle.rank)
        return RuleFailure(handle, info)


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
