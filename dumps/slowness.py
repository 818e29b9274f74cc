"""Why a rank is slow, as the kernel counts it: CPU time, context switches, run-queue delay, cgroup throttling.

Evidence for a straggler bundle (``watchdogs/straggler.py`` names the rank;
this says what the operating system did to it).  Two readings a window
apart, their difference, and the difference in words::

    before = read_slowness(pid)          # SlownessSample
    ...                                  # the window (a second or more)
    delta = slowness_delta(before, read_slowness(pid))
    fragment = explain(delta)            # "its CPU was throttled by its cgroup for 38 % of the window"
    why = explain_straggler(delta, 0.62)  # a straggler's (its group waited 62 % of the time for it): a cause only
                                          # where one accounts for that, else "the rank itself is slow"

What is read, for the whole process (every thread of it, at most
``MAX_THREADS``):

* ``/proc/<pid>/stat``: user + system CPU time (clock ticks, all threads);
* ``/proc/<pid>/task/<tid>/status``: voluntary and involuntary context
  switches (the process's own ``status`` counts its main thread only);
* ``/proc/<pid>/task/<tid>/schedstat``: time on a CPU and time waiting
  for one on a run queue (nanoseconds; needs ``CONFIG_SCHED_INFO``, which
  distribution kernels have), summed and per thread;
* the cgroup's ``cpu.stat``, cgroup v1, under the ``cpu`` controller's
  mount (``/proc/<pid>/cgroup``'s ``cpu`` line joined to that mount from
  ``/proc/self/mountinfo``): ``nr_periods``, ``nr_throttled``,
  ``throttled_time`` (ns); cgroup v2 (the ``0::`` line, a ``cgroup2``
  mount): ``nr_periods``, ``nr_throttled``, ``throttled_usec``.  A cgroup is
  shared by every process in it: throttling is the cgroup's.

A throttled thread is runnable and waits on the run queue: the contention
the sentence names is the run-queue delay beyond the throttled time, of the
thread that waited longest (every runnable thread of a throttled process
waits through the same throttled time: their sum would count it once per
thread).

**What accounts for a straggler.**  ``explain_straggler(delta, lateness)``, with
the share of the group's time its peers spent waiting for the rank over the
same window, names a counter as the cause only when the time it measures is
at least ``ACCOUNTS_FOR`` (half) of that share: throttled 40 % of the window
accounts for a rank the group waited for 60 % of its time; a run-queue delay
of 20 % on a shared 2-core host does not account for a rank that sleeps
300 ms per step (62 %).  When nothing does, it says so and that the rank
itself is slow (its stack, in the same bundle, shows where).

Every read is a small ``/proc`` or ``/sys/fs/cgroup`` file (at most
``READ_LIMIT`` bytes), none of which waits on the process; any error leaves
that field ``None``.  Nothing here raises.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

READ_LIMIT = 64 * 1024
MAX_THREADS = 1024
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_NS = 1e9
# Thresholds of the sentence: below them the kernel's counts are not worth a word.
THROTTLED_NOTABLE = 0.05  # of the window
RUNQ_NOTABLE = 0.10  # of the window, summed over the threads
INVOLUNTARY_NOTABLE = 100.0  # preemptions per second
ACCOUNTS_FOR = 0.5  # a counter is a straggler's cause when its time is at least this part of the group's waiting


@dataclass(frozen=True)
class CgroupCpu:
    """A cgroup's CPU throttling counters (``cpu.stat``)."""

    version: int  # 1 or 2
    path: str  # the cgroup's directory
    nr_periods: int
    nr_throttled: int
    throttled_s: float


@dataclass(frozen=True)
class SlownessSample:
    """One reading of a process; ``None`` where that counter could not be read."""

    pid: int
    at: float  # time.monotonic() of the reading
    cpu_s: float | None
    voluntary: int | None
    involuntary: int | None
    run_s: float | None  # on a CPU (schedstat)
    runq_s: float | None  # waiting for a CPU on a run queue (schedstat), summed over the threads
    threads: int
    cgroup: CgroupCpu | None
    thread_runq: tuple[tuple[int, float], ...] = ()  # (tid, runq_s) of each thread read


@dataclass(frozen=True)
class SlownessDelta:
    """What happened to the process between two readings."""

    pid: int
    window_s: float
    cpu_s: float | None
    voluntary: int | None
    involuntary: int | None
    runq_s: float | None
    nr_periods: int | None
    nr_throttled: int | None
    throttled_s: float | None
    cgroup_path: str | None
    runq_thread_s: float | None = None  # the run-queue delay of the thread that waited longest (None: unknown)

    @property
    def cpu_share(self) -> float | None:
        return self.cpu_s / self.window_s if self.cpu_s is not None else None

    @property
    def runq_share(self) -> float | None:
        return self.runq_s / self.window_s if self.runq_s is not None else None

    @property
    def throttled_share(self) -> float | None:
        return min(1.0, self.throttled_s / self.window_s) if self.throttled_s is not None else None

    @property
    def contention_share(self) -> float | None:
        """Run-queue delay not explained by the cgroup's throttling (a throttled thread is runnable and
        waits on the run queue too): other processes on its CPUs.  Of the thread that waited longest where
        the threads were read one by one (the throttled time is the cgroup's, once), else of their sum."""
        runq = self.runq_thread_s if self.runq_thread_s is not None else self.runq_s
        if runq is None:
            return None
        return max(0.0, runq - (self.throttled_s or 0.0)) / self.window_s

    def to_dict(self) -> dict:
        return {
            "pid": self.pid,
            "window_seconds": self.window_s,
            "cpu_seconds": self.cpu_s,
            "cpu_share": self.cpu_share,
            "voluntary_context_switches": self.voluntary,
            "involuntary_context_switches": self.involuntary,
            "run_queue_seconds": self.runq_s,
            "run_queue_share": self.runq_share,
            "run_queue_thread_seconds": self.runq_thread_s,
            "contention_share": self.contention_share,
            "cgroup": self.cgroup_path,
            "cgroup_periods": self.nr_periods,
            "cgroup_throttled_periods": self.nr_throttled,
            "cgroup_throttled_seconds": self.throttled_s,
            "cgroup_throttled_share": self.throttled_share,
            "explanation": explain(self),
        }


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, READ_LIMIT).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _cpu_s(pid: int) -> float | None:
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    try:
        fields = text[text.rindex(")") + 2 :].split()  # comm may hold spaces and parentheses
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (ValueError, IndexError):
        return None


def _threads(pid: int) -> list[str]:
    try:
        return sorted(os.listdir(f"/proc/{pid}/task"))[:MAX_THREADS]
    except OSError:
        return []


def _switches(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    voluntary = involuntary = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "voluntary_ctxt_switches":
            voluntary = int(value)
        elif key == "nonvoluntary_ctxt_switches":
            involuntary = int(value)
    return (voluntary, involuntary) if voluntary is not None and involuntary is not None else None


def _schedstat(text: str | None) -> tuple[int, int] | None:
    try:
        run, wait, *_ = (text or "").split()
        return int(run), int(wait)
    except ValueError:
        return None


def _cgroup_dir(pid: int) -> tuple[int, str] | None:
    """(version, directory) of the cgroup that accounts ``pid``'s CPU: v1's ``cpu`` controller, else v2."""
    lines = _read(f"/proc/{pid}/cgroup")
    mounts = _read("/proc/self/mountinfo")
    if lines is None or mounts is None:
        return None
    v1 = v2 = None
    for line in lines.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    for line in mounts.splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        root, point = fields[3], fields[4]
        if v1 is not None and rest[0] == "cgroup" and "cpu" in rest[2].split(","):
            return 1, _join(point, root, v1)
        if v1 is None and v2 is not None and rest[0] == "cgroup2":
            return 2, _join(point, root, v2)
    return None


def _join(mount_point: str, mount_root: str, path: str) -> str:
    """The directory of cgroup ``path`` under a mount of the hierarchy's ``mount_root`` (a container
    mounts its own cgroup as the root: its paths are below it)."""
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root) :]
    return os.path.join(mount_point, path.lstrip("/"))


def read_cgroup_cpu(pid: int) -> CgroupCpu | None:
    """The throttling counters of the cgroup that accounts ``pid``'s CPU (None: unknown, or no ``cpu.stat``)."""
    found = _cgroup_dir(pid)
    if found is None:
        return None
    version, directory = found
    text = _read(os.path.join(directory, "cpu.stat"))
    if text is None:
        return None
    stats = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            stats[key] = int(value)
        except ValueError:
            continue
    try:
        if version == 1:
            throttled = stats["throttled_time"] / _NS
        else:
            throttled = stats["throttled_usec"] / 1e6
        return CgroupCpu(version, directory, stats.get("nr_periods", 0), stats.get("nr_throttled", 0), throttled)
    except KeyError:  # a cgroup without CPU bandwidth control (v2 without the cpu controller enabled)
        return None


def read_slowness(pid: int) -> SlownessSample:
    """One reading of every counter of ``pid`` (fields ``None`` where unknown: a process that is gone)."""
    at = time.monotonic()
    voluntary = involuntary = 0
    run = wait = 0
    switches_ok = sched_ok = False
    tids = _threads(pid)
    per_thread = []
    for tid in tids:
        sw = _switches(_read(f"/proc/{pid}/task/{tid}/status"))
        if sw is not None:
            voluntary += sw[0]
            involuntary += sw[1]
            switches_ok = True
        st = _schedstat(_read(f"/proc/{pid}/task/{tid}/schedstat"))
        if st is not None:
            run += st[0]
            wait += st[1]
            sched_ok = True
            per_thread.append((int(tid), st[1] / _NS))
    return SlownessSample(
        pid=pid,
        at=at,
        cpu_s=_cpu_s(pid),
        voluntary=voluntary if switches_ok else None,
        involuntary=involuntary if switches_ok else None,
        run_s=run / _NS if sched_ok else None,
        runq_s=wait / _NS if sched_ok else None,
        threads=len(tids),
        cgroup=read_cgroup_cpu(pid),
        thread_runq=tuple(per_thread),
    )


def _diff(after, before):
    if after is None or before is None:
        return None
    return max(after - before, 0)  # threads that ended take their counts with them: never negative


def slowness_delta(before: SlownessSample, after: SlownessSample) -> SlownessDelta | None:
    """``after - before`` (None when they are not two readings of one process in time order)."""
    window = after.at - before.at
    if before.pid != after.pid or window <= 0:
        return None
    cg_before, cg_after = before.cgroup, after.cgroup
    periods = throttled_periods = throttled = None
    if cg_before is not None and cg_after is not None and cg_before.path == cg_after.path:
        periods = _diff(cg_after.nr_periods, cg_before.nr_periods)
        throttled_periods = _diff(cg_after.nr_throttled, cg_before.nr_throttled)
        throttled = _diff(cg_after.throttled_s, cg_before.throttled_s)
    return SlownessDelta(
        pid=after.pid,
        window_s=window,
        cpu_s=_diff(after.cpu_s, before.cpu_s),
        voluntary=_diff(after.voluntary, before.voluntary),
        involuntary=_diff(after.involuntary, before.involuntary),
        runq_s=_diff(after.runq_s, before.runq_s),
        nr_periods=periods,
        nr_throttled=throttled_periods,
        throttled_s=throttled,
        cgroup_path=cg_after.path if cg_after is not None else None,
        runq_thread_s=_longest_wait(before.thread_runq, after.thread_runq),
    )


def _longest_wait(before: tuple[tuple[int, float], ...], after: tuple[tuple[int, float], ...]) -> float | None:
    """The largest run-queue delay one thread had between the readings (threads in both; None: none was)."""
    then = dict(before)
    waits = [max(0.0, runq - then[tid]) for tid, runq in after if tid in then]
    return max(waits) if waits else None


def explain(delta: SlownessDelta | None) -> str:
    """What the counters say, as a fragment to append to a verdict ("" when nothing is notable).

    "its CPU was throttled by its cgroup for 38 % of the window (cpu.stat: 31 of 50 periods)";
    "it waited for a CPU 45 % of the time (run-queue delay): CPU contention".
    """
    if delta is None:
        return ""
    parts = [text for _share, text in _notable(delta)]
    if delta.involuntary is not None and delta.involuntary / delta.window_s >= INVOLUNTARY_NOTABLE and not parts:
        parts.append(f"it was preempted {delta.involuntary / delta.window_s:.0f} times a second")
    return "; ".join(parts)


def explain_straggler(delta: SlownessDelta | None, lateness: float, gpu: str = "") -> str:
    """Why a straggler is slow, as far as its counters account for it: a fragment for its verdict.

    ``lateness``: the share of the group's time its peers spent waiting for it, over the window ``delta``
    covers.  The throttling and the contention are said when each accounts for it (``accounts_for``); ``gpu``
    (``watchdogs.gpu.explain_gpu``'s words, "" without one) is a cause of its own.  When nothing is, the
    fragment says that the rank itself is slow, with what the counters did show ("its CPU counters do not
    account for it (waited for a CPU 20 % of the time): the rank itself is slow (its stack shows where)").
    Preemptions are a count, not a time: their delay is in the run-queue figure.
    """
    if delta is None:  # no counters read: nothing to say of them, either way
        return gpu
    causes = [text for share, text in _notable(delta) if accounts_for(share, lateness)]
    causes += [gpu] if gpu else []
    if causes:
        return "; ".join(causes)
    shown = ", ".join(text for _share, text in _notable(delta, short=True))
    counters = (
        f"its CPU counters do not account for it ({shown})" if shown else "its CPU counters do not account for it"
    )
    return f"{counters}: the rank itself is slow (its stack shows where)"


def accounts_for(share: float, lateness: float) -> bool:
    """Whether a delay of ``share`` of a window explains a rank its group waited for ``lateness`` of it."""
    return share >= ACCOUNTS_FOR * lateness


def _notable(delta: SlownessDelta, short: bool = False) -> list[tuple[float, str]]:
    """(share of the window, words) of the throttling and of the contention, where worth a word."""
    out = []
    throttled = delta.throttled_share
    if throttled is not None and throttled >= THROTTLED_NOTABLE:
        if short:
            out.append((throttled, f"throttled by its cgroup for {throttled * 100:.0f} % of the window"))
        else:
            periods = f" (cpu.stat: {delta.nr_throttled} of {delta.nr_periods} periods)" if delta.nr_periods else ""
            out.append(
                (throttled, f"its CPU was throttled by its cgroup for {throttled * 100:.0f} % of the window{periods}")
            )
    contention = delta.contention_share
    if contention is not None and contention >= RUNQ_NOTABLE:
        if short:
            out.append((contention, f"waited for a CPU {contention * 100:.0f} % of the time"))
        else:
            text = f"it waited for a CPU {contention * 100:.0f} % of the time (run-queue delay): CPU contention"
            out.append((contention, text))
    return out
