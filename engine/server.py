"""HTTP frontend on rank 0 (aiohttp, in its own thread and event loop).

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``
(OpenAI-compatible; see engine/openai_api.py).  The frontend tokenizes,
validates, hands requests to the engine loop through :class:`EngineBridge`,
detokenizes outputs and applies stop strings (a matched stop string aborts
the sequence in the engine).  A client that disconnects aborts its request.

Hostile input can only fail its own request: every error, including an
oversized body (413), a slow body (408), a full queue (429 + Retry-After) and
any bug in a handler (500), is answered in OpenAI's JSON error format and
logged as one line; aiohttp's protocol errors (oversized or malformed
headers) are logged as one line with the peer, never a traceback.  A
connection that has not sent its headers within the read timeout is closed
(aiohttp's keep-alive timer also covers a request in progress of arriving).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from tp_supervise.supervisor.rank.net import is_loopback

from .bridge import EngineBridge, EngineError
from .log import get_logger
from .openai_api import (
    ApiError,
    CompletionSpec,
    StopMatcher,
    check_context,
    check_prompt,
    completion_body,
    parse_completion,
    usage_body,
)
from .scheduler import Request, SamplingParams, SeqOutput
from .tokenizer import IncrementalDecoder

STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
HANDLER_DRAIN_S = 2.0  # in-flight handlers already got their error; give them this long to write it
SEED_BITS = 63
MAX_BODY_BYTES = 1 << 20  # a prompt beyond this is far past any context this engine serves
RETRY_AFTER_S = 1
LINGER_S = 1.0  # after answering early (408, 413), read and drop the unread body this long, then close
UTF8_CODECS = frozenset({"utf-8", "ascii"})  # codecs.lookup names JSON bodies may declare (RFC 8259: UTF-8)

log = get_logger()


@dataclass(frozen=True)
class ServingLimits:
    max_waiting: int = 256
    read_timeout_s: float = 15.0
    max_prompt_tokens: int = 2047


def _error(exc: ApiError, headers: dict | None = None) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=headers)


class _OneLineLog(logging.LoggerAdapter):
    """aiohttp's server logger: a protocol error becomes one structured line with the peer, no traceback."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})

    def exception(self, msg, *args, exc_info=None, **_kw) -> None:
        peer = args[0] if args else None
        error = f"{type(exc_info).__name__}: {exc_info}" if isinstance(exc_info, BaseException) else str(msg)
        log.warning("http protocol error", peer=str(peer), error=" ".join(error.split())[:300])

    def error(self, msg, *args, **kw) -> None:
        self.exception(msg, *args, **kw)


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


def _shutting_down(message: str) -> ApiError:
    return ApiError(503, message, None, "server_error")


class Frontend:
    def __init__(self, bridge: EngineBridge, tokenizer, *, model_name: str, max_context: int, vocab_size: int,
                 host: str, port: int, seed: int, limits: ServingLimits = ServingLimits()):
        self.bridge = bridge
        self.limits = limits
        self._waiting = _WaitingCount()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.host = host
        self.port = port
        self._seeds = random.Random(seed)
        self._created = int(time.time())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    # -- lifecycle (engine thread) ------------------------------------------
    def start(self) -> int:
        """Bind and serve in thread ``engine-http``; returns the bound port (raises OSError if binding fails)."""
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
        # keepalive_timeout also closes a connection that has not completed its headers (aiohttp
        # closes a handler still waiting for a message): the header half of the read timeout
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=HANDLER_DRAIN_S, logger=_OneLineLog(),
                                     keepalive_timeout=self.limits.read_timeout_s, lingering_time=LINGER_S)
        try:
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        if not is_loopback(self.host):
            log.warning("the completions API has no authentication and binds a non-loopback address; "
                        "put it behind an authenticating proxy or bind 127.0.0.1", host=self.host, port=self.port)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        asyncio.get_running_loop().call_soon(asyncio.get_running_loop().stop)

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
        if self.bridge.accepting:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "shutting_down"}, status=503)

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self._created, "owned_by": "tp-supervise",
            "max_model_len": self.max_context,
        }]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _read_json(request, self.limits.read_timeout_s)
            spec = parse_completion(body, model_name=self.model_name, vocab_size=self.vocab_size)
            ids = list(spec.prompt_ids) if spec.prompt_ids is not None else self.tokenizer.encode(spec.prompt_text)
            check_prompt(len(ids), self.limits.max_prompt_tokens)
            check_context(len(ids), spec.max_tokens, self.max_context)
            if not self.bridge.accepting:
                raise _shutting_down(self.bridge.close_reason or "engine is shutting down")
            if self._waiting.count >= self.limits.max_waiting:
                return _error(ApiError(429, f"{self._waiting.count} requests are already waiting for a batch slot; "
                                       "retry later", None, "rate_limit_error"),
                              {"Retry-After": str(RETRY_AFTER_S)})
        except ApiError as exc:
            return _error(exc)
        seed = spec.seed if spec.seed is not None else self._seeds.getrandbits(SEED_BITS)
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                                seed=seed, ignore_eos=spec.ignore_eos)
        req = Request(f"cmpl-{uuid.uuid4().hex}", tuple(ids), params)
        try:
            outputs = self.bridge.submit(req, asyncio.get_running_loop())
        except RuntimeError as exc:
            return _error(_shutting_down(str(exc)))
        outputs = _CountWaiting(outputs, self._waiting)
        done = False
        try:
            if spec.stream:
                response, done = await self._stream(request, req, spec, outputs)
            else:
                response, done = await self._collect(req, spec, outputs)
            return response
        finally:
            outputs.arrived()
            if not done:
                self.bridge.abort(req.request_id)

    async def _generate(self, req: Request, spec: CompletionSpec, outputs: asyncio.Queue):
        """Yields (text_delta, new_token_ids, finish_reason|None); raises ApiError on engine errors."""
        decoder = IncrementalDecoder(self.tokenizer)
        matcher = StopMatcher(spec.stop)
        while True:
            item = await outputs.get()
            if isinstance(item, EngineError):
                raise _shutting_down(item.message)
            if item.finish_reason == "error":
                raise ApiError(500, "the engine could not sample a token for this request (non-finite logits); "
                               "the engine goes on serving", None, "server_error")
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

    async def _collect(self, req: Request, spec: CompletionSpec, outputs: asyncio.Queue):
        parts: list[str] = []
        token_ids: list[int] = []
        finish = None
        try:
            async for text, ids, reason in self._generate(req, spec, outputs):
                parts.append(text)
                token_ids.extend(ids)
                finish = reason
        except ApiError as exc:
            return _error(exc), True
        body = completion_body(
            request_id=req.request_id, created=int(time.time()), model=self.model_name, text="".join(parts),
            finish_reason=finish, token_ids=token_ids if spec.return_token_ids else None,
            usage=usage_body(len(req.prompt_ids), len(token_ids)),
        )
        return web.json_response(body), True

    async def _stream(self, request: web.Request, req: Request, spec: CompletionSpec, outputs: asyncio.Queue):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        created = int(time.time())
        count = 0

        async def send(payload) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        try:
            async for text, ids, reason in self._generate(req, spec, outputs):
                count += len(ids)
                if text or reason is not None or spec.return_token_ids:
                    await send(completion_body(
                        request_id=req.request_id, created=created, model=self.model_name, text=text,
                        finish_reason=reason, token_ids=ids if spec.return_token_ids else None, usage=None))
            if spec.include_usage:
                await send({"id": req.request_id, "object": "text_completion", "created": created,
                            "model": self.model_name, "choices": [],
                            "usage": usage_body(len(req.prompt_ids), count)})
        except ApiError as exc:
            await send(exc.body())
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

    def arrived(self) -> None:
        if self._counter is not None:
            self._counter.count -= 1
            self._counter = None

    async def get(self) -> SeqOutput | EngineError:
        item = await self._outputs.get()
        self.arrived()
        return item
