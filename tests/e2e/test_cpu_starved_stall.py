"""A stall the CPU caused is not a hang (watchdogs/policy.py, "A stall the CPU caused"; docs/watchdogs.md).

Real gloo ranks whose steps need the CPU (tests/fakes/step_loop.py --busy); rank 1 is moved into a cgroup v1 cpu
controller with a CFS quota of 5 % of a CPU, as a container's CPU limit throttles a process: each of its 0.3 s
compute segments then takes about 6 s, past the 4 s hard timeout, while its main thread waits on the run queue
for most of it.  Counted out, those waits leave the stall short of the bar: no hang, a warning that says why, and
the run ends by itself once the quota is lifted.  (A stopped rank waits for no CPU: the hang tests rule it at the
bar as before.)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.conftest import MARK_VAR

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # tens of seconds of throttled steps: make test-slow

LOOP = str(Path(__file__).resolve().parents[1] / "fakes" / "step_loop.py")
THROTTLED_S = 20.0  # three or four of rank 1's throttled segments, each past the hard bar


def _rank_pid(mark: str, rank: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = b"\0" + (entry / "environ").read_bytes()
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"step_loop.py" in cmd and f"\0{MARK_VAR}={mark}\0".encode() in env and f"\0RANK={rank}\0".encode() in env:
            return int(entry.name)
    return None


def test_a_rank_throttled_past_the_hard_bar_is_counted_out_not_ruled_a_hang(supervise, tmp_path):
    from tests.dumps.test_slowness import cpu_cgroup_v1
    from tests.live import wait_for

    with cpu_cgroup_v1(quota_us=5_000) as cgroup:
        run = supervise(
            ["--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", "--kill-grace", "2"],
            [sys.executable, LOOP, "--seconds", str(10 + THROTTLED_S + 10), "--busy", "--step", "0.6", "--colls", "1"],
            dump_dir=tmp_path / "dumps",
        )
        pids: dict[int, int] = {}

        def rank1() -> bool:
            pid = _rank_pid(supervise.mark, 1)
            if pid is not None:
                pids[1] = pid
            return pid is not None

        wait_for(rank1, 60, "rank 1 running")
        time.sleep(10)  # steps at their own pace first
        for tid in (Path("/proc") / str(pids[1]) / "task").iterdir():
            (cgroup / "tasks").write_text(tid.name)
        throttled_at = time.monotonic()
        while time.monotonic() - throttled_at < THROTTLED_S:
            assert run.proc.poll() is None, "supervise ended while rank 1 was throttled: " + run.stderr[-4000:]
            time.sleep(0.5)
        for tid in (Path("/proc") / str(pids[1]) / "task").iterdir():  # the quota lifted: rank 1 back in the root
            try:
                (cgroup.parent / "tasks").write_text(tid.name)
            except OSError:
                pass
        assert run.wait(120) == 0, run.stderr[-4000:]
    starved = run.events("stall_cpu_starved")
    assert starved, "no stall past the hard bar was counted out: " + run.stderr[-4000:]
    line = starved[0]
    assert line["stalled_s"] >= 4.0 and line["cpu_wait_s"] > 1.0, line
    assert not [e for e in run.lines_so_far() if e.get("event") == "hang"], run.stderr[-4000:]
    assert not [b for b in run.bundles() if b.name.endswith("-hang")], run.bundles()
