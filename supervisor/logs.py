"""structlog set-up: console lines for people, one JSON object per line for machines and log agents.

Every line, ours or a library's, goes through one stdlib handler on the root
logger (structlog's ``ProcessorFormatter``), so the supervisor's calls, the
records of libraries that use ``logging`` and ``warnings.warn`` come out in
one format, one whole line per write.

A JSON line starts with the keys log agents map without configuration
(docs/logs.md has the table of event names)::

    {"message": "rank joined the group", "level": "info", "timestamp": "2025-…Z",
     "logger": "tp_supervise.supervisor.core", "event": "rank_joined_the_group", "rank": 1, …}

- ``message``: the human text, the call's first argument (or its explicit
  ``message=`` keyword, for records that carry someone else's text: a rank's
  output line, named ``rank_output``).
- ``event``: a stable snake_case name, the call's ``event_name=`` or else the
  name of the text (``event_name()``): its headline, up to the first ``:``,
  ``;`` or ``(``, so the detail after a colon may vary without renaming it.
- ``logger``: the module that logged (whatever name ``get_logger`` was given);
  a call site may bind ``logger=`` to name another source.
- a library's record is ``library_log``, a ``warnings.warn`` is ``python_warning``.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from types import FrameType

import structlog
from structlog.stdlib import ProcessorFormatter
from structlog.typing import EventDict, Processor, WrappedLogger

from tp_supervise.dumps.render import plain

#: The keys every JSON line starts with, in this order.
HEAD_KEYS = ("message", "level", "timestamp", "logger", "event")
LIBRARY_EVENT = "library_log"
WARNING_EVENT = "python_warning"
_WARNINGS_LOGGER = "py.warnings"
_HEADLINE_END = re.compile(r"[:;(]")
_NOT_NAME = re.compile(r"[^a-z0-9]+")
_SKIPPED_MODULES = ("structlog", "logging")

# What every line names (run id, attempt): replaced whole, never changed in place, so a thread that is
# logging while the main thread binds a new attempt iterates a dict that does not change under it.
_run: list[dict[str, object]] = [{}]


def event_name(text: str) -> str:
    """The stable name of an event text: its headline, lower-cased, in snake_case.

    ``"rank exited"`` → ``rank_exited``; ``"hang: rank 1 stuck in allreduce"``
    → ``hang``; ``"dump.captured"`` → ``dump_captured``.
    """
    headline = _HEADLINE_END.split(text, maxsplit=1)[0]
    return _NOT_NAME.sub("_", headline.lower()).strip("_")


def _calling_module() -> str:
    """The module of the first frame outside structlog and logging (``-m`` runs name their module, not ``__main__``)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        scope = frame.f_globals
        name = scope.get("__name__", "")
        if name.split(".", 1)[0] not in _SKIPPED_MODULES:
            spec = scope.get("__spec__")
            return getattr(spec, "name", None) or name
        frame = frame.f_back
    return "tp_supervise"


RANK_OUTPUT_LOGGER = "tp_supervise.rank_output"  # the ranks' own lines in JSON mode: never filtered by level


def rank_output_logger():
    """The logger of the ranks' lines (``rank_output`` records): ``--log-level`` is the supervisor's own
    verbosity, the ranks' output is not the supervisor's to drop (console mode forwards it whatever the level)."""
    return structlog.wrap_logger(
        logging.getLogger(RANK_OUTPUT_LOGGER), wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG)
    )


def _module_logger(*_names: str) -> logging.Logger:
    """structlog's logger factory: a stdlib logger named after the calling module."""
    return logging.getLogger(_calling_module())


def _add_run_id(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    """Every line of every thread carries the run id and, once the group was
    launched, the attempt (contextvars do not cross into the supervisor's threads)."""
    for key, value in _run[0].items():
        event.setdefault(key, value)
    return event


def _name_event(logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    """``message``, ``event`` and ``logger`` of one of our calls (see the module docstring)."""
    text = str(event.pop("event", ""))
    name = event.pop("event_name", None) or event_name(text)
    event.setdefault("message", text)
    event["event"] = name
    event.setdefault("logger", getattr(logger, "name", None) or "tp_supervise")
    return event


def _name_foreign(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    """``message``, ``event`` and ``logger`` of a record of the stdlib ``logging`` (a library, a warning)."""
    record = event["_record"]
    event["message"] = str(event.pop("event", "")).rstrip("\n")
    event["event"] = WARNING_EVENT if record.name == _WARNINGS_LOGGER else LIBRARY_EVENT
    event["logger"] = record.name
    return event


def _head_first(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    """The keys agents map come first, so a person reading a raw line finds them too."""
    head = {key: event.pop(key) for key in HEAD_KEYS if key in event}
    head.update(event)
    return head


def _for_people(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    """Console lines show the text; the event name is for machines."""
    event.pop("event", None)
    event.pop("logger", None)
    return event


def _visible_controls(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    """Console lines: text from ranks (verdicts, collective names) cannot drive the terminal.

    Control characters other than newline and tab are shown as escapes; the
    JSON renderer escapes them by itself.
    """
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = plain(value)
    return event


def _log_uncaught(exc_type, exc, tb, **fields) -> None:
    structlog.get_logger().error("uncaught exception", exc_info=(exc_type, exc, tb), **fields)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    thread = args.thread.name if args.thread is not None else None
    _log_uncaught(args.exc_type, args.exc_value, args.exc_traceback, thread=thread)


def _excepthook(exc_type, exc, tb) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    _log_uncaught(exc_type, exc, tb)


_configured = [""]  # the format configure() set last ("" before the first call)


def ensure_json() -> None:
    """JSON lines from now on, unless configure() already set them (a refusal before the run's set-up)."""
    if _configured[0] != "json":
        configure("json")


def configure(fmt: str = "console", level: int = logging.INFO, stream=None) -> None:
    """Send every log line of this process (ours, libraries', warnings) to ``stream`` in ``fmt``.

    ``json`` also logs uncaught exceptions (main thread and others) as JSON
    lines, so nothing the supervisor itself writes breaks a line-by-line parser.
    """
    stream = stream or sys.stderr
    _configured[0] = fmt
    stamp: list[Processor] = [
        _add_run_id,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    render: list[Processor]
    if fmt == "json":
        render = [
            structlog.processors.format_exc_info,
            _head_first,
            structlog.processors.JSONRenderer(sort_keys=False),
        ]
    else:
        render = [
            _for_people,
            _visible_controls,
            structlog.dev.ConsoleRenderer(colors=stream.isatty(), pad_event_to=40, event_key="message"),
        ]
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        ProcessorFormatter(
            foreign_pre_chain=[*stamp, _name_foreign],
            processors=[ProcessorFormatter.remove_processors_meta, *render],
        )
    )
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger(RANK_OUTPUT_LOGGER).setLevel(logging.DEBUG)
    logging.captureWarnings(True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *stamp,
            _name_event,
            ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_module_logger,
        cache_logger_on_first_use=False,
    )
    if fmt == "json":
        sys.excepthook = _excepthook
        threading.excepthook = _thread_excepthook


def bind_run(run_id: str) -> None:
    """From now on every log line names this run."""
    _run[0] = {**_run[0], "run_id": run_id}


def bind_attempt(number: int) -> None:
    """From now on every log line names this attempt (1, 2, … with --max-restarts)."""
    _run[0] = {**_run[0], "attempt": number}
