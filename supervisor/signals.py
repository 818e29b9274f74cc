"""What each signal means to `supervise serve`, and the one flag a signal handler may set.

=====================================  ==============================================
SIGINT, SIGTERM, SIGHUP                graceful stop: SIGTERM to every rank, kill-grace,
                                       SIGKILL, exit 0 (SIGHUP: the terminal went away)
SIGUSR2, SIGALRM, SIGVTALRM, SIGPROF,  the same graceful stop (their default would kill the
SIGXCPU, SIGXFSZ, SIGPWR               supervisor without a teardown); the log names the signal
a second stop signal, in any state     skip the rest of the grace: SIGKILL now
SIGUSR1                                on-demand soft dump (like `supervise dump`); the run goes on
SIGQUIT                                on-demand dump (waited for at most --dump-timeout), then the
                                       graceful stop (exit 0)
SIGKILL, SIGSTOP                       cannot be caught: the ranks' parent-death signal takes
                                       them down; the next `supervise serve` sweeps the rest
=====================================  ==============================================

A handler only records and posts (``SimpleQueue.put`` is reentrant); it never
takes a lock, so it cannot deadlock against the thread it interrupted (a
``threading.Event.set()`` from a handler can).  ``Hurry`` is the flag a
second stop signal sets: a plain attribute plus a self-pipe, so teardown,
linger and backoff waits see it at once.
"""

from __future__ import annotations

import os
import select
import signal

STOP_SIGNALS = tuple(
    getattr(signal, name)
    for name in (
        "SIGINT",
        "SIGTERM",
        "SIGHUP",
        "SIGUSR2",
        "SIGALRM",
        "SIGVTALRM",
        "SIGPROF",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGPWR",
    )
    if hasattr(signal, name)
)
DUMP_SIGNAL = signal.SIGUSR1
DUMP_THEN_STOP_SIGNAL = signal.SIGQUIT
HANDLED = (*STOP_SIGNALS, DUMP_SIGNAL, DUMP_THEN_STOP_SIGNAL)


class Hurry:
    """Set once from a signal handler; read and waited on anywhere, without locks."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        for fd in (self._r, self._w):
            os.set_blocking(fd, False)
            os.set_inheritable(fd, False)
        self._set = False

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._w, b"!")
        except OSError:  # pipe full: it is readable already
            pass

    def is_set(self) -> bool:
        return self._set

    def fileno(self) -> int:
        """Readable once set: wait for it with select() next to other fds."""
        return self._r

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, waking at once when set; returns whether it is set."""
        if not self._set and timeout > 0:
            select.select([self._r], [], [], timeout)
        return self._set

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
