"""The relay process, the supervisor's side: the public port, held across every attempt (supervisor/relay/).

Started once per run, before the first attempt, on the node that serves
HTTP; it accepts on the public socket (the built-in engine's
``--host``/``--port``, or a COMMAND's ``--relay``, bound once by ``supervise
serve``) and forwards to rank 0's loopback socket (bound once too, handed to
rank 0 of every attempt) or to the COMMAND's engine's own listener.  It is not a rank: no teardown of
an attempt signals it (``OWN_HELPERS``), it carries no run marker and joins
no run cgroup.  If it dies on its own, it is started again at once (a
bounded number of times: ``MAX_RESTARTS`` in ``RESTART_WINDOW_S``); the
public socket stays with the supervisor, so connections wait in its backlog
meanwhile.  At the end of the run ``stop()`` sends SIGTERM (the relay answers
what it still holds with 503s naming the incident), waits ``STOP_S``, then
SIGKILL.  It also ends with the supervisor: parent-death signal, and the end
of its stdin.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import structlog

from ..processes.listen_socket import ListenSocket
from ..processes.pidfds import OWN_HELPERS, named_thread, set_parent_death_signal
from ..rank.listen import RELAY_URL_ENV, SUPERVISE_LISTEN_FDS
from .protocol import COUNT_KEYS, COUNTS_FILE, GAUGE_KEYS, MODULE

log = structlog.get_logger("supervise")

__all__ = ["RELAY_URL_ENV", "RelayProcess"]  # RELAY_URL_ENV: rank 0's ready line names this URL (engine/app.py)

STOP_S = 3.0  # the relay's own drain is 2 s (supervisor/relay/main.py DRAIN_S)
RESTART_PAUSE_S = 0.2
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


def _dies_with_us() -> None:
    """Between fork and exec: the relay never outlives the supervisor (as the ranks, processes/spawn.py)."""
    set_parent_death_signal(signal.SIGKILL)


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
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._restarts: list[float] = []
        self._watcher: threading.Thread | None = None
        self._counts_stamp: tuple[int, int] | None = None  # (mtime_ns, size) of the file last read
        self._counts_pid = 0
        self._counts_lock = threading.Lock()
        self._counts_last: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)  # the current relay process's
        self._counts_base: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)  # earlier relay processes' (restarts)
        self._gauges: dict[str, int] = dict.fromkeys(GAUGE_KEYS, 0)  # the current relay process's

    def counts(self) -> dict[str, int]:
        """The relay's counts over the run, every relay process summed (tmpfs: one stat, a read when changed).
        A file that does not parse keeps the last counts.  Any thread."""
        with self._counts_lock:
            return self._read_counts()

    def _read_counts(self) -> dict[str, int]:
        path = os.path.join(self.run_dir, COUNTS_FILE)
        try:
            st = os.stat(path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._counts_stamp:
                self._counts_stamp = stamp
                with open(path, "rb") as f:
                    data = json.loads(f.read(4096))
                pid = int(data["pid"])
                values = {key: max(0, int(data.get(key, 0))) for key in COUNT_KEYS}
                self._gauges = {key: max(0, int(data.get(key, 0))) for key in GAUGE_KEYS}
                if pid != self._counts_pid:
                    for key in COUNT_KEYS:
                        self._counts_base[key] += self._counts_last[key]
                    self._counts_pid = pid
                self._counts_last = values
        except (OSError, ValueError, KeyError, TypeError):
            pass
        counts = {key: self._counts_base[key] + self._counts_last[key] for key in COUNT_KEYS}
        return {**counts, **self._gauges}

    def start(self) -> None:
        self._spawn()
        self._watcher = named_thread(self._watch, "relay")
        self._watcher.start()

    def _spawn(self) -> None:
        fd = self.public.fd
        env = dict(os.environ, **{SUPERVISE_LISTEN_FDS: str(fd), "SUPERVISE_LOG_FORMAT": self.log_format})
        argv = [sys.executable, "-m", MODULE, "--upstream", self.upstream, "--run-dir", self.run_dir]
        argv += ["--engine", self.engine]
        if self.read_timeout is not None:
            argv += ["--read-timeout", repr(self.read_timeout)]
        if self.hold_s is not None:
            argv += ["--hold", repr(self.hold_s)]
        if self.max_held is not None:
            argv += ["--max-held", str(self.max_held)]
        with self._lock:
            if self._stopping.is_set():  # stop() ran while the watcher was about to start it again
                return
            self.proc = subprocess.Popen(
                argv,
                pass_fds=(fd,),
                stdin=subprocess.PIPE,
                stdout=sys.stderr,
                env=env,
                start_new_session=True,
                preexec_fn=_dies_with_us,
            )
            OWN_HELPERS.add(self.proc.pid)
        log.info(
            "relay started",
            pid=self.proc.pid,
            address=self.public.address,
            upstream=self.upstream,
            engine=self.engine,
        )

    def _watch(self) -> None:
        while not self._stopping.is_set():
            proc = self.proc
            if proc is None:
                return
            code = proc.wait()
            OWN_HELPERS.discard(proc.pid)
            if self._stopping.is_set():
                return
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
            if len(self._restarts) >= MAX_RESTARTS:
                log.error(
                    "relay keeps dying: not started again; the serving port is closed (clients are refused)",
                    event_name="relay_given_up",
                    code=code,
                    restarts=len(self._restarts),
                )
                self.public.close()  # refused at once rather than held in a backlog no one reads
                return
            log.error("relay exited: starting it again", event_name="relay_exited", code=code)
            self._restarts.append(now)
            if self._stopping.wait(RESTART_PAUSE_S):
                return
            try:
                self._spawn()
            except OSError as exc:
                log.error("relay could not be started again", error=repr(exc))
                return

    def stop(self) -> None:
        """SIGTERM, ``STOP_S`` for its 503s, then SIGKILL (idempotent, never raises)."""
        with self._lock:
            self._stopping.set()
            proc = self.proc
        if proc is None:
            return
        if proc.stdin is not None:
            try:
                proc.stdin.close()  # the relay's second way to learn the run ends
            except OSError:
                pass
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
