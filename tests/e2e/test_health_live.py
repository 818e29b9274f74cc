"""Issue 7 acceptance against a live supervised gloo job."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import marked_pids
from tests.live import http_get, metric_value, wait_for, wait_registry

pytestmark = pytest.mark.e2e

GLOO = str(Path(__file__).resolve().parents[1] / "fakes" / "gloo_loop.py")


def test_stopped_rank_turns_readyz_503_and_counts_a_soft_hang(supervise, tmp_path):
    run = supervise(
        ["--nproc-per-node", "2", "--soft-timeout", "2", "--kill-grace", "2"],
        [sys.executable, GLOO, "--iters", "100000", "--fault", "stop", "--fault-at", "100"],
    )
    url = wait_registry(tmp_path / "registry")["metrics"]
    assert url.startswith("http://127.0.0.1:")
    wait_for(lambda: http_get(url + "/healthz")[0] == 200, 40, what="/healthz 200")
    body = http_get(url + "/metrics")[1]
    for rank in ("0", "1"):
        assert metric_value(body, "supervise_rank_up", {"rank": rank}) == 1
        assert metric_value(body, "supervise_rank_heartbeat_age_seconds", {"rank": rank}) is not None
    assert metric_value(body, "supervise_engine_state", {"state": "ready"}) == 1

    wait_for(lambda: http_get(url + "/readyz")[0] == 503, 30, what="/readyz 503")
    soft = wait_for(
        lambda: (metric_value(http_get(url + "/metrics")[1], "supervise_hangs_total", {"kind": "soft"}) or 0) >= 1,
        10,
        what="a soft hang counted",
    )
    assert soft
    assert len(marked_pids(supervise.mark)) >= 3, "the ranks must still be alive after a soft hang"
    assert http_get(url + "/healthz")[0] == 200, "a suspected hang is not a confirmed fault"
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 0
    assert any("hang_suspected" in b.name for b in run.bundles())


def _rank_pid(mark: str, rank: int) -> int:
    for pid in marked_pids(mark):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"SUPERVISE_SLOT=" + str(rank).encode() in env:
            return pid
    raise AssertionError(f"rank {rank} not found")


def test_healthz_turns_503_at_once_when_a_rank_dies(supervise, tmp_path):
    import os
    import time

    from tests.conftest import fake_rank

    run = supervise(["--nproc-per-node", "2", "--kill-grace", "3"], fake_rank("--all", "loop", "--ignore-term"))
    url = wait_registry(tmp_path / "registry")["metrics"]
    wait_for(lambda: http_get(url + "/healthz")[0] == 200, 30, what="/healthz 200")
    pid = _rank_pid(supervise.mark, 0)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: http_get(url + "/healthz", timeout=1)[0] == 503, 2, interval=0.01, what="/healthz 503")
    noticed = time.monotonic() - t0
    assert noticed < 1.0, noticed
    assert run.wait(timeout=30) == 80
