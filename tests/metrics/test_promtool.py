"""promtool: rule syntax, rule unit tests, example config, and lint of a live scrape."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tp_supervise.supervisor.observers.http_server import HealthCell, HealthServer, HealthStatus
from tp_supervise.supervisor.state import EngineState

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "docs" / "prometheus"
TOOL_TIMEOUT_S = 60


def run(promtool: str, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool, *args], input=stdin, capture_output=True, timeout=TOOL_TIMEOUT_S, cwd=REPO
    )


def test_check_rules(promtool):
    res = run(promtool, "check", "rules", str(PROM_DIR / "alerts.yml"))
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()
    assert b"SUCCESS" in res.stdout


def test_rule_unit_tests(promtool):
    res = run(promtool, "test", "rules", str(PROM_DIR / "alerts_test.yml"))
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()


def test_example_config_is_valid(promtool):
    res = run(promtool, "check", "config", str(PROM_DIR / "prometheus.yml"))
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()


def test_rule_unit_tests_catch_a_broken_rule(promtool, tmp_path):
    """Negative control: the unit tests fail when a rule stops discriminating."""
    broken = (PROM_DIR / "alerts.yml").read_text().replace(
        'reason!~"clean|teardown"', 'reason!~"clean"'
    )
    assert broken != (PROM_DIR / "alerts.yml").read_text()
    (tmp_path / "alerts.yml").write_text(broken)
    (tmp_path / "alerts_test.yml").write_text((PROM_DIR / "alerts_test.yml").read_text())
    res = run(promtool, "test", "rules", str(tmp_path / "alerts_test.yml"))
    assert res.returncode != 0
    assert b"TPSuperviseRankDied" in res.stdout + res.stderr


def test_check_metrics_on_a_live_scrape(promtool, http, populated_metrics):
    metrics = populated_metrics
    with HealthServer(metrics, HealthCell(HealthStatus.for_state(EngineState.SUSPECT)), "127.0.0.1", 0) as server:
        reply = http(server.url + "/metrics")
    assert reply.status == 200
    assert b"supervise_gpu_power_watts" in reply.body and b"supervise_step_duration_seconds_bucket" in reply.body
    res = run(promtool, "check", "metrics", stdin=reply.body)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), (
        res.stdout.decode() + res.stderr.decode()
    )


def test_check_metrics_rejects_a_badly_named_counter(promtool):
    """Negative control: promtool's lint does flag naming problems."""
    bad = b"# HELP supervise_hangs h\n# TYPE supervise_hangs counter\nsupervise_hangs 1\n"
    res = run(promtool, "check", "metrics", stdin=bad)
    assert res.returncode != 0
    assert b"_total" in res.stdout + res.stderr
