"""OpenAI ``/v1/completions`` request validation and response bodies (torch-free, pure).

Supported fields: ``prompt`` (text, or a list of token ids, or a one-element
list of either), ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop`` (string or up to four strings), ``stream`` (+ ``stream_options.
include_usage``), ``n`` (1 only), ``model`` (must match when given) and three
extensions: ``ignore_eos``, ``return_token_ids`` (choices carry
``token_ids``) and ``resume_token_ids`` (:func:`parse_resume`: continue a
generation the supervisor's relay already sent part of; docs/engine.md,
"Serving through faults").  Unknown fields are ignored, as OpenAI clients
send many.

The generation fields (everything but the prompt) are shared with
``/v1/chat/completions`` (engine/chat_api.py): :func:`parse_generation`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
MAX_STOP_STRINGS = 4
MAX_TEMPERATURE = 2.0
SEED_RANGE = 2**63
# error.code of every 503 the engine answers when it stops serving (its group failed, a shutdown): the
# relay (supervisor/relay/) sends such a request again to the next attempt
UNAVAILABLE_CODE = "engine_unavailable"
# error.code of the 400 a quarantined request gets (engine/runfiles.py, quarantine.json): from the built-in
# engine's frontend, or from the relay in front of a COMMAND's engine (:func:`quarantined`)
QUARANTINED_CODE = "request_quarantined"


class ApiError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status.

    ``retry_after`` (seconds) becomes a ``Retry-After`` header (429, 503);
    ``code`` is the machine-readable ``error.code`` (None for most errors).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        *,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def quarantined(incidents: tuple[str, ...] | list[str]) -> ApiError:
    """The refusal of a quarantined request, naming the incidents it was a suspect in (the one definition: the
    built-in engine's frontend and the relay answer the same)."""
    named = ", ".join(incidents) or "of an earlier attempt"
    message = (
        f"this request is quarantined: the engine's group failed while it was in flight (incidents {named}); "
        "it will not be run again"
    )
    return ApiError(400, message, None, code=QUARANTINED_CODE)


@dataclass(frozen=True)
class GenerationSpec:
    """What to generate and how, shared by completions and chat completions."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None  # as the client sent it (None: the server draws one)
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool
    # tokens already generated (and sent) for this request by an attempt that failed: the engine
    # generates the rest; not a sampling parameter (the fingerprint ignores it)
    resume_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CompletionSpec:
    prompt_text: str | None
    prompt_ids: tuple[int, ...] | None
    gen: GenerationSpec


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{name}' must be a number", name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean", name)
    return value


def _text(value: str, param: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"'{param}' is not valid Unicode text (it contains a lone surrogate)", param) from None
    return value


def _prompt(value, vocab_size: int) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise _bad("'prompt' must not be empty", "prompt")
        return _text(value, "prompt"), None
    if isinstance(value, list):
        if not value:
            raise _bad("'prompt' must not be empty", "prompt")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            bad = [v for v in value if not 0 <= v < vocab_size]
            if bad:
                raise _bad(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
            return None, tuple(value)
        if all(isinstance(v, (str, list)) for v in value):
            raise _bad("only one prompt per request is supported", "prompt")
    raise _bad("'prompt' must be a string or a list of token ids", "prompt")


def check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404, f"the model '{str(model)[:100]}' does not exist (serving '{model_name}')", "model", "not_found_error"
        )


def parse_generation(body: dict, *, max_tokens_field: str = "max_tokens") -> GenerationSpec:
    """The generation fields of a request body (``max_tokens_field`` overrides ``max_tokens`` when set)."""
    field = max_tokens_field
    max_tokens = _integer(body, field)
    if max_tokens is None:
        field = "max_tokens"
        max_tokens = _integer(body, field)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise _bad(f"'{field}' must be >= 1", field)
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise _bad(f"'temperature' must be in [0, {MAX_TEMPERATURE}]", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise _bad("'top_p' must be in (0, 1]", "top_p")
    seed = _integer(body, "seed")
    if seed is not None and not -SEED_RANGE <= seed < SEED_RANGE:
        raise _bad("'seed' is out of range", "seed")
    n = _integer(body, "n")
    if n not in (None, 1):
        raise _bad("only n=1 is supported", "n")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (_text(stop, "stop"),) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        stops = tuple(_text(s, "stop") for s in stop if s)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    return GenerationSpec(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stops,
        stream=_flag(body, "stream"),
        include_usage=bool(options.get("include_usage", False)),
        ignore_eos=_flag(body, "ignore_eos"),
        return_token_ids=_flag(body, "return_token_ids"),
    )


def parse_resume(body: dict, gen: GenerationSpec, vocab_size: int) -> GenerationSpec:
    """``resume_token_ids``: the tokens an earlier attempt generated for this request (the relay sends them).

    Counted in ``max_tokens`` and in the context; at least one token must be left to generate.
    """
    value = body.get("resume_token_ids")
    if value is None or value == []:
        return gen
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _bad("'resume_token_ids' must be a list of token ids", "resume_token_ids")
    bad = [v for v in value if not 0 <= v < vocab_size]
    if bad:
        raise _bad(f"resume token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "resume_token_ids")
    if len(value) >= gen.max_tokens:
        raise _bad("'resume_token_ids' must be shorter than 'max_tokens'", "resume_token_ids")
    return replace(gen, resume_ids=tuple(value))


def parse_completion(body, *, model_name: str, vocab_size: int) -> CompletionSpec:
    """Validate a request body; raises :class:`ApiError` (400/404) with an OpenAI-style message."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    check_model(body, model_name)
    if "prompt" not in body:
        raise _bad("'prompt' is required", "prompt")
    text, ids = _prompt(body["prompt"], vocab_size)
    gen = parse_resume(body, parse_generation(body), vocab_size)
    if body.get("logprobs") is not None:
        raise _bad("'logprobs' is not supported", "logprobs")
    if _flag(body, "echo"):
        raise _bad("'echo' is not supported", "echo")
    return CompletionSpec(prompt_text=text, prompt_ids=ids, gen=gen)


def check_prompt(prompt_len: int, max_prompt_tokens: int) -> None:
    if prompt_len > max_prompt_tokens:
        raise _bad(f"the prompt has {prompt_len} tokens; this server accepts at most {max_prompt_tokens}", "prompt")


def check_context(prompt_len: int, max_tokens: int, max_context: int) -> None:
    if prompt_len + max_tokens > max_context:
        raise _bad(
            f"this model's maximum context length is {max_context} tokens; the request has "
            f"{prompt_len} prompt tokens and asks for {max_tokens} more",
            "prompt" if prompt_len >= max_context else "max_tokens",
        )


class StopMatcher:
    """Finds stop strings in streamed text and holds back what could become one.

    ``feed(delta)`` returns ``(safe_text, stopped)``: text that can be sent now
    (never a prefix of a stop string that later text might complete), and
    whether a stop string was found (the text before it is then final).
    """

    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self._stops:
            return delta, False
        text = self._pending + delta
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._pending = ""
            return text[:cut], True
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text


def completion_body(
    *,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    token_ids: list[int] | None,
    usage: dict | None,
) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    return body


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class CompletionShape:
    """How ``/v1/completions`` answers: one body, or chunks of the same shape (the frontend's view)."""

    prefix = "cmpl"
    object = "text_completion"

    def body(self, **kw) -> dict:
        return completion_body(**kw)

    def first_chunk(self, **_kw) -> dict | None:
        return None

    def chunk(self, *, text: str, **kw) -> dict:
        return completion_body(text=text, usage=None, **kw)


COMPLETION = CompletionShape()
