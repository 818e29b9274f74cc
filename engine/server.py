"""HTTP frontend on rank 0 (aiohttp, in its own thread and event loop).

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (OpenAI-compatible; engine/openai_api.py,
engine/chat_api.py).  The frontend tokenizes (a chat request through the
chat template), validates, fingerprints, refuses quarantined requests (400),
hands requests to the engine loop through :class:`EngineBridge`, detokenizes
outputs and applies stop strings (a matched stop string aborts the sequence
in the engine).  A client that disconnects aborts its request.

It listens on ``--host``/``--port``, or on a listening socket inherited from
its parent (supervisor/rank/listen.py).

Hostile input can only fail its own request: every error, including an
oversized body (413), a slow body (408), a full queue (429 + Retry-After) and
any bug in a handler (500), is answered in OpenAI's JSON error format and
logged as one line; aiohttp's protocol errors (oversized or malformed
headers) are logged as one line with the peer, never a traceback.  A
connection that has not sent its headers within the read timeout is closed
(aiohttp's keep-alive timer also covers a request in progress of arriving).

When the engine stops serving (a shutdown signal, or its group failed) the
frontend stops accepting (connections then wait in the backlog of an
inherited socket) and every request in flight gets a 503 with
``Retry-After`` and ``Connection: close`` naming the incident when the
supervisor wrote one (engine/runfiles.py); a stream gets an error event and
``[DONE]``.  ``/health`` is 503 from then on.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from tp_supervise.supervisor.rank.listen import warn_if_exposed
from tp_supervise.supervisor.rank.net import listen_backlog

from .bridge import EngineBridge, EngineError
from .chat_api import CHAT, PlainTemplate, parse_chat
from .log import OneLineHttpLog, get_logger
from .openai_api import (
    COMPLETION,
    UNAVAILABLE_CODE,
    ApiError,
    GenerationSpec,
    StopMatcher,
    check_context,
    check_prompt,
    parse_completion,
    parse_resume,
    quarantined,
    usage_body,
)
from .runfiles import Quarantine, fingerprint, read_incident
from .scheduler import Request, SamplingParams, SeqOutput
from .tokenizer import IncrementalDecoder

STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
HANDLER_DRAIN_S = 2.0  # in-flight handlers already got their error; give them this long to write it
INCIDENT_WAIT_S = 0.5  # a failed collective may beat the supervisor's incident file by this much
INCIDENT_POLL_S = 0.02
SEED_BITS = 63
MAX_BODY_BYTES = 1 << 20  # a prompt beyond this is far past any context this engine serves
RETRY_AFTER_S = 1
LINGER_S = 1.0  # after answering early (408, 413), read and drop the unread body this long, then close
UTF8_CODECS = frozenset({"utf-8", "ascii"})  # codecs.lookup names JSON bodies may declare (RFC 8259: UTF-8)
SHUTDOWN_TEXT = "engine is shutting down"
GROUP_FAILED_TEXT = "the engine's group failed"

log = get_logger()


@dataclass(frozen=True)
class ServingLimits:
    max_waiting: int = 256
    read_timeout_s: float = 15.0
    max_prompt_tokens: int = 2047


@dataclass(frozen=True)
class FrontendSpec:
    model_name: str
    max_context: int
    vocab_size: int
    host: str
    port: int
    seed: int
    limits: ServingLimits = ServingLimits()
    run_dir: str | None = None  # $SUPERVISE_RUN_DIR: quarantine list and incident id (engine/runfiles.py)


def _with_incident(text: str, incident: str | None) -> str:
    return f"{text} (incident {incident})" if incident else text


def group_failed_message(incident: str | None) -> str:
    return _with_incident(GROUP_FAILED_TEXT, incident) + "; retry the request"


def _error(exc: ApiError, headers: dict | None = None) -> web.Response:
    headers = dict(headers or {})
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    response = web.json_response(exc.body(), status=exc.status, headers=headers)
    if exc.status == 503:
        response.force_close()  # the engine is going away: no keep-alive on this connection
    return response


def _unavailable(message: str) -> ApiError:
    """The engine stops serving (its group failed, or a shutdown): the relay (supervisor/relay/) sends it again."""
    return ApiError(503, message, None, "server_error", code=UNAVAILABLE_CODE, retry_after=RETRY_AFTER_S)


async def _read_json(request: web.Request, timeout_s: float):
    """The request body as JSON; every way it can be malformed is an :class:`ApiError`."""
    charset = (request.charset or "utf-8").lower()
    try:
        codec = codecs.lookup(charset).name
    except LookupError:
        codec = None
    if codec not in UTF8_CODECS:
        raise ApiError(415, f"unsupported charset {charset[:40]!r}: send the JSON body as UTF-8")
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)  # asyncio.timeout needs Python 3.11
    except (TimeoutError, asyncio.TimeoutError):
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: syntax, and ints over 4300 digits
        raise ApiError(400, "the request body is not valid JSON") from None


class Frontend:
    def __init__(
        self,
        bridge: EngineBridge,
        tokenizer,
        spec: FrontendSpec,
        *,
        chat_template=None,
        listen_sock: socket.socket | None = None,
    ):
        self.bridge = bridge
        self.spec = spec
        self.limits = spec.limits
        self.tokenizer = tokenizer
        self.chat_template = chat_template or PlainTemplate()
        self.model_name = spec.model_name
        self.host = spec.host
        self.port = spec.port
        self.inherited = listen_sock is not None
        self._listen_sock = listen_sock
        self._quarantine = Quarantine(spec.run_dir)
        self._quarantine.refresh()  # at start (logged); then whenever the file changes
        self._waiting = _WaitingCount()
        self._seeds = random.Random(spec.seed)
        self._created = int(time.time())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.BaseSite | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._bound = 0  # handlers with a request in the engine (HTTP loop only)
        self._idle = asyncio.Event()  # set while _bound == 0 (binds to the HTTP loop on first use)
        self._idle.set()

    # -- lifecycle (engine thread) ------------------------------------------
    def start(self) -> int:
        """Bind (or take the inherited socket) and serve in thread ``engine-http``; returns the port.

        Raises OSError when binding fails.
        """
        self._thread = threading.Thread(target=self._serve, name="engine-http", daemon=True)
        self._thread.start()
        if not self._started.wait(STARTUP_TIMEOUT_S):
            raise OSError(f"HTTP frontend did not start within {STARTUP_TIMEOUT_S} s")
        if self._start_error is not None:
            raise self._start_error
        return self.port

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return
        try:
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            fut.result(STOP_TIMEOUT_S)
        except Exception as exc:  # the process is exiting; never hang here
            log.warning("HTTP frontend did not stop cleanly", error=repr(exc))
        self._thread.join(STOP_TIMEOUT_S)

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        # keepalive_timeout also closes a connection that has not completed its headers (aiohttp
        # closes a handler still waiting for a message): the header half of the read timeout
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=HANDLER_DRAIN_S,
            logger=OneLineHttpLog(),
            keepalive_timeout=self.limits.read_timeout_s,
            lingering_time=LINGER_S,
        )
        try:
            loop.run_until_complete(self._runner.setup())
            if self._listen_sock is not None:
                site: web.BaseSite = web.SockSite(self._runner, self._listen_sock, backlog=listen_backlog())
            else:
                site = web.TCPSite(self._runner, self.host, self.port)
            loop.run_until_complete(site.start())
            self._site = site
            self.host, self.port = self._runner.addresses[0][:2]
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        warn_if_exposed(self.host, self.port, log.warning)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        asyncio.get_running_loop().call_soon(asyncio.get_running_loop().stop)

    # -- the engine stops serving (engine thread or shutdown guard thread) ----
    def _call(self, coro_fn, wait_s: float | None) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            fut = asyncio.run_coroutine_threadsafe(coro_fn(), loop)
            if wait_s is not None:
                fut.result(wait_s)
        except Exception as exc:  # the HTTP loop is gone or slow: nothing more to do for its clients
            log.warning("HTTP frontend did not answer", error=repr(exc)[:200])

    async def _stop_accepting(self) -> None:
        site, self._site = self._site, None
        if site is not None:
            await site.stop()  # closes this process's copy of the socket (never shutdown())

    async def _until_idle(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            log.warning("requests still being answered", handlers=self._bound)

    def stop_serving_on_signal(self, signal_name: str) -> None:
        """A shutdown signal (guard thread): stop accepting, answer every request in flight with 503 now.

        The engine loop may be blocked in a collective for good (a peer is gone);
        the clients must not wait for it.
        """
        incident = read_incident(self.spec.run_dir)
        self._call(self._stop_accepting, None)
        self.bridge.stop_serving(_with_incident(SHUTDOWN_TEXT, incident), failed=False)
        log.info("stopped serving", cause=signal_name, incident=incident)

    @property
    def serving(self) -> bool:
        """The frontend started (it may have requests to answer)."""
        return self._started.is_set() and self._start_error is None

    def fail_group(self, error: str) -> None:
        """The group failed (engine thread, a collective or the loop raised): 503 every request, briefly drain."""
        if not self.serving:
            self.bridge.stop_serving(group_failed_message(None), failed=True)
            return
        self._call(self._stop_accepting, STOP_TIMEOUT_S)
        in_flight = self.bridge.in_flight
        incident = read_incident(self.spec.run_dir)
        if incident is None and self.spec.run_dir and in_flight:
            deadline = time.monotonic() + INCIDENT_WAIT_S
            while incident is None and time.monotonic() < deadline:
                time.sleep(INCIDENT_POLL_S)
                incident = read_incident(self.spec.run_dir)
        self.bridge.stop_serving(group_failed_message(incident), failed=True)
        log.error("group failed", in_flight=in_flight, incident=incident, error=" ".join(error.split())[:300])
        self._call(lambda: self._until_idle(HANDLER_DRAIN_S), HANDLER_DRAIN_S + 1)

    # -- handlers --------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error a request can cause, answered as OpenAI JSON and logged as one line."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.reason if exc.status != 413 else f"the request body is larger than {MAX_BODY_BYTES} bytes"
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
            return _error(ApiError(exc.status, message, None, kind), headers)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as exc:  # a bug: this request fails, the engine goes on
            log.error("request failed", path=request.path, error=f"{type(exc).__name__}: {exc}"[:300])
            return _error(ApiError(500, "internal error while handling the request", None, "server_error"))

    async def health(self, _request: web.Request) -> web.Response:
        if self.bridge.failed:
            return web.json_response({"status": "failed", "error": self.bridge.close_reason}, status=503)
        if self.bridge.accepting:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "shutting_down"}, status=503)

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": self._created,
                        "owned_by": "tp-supervise",
                        "max_model_len": self.spec.max_context,
                    }
                ],
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _read_json(request, self.limits.read_timeout_s)
            spec = parse_completion(body, model_name=self.model_name, vocab_size=self.spec.vocab_size)
            ids = list(spec.prompt_ids) if spec.prompt_ids is not None else self.tokenizer.encode(spec.prompt_text)
        except ApiError as exc:
            return _error(exc)
        return await self._serve_generation(request, ids, spec.gen, COMPLETION)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _read_json(request, self.limits.read_timeout_s)
            spec = parse_chat(body, model_name=self.model_name)
            gen = parse_resume(body, spec.gen, self.spec.vocab_size)
            text = self.chat_template.render(spec.messages)
            ids = self.tokenizer.encode(text, add_special_tokens=self.chat_template.add_special_tokens)
        except ApiError as exc:
            return _error(exc)
        return await self._serve_generation(request, ids, gen, CHAT)

    def _admit(self, ids: list[int], gen: GenerationSpec) -> str:
        """Checks before a request reaches the engine; returns its fingerprint (raises ApiError)."""
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", "prompt")
        check_prompt(len(ids), self.limits.max_prompt_tokens)
        check_context(len(ids), gen.max_tokens, self.spec.max_context)
        fp = fingerprint(
            self.model_name, ids, gen.max_tokens, gen.temperature, gen.top_p, gen.seed, gen.stop, gen.ignore_eos
        )
        incidents = self._quarantine.lookup(fp)
        if incidents is not None:
            log.warning("request quarantined", fingerprint=fp, incidents=list(incidents))
            raise quarantined(incidents)
        if not self.bridge.accepting:
            raise _unavailable(self.bridge.close_reason or SHUTDOWN_TEXT)
        if self._waiting.count >= self.limits.max_waiting:
            raise ApiError(
                429,
                f"{self._waiting.count} requests are already waiting for a batch slot; retry later",
                None,
                "rate_limit_error",
                retry_after=RETRY_AFTER_S,
            )
        return fp

    async def _serve_generation(
        self, request: web.Request, ids: list[int], gen: GenerationSpec, shape
    ) -> web.StreamResponse:
        try:
            fp = self._admit(ids, gen)
        except ApiError as exc:
            return _error(exc)
        seed = gen.seed if gen.seed is not None else self._seeds.getrandbits(SEED_BITS)
        params = SamplingParams(
            max_tokens=gen.max_tokens,
            temperature=gen.temperature,
            top_p=gen.top_p,
            seed=seed,
            ignore_eos=gen.ignore_eos,
        )
        req = Request(
            f"{shape.prefix}-{uuid.uuid4().hex}",
            tuple(ids),
            params,
            fingerprint=fp,
            isolate=self._quarantine.suspected(fp),  # a suspect of a failed attempt: prefilled alone
            resume_ids=gen.resume_ids,
        )
        try:
            queue = self.bridge.submit(req, asyncio.get_running_loop())
        except RuntimeError as exc:
            return _error(_unavailable(str(exc)))
        outputs = _CountWaiting(queue, self._waiting)
        self._bound += 1
        self._idle.clear()
        done = False
        try:
            if gen.stream:
                response, done = await self._stream(request, req, gen, outputs, shape)
            else:
                response, done = await self._collect(req, gen, outputs, shape)
                await response.prepare(request)  # written before the handler counts as done (drain)
                await response.write_eof()
            return response
        finally:
            outputs.arrived()
            if not done:
                self.bridge.abort(req.request_id)
            self._bound -= 1
            if not self._bound:
                self._idle.set()

    async def _generate(self, req: Request, gen: GenerationSpec, outputs):
        """Yields (text_delta, new_token_ids, finish_reason|None); raises ApiError on engine errors."""
        decoder = IncrementalDecoder(self.tokenizer)
        matcher = StopMatcher(gen.stop)
        if req.resume_ids:  # the client has this text already; what the matcher holds back it has not
            _, stopped = matcher.feed(decoder.push(list(req.resume_ids)))
            if stopped:  # the tokens it resumes from already end in a stop string: nothing more to generate
                self.bridge.abort(req.request_id)
                yield "", [], "stop"
                return
        while True:
            item = await outputs.get()
            if isinstance(item, EngineError):
                raise _unavailable(item.message)
            if item.finish_reason == "error":
                raise ApiError(
                    500,
                    "the engine could not sample a token for this request (non-finite logits); "
                    "the engine goes on serving",
                    None,
                    "server_error",
                )
            delta = decoder.push([item.token_id], final=item.finished)
            text, stopped = matcher.feed(delta)
            if stopped:
                if not item.finished:
                    self.bridge.abort(req.request_id)
                yield text, [item.token_id], "stop"
                return
            if item.finished:
                yield text + matcher.flush(), [item.token_id], item.finish_reason
                return
            yield text, [item.token_id], None

    async def _collect(self, req: Request, gen: GenerationSpec, outputs, shape):
        parts: list[str] = []
        token_ids: list[int] = []
        finish = None
        try:
            async for text, ids, reason in self._generate(req, gen, outputs):
                parts.append(text)
                token_ids.extend(ids)
                finish = reason
        except ApiError as exc:
            return _error(exc), True
        body = shape.body(
            request_id=req.request_id,
            created=int(time.time()),
            model=self.model_name,
            text="".join(parts),
            finish_reason=finish,
            token_ids=token_ids if gen.return_token_ids else None,
            usage=usage_body(len(req.prompt_ids), len(req.resume_ids) + len(token_ids)),
        )
        return web.json_response(body), True

    async def _stream(self, request: web.Request, req: Request, gen: GenerationSpec, outputs, shape):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        head = {"request_id": req.request_id, "created": int(time.time()), "model": self.model_name}
        count = len(req.resume_ids)

        async def send(payload) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        try:
            first = shape.first_chunk(**head) if not req.resume_ids else None  # a resumed stream has begun
            if first is not None:
                await send(first)
            async for text, ids, reason in self._generate(req, gen, outputs):
                count += len(ids)
                if text or reason is not None or gen.return_token_ids:
                    await send(
                        shape.chunk(
                            text=text, finish_reason=reason, token_ids=ids if gen.return_token_ids else None, **head
                        )
                    )
            if gen.include_usage:
                await send(
                    {
                        "id": req.request_id,
                        "object": shape.object,
                        "created": head["created"],
                        "model": self.model_name,
                        "choices": [],
                        "usage": usage_body(len(req.prompt_ids), count),
                    }
                )
        except ApiError as exc:
            await send(exc.body())
            if exc.status == 503:
                response.force_close()
        await send("[DONE]")
        await response.write_eof()
        return response, True


class _WaitingCount:
    """Requests submitted whose first output has not arrived: the admission queue (HTTP loop only)."""

    def __init__(self) -> None:
        self.count = 0


class _CountWaiting:
    """An output queue that counts its request as waiting until the first output arrives."""

    def __init__(self, outputs: asyncio.Queue, waiting: _WaitingCount):
        self._outputs = outputs
        self._counter: _WaitingCount | None = waiting
        waiting.count += 1

    async def get(self) -> SeqOutput | EngineError:
        item = await self._outputs.get()
        self.arrived()
        return item

    def arrived(self) -> None:
        if self._counter is not None:
            self._counter.count -= 1
            self._counter = None
