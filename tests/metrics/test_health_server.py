"""HealthServer over real HTTP on free ports; a real fake rank feeding the metrics."""

from __future__ import annotations

from http import client as httpclient
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.live import wait_for
from prometheus_client.parser import text_string_to_metric_families

from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.rank import runtime
from tp_supervise.supervisor.observers.http_server import SERVE_THREAD_NAME, HealthCell, HealthServer, HealthStatus
from tp_supervise.supervisor.rank.net import is_loopback
from tp_supervise.supervisor.observers.metrics import SupervisorMetrics
from tp_supervise.supervisor.state import EngineState

FAKE_RANK = Path(__file__).with_name("fake_rank.py")
REPO = Path(__file__).resolve().parents[2]
# Generous bound for things that take milliseconds on an idle machine.
WAIT_S = 20.0


@pytest.fixture
def served():
    metrics = SupervisorMetrics("run-http", slot_ranks=[0, 1])
    cell = HealthCell(HealthStatus.for_state(EngineState.STARTING, "waiting for 2 ranks"))
    server = HealthServer(metrics, cell, "127.0.0.1", 0)
    server.start()
    try:
        yield server, metrics, cell
    finally:
        server.stop()


def scrape(http, server: HealthServer) -> dict[tuple[str, frozenset], float]:
    reply = http(server.url + "/metrics")
    assert reply.status == 200
    out = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


# -- health endpoints ---------------------------------------------------------------


@pytest.mark.parametrize(
    "state, healthz, readyz",
    [
        (EngineState.STARTING, 503, 503),
        (EngineState.READY, 200, 200),
        (EngineState.SUSPECT, 200, 503),
        (EngineState.HUNG, 503, 503),
        (EngineState.DIVERGED, 503, 503),
        (EngineState.FAILED, 503, 503),
        (EngineState.TEARING_DOWN, 503, 503),
        (EngineState.STOPPED, 503, 503),
    ],
)
def test_health_codes_follow_the_engine_state(served, http, state, healthz, readyz):
    server, _metrics, cell = served
    cell.set(HealthStatus.for_state(state, f"detail for {state.value}"))
    h, r = http(server.url + "/healthz"), http(server.url + "/readyz")
    assert (h.status, r.status) == (healthz, readyz)
    body = json.loads(h.body)
    assert body == {
        "state": state.value,
        "healthy": healthz == 200,
        "ready": readyz == 200,
        "detail": f"detail for {state.value}",
    }
    assert h.headers["content-type"] == "application/json"
    assert h.headers["cache-control"] == "no-store"


def test_health_flips_on_the_next_request(served, http):
    """No caching: a fault set by the supervisor shows on the very next probe."""
    server, _metrics, cell = served
    cell.set(HealthStatus.for_state(EngineState.READY))
    assert http(server.url + "/healthz").status == 200
    cell.set(HealthStatus.for_state(EngineState.HUNG, "ranks 0,1 wait in all_reduce #812; rank 1 is stopped"))
    reply = http(server.url + "/healthz")
    assert reply.status == 503
    assert json.loads(reply.body)["detail"].startswith("ranks 0,1 wait")
    cell.set(HealthStatus.for_state(EngineState.READY))
    assert http(server.url + "/healthz").status == 200


def test_a_failing_health_callback_reads_as_unhealthy(http):
    def broken() -> HealthStatus:
        raise RuntimeError("boom")

    with HealthServer(SupervisorMetrics("r"), broken, "127.0.0.1", 0) as server:
        for path in ("/healthz", "/readyz"):
            reply = http(server.url + path)
            assert reply.status == 503
            body = json.loads(reply.body)
            assert body["state"] == "unknown" and "boom" in body["detail"]
        assert http(server.url + "/metrics").status == 200


# -- metrics endpoint ---------------------------------------------------------------------


def test_livez_reports_the_loop_age_and_turns_503_only_when_the_loop_is_wedged(http):
    from tp_supervise.supervisor.observers.http_server import Liveness

    liveness = Liveness(stale_after_s=1.0)
    cell = HealthCell(HealthStatus.for_state(EngineState.TEARING_DOWN, "tearing down"))
    server = HealthServer(SupervisorMetrics("run-live", slot_ranks=[0]), cell, "127.0.0.1", 0, liveness=liveness)
    server.start()
    try:
        liveness.beat()
        reply = http(server.url + "/livez")
        assert reply.status == 200 and json.loads(reply.body)["alive"] is True  # tearing down is alive
        assert http(server.url + "/healthz").status == 503
        time.sleep(1.3)  # the loop stopped going round
        reply = http(server.url + "/livez")
        body = json.loads(reply.body)
        assert reply.status == 503 and body["alive"] is False and body["loop_age_s"] >= 1.0
        liveness.beat()
        assert http(server.url + "/livez").status == 200
    finally:
        server.stop()


def test_metrics_endpoint_serves_the_private_registry(served, http):
    server, metrics, _cell = served
    metrics.set_engine_state(EngineState.READY)
    metrics.record_hang("soft")
    s = scrape(http, server)
    assert s[("supervise_engine_state", frozenset({"state": "ready"}.items()))] == 1
    assert s[("supervise_engine_state", frozenset({"state": "starting"}.items()))] == 0
    assert s[("supervise_hangs_total", frozenset({"kind": "soft"}.items()))] == 1
    assert s[("supervise_hangs_total", frozenset({"kind": "hard"}.items()))] == 0
    reply = http(server.url + "/metrics?name[]=ignored")
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")


def test_metrics_endpoint_speaks_openmetrics_when_asked(served, http):
    server, _metrics, _cell = served
    reply = http(server.url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("application/openmetrics-text")
    assert reply.body.rstrip().endswith(b"# EOF")


def test_unknown_paths_methods_and_head(served, http):
    server, _metrics, _cell = served
    for path in ("/", "/metrics/x", "/health", "/favicon.ico"):
        assert http(server.url + path).status == 404, path
    assert http(server.url + "/metrics", method="POST").status == 405
    head = http(server.url + "/metrics", method="HEAD")
    assert head.status == 200 and head.body == b"" and int(head.headers["content-length"]) > 0


# -- server mechanics --------------------------------------------------------------------


def test_port_zero_binds_a_free_port_and_stop_releases_it(http):
    metrics = SupervisorMetrics("r")
    cell = HealthCell(HealthStatus.for_state(EngineState.READY))
    a, b = HealthServer(metrics, cell, "127.0.0.1", 0), HealthServer(metrics, cell, "127.0.0.1", 0)
    with a, b:
        assert a.port != b.port and a.port > 0
        assert http(a.url + "/healthz").status == 200
        assert http(b.url + "/healthz").status == 200
        assert any(t.name == SERVE_THREAD_NAME for t in threading.enumerate())
        port = a.port
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S).close()
    wait_for(lambda: not any(t.name == SERVE_THREAD_NAME for t in threading.enumerate()), WAIT_S, interval=0.02)
    a.stop()  # idempotent


def test_stop_hangs_up_on_keep_alive_connections():
    """A keep-alive scraper (Prometheus) must see the target go down at stop()."""
    server = HealthServer(SupervisorMetrics("r"), HealthCell(HealthStatus("ready", True, True)), "127.0.0.1", 0)
    server.start()
    conn = httpclient.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200 and not resp.will_close
        resp.read()
        server.stop()
        with pytest.raises((httpclient.HTTPException, ConnectionError)):
            conn.request("GET", "/metrics")
            conn.getresponse().read()
    finally:
        conn.close()
        server.stop()


def test_a_taken_port_fails_start_with_oserror():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        server = HealthServer(SupervisorMetrics("r"), HealthCell(HealthStatus("x", True, True)), "127.0.0.1",
                              holder.getsockname()[1])
        with pytest.raises(OSError):
            server.start()
        server.stop()


def test_a_stalled_client_does_not_block_probes(served, http):
    """A client that sends half a request and stops holds only its own thread."""
    server, _metrics, cell = served
    cell.set(HealthStatus.for_state(EngineState.READY))
    stalled = [socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) for _ in range(4)]
    try:
        for s in stalled:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line: the request never ends
        for _ in range(3):
            assert http(server.url + "/healthz").status == 200
    finally:
        for s in stalled:
            s.close()


def test_ipv6_loopback(http):
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    with HealthServer(SupervisorMetrics("r"), HealthCell(HealthStatus("ready", True, True)), "::1", 0) as server:
        assert server.url.startswith("http://[::1]:")
        assert http(server.url + "/readyz").status == 200


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.7", False),
        ("node7.example.com", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


# -- a real rank process ------------------------------------------------------------------


def test_live_rank_metrics_through_http(tmp_path, http):
    """A fake rank heartbeats; the test plays the watchdog tick and scrapes over HTTP.

    SIGSTOP freezes its step counter and its heartbeat age grows while it is
    still up; SIGKILL makes it down.
    """
    run_id = str(uuid.uuid4())
    seg = hb.HeartbeatSegment(tmp_path / "hb", nslots=1, run_id=run_id, created=time.monotonic())
    env = dict(os.environ)
    env.update(
        {
            runtime.ENV_RUN_ID: run_id,
            runtime.ENV_HEARTBEAT: str(tmp_path / "hb"),
            runtime.ENV_SLOT: "0",
            runtime.ENV_SUPERVISOR_PID: str(os.getpid()),
            "RANK": "0",
            "PYTHONPATH": str(REPO),
        }
    )
    proc = subprocess.Popen([sys.executable, str(FAKE_RANK)], env=env, stdout=subprocess.PIPE, text=True)
    metrics = SupervisorMetrics(run_id, slot_ranks=[0])
    cell = HealthCell(HealthStatus.for_state(EngineState.STARTING))
    try:
        assert proc.stdout.readline().strip() == "ready"
        with HealthServer(metrics, cell, "127.0.0.1", 0) as server:

            def tick():
                metrics.observe_ranks(seg.read_all(), time.monotonic(), {0: proc.poll() is None})
                return scrape(http, server)

            def rank(s, name):
                return s.get((name, frozenset({"rank": "0"}.items())))

            def tick_until(name, predicate):
                return wait_for(lambda: (lambda s: s if predicate(rank(s, name)) else None)(tick()), WAIT_S, interval=0.02)

            first = tick()
            assert rank(first, "supervise_rank_up") == 1
            tick_until("supervise_rank_step", lambda step: step >= rank(first, "supervise_rank_step") + 5)
            s = tick_until("supervise_step_duration_seconds_count", lambda n: n >= 1)
            assert rank(s, "supervise_rank_heartbeat_age_seconds") < WAIT_S

            os.kill(proc.pid, signal.SIGSTOP)
            try:
                stopped_at = rank(tick(), "supervise_rank_step")
                s = tick_until("supervise_rank_heartbeat_age_seconds", lambda age: age > 0.5)
                assert rank(s, "supervise_rank_up") == 1  # stopped, not dead
                assert rank(s, "supervise_rank_step") == stopped_at
            finally:
                os.kill(proc.pid, signal.SIGCONT)

            proc.kill()
            proc.wait(timeout=WAIT_S)
            assert rank(tick(), "supervise_rank_up") == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT_S)
        proc.stdout.close()
        seg.close()
