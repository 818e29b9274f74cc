"""Teardown: leave no process of the run behind.

One shared deadline for every process (torchelastic's ``_close`` idea)::

    SIGTERM  → every rank's process group, every other process of the run;
               SIGCONT to stopped ones so they can act on it
    wait     → until all are gone or ``kill_grace`` passed (blocking on pidfds)
    SIGKILL  → every group and every process of the run still there
               (SIGCONT too: a stopped process must run to die)
    reap     → ranks by the exit monitor, reparented orphans here
    verify   → nothing of the run remains; a survivor (state D: stuck in
               uninterruptible sleep) is reported by pid and state → exit 85;
               where NVML exists, no run process still holds GPU memory.

The kill policy is a parameter (``KillPolicy``), the clock is time.monotonic.
"""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import structlog

from . import procs
from .cgroup import RunCgroup
from .launch import RankHandle, signal_group
from .signals import Hurry

log = structlog.get_logger("supervise.teardown")

# How long SIGKILLed processes get to disappear before they count as survivors.
# SIGKILL is not catchable; only a process in uninterruptible sleep (D) or a
# kernel problem can outlast this.
KILL_CONFIRM_S = 2.0
# How long to wait for GPU memory of killed processes to be released.
GPU_RELEASE_S = 5.0
GPU_POLL_S = 0.2
_POLL_SLICE_S = 0.05


@dataclass(frozen=True)
class KillPolicy:
    grace_s: float
    first_signal: int = signal.SIGTERM
    immediate: bool = False  # second Ctrl-C: skip straight to SIGKILL
    hurry: "Hurry | None" = None  # set mid-wait (a second stop signal): stop waiting, escalate now


@dataclass
class TeardownResult:
    duration_s: float = 0.0
    escalated: bool = False  # SIGKILL was needed
    killed: list[int] = field(default_factory=list)
    survivors: list[procs.ProcInfo] = field(default_factory=list)
    gpu_holders: list[tuple[int, int, int]] = field(default_factory=list)  # (gpu, pid, bytes)
    gpu_checked: bool = False

    @property
    def complete(self) -> bool:
        return not self.survivors and not self.gpu_holders


def _signal_all(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def wait_gone(pids: set[int], deadline: float, hurry: "Hurry | None" = None) -> set[int]:
    """Block until every pid is gone or the deadline; returns those still alive.

    Uses pidfds (readable when the process exits); zombies count as gone.
    """
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except (ProcessLookupError, OSError):
            pass
    alive = {pid for pid in fds.values()}
    try:
        while alive:
            left = deadline - time.monotonic()
            if left <= 0 or (hurry is not None and hurry.is_set()):
                break
            poller = select.poll()
            for fd, pid in fds.items():
                if pid in alive:
                    poller.register(fd, select.POLLIN)
            # The slice bounds how late we notice a second Ctrl-C (hurry) or a
            # process that ended without its pidfd waking us (already reaped).
            for fd, _ev in poller.poll(min(left, _POLL_SLICE_S) * 1000):
                alive.discard(fds[fd])
            alive = {pid for pid in alive if not procs.is_gone(pid)}
    finally:
        for fd in fds:
            os.close(fd)
    return alive


def teardown(
    ranks: list[RankHandle],
    run_id: str,
    policy: KillPolicy,
    wait_ranks_reaped: Callable[[float], bool],
    gpu_holders: Callable[[set[int]], list[tuple[int, int, int]]] | None = None,
    extra_pids: Iterable[int] = (),
    cgroup: RunCgroup | None = None,
) -> TeardownResult:
    """Stop every process of the run.  ``wait_ranks_reaped(deadline)`` blocks
    until the exit monitor reaped every rank (it owns their exit status).
    With the run's ``cgroup``, its members count as the run's too (escapees
    that scrubbed their environment included), and SIGKILL goes to the
    whole cgroup at once."""
    start = time.monotonic()
    result = TeardownResult()
    seen: set[int] = set(extra_pids)
    rank_pids = {h.pid for h in ranks}

    def everyone() -> set[int]:
        live = procs.run_processes(run_id)
        if cgroup is not None:
            live |= cgroup.pids()
        seen.update(live)
        live |= {h.pid for h in ranks if h.alive}
        return {pid for pid in live if not procs.is_gone(pid)}

    if not policy.immediate and policy.grace_s > 0:
        targets = everyone()
        for h in ranks:
            if h.alive:
                signal_group(h.pid, policy.first_signal)
        _signal_all(targets, policy.first_signal)
        # Stopped processes keep SIGTERM pending until they run again.
        for h in ranks:
            if h.alive:
                signal_group(h.pid, signal.SIGCONT)
        _signal_all(targets, signal.SIGCONT)
        deadline = start + policy.grace_s
        remaining = wait_gone(targets, deadline, policy.hurry)
        # New processes may have appeared (a rank forking while dying).
        remaining |= everyone()
        if remaining:
            remaining = wait_gone(remaining, deadline, policy.hurry)
    else:
        remaining = everyone()

    if remaining:
        result.escalated = True
        result.killed = sorted(remaining)
        for h in ranks:
            if h.alive:
                signal_group(h.pid, signal.SIGKILL)
        _signal_all(remaining, signal.SIGKILL)
        _signal_all(remaining, signal.SIGCONT)
        if cgroup is not None:
            cgroup.kill()
        log.warning("sent SIGKILL", pids=result.killed, grace_s=policy.grace_s)

    confirm_deadline = time.monotonic() + KILL_CONFIRM_S
    leftover = wait_gone(everyone(), confirm_deadline) if remaining else everyone()
    if leftover:
        # Late children of dying processes: one more SIGKILL round.
        if cgroup is not None:
            cgroup.kill()
        _signal_all(leftover, signal.SIGKILL)
        leftover = wait_gone(leftover, confirm_deadline)
    wait_ranks_reaped(time.monotonic() + KILL_CONFIRM_S)
    procs.reap_children(exclude=rank_pids)
    for pid in sorted(leftover):
        info = procs.proc_info(pid)
        if info is not None and info.state not in ("Z", "X"):
            result.survivors.append(info)

    if gpu_holders is not None:
        result.gpu_checked = True
        check_deadline = time.monotonic() + GPU_RELEASE_S
        while True:
            result.gpu_holders = gpu_holders(seen | rank_pids)
            if not result.gpu_holders or time.monotonic() >= check_deadline:
                break
            time.sleep(GPU_POLL_S)
    result.duration_s = time.monotonic() - start
    return result
