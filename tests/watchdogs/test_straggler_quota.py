"""A rank throttled hard by a cgroup CPU quota is named (issue 26), on real gloo ranks under `supervise serve`.

The issue's run: TP=2, a plain torch.distributed gloo loop whose ranks compute by spinning the CPU
(tests/fakes/step_loop.py ``--busy``: zero code, the hook stamps the arrivals), rank 1 moved into a cgroup v1
``cpu`` child with ``cpu.cfs_quota_us`` 15000 of ``cpu.cfs_period_us`` 100000 (15 % of one CPU: it wants a
whole one, so it runs about 6x slower) 15 s after `supervise serve` started, default straggler flags.  15 s
in, the detector is still warming up or learning the ranks' baselines: a slowdown that begins there must be
named anyway, within 30 s of the throttle, and the run goes on (a straggler is not fatal by default).  It was
named 32-42 s after the throttle, or never: judged by its excess over a baseline only once warm-up and
learning were over (and over a baseline learned at its throttled pace when the throttle came early in the
learning), or by a gross share of half the group's time bucket by bucket, which its measured share (40-65 %:
part of its slowness falls inside the collectives, after its arrival) crosses in some buckets only.

Needs root and the cgroup v1 ``cpu`` controller (skipped otherwise).  The 30 s bound is the issue's
acceptance; everything else is generous (the run's own length, start-up on a loaded host).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, marked_pids
from tests.dumps.test_slowness import cpu_cgroup_v1
from tests.live import wait_for

LOOP = ROOT / "tests" / "fakes" / "step_loop.py"
CPU_V1 = Path("/sys/fs/cgroup/cpu")
QUOTA_US, PERIOD_US = 15_000, 100_000
THROTTLE_AT_S = 15.0  # after `supervise serve` started, as in the issue
RUN_S = 60.0  # the loop's length (rank 0's clock)
NAMED_WITHIN_S = 30.0  # the acceptance
START_S = 60.0  # generous: two torch imports and a gloo rendezvous on a loaded host

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,  # make test-slow: a 60 s loop
    pytest.mark.skipif(
        os.geteuid() != 0 or not (CPU_V1 / "cpu.cfs_quota_us").exists(),
        reason="needs root and the cgroup v1 cpu controller",
    ),
]


def _rank_pid(mark: str, rank: int) -> int | None:
    """The pid of the run's rank ``rank`` (its environment says RANK; the loop is its program)."""
    for pid in marked_pids(mark):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and str(LOOP).encode() in cmdline:
            return pid
    return None


def _cpu_stat(cgroup: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in (cgroup / "cpu.stat").read_text().splitlines())}


def test_a_rank_throttled_to_15_percent_of_a_cpu_is_named_within_30_s_and_the_run_goes_on(supervise):
    command = [sys.executable, str(LOOP), "--seconds", str(RUN_S), "--step", "0.05", "--colls", "8", "--busy"]
    with cpu_cgroup_v1(QUOTA_US, PERIOD_US) as cgroup:  # removed on exit (rank 1 has exited by then)
        run = supervise(["--nproc-per-node", "2"], command)
        pid = wait_for(lambda: _rank_pid(supervise.mark, 1), START_S, "rank 1 running")
        time.sleep(max(0.0, run.started + THROTTLE_AT_S - time.monotonic()))
        (cgroup / "cgroup.procs").write_text(str(pid))  # every thread of it, and whatever it starts later
        throttled_at = time.monotonic()
        code = run.wait(RUN_S + 120)  # kills the run's processes if it does not end
        stat = _cpu_stat(cgroup)
    assert code == 0, f"a straggler is not fatal by default\n{run.stderr[-3000:]}"
    assert stat["nr_throttled"] >= 0.5 * stat["nr_periods"] > 0, f"the quota did not hold rank 1 back: {stat}"
    named = run.events("straggler_named")
    assert [line["rank"] for line in named] == [1], f"rank 1, and only it, named\n{run.stderr[-4000:]}"
    summary = run.summary("straggler")
    event = summary["straggler"]["event"]
    assert event["rank"] == 1
    after = event["at"] - throttled_at
    print(f"named {after:.1f} s after the throttle ({stat}): {summary['verdict']}")  # shown with -s
    assert 0 < after <= NAMED_WITHIN_S, f"named {after:.1f} s after the throttle: {summary['verdict']}"
    assert "throttled by its cgroup" in summary["verdict"], summary["verdict"]
    # The run went on: the loop ran to its end (the clean finish of both ranks), nothing stopped at the naming.
    assert run.events("run_finished") and not run.events("rank_exited"), run.stderr[-3000:]
    assert run.ended - throttled_at > after + 5, "the supervisor outlived the naming by the loop's remaining time"
