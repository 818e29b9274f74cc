"""supervise_dumps_total's ``reason`` (issue 26): every reason a bundle is written under is a label value of its
own, never folded into ``other`` (a straggler bundle logged ``metrics_label_folded`` and counted as ``other``);
docs/bundle.md's reasons, the code's label set and docs/metrics.md's row say the same."""

from __future__ import annotations

import re
from pathlib import Path

import structlog

from tests.metrics.test_metrics_registry import value
from tp_supervise.supervisor.observers.metrics import DUMP_REASONS, OTHER, SupervisorMetrics

DOCS = Path(__file__).resolve().parents[2] / "docs"


def bundle_reasons() -> set[str]:
    """The reasons docs/bundle.md names for a bundle's directory ("`reason` is one of `a`, `b` ... or `z`.")."""
    text = " ".join((DOCS / "bundle.md").read_text().split())
    listed = re.search(r"`reason` is one of (.+?)\.", text)
    assert listed, "docs/bundle.md no longer lists the bundle reasons"
    return set(re.findall(r"`([a-z_]+)`", listed.group(1)))


def test_every_bundle_reason_is_a_label_value_of_its_own():
    assert "straggler" in bundle_reasons()
    assert bundle_reasons() == set(DUMP_REASONS) - {OTHER}


def test_docs_metrics_lists_the_dump_reasons_the_code_exports():
    row = next(line for line in (DOCS / "metrics.md").read_text().splitlines()
               if line.startswith("| `supervise_dumps_total`"))
    listed = re.search(r"`reason` = ([a-z_, ]+);", row)
    assert listed, row
    assert [r.strip() for r in listed.group(1).split(",")] == list(DUMP_REASONS)


def test_a_straggler_bundle_is_counted_as_straggler_without_folding():
    m = SupervisorMetrics("run")
    with structlog.testing.capture_logs() as logs:
        m.record_dump("straggler", ok=True, duration_s=0.3)
    assert value(m, "supervise_dumps_total", reason="straggler", result="ok") == 1
    assert value(m, "supervise_dumps_total", reason=OTHER, result="ok") == 0
    assert not [e for e in logs if e["event"] == "metrics_label_folded"], logs
