"""A real Prometheus server scrapes live HealthServers and evaluates docs/prometheus/alerts.yml.

Prometheus (Debian's ``prometheus`` binary) runs on loopback with a temporary
storage dir and 1 s scrape/evaluation intervals, loading the real rule file
unchanged.  Two supervisor targets: one the test drives into a hard hang, one
the test stops to see the scrape-target-down alert go pending.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.live import wait_for

from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.observers.http_server import HealthCell, HealthServer, HealthStatus
from tp_supervise.supervisor.observers.metrics import SupervisorMetrics
from tp_supervise.supervisor.state import EngineState
from tp_supervise.supervisor.rank.net import free_port

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "docs" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "docs" / "grafana" / "tp-supervise.json"
INTERVAL = "1s"
READY_TIMEOUT_S = 60.0  # Prometheus start-up (TSDB, rule load) on a busy 2-core box
ALERT_TIMEOUT_S = 60.0  # a few scrape + evaluation rounds, with a wide margin
STOP_TIMEOUT_S = 15.0
START_ATTEMPTS = 3
HANG_JOB = "tp-supervise"
DOWN_JOB = "tp-supervise-down"
# Grafana variables of the dashboard, as a Grafana would expand them.
GRAFANA_VARS = {"$job": "tp-supervise.*", "$instance": ".*", "$__rate_interval": "1m", "$__range": "5m"}


@dataclass
class Stack:
    base: str  # Prometheus URL
    proc: subprocess.Popen
    hang_metrics: SupervisorMetrics
    hang_cell: HealthCell
    hang_server: HealthServer
    down_server: HealthServer

    def api(self, path: str, **params) -> dict:
        url = f"{self.base}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=STOP_TIMEOUT_S) as resp:
            doc = json.loads(resp.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def alerts(self, name: str) -> list[dict]:
        return [a for a in self.api("/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == name]

    def query(self, expr: str) -> list[dict]:
        return self.api("/api/v1/query", query=expr)["result"]


def write_config(path: Path, hang_port: int, down_port: int) -> None:
    # JSON is YAML: no YAML writer needed.
    config = {
        "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL, "scrape_timeout": INTERVAL},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": HANG_JOB, "static_configs": [{"targets": [f"127.0.0.1:{hang_port}"]}]},
            {"job_name": DOWN_JOB, "static_configs": [{"targets": [f"127.0.0.1:{down_port}"]}]},
        ],
    }
    path.write_text(json.dumps(config, indent=2))


def ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/-/ready", timeout=STOP_TIMEOUT_S) as resp:
            return resp.status == 200
    except OSError:
        return False


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)


def start_prometheus(binary: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    """Start on a free loopback port; retry when another process took the port first."""
    for attempt in range(START_ATTEMPTS):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = open(workdir / f"prometheus-{attempt}.log", "wb")
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / f'data-{attempt}'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None and not ready(base):
            time.sleep(0.1)
        if proc.poll() is None and ready(base):
            return proc, base
        stop_process(proc)
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(workdir.glob("prometheus-*.log")))
    raise AssertionError(f"Prometheus did not become ready:\n{logs}")


def busy_ranks(step: int, now: float) -> list[hb.SlotSnapshot]:
    flags = hb.CLAIMED | hb.INSTRUMENTED | hb.READY | hb.IN_COLLECTIVE
    return [
        hb.SlotSnapshot(r, 100 + r, r, flags, 0, step, 4 * step, now, now, now, 0.01, now, "decode", "all_reduce", "")
        for r in (0, 1)
    ]


@pytest.fixture(scope="module")
def stack(prometheus_bin, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("prometheus")
    hang_metrics = SupervisorMetrics("e2e-hang", slot_ranks=[0, 1])
    hang_metrics.set_engine_state(EngineState.READY)
    hang_metrics.observe_ranks(busy_ranks(1, time.monotonic()), time.monotonic(), {0: True, 1: True})
    hang_cell = HealthCell(HealthStatus.for_state(EngineState.READY))
    hang_server = HealthServer(hang_metrics, hang_cell, "127.0.0.1", 0)
    down_server = HealthServer(
        SupervisorMetrics("e2e-down"), HealthCell(HealthStatus.for_state(EngineState.READY)), "127.0.0.1", 0
    )
    proc = None
    try:
        hang_server.start()
        down_server.start()
        write_config(workdir / "prometheus.yml", hang_server.port, down_server.port)
        proc, base = start_prometheus(prometheus_bin, workdir)
        yield Stack(base, proc, hang_metrics, hang_cell, hang_server, down_server)
    finally:
        if proc is not None:
            stop_process(proc)
        hang_server.stop()
        down_server.stop()


def test_rules_load_and_evaluate_without_errors(stack):
    def evaluated():
        rules = [r for g in stack.api("/api/v1/rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = wait_for(evaluated, READY_TIMEOUT_S, "every rule evaluated once")
    names = {r["name"] for r in rules}
    assert "TPSuperviseHang" in names and "TPSuperviseDown" in names
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


def test_hard_hang_fires_the_hang_alert(stack, http):
    m = stack.hang_metrics
    wait_for(
        lambda: stack.query(f'supervise_engine_state{{job="{HANG_JOB}",state="ready"}} == 1'),
        ALERT_TIMEOUT_S,
        "Prometheus to scrape the healthy supervisor",
    )
    # Evaluations have run on healthy data: nothing about a hang may be active.
    time.sleep(2.5)
    assert not stack.alerts("TPSuperviseHang")
    assert not stack.alerts("TPSuperviseHangSuspected")

    # The supervisor's hard watchdog fires: what its tick would record.
    started = time.monotonic()
    m.observe_ranks(busy_ranks(1, time.monotonic() - 5), time.monotonic(), {0: True, 1: True})
    m.set_watchdog(soft=2.0, hard=4.0, stalled_s=4.1)
    m.record_hang("hard")
    m.set_engine_state(EngineState.HUNG)
    m.set_incident_open(True)
    stack.hang_cell.set(HealthStatus.for_state(EngineState.HUNG, "no progress for 4.1 s"))
    assert http(stack.hang_server.url + "/healthz").status == 503

    alerts = wait_for(
        lambda: [a for a in stack.alerts("TPSuperviseHang") if a["state"] in ("pending", "firing")],
        ALERT_TIMEOUT_S,
        "TPSuperviseHang to go pending/firing",
    )
    elapsed = time.monotonic() - started
    (alert,) = alerts
    assert alert["labels"]["job"] == HANG_JOB
    assert alert["labels"]["kind"] == "hard"
    assert alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook_url"] == "docs/runbooks/TPSuperviseHang.md"
    assert alert["annotations"]["summary"] == f"TP group hung on {alert['labels']['instance']}"
    print(f"TPSuperviseHang {alert['state']} {elapsed:.1f} s after the hang was recorded")
    # Scraped state agrees, and the soft alert stays quiet (no soft verdict was recorded).
    assert stack.query(f'supervise_engine_state{{job="{HANG_JOB}",state="hung"}} == 1')
    assert not stack.alerts("TPSuperviseHangSuspected")


def test_scrape_target_down_alert_goes_pending(stack):
    wait_for(lambda: stack.query(f'up{{job="{DOWN_JOB}"}} == 1'), ALERT_TIMEOUT_S, "the second target to be up")
    assert not stack.alerts("TPSuperviseDown")
    stack.down_server.stop()
    alerts = wait_for(
        lambda: [a for a in stack.alerts("TPSuperviseDown") if a["state"] in ("pending", "firing")],
        ALERT_TIMEOUT_S,
        "TPSuperviseDown to go pending",
    )
    assert [a["labels"]["job"] for a in alerts] == [DOWN_JOB]


def test_dashboard_queries_are_valid_promql(stack):
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    assert exprs
    for expr in exprs:
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        stack.query(expr)  # raises on a parse or evaluation error
