"""`supervise drill` runs the fault matrix and reports each kind's outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import MARK_VAR, ROOT, wait_no_marked

pytestmark = pytest.mark.e2e


def test_drill_crash_kind_passes_and_reports_json(tmp_path):
    mark = "drill-" + os.urandom(4).hex()
    env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(tmp_path / "registry"), **{MARK_VAR: mark})
    done = subprocess.run(
        [sys.executable, "-m", "tp_supervise.supervisor.cli", "drill", "--kinds", "crash", "--dump-dir", str(tmp_path), "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (result,) = json.loads(done.stdout)
    assert result["kind"] == "crash" and result["passed"]
    assert result["exit_code"] == 80 and result["culprit_ranks"] == [1]
    assert wait_no_marked(mark, timeout=3.0) == []


def test_drill_rejects_unknown_kinds(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tp_supervise.supervisor.cli", "drill", "--kinds", "meteor", "--dump-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 64 and "meteor" in done.stderr
