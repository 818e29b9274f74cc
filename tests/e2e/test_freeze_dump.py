"""Freeze, then dump (issue 11), end to end on real gloo collectives.

A fatal verdict (hard hang, enforced divergence) stops every rank before
any evidence is taken, so the bundle is one snapshot and no rank races to
abort while the others are read; the ranks are resumed for their flight
recorders, then torn down.  A soft dump never stops a rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.e2e.test_engine_supervised import EXIT_TIMEOUT_S, Load, fatal_bundles, serve

pytestmark = pytest.mark.e2e

GLOO = str(Path(__file__).resolve().parents[1] / "fakes" / "gloo_loop.py")
# Where rank 1's stacks come from (see dumps/capture.py and supervisor/rank/runtime.py).
DEATH_DUMP_GAP = (
    "rank 1 aborts inside gloo (std::terminate on the size mismatch) within about a millisecond of "
    "entering the collective, before the out-of-band verdict (polled every 5 ms) can freeze it; its "
    "stacks come from the faulthandler the rank side enables for fatal signals on its stack file"
)


def stacks(bundle: Path, rank: int) -> str:
    text = (bundle / "stacks" / f"rank-{rank}.txt").read_text()
    return text.split("\n\n", 1)[1] if "\n\n" in text else ""


@pytest.mark.slow
def test_enforced_divergence_freezes_the_group_before_the_dump(supervise):
    run, port = serve(supervise, "--kill-grace", "2", "--control-plane", "replicated", "--consensus", "enforce",
                      "--inject", "diverge_batch@1:20")
    load = Load(port).start()
    code = run.wait(timeout=EXIT_TIMEOUT_S)
    load.stop()
    assert code == 82, run.stderr[-4000:]
    [bundle] = fatal_bundles(run)
    summary = json.loads((bundle / "summary.json").read_text())
    assert summary["reason"] == "divergence"
    assert summary["culprit_ranks"] == [1], summary["verdict"]
    freeze = summary["capture"]["freeze"]
    assert 0 in freeze["stopped_ranks"], freeze
    # The peer's stacks were read while it was stopped.  Where it was stopped is a race of milliseconds with
    # gloo, which releases it from the mismatched collective as rank 1 aborts: usually still inside the
    # all_reduce, else on the path of the failed collective (measured in docs/benchmarks.md, "freeze race").
    peer = stacks(bundle, 0)
    assert "all_reduce" in peer or "fail_group" in peer, (bundle / "stacks" / "rank-0.txt").read_text()
    assert summary["ranks"]["0"]["stack_method"] == "py-spy --nonblocking"
    culprit = (bundle / "stacks" / "rank-1.txt").read_text()
    # rank 1 aborts inside gloo before any freeze; its stacks come from its own dump at death
    assert "all_reduce" in stacks(bundle, 1), DEATH_DUMP_GAP + "\n" + culprit[:400]


def test_a_hard_hang_freezes_every_rank_then_reads_the_flight_recorders(supervise):
    run = supervise(
        ["--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", "--kill-grace", "2"],
        [sys.executable, GLOO, "--iters", "100000", "--fault", "stop", "--fault-at", "30"],
    )
    assert run.wait(timeout=90) == 81, run.stderr[-4000:]
    hang = run.summary("-hang")
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["ranks"]["1"]["state"] == "T" and hang["ranks"]["0"]["state"] != "T"  # as before the freeze
    freeze = hang["capture"]["freeze"]
    assert freeze["stopped_ranks"] == [0] and freeze["already_stopped_ranks"] == [1], freeze
    bundle = [b for b in run.bundles() if b.name.endswith("-hang")][-1]
    assert "all_reduce" in stacks(bundle, 0)
    assert stacks(bundle, 1).strip()
    # Rank 0 was resumed for its flight recorder; rank 1, stopped by the fault, could not answer.
    fr = hang["flight_recorder"]
    assert 0 in fr["collected"], fr
    assert "stopped" in fr["errors"].get("1", ""), fr
    # The soft dump before it never stopped a rank.
    soft = run.summary("hang_suspected")
    assert "freeze" not in soft["capture"]
