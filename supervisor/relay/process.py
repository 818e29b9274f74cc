"""The relay process, the supervisor's side: the public port, held across every attempt (supervisor/relay/).

Started once per run, before the first attempt, on the node that serves
HTTP; it accepts on the public socket (the built-in engine's
``--host``/``--port``, or a COMMAND's ``--relay``, bound once by ``supervise
serve``) and forwards to rank 0's loopback socket (bound once too, handed to
rank 0 of every attempt) or to the COMMAND's engine's own listener.  It is not a rank: no teardown of
an attempt signals it (``OWN_HELPERS``), it carries no run marker and joins
no run cgroup.  The supervisor's exit monitor watches it by pidfd like any
process of the run; when it dies on its own, the main loop calls ``exited``
(which reaps it and says whether and when to start it again: a bounded
number of times, ``MAX_RESTARTS`` in ``RESTART_WINDOW_S``) and, after that
pause, ``respawn``, on the main thread: the relay's parent-death signal is
tied to the thread that forked it, and the main thread lives as long as the
supervisor (a helper thread that forked it could end before it).  The
public socket stays with the supervisor, so connections wait in its backlog
meanwhile.  At the end of the run ``stop()`` sends SIGTERM (the relay answers
what it still holds with 503s naming the incident), waits ``STOP_S``, then
SIGKILL.  It also ends with the supervisor: parent-death signal, and the end
of its stdin.

What the relay must know of the run goes over its stdin (``tell``: the
incident ruled, the quarantine; the latest notice again to every relay
process started), its counts come back over a pipe made once for the run
(``counts()``: drained without waiting, summed over relay restarts by pid);
supervisor/relay/protocol.py.  Neither side ever waits for the other.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import structlog

from ..processes.listen_socket import ListenSocket
from ..processes.pidfds import OWN_HELPERS, Pidfd, set_parent_death_signal
from ..rank.listen import RELAY_URL_ENV, SUPERVISE_LISTEN_FDS
from .protocol import COUNT_KEYS, GAUGE_KEYS, MODULE, Notice, parse_counts, read_now

log = structlog.get_logger("supervise")

__all__ = ["RELAY_URL_ENV", "RelayProcess"]  # RELAY_URL_ENV: rank 0's ready line names this URL (engine/app.py)

STOP_S = 3.0  # the relay's own drain is 2 s (supervisor/relay/main.py DRAIN_S)
RESTART_PAUSE_S = 0.2
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


def _dies_with_us() -> None:
    """Between fork and exec: the relay never outlives the supervisor, and runs in a process group of its own in
    the supervisor's session (as the ranks, processes/spawn.py: the terminal's Ctrl-C is the supervisor's)."""
    os.setpgid(0, 0)
    set_parent_death_signal(signal.SIGKILL)


class _Counts:
    """The relay's counts as the supervisor sees them: every line of the pipe, summed over relay processes."""

    def __init__(self) -> None:
        self.pid = 0
        self.last: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)  # the current relay process's
        self.base: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)  # earlier relay processes' (restarts)
        self.gauges: dict[str, int] = dict.fromkeys(GAUGE_KEYS, 0)  # the current relay process's
        self._pending = b""  # a line not complete yet

    def take(self, data: bytes) -> None:
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            try:
                pid, values, self.gauges = parse_counts(line)
            except ValueError:
                continue  # not a counts line: the last ones stay
            if pid != self.pid:
                for key in COUNT_KEYS:
                    self.base[key] += self.last[key]
                self.pid = pid
            self.last = values

    def now(self) -> dict[str, int]:
        return {**{key: self.base[key] + self.last[key] for key in COUNT_KEYS}, **self.gauges}


class RelayProcess:
    def __init__(
        self,
        public: ListenSocket,
        upstream: str,
        run_dir: str,
        log_format: str,
        read_timeout: float | None,
        engine: str = "builtin",
        hold_s: float | None = None,
        max_held: int | None = None,
    ):
        self.read_timeout = read_timeout  # the engine's --read-timeout (None: its default)
        self.public = public
        self.upstream = upstream  # HOST:PORT of rank 0's loopback socket, or the URL of a COMMAND's listener
        self.engine = engine  # the relay's adapter (supervisor/relay/engines.py)
        self.hold_s = hold_s
        self.max_held = max_held
        self.run_dir = run_dir
        self.log_format = log_format
        self.proc: subprocess.Popen | None = None
        self.pidfd: Pidfd | None = None  # the current relay process, held for the exit monitor
        self._lock = threading.Lock()  # the process, its stdin and what it is told
        self._stopping = threading.Event()
        self._restarts: list[float] = []
        self._stdin: int | None = None  # the write end of the current relay's stdin (non-blocking)
        self._notice = b""  # the latest notice line (every relay process started is told it)
        self._rest = b""  # what the pipe did not take of a line it took part of (finished before anything else)
        self._next = b""  # the latest notice line, not begun on this relay's stdin
        self._counts_lock = threading.Lock()
        self._counts_read: int | None = None  # the pipe the relay processes' counts come through (the run's)
        self._counts_write: int | None = None  # its write end, handed to every relay process
        self._counts = _Counts()

    # -- the relay's counts ---------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """The relay's counts over the run, every relay process summed: what its pipe holds now, read without
        waiting (a line that does not parse keeps the last counts).  Any thread."""
        with self._counts_lock:
            self._drain_counts()
            return self._counts.now()

    def _drain_counts(self) -> None:
        while self._counts_read is not None:
            data = read_now(self._counts_read)
            if not data:
                return
            self._counts.take(data)

    def _close_counts(self) -> None:
        with self._counts_lock:
            self._drain_counts()  # the last relay process's last line
            for fd in (self._counts_read, self._counts_write):
                if fd is not None:
                    os.close(fd)
            self._counts_read = self._counts_write = None

    # -- what the relay is told ------------------------------------------------------------
    def tell(self, incident: str | None, quarantined: dict[str, list[str]], suspects: list[str]) -> None:
        """The incident ruled now (None: cleared, the next attempt starts) and the quarantine (quarantine.json's
        content).  Never waits for the relay: what its stdin has no room for is written at the next notice."""
        notice = Notice(incident, {fp: tuple(ids) for fp, ids in quarantined.items()}, frozenset(suspects))
        line = notice.line()
        with self._lock:
            if line == self._notice:
                return
            self._notice = self._next = line
            self._flush()

    def _flush(self) -> None:
        """Write what waits, without waiting (held: ``_lock``); a line is finished before the next is begun."""
        while self._stdin is not None and (self._rest or self._next):
            if not self._rest:
                self._rest, self._next = self._next, b""
            try:
                written = os.write(self._stdin, self._rest)
            except BlockingIOError:
                return
            except OSError:  # the relay is gone: its successor is told the latest notice when it starts
                self._rest = self._next = b""
                return
            self._rest = self._rest[written:]

    def _close_stdin(self) -> None:
        """The relay's end of the run (held: ``_lock``): EOF on its stdin."""
        if self._stdin is not None:
            os.close(self._stdin)
            self._stdin = None
        self._rest = self._next = b""

    # -- its life -------------------------------------------------------------------------
    def start(self) -> Pidfd | None:
        """The first relay process (main thread): its pidfd, for the exit monitor."""
        self._counts_read, self._counts_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            return self._spawn()
        except BaseException:
            self._close_counts()
            raise

    def respawn(self) -> Pidfd | None:
        """Start it again after ``exited`` said so (main thread); None when the run is ending or it failed."""
        try:
            return self._spawn()
        except OSError as exc:
            log.error("relay could not be started again", error=repr(exc))
            return None

    def _spawn(self) -> Pidfd | None:
        fd = self.public.fd
        counts_fd = self._counts_write
        assert counts_fd is not None, "start() made the counts pipe"
        env = dict(os.environ, **{SUPERVISE_LISTEN_FDS: str(fd), "SUPERVISE_LOG_FORMAT": self.log_format})
        argv = [sys.executable, "-m", MODULE, "--upstream", self.upstream, "--run-dir", self.run_dir]
        argv += ["--engine", self.engine, "--counts-fd", str(counts_fd)]
        if self.read_timeout is not None:
            argv += ["--read-timeout", repr(self.read_timeout)]
        if self.hold_s is not None:
            argv += ["--hold", repr(self.hold_s)]
        if self.max_held is not None:
            argv += ["--max-held", str(self.max_held)]
        with self._lock:
            if self._stopping.is_set():  # the run ended during the pause before a restart
                return None
            stdin, self._stdin = os.pipe2(os.O_CLOEXEC)
            try:
                self.proc = subprocess.Popen(
                    argv,
                    pass_fds=(fd, counts_fd),
                    stdin=stdin,
                    stdout=sys.stderr,
                    env=env,
                    preexec_fn=_dies_with_us,
                )
            except BaseException:
                self._close_stdin()
                raise
            finally:
                os.close(stdin)
            OWN_HELPERS.add(self.proc.pid)
            # Our unreaped child: its pid cannot change hands before the pidfd is open.
            self.pidfd = Pidfd(self.proc.pid, os.pidfd_open(self.proc.pid), child=True)
            os.set_blocking(self._stdin, False)
            self._rest, self._next = b"", self._notice  # what the run is now, for this relay process
            self._flush()
        log.info(
            "relay started",
            pid=self.proc.pid,
            address=self.public.address,
            upstream=self.upstream,
            engine=self.engine,
        )
        return self.pidfd

    def exited(self, now: float) -> float | None:
        """The relay process died on its own (main thread, told by the exit monitor): reap it; the pause before
        ``respawn``, or None: the run is ending, or it keeps dying (the serving port is closed then)."""
        with self._lock:
            proc, self.proc = self.proc, None
            self._close_stdin()
        if proc is None:
            return None
        code = proc.wait()  # its exit was read: a zombie, reaped at once
        OWN_HELPERS.discard(proc.pid)
        self._close_pidfd()
        if self._stopping.is_set():
            return None
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
        if len(self._restarts) >= MAX_RESTARTS:
            log.error(
                "relay keeps dying: not started again; the serving port is closed (clients are refused)",
                event_name="relay_given_up",
                code=code,
                restarts=len(self._restarts),
            )
            self.public.close()  # refused at once rather than held in a backlog no one reads
            return None
        log.error("relay exited: starting it again", event_name="relay_exited", code=code)
        self._restarts.append(now)
        return RESTART_PAUSE_S

    def _close_pidfd(self) -> None:
        if self.pidfd is not None:
            self.pidfd.close()
            self.pidfd = None

    def stop(self) -> None:
        """EOF on its stdin, SIGTERM, ``STOP_S`` for its 503s, then SIGKILL; its last counts are read then
        (idempotent, never raises)."""
        with self._lock:
            self._stopping.set()
            proc = self.proc
            self._close_stdin()  # the relay's second way to learn the run ends
        if proc is None:
            self._close_counts()
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(1.0)
                except subprocess.TimeoutExpired:
                    log.warning("relay did not end after SIGKILL", pid=proc.pid)
        OWN_HELPERS.discard(proc.pid)
        self._close_pidfd()
        self._close_counts()
