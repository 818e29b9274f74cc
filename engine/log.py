"""Engine logs: one structured line per event on stderr, through the stdlib's ``logging``.

The engine runs inside the rank processes, where tp-supervise is a guest:
no logging library of the supervisor's is loaded there.  Call sites read
like structlog's (``log.warning("request refused", request_id=..., error=...)``);
``SUPERVISE_LOG_FORMAT=json`` (set by ``supervise serve --log-format json``)
renders one JSON object per line with ``timestamp``, ``level``, ``event``,
``rank`` and the fields; otherwise a console line
``<timestamp> [<level>] <event> key=value ...``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

ENV_FORMAT = "SUPERVISE_LOG_FORMAT"
LOGGER_NAME = "tp_supervise.engine"


def _timestamp(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1e6):06d}Z"


class _Formatter(logging.Formatter):
    def __init__(self, as_json: bool, rank: int):
        super().__init__()
        self.as_json = as_json
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {})
        level = record.levelname.lower()
        if self.as_json:
            return json.dumps(
                {
                    "timestamp": _timestamp(record.created),
                    "level": level,
                    "event": record.getMessage(),
                    "rank": self.rank,
                    **fields,
                },
                default=repr,
            )
        text = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in fields.items())
        return f"{_timestamp(record.created)} [{level:<8}] {record.getMessage():<30} {text} rank={self.rank}"


class Log:
    """``log.info(event, **fields)``, as the engine's modules call it."""

    def __init__(self, logger: logging.Logger):
        self._logger = logger

    def _emit(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if self._logger.isEnabledFor(level):
            self._logger.log(level, event, extra={"fields": fields})

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields)


def get_logger() -> Log:
    return Log(logging.getLogger(LOGGER_NAME))


def configure(rank: int, environ=os.environ) -> None:
    """Send the engine's events to stderr in the format the supervisor asked for (once per process)."""
    logger = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(environ.get(ENV_FORMAT) == "json", rank))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
