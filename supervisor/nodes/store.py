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
from typing import Protocol

import structlog

log = structlog.get_logger("supervise.nodes")


PREFIX = "tpsv/v1/"


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


def client(store_addr: str, timeout_s: float = STORE_TIMEOUT_S, connect_timeout_s: float | None = None) -> TorchStore:
    """One more client of node 0's store (``NodeGroup.store_addr``), for a thread that needs its own
    connection (the cross-node consensus, the incident exchange); every call has ``timeout_s``."""
    host, port = store_addr.rsplit(":", 1)
    return TorchStore(host, int(port), False, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)


