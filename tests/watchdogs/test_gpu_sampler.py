"""NVML on its own thread (issue 11): a wedged driver call stalls only the sampler.

The telemetry here is a stand-in whose calls block on an event, as a wedged
GPU driver's would; everyone else's waits must still end on time.
"""

from __future__ import annotations

import threading
import time

from tp_supervise.watchdogs.gpu import GpuProcess, GpuSample, GpuSampler

INTERVAL_S = 0.05
TIMEOUT_S = 0.2
SLACK_S = 0.5  # a loaded 2-core machine


def sample(util: float) -> GpuSample:
    return GpuSample(0, "GPU-0", util, 100.0, 1 << 30, 80 << 30, (GpuProcess(1234, 1 << 20),))


class FakeTelemetry:
    """Answers like NVML until ``wedge`` is cleared; then every sample() blocks until it is set again."""

    def __init__(self, init_blocks: threading.Event | None = None):
        if init_blocks is not None:
            init_blocks.wait()
        self.available = True
        self.reason = ""
        self.calls = 0
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = False

    def sample(self):
        self.calls += 1
        self.flowing.wait()
        return [sample(float(self.calls))]

    def close(self):
        self.closed = True


def started(telemetry) -> GpuSampler:
    s = GpuSampler(INTERVAL_S, telemetry=lambda: telemetry)
    s.start()
    end = time.monotonic() + 5
    while s.latest() is None and time.monotonic() < end:
        time.sleep(0.01)
    assert s.latest() is not None
    return s


def timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_readings_are_published_and_fresh_waits_for_a_newer_one():
    tel = FakeTelemetry()
    s = started(tel)
    try:
        first = s.latest()
        got, took = timed(lambda: s.fresh(TIMEOUT_S * 10))
        assert got is not None and got[0].utilization_pct > first.samples[0].utilization_pct
        assert took < TIMEOUT_S * 10
        assert s.available and not s.wedged(TIMEOUT_S)
    finally:
        assert s.stop(1.0)
    assert tel.closed, "NVML is shut down on its own thread"


def test_a_wedged_call_stalls_only_the_sampler():
    tel = FakeTelemetry()
    s = started(tel)
    try:
        tel.flowing.clear()  # the next NVML call never returns
        time.sleep(INTERVAL_S * 3)
        before = s.latest()
        # The cache still answers at once.
        cached, took = timed(s.latest)
        assert cached is before and took < 0.01
        # A fresh reading is given up after its deadline...
        got, took = timed(lambda: s.fresh(TIMEOUT_S))
        assert got is None and took < TIMEOUT_S + SLACK_S
        time.sleep(TIMEOUT_S)
        assert s.wedged(TIMEOUT_S)
        # ...and, once the call is overdue, at once.
        got, took = timed(lambda: s.fresh(TIMEOUT_S))
        assert got is None and took < 0.05
        # stop() gives up on the thread after its join limit.
        stopped, took = timed(lambda: s.stop(TIMEOUT_S))
        assert stopped is False and took < TIMEOUT_S + SLACK_S
    finally:
        tel.flowing.set()  # let the left-behind thread finish
    s._thread.join(5)
    assert not s._thread.is_alive()


def test_nvml_init_that_never_returns_blocks_nobody():
    release = threading.Event()
    s = GpuSampler(INTERVAL_S, telemetry=lambda: FakeTelemetry(init_blocks=release))
    t0 = time.monotonic()
    s.start()
    try:
        assert time.monotonic() - t0 < 0.05, "start() waited for nvmlInit"
        assert not s.available and s.latest() is None
        got, took = timed(lambda: s.fresh(TIMEOUT_S))
        assert got is None and took < 0.05
        stopped, took = timed(lambda: s.stop(TIMEOUT_S))
        assert stopped is False and took < TIMEOUT_S + SLACK_S
    finally:
        release.set()
    s._thread.join(5)


def test_without_nvml_the_sampler_ends_quietly():
    class Missing:
        available = False
        reason = "NVMLError_LibraryNotFound: NVML Shared Library Not Found"

    s = GpuSampler(INTERVAL_S, telemetry=Missing)
    s.start()
    s._thread.join(5)
    assert not s._thread.is_alive()
    assert not s.available and "NVML" in s.reason
    assert s.latest() is None and s.fresh(TIMEOUT_S) is None
    assert s.stop(TIMEOUT_S)
