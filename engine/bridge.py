"""The hand-off between the HTTP thread and the engine loop on rank 0 (torch-free).

The HTTP thread (its own asyncio loop) calls ``submit``/``abort``; the engine
loop (main thread) calls ``drain`` to take what arrived since the last step,
blocking with a timeout only when it has nothing to run, and ``deliver`` to
hand each step's outputs back.  Outputs cross threads with one
``call_soon_threadsafe`` per step, so the engine never waits on the frontend.

Shutdown: ``request_shutdown(reason)`` (safe in a signal handler) wakes the
engine's drain, which stops accepting; ``fail_all`` then answers every
in-flight request with an error.  ``stop_serving(message, failed)`` does
both at once from any thread (the shutdown guard on a signal, the engine
thread when its group failed): no new request is accepted and every request
in flight gets ``message``; ``failed`` marks the group dead for ``/health``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .scheduler import Request, SeqOutput


@dataclass(frozen=True)
class ControlMessage:
    """What rank 0 learned since the last loop iteration (the replicated plane broadcasts it)."""

    requests: tuple[Request, ...] = ()
    aborts: tuple[str, ...] = ()
    shutdown: bool = False

    @property
    def empty(self) -> bool:
        return not (self.requests or self.aborts or self.shutdown)


@dataclass(frozen=True)
class EngineError:
    """Delivered instead of outputs when the engine stops with requests in flight."""

    message: str


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


_ABORT = "abort"
_SUBMIT = "submit"
_CLOSE = "close"


class EngineBridge:
    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.close_reason = ""
        self.failed = False  # the group failed (a collective raised): /health never says ok again

    # -- HTTP thread -------------------------------------------------------
    @property
    def accepting(self) -> bool:
        return not self._closed

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        """Queue a request; its outputs (lists of SeqOutput, or an EngineError) arrive on the returned queue."""
        sink = _Sink(loop)
        with self._lock:
            if self._closed:
                raise RuntimeError(self.close_reason or "engine is shutting down")
            self._sinks[request.request_id] = sink
        self._inbox.put((_SUBMIT, request))
        return sink.queue

    def abort(self, request_id: str) -> None:
        with self._lock:
            known = self._sinks.pop(request_id, None) is not None
        if known:
            self._inbox.put((_ABORT, request_id))

    # -- engine thread -----------------------------------------------------
    def request_shutdown(self, reason: str) -> None:
        """Wake the engine loop with a shutdown (signal-safe: no lock, SimpleQueue.put is reentrant)."""
        self._inbox.put((_CLOSE, reason))

    def _mark_closed(self, reason: str) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.close_reason = reason

    def stop_serving(self, message: str, failed: bool) -> None:
        """Refuse new requests and answer every in-flight one with ``message`` (any thread but a signal handler)."""
        with self._lock:
            self.failed = self.failed or failed
            if not self._closed or failed:
                self._closed = True
                self.close_reason = message
        self.fail_all(message)

    def drain(self, timeout: float | None) -> ControlMessage:
        """Everything queued; waits up to ``timeout`` for the first item (None: do not wait)."""
        requests: list[Request] = []
        aborts: list[str] = []
        shutdown = False
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return ControlMessage()
        while True:
            kind, value = item
            if kind == _SUBMIT:
                requests.append(value)
            elif kind == _ABORT:
                aborts.append(value)
            else:
                shutdown = True
                self._mark_closed(value)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        return ControlMessage(tuple(requests), tuple(aborts), shutdown)

    def deliver(self, outputs: list[SeqOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, SeqOutput]]] = {}
        with self._lock:
            for out in outputs:
                sink = self._sinks.get(out.seq_id)
                if sink is None:
                    continue
                if out.finished:
                    del self._sinks[out.seq_id]
                by_loop.setdefault(sink.loop, []).append((sink.queue, out))
        for loop, batch in by_loop.items():
            _call_soon(loop, _dispatch, batch)

    def fail(self, request_ids, message: str) -> None:
        """Answer these requests with an error (e.g. refused by the scheduler)."""
        with self._lock:
            sinks = [self._sinks.pop(r) for r in request_ids if r in self._sinks]
        for sink in sinks:
            _call_soon(sink.loop, sink.queue.put_nowait, EngineError(message))

    def fail_all(self, message: str) -> None:
        with self._lock:
            sinks = list(self._sinks.values())
            self._sinks.clear()
        error = EngineError(message)
        for sink in sinks:
            _call_soon(sink.loop, sink.queue.put_nowait, error)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._sinks)


def _dispatch(batch: list[tuple[asyncio.Queue, SeqOutput]]) -> None:
    for q, out in batch:
        q.put_nowait(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the HTTP loop is already closed: nobody is waiting
