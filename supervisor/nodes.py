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

Handshake (``handshake``), before any rank starts, bounded by
``--rendezvous-timeout``: every node registers; refused on every node, with
what to change and nothing started: a duplicate ``--node-rank``, a
fingerprint mismatch (command and arguments, ``--nproc-per-node``,
tp-supervise, Python and torch versions, ``--fingerprint-env`` keys: the
error says ``mismatch`` and lists the differing fields per node), a wrong
``--join-token`` (compared as an HMAC digest, never logged).  A node missing
after the timeout is exit 83, with a progress line every few seconds naming
the missing node ranks and the store address.

After it, ``NodeLink`` (a thread, one more event source of the main loop)
heartbeats into the store, watches the other nodes' beats and the fault
key, and posts ``PeerFailed`` / ``NodeLost``; the main thread's
``publish_fault`` only enqueues.  Every store call runs on that thread with
the store's timeout (node 0 alone, at its exit, after its teardown, gives the
others a bounded moment to read the store): none sits on a path that can
block a teardown.  The
``Store`` protocol is the small interface another store (etcd) would
implement.

Every store call is timed (``StoreLatency``): the durations wait in a small
bounded buffer until the metrics exist (the handshake runs before them) and
then go to ``supervise_store_latency_seconds{op}``; recording one is a
``time.monotonic()`` pair and a histogram observe, never I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import queue
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Mapping, Protocol, Sequence

import structlog

log = structlog.get_logger("supervise.nodes")

PREFIX = "tpsv/v1/"
STORE_TIMEOUT_S = 3.0  # every store call: a peer that stopped answering is lost, not waited for
BEAT_S = 0.25  # heartbeat and fault-bus poll period
NODE_LOST_S = 4.0  # a node whose beat counter stood still this long is lost
# ... once it has beaten: a node that passed the handshake may take longer to start its link on a loaded
# host (its imports, its ranks' spawn), so its first beat gets this long before it counts as lost.
FIRST_BEAT_S = 15.0
PROGRESS_EVERY_S = 3.0  # handshake progress lines
REFUSAL_LINGER_S = 1.5  # node 0 keeps the store up this long after a refusal, so every node reads it
STORE_LINGER_S = 5.0  # node 0 keeps the store up this long at its exit, until every node read the end
POLL_S = 0.1
HANG_QUERY_WAIT_S = 3.0  # a node asking where the missing rank is rules alone after this
TOKEN_MESSAGE = b"tp-supervise join token v1"
LATENCY_PENDING_MAX = 4096  # store calls timed before the metrics exist (the handshake's), kept until attached


class StoreLatency:
    """Durations of one store client's calls, handed to a sink (the metrics) once one is attached.

    Calls come from the handshake (main thread, before the metrics exist) and from the node-link thread;
    until ``attach`` they wait in a bounded buffer, so the handshake's calls are counted too.  A sink that
    raises is ignored: a metric never fails a store call."""

    def __init__(self, keep: int = LATENCY_PENDING_MAX):
        self._lock = threading.Lock()
        self._pending: deque[tuple[str, float]] = deque(maxlen=keep)
        self._sink: Callable[[str, float], None] | None = None

    def record(self, op: str, seconds: float) -> None:
        sink = self._sink
        if sink is None:
            with self._lock:
                sink = self._sink
                if sink is None:
                    self._pending.append((op, seconds))
                    return
        self._deliver(sink, op, seconds)

    def attach(self, sink: Callable[[str, float], None]) -> None:
        """From now on every duration goes to ``sink(op, seconds)``, the buffered ones first."""
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
            self._sink = sink
        for op, seconds in pending:
            self._deliver(sink, op, seconds)

    @staticmethod
    def _deliver(sink: Callable[[str, float], None], op: str, seconds: float) -> None:
        try:
            sink(op, seconds)
        except Exception as exc:
            log.warning("store latency not recorded", op=op, error=repr(exc)[:200])


class Store(Protocol):
    """What the supervisors need of a distributed key-value store (TCPStore today; etcd could follow)."""

    latency: StoreLatency  # every call below is timed into it

    def set(self, key: str, value: bytes) -> None: ...
    def get_nowait(self, key: str) -> bytes | None: ...
    def add(self, key: str, amount: int) -> int: ...
    def first_writer(self, key: str, value: bytes) -> bytes: ...
    def call_timeout(self, seconds: float) -> None:
        """Every later call of this client gives up after ``seconds`` (a caller with a deadline shrinks it)."""
        self._store.set_timeout(timedelta(seconds=max(0.001, seconds)))

    def get_many(self, keys: Sequence[str]) -> list[bytes]: ...  # every key must exist (see NodeLink)


class TorchStore:
    """``torch.distributed.TCPStore`` behind ``Store``; node 0 hosts it (``is_master``)."""

    def __init__(self, host: str, port: int, is_master: bool, timeout_s: float = STORE_TIMEOUT_S,
                 connect_timeout_s: float | None = None):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d prints a C++ backtrace per lost connection
        from torch.distributed import TCPStore

        self.latency = StoreLatency()
        t0 = time.monotonic()
        self._store = TCPStore(host, port, None, is_master, timedelta(seconds=connect_timeout_s or timeout_s),
                               wait_for_workers=False)
        self.latency.record("connect", time.monotonic() - t0)  # a refused attempt raised: not a latency
        self._store.set_timeout(timedelta(seconds=timeout_s))
        self.port = self._store.port

    def set(self, key: str, value: bytes) -> None:
        t0 = time.monotonic()
        try:
            self._store.set(PREFIX + key, value)
        finally:
            self.latency.record("set", time.monotonic() - t0)

    def get_nowait(self, key: str) -> bytes | None:
        """One ``get`` sample: the check and, when the key exists, the read."""
        full = PREFIX + key
        t0 = time.monotonic()
        try:
            if not self._store.check([full]):
                return None
            return bytes(self._store.get(full))
        finally:
            self.latency.record("get", time.monotonic() - t0)

    def add(self, key: str, amount: int) -> int:
        t0 = time.monotonic()
        try:
            return int(self._store.add(PREFIX + key, amount))
        finally:
            self.latency.record("add", time.monotonic() - t0)

    def first_writer(self, key: str, value: bytes) -> bytes:
        """Set ``key`` unless someone did first (a key holding b"" counts as unset); returns the value that won."""
        t0 = time.monotonic()
        try:
            return bytes(self._store.compare_set(PREFIX + key, "", value))
        finally:
            self.latency.record("compare_set", time.monotonic() - t0)

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """One round trip for several keys; a missing key makes it wait for the store timeout, so callers
        create every key first (``NodeLink._create_keys``)."""
        t0 = time.monotonic()
        try:
            return [bytes(v) for v in self._store.multi_get([PREFIX + k for k in keys])]
        finally:
            self.latency.record("multi_get", time.monotonic() - t0)


def default_store_port(master_port: int) -> int:
    return master_port + 1


def token_digest(token: str | None) -> str:
    """What a node registers instead of its join token (an HMAC: the token itself never leaves the node)."""
    if not token:
        return ""
    return hmac.new(token.encode(), TOKEN_MESSAGE, hashlib.sha256).hexdigest()


def fingerprint(command: Sequence[str], nproc_per_node: int, env_keys: Sequence[str],
                environ: Mapping[str, str] = os.environ, max_restarts: int = 0) -> dict[str, str]:
    """What must be equal on every node of one TP group."""
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    out = {
        "command": " ".join(command),
        "nproc_per_node": str(nproc_per_node),
        "max_restarts": str(max_restarts),  # the group restarts together: every node must agree
        "tp_supervise": version("tp-supervise"),
        "python": platform.python_version(),
        "torch": version("torch"),
    }
    for key in env_keys:
        out[f"env:{key}"] = environ.get(key, "(unset)")
    return out


def mismatches(infos: Mapping[int, dict]) -> list[str]:
    """Fingerprint fields that differ across nodes, one line per field naming each node's value."""
    fields = sorted({k for info in infos.values() for k in info.get("fingerprint", {})})
    out = []
    for name in fields:
        values = {node: info.get("fingerprint", {}).get(name, "(missing)") for node, info in sorted(infos.items())}
        if len(set(values.values())) > 1:
            shown = "; ".join(f"node {node}: {value!r}" for node, value in values.items())
            out.append(f"{name}: {shown}")
    return out


class HandshakeError(RuntimeError):
    """The group cannot start; ``code`` is the exit code (64 refused, 83 timeout)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class NodeGroup:
    """What the handshake established: the shared run id and this node's place."""

    run_id: str
    nnodes: int
    node_rank: int
    store_addr: str
    hosts: Mapping[int, str] = field(default_factory=dict)


def handshake(store: Store, **kw) -> NodeGroup:
    """Register, validate every node, pass the start barrier; raises HandshakeError (64 or 83) only.

    A store that fails mid-way (node 0 gone, a network error) is a rendezvous failure (83), never a
    traceback."""
    from .outcome import EXIT_STARTUP

    try:
        return _handshake(store, **kw)
    except HandshakeError:
        raise
    except Exception as exc:
        raise HandshakeError(f"rendezvous failed: the store at {kw.get('store_addr')} stopped answering during the "
                             f"handshake ({type(exc).__name__}: {str(exc)[:200]}); is node 0 still running?",
                             EXIT_STARTUP) from None


def _handshake(store: Store, *, nnodes: int, node_rank: int, run_id: str | None, fp: Mapping[str, str],
               token: str | None, deadline: float, store_addr: str,
               progress: Callable[[str, dict], None] | None = None) -> NodeGroup:
    from .outcome import EXIT_STARTUP, EXIT_USAGE

    say = progress or (lambda event, fields: log.info(event, **fields))
    if node_rank == 0:
        shared = store.first_writer("run_id", (run_id or "").encode()).decode()
        if not shared:
            raise HandshakeError("node 0 could not publish a run id", EXIT_USAGE)
    host = socket.gethostname()
    claims = store.add(f"node/{node_rank}/claims", 1)
    info = {"host": host, "pid": os.getpid(), "fingerprint": dict(fp), "token": token_digest(token)}
    if claims > 1:
        other = store.get_nowait(f"node/{node_rank}/info")
        who = json.loads(other)["host"] if other else "another supervisor"
        _refuse(store, f"duplicate --node-rank {node_rank}: {who} registered as node {node_rank} first; give "
                f"every node its own --node-rank in 0..{nnodes - 1}")
    store.set(f"node/{node_rank}/info", json.dumps(info).encode())
    next_progress = time.monotonic() + PROGRESS_EVERY_S
    while True:
        refused = store.get_nowait("refused")
        if refused:
            raise HandshakeError(refused.decode(), EXIT_USAGE)
        infos = {}
        for node in range(nnodes):
            raw = store.get_nowait(f"node/{node}/info")
            if raw is not None:
                infos[node] = json.loads(raw)
            if store.add(f"node/{node}/claims", 0) > 1:
                _refuse(store, f"duplicate --node-rank {node}: two supervisors registered as node {node}; "
                        f"give every node its own --node-rank in 0..{nnodes - 1}")
        missing = [node for node in range(nnodes) if node not in infos]
        if not missing:
            break
        now = time.monotonic()
        if now >= deadline:
            raise HandshakeError(
                f"rendezvous timeout: node rank(s) {missing} never registered at the store {store_addr}; start a "
                f"supervise serve with --node-rank {missing[0]} (same --master-addr/--master-port), or raise "
                "--rendezvous-timeout", EXIT_STARTUP)
        if now >= next_progress:
            next_progress = now + PROGRESS_EVERY_S
            say("waiting for nodes", {"missing_node_ranks": missing, "store": store_addr,
                                      "registered": sorted(infos)})
        time.sleep(POLL_S)
    tokens = {node: info.get("token", "") for node, info in infos.items()}
    if len(set(tokens.values())) > 1:
        wrong = sorted(node for node, digest in tokens.items() if digest != tokens[0])
        _refuse(store, f"join token mismatch: node(s) {wrong} did not give node 0's --join-token; give every "
                "node the same --join-token")
    differing = mismatches(infos)
    if differing:
        _refuse(store, "fingerprint mismatch between nodes (every node must run the same job): "
                + " | ".join(differing))
    shared = ""
    while not shared:
        raw = store.get_nowait("run_id")
        shared = raw.decode() if raw else ""
        if not shared:
            if time.monotonic() >= deadline:
                raise HandshakeError(f"rendezvous timeout: node 0 published no run id at {store_addr}", EXIT_STARTUP)
            time.sleep(POLL_S)
    store.add("ready", 1)
    while store.add("ready", 0) < nnodes:
        refused = store.get_nowait("refused")
        if refused:
            raise HandshakeError(refused.decode(), EXIT_USAGE)
        if time.monotonic() >= deadline:
            raise HandshakeError(f"rendezvous timeout: not every node passed the start barrier at {store_addr}",
                                 EXIT_STARTUP)
        time.sleep(POLL_S)
    return NodeGroup(run_id=shared, nnodes=nnodes, node_rank=node_rank, store_addr=store_addr,
                     hosts={node: info["host"] for node, info in infos.items()})


def _refuse(store: Store, message: str) -> None:
    from .outcome import EXIT_USAGE

    won = store.first_writer("refused", message.encode()).decode()
    raise HandshakeError(won or message, EXIT_USAGE)


# -- after the handshake: fault bus and liveness ------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """A fatal incident on some node, as the fault bus carries it."""

    node: int
    rank: int | None
    reason: str
    incident_id: str
    verdict: str

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Fault":
        data = json.loads(raw)
        return cls(int(data["node"]), data.get("rank"), str(data["reason"]), str(data["incident_id"]),
                   str(data.get("verdict", "")))


@dataclass(frozen=True)
class HangQuery:
    """A node whose every rank waits inside a collective asks the others where the missing rank is.

    ``seq`` is the highest collective sequence number its ranks wait in.  A
    node that holds the rank that is elsewhere (stopped, outside collectives,
    behind) raises the hang itself, under ``incident_id``; when nobody does
    within ``HANG_QUERY_WAIT_S`` the asking node rules on its own evidence.
    """

    node: int
    incident_id: str
    seq: int
    verdict: str

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "HangQuery":
        data = json.loads(raw)
        return cls(int(data["node"]), str(data["incident_id"]), int(data["seq"]), str(data.get("verdict", "")))


@dataclass(frozen=True)
class PeerHangQuery:
    """Event: another node's ranks all wait in a collective; is the missing rank here?"""

    query: HangQuery
    at: float


@dataclass(frozen=True)
class StoreKeySeen:
    """Event: a key the main thread asked the node link to watch (``NodeLink.watch``) reached what it waited for."""

    key: str
    value: bytes


@dataclass(frozen=True)
class PeerFailed:
    """Event: another node published a fatal incident (or stopped: reason ``shutdown``)."""

    fault: Fault
    at: float
    attempt: int = 1  # the group attempt whose fault key held it


@dataclass(frozen=True)
class NodeLost:
    """Event: a node's supervisor stopped beating (or node 0's store is gone)."""

    node: int
    detail: str
    at: float


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


def client(store_addr: str, timeout_s: float = STORE_TIMEOUT_S, connect_timeout_s: float | None = None) -> TorchStore:
    """One more client of node 0's store (``NodeGroup.store_addr``), for a thread that needs its own
    connection (the cross-node consensus, the incident exchange); every call has ``timeout_s``."""
    host, port = store_addr.rsplit(":", 1)
    return TorchStore(host, int(port), False, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)


def connect(host: str, port: int, is_master: bool, deadline: float,
            progress: Callable[[str, dict], None] | None = None) -> TorchStore:
    """Node 0 hosts the store; the others retry connecting until ``deadline`` (node 0 may start later)."""
    say = progress or (lambda event, fields: log.info(event, **fields))
    from .outcome import EXIT_STARTUP, EXIT_USAGE

    if is_master:
        try:
            return TorchStore(host if host not in ("localhost",) else "127.0.0.1", port, True)
        except Exception as exc:
            raise HandshakeError(f"node 0 cannot host the store on port {port} ({exc}); free the port or choose "
                                 "another with --store-port", EXIT_USAGE) from None
    last = None
    next_progress = time.monotonic() + PROGRESS_EVERY_S
    while time.monotonic() < deadline:
        if time.monotonic() >= next_progress:
            next_progress = time.monotonic() + PROGRESS_EVERY_S
            say("waiting for nodes", {"missing_node_ranks": [0], "store": f"{host}:{port}",
                                      "detail": "node 0 hosts the store and has not answered yet"})
        try:
            return TorchStore(host, port, False, connect_timeout_s=max(0.5, min(STORE_TIMEOUT_S,
                                                                                deadline - time.monotonic())))
        except Exception as exc:
            last = exc
            time.sleep(0.5)
    raise HandshakeError(f"rendezvous timeout: node 0's store at {host}:{port} never answered ({last}); start node 0 "
                         "(supervise serve --node-rank 0) or check --master-addr/--store-port", EXIT_STARTUP)


__all__ = ["Fault", "HandshakeError", "NodeGroup", "NodeLink", "NodeLost", "PeerFailed", "Store",
           "StoreLatency", "TorchStore", "connect", "default_store_port", "fingerprint", "handshake", "mismatches", "token_digest"]
