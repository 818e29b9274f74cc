"""The node link: one thread per supervisor that keeps this node in the group after the handshake.

Every node's supervisor is a client of node 0's store (through node 0's gate,
``gate``/``tunnel``: authenticated when the run has a ``--join-token``).  Key
layout (version 1, every key under ``tpsv/v1/``; docs/multinode.md)::

    run_id              node 0: the run id every node uses (``--run-id``, or node 0's own)
    node/<R>/claims     add-counter; above 1: two supervisors said ``--node-rank R``
    node/<R>/info       JSON {host, pid, fingerprint, token}: what node R registered
    refused             the first refusal (duplicate, mismatch, token), so every node says the same
    ready               add-counter of nodes that validated the group: the start barrier
    beat/<R>            add-counter, +1 every BEAT_S: node R's supervisor is alive
    fault/<n>           the first fatal incident of any node in group attempt n (compare_set): JSON
                        {node, rank, reason, incident_id, verdict, final}; everyone else tears down,
                        exit 84 (or, with --max-restarts, all restart together: restart/<n>, ready/<n+1>,
                        unless the fault is final: --on-straggler kill)
    restart/<n>         node 0's decision after attempt n: JSON {restart, delay_s, restarts}
    ready/<n>           add-counter: nodes ready to launch attempt n (the barrier of a group restart)
    hang/<n>            the first hang query (compare_set): JSON {node, incident_id, seq, verdict}
    done/<a>/<R>        node R finished attempt a cleanly, or saw its fault (its silence is then no loss)
    stop                a node stopped on a signal (first writer): every node stops, in an attempt or between

Every key a pass reads is created empty at the start, so one ``multi_get``
reads them all: a pass costs two store calls (this node's beat, the read)
whatever the number of nodes.

Event-driven: a pass runs every ``BEAT_S``, and at once when the main thread
hands something over or another node rings (``NodeTransport.ring``: after
writing a fault, a stop or a hang query, a node rings, node 0's gate passes it
to every other node).  Liveness comes first from the transport's link
connection (a supervisor that dies closes it: lost within milliseconds; a
silent one is lost after the node timeout), then from the beats in the store.
Every store call has a deadline enforced outside the call (``store._Caller``):
a store that does not answer within the node timeout is a lost node 0.  A value
that is not what a supervisor writes (``messages.BadValue``) is logged and
dropped; it never stops the link.

The main thread only enqueues (``publish_fault``, ``publish_stop``, ...); node
0 alone, at its exit, gives the others a bounded moment to read the store.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import structlog

from ..events import NodeLost, PeerFailed, PeerHangQuery, StoreKeySeen
from ..processes.pidfds import named_thread
from .gate import BEAT_S, NODE_LOST_S
from .handshake import NodeGroup
from .messages import BadValue, Fault, HangQuery, counter, shown
from .store import STORE_TIMEOUT_S, Store

if TYPE_CHECKING:
    from .transport import NodeTransport

log = structlog.get_logger("supervise.nodes")

BAD_VALUE_LOG_EVERY_S = 10.0
STRAGGLER_READ_S = 2.0  # the other nodes' straggler summaries: one multi_get this often
MAX_SUMMARY = 64 * 1024
# ... once it has beaten: a node that passed the handshake may take longer to start its link on a loaded
# host (its imports, its ranks' spawn), so its first beat gets this long before it counts as lost.
FIRST_BEAT_S = 15.0
REFUSAL_LINGER_S = 1.5  # node 0 keeps the store up this long after a refusal, so every node reads it
STORE_LINGER_S = 5.0  # node 0 keeps the store up this long at its exit, until every node read the end
POLL_S = 0.1


# -- after the handshake: fault bus and liveness ------------------------------------------------------


class NodeLink:
    """Thread ``node-link``: beats, watches the others and the fault bus, and publishes what the main thread hands it."""

    def __init__(
        self,
        store: Store,
        group: NodeGroup,
        post: Callable[[object], None],
        on_peers: Callable[[Mapping[int, bool]], None] | None = None,
        on_store_latency: Callable[[str, float], None] | None = None,
        transport: NodeTransport | None = None,
        world_size: int | None = None,
        node_lost_s: float = NODE_LOST_S,
    ):
        self.store = store
        self.group = group
        self.post = post
        self.transport = transport
        self.world_size = world_size
        self.node_lost_s = node_lost_s
        self._wake = threading.Event()
        self._peer_stragglers: dict[int, bytes] = {}
        self._next_straggler_read = 0.0
        self._lost_lock = threading.Lock()
        self._bad_logged: dict[str, float] = {}
        self.on_peers = on_peers or (lambda _up: None)  # the metrics (supervise_peer_node_up)
        if on_store_latency is not None:  # the metrics (supervise_store_latency_seconds), the handshake's calls first
            store.latency.attach(on_store_latency)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = named_thread(self._run, "node-link")
        self._seen: dict[int, tuple[int, float]] = {}  # node -> (beat count, when it last changed)
        self._store_ok_at = time.monotonic()
        self._reported: set[int] = set()
        self._done: set[int] = set()  # nodes that said they finished: their silence is no loss
        self._fault_posted = False
        self._query_posted = False
        self._keys_ready = False
        self._attempt = 1  # fault/<n> and hang/<n> of this group attempt are watched (--max-restarts)
        self._stop_posted = False
        # The group knows how this node's attempt ends: its fault, stop or clean end published, or a fault read.
        self._announced = False
        self._retry: deque = deque()  # an outbox item whose store call failed: first in line next pass
        self._watches: dict[str, Callable[[bytes], bool]] = {}  # key -> condition; StoreKeySeen once it holds

    # -- main thread --------------------------------------------------------------------------------
    def start(self) -> None:
        if self.transport is not None:
            self.transport.attach(self._link_lost, self._wake.set)
        self._thread.start()

    def _link_lost(self, node: int, detail: str) -> None:
        """The transport's link saw ``node`` go (its connection closed, or silence): lost now, not after the
        beats' timeout.  Runs on the gate's or the link connection's thread."""
        with self._lost_lock:
            if node == self.group.node_rank or node in self._reported or node in self._done or self._stop.is_set():
                return
            self._reported.add(node)
        self.post(NodeLost(node, shown(detail, 300), time.monotonic()))
        self._wake.set()

    def stop(self) -> None:
        """End the link; node 0 (the store's host) first gives the others a bounded moment to read what is
        there (a fault, the end of the run) before its exit takes the store away.  Another node whose end the
        group knows of (a fault, a stop, its clean end) says goodbye on its link: it reads the store no more,
        and node 0 need not wait for it."""
        self._stop.set()
        self._wake.set()
        self._thread.join(STORE_TIMEOUT_S + 1.0)
        self._drain_outbox_safely()  # what the main thread handed over last (the thread has stopped)
        if self.group.node_rank != 0:
            if self.transport is not None and self._announced and 0 not in self._reported:
                self.transport.bye()
            return
        deadline = time.monotonic() + STORE_LINGER_S
        while time.monotonic() < deadline:
            try:
                if all(self._left(n) for n in range(1, self.group.nnodes)):
                    return
            except Exception:
                return
            time.sleep(POLL_S)

    def _left(self, node: int) -> bool:
        """Node 0 at its exit: ``node`` needs its store no more.  Lost; gone from the gate (its supervisor
        exited, or said goodbye); or it said it is done.  The node where an incident began never says done
        (it reads the store until its bundle is merged), so without the gate's word node 0 waited out the
        whole linger after every fault of another node (issue 26)."""
        if node in self._reported:  # a node declared lost will never say it is done
            return True
        if self.transport is not None and node in self.transport.departed():
            return True
        return bool(self.store.get_nowait(f"done/{self._attempt}/{node}"))

    def _drain_outbox_safely(self) -> None:
        try:
            self._drain_outbox()
        except Exception as exc:
            log.warning("node link: could not reach the store before stopping", error=repr(exc)[:200])

    def publish_stop(self, fault: Fault) -> None:
        """This node stops on a signal: every other node stops too, whatever attempt it is in (never blocks)."""
        self._hand_over("stop", fault)

    def publish_fault(self, fault: Fault) -> None:
        """Hand a fatal incident of this node to the bus (never blocks)."""
        self._hand_over("fault", fault)

    def ask_where(self, query: HangQuery) -> None:
        """Hand a hang query of this node to the other nodes (never blocks)."""
        self._hand_over("hang", query)

    def begin_attempt(self, number: int) -> None:
        """The group starts attempt ``number``: from now on its fault and hang keys are the ones watched."""
        self._hand_over("attempt", number)

    def set(self, key: str, value: bytes) -> None:
        """Write a key of the run (e.g. node 0's restart decision) from the link's thread (never blocks)."""
        self._hand_over("set", (key, value))

    def add(self, key: str, amount: int = 1) -> None:
        self._hand_over("add", (key, amount))

    def watch(self, key: str, until: Callable[[bytes], bool]) -> None:
        """Post ``StoreKeySeen(key, value)`` once ``until(value)`` holds (missing keys read as b"").  ``until``
        validates: a value it raises ``BadValue`` for is dropped (logged) and the key watched on."""
        self._hand_over("watch", (key, until))

    def publish_straggler(self, summary: bytes) -> None:
        """This node's straggler summary (``watchdogs.straggler_nodes``), for the others (never blocks)."""
        self._hand_over("set", (f"straggler/{self.group.node_rank}", summary))

    def peer_stragglers(self) -> dict[int, bytes]:
        """The other nodes' latest straggler summaries, as read (at most every STRAGGLER_READ_S)."""
        return dict(self._peer_stragglers)

    def finished(self) -> None:
        """This node ends cleanly: its silence from now on is not a loss."""
        self._hand_over("done", None)

    def _hand_over(self, kind: str, item: object) -> None:
        self._outbox.put((kind, item))
        self._wake.set()  # the link acts now, not at its next beat

    # -- the thread ---------------------------------------------------------------------------------
    def _create_keys(self) -> None:
        """Every key a pass reads exists from the start (empty = not set), so one ``get_many`` reads them
        all: two store calls per pass (the beat and the read) whatever the number of nodes, instead of two
        per node.  Idempotent: a key another node already set keeps its value."""
        for node in range(self.group.nnodes):
            self.store.add(f"beat/{node}", 0)
        self.store.first_writer("stop", b"")
        for node in range(self.group.nnodes):
            self.store.first_writer(f"straggler/{node}", b"")
        self._create_attempt_keys()
        self._keys_ready = True

    def _create_attempt_keys(self) -> None:
        a = self._attempt
        for node in range(self.group.nnodes):
            self.store.first_writer(f"done/{a}/{node}", b"")
        self.store.first_writer(f"fault/{a}", b"")
        self.store.first_writer(f"hang/{a}", b"")

    def _new_attempt(self, number: int) -> None:
        """What the link knew of the attempt that ended does not hold for the next: who finished or saw
        its fault, the beat history, the fault and hang query it posted."""
        self._attempt, self._fault_posted, self._query_posted = number, False, False
        self._announced = self._stop_posted
        self._done, self._seen = set(), {}
        self._store_ok_at = time.monotonic()
        self._create_attempt_keys()

    def _read_all(self) -> dict[str, bytes]:
        me, a = self.group.node_rank, self._attempt
        keys = [f"fault/{a}", f"hang/{a}", "stop"] + [
            key for n in range(self.group.nnodes) if n != me for key in (f"beat/{n}", f"done/{a}/{n}")
        ]
        seen = dict(zip(keys, self.store.get_many(keys), strict=True))
        seen["fault"], seen["hang"] = seen[keys[0]], seen[keys[1]]
        for n in range(self.group.nnodes):
            if n != me:
                seen[f"done/{n}"] = seen[f"done/{a}/{n}"]
        return seen

    def _check_watches(self) -> None:
        for key, until in list(self._watches.items()):
            value = self.store.get_nowait(key) or b""
            try:
                reached = until(value)
            except BadValue as why:  # not one of ours: never taken for a store that stopped answering
                self._dropped(key, value, why)
                continue
            if reached:
                del self._watches[key]
                self.post(StoreKeySeen(key, value))

    def _run(self) -> None:
        me = self.group.node_rank
        while not self._stop.is_set():
            self._wake.clear()
            try:
                if not self._keys_ready:
                    self._create_keys()
                self._drain_outbox()
                self.store.add(f"beat/{me}", 1)
                seen = self._read_all()
                self._watch_fault(seen)
                self._watch_beats(seen)
                self._check_watches()
                self._read_stragglers()
                self._store_ok_at = time.monotonic()
                self.on_peers(
                    {n: n not in self._reported and n not in self._done for n in range(self.group.nnodes) if n != me}
                )
            except Exception as exc:  # the store is unreachable (node 0 gone) or timed out
                silent = time.monotonic() - self._store_ok_at
                if silent >= self.node_lost_s:  # node 0 too: the store it hosts, on loopback, stopped serving it
                    self._store_lost(
                        f"the store on node 0 ({self.group.store_addr}) did not answer for {silent:.1f} s: {exc!r}"
                    )
            problem = self.transport.store_problem() if self.transport is not None else None
            if problem:  # node 0: its store process died (a flood over its memory cap, a kill)
                self._store_lost(problem)
            self._wake.wait(BEAT_S)

    def _read_stragglers(self) -> None:
        now = time.monotonic()
        if now < self._next_straggler_read or self.group.nnodes < 2:
            return
        self._next_straggler_read = now + STRAGGLER_READ_S
        others = [n for n in range(self.group.nnodes) if n != self.group.node_rank]
        values = self.store.get_many([f"straggler/{n}" for n in others])
        self._peer_stragglers = {n: v for n, v in zip(others, values, strict=True) if v and len(v) <= MAX_SUMMARY}

    def _store_lost(self, detail: str) -> None:
        with self._lost_lock:
            if 0 in self._reported or 0 in self._done:
                return
            self._reported.add(0)
        me = self.group.node_rank
        self.on_peers({n: False for n in range(self.group.nnodes) if n != me})
        self.post(NodeLost(0, detail[:300], time.monotonic()))

    def _dropped(self, key: str, raw: bytes, why: BadValue) -> None:
        """A value no supervisor of this group wrote: said once a while per key, then ignored."""
        now = time.monotonic()
        if now - self._bad_logged.get(key, -1e9) >= BAD_VALUE_LOG_EVERY_S:
            self._bad_logged[key] = now
            log.warning(
                "a value in the store is not one of ours: dropped",
                event_name="store_value_dropped",
                key=key,
                why=str(why),
                value=shown(raw, 120),
            )

    def _drain_outbox(self) -> None:
        """Hand what the main thread queued to the store, in order.  An item whose store call failed stays
        first in line for the next pass (a fault, a barrier count or a decision is never dropped on a
        timeout; the writes are first-writer or set, so a repeat is harmless, except an ``add`` that was
        applied although its answer timed out: the barrier then counts this node twice)."""
        while True:
            if self._retry:
                kind, item = self._retry.popleft()
            else:
                try:
                    kind, item = self._outbox.get_nowait()
                except queue.Empty:
                    return
            try:
                self._apply(kind, item)
            except Exception:
                self._retry.appendleft((kind, item))
                raise

    def _publish(self, key: str, value: bytes) -> None:
        """First writer wins; a value in the way that no supervisor wrote (a stranger's, without a token) is
        overwritten.  Then every node is told to look (``ring``)."""
        won = self.store.first_writer(key, value)
        if won != value:
            try:
                Fault.decode(won) if not key.startswith("hang/") else HangQuery.decode(won)
            except BadValue:
                self.store.set(key, value)
        if self.transport is not None:
            self.transport.ring()

    def _apply(self, kind: str, item) -> None:
        """One queued item: one store call (or none)."""
        if kind == "fault":
            self._publish(f"fault/{self._attempt}", item.encode())
            self._announced = True
        elif kind == "stop":
            self._publish("stop", item.encode())
            self._announced = True
        elif kind == "hang":
            self._publish(f"hang/{self._attempt}", item.encode())
        elif kind == "attempt":
            self._new_attempt(item)
        elif kind == "set":
            self.store.set(*item)
        elif kind == "add":
            self.store.add(*item)
        elif kind == "watch":
            self._watches[item[0]] = item[1]
        elif kind == "done":
            self.store.set(f"done/{self._attempt}/{self.group.node_rank}", b"1")
            self._announced = True
            if self.transport is not None:
                self.transport.bye()

    def _decode(self, key: str, raw: bytes, kind: type[Fault] | type[HangQuery]) -> Fault | HangQuery | None:
        try:
            if kind is Fault:
                return Fault.decode(raw, self.group.nnodes, self.world_size)
            return HangQuery.decode(raw, self.group.nnodes)
        except BadValue as why:
            self._dropped(key, raw, why)
            return None

    def _watch_fault(self, seen: Mapping[str, bytes]) -> None:
        if seen["stop"] and not self._stop_posted:
            # A node stopped on a signal, in an attempt or between two: every node stops (exit 0).
            fault = self._decode("stop", seen["stop"], Fault)
            if isinstance(fault, Fault):
                self._stop_posted = self._announced = True
                if fault.node != self.group.node_rank:
                    self.post(PeerFailed(fault, time.monotonic(), self._attempt))
        if self._fault_posted:
            return
        if not self._query_posted and seen["hang"]:
            query = self._decode(f"hang/{self._attempt}", seen["hang"], HangQuery)
            if isinstance(query, HangQuery):
                self._query_posted = True
                if query.node != self.group.node_rank:
                    self.post(PeerHangQuery(query, time.monotonic()))
        raw = seen["fault"]
        if not raw:
            return
        fault = self._decode(f"fault/{self._attempt}", raw, Fault)
        if not isinstance(fault, Fault):
            return
        self._fault_posted = self._announced = True
        if fault.node != self.group.node_rank:
            self.post(PeerFailed(fault, time.monotonic(), self._attempt))
            self.store.set(f"done/{self._attempt}/{self.group.node_rank}", b"seen the fault")  # node 0 may go

    def _watch_beats(self, seen: Mapping[str, bytes]) -> None:
        now = time.monotonic()
        for node in range(self.group.nnodes):
            if node == self.group.node_rank or node in self._reported:
                continue
            if seen[f"done/{node}"]:
                self._done.add(node)  # it finished (or saw the fault): its silence from now on is no loss
            if node in self._done:
                continue
            try:
                count = counter(seen[f"beat/{node}"])
            except BadValue as why:
                self._dropped(f"beat/{node}", seen[f"beat/{node}"], why)
                continue
            last = self._seen.get(node)
            if last is None or last[0] != count:
                self._seen[node] = (count, now)
                continue
            if now - last[1] >= (self.node_lost_s if count > 0 else FIRST_BEAT_S):
                with self._lost_lock:
                    if node in self._reported:
                        continue
                    self._reported.add(node)
                host = self.group.hosts.get(node, "?")
                self.post(NodeLost(node, f"node {node} ({host}) stopped heartbeating {now - last[1]:.1f} s ago", now))
