"""Real processes: fake ranks publish through their rings, the monitor catches divergence.

Each fake rank is a small torch-free Python process (fake_rank.py) that records
events the way the engine does and ends steps as fast as it can (or with a
short sleep).  Nothing here waits on a rank: the monitor reads shared memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tp_supervise.supervisor.rank.channel import rank_env
from tp_supervise.consensus.monitor import ConsensusMonitor, MonitorConfig

FAKE = Path(__file__).with_name("fake_rank.py")
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 30.0  # generous: 2 shared cores
POLL_S = 0.002


@pytest.fixture
def ranks(tmp_path):
    """Start fake ranks; SIGKILL and reap every one of them afterwards."""
    procs: list[subprocess.Popen] = []

    def start(n: int, *args: str, run_dir: Path = tmp_path, slots=None, **env_kw) -> list[subprocess.Popen]:
        started = []
        for slot in slots if slots is not None else range(n):
            env = dict(os.environ)
            env.update(rank_env(run_dir, slot, "observe", **env_kw))
            env["RANK"] = str(slot)
            env["PYTHONPATH"] = str(ROOT)
            proc = subprocess.Popen(
                [sys.executable, str(FAKE), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            procs.append(proc)
            started.append(proc)
        return started

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def poll_until(monitor: ConsensusMonitor, done, deadline_s: float = DEADLINE_S) -> list:
    verdicts = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        verdicts += monitor.poll(time.monotonic())
        if done(verdicts):
            return verdicts
        time.sleep(POLL_S)
    return verdicts


def finish(procs, monitor, steps) -> list:
    """Wait for the ranks to end cleanly; return the verdicts of every published step."""
    for proc in procs:
        out, err = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 0, err
        assert "done" in out
    return poll_until(monitor, lambda _v: monitor.counters().entries_read >= steps * len(procs))


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_two_ranks_divergence_caught_at_its_step(ranks, tmp_path):
    monitor = ConsensusMonitor(tmp_path, 2)
    procs = ranks(2, "--steps", "60", "--diverge-at", "20", "--step-sleep", "0.001")
    [v] = finish(procs, monitor, 60)
    assert v.step == 20 and v.culprit_ranks == (1,) and v.reference_ranks == (0,)
    assert v.first_difference.kinds == {0: "sample", 1: "sample"}
    expected = (20 * 31) % 1000
    assert v.values == {0: expected, 1: 17}
    assert "no majority in a two-way split" in v.verdict and "rank 1 diverged at step 20" in v.verdict
    c = monitor.counters()
    assert (c.comparisons, c.mismatches, c.verdicts, c.entries_lost) == (60, 1, 1, 0)
    monitor.close()


def test_three_ranks_majority_names_rank_0(ranks, tmp_path):
    monitor = ConsensusMonitor(tmp_path, 3)
    procs = ranks(3, "--steps", "30", "--diverge-at", "12", "--culprits", "0", "--step-sleep", "0.001")
    [v] = finish(procs, monitor, 30)
    assert v.step == 12 and v.culprit_ranks == (0,) and v.reference_ranks == (1, 2)
    assert v.decided_by == "majority" and "majority of 2 of 3" in v.verdict
    monitor.close()


def test_four_ranks_batch_divergence(ranks, tmp_path):
    monitor = ConsensusMonitor(tmp_path, 4)
    procs = ranks(4, "--steps", "30", "--diverge-at", "9", "--diverge-kind", "batch", "--culprits", "2")
    [v] = finish(procs, monitor, 30)
    assert v.step == 9 and v.culprit_ranks == (2,) and v.decided_by == "majority"
    fd = v.first_difference
    assert fd.index == 0 and fd.kinds[2] == "batch" and fd.path == ("lengths", 4)
    assert len(fd.events[0]["request_ids"]) == 5 and len(fd.events[2]["request_ids"]) == 4
    monitor.close()


def test_stopped_culprit_still_has_its_events_read(ranks, tmp_path):
    """Rank 1 SIGSTOPs right after diverging, rank 0 then blocks forever (a hung group)."""
    monitor = ConsensusMonitor(tmp_path, 2)
    good, bad = ranks(2, "--steps", "100", "--diverge-at", "15", "--then", "stop", "--hang-after", "16")
    verdicts = poll_until(monitor, lambda v: v)
    assert verdicts, "no verdict while the culprit is stopped"
    [v] = verdicts
    # the verdict may come from events read a moment before the culprit's own SIGSTOP lands
    deadline = time.monotonic() + 10.0
    while proc_state(bad.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc_state(bad.pid) == "T" and good.poll() is None and bad.poll() is None
    assert v.step == 15 and v.culprit_ranks == (1,)
    assert v.first_difference.values[1] == 17
    assert len(v.logs[1]) == 4 and v.event_counts == {0: 4, 1: 4}
    files = v.bundle_files()
    assert '"tokens":[17' in files["consensus/step-15-rank-1.jsonl"]
    # nothing else is reported while both ranks stay stuck
    assert poll_until(monitor, lambda v: v, deadline_s=0.3) == []
    monitor.close()


def test_third_rank_hung_before_the_step_does_not_delay_the_verdict(ranks, tmp_path):
    monitor = ConsensusMonitor(tmp_path, 3, config=MonitorConfig(mismatch_wait_s=0.3))
    ranks(2, "--steps", "12", "--diverge-at", "10", slots=[0, 1])
    ranks(1, "--steps", "12", "--hang-after", "9", slots=[2])
    [v] = poll_until(monitor, lambda v: v)
    assert v.step == 10 and v.culprit_ranks == (1,) and v.missing_ranks == (2,)
    assert v.ranks == (0, 1) and "two-way split" in v.verdict
    monitor.close()


def test_long_run_without_injection_reports_nothing(ranks, tmp_path):
    steps = 1500
    # fake ranks are not in lockstep (one may start 1000 steps later): keep every step pending
    monitor = ConsensusMonitor(tmp_path, 2, config=MonitorConfig(max_pending_steps=steps))
    procs = ranks(2, "--steps", str(steps), "--step-sleep", "0.0002", depth=4096)
    verdicts = []
    for proc in procs:
        while proc.poll() is None:
            verdicts += monitor.poll(time.monotonic())
            time.sleep(POLL_S)
    verdicts += finish(procs, monitor, steps)
    verdicts += poll_until(monitor, lambda _v: monitor.counters().comparisons >= steps, deadline_s=5)
    c = monitor.counters()
    assert verdicts == [] and c.mismatches == 0
    assert c.comparisons == steps and c.entries_lost == 0
    monitor.close()


def test_group_restart_replaces_rings_and_compares_afresh(ranks, tmp_path):
    monitor = ConsensusMonitor(tmp_path, 2, config=MonitorConfig(rescan_interval_s=0.0))
    assert finish(ranks(2, "--steps", "10"), monitor, 10) == []
    assert monitor.counters().comparisons == 10
    procs = ranks(2, "--steps", "10", "--diverge-at", "3")  # same slots, steps start at 0 again
    verdicts = finish(procs, monitor, 10)
    assert [v.step for v in verdicts] == [3] and verdicts[0].culprit_ranks == (1,)
    monitor.close()


def test_rank_that_never_records_only_expires_steps(ranks, tmp_path):
    monitor = ConsensusMonitor(tmp_path, 2, config=MonitorConfig(max_pending_steps=8))
    finish(ranks(1, "--steps", "20", slots=[0]), monitor, 20)
    c = monitor.counters()
    assert (c.comparisons, c.mismatches, c.expired, c.rings_open) == (0, 0, 12, 1)
    monitor.close()


def test_monitor_keeps_polling_past_garbage_rings(tmp_path):
    (tmp_path / "consensus").mkdir()
    (tmp_path / "consensus" / "slot-0.ring").write_bytes(b"garbage" * 20)
    monitor = ConsensusMonitor(tmp_path, 2)
    assert monitor.poll(time.monotonic()) == [] and monitor.counters().rings_open == 0
    with pytest.raises(ValueError):
        ConsensusMonitor(tmp_path, 2, groups=[[0, 1], [1]])
    monitor.close()


def test_stopped_ranks_never_block_poll(ranks, tmp_path):
    """poll() stays fast whatever the ranks do (here: all SIGSTOPped mid-run)."""
    monitor = ConsensusMonitor(tmp_path, 2)
    procs = ranks(2, "--steps", "100000", "--step-sleep", "0.0005")
    poll_until(monitor, lambda _v: monitor.counters().comparisons >= 20)
    for proc in procs:
        os.kill(proc.pid, signal.SIGSTOP)
    worst = 0.0
    for _ in range(200):
        t0 = time.monotonic()
        monitor.poll(t0)
        worst = max(worst, time.monotonic() - t0)
    assert worst < 0.5  # generous; typical is tens of microseconds
    monitor.close()


def test_batch_divergence_caught_while_the_step_is_in_progress(ranks, tmp_path):
    """Both ranks block inside step 10 (as in its first collective): it never publishes."""
    monitor = ConsensusMonitor(tmp_path, 2)
    ranks(1, "--steps", "50", "--freeze-in-step", "10", slots=[0])
    ranks(1, "--steps", "50", "--diverge-at", "10", "--diverge-kind", "batch", "--then", "hang-in-step", slots=[1])
    [v] = poll_until(monitor, lambda v: v)
    assert v.in_progress and v.step == 10 and v.culprit_ranks == (1,)
    fd = v.first_difference
    assert fd.index == 0 and fd.kinds == {0: "batch", 1: "batch"}
    assert "rank 1 diverged at step 10 (in progress): event #0 'batch'" in v.verdict
    assert v.event_counts == {0: 1, 1: 1}
    c = monitor.counters()
    assert (c.mismatches, c.verdicts, c.in_progress_verdicts, c.comparisons) == (1, 1, 1, 10)
    assert poll_until(monitor, lambda v: v, deadline_s=0.3) == []
    monitor.close()


def test_settle_after_a_rank_died_mid_step_names_the_divergence(ranks, tmp_path):
    """TP=3: rank 1 diverges and dies inside step 10 (as gloo aborts), rank 2 hangs before it.

    A plain poll waits for rank 2; settle(), which the supervisor calls when a
    rank exits, judges at once from the rings, the dead rank's included.
    """
    monitor = ConsensusMonitor(tmp_path, 3, config=MonitorConfig(mismatch_wait_s=600.0))
    ranks(1, "--steps", "50", "--freeze-in-step", "10", slots=[0])
    [dying] = ranks(
        1, "--steps", "50", "--diverge-at", "10", "--diverge-kind", "batch", "--then", "exit-in-step", slots=[1]
    )
    ranks(1, "--steps", "50", "--freeze-in-step", "9", slots=[2])
    assert dying.wait(timeout=DEADLINE_S) == 134
    assert poll_until(monitor, lambda v: v, deadline_s=1.0) == []  # poll waits for rank 2
    [v] = monitor.settle(time.monotonic())
    assert v.in_progress and v.step == 10 and v.culprit_ranks == (1,) and v.missing_ranks == (2,)
    assert "two-way split" in v.verdict
    monitor.close()
