"""One client stream across the attempts that serve it: relayed chunk by chunk, continued after a failure.

``Stream.relay`` copies one attempt's events to the client and says whether
the stream ended (``[DONE]``, or every token went out) or the attempt failed
under it.  ``next_send`` is what to send next: the request as the client
made it (asking the engine for token ids), or the engine's way to continue
from the token ids the client already has (the adapter's ``resume``,
supervisor/relay/engines.py; None: it cannot, the stream ends with an error
event naming the incident).  Every chunk keeps the first attempt's ``id``
and ``created``; a repeated chat role chunk is dropped; token ids are
stripped unless the client asked for them; a resumed attempt's chunks are
shown in the client's endpoint's shape (``Resumed.reframe``).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from .engines import Adapter, Resumed, StreamSoFar, error_body
from .hold import Flight, Group


class ClientGone(Exception):
    """Writing to the client failed: it went away (never a reason to send the request again)."""


def parse_json(data: bytes):
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


class Stream:
    """One client stream across the attempts that serve it."""

    def __init__(self, request: web.Request, body: dict, engine: Adapter, flight: Flight):
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
            raise ClientGone from exc

    async def _end(self) -> web.StreamResponse:
        await self._send("[DONE]")
        try:
            await self.done().write_eof()
        except (ConnectionError, OSError) as exc:
            raise ClientGone from exc
        return self.done()

    async def relay(self, up: aiohttp.ClientResponse, retry: bool, group: Group) -> bool:
        """Relay one attempt's events; True when the stream ended ([DONE]), False when the attempt failed."""
        try:
            async for line in up.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    await self._end()
                    return True
                event = parse_json(data)
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    if self.finished:  # every token is out; the usage chunk is all the failure cost
                        await self._end()
                        return True
                    if retry and await group.is_failure(self.engine.event_failure(event)):
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
        body = parse_json(data)
        await self.fail(body if isinstance(body, dict) and "error" in body else error_body(status, "request refused"))
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
