"""A bug of ours in an attempt's handler ends that attempt: exit 70 and a teardown (issue 37).

The incident desk's hard-hang handler raises (tests/fakes/raising_desk.py) after
the hang was ruled: the state is HUNG, the hard watchdog does not fire twice,
so before the fix the group stayed hung for ever.  Real ranks (a stopped one
in a real gloo all-reduce), the real supervisor.
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

GLOO = str(ROOT / "tests" / "fakes" / "gloo_loop.py")
RAISING_DESK = ROOT / "tests" / "fakes" / "raising_desk.py"
RUN_TIMEOUT_S = 90.0


@pytest.mark.slow
def test_a_hang_whose_handler_raises_ends_with_the_internal_error_exit_and_leaves_nothing(supervise, tmp_path):
    run = supervise(
        ["--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", "--kill-grace", "2",
         "--max-restarts", "3"],  # fmt: skip
        [sys.executable, GLOO, "--iters", "100000", "--fault", "stop", "--fault-at", "30"],
        entry=RAISING_DESK,
    )
    code = run.wait(timeout=RUN_TIMEOUT_S)
    assert code == 70, run.stderr[-4000:]
    assert run.events("hang"), run.stderr[-3000:]
    [failed] = run.events("event handling failed")
    assert failed["kind"] == "WatchdogVerdict"
    assert "the desk broke on purpose" in str(failed.get("exception", "")), failed
    assert run.events("teardown complete"), run.stderr[-3000:]
    assert not run.events("restarting the group"), "an internal error is not a fault of the engine's to restart"
    [exiting] = run.events("supervise exiting")
    assert exiting["reason"] == "internal_error"
