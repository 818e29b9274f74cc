"""Alert rules, their unit tests, runbooks, dashboard and docs agree with the metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "docs" / "prometheus"
RUNBOOK_DIR = REPO / "docs" / "runbooks"
DASHBOARD = REPO / "docs" / "grafana" / "tp-supervise.json"
METRICS_DOC = REPO / "docs" / "metrics.md"
SEVERITIES = {"critical", "warning"}
RUNBOOK_SECTIONS = ("## What it means", "## What to look at", "## What to do")
METRIC_RE = re.compile(r"\bsupervise_[a-z_]+\b")
SERIES_SUFFIXES = ("_bucket", "_count", "_sum", "_created")
REQUIRED_ALERTS = {
    "TPSuperviseHang",
    "TPSuperviseHangSuspected",
    "TPSuperviseDivergence",
    "TPSuperviseRankDied",
    "TPSuperviseCrashLoop",
    "TPSuperviseDown",
    "TPSuperviseDumpsFailing",
    "TPSuperviseGpusBusyWithoutProgress",
}


def alert_rules() -> dict[str, dict]:
    doc = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def family_names(metrics) -> set[str]:
    body, _ = metrics.exposition()
    # prometheus_client's <family>_created gauges are documented as a group.
    return {f.name for f in text_string_to_metric_families(body.decode()) if not f.name.endswith("_created")}


def referenced(text: str) -> set[str]:
    """Metric family names in PromQL or prose (series suffixes stripped)."""
    names = set()
    for name in METRIC_RE.findall(text):
        for suffix in SERIES_SUFFIXES:
            if name.endswith(suffix) and not name.endswith("_total" + suffix):
                name = name[: -len(suffix)]
                break
        names.add(name)
    return names


def counter_base(name: str) -> str:
    """prometheus_client names counter families without ``_total``."""
    return name[: -len("_total")] if name.endswith("_total") else name


# -- alerts and runbooks ------------------------------------------------------------------


def test_every_required_alert_exists():
    assert REQUIRED_ALERTS <= set(alert_rules())


@pytest.mark.parametrize("alert", sorted(alert_rules()))
def test_alert_has_severity_text_and_a_runbook(alert):
    rule = alert_rules()[alert]
    assert rule["labels"]["severity"] in SEVERITIES
    ann = rule["annotations"]
    assert ann["summary"].strip() and ann["description"].strip()
    url = ann["runbook_url"]
    assert url.endswith(f"/{alert}.md")
    assert "docs/runbooks" in url
    runbook = RUNBOOK_DIR / f"{alert}.md"
    assert runbook.is_file()
    text = runbook.read_text()
    assert text.startswith(f"# {alert}\n")
    for section in RUNBOOK_SECTIONS:
        assert section in text, f"{runbook.name} lacks {section!r}"


def test_no_orphan_runbooks():
    assert {p.stem for p in RUNBOOK_DIR.glob("*.md")} == set(alert_rules())


def test_runbooks_point_at_the_bundle_and_analyze():
    for alert in alert_rules():
        text = (RUNBOOK_DIR / f"{alert}.md").read_text()
        assert "--dump-dir" in text and "supervise analyze" in text, alert


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    doc = yaml.safe_load((PROM_DIR / "alerts_test.yml").read_text())
    assert doc["rule_files"] == ["alerts.yml"]
    fires, quiet = set(), set()
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert fires == set(alert_rules()), "alerts without a firing test"
    assert quiet == set(alert_rules()), "alerts without a test that they stay quiet"


def test_alert_expressions_use_only_exported_metrics(populated_metrics):
    exported = family_names(populated_metrics)
    for alert, rule in alert_rules().items():
        for name in referenced(rule["expr"]):
            assert counter_base(name) in exported, f"{alert} uses unknown metric {name}"


# -- dashboard ------------------------------------------------------------------------------


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    return exprs


def test_dashboard_structure():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "tp-supervise" and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= variables
    for panel in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"


def test_dashboard_covers_the_brief(populated_metrics):
    exprs = "\n".join(dashboard_exprs())
    used = {counter_base(n) for n in referenced(exprs)}
    exported = family_names(populated_metrics)
    assert used <= exported, f"unknown metrics in the dashboard: {used - exported}"
    for needed in (
        "supervise_rank_heartbeat_age_seconds",
        "supervise_step_duration_seconds",
        "supervise_engine_state",
        "supervise_hangs",
        "supervise_divergences",
        "supervise_dumps",
        "supervise_restarts",
        "supervise_gpu_utilization_ratio",
    ):
        assert needed in used, needed


# -- docs/metrics.md ----------------------------------------------------------------------------


def test_metrics_doc_lists_exactly_the_exported_families(populated_metrics):
    documented = {counter_base(n) for n in referenced(METRICS_DOC.read_text())}
    exported = family_names(populated_metrics)
    assert exported - documented == set(), "exported but undocumented"
    assert documented - exported == set(), "documented but not exported"
