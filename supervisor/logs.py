"""structlog set-up: rich console lines for people, one JSON object per line for machines."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "console", level: int = logging.INFO, stream=None) -> None:
    stream = stream or sys.stderr
    shared = [
        structlog.contextvars.merge_contextvars,
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
        processors = shared + [structlog.dev.ConsoleRenderer(colors=colors, pad_event=40)]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def bind(**values) -> None:
    """Fields every subsequent line carries (run_id, node)."""
    structlog.contextvars.bind_contextvars(**values)
