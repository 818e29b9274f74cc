"""Fixtures for the metrics / health / alert-rule tests.

Tools from Debian's ``prometheus`` package (promtool, the server) are
required in CI (``CI`` set: a missing binary fails the test); locally a
missing binary skips the tests that need it.
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.observers.metrics import SupervisorMetrics
from tp_supervise.supervisor.state import EngineState

HTTP_TIMEOUT_S = 10.0


def _require_binary(name: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} not found: apt-get install --no-install-recommends prometheus"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set, so this is a failure, not a skip)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def promtool() -> str:
    return _require_binary("promtool")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    return _require_binary("prometheus")


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def fetch(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> Reply:
    """One HTTP request; error statuses are returned, not raised."""
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return Reply(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read())


@pytest.fixture
def http():
    return fetch


@pytest.fixture
def populated_metrics() -> SupervisorMetrics:
    """Every family carries samples, as in a run that saw every kind of event."""
    m = SupervisorMetrics("lint-run", slot_ranks=[0, 1])
    now = time.monotonic()
    claimed = hb.CLAIMED | hb.INSTRUMENTED | hb.READY
    for step in (1, 2):
        snaps = [
            hb.SlotSnapshot(0, 100, 0, claimed | hb.IN_COLLECTIVE, 0, step, 10 * step, now, now, now - 0.2, 0.01, now,
                            "decode", "all_reduce", "8x8 float32"),
            hb.SlotSnapshot(1, 101, 1, claimed, 0, step, 10 * step - 1, now, now, now, 0.012, now, "decode", "", ""),
        ]
        m.observe_ranks(snaps, now + step, {0: True, 1: True})
    m.set_engine_state(EngineState.SUSPECT)
    m.set_incident_open(True)
    m.set_watchdog(soft=3.0, hard=None, startup=600.0, stalled_s=3.2)
    m.record_hang("soft")
    m.record_divergence()
    m.set_consensus_counts(100, 1)
    m.record_rank_exit("segfault")
    m.record_restart()
    m.record_teardown(0.8, complete=True)
    m.record_dump("hang_suspected", ok=True, duration_s=0.3)
    m.set_gpu(0, utilization_pct=99.0, power_watts=300.0, memory_used_bytes=1 << 30, memory_total_bytes=80 << 30)
    return m
