"""What the relay needs to know of the engine behind it: one small adapter per engine.

The relay's work is the same for every engine: hold a request the failing
group answered, send it again once the next attempt is ready, continue a
stream from the tokens the client already has.  What differs:

- **which answers are the group's failure** (``failure`` for a whole answer,
  ``event_failure`` for a stream's error event): ``True`` hold and resend,
  ``False`` pass it on, ``None`` ask the group (the relay then holds the
  request when the supervisor ruled a fault, the ``incident`` file, or the
  engine's ``/health`` is not 200 within a moment: a 500 of a healthy engine
  is the request's own answer);
- **how to ask for token ids** (``first_payload``) and **how to resume**
  (``resume``: the request that continues a stream from prompt token ids +
  the tokens already sent, or None where the engine cannot);
- **how a resumed stream's chunks are shown** to the client
  (``Resumed.reframe``: the original endpoint's shape, usage counted once).

Adapters: ``builtin`` (our engine: ``resume_token_ids`` on the same path),
``vllm`` (vLLM's ``return_token_ids``; a stream resumes as a
``/v1/completions`` request whose prompt is the token ids, re-framed as the
client's chat or completions chunks), ``openai`` (any other OpenAI-compatible
server, SGLang included: no token ids, so a stream that already sent tokens
ends with an error event naming the incident).  The names are ``--relay``'s
engines (supervisor/spec.py ``RELAY_ENGINES``).  Errors the relay answers
itself take the engine's format (``error_body``: engine/openai_api.py's).
docs/engine.md, "The relay".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from tp_supervise.engine.openai_api import UNAVAILABLE_CODE, ApiError

FINGERPRINT_PERSON = b"tps-relay-req-v1"  # not the engine's (tps-request-v1): the relay sees text, not token ids
# Keys that change how an answer is delivered, not what is generated: not part of a request's fingerprint.
DELIVERY_KEYS = frozenset({"stream", "stream_options", "return_token_ids", "user", "request_id", "resume_token_ids"})
# Chat fields a /v1/completions request has no place for; with any of these set a chat stream is not resumed
# (the engine's grammar or parser state would start again from the resumed prompt).
CHAT_ONLY_STATE = (
    "tools",
    "tool_choice",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "reasoning_effort",
    "echo",
    "continue_final_message",
)
CHAT_ONLY_KEYS = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "reasoning_effort",
        "include_reasoning",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        "mm_processor_kwargs",
        "add_special_tokens",
        "return_prompt_text",
    }
)
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def request_fingerprint(path: str, body: dict) -> str:
    """32 hex digits over the request as the engine would run it (path, model, prompt or messages, sampling
    parameters), never the text itself; how it is delivered (stream, token ids) does not count."""
    kept = {k: v for k, v in body.items() if k not in DELIVERY_KEYS}
    canonical = json.dumps([path, kept], sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.blake2b(canonical.encode("ascii"), digest_size=16, person=FINGERPRINT_PERSON).hexdigest()


def error_body(status: int, message: str, code: str | None = None) -> dict:
    """An OpenAI-format error body of the relay's own (a 5xx is a ``server_error``)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return ApiError(status, message, None, kind, code=code).body()


def error_code(event) -> str | None:
    error = event.get("error") if isinstance(event, dict) else None
    return error.get("code") if isinstance(error, dict) and isinstance(error.get("code"), str) else None


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class Resumed:
    """How the chunks of a resumed attempt are shown: the client's endpoint, the tokens it already had."""

    client_path: str
    upstream_path: str
    had_tokens: int  # completion tokens the client got before the resume (counted once in usage)
    prompt_tokens: int | None  # the original prompt's length (the resumed prompt holds the tokens too)
    model: str | None = None

    def reframe(self, event: dict) -> dict:
        usage = event.get("usage")
        if isinstance(usage, dict) and self.prompt_tokens is not None:
            done = (_int(usage.get("completion_tokens")) or 0) + self.had_tokens
            usage = dict(
                usage, prompt_tokens=self.prompt_tokens, completion_tokens=done, total_tokens=self.prompt_tokens + done
            )
            event["usage"] = usage
        if self.client_path == self.upstream_path:
            return event
        # a /v1/completions chunk shown as the chat chunk the client's stream was made of
        choices = []
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            out = {
                "index": choice.get("index", 0),
                "delta": {"content": choice.get("text") or ""},
                "logprobs": None,
                "finish_reason": choice.get("finish_reason"),
            }
            if "token_ids" in choice:
                out["token_ids"] = choice["token_ids"]
            if choice.get("stop_reason") is not None:
                out["stop_reason"] = choice["stop_reason"]
            choices.append(out)
        chat = {"object": "chat.completion.chunk", "model": event.get("model", self.model), "choices": choices}
        if "usage" in event:
            chat["usage"] = event["usage"]
        return chat


@dataclass
class StreamSoFar:
    """What a stream delivered: the ids the relay collected, the prompt's ids when the engine said them."""

    path: str
    body: dict
    ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] | None = None


class Adapter:
    """Any OpenAI-compatible server (SGLang included): no token ids, a 5xx is checked against the group."""

    name = "openai"
    health_path = "/health"
    records_requests = True  # the relay is the source of in-flight fingerprints (the builtin engine records its own)
    quarantines = True  # the relay refuses quarantined fingerprints (the builtin engine does it itself)

    def failure(self, status: int, body) -> bool | None:
        if status == 503 and error_code(body) == UNAVAILABLE_CODE:
            return True
        if status >= 500:
            return None
        return False

    def event_failure(self, event: dict) -> bool | None:
        return True if error_code(event) == UNAVAILABLE_CODE else None

    def first_payload(self, path: str, body: dict) -> dict:
        return body

    @staticmethod
    def first_token_payload(path: str, body: dict) -> dict:
        """The same request cut to its first token and not streamed: a suspect whose answer is not streamed is
        sent alone like this first, so that the engine's own signal (the token) ends its turn, not a timer."""
        payload = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
        payload.pop("max_completion_tokens", None)
        payload["max_tokens"] = 1
        return payload

    def resume(self, so_far: StreamSoFar) -> tuple[str, dict, Resumed] | None:
        return None

    @staticmethod
    def collect(event: dict, so_far: StreamSoFar) -> list:
        """The token ids of one chunk (and the prompt's, when this chunk says them)."""
        return []


class BuiltinAdapter(Adapter):
    """tp_supervise's own engine: ``return_token_ids`` and ``resume_token_ids`` on the same path; its failure is
    always said (503 ``engine_unavailable``), so nothing is checked against the group."""

    name = "builtin"
    records_requests = False
    quarantines = False

    def failure(self, status: int, body) -> bool | None:
        return status == 503 and error_code(body) == UNAVAILABLE_CODE

    def event_failure(self, event: dict) -> bool | None:
        return error_code(event) == UNAVAILABLE_CODE

    def first_payload(self, path: str, body: dict) -> dict:
        return dict(body, return_token_ids=True)

    def resume(self, so_far: StreamSoFar) -> tuple[str, dict, Resumed] | None:
        given = so_far.body.get("resume_token_ids")
        given = list(given) if isinstance(given, list) else []
        payload = dict(so_far.body, return_token_ids=True, resume_token_ids=given + so_far.ids)
        # the engine counts resumed tokens in max_tokens and usage itself
        return so_far.path, payload, Resumed(so_far.path, so_far.path, 0, None)

    @staticmethod
    def collect(event: dict, so_far: StreamSoFar) -> list:
        choices = event.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        return [i for i in choice.get("token_ids") or [] if isinstance(i, int)]


class VllmAdapter(Adapter):
    """vLLM's OpenAI server (checked on 0.32): ``return_token_ids`` gives the prompt's ids in the first chunk
    (chat: top level; completions: in the choice) and every chunk's ``token_ids``; a ``/v1/completions`` request
    takes a prompt of token ids, so a stream continues from prompt ids + the ids sent, ``max_tokens`` reduced."""

    name = "vllm"

    def first_payload(self, path: str, body: dict) -> dict:
        if self._resumable(path, body):
            return dict(body, return_token_ids=True)
        return body

    @staticmethod
    def _resumable(path: str, body: dict) -> bool:
        if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("use_beam_search"):
            return False
        if path == CHAT_PATH:
            return not any(body.get(k) for k in CHAT_ONLY_STATE)
        if path == COMPLETIONS_PATH:
            prompt = body.get("prompt")
            single = (
                isinstance(prompt, str)
                or (isinstance(prompt, list) and all(isinstance(i, int) for i in prompt))
                or (isinstance(prompt, list) and len(prompt) == 1)
            )
            return single and not body.get("echo") and not body.get("suffix")
        return False

    @staticmethod
    def collect(event: dict, so_far: StreamSoFar) -> list:
        choices = event.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        prompt = event.get("prompt_token_ids") or choice.get("prompt_token_ids")
        if so_far.prompt_ids is None and isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
            so_far.prompt_ids = list(prompt)
        return [i for i in choice.get("token_ids") or [] if isinstance(i, int)]

    def resume(self, so_far: StreamSoFar) -> tuple[str, dict, Resumed] | None:
        body, path = so_far.body, so_far.path
        if so_far.prompt_ids is None or not self._resumable(path, body):
            return None
        had = len(so_far.ids)
        if path == CHAT_PATH:
            payload = {k: v for k, v in body.items() if k not in CHAT_ONLY_KEYS}
            limit = _int(body.get("max_completion_tokens"))
            limit = limit if limit is not None else _int(body.get("max_tokens"))
        else:
            payload = dict(body)
            limit = _int(body.get("max_tokens"))
            limit = 16 if limit is None and "max_tokens" not in body else limit  # vLLM's completions default
        payload.update(prompt=so_far.prompt_ids + so_far.ids, stream=True, return_token_ids=True)
        payload["max_tokens"] = None if limit is None else max(1, limit - had)  # None: up to the model's length
        if _int(body.get("min_tokens")):
            payload["min_tokens"] = max(0, body["min_tokens"] - had)
        payload.pop("echo", None)
        model = body.get("model") if isinstance(body.get("model"), str) else None
        return COMPLETIONS_PATH, payload, Resumed(path, COMPLETIONS_PATH, had, len(so_far.prompt_ids), model)


ADAPTERS = {a.name: a for a in (Adapter(), BuiltinAdapter(), VllmAdapter())}


def adapter(name: str) -> Adapter:
    try:
        return ADAPTERS[name]
    except KeyError:
        raise ValueError(f"no relay adapter {name!r}: one of {', '.join(sorted(ADAPTERS))}") from None
