"""Issue 4/5 acceptance on real gloo collectives, with no supervisor code in
the program (the zero-code hook instruments torch.distributed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.test_frtrace import frtrace

pytestmark = pytest.mark.e2e

GLOO = str(Path(__file__).resolve().parents[1] / "fakes" / "gloo_loop.py")


def gloo(*args: str) -> list[str]:
    return [sys.executable, GLOO, *args]


@pytest.fixture(scope="module")
def stopped_rank_hang(supervise_module):
    """Rank 1 SIGSTOPs itself at step 30 of a zero-code gloo loop: run once, asserted by the supervisor's
    verdict test and by the torchfrtrace test below."""
    run = supervise_module(
        ["--nproc-per-node", "2", "--soft-timeout", "3", "--hard-timeout", "6", "--kill-grace", "2"],
        gloo("--iters", "100000", "--fault", "stop", "--fault-at", "30"),
    )
    return run, run.wait(timeout=90)


def test_stopped_rank_soft_then_hard_hang(stopped_rank_hang):
    run, code = stopped_rank_hang
    assert code == 81, run.stderr[-4000:]
    names = [b.name for b in run.bundles()]
    assert any("hang_suspected" in n for n in names), names
    hang = run.summary("-hang")
    assert hang["reason"] == "hang"
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["ranks"]["1"]["state"] == "T"
    assert "stopped" in hang["verdict"]
    bundle = [b for b in run.bundles() if b.name.endswith("-hang") or "-hang-" in b.name][-1]
    rank0 = (bundle / "stacks" / "rank-0.txt").read_text()
    assert "all_reduce" in rank0
    assert (bundle / "stacks" / "rank-1.txt").read_text().strip()


def test_rank_stuck_in_python_outside_collectives(supervise):
    run = supervise(
        ["--nproc-per-node", "2", "--soft-timeout", "3", "--hard-timeout", "6", "--kill-grace", "2"],
        gloo("--iters", "100000", "--fault", "stall", "--fault-at", "30"),
    )
    assert run.wait(timeout=90) == 81, run.stderr[-4000:]
    hang = run.summary("-hang")
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    bundle = [b for b in run.bundles() if b.name.endswith("-hang") or "-hang-" in b.name][-1]
    assert "stuck_in_python" in (bundle / "stacks" / "rank-1.txt").read_text()


@pytest.mark.slow  # a "not a hang" run needs tens of seconds of real time: make test-slow
def test_idle_longer_than_hard_timeout_is_not_a_hang(supervise):
    run = supervise(
        ["--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4"],
        gloo("--iters", "40", "--idle", "7", "--fault-at", "20"),
    )
    assert run.wait(timeout=90) == 0, run.stderr[-4000:]
    assert run.bundles() == []


@pytest.mark.slow  # a "not a hang" run needs tens of seconds of real time: make test-slow
def test_slow_rank_under_soft_timeout_is_not_a_hang(supervise):
    run = supervise(
        ["--nproc-per-node", "2", "--soft-timeout", "3", "--hard-timeout", "6"],
        gloo("--iters", "24", "--slow", "2", "--fault-at", "20"),
    )
    assert run.wait(timeout=90) == 0, run.stderr[-4000:]
    assert run.bundles() == []


@pytest.mark.slow
def test_adaptive_default_detects_a_stopped_rank_well_under_a_minute(supervise):
    run = supervise(
        ["--nproc-per-node", "2", "--kill-grace", "2"],
        gloo("--iters", "100000", "--fault", "stop", "--fault-at", "1500", "--sleep", "0.005"),
    )
    assert run.wait(timeout=120) == 81, run.stderr[-4000:]
    hang = run.summary("-hang")
    assert hang["culprit_ranks"] == [1]
    stalled = hang.get("stalled_s")
    # Learned from ~12 s of steady collectives: seconds, not the 60 s warm-up default.
    assert stalled is not None and stalled < 20, stalled
    assert run.events("watchdog thresholds")[-1]["hard_source"] == "learned"


def test_torchfrtrace_reads_the_hang_bundle_of_a_zero_code_gloo_program(stopped_rank_hang):
    """Issue 13 (see test_frtrace.py): PyTorch's own analyzer reads this hang's bundle.  The stopped rank's
    worker server cannot answer, so ``fr/`` holds rank 0's trace only and ``torchfrtrace`` runs with
    ``--allow-incomplete-ranks``; without it, the analyzer names the rank whose file is missing."""
    run, code = stopped_rank_hang
    assert code == 81, run.stderr[-4000:]
    bundle = [b for b in run.bundles() if b.name.endswith("-hang") or "-hang-" in b.name][-1]
    summary = run.summary("-hang")
    assert summary["flight_recorder"]["collected"] == [0], summary["flight_recorder"]
    assert "stopped" in summary["flight_recorder"]["errors"]["1"]

    fr = bundle / "fr"
    assert sorted(p.name for p in fr.iterdir()) == ["rank-0"]
    assert (bundle / "fr-json" / "rank-0.json").is_file()

    done = frtrace("--allow-incomplete-ranks", str(fr))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # It knows the group has two ranks (the bundle completes gloo's group table) and says whose file is missing.
    assert "missed FR dumps from ranks ({1})" in done.stdout + done.stderr

    strict = frtrace(str(fr))
    assert strict.returncode != 0
    assert "Missing dump files from ranks {1}" in strict.stderr
