"""The relay: the built-in engine's public port, in a process that outlives every attempt of the group.

``supervise serve`` (built-in engine) starts it beside the ranks, not as one::

    supervisor ─┬─ relay      public --host/--port (inherited: SUPERVISE_LISTEN_FDS), run-long
                └─ rank 0..   rank 0 serves on a loopback socket the supervisor bound once (held across attempts)

A restart of the group closes rank 0's connections; without the relay every
request in flight, and every stream half sent, would end with an error the
client has to handle.  The relay holds the client's connection instead and
forwards each request to rank 0 over loopback.  When the answer it gets is
the group's failure (a 503 with code ``engine_unavailable``, a stream's error
event with that code, a connection reset or closed before the answer was
complete), it sends the request again: the new connection waits in the
loopback socket's backlog until the next attempt's rank 0 accepts it.

- A request that is not streamed is simply sent again (nothing reached the client).
- A stream continues: the relay asks rank 0 for the token ids of every chunk
  (``return_token_ids``), and sends the retry with ``resume_token_ids`` = the
  tokens the client already has; the engine prefills prompt + those tokens,
  counts them in ``max_tokens`` and usage, and streams only what follows.  The
  relay keeps the first attempt's ``id`` and ``created`` in every chunk and
  strips ``token_ids`` unless the client asked for them, so the client reads one
  uninterrupted stream.  A sampled (temperature > 0) continuation draws from a
  generator seeded afresh, so it is a valid sample, not the one the failed
  attempt would have drawn.
- The quarantine still applies: the retry has the fingerprint of the original
  request (``resume_token_ids`` is not part of it), so a poison request is
  answered 400 after two failed attempts (a stream gets the 400 as its final
  error event).
- After a failure a request waits at most ``HOLD_S`` for the next attempt to
  answer ``/health`` (a generation itself has no deadline here), and is resent
  at most ``MAX_RESENDS`` times; then, or when the run ends (the supervisor's
  SIGTERM), the client gets the 503 (a stream: an error event and ``[DONE]``)
  naming the incident, with ``Retry-After``.

Everything else (``/health``, ``/v1/models``, unknown paths) is forwarded once
with a deadline; no answer in that time is a 503 (``/health`` of a dead or
restarting group is never OK).  Bodies are capped at the engine's limit
(413) and read within its read timeout (408).

Run as ``python -m tp_supervise.engine.relay --upstream 127.0.0.1:PORT
[--run-dir DIR]`` with the public socket named by ``SUPERVISE_LISTEN_FDS``
(engine/listen.py).  It ends with its parent (the parent-death signal its
starter sets, and the end of its stdin).  docs/engine.md, "Serving through faults".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

import aiohttp
from aiohttp import web

from tp_supervise.supervisor.rank.net import listen_backlog

from .listen import ListenError, take_listen_socket, warn_if_exposed
from .log import OneLineHttpLog, configure, get_logger
from .openai_api import UNAVAILABLE_CODE, ApiError
from .runfiles import read_incident

HOLD_S = 90.0  # after a failure, a request waits this long at most for the next attempt to answer /health
MAX_RESENDS = 8  # and is sent again at most this often (the quarantine stops a poison after 2)
PROBE_TIMEOUT_S = 10.0  # one /health probe of a restarting group (it waits in rank 0's backlog)
PROBE_PAUSE_S = 0.1  # between probes answered without a 200
RETRY_429_S = 1.0  # a resent request refused by a full queue (the restart's herd) waits this long, then again
FORWARD_TIMEOUT_S = 5.0  # /v1/models, anything that is not a generation
HEALTH_TIMEOUT_S = 2.0  # /health: a restarting group is 503 quickly (probes time out at 1-2 s)
CONNECT_TIMEOUT_S = 5.0  # loopback connect: the kernel completes it from the backlog
MAX_BODY_BYTES = 1 << 20  # the engine's own limit (engine/server.py)
DEFAULT_READ_TIMEOUT_S = 15.0  # the engine's --read-timeout default; the supervisor passes the engine's value
LINGER_S = 1.0
DRAIN_S = 2.0  # at SIGTERM: handlers answering their 503 get this long
RETRY_AFTER_S = 1
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
PASSED_HEADERS = ("content-type", "retry-after", "allow")
COUNTS_FILE = "relay.json"  # in $SUPERVISE_RUN_DIR: the counts below, for the supervisor's metrics
COUNTS_EVERY_S = 0.5  # written at most this often, when they changed
RELAY_RANK = -1  # not a rank
LOGGER = "tp_supervise.engine.relay"

log = get_logger()


class _ClientGone(Exception):
    """Writing to the client failed: it went away (never a reason to send the request again)."""


class _Ended(Exception):
    """The request is answered 503 here: the run ends, or no attempt answered within HOLD_S."""


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


def _is_unavailable(body) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == UNAVAILABLE_CODE


class Relay:
    def __init__(self, upstream: str, run_dir: str | None, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S):
        self.upstream = f"http://{upstream}"
        self.read_timeout_s = read_timeout_s
        self.run_dir = run_dir
        self.ending = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None
        self._ready = asyncio.Event()  # the group answers, as far as the relay knows (cleared at a failure)
        self._ready.set()
        self._probe: asyncio.Future | None = None
        self.counts = {"requests": 0, "resent": 0, "resumed_streams": 0, "given_up": 0}
        self._dirty = False
        self._write_failed = False

    # -- counts: $SUPERVISE_RUN_DIR/relay.json, read by the supervisor for its metrics -------------
    def _count(self, key: str) -> None:
        self.counts[key] += 1
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
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        connector = aiohttp.TCPConnector(force_close=True, limit=0)  # every request its own connection
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def _close(self, _app) -> None:
        if self.session is not None:
            await self.session.close()

    def _unavailable_text(self) -> str:
        incident = read_incident(self.run_dir)
        where = f" (incident {incident})" if incident else ""
        if self.ending.is_set():
            return f"the engine stopped{where}; retry the request"
        return f"the engine's group did not come back within {HOLD_S:g} s{where}; retry the request"

    def _given_up(self, path: str, why: str) -> dict:
        """The request ends here with a 503 of ours (counted and logged once); returns the error body."""
        self._count("given_up")
        log.warning("request given up", path=path, why=why)
        return _error_body(503, self._unavailable_text(), UNAVAILABLE_CODE)

    def _unavailable(self, body: dict) -> web.Response:
        response = web.json_response(body, status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        response.force_close()
        return response

    # -- the group's state as the relay sees it ----------------------------------------
    def _failed(self) -> None:
        """An attempt failed under a request: resends wait until the next attempt answers /health 200."""
        if self._ready.is_set():
            self._ready.clear()
            self._probe = asyncio.ensure_future(self._probe_ready())

    async def _probe_ready(self) -> None:
        """One probe at a time: its connection waits in rank 0's backlog until the next attempt answers it."""
        assert self.session is not None
        while not self.ending.is_set():
            try:
                timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
                async with self.session.get(self.upstream + "/health", timeout=timeout) as up:
                    if up.status == 200:
                        self._ready.set()
                        return
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(PROBE_PAUSE_S)

    async def _await_ready(self) -> None:
        """Until the group answers again; ``_Ended`` when the run ends or it does not within ``HOLD_S``."""
        if self._ready.is_set():
            return
        if self.ending.is_set():
            raise _Ended("the run ended")
        waits = [asyncio.ensure_future(self._ready.wait()), asyncio.ensure_future(self.ending.wait())]
        try:
            done, _ = await asyncio.wait(waits, timeout=HOLD_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if not self._ready.is_set():
            raise _Ended("the run ended" if self.ending.is_set() else f"no attempt answered within {HOLD_S:g} s")

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

    # -- everything but generations: once, with a deadline -------------------------
    async def forward(self, request: web.Request) -> web.StreamResponse:
        try:
            data = await self._read_body(request) if request.can_read_body else None
        except web.HTTPException as exc:
            return web.json_response(_error_body(exc.status, exc.reason), status=exc.status)
        limit_s = HEALTH_TIMEOUT_S if request.path == "/health" else FORWARD_TIMEOUT_S
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}

        async def once() -> web.Response:
            async with await self._send(request.method, request.path_qs, data=data, headers=headers) as up:
                return web.Response(status=up.status, body=await up.read(), headers=self._headers(up))

        try:
            return await asyncio.wait_for(once(), limit_s)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, _Ended):
            if request.path == "/health":
                return web.json_response({"status": "unavailable"}, status=503)
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
        if isinstance(body, dict) and body.get("stream") is True:
            return await self._stream(request, body)
        return await self._unary(request, raw)

    async def _send_again(self, status: int, data: bytes, sent: int) -> bool:
        """Whether an attempt's refusal is the relay's to retry (then after the pause it needs): the group's
        failure (503 ``engine_unavailable``), or a full queue (429) meeting a send the client never made."""
        if status == 503 and not self.ending.is_set() and _is_unavailable(_json(data)):
            self._failed()
            return True
        if status == 429 and sent:  # the restart's herd of held requests
            await asyncio.sleep(RETRY_429_S)
            return True
        return False

    def _resending(self, path: str, resend: int, resumed: int) -> None:
        self._count("resent")
        if resumed:
            self._count("resumed_streams")
        log.info("request resent", path=path, resend=resend, resumed_tokens=resumed)

    async def _unary(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        """Sent again, whole, until an attempt answers it (nothing reached the client yet)."""
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        try:
            for sent in range(MAX_RESENDS + 1):
                if sent:
                    await self._await_ready()
                    self._resending(request.path, sent, 0)
                try:
                    async with await self._send("POST", request.path, data=raw, headers=headers) as up:
                        body = await up.read()
                        if await self._send_again(up.status, body, sent):
                            continue
                        return web.Response(status=up.status, body=body, headers=self._headers(up))
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):  # cut, reset, connect timeout
                    self._failed()
            why = f"sent {MAX_RESENDS + 1} times"
        except _Ended as exc:
            why = str(exc)
        return self._unavailable(self._given_up(request.path, why))

    async def _stream(self, request: web.Request, body: dict) -> web.StreamResponse:
        stream = _Stream(request, body)
        try:
            for sent in range(MAX_RESENDS + 1):
                if sent:
                    await self._await_ready()
                    self._resending(request.path, sent, len(stream.ids))
                try:
                    async with await self._send("POST", request.path, json=stream.payload()) as up:
                        if up.status != 200:
                            data = await up.read()
                            if await self._send_again(up.status, data, sent):
                                continue
                            return await stream.refuse(up.status, data, self._headers(up))
                        if await stream.relay(up, retry=not self.ending.is_set()):
                            return stream.done()
                        self._failed()  # the attempt failed mid-stream: resume
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    self._failed()
            why = f"sent {MAX_RESENDS + 1} times"
        except _Ended as exc:
            why = str(exc)
        except _ClientGone:
            raise asyncio.CancelledError from None  # aiohttp's way for a handler whose client left
        except Exception as exc:
            if stream.response is None:
                raise  # the middleware answers a JSON 500
            log.error("request failed", path=request.path, error=f"{type(exc).__name__}: {exc}"[:300])
            why, error = "", _error_body(500, "internal error in the relay")
        else:
            error = {}
        if why:
            error = self._given_up(request.path, why)
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
        loop.add_signal_handler(signal.SIGTERM, self.ending.set)
        loop.add_signal_handler(signal.SIGINT, self.ending.set)
        loop.add_reader(sys.stdin.fileno(), self._stdin_readable)
        host, port = runner.addresses[0][:2]
        log.info("relay serving", address=f"{host}:{port}", upstream=self.upstream)
        warn_if_exposed(host, port)
        publisher = asyncio.ensure_future(self._publish_loop())
        await self.ending.wait()
        publisher.cancel()
        await site.stop()  # closes our copy; the supervisor's copy keeps the port until the run ends
        await runner.cleanup()  # handlers get DRAIN_S to write their 503s
        self._publish_counts()
        log.info("relay stopped", **self.counts)

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

    def __init__(self, request: web.Request, body: dict):
        self.request = request
        self.body = body
        self.wants_ids = body.get("return_token_ids") is True
        given = body.get("resume_token_ids")  # the client's own (the engine checks them)
        self.given: list = list(given) if isinstance(given, list) else []
        self.ids: list[int] = []  # relayed to the client
        self.response: web.StreamResponse | None = None
        self.head: dict | None = None  # id and created of the first chunk: every chunk carries them
        self.finished = False  # a chunk with a finish_reason was relayed: only usage and [DONE] may follow
        self.role_sent = False

    def payload(self) -> dict:
        payload = dict(self.body, return_token_ids=True)
        if self.ids:
            payload["resume_token_ids"] = self.given + self.ids
        return payload

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

    async def relay(self, up: aiohttp.ClientResponse, retry: bool) -> bool:
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
                    if retry and _is_unavailable(event):
                        return False
                    await self.fail(event)
                    return True
                await self._chunk(event)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass  # cut mid-body (rank 0 gone): aiohttp reports the broken payload
        if self.finished:  # cut after its last token: nothing to resume
            await self._end()
            return True
        return False  # cut without [DONE]: rank 0 is gone

    async def _chunk(self, event: dict) -> None:
        choices = event.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else None
        if self.head is None:
            self.head = {k: event.get(k) for k in ("id", "created")}
        event.update(self.head)
        if choice is not None:
            delta = choice.get("delta")
            if isinstance(delta, dict) and "role" in delta:
                if self.role_sent:  # an attempt cut before its first token began the chat stream again
                    return
                self.role_sent = True
            ids = choice.get("token_ids") or []
            self.ids.extend(i for i in ids if isinstance(i, int))
            self.finished = self.finished or choice.get("finish_reason") is not None
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


def _has_text(choice: dict) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content")) or "role" in delta
    return bool(choice.get("text"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tp_supervise.engine.relay")
    parser.add_argument("--upstream", required=True, help="HOST:PORT rank 0 serves on (loopback)")
    parser.add_argument("--run-dir", default=os.environ.get("SUPERVISE_RUN_DIR"))
    parser.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S, help="the engine's")
    args = parser.parse_args(argv)
    configure(RELAY_RANK, process=LOGGER)
    try:
        sock = take_listen_socket(os.environ, os.getpid(), use=True)
    except ListenError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 2
    if sock is None:
        print("relay: no listening socket (SUPERVISE_LISTEN_FDS)", file=sys.stderr)
        return 2
    asyncio.run(Relay(args.upstream, args.run_dir, args.read_timeout).serve(sock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
