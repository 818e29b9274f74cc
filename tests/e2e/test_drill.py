"""`supervise drill` runs the fault matrix and reports each kind's outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import MARK_VAR, ROOT, wait_no_marked

pytestmark = pytest.mark.e2e


def test_drill_crash_and_poison_kinds_pass_and_report_json(tmp_path):
    mark = "drill-" + os.urandom(4).hex()
    env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(tmp_path / "registry"), **{MARK_VAR: mark})
    done = subprocess.run(
        [sys.executable, "-m", "tp_supervise.supervisor.cli", "drill", "--kinds", "crash,poison", "--dump-dir",
         str(tmp_path), "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    crash, poison = json.loads(done.stdout)
    assert crash["kind"] == "crash" and crash["passed"]
    assert crash["exit_code"] == 80 and crash["culprit_ranks"] == [1]
    # the group restarted once (the injection fires in every attempt): a request sent after the fault was served
    assert 0 < crash["serving_again_s"] < 60
    assert poison["kind"] == "poison" and poison["passed"] and poison["exit_code"] == 0
    assert "request_quarantined" in poison["verdict"] and poison["serving_again_s"] is not None
    assert wait_no_marked(mark, timeout=3.0) == []


def test_drill_rejects_unknown_kinds(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tp_supervise.supervisor.cli", "drill", "--kinds", "meteor", "--dump-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 64 and "meteor" in done.stderr
