"""Teardown: leave no process of the run behind.

One scan, pidfds, two deadlines (torchelastic's ``_close`` idea)::

    scan     → ONE walk of /proc for the run marker (it reads environments:
               bounded by procs.MARKER_SCAN_TIMEOUT_S), plus the supervisor's
               descendants and the run's cgroup: every process found is held
               by a verified pidfd from then on
    SIGTERM  → every rank's process group (its leader is our unreaped child:
               ``launch.signal_group``) and, by pidfd, every process held;
               SIGCONT to stopped ones so they can act on it
    wait     → on the pidfds, until all are gone or ``kill_grace`` passed;
               what appeared meanwhile (descendants, cgroup: no second marker
               scan) is signalled and waited for against the same deadline
    SIGKILL  → every group, every process held, the whole cgroup
               (SIGCONT too: a stopped process must run to die)
    confirm  → on the pidfds until KILL_CONFIRM_S after the SIGKILL: the
               exit monitor's reports of the ranks are awaited against the
               same deadline, then ranks and launcher are reaped (by pidfd),
               and every zombie that reparented to us
    verify   → a process still alive (state D: uninterruptible sleep, or a
               frozen cgroup) is reported by pid and state → exit 85; where
               NVML exists, no run process still holds GPU memory.

A process in uninterruptible sleep therefore costs at most one scan timeout
plus KILL_CONFIRM_S beyond the grace.  The kill policy is a parameter
(``KillPolicy``), the clock is time.monotonic.
"""

from __future__ import annotations

import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog

from ..signals import Hurry
from . import pidfds as procs
from . import shm
from .cgroup import RunCgroup
from .exits import ExitStatus
from .pidfds import Pidfd
from .spawn import RankHandle, signal_group

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
    hurry: Hurry | None = None  # set mid-wait (a second stop signal): stop waiting, escalate now


@dataclass
class TeardownResult:
    duration_s: float = 0.0
    escalated: bool = False  # SIGKILL was needed
    killed: list[int] = field(default_factory=list)
    survivors: list[procs.ProcInfo] = field(default_factory=list)
    gpu_holders: list[tuple[int, int, int | None]] = field(default_factory=list)  # (gpu, pid, bytes or unknown)
    gpu_checked: bool = False
    marker_scans: int = 0  # walks of /proc for the run marker (one per teardown)
    statuses: dict[int, ExitStatus] = field(default_factory=dict)  # pid → status of each rank reaped here
    shm_removed: list[str] = field(default_factory=list)  # /dev/shm files the run left, removed (shm.py)

    @property
    def complete(self) -> bool:
        return not self.survivors and not self.gpu_holders


def wait_gone(held: Iterable[Pidfd], deadline: float, hurry: Hurry | None = None) -> list[Pidfd]:
    """Block on the pidfds until every process ended or the deadline; returns those still running.

    A zombie counts as ended (its pidfd is readable)."""
    alive = [p for p in held if not p.exited()]
    while alive:
        left = deadline - time.monotonic()
        if left <= 0 or (hurry is not None and hurry.is_set()):
            break
        # The slice bounds how late we notice a second Ctrl-C (hurry).
        ready, _, _ = select.select(alive, [], [], min(left, _POLL_SLICE_S))
        if ready:
            alive = [p for p in alive if p not in ready]
    return alive


def _signal(leaders: list[RankHandle], held: Iterable[Pidfd], signum: int) -> None:
    for h in leaders:
        signal_group(h, signum)
    for proc in held:
        proc.send(signum)


def teardown(
    ranks: list[RankHandle],
    run_id: str,
    policy: KillPolicy,
    wait_ranks_reported: Callable[[float], bool],
    gpu_holders: Callable[[set[int]], list[tuple[int, int, int | None]]] | None = None,
    cgroup: RunCgroup | None = None,
    keep: Callable[[], Iterable[int]] = tuple,
    shm_seen: Iterable[str] = (),
) -> TeardownResult:
    """Stop every process of the run.

    ``ranks``: the attempt's ranks and launcher, each with the pidfd it was
    held by since its spawn (or claim).  ``wait_ranks_reported(deadline)``
    blocks until the exit monitor reported every rank (it reads their status;
    they are reaped here only afterwards).  With the run's ``cgroup``, its
    members count as the run's too (escapees that scrubbed their environment
    included), and SIGKILL goes to the whole cgroup at once.  ``keep()``: pids
    the orphan reaping must leave alone (other ranks the exit monitor owns).  ``shm_seen``: /dev/shm files the
    run's processes were seen mapping earlier (a worker that died before the teardown maps nothing now)."""
    start = time.monotonic()
    result = TeardownResult()
    # An exited rank still leads its group (its zombie holds the number): its children get the signals too.
    leaders = [h for h in ranks if h.proc is not None and not h.proc.reaped]
    found = procs.RunProcesses(
        run_id,
        cgroup_pids=cgroup.pids if cgroup is not None else None,
        in_cgroup=cgroup.holds if cgroup is not None else None,
    )
    try:
        rank_pids = {h.proc.pid for h in ranks if h.proc is not None}
        found.scan()
        result.marker_scans = found.marker_scans
        # What the run maps in /dev/shm, read while it lives; removed below once nothing of it is left.
        shm_files = set(shm_seen) | shm.inventory(
            [h.proc.pid for h in leaders if h.proc is not None and not h.proc.exited()]
            + [pid for pid, p in found.held.items() if not p.exited()]
        )

        def everyone() -> list[Pidfd]:
            held = [p for pid, p in found.held.items() if pid not in rank_pids]
            return [h.proc for h in leaders if h.proc is not None] + held

        remaining: list[Pidfd] = []
        if not policy.immediate and policy.grace_s > 0:
            deadline = start + policy.grace_s
            batch = everyone()
            while batch:
                _signal(leaders, batch, policy.first_signal)
                # Stopped processes keep SIGTERM pending until they run again.
                _signal(leaders, batch, signal.SIGCONT)
                remaining = wait_gone(everyone(), deadline, policy.hurry)
                if time.monotonic() >= deadline or (policy.hurry is not None and policy.hurry.is_set()):
                    break
                batch = found.refresh()  # a rank forking while dying
        else:
            found.refresh()
            remaining = [p for p in everyone() if not p.exited()]

        confirm_deadline = time.monotonic() + KILL_CONFIRM_S
        if remaining:
            result.escalated = True
            result.killed = sorted({p.pid for p in remaining})
            log.warning("sent SIGKILL", pids=result.killed, grace_s=policy.grace_s)
            batch = everyone()
            while batch:
                _signal(leaders, batch, signal.SIGKILL)
                _signal(leaders, batch, signal.SIGCONT)
                if cgroup is not None:
                    cgroup.kill()
                wait_gone(everyone(), confirm_deadline)
                if time.monotonic() >= confirm_deadline:
                    break
                batch = found.refresh()  # late children of dying processes: one more round
                result.killed = sorted(set(result.killed) | {p.pid for p in batch})

        wait_ranks_reported(confirm_deadline)
        _reap_ranks(ranks, result)
        procs.reap_orphans(set(keep()) | {h.proc.pid for h in ranks if h.proc is not None and not h.proc.reaped})
        for proc in everyone():
            if proc.exited():
                continue
            info = procs.proc_info(proc.pid)
            if info is not None and proc.send(0):
                result.survivors.append(info)
        seen = set(found.held)
        if not result.survivors:
            result.shm_removed = shm.remove(shm_files)
    finally:
        found.close()

    if gpu_holders is not None:
        result.gpu_checked = True
        every_rank = {h.pid for h in ranks}
        check_deadline = time.monotonic() + GPU_RELEASE_S
        while True:
            result.gpu_holders = gpu_holders(seen | every_rank)
            if not result.gpu_holders or time.monotonic() >= check_deadline:
                break
            time.sleep(GPU_POLL_S)
    result.duration_s = time.monotonic() - start
    return result


def _reap_ranks(ranks: list[RankHandle], result: TeardownResult) -> None:
    """Reap every rank and launcher that ended (their groups were signalled for the last time)."""
    for h in ranks:
        proc = h.proc
        if proc is None or proc.reaped or not proc.exited():
            continue
        try:
            status = proc.wait(reap=True)
        except ChildProcessError:
            continue  # not our child: a tree-mode rank whose launcher reaps it
        if status is None:
            continue
        exit_status = ExitStatus.from_waitid(status)
        result.statuses[proc.pid] = exit_status
        if h.popen is not None and h.popen.returncode is None:
            h.popen.returncode = exit_status.returncode  # Popen must never wait on the pid again
