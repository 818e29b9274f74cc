"""Exit monitor: a named thread that blocks on pidfds and reports each exit.

No sleep-polling: the thread sleeps in ``poll()`` on the pidfds of every
watched process plus a wake-up pipe, so a death is reported the moment the
kernel marks the process exited.  Our own children are reaped here with
``waitid(P_PIDFD)`` (which gives code, signal and core-dump flag); processes
that are not our children (tree-mode ranks) are only reported as gone.
"""

from __future__ import annotations

import os
import select
import threading
import time
from dataclasses import dataclass
from typing import Callable

import structlog

from . import procs
from .exits import ExitStatus

log = structlog.get_logger("supervise.monitor")

THREAD_JOIN_S = 2.0
ERROR_BACKOFF_S = 0.05  # after a failed pass, before the next (never a busy loop)


@dataclass(frozen=True)
class ProcessExited:
    """Event: a watched process ended.  ``status`` is None for non-children."""

    key: object
    pid: int
    status: ExitStatus | None
    at: float


@dataclass
class _Watch:
    key: object
    pid: int
    fd: int
    child: bool


class ExitMonitor:
    def __init__(self, post: Callable[[ProcessExited], None]):
        self._post = post
        self._lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="exit-monitor", daemon=True)
        self._exited = threading.Condition(self._lock)
        self._pending: set[object] = set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake()
        self._thread.join(timeout=THREAD_JOIN_S)
        with self._lock:
            for w in self._watches.values():
                os.close(w.fd)
            self._watches.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def watch(self, key: object, pid: int, pidfd: int | None = None, child: bool = True) -> bool:
        """Watch ``pid`` (pass the pidfd of a child started by us)."""
        if pidfd is None:
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._post(ProcessExited(key, pid, None, time.monotonic()))
                return False
        with self._lock:
            self._watches[pidfd] = _Watch(key, pid, pidfd, child)
            self._pending.add(key)
        self._wake()
        return True

    def wait_all_exited(self, keys: set[object], deadline: float) -> bool:
        """Block until none of ``keys`` is still watched, or the deadline passes."""
        with self._exited:
            while self._pending & keys:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._exited.wait(left)
            return True

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _run(self) -> None:
        while not self._stop:
            try:
                self._pass()
            except Exception as exc:  # a monitor never dies of one bad pass
                log.error("exit monitor pass failed", error=repr(exc))
                time.sleep(ERROR_BACKOFF_S)

    def _pass(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        with self._lock:
            fds = list(self._watches)
        for fd in fds:
            poller.register(fd, select.POLLIN)
        for fd, _ev in poller.poll():
            if fd == self._wake_r:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            self._handle(fd)

    def _handle(self, fd: int) -> None:
        with self._lock:
            w = self._watches.get(fd)
        if w is None:
            return
        status = None
        if w.child:
            try:
                result = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                result = None
            if result is None:
                # Readable but not reapable: someone else reaped it, or a
                # spurious wake-up; confirm with the process state.
                if not procs.is_gone(w.pid):
                    return
            else:
                status = ExitStatus.from_waitid(result)
        at = time.monotonic()
        with self._exited:
            self._watches.pop(fd, None)
            self._pending.discard(w.key)
            self._exited.notify_all()
        os.close(fd)
        self._post(ProcessExited(w.key, w.pid, status, at))
