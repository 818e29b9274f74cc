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
    def __init__(self, as_json: bool, rank: int, logger: str | None = None):
        super().__init__()
        self.as_json = as_json
        self.rank = rank
        self.logger = logger

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {})
        level = record.levelname.lower()
        text = record.getMessage()
        if self.as_json and self.logger is not None:  # not a rank: the supervisor's own record shape
            head = {"message": text, "level": level, "timestamp": _timestamp(record.created), "logger": self.logger}
            return json.dumps({**head, "event": "_".join(text.split()), **fields}, default=repr)
        if self.as_json:
            return json.dumps(
                {"timestamp": _timestamp(record.created), "level": level, "event": text, "rank": self.rank, **fields},
                default=repr,
            )
        values = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in fields.items())
        who = f"rank={self.rank}" if self.logger is None else f"logger={self.logger}"
        return f"{_timestamp(record.created)} [{level:<8}] {text:<30} {values} {who}"


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


def configure(rank: int, environ=os.environ, process: str | None = None) -> None:
    """Send the engine's events to stderr in the format the supervisor asked for (once per process).

    ``process``: a process of the run that is not a rank (the supervisor's relay, supervisor/relay/) writes
    straight to the supervisor's stderr, so its JSON records take the supervisor's shape (message, level,
    timestamp, logger ``process``, event: the message in snake case; docs/logs.md).
    """
    logger = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(environ.get(ENV_FORMAT) == "json", rank, process))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


class OneLineHttpLog(logging.LoggerAdapter):
    """aiohttp's server logger: a protocol error becomes one structured line with the peer, no traceback."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})

    def exception(self, msg, *args, exc_info=None, **_kw) -> None:
        peer = args[0] if args else None
        error = f"{type(exc_info).__name__}: {exc_info}" if isinstance(exc_info, BaseException) else str(msg)
        get_logger().warning("http protocol error", peer=str(peer), error=" ".join(error.split())[:300])

    def error(self, msg, *args, **kw) -> None:
        self.exception(msg, *args, **kw)
