"""Exit monitor: a named thread that blocks on pidfds, reports each exit, reaps orphans.

No sleep-polling for exits: the thread sleeps in ``poll()`` on the pidfds of
every watched process plus a wake-up pipe, so a death is reported the moment
the kernel marks the process exited.

Watched processes (ranks, the launcher, tree-mode ranks) are *not* reaped
here: ``waitid(P_PIDFD, WNOWAIT)`` reads the status (code, signal, core-dump
flag) and leaves the zombie, so the pid, and the process group a rank leads,
cannot be reused until the teardown has signalled that group and reaps it
(``teardown``).  A tree-mode rank is not our child until its launcher dies
and it reparents to us (the subreaper): from then on its exit is read the
same way; before, its status is read from its zombie's ``/proc/<pid>/stat``
if its parent has not reaped it yet, else it is only reported as gone.

Everything else that reparents to the subreaper (a rank's double-forked
children, a dead launcher's workers) is reaped continuously, every
REAP_INTERVAL_S, by pid and never with ``waitpid(-1)``
(``procs.reap_orphans``): a long run collects no zombies.  Processes being
spawned are protected by ``spawning()``: the sweep never runs between a fork
and the ``watch`` of its child.

Cause before consequence: a tree-mode rank dies of its parent-death signal
(SIGKILL) when the thread that started it exits, and a big parent (vLLM's
engine core) takes longer to finish exiting than its child, so the child's
exit can be readable first.  A child killed by SIGKILL whose watched parent is
itself exiting waits for the parent's exit (at most PARENT_WAIT_S) and is
ordered as exits seen together are (``_parents_first``): after a parent killed
by a signal, before a parent that exited on its own (a launcher that returns
after its rank died).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog

from ..events import ProcessExited
from . import pidfds as procs
from .attempt import ENGINE_PROCESS
from .exits import ExitStatus
from .pidfds import Pidfd, named_thread

log = structlog.get_logger("supervise.monitor")

THREAD_JOIN_S = 2.0
ERROR_BACKOFF_S = 0.05  # after a failed pass, before the next (never a busy loop)
# How often zombies that reparented to us are looked for (bounds how long one stays a zombie).
REAP_INTERVAL_S = 0.25
# How long a SIGKILLed child's exit waits for the exit of its parent, which was seen exiting (bounds the delay
# of the report when the parent's exit is slow or the parent only lost a thread).
PARENT_WAIT_S = 2.0


@dataclass
class _Watch:
    key: object
    proc: Pidfd
    attempt: int
    parent: int | None = None  # pid of the watched process that started it (tree mode), if any


@dataclass
class _Held:
    """An exit read and not reported yet: it waits for its parent's (``_waits_for_parent``)."""

    watch: _Watch
    status: ExitStatus | None
    at: float
    until: float


class ExitMonitor:
    def __init__(self, post: Callable[[ProcessExited], None]):
        self._post = post
        self._lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}  # fd → watch, until the exit is reported
        self._kept: dict[int, Pidfd] = {}  # pid → watched process, until its owner released it
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = False
        self._thread = named_thread(self._run, "exit-monitor")
        self._exited = threading.Condition(self._lock)
        self._pending: set[object] = set()
        self._reap_lock = threading.Lock()  # held by a sweep, and from a fork until its watch
        self._next_sweep = 0.0
        self._held: list[_Held] = []  # monitor thread only
        self.orphans_reaped = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake()
        self._thread.join(timeout=THREAD_JOIN_S)
        with self._lock:
            self._watches.clear()
            self._kept.clear()
        self._held.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """Around a spawn and the ``watch`` of its child: no sweep can reap it in between."""
        with self._reap_lock:
            yield

    def watch(self, key: object, proc: Pidfd, attempt: int = 0, parent: int | None = None) -> None:
        """Report the end of ``proc`` (the caller owns the pidfd; ``release`` it once reaped).  ``parent``: the
        pid of a watched process that started it, whose exit is reported first when both die of one kill."""
        with self._lock:
            self._watches[proc.fd] = _Watch(key, proc, attempt, parent)
            self._kept[proc.pid] = proc
            self._pending.add(key)
        self._wake()

    def release(self, procs_: list[Pidfd]) -> None:
        """The owner reaped (or gave up on) these: forget them before it closes their pidfds."""
        with self._exited:
            for proc in procs_:
                w = self._watches.pop(proc.fd, None)
                if w is not None:
                    self._pending.discard(w.key)
                if self._kept.get(proc.pid) is proc:
                    del self._kept[proc.pid]
            self._exited.notify_all()
        self._wake()

    def kept_pids(self) -> set[int]:
        """Pids whose status belongs to the monitor's owner (never reaped as orphans)."""
        with self._lock:
            return set(self._kept)

    def wait_all_exited(self, keys: set[object], deadline: float) -> bool:
        """Block until every one of ``keys`` was reported, or the deadline passes."""
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
        held = {h.watch.proc.fd for h in self._held}  # read already: polled again, they would spin the loop
        with self._lock:
            fds = [fd for fd in self._watches if fd not in held]
        for fd in fds:
            poller.register(fd, select.POLLIN)
        wake_at = min([self._next_sweep] + [h.until for h in self._held])
        timeout_ms = max(0.0, wake_at - time.monotonic()) * 1000
        ready = []
        for fd, _ev in poller.poll(timeout_ms):
            if fd == self._wake_r:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            ready.append(fd)
        seen = [e for e in (self._read(fd) for fd in ready) if e is not None]
        for w, status, at in sorted(seen, key=_parents_first):
            if self._waits_for_parent(w, status):
                self._held.append(_Held(w, status, at, time.monotonic() + PARENT_WAIT_S))
                log.debug("exit held for its parent", pid=w.proc.pid, parent=w.parent)
                continue
            if status is not None and status.signal is None:
                self._report_held(of_parent=w.proc.pid)  # it exited on its own, after them: theirs come first
            self._report(w, status, at)
        self._report_held()
        if time.monotonic() >= self._next_sweep and not self._stop:
            self._sweep()
            self._next_sweep = time.monotonic() + REAP_INTERVAL_S

    def _sweep(self) -> None:
        with self._reap_lock:
            reaped = procs.reap_orphans(self.kept_pids())
        if reaped:
            self.orphans_reaped += reaped
            log.debug("reaped orphans", count=reaped, total=self.orphans_reaped)

    def _read(self, fd: int) -> tuple[_Watch, ExitStatus | None, float] | None:
        """A readable pidfd: its process's exit status (None: not ours to read, or reaped already) and when."""
        with self._lock:
            w = self._watches.get(fd)
        if w is None:
            return None
        status = None
        try:
            result = w.proc.wait(reap=False)  # the zombie stays: its pid is the teardown's to release
        except ChildProcessError:
            # Not our child (a tree-mode rank its launcher reaps): its status, while its parent has not reaped
            # it yet; this thread wakes the moment it exits, and a parent in Python takes longer.
            wait_status = procs.zombie_wait_status(w.proc.pid)
            status = ExitStatus.from_wait_status(wait_status) if wait_status is not None else None
        else:
            if result is not None:
                status = ExitStatus.from_waitid(result)
            elif not procs.is_gone(w.proc.pid):
                return None  # a spurious wake-up
        return w, status, time.monotonic()

    def _waits_for_parent(self, w: _Watch, status: ExitStatus | None) -> bool:
        """Killed by SIGKILL (or its status is gone) while the watched process that started it is exiting: the
        parent-death signal, most likely; the parent's exit is the cause and is reported first."""
        if w.parent is None or (status is not None and status.signal != signal.SIGKILL):
            return False
        with self._lock:
            parent_watched = any(other.proc.pid == w.parent for other in self._watches.values())
        return parent_watched and procs.is_exiting(w.parent)

    def _report_held(self, of_parent: int | None = None) -> None:
        """Held exits whose parent was reported (or released), or whose wait is over; with ``of_parent``, those
        of that parent now."""
        if not self._held:
            return
        with self._lock:
            current = dict(self._watches)
        watched = {w.proc.pid for w in current.values()}
        now = time.monotonic()
        still = []
        for h in self._held:
            if current.get(h.watch.proc.fd) is not h.watch:
                continue  # released by its owner meanwhile (a teardown): nothing to report
            if h.watch.parent != of_parent and h.watch.parent in watched and now < h.until:
                still.append(h)
            else:
                self._report(h.watch, h.status, h.at)
        self._held = still

    def _report(self, w: _Watch, status: ExitStatus | None, at: float) -> None:
        with self._exited:
            self._watches.pop(w.proc.fd, None)
            self._pending.discard(w.key)
            self._exited.notify_all()
        self._post(ProcessExited(w.key, w.proc.pid, status, at, w.attempt))


def _parents_first(seen: tuple[_Watch, ExitStatus | None, float]) -> tuple[int, int]:
    """Exits seen in one wake-up are reported killed parents first.  A tree-mode rank dies of its parent-death
    signal (SIGKILL) as its parent exits, so both are readable together, and the parent's exit is the first
    failure: processes killed by a signal (or whose status is gone) before those that exited on their own (a
    launcher that returns after its child died is a consequence), and among them the launcher, then the
    processes between it and the ranks (vLLM's EngineCore), then the ranks."""
    w, status, _at = seen
    on_its_own = status is not None and status.signal is None
    if not isinstance(w.key, tuple):
        depth = 0  # the launcher
    else:
        depth = 1 if w.key[0] == ENGINE_PROCESS else 2
    return int(on_its_own), depth
