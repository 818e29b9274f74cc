"""--health-addr (issue 13): a health-only listener for Kubernetes probes while /metrics stays on loopback."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request

import pytest

from tp_supervise.supervisor.rank.net import free_port
from tests.conftest import fake_rank
from tests.live import wait_for

pytestmark = pytest.mark.e2e


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def test_health_listener_serves_probes_and_not_metrics(supervise):
    metrics_port, health_port = free_port(), free_port()
    run = supervise(["--nproc-per-node", "2", "--metrics-addr", f"127.0.0.1:{metrics_port}",
                     "--health-addr", f"127.0.0.1:{health_port}"], fake_rank("--all", "loop"))
    health = f"http://127.0.0.1:{health_port}"
    wait_for(lambda: get(health + "/readyz")[0] == 200, 60, "ready on the health listener")
    code, body = get(health + "/healthz")
    assert code == 200 and json.loads(body)["healthy"] is True
    code, body = get(health + "/livez")
    assert code == 200 and json.loads(body)["alive"] is True
    code, body = get(health + "/metrics")
    assert code == 404 and b"--metrics-addr" in body
    code, body = get(f"http://127.0.0.1:{metrics_port}/metrics")
    assert code == 200 and b"supervise_engine_state" in body
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(30) == 0
    assert run.events("health endpoints")


def test_health_addr_on_the_metrics_port_is_refused_before_anything_starts(supervise):
    port = free_port()
    run = supervise(["--nproc-per-node", "1", "--metrics-addr", f"127.0.0.1:{port}", "--health-addr", f"127.0.0.1:{port}"], fake_rank("--all", "loop"))
    assert run.wait(30) == 64
    assert "--health-addr" in run.stderr and "rank started" not in run.stderr
