"""structlog set-up: rich console lines for people, one JSON object per line for machines."""

from __future__ import annotations

import logging
import sys

import structlog

from tp_supervise.dumps.render import plain


_run: dict[str, str] = {}


def _add_run_id(_logger, _method, event: dict) -> dict:
    """Every line of every thread carries the run id (contextvars do not
    cross into the supervisor's threads)."""
    if _run:
        event.setdefault("run_id", _run["run_id"])
    return event


def _visible_controls(_logger, _method, event: dict) -> dict:
    """Console lines: text from ranks (verdicts, collective names) cannot drive the terminal.

    Control characters other than newline and tab are shown as escapes; the
    JSON renderer escapes them by itself.
    """
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = plain(value)
    return event


def configure(fmt: str = "console", level: int = logging.INFO, stream=None) -> None:
    stream = stream or sys.stderr
    shared = [
        structlog.contextvars.merge_contextvars,
        _add_run_id,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        processors = shared + [
            structlog.processors.format_exc_info,
            structlog.processors.EventRenamer("event"),
            structlog.processors.JSONRenderer(sort_keys=False),
        ]
    else:
        colors = stream.isatty()
        processors = shared + [_visible_controls, structlog.dev.ConsoleRenderer(colors=colors, pad_event=40)]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def bind_run(run_id: str) -> None:
    """From now on every log line names this run."""
    _run["run_id"] = run_id
