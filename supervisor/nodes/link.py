"""Multi-node: one supervisor per node, one fate for the whole TP group.

Node 0's supervisor hosts a torch.distributed ``TCPStore`` (the store
torchrun's c10d rendezvous uses) on ``--store-port`` (default: the ranks'
``--master-port`` + 1, so the two never collide); every supervisor, node 0
included, is a client of it.  Nothing here is a protocol of our own: keys,
counters (``add``) and first-writer-wins (``compare_set``) of that store.

Key layout (version 1, every key under ``tpsv/v1/``)::

    run_id              node 0: the run id every node uses (``--run-id``, or node 0's own)
    node/<R>/claims     add-counter; above 1: two supervisors said ``--node-rank R``
    node/<R>/info       JSON {host, pid, fingerprint, token}: what node R registered
    refused             the first refusal (duplicate, mismatch, token), so every node says the same
    ready               add-counter of nodes that validated the group: the start barrier
    beat/<R>            add-counter, +1 every BEAT_S: node R's supervisor is alive
    fault/<n>           the first fatal incident of any node in group attempt n (compare_set): JSON
                        {node, rank, reason, incident_id, verdict}; everyone else tears down, exit 84
                        (or, with --max-restarts, all restart together: restart/<n>, ready/<n+1>)
    restart/<n>         node 0's decision after attempt n: JSON {restart, delay_s, restarts}
    ready/<n>           add-counter: nodes ready to launch attempt n (the barrier of a group restart)
    hang/<n>            the first hang query (compare_set): JSON {node, incident_id, seq, verdict}: every
                        rank of that node waits in a collective; the node holding the missing rank
                        raises the hang itself under that incident id (see ``HangQuery``)
    done/<a>/<R>        node R finished attempt a cleanly, or saw its fault (its silence is then no loss)
    stop                a node stopped on a signal (first writer): every node stops, in an attempt or between

Every key a node-link pass reads (fault/<a>, hang/<a>, stop, beat/<R>, done/<a>/<R>) is created empty, so
one ``multi_get`` reads them all: a pass costs two store calls (this node's beat, the read) on any number of
nodes.

After it, ``NodeLink`` (a thread, one more event source of the main loop)
heartbeats into the store, watches the other nodes' beats and the fault
key, and posts ``PeerFailed`` / ``NodeLost``; the main thread's
``publish_fault`` only enqueues.  Every store call runs on that thread with
the store's timeout (node 0 alone, at its exit, after its teardown, gives the
others a bounded moment to read the store): none sits on a path that can
block a teardown.  The
``Store`` protocol is the small interface another store (etcd) would
implement.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

import structlog

from ..events import NodeLost, PeerFailed, PeerHangQuery, StoreKeySeen
from .handshake import NodeGroup
from .messages import Fault, HangQuery
from .store import STORE_TIMEOUT_S, Store

log = structlog.get_logger("supervise.nodes")

BEAT_S = 0.25  # heartbeat and fault-bus poll period
NODE_LOST_S = 4.0  # a node whose beat counter stood still this long is lost
# ... once it has beaten: a node that passed the handshake may take longer to start its link on a loaded
# host (its imports, its ranks' spawn), so its first beat gets this long before it counts as lost.
FIRST_BEAT_S = 15.0
REFUSAL_LINGER_S = 1.5  # node 0 keeps the store up this long after a refusal, so every node reads it
STORE_LINGER_S = 5.0  # node 0 keeps the store up this long at its exit, until every node read the end
POLL_S = 0.1


























# -- after the handshake: fault bus and liveness ------------------------------------------------------














class NodeLink:
    """Thread ``node-link``: beats, watches the others and the fault bus, and publishes what the main thread hands it."""

    def __init__(self, store: Store, group: NodeGroup, post: Callable[[object], None],
                 on_peers: Callable[[Mapping[int, bool]], None] | None = None,
                 on_store_latency: Callable[[str, float], None] | None = None):
        self.store = store
        self.group = group
        self.post = post
        self.on_peers = on_peers or (lambda _up: None)  # the metrics (supervise_peer_node_up)
        if on_store_latency is not None:  # the metrics (supervise_store_latency_seconds), the handshake's calls first
            store.latency.attach(on_store_latency)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-link", daemon=True)
        self._seen: dict[int, tuple[int, float]] = {}  # node -> (beat count, when it last changed)
        self._store_ok_at = time.monotonic()
        self._reported: set[int] = set()
        self._done: set[int] = set()  # nodes that said they finished: their silence is no loss
        self._fault_posted = False
        self._query_posted = False
        self._keys_ready = False
        self._attempt = 1  # fault/<n> and hang/<n> of this group attempt are watched (--max-restarts)
        self._stop_posted = False
        self._retry: deque = deque()  # an outbox item whose store call failed: first in line next pass
        self._watches: dict[str, Callable[[bytes], bool]] = {}  # key -> condition; StoreKeySeen once it holds

    # -- main thread --------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the link; node 0 (the store's host) first gives the others a bounded moment to read what is
        there (a fault, the end of the run) before its exit takes the store away."""
        self._stop.set()
        self._thread.join(STORE_TIMEOUT_S + 1.0)
        self._drain_outbox_safely()  # what the main thread handed over last (the thread has stopped)
        if self.group.node_rank != 0:
            return
        deadline = time.monotonic() + STORE_LINGER_S
        while time.monotonic() < deadline:
            try:
                if all(self.store.get_nowait(f"done/{self._attempt}/{n}") for n in range(1, self.group.nnodes)):
                    return
            except Exception:
                return
            time.sleep(POLL_S)

    def _drain_outbox_safely(self) -> None:
        try:
            self._drain_outbox()
        except Exception as exc:
            log.warning("node link: could not reach the store before stopping", error=repr(exc)[:200])

    def publish_stop(self, fault: Fault) -> None:
        """This node stops on a signal: every other node stops too, whatever attempt it is in (never blocks)."""
        self._outbox.put(("stop", fault))

    def publish_fault(self, fault: Fault) -> None:
        """Hand a fatal incident of this node to the bus (never blocks)."""
        self._outbox.put(("fault", fault))

    def ask_where(self, query: HangQuery) -> None:
        """Hand a hang query of this node to the other nodes (never blocks)."""
        self._outbox.put(("hang", query))

    def begin_attempt(self, number: int) -> None:
        """The group starts attempt ``number``: from now on its fault and hang keys are the ones watched."""
        self._outbox.put(("attempt", number))

    def set(self, key: str, value: bytes) -> None:
        """Write a key of the run (e.g. node 0's restart decision) from the link's thread (never blocks)."""
        self._outbox.put(("set", (key, value)))

    def add(self, key: str, amount: int = 1) -> None:
        self._outbox.put(("add", (key, amount)))

    def watch(self, key: str, until: Callable[[bytes], bool]) -> None:
        """Post ``StoreKeySeen(key, value)`` once ``until(value)`` holds (missing keys read as b"")."""
        self._outbox.put(("watch", (key, until)))

    def finished(self) -> None:
        """This node ends cleanly: its silence from now on is not a loss."""
        self._outbox.put(("done", None))

    # -- the thread ---------------------------------------------------------------------------------
    def _create_keys(self) -> None:
        """Every key a pass reads exists from the start (empty = not set), so one ``get_many`` reads them
        all: two store calls per pass (the beat and the read) whatever the number of nodes, instead of two
        per node.  Idempotent: a key another node already set keeps its value."""
        for node in range(self.group.nnodes):
            self.store.add(f"beat/{node}", 0)
        self.store.first_writer("stop", b"")
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
        self._done, self._seen = set(), {}
        self._store_ok_at = time.monotonic()
        self._create_attempt_keys()

    def _read_all(self) -> dict[str, bytes]:
        me, a = self.group.node_rank, self._attempt
        keys = [f"fault/{a}", f"hang/{a}", "stop"] + [
            key for n in range(self.group.nnodes) if n != me for key in (f"beat/{n}", f"done/{a}/{n}")]
        seen = dict(zip(keys, self.store.get_many(keys)))
        seen["fault"], seen["hang"] = seen[keys[0]], seen[keys[1]]
        for n in range(self.group.nnodes):
            if n != me:
                seen[f"done/{n}"] = seen[f"done/{a}/{n}"]
        return seen

    def _check_watches(self) -> None:
        for key, until in list(self._watches.items()):
            value = self.store.get_nowait(key) or b""
            if until(value):
                del self._watches[key]
                self.post(StoreKeySeen(key, value))

    def _run(self) -> None:
        me = self.group.node_rank
        while not self._stop.is_set():
            try:
                if not self._keys_ready:
                    self._create_keys()
                self._drain_outbox()
                self.store.add(f"beat/{me}", 1)
                seen = self._read_all()
                self._watch_fault(seen)
                self._watch_beats(seen)
                self._check_watches()
                self._store_ok_at = time.monotonic()
                self.on_peers({n: n not in self._reported and n not in self._done
                               for n in range(self.group.nnodes) if n != me})
            except Exception as exc:  # the store is unreachable (node 0 gone) or timed out
                silent = time.monotonic() - self._store_ok_at
                if silent >= NODE_LOST_S and 0 not in self._reported and 0 not in self._done and me != 0:
                    self._reported.add(0)
                    self.on_peers({n: False for n in range(self.group.nnodes) if n != me})
                    self.post(NodeLost(0, f"the store on node 0 ({self.group.store_addr}) is gone: {exc!r}"[:300],
                                       time.monotonic()))
            self._stop.wait(BEAT_S)

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

    def _apply(self, kind: str, item) -> None:
        """One queued item: one store call (or none)."""
        if kind == "fault":
            self.store.first_writer(f"fault/{self._attempt}", item.encode())
        elif kind == "stop":
            self.store.first_writer("stop", item.encode())
        elif kind == "hang":
            self.store.first_writer(f"hang/{self._attempt}", item.encode())
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

    def _watch_fault(self, seen: Mapping[str, bytes]) -> None:
        if seen["stop"] and not self._stop_posted:
            # A node stopped on a signal, in an attempt or between two: every node stops (exit 0).
            self._stop_posted = True
            fault = Fault.decode(seen["stop"])
            if fault.node != self.group.node_rank:
                self.post(PeerFailed(fault, time.monotonic(), self._attempt))
        if self._fault_posted:
            return
        if not self._query_posted and seen["hang"]:
            self._query_posted = True
            query = HangQuery.decode(seen["hang"])
            if query.node != self.group.node_rank:
                self.post(PeerHangQuery(query, time.monotonic()))
        raw = seen["fault"]
        if not raw:
            return
        fault = Fault.decode(raw)
        self._fault_posted = True
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
            count = int(seen[f"beat/{node}"] or 0)
            last = self._seen.get(node)
            if last is None or last[0] != count:
                self._seen[node] = (count, now)
                continue
            if now - last[1] >= (NODE_LOST_S if count > 0 else FIRST_BEAT_S):
                self._reported.add(node)
                host = self.group.hosts.get(node, "?")
                self.post(NodeLost(node, f"node {node} ({host}) stopped heartbeating {now - last[1]:.1f} s ago",
                                   now))






