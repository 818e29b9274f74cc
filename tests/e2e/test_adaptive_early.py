"""Issue 11 acceptance: adaptive thresholds (no timeout flags) early in a run.

Real gloo processes with no supervisor code in the program (the zero-code
hook instruments torch.distributed).  The learner warms up on the progress
events the ranks report (``watchdogs/adaptive.py``), so a rank stopped about
a second after the first collective is killed within seconds, while an idle
group, a slow rank and a long first step are never called hung.

The fault instant is measured from outside the supervisor: the test watches
``/proc`` for the rank that SIGSTOPs itself.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import marked_pids

pytestmark = pytest.mark.e2e

GLOO = str(Path(__file__).resolve().parents[1] / "fakes" / "gloo_loop.py")
# Generous bounds: a shared 2-core machine, other suites running.
RUN_LIMIT_S = 150
FAULT_TO_EXIT_S = 30.0  # the bound: exit 81 within 30 s of the fault
POLL_S = 0.02
# ~1 s of the loop (0.01 s sleep per iteration, ~100 iterations per second;
# slower on a loaded host, which only moves the fault later).
EARLY_ITERATIONS = "100"


def gloo(*args: str) -> list[str]:
    return [sys.executable, GLOO, *args]


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode(errors="replace").rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


class StopWatch:
    """Notes the monotonic instant a process of the test stops itself (state T)."""

    def __init__(self, mark: str):
        self.mark = mark
        self.stopped_at: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-stopwatch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            if any(_state(pid) == "T" for pid in marked_pids(self.mark)):
                self.stopped_at = time.monotonic()
                return
            self._done.wait(POLL_S)

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)


def no_hang_bundle(run) -> None:
    assert run.bundles() == [], [b.name for b in run.bundles()]
    assert not run.events("hang suspected:") and not run.events("hang:"), run.stderr[-3000:]


def test_rank_stopped_a_second_after_the_first_collective_is_killed_within_30_s(supervise):
    run = supervise(
        ["--nproc-per-node", "2", "--kill-grace", "2"],
        gloo("--iters", "100000", "--fault", "stop", "--fault-at", EARLY_ITERATIONS),
    )
    watch = StopWatch(supervise.mark)
    try:
        code = run.wait(timeout=RUN_LIMIT_S)
    finally:
        watch.close()
    assert code == 81, run.stderr[-4000:]
    assert watch.stopped_at is not None, "rank 1 was never seen stopped"
    fault_to_exit = run.ended - watch.stopped_at
    assert fault_to_exit <= FAULT_TO_EXIT_S, (fault_to_exit, run.stderr[-3000:])
    hang = run.summary("-hang")
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["watchdog"]["hard_source"] == "learned", hang["watchdog"]
    print(f"fault -> exit {fault_to_exit:.2f} s, stalled_s {hang['stalled_s']}, "
          f"hard {hang['watchdog']['hard_timeout_seconds']} s, events {hang['watchdog']['adaptive']}")


@pytest.mark.slow  # a "not a hang" run needs tens of seconds of real time: make test-slow
def test_idle_after_an_early_start_is_not_a_hang(supervise):
    # Learned from the first 100 iterations, then every rank sleeps 7 s
    # outside collectives: longer than the learned hard threshold (the 3 s floor).
    run = supervise(
        ["--nproc-per-node", "2"],
        gloo("--iters", "140", "--idle", "7", "--fault-at", EARLY_ITERATIONS),
    )
    assert run.wait(timeout=RUN_LIMIT_S) == 0, run.stderr[-4000:]
    no_hang_bundle(run)


@pytest.mark.slow  # a "not a hang" run needs tens of seconds of real time: make test-slow
def test_slow_rank_is_not_a_hang(supervise):
    # After a fast start, rank 1 sleeps 0.5 s before each all_reduce: its peer
    # waits inside every one of them (busy, no progress for 0.5 s each time).
    run = supervise(
        ["--nproc-per-node", "2"],
        gloo("--iters", "125", "--slow", "0.5", "--fault-at", EARLY_ITERATIONS),
    )
    assert run.wait(timeout=RUN_LIMIT_S) == 0, run.stderr[-4000:]
    no_hang_bundle(run)


@pytest.mark.slow  # a "not a hang" run needs tens of seconds of real time: make test-slow
def test_long_first_step_is_not_a_hang(supervise):
    # The first iteration takes ~8 s on rank 1 (a model warm-up / compile),
    # rank 0 waits inside the first all_reduce all along; then a fast loop.
    run = supervise(
        ["--nproc-per-node", "2"],
        gloo("--iters", "300", "--first-step", "8"),
    )
    assert run.wait(timeout=RUN_LIMIT_S) == 0, run.stderr[-4000:]
    no_hang_bundle(run)
