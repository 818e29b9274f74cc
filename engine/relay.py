"""The relay: the public port of a supervised engine, in a process that outlives every attempt of the group.

``supervise serve`` starts it beside the ranks, not as one::

    supervisor ─┬─ relay      the public address (inherited: SUPERVISE_LISTEN_FDS), run-long
                └─ group      built-in engine: rank 0 serves on a loopback socket the supervisor bound once;
                              a COMMAND (``--relay``): the engine's own listener (vLLM/SGLang --host/--port)

A restart of the group closes the engine's connections; without the relay
every request in flight, and every stream half sent, would end with an error
the client has to handle, and every new one would be refused until the next
attempt serves.  The relay holds the client's connection instead and forwards
each request upstream.  When the answer it gets is the group's failure
(the engine said so, a 5xx while the supervisor ruled a fault or the engine's
``/health`` fails, a connection refused, reset or closed before the answer
was complete), it holds the request until the next attempt answers
``/health`` and sends it again:

- A request that is not streamed is simply sent again (nothing reached the client).
- A stream continues from the token ids the client already has, the way the
  engine's adapter says (engine/relay_engines.py: our engine's
  ``resume_token_ids``; vLLM's ``return_token_ids`` + a prompt of token ids);
  the first attempt's ``id`` and ``created`` stay in every chunk, token ids
  are stripped unless the client asked, usage counts every token once.  A
  sampled (temperature > 0) continuation is a valid sample, not the one the
  failed attempt would have drawn.  An engine that cannot resume: a stream
  that already sent tokens ends with an error event naming the incident.
- The quarantine applies: for our engine the engine checks it; for any other
  the relay records the fingerprints it has in flight (``inflight-relay``),
  the supervisor blames and quarantines them as it does rank 0's, and the
  relay answers a quarantined request 400 and sends each suspect of the
  current crash loop alone.
- After a failure a request is held at most ``--relay-hold`` for the next
  attempt to answer ``/health`` (a generation itself has no deadline here),
  at most ``--relay-max-held`` at once, and it is resent at most
  ``MAX_RESENDS`` times; past these, or when the run ends (the supervisor's
  SIGTERM), the client gets the 503 (a stream: an error event and ``[DONE]``)
  naming the incident, with ``Retry-After``.

Everything else (``/health``, ``/v1/models``, unknown paths) is forwarded once
with a deadline; no answer in that time is a 503 (``/health`` of a dead or
restarting group is never OK).  The relay's own ``/livez`` is 200 while it
runs and ``/readyz`` 200 only while the group answers (503 ``restarting``
after a failure, ``starting`` before the first attempt serves).  Bodies are
capped at the engine's limit (413) and read within its read timeout (408).

Run as ``python -m tp_supervise.engine.relay --upstream HOST:PORT
[--engine builtin|vllm|openai] [--run-dir DIR]`` with the public socket named
by ``SUPERVISE_LISTEN_FDS`` (supervisor/rank/listen.py).  It ends with its parent (the
parent-death signal its starter sets, and the end of its stdin).
docs/engine.md, "The relay".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import uuid

import aiohttp
from aiohttp import web

from tp_supervise.supervisor.rank.listen import ListenError, take_listen_socket, warn_if_exposed
from tp_supervise.supervisor.rank.net import listen_backlog

from . import runfiles
from .log import OneLineHttpLog, configure, get_logger
from .openai_api import UNAVAILABLE_CODE, ApiError, quarantined
from .relay_engines import Adapter, Resumed, StreamSoFar, adapter, request_fingerprint
from .runfiles import read_incident

HOLD_S = 90.0  # the built-in engine's default: a request waits this long at most for the next attempt
DEFAULT_MAX_HELD = 1024  # requests held at once (waiting for the next attempt); past it a 503 with Retry-After
MAX_RESENDS = 8  # a request is sent again at most this often (the quarantine stops a poison after 2)
PROBE_TIMEOUT_S = 10.0  # one /health probe of a restarting group (it may wait in rank 0's backlog)
PROBE_PAUSE_S = 0.1  # between probes answered without a 200
GROUP_CHECK_S = 2.0  # a 5xx the engine did not call the group's failure: /health must answer 200 within this
RETRY_429_S = 1.0  # a resent request refused by a full queue (the restart's herd) waits this long, then again
FORWARD_TIMEOUT_S = 5.0  # /v1/models, anything that is not a generation
HEALTH_TIMEOUT_S = 2.0  # /health: a restarting group is 503 quickly (probes time out at 1-2 s)
CONNECT_TIMEOUT_S = 5.0  # loopback connect: the kernel completes it from the backlog
INCIDENT_POLL_S = 0.1  # the incident file is read this often (tmpfs: ~20 us)
INCIDENT_WAIT_S = 2.0  # a stream that cannot be continued waits this long at most for the incident to name
# A suspect is sent alone: nothing else is sent until its first token or its answer (a whole answer: of the request
# cut to one token, sent first).  Past this the turn passes on all the same (an engine that neither answers nor
# fails must not stall every request); the suspect stays recorded until its first token.
TURN_LIMIT_S = 60.0
MAX_BODY_BYTES = 1 << 20  # the engine's own limit (engine/server.py)
DEFAULT_READ_TIMEOUT_S = 15.0  # the engine's --read-timeout default; the supervisor passes the engine's value
LINGER_S = 1.0
DRAIN_S = 2.0  # at SIGTERM: handlers answering their 503 get this long
RETRY_AFTER_S = 1
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
PASSED_HEADERS = ("content-type", "retry-after", "allow")
COUNTS_FILE = "relay.json"  # in $SUPERVISE_RUN_DIR: the counts below, for the supervisor's metrics
COUNTS_EVERY_S = 0.5  # written at most this often, when they changed
INFLIGHT_SLOTS = 4096  # inflight-relay's slots (requests sent and not yet answered)
RELAY_RANK = -1  # not a rank
LOGGER = "tp_supervise.engine.relay"

log = get_logger()


class _ClientGone(Exception):
    """Writing to the client failed: it went away (never a reason to send the request again)."""


class _Ended(Exception):
    """The request is answered 503 here: the run ends, the hold ran out, or too many are held (``args``: why,
    and the client's message when it is not the usual one)."""

    def __init__(self, why: str, message: str | None = None):
        super().__init__(why)
        self.message = message


class _Refused(Exception):
    """The request is answered here with this error (quarantined): ``status`` and the OpenAI error body."""

    def __init__(self, status: int, body: dict):
        super().__init__(status)
        self.status, self.body = status, body


def _settle(task: asyncio.Future) -> None:
    """Retrieve a send's exception, so that one abandoned (its client left, the run ended) is no traceback."""
    if not task.cancelled():
        task.exception()


def _abandon(sending: asyncio.Future) -> None:
    """Stop a send nobody waits for: cancel it, or close the answer that already came."""
    if not sending.done():
        sending.cancel()
    elif not sending.cancelled() and sending.exception() is None:
        sending.result().close()


def _error_body(status: int, message: str, code: str | None = None) -> dict:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return ApiError(status, message, None, kind, code=code).body()


class _Flight:
    """One request's record in ``inflight-relay`` (the quarantine's evidence), and its turn when it is sent alone.

    A request is recorded from its send until its first answer (first token, or the whole answer): a request the
    group fails before that may be the one that failed it.  ``step`` is the relay's epoch (one per attempt it saw
    serve): the supervisor blames the newest epoch only, so a request still held from an earlier failure is not
    blamed again for this one."""

    def __init__(self, relay: Relay, fp: str | None):
        self.relay, self.fp = relay, fp
        self.key = uuid.uuid4().hex
        self._solo: asyncio.TimerHandle | None = None
        self._holds_turn = False

    async def sending(self) -> None:
        """Before each send: a suspect waits for its turn alone; anything else waits while a suspect has it."""
        relay = self.relay
        if relay.inflight is None or self.fp is None:
            return
        relay.quarantine_check(self.fp)
        relay.inflight.remove(self.key)
        if relay.quarantine.suspected(self.fp) and relay.cleared.get(self.fp) != relay.epoch:
            await relay._turn.acquire()
            while not relay._ready.is_set():  # the group failed under the one before: its turn is the next attempt's
                relay._turn.release()
                await relay._await_ready()
                await relay._turn.acquire()
            self._holds_turn = True
            relay._turn_free.clear()
            self._solo = asyncio.get_running_loop().call_later(TURN_LIMIT_S, self.release)
        else:
            while not relay._turn_free.is_set():
                await relay._turn_free.wait()
            if relay.quarantine.suspects_listed():
                return  # a crash loop is being sorted out: only a request sent alone is evidence against it
        relay.inflight.add(self.key, self.fp, relay.epoch)

    @property
    def alone(self) -> bool:
        """It holds the turn: a suspect sent with nothing else."""
        return self._holds_turn

    def answered(self) -> None:
        """Its first token or answer came: no longer a suspect of a failure, and the same request is not sent
        alone again in this attempt (a client repeating it)."""
        if self.relay.inflight is not None:
            self.relay.inflight.remove(self.key)
        if self._holds_turn and self.fp is not None:
            self.relay.cleared[self.fp] = self.relay.epoch
        self.release()

    def release(self) -> None:
        if self._solo is not None:
            self._solo.cancel()
            self._solo = None
        if self._holds_turn:
            self._holds_turn = False
            self.relay._turn.release()
            if not self.relay._turn.locked():
                self.relay._turn_free.set()

    def failed(self) -> None:
        """The group failed under it: its record stays (the supervisor reads it) until it is sent again."""
        self.release()

    def close(self) -> None:
        self.answered()


def _noted(_signum: int, _frame: object) -> None:
    """The Python-level handler of a stop signal: nothing; the wakeup socket tells the loop (``_StopSignals``)."""


class _StopSignals:
    """SIGTERM and SIGINT end the relay.  Not through the loop's ``add_signal_handler``: when the loop closes it
    puts SIG_DFL back (``remove_signal_handler`` does too), and a SIGTERM of the supervisor in that moment killed
    the relay (exit -15), one in the moment its wakeup pipe was closed printed a traceback.  Here a no-op
    handler and our own wakeup socket, read by the loop (a signal that comes just before the loop waits still
    wakes it); ``ignore()`` makes each signal SIG_IGN in one step, and only then lets the socket go."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, loop: asyncio.AbstractEventLoop, on_signal) -> None:
        self._loop = loop
        self._read, self._write = socket.socketpair()
        for end in (self._read, self._write):
            end.setblocking(False)
        loop.add_reader(self._read.fileno(), self._readable, on_signal)
        signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        for signum in self.SIGNALS:
            signal.signal(signum, _noted)

    def _readable(self, on_signal) -> None:
        try:
            numbers = self._read.recv(4096)  # one byte per signal: its number
        except OSError:
            return
        if any(number in self.SIGNALS for number in numbers):
            on_signal()

    def ignore(self) -> None:
        for signum in self.SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        signal.set_wakeup_fd(-1)
        self._loop.remove_reader(self._read.fileno())
        self._read.close()
        self._write.close()


class Relay:
    def __init__(
        self,
        upstream: str,
        run_dir: str | None,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        engine: Adapter | None = None,
        hold_s: float = HOLD_S,
        max_held: int = DEFAULT_MAX_HELD,
    ):
        self.upstream = upstream if upstream.startswith(("http://", "https://")) else f"http://{upstream}"
        self.read_timeout_s = read_timeout_s
        self.run_dir = run_dir
        self.engine = engine or adapter("builtin")
        self.hold_s = hold_s
        self.max_held = max_held
        self.ending = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None
        self._ready = asyncio.Event()  # the group answers, as far as the relay knows (cleared at a failure)
        self._ready.set()
        self._served = False  # an attempt answered /health or a request (before: "starting", after: "restarting")
        self._probe: asyncio.Future | None = None
        # The incident of the failure the relay waits out: the supervisor removes its file before the next attempt
        # starts, while the relay may still hold requests (their 503s name it).
        self.last_incident: str | None = None
        self.epoch = 1  # +1 each time a new attempt is seen serving after a failure (inflight-relay's step)
        self.held = 0  # requests waiting for the next attempt now
        self.counts = {"requests": 0, "resent": 0, "resumed_streams": 0, "given_up": 0, "held": 0, "quarantined": 0}
        self._dirty = False
        self._write_failed = False
        self.quarantine = runfiles.Quarantine(run_dir if self.engine.quarantines else None)
        self.inflight: runfiles.InflightFile | None = None
        self.cleared: dict[str, int] = {}  # suspect fingerprint -> the epoch in which it ran alone unharmed
        self._turn = asyncio.Lock()  # the suspect being sent alone holds it
        self._turn_free = asyncio.Event()
        self._turn_free.set()

    # -- counts: $SUPERVISE_RUN_DIR/relay.json, read by the supervisor for its metrics -------------
    def _count(self, key: str, by: int = 1) -> None:
        self.counts[key] += by
        self._dirty = True

    def _publish_counts(self) -> None:
        """Write the counts (temporary file + rename: a reader never sees half of it); tmpfs, so cheap."""
        self._dirty = False
        if not self.run_dir:
            return
        path = os.path.join(self.run_dir, COUNTS_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"version": 1, "pid": os.getpid(), **self.counts}, f)
            os.replace(tmp, path)
        except OSError as exc:
            if not self._write_failed:
                log.warning("relay counts not written", path=path, error=str(exc))
            self._write_failed = True

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(COUNTS_EVERY_S)
            if self._dirty:
                self._publish_counts()

    async def _incident_loop(self) -> None:
        """The supervisor's incident file lives from its ruling until the next attempt starts (a SIGKILLed rank:
        half a second); the relay keeps the id of the last one it saw, for the 503s of what it still holds."""
        while True:
            self.last_incident = read_incident(self.run_dir) or self.last_incident
            await asyncio.sleep(INCIDENT_POLL_S)

    # -- plumbing ----------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """A bug in a handler fails its request only: OpenAI JSON 500 and one log line, never a traceback."""
        try:
            return await handler(request)
        except (web.HTTPException, asyncio.CancelledError, ConnectionError):
            raise
        except Exception as exc:
            log.error("request failed", path=request.path, error=f"{type(exc).__name__}: {exc}"[:300])
            return web.json_response(_error_body(500, "internal error in the relay"), status=500)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        for path in GENERATION_PATHS:
            app.router.add_post(path, self.generation)
        app.router.add_get("/livez", self.livez)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        connector = aiohttp.TCPConnector(force_close=True, limit=0)  # every request its own connection
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        if self.engine.records_requests and self.run_dir:
            try:
                self.inflight = runfiles.InflightFile(
                    os.path.join(self.run_dir, runfiles.RELAY_INFLIGHT_FILE), INFLIGHT_SLOTS, 0
                )
            except OSError as exc:
                log.warning("in-flight record not made: no quarantine evidence from the relay", error=str(exc))

    async def _close(self, _app) -> None:
        if self.session is not None:
            await self.session.close()

    def _incident(self) -> str | None:
        return read_incident(self.run_dir) or (None if self._ready.is_set() else self.last_incident)

    def _unavailable_text(self) -> str:
        incident = self._incident()
        where = f" (incident {incident})" if incident else ""
        if self.ending.is_set():
            return f"the engine stopped{where}; retry the request"
        return f"the engine's group did not come back within {self.hold_s:g} s{where}; retry the request"

    def _given_up(self, path: str, why: str, message: str | None = None) -> dict:
        """The request ends here with a 503 of ours (counted and logged once); returns the error body."""
        incident = self._incident()
        self._count("given_up")
        log.warning("request given up", path=path, why=why, incident=incident)
        if message is not None and incident:
            message = f"{message} (incident {incident})"
        return _error_body(503, message or self._unavailable_text(), UNAVAILABLE_CODE)

    async def _incident_named(self, limit_s: float) -> None:
        """Until the supervisor's incident file exists (a stream's error names it), at most ``limit_s``."""
        deadline = asyncio.get_running_loop().time() + limit_s
        while not read_incident(self.run_dir) and not self.ending.is_set():
            if asyncio.get_running_loop().time() >= deadline or not self.run_dir:
                return
            await asyncio.sleep(0.05)

    def _unavailable(self, body: dict) -> web.Response:
        response = web.json_response(body, status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        response.force_close()
        return response

    # -- the quarantine (engines that do not check it themselves) -------------------------
    def quarantine_check(self, fp: str) -> None:
        incidents = self.quarantine.lookup(fp)
        if incidents is None:
            return
        self._count("quarantined")
        log.warning("request quarantined", fingerprint=fp, incidents=list(incidents))
        raise _Refused(400, quarantined(incidents).body())

    def _flight(self, path: str, body) -> _Flight:
        fp = None
        if self.inflight is not None and isinstance(body, dict):
            fp = request_fingerprint(path, body)
        return _Flight(self, fp)

    # -- the group's state as the relay sees it ----------------------------------------
    def _failed(self) -> None:
        """An attempt failed under a request: resends wait until the next attempt answers /health 200."""
        if self._ready.is_set():
            self._ready.clear()
            self._probe = asyncio.ensure_future(self._probe_ready())

    async def _probe_ready(self) -> None:
        """One probe at a time: its connection may wait in rank 0's backlog until the next attempt answers it."""
        assert self.session is not None
        while not self.ending.is_set():
            if await self._health_ok(PROBE_TIMEOUT_S):
                self.epoch += 1
                self.last_incident = None
                self._ready.set()
                return
            await asyncio.sleep(PROBE_PAUSE_S)

    async def _health_ok(self, timeout_s: float) -> bool:
        assert self.session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self.session.get(self.upstream + self.engine.health_path, timeout=timeout) as up:
                ok = up.status == 200
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False
        self._served = self._served or ok
        return ok

    async def _group_failing(self) -> bool:
        """A 5xx the engine did not name: the group's failure when the supervisor ruled a fault (the incident
        file) or the engine's /health does not answer 200 at once; else it is the request's own answer."""
        if not self._ready.is_set() or read_incident(self.run_dir):
            return True
        return not await self._health_ok(GROUP_CHECK_S)

    async def _is_failure(self, verdict: bool | None) -> bool:
        if verdict is None:
            verdict = not self.ending.is_set() and await self._group_failing()
        if verdict:
            self._failed()
        return bool(verdict)

    async def _await_ready(self) -> None:
        """Until the group answers again; ``_Ended`` when the run ends, the hold runs out, or too many wait."""
        if self._ready.is_set():
            return
        if self.ending.is_set():
            raise _Ended("the run ended")
        if self.held >= self.max_held:
            raise _Ended(
                f"{self.held} requests are already held for the engine's next attempt (--relay-max-held)",
                "the engine's group is restarting and the relay holds as many requests as it may; retry later",
            )
        self.held += 1
        self.counts["held"] = self.held
        self._dirty = True
        waits = [asyncio.ensure_future(self._ready.wait()), asyncio.ensure_future(self.ending.wait())]
        try:
            await asyncio.wait(waits, timeout=self.hold_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            self.held -= 1
            self.counts["held"] = self.held
            self._dirty = True
        if not self._ready.is_set():
            raise _Ended("the run ended" if self.ending.is_set() else f"no attempt answered within {self.hold_s:g} s")

    async def _send(self, method: str, path: str, **kw) -> aiohttp.ClientResponse:
        """One upstream request, until its answer's headers (no deadline: a generation takes what it takes; a hung
        group is the supervisor's to end); the run's end interrupts the wait (``_Ended``)."""
        assert self.session is not None
        if self.ending.is_set():
            raise _Ended("the run ended")
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        sending = asyncio.ensure_future(self.session.request(method, self.upstream + path, timeout=timeout, **kw))
        sending.add_done_callback(_settle)
        ending = asyncio.ensure_future(self.ending.wait())
        try:
            done, _ = await asyncio.wait({sending, ending}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the handler was cancelled (its client left): the request must not go on
            _abandon(sending)
            raise
        finally:
            ending.cancel()
        if sending not in done:
            _abandon(sending)
            raise _Ended("the run ended")
        return sending.result()

    async def _read_body(self, request: web.Request) -> bytes:
        try:
            return await asyncio.wait_for(request.read(), self.read_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            message = f"the request body did not arrive within {self.read_timeout_s:g} s"
            raise web.HTTPRequestTimeout(reason=message) from None

    # -- the relay's own probes ---------------------------------------------------
    async def livez(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _request: web.Request) -> web.Response:
        """200 only while the group answers /health; 503 ``restarting`` after a failure (the supervisor ruled
        one, or the relay saw one), ``starting`` before any attempt served."""
        incident = read_incident(self.run_dir)
        if self._ready.is_set() and not incident and await self._health_ok(HEALTH_TIMEOUT_S):
            return web.json_response({"status": "ready"})
        status = "restarting" if self._served or incident else "starting"
        return web.json_response({"status": status, "incident": incident}, status=503)

    # -- everything but generations: once, with a deadline -------------------------
    async def forward(self, request: web.Request) -> web.StreamResponse:
        try:
            data = await self._read_body(request) if request.can_read_body else None
        except web.HTTPException as exc:
            return web.json_response(_error_body(exc.status, exc.reason), status=exc.status)
        health = request.path == self.engine.health_path
        limit_s = HEALTH_TIMEOUT_S if health else FORWARD_TIMEOUT_S
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}

        async def once() -> web.Response:
            async with await self._send(request.method, request.path_qs, data=data, headers=headers) as up:
                if health and up.status == 200:
                    self._served = True
                return web.Response(status=up.status, body=await up.read(), headers=self._headers(up))

        try:
            return await asyncio.wait_for(once(), limit_s)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, _Ended):
            if health:
                status = (
                    "restarting"
                    if (self._served and not self._ready.is_set()) or read_incident(self.run_dir)
                    else "unavailable"
                )
                return web.json_response({"status": status}, status=503)
            return self._unavailable(_error_body(503, self._unavailable_text(), UNAVAILABLE_CODE))

    @staticmethod
    def _headers(up: aiohttp.ClientResponse) -> dict[str, str]:
        return {k: v for k, v in up.headers.items() if k.lower() in PASSED_HEADERS}

    # -- generations ---------------------------------------------------------------
    async def generation(self, request: web.Request) -> web.StreamResponse:
        self._count("requests")
        try:
            raw = await self._read_body(request)
        except web.HTTPRequestEntityTooLarge:
            message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
            return web.json_response(_error_body(413, message), status=413)
        except web.HTTPException as exc:
            return web.json_response(_error_body(exc.status, exc.reason), status=exc.status)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError):
            body = None
        flight = self._flight(request.path, body)
        try:
            if isinstance(body, dict) and body.get("stream") is True:
                return await self._stream(request, body, flight)
            return await self._unary(request, raw, body, flight)
        except _Refused as exc:
            return web.json_response(exc.body, status=exc.status)
        finally:
            flight.close()

    async def _send_again(self, status: int, data: bytes, sent: int) -> bool:
        """Whether an attempt's refusal is the relay's to retry (then after the pause it needs): the group's
        failure, or a full queue (429) meeting a send the client never made."""
        if status == 429 and sent:  # the restart's herd of held requests
            await asyncio.sleep(RETRY_429_S)
            return True
        if self.ending.is_set():
            return False
        return await self._is_failure(self.engine.failure(status, _json(data)))

    def _resending(self, path: str, resend: int, resumed: int) -> None:
        self._count("resent")
        if resumed:
            self._count("resumed_streams")
            log.info("request resumed", path=path, resend=resend, resumed_tokens=resumed)
        else:
            log.info("request resent", path=path, resend=resend, resumed_tokens=0)

    async def _unary(self, request: web.Request, raw: bytes, body, flight: _Flight) -> web.StreamResponse:
        """Sent again, whole, until an attempt answers it (nothing reached the client yet)."""
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        try:
            for sent in range(MAX_RESENDS + 1):
                await self._await_ready()
                if sent:
                    self._resending(request.path, sent, 0)
                await flight.sending()
                if flight.alone and isinstance(body, dict):
                    first = await self._first_token(request.path, body, sent)
                    if first is None:
                        flight.failed()
                        continue
                    if first:
                        flight.answered()  # past its prefill; the whole request is sent with the others
                try:
                    async with await self._send("POST", request.path, data=raw, headers=headers) as up:
                        data = await up.read()
                        if await self._send_again(up.status, data, sent):
                            flight.failed()
                            continue
                        flight.answered()
                        return web.Response(status=up.status, body=data, headers=self._headers(up))
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):  # cut, reset, refused, connect timeout
                    flight.failed()
                    self._failed()
            why, message = f"sent {MAX_RESENDS + 1} times", None
        except _Ended as exc:
            why, message = str(exc), exc.message
        return self._unavailable(self._given_up(request.path, why, message))

    async def _first_token(self, path: str, body: dict, sent: int) -> bool | None:
        """A suspect's answer is not streamed: its first token alone, asked for as a request of one token.  True:
        it came; False: the engine refused that request (the whole one then keeps the turn until its answer);
        None: the group failed under it (or a full queue: send again)."""
        try:
            async with await self._send("POST", path, json=self.engine.first_token_payload(path, body)) as up:
                data = await up.read()
                if up.status == 200:
                    return True
                return None if await self._send_again(up.status, data, sent) else False
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            self._failed()
            return None

    async def _stream(self, request: web.Request, body: dict, flight: _Flight) -> web.StreamResponse:
        stream = _Stream(request, body, self.engine, flight)
        message = None
        try:
            for sent in range(MAX_RESENDS + 1):
                path, payload = stream.next_send()
                if payload is None:  # tokens went out and this engine cannot continue from them
                    why = f"the {self.engine.name} engine cannot continue a stream from the tokens it sent"
                    message = "the engine's group failed during this stream and it cannot be continued; retry it"
                    await self._incident_named(INCIDENT_WAIT_S)  # the supervisor's ruling may be a moment behind
                    break
                await self._await_ready()
                if sent:
                    self._resending(request.path, sent, len(stream.so_far.ids))
                await flight.sending()
                try:
                    async with await self._send("POST", path, json=payload) as up:
                        if up.status != 200:
                            data = await up.read()
                            if await self._send_again(up.status, data, sent):
                                flight.failed()
                                continue
                            flight.answered()
                            return await stream.refuse(up.status, data, self._headers(up))
                        ended = await stream.relay(up, retry=not self.ending.is_set(), relay=self)
                        if ended:
                            return stream.done()
                        flight.failed()
                        self._failed()  # the attempt failed mid-stream: resume
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    flight.failed()
                    self._failed()
            else:
                why = f"sent {MAX_RESENDS + 1} times"
        except _Ended as exc:
            why, message = str(exc), exc.message
        except _ClientGone:
            raise asyncio.CancelledError from None  # aiohttp's way for a handler whose client left
        except _Refused as exc:
            if stream.response is None:
                raise
            try:
                await stream.fail(exc.body)
            except _ClientGone:
                raise asyncio.CancelledError from None
            return stream.done()
        except Exception as exc:
            if stream.response is None:
                raise  # the middleware answers a JSON 500
            log.error("request failed", path=request.path, error=f"{type(exc).__name__}: {exc}"[:300])
            why, error = "", _error_body(500, "internal error in the relay")
        else:
            error = {}
        if why:
            error = self._given_up(request.path, why, message)
        if stream.response is None:
            return self._unavailable(error)
        try:
            await stream.fail(error)
        except _ClientGone:
            raise asyncio.CancelledError from None
        return stream.done()

    # -- run -----------------------------------------------------------------------
    async def serve(self, sock) -> None:
        runner = web.AppRunner(
            self.app(),
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=DRAIN_S,
            logger=OneLineHttpLog(),
            keepalive_timeout=self.read_timeout_s,  # also closes a connection whose headers never complete
            lingering_time=LINGER_S,
        )
        await runner.setup()
        site = web.SockSite(runner, sock, backlog=listen_backlog())
        await site.start()
        loop = asyncio.get_running_loop()
        stop_signals = _StopSignals(loop, self.ending.set)
        loop.add_reader(sys.stdin.fileno(), self._stdin_readable)
        host, port = runner.addresses[0][:2]
        log.info(
            "relay serving",
            address=f"{host}:{port}",
            upstream=self.upstream,
            engine=self.engine.name,
            hold_s=self.hold_s,
            max_held=self.max_held,
        )
        warn_if_exposed(host, port, log.warning)
        publisher = asyncio.ensure_future(self._publish_loop())
        watcher = asyncio.ensure_future(self._incident_loop()) if self.run_dir else None
        await self.ending.wait()
        publisher.cancel()
        if watcher is not None:
            watcher.cancel()
        await site.stop()  # closes our copy; the supervisor's copy keeps the port until the run ends
        await runner.cleanup()  # handlers get DRAIN_S to write their 503s
        self._publish_counts()
        counts = {k: v for k, v in self.counts.items() if k != "held"}
        log.info("relay stopped", **counts)
        # The supervisor's SIGTERM follows its closing our stdin and may come at any point of the exit from here on.
        stop_signals.ignore()

    def _stdin_readable(self) -> None:
        try:
            data = os.read(sys.stdin.fileno(), 4096)
        except OSError:
            data = b""
        if not data:  # the supervisor closed it, or died
            asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
            self.ending.set()


def _json(data: bytes):
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


class _Stream:
    """One client stream across the attempts that serve it."""

    def __init__(self, request: web.Request, body: dict, engine: Adapter, flight: _Flight):
        self.request = request
        self.engine = engine
        self.flight = flight
        self.wants_ids = body.get("return_token_ids") is True
        self.so_far = StreamSoFar(request.path, body)
        self.resumed: Resumed | None = None
        self.response: web.StreamResponse | None = None
        self.head: dict | None = None  # id and created of the first chunk: every chunk carries them
        self.finished = False  # a chunk with a finish_reason was relayed: only usage and [DONE] may follow
        self.role_sent = False
        self.text_sent = False  # content reached the client (with or without token ids)
        self.untracked = False  # content went out without token ids: nothing to resume from

    def next_send(self) -> tuple[str, dict | None]:
        """The path and payload of the next send: the request as the client made it (asking for token ids), or
        the engine's way to continue from the tokens already sent (None: it has none)."""
        if not self.text_sent:
            self.resumed = None
            return self.so_far.path, self.engine.first_payload(self.so_far.path, self.so_far.body)
        plan = None if self.untracked else self.engine.resume(self.so_far)
        if plan is None:
            return self.so_far.path, None
        path, payload, self.resumed = plan
        return path, payload

    async def _start(self) -> web.StreamResponse:
        if self.response is None:
            self.response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self.response.prepare(self.request)
        return self.response

    def done(self) -> web.StreamResponse:
        assert self.response is not None, "a stream ends only after it began"
        return self.response

    async def _send(self, payload) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        try:
            response = await self._start()
            await response.write(f"data: {data}\n\n".encode())
        except (ConnectionError, OSError) as exc:
            raise _ClientGone from exc

    async def _end(self) -> web.StreamResponse:
        await self._send("[DONE]")
        try:
            await self.done().write_eof()
        except (ConnectionError, OSError) as exc:
            raise _ClientGone from exc
        return self.done()

    async def relay(self, up: aiohttp.ClientResponse, retry: bool, relay: Relay) -> bool:
        """Relay one attempt's events; True when the stream ended ([DONE]), False when the attempt failed."""
        try:
            async for line in up.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    await self._end()
                    return True
                event = _json(data)
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    if self.finished:  # every token is out; the usage chunk is all the failure cost
                        await self._end()
                        return True
                    if retry and await relay._is_failure(self.engine.event_failure(event)):
                        return False
                    await self.fail(event)
                    return True
                await self._chunk(event)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass  # cut mid-body (the engine gone): aiohttp reports the broken payload
        if self.finished:  # cut after its last token: nothing to resume
            await self._end()
            return True
        return False  # cut without [DONE]: the engine is gone

    async def _chunk(self, event: dict) -> None:
        ids = self.engine.collect(event, self.so_far)
        if self.resumed is not None:
            event = self.resumed.reframe(event)
        choices = event.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else None
        if self.head is None:
            self.head = {k: event.get(k) for k in ("id", "created")}
        event.update(self.head)
        if not self.wants_ids or self.resumed is not None:
            event.pop("prompt_token_ids", None)  # a resumed attempt's prompt is not the client's
        if choice is not None:
            delta = choice.get("delta")
            if isinstance(delta, dict) and "role" in delta:
                if self.role_sent:  # an attempt cut before its first token began the chat stream again
                    return
                self.role_sent = True
            if ids or _has_text(choice):
                self.flight.answered()  # its first token: it got past its prefill
            if ids or _has_content(choice):
                self.text_sent = True
                self.untracked = self.untracked or not ids
            self.so_far.ids.extend(ids)
            self.finished = self.finished or choice.get("finish_reason") is not None
            if not self.wants_ids or self.resumed is not None:
                choice.pop("prompt_token_ids", None)
            if not self.wants_ids:
                choice.pop("token_ids", None)
                # the engine sends a chunk per token when asked for ids; without them it sends only text
                if choice.get("finish_reason") is None and not _has_text(choice) and "usage" not in event:
                    return
        await self._send(event)

    async def refuse(self, status: int, data: bytes, headers: dict[str, str]) -> web.StreamResponse:
        """An attempt refused the request (e.g. 400 quarantined): as is before the stream began, else its last event."""
        if self.response is None:
            return web.Response(status=status, body=data, headers=headers)
        body = _json(data)
        await self.fail(body if isinstance(body, dict) and "error" in body else _error_body(status, "request refused"))
        return self.done()

    async def fail(self, event: dict) -> None:
        await self._send(event)
        await self._end()


def _has_content(choice: dict) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content"))
    return bool(choice.get("text"))


def _has_text(choice: dict) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content")) or "role" in delta
    return bool(choice.get("text"))


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a positive number")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tp_supervise.engine.relay")
    parser.add_argument("--upstream", required=True, help="HOST:PORT (or URL) of the engine's own listener")
    parser.add_argument("--engine", default="builtin", help="the engine's adapter: builtin, vllm or openai")
    parser.add_argument("--run-dir", default=os.environ.get("SUPERVISE_RUN_DIR"))
    parser.add_argument("--read-timeout", type=_positive, default=DEFAULT_READ_TIMEOUT_S, help="the engine's")
    parser.add_argument("--hold", type=_positive, default=HOLD_S, help="seconds a request is held after a failure")
    parser.add_argument("--max-held", type=int, default=DEFAULT_MAX_HELD, help="requests held at once")
    args = parser.parse_args(argv)
    configure(RELAY_RANK, process=LOGGER)
    try:
        engine = adapter(args.engine)
    except ValueError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 2
    try:
        sock = take_listen_socket(os.environ, os.getpid(), use=True)
    except ListenError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 2
    if sock is None:
        print("relay: no listening socket (SUPERVISE_LISTEN_FDS)", file=sys.stderr)
        return 2
    relay = Relay(args.upstream, args.run_dir, args.read_timeout, engine, args.hold, max(1, args.max_held))
    asyncio.run(relay.serve(sock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
