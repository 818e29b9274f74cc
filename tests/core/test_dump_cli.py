"""`supervise dump` and `supervise analyze` against a running supervised job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT, fake_rank, marked_pids
from tests.live import wait_registry


def _cli(*args: str, registry, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(registry))
    return subprocess.run(
        [sys.executable, "-m", "tp_supervise.supervisor.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_on_demand_dump_keeps_the_job_running_and_analyze_renders_it(supervise, tmp_path):
    registry = tmp_path / "registry"
    run = supervise(["--nproc-per-node", "2"], fake_rank("--all", "loop"))
    entry = wait_registry(registry)
    assert oct(os.stat(entry["socket"]).st_mode & 0o777) == "0o600"
    time.sleep(1.0)
    t0 = time.monotonic()
    done = _cli("dump", registry=registry)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 10
    bundle = done.stdout.strip().splitlines()[-1]
    summary = json.loads(open(os.path.join(bundle, "summary.json")).read())
    assert summary["reason"] == "on_demand"
    assert set(summary["ranks"]) == {"0", "1"}
    assert run.proc.poll() is None, "the job must keep running after an on-demand dump"
    assert len(marked_pids(supervise.mark)) >= 3

    shown = _cli("analyze", bundle, registry=registry)
    assert shown.returncode == 0, shown.stderr
    assert "on_demand" in shown.stdout
    as_json = _cli("analyze", bundle, "--json", registry=registry)
    assert json.loads(as_json.stdout)["reason"] == "on_demand"

    wrong = _cli("dump", "--run-id", "no-such-run", registry=registry)
    assert wrong.returncode == 2 and "no-such-run" in wrong.stderr
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 0


def test_dump_without_a_job_says_so(tmp_path):
    done = _cli("dump", registry=tmp_path / "empty")
    assert done.returncode == 2
    assert "no supervised job" in done.stderr


def test_analyze_rejects_a_non_bundle(tmp_path):
    done = _cli("analyze", str(tmp_path), registry=tmp_path)
    assert done.returncode == 2
