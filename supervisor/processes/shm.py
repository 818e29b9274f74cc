"""Shared-memory files the run's processes leave in /dev/shm: found while they live, removed once they are gone.

Engines create POSIX shared memory for their own transports and do not always
remove it: vLLM's CPU build leaves its shm all-reduce buffers
(``vllm_dist_<id>-tp:0-[0-1]-cpushm_<r>``) after a Ctrl-C even without us, and
a worker killed in a teardown never runs its destructors.  The teardown reads
which /dev/shm files the run's processes map (``/proc/<pid>/maps``) before it
signals them, and removes those files once no process of the run is left.
Reading another process's maps takes its mmap lock, so the inventory runs on a
worker thread with a deadline (``INVENTORY_TIMEOUT_S``): a rank stuck in
uninterruptible sleep costs that deadline, never the teardown.  Only regular
files directly in /dev/shm owned by our user are removed, never through a
symlink.

Names a process of the run registered with multiprocessing's resource
tracker (named semaphores ``sem.mp-*``, shared memory) are the run's too,
mapped or not: the hook notes each in the run's folder
(``rank.autohook.patch_resource_tracker``; ``registered``), since a teardown
that SIGKILLs kills the tracker before it can unlink them.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterable

import structlog

from ..rank.runtime import REGISTERED_SHM_FILE

log = structlog.get_logger("supervise.shm")

SHM_DIR = "/dev/shm"
INVENTORY_TIMEOUT_S = 0.5
OWN_PREFIX = "tp-supervise"  # our own run files (heartbeat segment, ...): the run's owner removes them


def _mapped_shm(pid: int) -> set[str]:
    out: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.rstrip("\n").partition(f" {SHM_DIR}/")[2]
                if path:
                    name = path.removesuffix(" (deleted)")
                    if "/" not in name and not path.endswith(" (deleted)"):
                        out.add(name)
    except OSError:
        pass
    return out


def _note_mapped(pids: list[int], found: set[str], lock: threading.Lock) -> None:
    """Add each process's mapped names to ``found`` as soon as they are read (a slow reader keeps what it read)."""
    for pid in pids:
        names = _mapped_shm(pid)
        with lock:
            found.update(names)


def inventory(pids: Iterable[int], timeout: float = INVENTORY_TIMEOUT_S) -> set[str]:
    """Names of the /dev/shm files ``pids`` map now (what a slow reader found by the deadline)."""
    found: set[str] = set()
    lock = threading.Lock()
    pids = list(pids)
    thread = threading.Thread(target=_note_mapped, args=(pids, found, lock), name="shm-inventory", daemon=True)
    thread.start()
    thread.join(timeout)
    with lock:
        return set(found)


class Watch:
    """What one attempt's processes map in /dev/shm, looked at now and then while they run (``look``), each look
    on its own daemon thread (never the caller's: reading a process's maps takes its mmap lock); a
    worker that dies before the teardown (an engine core's death takes its workers) maps nothing by then, so
    the teardown removes what was ``seen`` besides what it finds itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._busy = False

    def look(self, pids: Iterable[int]) -> None:
        with self._lock:
            if self._busy:
                return
            self._busy = True
        pids = list(pids)

        def run() -> None:
            # No deadline here (this thread is the deadline's reason): each process's names count as soon as they
            # are read. On a loaded host a look at every process took past INVENTORY_TIMEOUT_S, and a deadline
            # threw away what it had read.
            try:
                _note_mapped(pids, self._seen, self._lock)
            finally:
                with self._lock:
                    self._busy = False

        threading.Thread(target=run, name="shm-watch", daemon=True).start()

    def seen(self) -> set[str]:
        with self._lock:
            return set(self._seen)


REGISTERED_MAX_BYTES = 1 << 20


def registered(run_dir: str | os.PathLike) -> set[str]:
    """The /dev/shm names of what the run's processes registered with the resource tracker: a semaphore ``/mp-x``
    is ``sem.mp-x``, shared memory ``/psm_x`` is ``psm_x``.  Bounded read; anything odd is skipped."""
    out: set[str] = set()
    try:
        with open(os.path.join(run_dir, REGISTERED_SHM_FILE), "rb") as f:
            data = f.read(REGISTERED_MAX_BYTES)
    except OSError:
        return out
    for line in data.decode(errors="replace").splitlines():
        rtype, _, name = line.partition(" ")
        name = name.lstrip("/")
        if not name or "/" in name or name in (".", ".."):
            continue
        if rtype == "semaphore":
            out.add(f"sem.{name}")
        elif rtype == "shared_memory":
            out.add(name)
    return out


def remove(names: Iterable[str], keep: Iterable[str] = ()) -> list[str]:
    """Unlink each regular /dev/shm file in ``names`` that is ours (same uid), except ``keep``; returns those."""
    removed: list[str] = []
    skip = set(keep) | _mapped_shm(os.getpid())  # the supervisor's own segments (heartbeats, rings) stay
    try:
        fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return removed
    try:
        for name in sorted(set(names) - skip):
            if name.startswith(OWN_PREFIX):
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    continue
                os.unlink(name, dir_fd=fd)
                removed.append(name)
            except OSError:
                continue
    finally:
        os.close(fd)
    if removed:
        log.info("removed shared memory the run left", event_name="shm_removed", files=removed)
    return removed
