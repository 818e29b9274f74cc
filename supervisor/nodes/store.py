"""The store the node supervisors share: node 0 hosts it, every node is a client.

``Store`` is the small interface the node link, the handshake, the incident
exchange and the cross-node consensus use; ``TorchStore`` implements it on
torch.distributed's ``TCPStore`` (the store torchrun's rendezvous uses).
Every call is timed (``StoreLatency``): the durations wait in a small bounded
buffer until the metrics exist (the handshake runs before them), then go to
``supervise_store_latency_seconds{op}``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, TypeVar

import structlog

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = structlog.get_logger("supervise.nodes")


PREFIX = "tpsv/v1/"

T = TypeVar("T")


STORE_TIMEOUT_S = 3.0  # every store call: a peer that stopped answering is lost, not waited for


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


class StoreDeadline(TimeoutError):
    """A store call did not return within its deadline: the store (or the way to it) is frozen or gone."""


class Store(Protocol):
    """What the supervisors need of a distributed key-value store (TCPStore today; etcd could follow)."""

    latency: StoreLatency  # every call below is timed into it

    def set(self, key: str, value: bytes) -> None: ...
    def get_nowait(self, key: str) -> bytes | None: ...
    def add(self, key: str, amount: int) -> int: ...
    def first_writer(self, key: str, value: bytes) -> bytes: ...
    def call_timeout(self, seconds: float) -> None:
        """Every later call of this client gives up after ``seconds`` (a caller with a deadline shrinks it)."""

    def get_many(self, keys: Sequence[str]) -> list[bytes]: ...  # every key must exist (see NodeLink)


class _Caller:
    """Runs a client's calls on one worker thread and waits for each at most ``timeout_s``.

    torch's store timeout does not bound a server that holds the connection and never answers (node 0's
    supervisor SIGSTOPped, its host black-holed): the call would block for minutes.  Here the deadline is
    enforced outside the call.  A call that overran leaves the worker stuck in it, so the client is broken
    from then on: every later call fails at once (the caller treats the store as lost, or opens a new client).
    """

    def __init__(self, name: str):
        self._lock = threading.Lock()
        self._work: deque[tuple[Callable[[], object], list, threading.Event]] = deque()
        self._ready = threading.Condition(self._lock)
        self.broken: str | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        if self.broken:
            raise StoreDeadline(self.broken)
        box: list = []
        done = threading.Event()
        with self._ready:
            self._work.append((fn, box, done))
            self._ready.notify()
        if not done.wait(timeout_s):
            self.broken = f"a store call got no answer within {timeout_s:.1f} s"
            raise StoreDeadline(self.broken)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._work:
                    self._ready.wait()
                fn, box, done = self._work.popleft()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the caller
                box.append((False, exc))
            done.set()


class TorchStore:
    """``torch.distributed.TCPStore`` behind ``Store``; node 0 hosts it (``is_master``), in this process only
    in tests and benchmarks (the supervisor hosts it in a child: ``store_host``)."""

    def __init__(
        self,
        host: str,
        port: int,
        is_master: bool,
        timeout_s: float = STORE_TIMEOUT_S,
        connect_timeout_s: float | None = None,
    ):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d prints a C++ backtrace per lost connection
        from torch.distributed import TCPStore

        self.latency = StoreLatency()
        self.timeout_s = timeout_s
        self._caller = _Caller(f"store-client-{port}")
        t0 = time.monotonic()
        connect_s = connect_timeout_s or timeout_s
        self._store: TCPStore = self._caller.call(
            lambda: TCPStore(host, port, None, is_master, timedelta(seconds=connect_s), wait_for_workers=False),
            connect_s + 1.0,
        )
        self.latency.record("connect", time.monotonic() - t0)  # a refused attempt raised: not a latency
        self._store.set_timeout(timedelta(seconds=timeout_s))
        self.port = self._store.port

    def call_timeout(self, seconds: float) -> None:
        self.timeout_s = max(0.001, seconds)
        self._store.set_timeout(timedelta(seconds=self.timeout_s))

    def _timed(self, op: str, fn: Callable[[], T]) -> T:
        t0 = time.monotonic()
        try:
            # torch's own timeout first; ours a moment later, for the calls torch's does not bound
            return self._caller.call(fn, self.timeout_s + 0.5)
        finally:
            self.latency.record(op, time.monotonic() - t0)

    def set(self, key: str, value: bytes) -> None:
        # torch's stub says str; the binding (a std::string) takes bytes as they are
        self._timed("set", lambda: self._store.set(PREFIX + key, value))  # type: ignore[arg-type]

    def get_nowait(self, key: str) -> bytes | None:
        """One ``get`` sample: the check and, when the key exists, the read."""
        full = PREFIX + key

        def get() -> bytes | None:
            if not self._store.check([full]):
                return None
            return bytes(self._store.get(full))

        return self._timed("get", get)

    def add(self, key: str, amount: int) -> int:
        return int(self._timed("add", lambda: self._store.add(PREFIX + key, amount)))

    def first_writer(self, key: str, value: bytes) -> bytes:
        """Set ``key`` unless someone did first (a key holding b"" counts as unset); returns the value that won."""
        # torch's stub says str; the binding (a std::string) takes bytes as they are
        won = self._timed("compare_set", lambda: self._store.compare_set(PREFIX + key, "", value))  # type: ignore[arg-type]
        return bytes(won)

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """One round trip for several keys; a missing key makes it wait for the store timeout, so callers
        create every key first (``NodeLink._create_keys``)."""
        values = self._timed("multi_get", lambda: self._store.multi_get([PREFIX + k for k in keys]))
        return [bytes(v) for v in values]


def client(store_addr: str, timeout_s: float = STORE_TIMEOUT_S, connect_timeout_s: float | None = None) -> TorchStore:
    """One more client of node 0's store (``NodeGroup.store_addr``), for a thread that needs its own
    connection (the cross-node consensus, the incident exchange); every call has ``timeout_s``."""
    host, port = store_addr.rsplit(":", 1)
    return TorchStore(host, int(port), False, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
