"""The ranks' stdout and stderr: pipes read by one pump thread, as torchrun tees them.

Every rank (and the tree-mode launcher) writes to two pipes; the ``rank-output``
thread reads them all with one ``selectors`` loop, non-blocking, and for each
stream, in this order:

* keeps the last ``TAIL_BYTES`` of stderr in memory (the ``rank_exit`` bundle's
  ``logs/rank-<r>.txt`` and the traceback its verdict quotes);
* appends the raw bytes to ``--log-dir``'s file for the stream, when the stream
  goes to a file (``--redirects``/``--tee``): private, never through a symlink,
  never outside the directory, rotated at ``--log-max-bytes`` (``rank_logs.py``);
  a file refused or failing is dropped with one log line, the stream goes on;
* forwards whole lines to the console, unless redirected or filtered out
  (``--local-ranks-filter``): console log format, ``[rank<N>]:<line>`` on the
  supervisor's stdout (rank stdout) or stderr (rank stderr), queued with the
  log lines to that stream's writer (``logs.write``: when the supervisor's
  reader is slow, this thread and then the rank wait, never the supervisor's
  decisions), so a log line and a rank line never share a line; JSON log
  format, one ``rank_output`` log record per line, so nothing raw reaches the
  supervisor's streams.

A partial line (no newline yet: a prompt, a progress bar redrawn with ``\\r``)
is forwarded once its stream has been idle ``PARTIAL_IDLE_S``, once its first
byte is ``PARTIAL_MAX_AGE_S`` old, or at ``LINE_CAP`` bytes.  Of a line redrawn
with ``\\r``, only what a terminal would show (the text after the last ``\\r``)
is forwarded.  Bytes that are not UTF-8 are replaced, never fatal.

The supervisor never waits on a rank's output: the main thread only creates
the pipes (``open``) and hands their read ends over (``RankStreams.started``);
log files are opened and written on the pump thread; ``close`` joins it at most
``JOIN_S``.  A stream is closed at EOF, when the same rank is started again
(a restart: nothing accumulates across ``--max-restarts``) or at ``close``.

Output routing is process-wide, like the log configuration: the CLI installs
one pump for the run (``installed``), ``launch.spawn`` and the incident desk
use it; without one (a benchmark spawning ranks directly), ranks inherit the
supervisor's stdout and stderr as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import selectors
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import structlog

from .. import logs
from ..spec import OutputOptions
from .pidfds import named_thread
from .rank_logs import Closer, LogFile, LogPath, LogRefused

log = structlog.get_logger("supervise.output")

TAIL_BYTES = 64 * 1024  # of each rank's stderr, for its rank_exit bundle
READ_BYTES = 64 * 1024  # one read per stream per pass: a chatty rank cannot starve the others
LINE_CAP = 16 * 1024  # a longer line is forwarded in pieces
PARTIAL_IDLE_S = 0.2
PARTIAL_MAX_AGE_S = 1.0
SELECT_IDLE_S = 0.5
JOIN_S = 0.5  # close(): the pump's final drain and join, at most
FINAL_DRAIN_S = 0.2  # of JOIN_S: reading what the ranks left in their pipes
ERROR_PAUSE_S = 0.05  # after a failed pass, so a persistent failure cannot spin
STREAMS = ("stdout", "stderr")
# Lines a rank-side engine adapter prints (rank/engines/): each logged once per run as the event of that name.
ADAPTER_UNAVAILABLE = "supervise: engine_adapter_unavailable"
ADAPTER_UNCHECKED = "supervise: engine_adapter_unchecked"


@dataclass(frozen=True)
class Source:
    """Whose output: a rank (global and local rank), or the tree-mode launcher (both None)."""

    rank: int | None = None
    local_rank: int | None = None

    @property
    def label(self) -> str:
        return "launcher" if self.rank is None else f"rank{self.rank}"

    @property
    def dir_name(self) -> str:
        return "launcher" if self.rank is None else str(self.rank)


def visible(segment: bytes) -> str:
    """What a terminal shows of one line: the text after the last carriage return, decoded leniently."""
    segment = segment.rstrip(b"\r")
    cut = segment.rfind(b"\r")
    if cut >= 0:
        segment = segment[cut + 1 :]
    return segment.decode("utf-8", "replace")


class _Stream:
    """One pipe of one source; touched only by the pump thread (``drained`` and ``tail`` by anyone)."""

    def __init__(self, source: Source, name: str, fd: int, console: bool, log_path: LogPath | None):
        self.source = source
        self.name = name
        self.fd = fd
        self.console = console
        self.log_path = log_path
        self.log: LogFile | None = None
        self.partial = bytearray()
        self.partial_since = 0.0  # monotonic time of the partial line's first byte
        self.last_data = 0.0
        self.continued = False  # a partial line was forwarded: a newline right after it ends that line
        self.drained = threading.Event()  # EOF seen (or the stream was closed)
        self._tail = bytearray()
        self._tail_lock = threading.Lock()

    def keep_tail(self, data: bytes) -> None:
        with self._tail_lock:
            self._tail += data
            if len(self._tail) > TAIL_BYTES:
                del self._tail[: len(self._tail) - TAIL_BYTES]

    def tail(self) -> bytes:
        with self._tail_lock:
            return bytes(self._tail)


class StderrTail:
    """A rank's stderr as the pump keeps it: read from a dump thread, never blocking long."""

    def __init__(self, stream: _Stream):
        self._stream = stream

    def wait_drained(self, timeout_s: float) -> bool:
        """True once the pump saw EOF (everything the rank wrote is in ``text``)."""
        return self._stream.drained.wait(max(0.0, timeout_s))

    def drained(self) -> bool:
        """``wait_drained`` without the wait (the main loop looks again later)."""
        return self._stream.drained.is_set()

    def data(self) -> bytes:
        return self._stream.tail()


@dataclass
class RankStreams:
    """The pipes of one process being started: give ``stdout``/``stderr`` to Popen, then call
    ``started`` (or ``abandon`` if it failed)."""

    pump: RankOutput
    source: Source
    stdout: int
    stderr: int
    _read_ends: tuple[int, int]

    def started(self) -> None:
        """The child has its ends: close ours (else EOF never comes) and let the pump read."""
        os.close(self.stdout)
        os.close(self.stderr)
        self.pump._adopt(self.source, self._read_ends)

    def abandon(self) -> None:
        for fd in (self.stdout, self.stderr, *self._read_ends):
            with contextlib.suppress(OSError):
                os.close(fd)


class RankOutput:
    """The output pump of one supervisor run."""

    def __init__(
        self,
        options: OutputOptions,
        log_format: str = "console",
        console_out: IO[str] | None = None,
        console_err: IO[str] | None = None,
    ):
        self.options = options
        self.json = log_format == "json"
        self._rank_log = logs.rank_output_logger()
        self._adapter_lines: set[str] = set()
        self._console = {"stdout": console_out or sys.stdout, "stderr": console_err or sys.stderr}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()  # (source, streams) from the main thread
        self._streams: dict[int, _Stream] = {}  # fd → stream; pump thread only
        self._latest: dict[tuple[Source, str], _Stream] = {}  # the newest stream of each source; any thread reads
        self._attempts: dict[Source, int] = {}  # how often each source was started (main thread)
        self._run_ids: dict[Source, str] = {}
        self._stop = threading.Event()
        self._failed_once = False
        self._closer = Closer()  # rotated files are closed off the pump thread
        self._thread = named_thread(self._run, "rank-output")
        self._thread.start()

    # ------------------------------------------------------------ main thread
    def open(self, source: Source, run_id: str) -> RankStreams:
        """Two pipes for a process about to start; its attempt number counts its starts (attempt_0 first)."""
        out_r, out_w = os.pipe()
        try:
            err_r, err_w = os.pipe()
        except OSError:
            for fd in (out_r, out_w):
                os.close(fd)
            raise
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        self._run_ids[source] = run_id
        return RankStreams(self, source, out_w, err_w, (out_r, err_r))

    def _adopt(self, source: Source, read_ends: tuple[int, int]) -> None:
        attempt = self._attempts.get(source, -1) + 1
        self._attempts[source] = attempt
        streams = []
        for name, fd in zip(STREAMS, read_ends, strict=True):
            log_path, console = self._route(source, name, attempt)
            stream = _Stream(source, name, fd, console, log_path)
            self._latest[(source, name)] = stream
            streams.append(stream)
        self._incoming.put(streams)
        self._wake()

    def _route(self, source: Source, name: str, attempt: int) -> tuple[LogPath | None, bool]:
        to_file, to_console = self.options.route(source.local_rank, name)
        path = None
        if to_file and self.options.log_dir is not None:
            path = LogPath(self.options.log_dir, self._run_ids.get(source, "run"), attempt, source.dir_name, name)
        return path, to_console

    def stderr_tail(self, rank: int | None) -> StderrTail | None:
        """The newest stderr stream of a rank (None: the launcher), as a reader for a dump thread."""
        for (source, name), stream in list(self._latest.items()):
            if name == "stderr" and source.rank == rank:
                return StderrTail(stream)
        return None

    def close(self, join_s: float = JOIN_S) -> None:
        """Stop the pump: forward what is buffered, close every pipe and file.  Waits at most ``join_s``."""
        self._stop.set()
        self._wake()
        deadline = time.monotonic() + max(0.0, join_s)
        self._thread.join(max(0.0, join_s))
        if self._thread.is_alive():
            log.warning("rank output pump did not stop in time; leaving it (a daemon thread)", waited_s=join_s)
            return
        self._closer.stop(deadline - time.monotonic())  # a file still closing on a slow disk is left to it
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (already woken) or closed
            os.write(self._wake_w, b"x")

    # ------------------------------------------------------------ pump thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._pass()
            except Exception:
                self._fail_once("rank output pump pass failed; still running")
                time.sleep(ERROR_PAUSE_S)
        try:
            self._final_drain(time.monotonic() + FINAL_DRAIN_S)
        except Exception:
            self._fail_once("rank output pump: final drain failed")
        for stream in list(self._streams.values()):
            self._close_stream(stream)
        with contextlib.suppress(Exception):
            self._selector.close()

    def _fail_once(self, message: str) -> None:
        if not self._failed_once:
            self._failed_once = True
            log.exception(message, event_name="rank_output_pump_failed")

    def _pass(self) -> None:
        self._take_incoming()
        ready = self._selector.select(self._select_timeout(time.monotonic()))
        for key, _mask in ready:
            if key.fd == self._wake_r:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
                continue
            stream = self._streams.get(key.fd)
            if stream is not None:
                self._read(stream)
        self._flush_due(time.monotonic())

    def _take_incoming(self) -> None:
        while True:
            try:
                streams = self._incoming.get_nowait()
            except queue.Empty:
                return
            for stream in streams:
                # The same rank started again: its previous pipes (a survivor may hold them) go now.
                for old in [s for s in self._streams.values() if s.source == stream.source and s.name == stream.name]:
                    self._close_stream(old)
                self._open_file(stream)
                self._streams[stream.fd] = stream
                self._selector.register(stream.fd, selectors.EVENT_READ, None)

    def _open_file(self, stream: _Stream) -> None:
        if stream.log_path is None:
            return
        try:
            stream.log = LogFile(stream.log_path, self.options.log_max_bytes, self._closer)
        except LogRefused as exc:
            self._refused(stream, exc)
        except OSError as exc:
            log.error(
                "rank log file not opened: that stream goes on without it",
                path=str(stream.log_path),
                error=exc.strerror or repr(exc),
            )

    def _refused(self, stream: _Stream, exc: LogRefused) -> None:
        log.warning(
            "rank log file refused: a link or a name that leads elsewhere is not followed; "
            "that stream goes on without it",
            path=str(stream.log_path),
            reason=str(exc),
        )
        self._close_file(stream)

    def _select_timeout(self, now: float) -> float:
        timeout = SELECT_IDLE_S
        for stream in self._streams.values():
            if stream.partial:
                due = min(stream.last_data + PARTIAL_IDLE_S, stream.partial_since + PARTIAL_MAX_AGE_S)
                timeout = min(timeout, max(0.0, due - now))
        return timeout

    def _read(self, stream: _Stream) -> None:
        try:
            data = os.read(stream.fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno == errno.EINTR:
                return
            data = b""  # EIO or the like: treat as the end of the stream
        if not data:
            self._eof(stream)
            return
        self._feed(stream, data)

    def _feed(self, stream: _Stream, data: bytes) -> None:
        now = time.monotonic()
        if stream.name == "stderr":
            stream.keep_tail(data)
        if stream.log is not None:
            try:
                stream.log.write(data)
            except LogRefused as exc:  # planted at the path while the file was rotated
                self._refused(stream, exc)
            except OSError as exc:
                log.error(
                    "rank log file write failed: that stream goes on without it",
                    path=str(stream.log_path),
                    error=exc.strerror or repr(exc),
                )
                self._close_file(stream)
        if not stream.console:
            return
        if not stream.partial:
            stream.partial_since = now
        stream.last_data = now
        stream.partial += data
        lines = []
        cut = stream.partial.rfind(b"\n")
        if cut >= 0:
            lines = bytes(stream.partial[:cut]).split(b"\n")
            del stream.partial[: cut + 1]
            stream.partial_since = now
            if stream.continued and not lines[0].strip(b"\r"):
                lines.pop(0)  # the newline that ends a line already forwarded in part
        stream.continued = False
        while len(stream.partial) >= LINE_CAP:
            lines.append(bytes(stream.partial[:LINE_CAP]))
            del stream.partial[:LINE_CAP]
        if lines:
            self._forward(stream, [visible(line) for line in lines])

    def _flush_due(self, now: float) -> None:
        for stream in self._streams.values():
            if stream.partial and (
                now - stream.last_data >= PARTIAL_IDLE_S or now - stream.partial_since >= PARTIAL_MAX_AGE_S
            ):
                self._flush_partial(stream)

    def _flush_partial(self, stream: _Stream) -> None:
        if stream.partial:
            text = visible(bytes(stream.partial))
            stream.partial.clear()
            stream.continued = True
            self._forward(stream, [text])

    def _forward(self, stream: _Stream, lines: list[str]) -> None:
        source = stream.source
        for line in lines:
            if line.startswith("supervise: engine_adapter_") and line not in self._adapter_lines:
                # A rank-side engine adapter met a version it does not know (rank/engines/): once per run.
                self._adapter_lines.add(line)
                if line.startswith(ADAPTER_UNAVAILABLE):
                    log.warning(
                        "engine adapter not installed: " + line[len(ADAPTER_UNAVAILABLE) :].strip(),
                        event_name="engine_adapter_unavailable",
                    )
                elif line.startswith(ADAPTER_UNCHECKED):
                    log.warning(
                        "engine release outside the adapter's checked releases: "
                        + line[len(ADAPTER_UNCHECKED) :].strip(),
                        event_name="engine_adapter_unchecked",
                    )
        if self.json:
            ids = {"launcher": True} if source.rank is None else {"rank": source.rank, "local_rank": source.local_rank}
            for line in lines:
                self._rank_log.info("rank_output", **ids, stream=stream.name, message=line)
            return
        prefix = f"[{source.label}]:"
        text = "".join(f"{prefix}{line}\n" for line in lines)
        logs.write(self._console[stream.name], text, wait=True)  # waits for room as the rank would

    def _eof(self, stream: _Stream) -> None:
        self._flush_partial(stream)
        self._close_stream(stream)

    def _final_drain(self, deadline: float) -> None:
        """At close: what the ranks left in their pipes, read until empty or the deadline."""
        self._take_incoming()
        for stream in list(self._streams.values()):
            while stream.fd in self._streams and time.monotonic() < deadline:
                try:
                    data = os.read(stream.fd, READ_BYTES)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    data = b""
                if not data:
                    self._eof(stream)
                    break
                self._feed(stream, data)
            self._flush_partial(stream)

    def _close_stream(self, stream: _Stream) -> None:
        if self._streams.pop(stream.fd, None) is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(stream.fd)
            with contextlib.suppress(OSError):
                os.close(stream.fd)
        self._close_file(stream)
        stream.drained.set()

    def _close_file(self, stream: _Stream) -> None:
        if stream.log is not None:
            stream.log.close()
            stream.log = None


# ---------------------------------------------------------------- the run's pump
_installed: list[RankOutput] = []


def installed() -> RankOutput | None:
    """The pump of this supervisor process, if the CLI installed one."""
    return _installed[-1] if _installed else None


@contextlib.contextmanager
def install(options: OutputOptions, log_format: str) -> Iterator[RankOutput]:
    """Route the ranks' output through one pump for the duration of the run; closed (bounded) after."""
    pump = RankOutput(options, log_format)
    _installed.append(pump)
    try:
        yield pump
    finally:
        _installed.remove(pump)
        pump.close()
