"""`supervise drill` runs the fault matrix and reports each kind's outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import MARK_VAR, ROOT, wait_no_marked
from tp_supervise.supervisor.rank.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # tens of seconds of real time each: make test-slow


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


def drill(tmp_path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tp_supervise.supervisor.cli", "drill", "--dump-dir", str(tmp_path), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--kinds", "crash", "--", "sleep", "1"], "crash"),  # an inject kind needs the built-in engine
        (["--serve-flags=--relay 127.0.0.1:1", "--", "sleep", "1"], "--relay"),
        (["--serve-flags=--tree 'unclosed", "--", "sleep", "1"], "--serve-flags"),
        (["--serve-flags=--tree"], "COMMAND"),  # serve flags without a COMMAND
    ],
)
def test_a_command_drill_refuses_bad_flags_before_anything_starts(tmp_path, args, said):
    done = drill(tmp_path, *args)
    assert done.returncode == 64 and said in done.stderr, done.stderr
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_command_drill_kills_rank_1_behind_the_relay_and_times_serving_again(tmp_path):
    """The built-in engine run as a COMMAND on its own port (the drill knows nothing of it): rank 1 SIGKILLed
    under load, the group restarts once, no client sees an error (the relay holds what was in flight)."""
    mark = "drill-" + os.urandom(4).hex()
    up = free_port()
    engine = [sys.executable, "-m", "tp_supervise.engine", "--port", str(up), "--host", "127.0.0.1"]
    flags = f"--nproc-per-node 2 --kill-grace 3 --relay-upstream http://127.0.0.1:{up}"
    env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(tmp_path / "registry"), **{MARK_VAR: mark})
    done = subprocess.run(
        [sys.executable, "-m", "tp_supervise.supervisor.cli", "drill", "--kinds", "kill", "--dump-dir",
         str(tmp_path / "drill"), "--json", f"--serve-flags={flags}", "--ready-timeout", "120", "--load-before", "3", "--", *engine],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (kill,) = json.loads(done.stdout)
    assert kill["kind"] == "kill_rank" and kill["passed"] and kill["localised"], kill
    seen = kill["observed"]
    assert kill["exit_code"] == 0 and seen["reason"] == "rank_exit" and (seen["culprit_role"], seen["culprit_rank"]) == ("rank", 1)
    assert seen["client_errors"] == 0 and seen["streams_cut"] == 0 and 0 <= seen["verdict_s"] < 10, kill
    assert 0 < seen["serving_again_s"] < 120 and seen["leftovers"] == [], kill
    assert wait_no_marked(mark, timeout=3.0) == []
