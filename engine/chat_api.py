"""OpenAI ``/v1/chat/completions``: validation, prompt rendering and response bodies (torch-free).

A chat request is a completion of one rendered prompt: the messages become
text through a chat template, the text becomes token ids, and from there on
the request is scheduled, sampled, stopped and fingerprinted exactly like a
``/v1/completions`` request (the generation fields are the same:
engine/openai_api.py ``parse_generation``; ``max_completion_tokens`` wins over
``max_tokens``).

Messages: a non-empty list (at most ``MAX_MESSAGES``) of objects with a
``role`` in ``ROLES`` and a ``content`` that is a string or a list of text
parts ``{"type": "text", "text": "..."}`` (joined with newlines); an
``assistant`` message may have no content.  Anything else (another role,
image parts, tools) is a 400 naming the field.

Templates, chosen once at startup (:func:`load_chat_template`):

* the checkpoint's own, when its directory has ``chat_template.jinja`` or
  ``tokenizer_config.json`` has ``chat_template`` (a string, or a list of
  ``{"name", "template"}`` of which ``default`` is used): rendered with jinja2
  (imported here, only when a checkpoint has a template) the way transformers
  does it (sandboxed, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
  ``raise_exception``, ``tojson``, ``strftime_now``) with ``messages``,
  ``add_generation_prompt=True``, ``bos_token`` and ``eos_token``; the text is
  tokenized without adding special tokens (the template writes them);
  ``developer`` messages are given to it as ``system`` (templates written
  before that role know only ``system``).  A message the template refuses
  (``raise_exception``) or cannot render is a 400 with its reason.
* otherwise (the random models, a checkpoint without a template, jinja2 not
  installed, a template that does not compile) the plain template::

      <role>: <content>\\n        (one line per message)
      assistant:<space>         (the generation prompt)

  tokenized like a completion prompt (BOS added).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .log import get_logger
from .openai_api import ApiError, GenerationSpec, check_model, parse_generation

ROLES = ("system", "developer", "user", "assistant")
MAX_MESSAGES = 1024
PLAIN_GENERATION_PROMPT = "assistant: "
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
PART_SEPARATOR = "\n"

log = get_logger()


@dataclass(frozen=True)
class ChatSpec:
    messages: tuple[tuple[str, str], ...]  # (role, content)
    gen: GenerationSpec


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _checked_text(value: str, param: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"'{param}' is not valid Unicode text (it contains a lone surrogate)", param) from None
    return value


def _content(message: dict, role: str, where: str) -> str:
    param = f"{where}.content"
    value = message.get("content")
    if value is None:
        if role == "assistant":
            return ""
        raise _bad(f"'{param}' is required for a {role} message", param)
    if isinstance(value, str):
        return _checked_text(value, param)
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            part_param = f"{param}[{j}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(
                    f'\'{part_param}\' must be a text part {{"type": "text", "text": ...}} '
                    "(only text content is supported)",
                    part_param,
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"'{part_param}.text' must be a string", part_param)
            texts.append(_checked_text(text, part_param))
        return PART_SEPARATOR.join(texts)
    raise _bad(f"'{param}' must be a string or a list of text parts", param)


def _messages(value) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list):
        raise _bad("'messages' must be a list of messages", "messages")
    if not value:
        raise _bad("'messages' must not be empty", "messages")
    if len(value) > MAX_MESSAGES:
        raise _bad(f"at most {MAX_MESSAGES} messages per request", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"'{where}' must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            shown = role[:40] if isinstance(role, str) else type(role).__name__
            raise _bad(f"'{where}.role' must be one of {', '.join(ROLES)} (got {shown!r})", f"{where}.role")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"'{where}.name' must be a string", f"{where}.name")
        out.append((role, _content(message, role, where)))
    return tuple(out)


def parse_chat(body, *, model_name: str) -> ChatSpec:
    """Validate a chat request body; raises :class:`ApiError` (400/404) with an OpenAI-style message."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    check_model(body, model_name)
    if "messages" not in body:
        raise _bad("'messages' is required", "messages")
    messages = _messages(body["messages"])
    gen = parse_generation(body, max_tokens_field="max_completion_tokens")
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:
        raise _bad("'logprobs' is not supported", "logprobs")
    tools = body.get("tools")
    if tools is not None and tools != []:
        raise _bad("'tools' are not supported by this server", "tools")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _bad('\'response_format\' other than {"type": "text"} is not supported', "response_format")
    return ChatSpec(messages=messages, gen=gen)


# -- templates -------------------------------------------------------------------------------
class PlainTemplate:
    """``<role>: <content>`` lines, then ``assistant: ``; encoded with the tokenizer's special tokens."""

    source = "plain"
    add_special_tokens = True

    def render(self, messages: tuple[tuple[str, str], ...]) -> str:
        return "".join(f"{role}: {content}\n" for role, content in messages) + PLAIN_GENERATION_PROMPT


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class JinjaTemplate:
    """A checkpoint's Jinja chat template, compiled once (raises on a template that does not compile)."""

    add_special_tokens = False

    def __init__(self, text: str, source: str, bos_token: str, eos_token: str):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self._template = env.from_string(text)
        self.source = source
        self._bos = bos_token
        self._eos = eos_token

    def render(self, messages: tuple[tuple[str, str], ...]) -> str:
        rendered = [
            {"role": "system" if role == "developer" else role, "content": content} for role, content in messages
        ]
        try:
            text = self._template.render(
                messages=rendered, add_generation_prompt=True, bos_token=self._bos, eos_token=self._eos
            )
        except Exception as exc:  # raise_exception, or a template that fails on this input: this request only
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise _bad(f"the model's chat template cannot render these messages: {reason}", "messages") from None
        if not text:
            raise _bad("the model's chat template rendered these messages as an empty prompt", "messages")
        return text


def _token_text(value) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _checkpoint_template(model_dir: Path) -> tuple[str, str, dict] | None:
    """(template text, where it came from, tokenizer_config) of a checkpoint, or None."""
    config_path = model_dir / TOKENIZER_CONFIG
    config: dict = {}
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError) as exc:
            log.warning("tokenizer config unreadable", path=str(config_path), error=str(exc)[:200])
    jinja_file = model_dir / TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file), config
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template, f"{config_path} chat_template", config
    return None


def load_chat_template(model_dir: str | None):
    """The checkpoint's template when it has one and it compiles, else :class:`PlainTemplate` (logged)."""
    if model_dir is None:
        return PlainTemplate()
    found = _checkpoint_template(Path(model_dir))
    if found is None:
        log.info("chat template", source="plain", reason="the checkpoint has no chat template")
        return PlainTemplate()
    text, source, config = found
    try:
        template = JinjaTemplate(
            text, source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        )
    except ImportError:
        log.warning(
            "chat template unusable",
            source=source,
            fallback="plain",
            error="jinja2 is not installed (pip install jinja2)",
        )
        return PlainTemplate()
    except Exception as exc:  # a template that does not compile
        log.warning("chat template unusable", source=source, fallback="plain", error=" ".join(str(exc).split())[:300])
        return PlainTemplate()
    log.info("chat template", source=source)
    return template


# -- response bodies ---------------------------------------------------------------------------
def chat_body(
    *,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    token_ids: list[int] | None,
    usage: dict,
) -> dict:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def chat_chunk(
    *, request_id: str, created: int, model: str, delta: dict, finish_reason: str | None, token_ids: list[int] | None
) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


class ChatShape:
    """How ``/v1/chat/completions`` answers: the first chunk names the role, later ones carry content."""

    prefix = "chatcmpl"
    object = "chat.completion.chunk"

    def body(self, **kw) -> dict:
        return chat_body(**kw)

    def first_chunk(self, **kw) -> dict | None:
        return chat_chunk(delta={"role": "assistant", "content": ""}, finish_reason=None, token_ids=None, **kw)

    def chunk(self, *, text: str, **kw) -> dict:
        return chat_chunk(delta={"content": text} if text else {}, **kw)


CHAT = ChatShape()
