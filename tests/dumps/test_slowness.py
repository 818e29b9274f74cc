"""dumps/slowness.py on real processes: cgroup CPU throttling and run-queue delay, as the kernel counts them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager

import pytest

from bench.bench_straggler import cpu_quota_cgroup
from tp_supervise.dumps.slowness import (
    SlownessDelta,
    explain,
    read_cgroup_cpu,
    read_slowness,
    slowness_delta,
)

BUSY = [sys.executable, "-c", "while True: pass"]
WINDOW_S = 1.0  # at least; longer until the process has done enough to judge (a loaded host runs it less)
DEADLINE_S = 30.0


@contextmanager
def busy(cpu: int | None = None):
    """A CPU-bound child process (pinned to ``cpu``), killed and reaped on exit."""
    proc = subprocess.Popen(BUSY)
    try:
        if cpu is not None:
            os.sched_setaffinity(proc.pid, {cpu})
        yield proc
    finally:
        proc.kill()
        proc.wait()


def measure(pid: int, enough: Callable[[SlownessDelta], bool]) -> SlownessDelta:
    """The delta over a window of at least WINDOW_S that ``enough`` accepts (what it saw at the deadline)."""
    before = read_slowness(pid)
    time.sleep(WINDOW_S)
    end = time.monotonic() + DEADLINE_S
    while True:
        delta = slowness_delta(before, read_slowness(pid))
        assert delta is not None
        if enough(delta) or time.monotonic() > end:
            return delta
        time.sleep(0.25)


@contextmanager
def cpu_cgroup_v1(quota_us: int, period_us: int = 100_000):
    """A cgroup v1 ``cpu`` controller child with a CFS quota, removed on exit (skips where there is none)."""
    try:
        made = cpu_quota_cgroup(quota_us, period_us)
        path = made.__enter__()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        yield path
    finally:
        made.__exit__(None, None, None)


def test_a_cgroup_cpu_quota_shows_as_throttling():
    # 5 % of one CPU for a process that wants 100 %: it reaches its quota early in each period even on a
    # loaded host (where it waits for a CPU too), then is throttled for the rest of the period.
    with cpu_cgroup_v1(quota_us=5_000) as cgroup, busy() as proc:
        (cgroup / "cgroup.procs").write_text(str(proc.pid))
        time.sleep(0.2)  # the first periods in the cgroup
        cg = read_cgroup_cpu(proc.pid)
        assert cg is not None and cg.version == 1 and cg.path == str(cgroup)
        delta = measure(proc.pid, lambda d: (d.nr_periods or 0) >= 5)
    assert delta.cgroup_path == str(cgroup)
    assert delta.throttled_share is not None and delta.throttled_share > 0.3, delta
    assert delta.nr_throttled and delta.nr_periods and delta.nr_throttled >= 0.5 * delta.nr_periods, delta
    assert delta.cpu_share is not None and delta.cpu_share < 0.1, "the quota held it near 5 % of a CPU"
    text = explain(delta)
    assert text.startswith("its CPU was throttled by its cgroup for ") and "% of the window (cpu.stat: " in text
    # A throttled thread waits on the run queue too: that part is the throttling, not contention.
    assert delta.runq_share is not None and delta.contention_share is not None
    assert delta.contention_share <= delta.runq_share - delta.throttled_share + 0.01


def test_a_competitor_on_the_same_core_shows_as_run_queue_delay():
    cpu = max(os.sched_getaffinity(0))
    with busy(cpu) as proc, busy(cpu):
        time.sleep(0.2)
        delta = measure(proc.pid, lambda d: (d.cpu_s or 0.0) >= 0.2)
    assert delta.runq_share is not None and delta.runq_share > 0.3, delta  # about half of it, more on a loaded host
    assert delta.involuntary is not None and delta.involuntary > 0, "it was preempted by its competitor"
    text = explain(delta)
    assert "it waited for a CPU " in text and "% of the time (run-queue delay): CPU contention" in text
    assert "throttled" not in text


def test_a_process_alone_says_nothing_notable_about_throttling():
    with busy() as proc:
        delta = measure(proc.pid, lambda d: (d.cpu_s or 0.0) >= 0.2)
    assert delta.cpu_s is not None and delta.cpu_s >= 0.2
    assert "throttled" not in explain(delta)


def test_a_gone_process_reads_as_unknown_and_never_raises():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    sample = read_slowness(proc.pid)
    assert (sample.cpu_s, sample.voluntary, sample.runq_s, sample.cgroup, sample.threads) == (None, None, None, None, 0)
    delta = slowness_delta(sample, read_slowness(proc.pid))
    assert delta is not None and explain(delta) == ""
    assert slowness_delta(read_slowness(os.getpid()), sample) is None, "two processes are not one window"
    assert explain(None) == ""


def test_the_fragments_in_words():
    def delta(**kw) -> SlownessDelta:
        base = dict(pid=1, window_s=2.0, cpu_s=0.5, voluntary=10, involuntary=5, runq_s=0.0, nr_periods=20,
                    nr_throttled=15, throttled_s=0.76, cgroup_path="/sys/fs/cgroup/cpu/x")
        base.update(kw)
        return SlownessDelta(**base)

    assert explain(delta()) == "its CPU was throttled by its cgroup for 38 % of the window (cpu.stat: 15 of 20 periods)"
    assert explain(delta(throttled_s=0.0, runq_s=0.9)) == (
        "it waited for a CPU 45 % of the time (run-queue delay): CPU contention"
    )
    assert explain(delta(throttled_s=0.0, involuntary=600)) == "it was preempted 300 times a second"
    assert explain(delta(throttled_s=None, runq_s=None, involuntary=None)) == ""
