"""A stall a helper worked through is not a hang (watchdogs/policy.py, "A stall a helper worked through";
docs/watchdogs.md).

Real gloo ranks (tests/fakes/step_loop.py); 8 s into the run rank 1 runs a child process for 8 s inside its step
and waits for it, while rank 0 waits in the all-reduce: twice the 4 s hard bar.  A child that burns the CPU (as the
C++ compiler Inductor runs when a compiled model meets a new shape) is the rank working: no hang, one line that
names the child, the run ends by itself.  A child that only sleeps is no work: the stall is ruled at the bar and
rank 1 is named.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

LOOP = str(Path(__file__).resolve().parents[1] / "fakes" / "step_loop.py")
FLAGS = ["--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", "--kill-grace", "2"]


def loop(child: str) -> list[str]:
    return [sys.executable, LOOP, "--seconds", "20", "--step", "0.2", "--colls", "2",
            "--child-rank", "1", "--child-at", "8", "--child-s", "8", "--child", child]  # fmt: skip


def test_a_rank_waiting_on_a_compiler_it_runs_is_working_not_hung(supervise, tmp_path):
    run = supervise(FLAGS, loop("spin"), dump_dir=tmp_path / "dumps")
    assert run.wait(120) == 0, run.stderr[-4000:]
    said = [e.get("message", "") for e in run.lines_so_far() if e.get("event") == "rank_output"]
    assert any("child spin from" in m for m in said), said[-20:]
    working = run.events("stall_helper_working")
    assert working, "the compiler's work was not counted out: " + run.stderr[-4000:]
    line = working[0]
    assert line["helper"].startswith("python") and line["helper_pid"] and line["of_pid"], line
    assert not [e for e in run.lines_so_far() if e.get("event") in ("hang", "hang_suspected")], run.stderr[-4000:]
    assert not run.bundles(), run.bundles()


def test_a_rank_waiting_on_a_child_that_does_no_work_is_a_hang(supervise, tmp_path):
    run = supervise(FLAGS, loop("sleep"), dump_dir=tmp_path / "dumps")
    assert run.wait(120) == 81, run.stderr[-4000:]
    assert not run.events("stall_helper_working"), run.stderr[-4000:]
    (hang,) = [b for b in run.bundles() if b.name.endswith("-hang")]
    summary = json.loads((hang / "summary.json").read_text())
    assert summary["culprit_ranks"] == [1], summary["verdict"]
    assert "subprocess" in summary["ranks"]["1"]["stack_signature"], summary["ranks"]["1"]
