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

A reader that stops (a terminal paused, a pipe to a log agent that fell behind)
never stops the supervisor: lines to its own stdout and stderr are queued by
the thread that formats them and written by one daemon thread per stream
(``Sink``).  The ranks' lines wait for room (the ranks block on their output as
they would without us); the supervisor's own lines never wait: past
``SINK_MAX_BYTES`` they are dropped and counted, and a ``log_lines_dropped``
line says how many whenever the queue has room again (docs/logs.md).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import select
import sys
import threading
import time
from collections import deque
from types import FrameType
from typing import IO

import structlog
from structlog.stdlib import ProcessorFormatter
from structlog.typing import EventDict, Processor, WrappedLogger

from tp_supervise.dumps.render import plain

#: The keys every JSON line starts with, in this order.
HEAD_KEYS = ("message", "level", "timestamp", "logger", "event")
LIBRARY_EVENT = "library_log"
WARNING_EVENT = "python_warning"
UNFORMATTABLE_EVENT = "log_record_unformattable"  # a record logging could not format (``_Handler.handleError``)
_WARNINGS_LOGGER = "py.warnings"
_HEADLINE_END = re.compile(r"[:;(]")
_NOT_NAME = re.compile(r"[^a-z0-9]+")
_SKIPPED_MODULES = ("structlog", "logging")

# What every line names (run id, attempt): replaced whole, never changed in place, so a thread that is
# logging while the main thread binds a new attempt iterates a dict that does not change under it.
_run: list[dict[str, object]] = [{}]


#: Characters of lines that may wait for a slow reader of one of our streams before the supervisor's own lines
#: are dropped.  The ranks' lines wait at ``RANK_SHARE`` of it, so the supervisor's own always find room.
SINK_MAX_BYTES = 4 << 20
RANK_SHARE = 0.75
#: At exit, how long what is queued may take to reach a reader that is slow (one that reads nothing loses it).
DRAIN_AT_EXIT_S = 2.0


class Sink:
    """The writer of one of the supervisor's output descriptors (stdout, stderr, or both when they are the
    same file: ``2>&1``, a pipe to a log agent): any thread queues whole lines with ``put``, one daemon thread
    writes them, whole lines per write (at most ``PIPE_BUF`` bytes a write when they fit, so another writer of
    the same pipe cannot cut one), and no caller waits for the reader unless it asks to (``wait``: the ranks'
    lines, which wait as the ranks would without us)."""

    def __init__(self, stream: IO[str], fd: int):
        self.fd = fd
        self._encoding = getattr(stream, "encoding", None) or "utf-8"
        self._cond = threading.Condition()
        self._lines: deque[str] = deque()
        self._queued = 0  # characters queued or being written
        self._dropped = 0  # lines not queued since the last report
        self._broken = False  # the descriptor failed (closed reader): nothing more is written
        self._reporting = False  # a log_lines_dropped line is being logged (drain waits for it too)
        self._thread: threading.Thread | None = None

    def put(self, text: str, wait: bool = False) -> bool:
        """Queue ``text`` (whole lines); False when it was dropped (no room and not ``wait``, or a broken stream)."""
        size = len(text)
        with self._cond:
            if wait:
                limit = SINK_MAX_BYTES * RANK_SHARE
                while self._queued and self._queued + size > limit and not self._broken:
                    self._cond.wait()
            elif self._queued and self._queued + size > SINK_MAX_BYTES:
                self._dropped += 1
                return False
            if self._broken:
                return False
            self._lines.append(text)
            self._queued += size
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"output-fd{self.fd}", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def drain(self, timeout: float) -> bool:
        """Wait until everything queued was written, at most ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._broken or not (self._queued or self._reporting), timeout)

    def _run(self) -> None:
        try:
            while self._pass():
                pass
        except BaseException:  # whatever failed, nothing waits for this thread any more
            with self._cond:
                self._break()
                self._cond.notify_all()
            raise

    def _break(self) -> None:
        """Nothing more is written (held: ``_cond``)."""
        self._broken, self._queued = True, 0
        self._lines.clear()

    def _pass(self) -> bool:
        """Write what is queued; False once the descriptor failed."""
        with self._cond:
            while not self._lines:
                self._cond.wait()
            lines = list(self._lines)
            self._lines.clear()
        written = self._write(lines)
        with self._cond:
            self._queued -= sum(map(len, lines))
            if not written:
                self._break()
            dropped = 0
            if self._dropped and self._queued <= SINK_MAX_BYTES // 2:  # room again: say what was lost
                dropped, self._dropped, self._reporting = self._dropped, 0, True
            self._cond.notify_all()
        if dropped:
            try:
                structlog.get_logger("supervise.output").warning(
                    f"{dropped} log lines dropped: fd {self.fd} was not read fast enough",
                    event_name="log_lines_dropped",
                    lines=dropped,
                    fd=self.fd,
                )
            finally:
                with self._cond:
                    self._reporting = False
                    self._cond.notify_all()
        return written

    def _write(self, lines: list[str]) -> bool:
        chunk = bytearray()
        for text in lines:
            data = text.encode(self._encoding, "backslashreplace")
            if chunk and len(chunk) + len(data) > select.PIPE_BUF:
                if not self._write_all(chunk):
                    return False
                chunk.clear()
            chunk += data
        return not chunk or self._write_all(chunk)

    def _write_all(self, data: bytearray) -> bool:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except BlockingIOError:  # a descriptor someone made non-blocking: wait for room
                select.select([], [self.fd], [], 1.0)
            except OSError:  # EPIPE, EBADF: no reader any more
                return False
        return True


_sinks: dict[int, Sink] = {}
_sinks_lock = threading.Lock()


def _same_file(a: int, b: int) -> bool:
    try:
        return os.path.samestat(os.fstat(a), os.fstat(b))
    except OSError:
        return False


def sink_for(stream: IO[str]) -> Sink | None:
    """The ``Sink`` of ``stream`` when it is this process's stdout or stderr descriptor (one for both when
    they are the same file); None for any other stream (a test's file or StringIO), which its callers write
    directly."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    if fd not in (1, 2):
        return None
    with _sinks_lock:
        sink = _sinks.get(fd)
        if sink is None:
            other = _sinks.get(3 - fd)
            sink = _sinks[fd] = other if other is not None and _same_file(1, 2) else Sink(stream, fd)
        return sink


def drain(timeout: float = DRAIN_AT_EXIT_S) -> None:
    """Let what is queued for stdout and stderr be written, at most ``timeout`` seconds in all (at exit)."""
    deadline = time.monotonic() + timeout
    with _sinks_lock:
        sinks = {id(sink): sink for sink in _sinks.values()}.values()
    for sink in sinks:
        sink.drain(max(0.0, deadline - time.monotonic()))


atexit.register(drain)


def write(stream: IO[str], text: str, wait: bool = False) -> None:
    """Whole lines for ``stream`` beside the log lines: queued to its ``Sink`` when it is our stdout or stderr
    (``wait``: for room, as a rank's lines do), else written at once under the lock of the log handler that
    writes to the same stream, so the two never share a line."""
    sink = sink_for(stream)
    handler = None
    if sink is None:
        handler = next(
            (h for h in logging.getLogger().handlers if isinstance(h, _Handler) and h.stream is stream), None
        )
    _put(stream, sink, handler.lock if handler is not None else None, text, wait)


def _put(stream: IO[str], sink: Sink | None, lock: threading.RLock | None, text: str, wait: bool) -> None:
    """``text`` to its stream's ``sink``, or, for a stream without one, written at once under ``lock``."""
    if sink is not None:
        sink.put(text, wait=wait)
        return
    with lock if lock is not None else contextlib.nullcontext():
        stream.write(text)
        stream.flush()


class _Handler(logging.Handler):
    """The root logger's handler: a record is formatted on the thread that logged it and queued to the
    stream's ``Sink``; a rank's line (``RANK_OUTPUT_LOGGER``) waits for room, no other line ever waits."""

    def __init__(self, stream: IO[str]):
        super().__init__()
        self.stream = stream
        self.sink = sink_for(stream)

    def handle(self, record: logging.LogRecord) -> bool:
        # Not under the handler's lock: a rank's line waiting for room must not hold up another thread's line.
        if not self.filter(record):
            return False
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record) + "\n"
        except Exception:
            self.handleError(record)
            return
        _put(self.stream, self.sink, self.lock, text, wait=record.name == RANK_OUTPUT_LOGGER)

    def handleError(self, record: logging.LogRecord) -> None:
        """A record that could not be formatted (say a library's ``%d`` given a string): one line of ours in the
        run's format, through the sink like any other, instead of logging's traceback written straight to
        stderr, which a reader that stopped would make this thread wait for."""
        exc = sys.exc_info()[1]
        where = f"{record.name} at {record.pathname}:{record.lineno}"
        try:
            message = f"a log record could not be formatted: {type(exc).__name__}: {exc} ({where}: {record.msg!r})"
        except Exception:  # the record's own msg cannot be shown either
            message = f"a log record could not be formatted ({where})"
        line = logging.makeLogRecord(
            {
                "name": __name__,
                "levelno": logging.ERROR,
                "levelname": "ERROR",
                "msg": message,
                "event_name": UNFORMATTABLE_EVENT,
            }
        )
        try:
            text = self.format(line) + "\n"
        except Exception:
            text = message + "\n"
        _put(self.stream, self.sink, self.lock, text, wait=False)


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
    named = getattr(record, "event_name", None)  # a record of our own made without structlog (handleError's)
    event["event"] = named or (WARNING_EVENT if record.name == _WARNINGS_LOGGER else LIBRARY_EVENT)
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
    handler = _Handler(stream)
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
