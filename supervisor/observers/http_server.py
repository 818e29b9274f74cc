"""Health and metrics endpoint of the supervisor (``--metrics-addr``).

Routes::

    GET /metrics   Prometheus exposition of SupervisorMetrics' private registry
    GET /healthz   200 while healthy (engine ready or only suspect, no confirmed fault), else 503
    GET /readyz    200 only while ready (not starting, nothing suspected, no fault), else 503
    GET /livez     200 while the supervisor's own loop goes round; 503 only when it is wedged
    anything else  404 (405 for methods other than GET/HEAD)

The health bodies are JSON: ``{"state", "healthy", "ready", "detail"}``.

A request never waits on the supervisor: ``health`` must return a value
computed elsewhere (``HealthCell`` holds one: the supervisor's loop ``set()``s
it, a request reads one attribute).  The only lock a request can meet is the
metrics registry's.  Requests run on their own named daemon threads with a
socket timeout, so a stuck client cannot hold up a probe.

The endpoint has no authentication.  It binds what it is given; the CLI's
default is loopback, and binding anything else logs a warning (see
docs/metrics.md for what exposing it reveals).
"""

from __future__ import annotations

import json
import math
import os
import select
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol
from urllib.parse import urlsplit

import structlog

from .. import state as engine_state
from ..rank.net import is_loopback
from .metrics import SupervisorMetrics

log = structlog.get_logger()

# A client that sends nothing for this long loses its connection (slowloris).
REQUEST_TIMEOUT_S = 10.0
# serve_forever's wake-up interval, i.e. the longest stop() waits for the loop.
SHUTDOWN_POLL_S = 0.25
# stop() waits this long for the serving thread before giving up on it.
STOP_JOIN_S = 5.0
SERVE_THREAD_NAME = "supervise-http"
REQUEST_THREAD_NAME = "supervise-http-request"
JSON_TYPE = "application/json"
TEXT_TYPE = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class HealthStatus:
    """What /healthz and /readyz report; computed by the supervisor, not here."""

    state: str
    healthy: bool
    ready: bool
    detail: str = ""

    @classmethod
    def for_state(cls, state: engine_state.EngineState, detail: str = "") -> HealthStatus:
        """The status implied by the engine state alone (supervisor.state's policy)."""
        return cls(
            state=state.value,
            healthy=engine_state.healthy(state),
            ready=engine_state.ready(state),
            detail=detail,
        )


class HealthCell:
    """The latest HealthStatus; one writer (the supervisor loop), any readers.

    Replacing one attribute is atomic in CPython, so readers never block.
    Pass the cell itself as the ``health`` callable of HealthServer.
    """

    def __init__(self, initial: HealthStatus):
        self._status = initial

    def set(self, status: HealthStatus) -> None:
        self._status = status

    def __call__(self) -> HealthStatus:
        return self._status


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], handler, app: HealthServer):
        self.app = app
        # Open connections: keep-alive clients (Prometheus) would otherwise go
        # on being served by their request threads after stop().
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._closing = False
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a DNS lookup that can
        # stall start-up for seconds; the name is never used here.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = port

    def handle_error(self, request, client_address) -> None:
        # socketserver prints tracebacks to stderr; a client hanging up is routine.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("http client gone", client=client_address[0], error=repr(exc))
        else:
            log.warning("http request failed", client=client_address[0], exc_info=True)

    def process_request_thread(self, request, client_address) -> None:
        with self._conns_lock:
            if self._closing:
                self.shutdown_request(request)
                return
            self._conns.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._conns_lock:
                self._conns.discard(request)

    def close_connections(self) -> None:
        """Hang up on every open connection; later ones are refused."""
        with self._conns_lock:
            self._closing = True
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already gone

    def process_request(self, request, client_address) -> None:
        t = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=REQUEST_THREAD_NAME,
            daemon=True,
        )
        t.start()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT_S
    protocol_version = "HTTP/1.1"
    server_version = "tp-supervise"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._route(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._route(send_body=False)

    def _other_method(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"only GET and HEAD\n", TEXT_TYPE, True)

    do_POST = do_PUT = do_DELETE = do_PATCH = _other_method  # noqa: N815

    def _route(self, send_body: bool) -> None:
        path = urlsplit(self.path).path
        app = self.server.app
        if path == "/metrics" and not app.serve_metrics:
            self._send(
                HTTPStatus.NOT_FOUND,
                b"not here: this listener serves /healthz /readyz /livez; /metrics is on --metrics-addr\n",
                TEXT_TYPE,
                send_body,
            )
        elif path == "/metrics":
            began = time.monotonic()
            try:
                body, content_type = app.metrics.exposition(self.headers.get("Accept", ""))
            except Exception:  # a broken collector must not kill the endpoint
                log.exception("metrics exposition failed")
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, b"exposition failed\n", TEXT_TYPE, send_body)
                return
            self._send(HTTPStatus.OK, body, content_type, send_body)
            if send_body:
                app.scrapes.served(began)
        elif path == "/livez":
            age = app.liveness.age()
            alive = age < app.liveness.stale_after_s
            body = (
                json.dumps(
                    {"alive": alive, "loop_age_s": round(age, 3), "stale_after_s": app.liveness.stale_after_s}
                ).encode()
                + b"\n"
            )
            self._send(HTTPStatus.OK if alive else HTTPStatus.SERVICE_UNAVAILABLE, body, JSON_TYPE, send_body)
        elif path in ("/healthz", "/readyz"):
            status = app.current_health()
            ok = status.healthy if path == "/healthz" else status.ready
            body = json.dumps(asdict(status), sort_keys=True).encode() + b"\n"
            self._send(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, body, JSON_TYPE, send_body)
        else:
            self._send(
                HTTPStatus.NOT_FOUND, b"not found: try /metrics, /healthz, /readyz or /livez\n", TEXT_TYPE, send_body
            )

    def _send(self, code: HTTPStatus, body: bytes, content_type: str, send_body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (base class signature)
        log.debug("http request", client=self.client_address[0], line=format % args)


class Waitable(Protocol):
    """Something select() can wait on that says when it is set (``signals.Hurry``)."""

    def fileno(self) -> int: ...

    def is_set(self) -> bool: ...


class Scrapes:
    """When /metrics was served: lets the supervisor's exit wait for one scrape of its final state.

    A request thread calls ``served(began)`` once a /metrics body went out, ``began`` the monotonic time its
    exposition was taken: a scrape that began after the run's last update carried the final counts.  While
    someone waits, a byte on a pipe wakes it (it also waits on the second-Ctrl-C pipe), so nothing polls; the
    pipe exists only during ``wait_after`` and every use of it holds the lock (no write to a reused fd number).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.latest = -math.inf  # when the exposition of the latest scrape was taken
        self._wake: tuple[int, int] | None = None

    def served(self, began: float) -> None:
        with self._lock:
            self.count += 1
            self.latest = max(self.latest, began)
            if self._wake is not None:
                try:
                    os.write(self._wake[1], b"s")
                except OSError:  # full: readable already
                    pass

    def wait_after(self, mark: float, timeout_s: float, interrupt: Waitable) -> bool:
        """Until a scrape that began at or after ``mark`` was served (True), ``timeout_s`` passed or ``interrupt``
        is set (False)."""
        deadline = time.monotonic() + timeout_s
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        with self._lock:
            self._wake = (r, w)
        try:
            while self.latest < mark:
                left = deadline - time.monotonic()
                if left <= 0 or interrupt.is_set():
                    return False
                select.select([r, interrupt.fileno()], [], [], left)
                try:
                    os.read(r, 4096)
                except BlockingIOError:  # woken by the interrupt (or the time), not by a scrape
                    pass
            return True
        finally:
            with self._lock:
                self._wake = None
            os.close(r)
            os.close(w)


class Liveness:
    """When the supervisor's main loop last went round (``beat`` on the main thread; ``age`` from any thread).

    /livez turns 503 only when the loop has not gone round for ``stale_after_s``: longer than the longest
    thing the loop legitimately does without reading events (a teardown, a fatal dump's capture), so a
    supervisor that is tearing down or restarting on purpose stays alive for Kubernetes.
    """

    def __init__(self, stale_after_s: float):
        self.stale_after_s = stale_after_s
        self._last = time.monotonic()

    def beat(self) -> None:
        self._last = time.monotonic()  # one float assignment: atomic in CPython

    def age(self) -> float:
        return time.monotonic() - self._last


class HealthServer:
    """/metrics, /healthz, /readyz and /livez on a named daemon thread.

    ``port`` 0 binds a free port; read the bound one from ``.port`` after
    ``start()``.  ``start()`` raises OSError when the address cannot be bound.
    """

    def __init__(
        self,
        metrics: SupervisorMetrics,
        health: Callable[[], HealthStatus],
        host: str,
        port: int,
        liveness: Liveness | None = None,
        serve_metrics: bool = True,
    ):
        self.serve_metrics = serve_metrics  # False: a health-only listener (--health-addr)
        self.metrics = metrics
        self.health = health
        self.liveness = liveness or Liveness(stale_after_s=float("inf"))
        self.host = host
        self.requested_port = port
        self.scrapes = Scrapes()  # /metrics requests served (the linger at exit waits for one)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("HealthServer is not started")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def current_health(self) -> HealthStatus:
        try:
            return self.health()
        except Exception as exc:  # unknown health is reported as unhealthy, never as a crash
            log.warning("health callback failed", error=repr(exc))
            return HealthStatus(state="unknown", healthy=False, ready=False, detail=f"health unavailable: {exc!r}")

    def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("HealthServer already started")
        self._server = _Server((self.host, self.requested_port), _Handler, self)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": SHUTDOWN_POLL_S},
            name=SERVE_THREAD_NAME,
            daemon=True,
        )
        self._thread.start()
        if not is_loopback(self.host) and self.serve_metrics:
            log.warning(
                "metrics endpoint exposed",
                address=self.url,
                risk="no authentication: anyone who can reach it reads run id, ranks, states and GPU telemetry",
            )
        elif not is_loopback(self.host):
            log.info(
                "health endpoints exposed",
                event_name="health_endpoints_exposed",
                address=self.url,
                risk="no authentication: anyone who can reach it reads the engine state and its one-line detail",
            )
        log.info("metrics endpoint listening" if self.serve_metrics else "health endpoints listening", url=self.url)

    def stop(self) -> None:
        """Stop serving and release the port; idempotent."""
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.close_connections()
        if thread is not None:
            thread.join(STOP_JOIN_S)
        self._server = None
        self._thread = None

    def __enter__(self) -> HealthServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
