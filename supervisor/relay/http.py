"""The relay's HTTP side: what a client's request meets on the public port, and the answers it gets.

Generations (``GENERATION_PATHS``) are sent upstream until an attempt of the
group answers them: a request that is not streamed is sent again whole
(nothing reached the client), a stream continues from the tokens the client
has (supervisor/relay/resume.py), each at most ``MAX_RESENDS`` times after
the first send, each send waiting for the group (supervisor/relay/hold.py).
A request the relay gives up on gets a 503 (``engine_unavailable``,
``Retry-After``) naming the incident; a stream that already began gets it as
its last event, then ``[DONE]``.

Everything else (``/health``, ``/v1/models``, unknown paths) is forwarded once
with a deadline; no answer in that time is a 503 (``/health`` of a dead or
restarting group is never OK).  The relay's own ``/livez`` is 200 while it
runs and ``/readyz`` 200 only while the group answers (503 ``restarting``
after a failure, ``starting`` before the first attempt serves).  Bodies are
capped at the engine's limit (413) and read within its read timeout (408).
A bug in a handler fails its request only (a JSON 500, one log line).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from tp_supervise.engine.log import get_logger
from tp_supervise.engine.openai_api import UNAVAILABLE_CODE

from .engines import error_body
from .hold import Ended, Flight, Group, Refused
from .protocol import Counts
from .resume import ClientGone, Stream, parse_json

MAX_RESENDS = 8  # a request is sent again at most this often (the quarantine stops a poison after 2)
RETRY_429_S = 1.0  # a resent request refused by a full queue (the restart's herd) waits this long, then again
FORWARD_TIMEOUT_S = 5.0  # /v1/models, anything that is not a generation
HEALTH_TIMEOUT_S = 2.0  # /health: a restarting group is 503 quickly (probes time out at 1-2 s)
INCIDENT_WAIT_S = 2.0  # a stream that cannot be continued waits this long at most for the incident to name
MAX_BODY_BYTES = 1 << 20  # the engine's own limit (engine/server.py)
DEFAULT_READ_TIMEOUT_S = 15.0  # the engine's --read-timeout default; the supervisor passes the engine's value
RETRY_AFTER_S = 1
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
PASSED_HEADERS = ("content-type", "retry-after", "allow")

log = get_logger()


class Relay:
    """The aiohttp application of the public port: one handler per kind of request, over the group's view."""

    def __init__(self, group: Group, counts: Counts, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S):
        self.group = group
        self.engine = group.engine
        self.counts = counts
        self.read_timeout_s = read_timeout_s

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
            return web.json_response(error_body(500, "internal error in the relay"), status=500)

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
        await self.group.open()

    async def _close(self, _app) -> None:
        await self.group.close()

    def _unavailable_text(self) -> str:
        incident = self.group.incident()
        where = f" (incident {incident})" if incident else ""
        if self.group.ending.is_set():
            return f"the engine stopped{where}; retry the request"
        return f"the engine's group did not come back within {self.group.hold_s:g} s{where}; retry the request"

    def _given_up(self, path: str, why: str, message: str | None = None) -> dict:
        """The request ends here with a 503 of ours (counted and logged once); returns the error body."""
        incident = self.group.incident()
        self.counts.add("given_up")
        log.warning("request given up", path=path, why=why, incident=incident)
        if message is not None and incident:
            message = f"{message} (incident {incident})"
        return error_body(503, message or self._unavailable_text(), UNAVAILABLE_CODE)

    def _unavailable(self, body: dict) -> web.Response:
        response = web.json_response(body, status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        response.force_close()
        return response

    async def _read_body(self, request: web.Request) -> bytes:
        try:
            return await asyncio.wait_for(request.read(), self.read_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            message = f"the request body did not arrive within {self.read_timeout_s:g} s"
            raise web.HTTPRequestTimeout(reason=message) from None

    @staticmethod
    def _headers(up: aiohttp.ClientResponse) -> dict[str, str]:
        return {k: v for k, v in up.headers.items() if k.lower() in PASSED_HEADERS}

    # -- the relay's own probes ---------------------------------------------------
    async def livez(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _request: web.Request) -> web.Response:
        """200 only while the group answers /health; 503 ``restarting`` after a failure (the supervisor ruled
        one, or the relay saw one), ``starting`` before any attempt served."""
        group = self.group
        incident = group.ruled
        if group.ready.is_set() and not incident and await group.health_ok(HEALTH_TIMEOUT_S):
            return web.json_response({"status": "ready"})
        status = "restarting" if group.served or incident else "starting"
        return web.json_response({"status": status, "incident": incident}, status=503)

    # -- everything but generations: once, with a deadline -------------------------
    async def forward(self, request: web.Request) -> web.StreamResponse:
        group = self.group
        try:
            data = await self._read_body(request) if request.can_read_body else None
        except web.HTTPException as exc:
            return web.json_response(error_body(exc.status, exc.reason), status=exc.status)
        health = request.path == self.engine.health_path
        limit_s = HEALTH_TIMEOUT_S if health else FORWARD_TIMEOUT_S
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}

        async def once() -> web.Response:
            async with await group.send(request.method, request.path_qs, data=data, headers=headers) as up:
                if health and up.status == 200:
                    group.served = True
                return web.Response(status=up.status, body=await up.read(), headers=self._headers(up))

        try:
            return await asyncio.wait_for(once(), limit_s)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, Ended):
            if health:
                down = (group.served and not group.ready.is_set()) or group.ruled
                return web.json_response({"status": "restarting" if down else "unavailable"}, status=503)
            return self._unavailable(error_body(503, self._unavailable_text(), UNAVAILABLE_CODE))

    # -- generations ---------------------------------------------------------------
    async def generation(self, request: web.Request) -> web.StreamResponse:
        self.counts.add("requests")
        try:
            raw = await self._read_body(request)
        except web.HTTPRequestEntityTooLarge:
            message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
            return web.json_response(error_body(413, message), status=413)
        except web.HTTPException as exc:
            return web.json_response(error_body(exc.status, exc.reason), status=exc.status)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError):
            body = None
        flight = self.group.flight(request.path, body)
        try:
            if isinstance(body, dict) and body.get("stream") is True:
                return await self._stream(request, body, flight)
            return await self._unary(request, raw, body, flight)
        except Refused as exc:
            return web.json_response(exc.body, status=exc.status)
        finally:
            flight.close()

    async def _send_again(self, status: int, data: bytes, sent: int) -> bool:
        """Whether an attempt's refusal is the relay's to retry (then after the pause it needs): the group's
        failure, or a full queue (429) meeting a send the client never made."""
        if status == 429 and sent:  # the restart's herd of held requests
            await asyncio.sleep(RETRY_429_S)
            return True
        if self.group.ending.is_set():
            return False
        return await self.group.is_failure(self.engine.failure(status, parse_json(data)))

    def _resending(self, path: str, resend: int, resumed: int) -> None:
        self.counts.add("resent")
        if resumed:
            self.counts.add("resumed_streams")
            log.info("request resumed", path=path, resend=resend, resumed_tokens=resumed)
        else:
            log.info("request resent", path=path, resend=resend, resumed_tokens=0)

    async def _unary(self, request: web.Request, raw: bytes, body, flight: Flight) -> web.StreamResponse:
        """Sent again, whole, until an attempt answers it (nothing reached the client yet)."""
        group = self.group
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        try:
            for sent in range(MAX_RESENDS + 1):
                await group.await_ready()
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
                    async with await group.send("POST", request.path, data=raw, headers=headers) as up:
                        data = await up.read()
                        if await self._send_again(up.status, data, sent):
                            flight.failed()
                            continue
                        flight.answered()
                        return web.Response(status=up.status, body=data, headers=self._headers(up))
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):  # cut, reset, refused, connect timeout
                    flight.failed()
                    group.failed()
            why, message = f"sent {MAX_RESENDS + 1} times", None
        except Ended as exc:
            why, message = str(exc), exc.message
        return self._unavailable(self._given_up(request.path, why, message))

    async def _first_token(self, path: str, body: dict, sent: int) -> bool | None:
        """A suspect's answer is not streamed: its first token alone, asked for as a request of one token.  True:
        it came; False: the engine refused that request (the whole one then keeps the turn until its answer);
        None: the group failed under it (or a full queue: send again)."""
        try:
            async with await self.group.send("POST", path, json=self.engine.first_token_payload(path, body)) as up:
                data = await up.read()
                if up.status == 200:
                    return True
                return None if await self._send_again(up.status, data, sent) else False
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            self.group.failed()
            return None

    async def _stream(self, request: web.Request, body: dict, flight: Flight) -> web.StreamResponse:
        group = self.group
        stream = Stream(request, body, self.engine, flight)
        message = None
        try:
            for sent in range(MAX_RESENDS + 1):
                path, payload = stream.next_send()
                if payload is None:  # tokens went out and this engine cannot continue from them
                    why = f"the {self.engine.name} engine cannot continue a stream from the tokens it sent"
                    message = "the engine's group failed during this stream and it cannot be continued; retry it"
                    await group.incident_named(INCIDENT_WAIT_S)  # the supervisor's ruling may be a moment behind
                    break
                await group.await_ready()
                if sent:
                    self._resending(request.path, sent, len(stream.so_far.ids))
                await flight.sending()
                try:
                    async with await group.send("POST", path, json=payload) as up:
                        if up.status != 200:
                            data = await up.read()
                            if await self._send_again(up.status, data, sent):
                                flight.failed()
                                continue
                            flight.answered()
                            return await stream.refuse(up.status, data, self._headers(up))
                        ended = await stream.relay(up, retry=not group.ending.is_set(), group=group)
                        if ended:
                            return stream.done()
                        flight.failed()
                        group.failed()  # the attempt failed mid-stream: resume
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    flight.failed()
                    group.failed()
            else:
                why = f"sent {MAX_RESENDS + 1} times"
        except Ended as exc:
            why, message = str(exc), exc.message
        except ClientGone:
            raise asyncio.CancelledError from None  # aiohttp's way for a handler whose client left
        except Refused as exc:
            if stream.response is None:
                raise
            try:
                await stream.fail(exc.body)
            except ClientGone:
                raise asyncio.CancelledError from None
            return stream.done()
        except Exception as exc:
            if stream.response is None:
                raise  # the middleware answers a JSON 500
            log.error("request failed", path=request.path, error=f"{type(exc).__name__}: {exc}"[:300])
            why, error = "", error_body(500, "internal error in the relay")
        else:
            error = {}
        if why:
            error = self._given_up(request.path, why, message)
        if stream.response is None:
            return self._unavailable(error)
        try:
            await stream.fail(error)
        except ClientGone:
            raise asyncio.CancelledError from None
        return stream.done()
