"""What a named straggler's bundle carries about why: the slow rank's and a peer's /proc counters over the
window and, where NVML reports the GPU holding the rank, its clocks and why they are low.

Real processes stand in for the ranks (their /proc is read); the GPU reading is the sampler's published
type, built here because this machine has no NVML (tests/watchdogs/test_gpu_telemetry.py reads a real one
where a GPU exists)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

from tp_supervise.supervisor.observers.straggler_thread import StragglerThread
from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.watchdogs.gpu import GpuProcess, GpuReading, GpuSample
from tp_supervise.watchdogs.straggler import StragglerConfig


def _gpu(index: int, pid: int, clock: int, reasons: tuple[str, ...]) -> GpuSample:
    return GpuSample(index=index, uuid=f"GPU-{index}", utilization_pct=100.0, power_w=700.0, memory_used=1 << 30,
                     memory_total=80 << 30, processes=(GpuProcess(pid, 1 << 30),), sm_clock_mhz=clock,
                     sm_clock_max_mhz=1980, temperature_c=88 if reasons else 60, clock_reasons=reasons)


def test_the_evidence_names_the_slow_ranks_gpu_clocks_and_its_cpu_counters(tmp_path):
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    seg = hb.HeartbeatSegment(tmp_path / "hb", 2, uuid.uuid4().hex, time.monotonic())
    try:
        pids = {0: ranks[0].pid, 1: ranks[1].pid}
        reading = GpuReading(samples=(_gpu(0, pids[0], 1980, ()), _gpu(1, pids[1], 1110, ("hardware thermal slowdown",))),
                             at=time.monotonic(), seq=1)
        thread = StragglerThread(StragglerConfig(), seg, attempt=lambda: None, post=lambda _e: None,
                                 on_report=lambda _r: None, gpu=lambda: reading)
        thread._sample(pids, time.monotonic())
        time.sleep(0.2)
        evidence = thread._evidence(1, pids)
        no_gpu = StragglerThread(StragglerConfig(), seg, attempt=lambda: None, post=lambda _e: None,
                                 on_report=lambda _r: None, gpu=lambda: None)
        no_gpu._sample(pids, time.monotonic())
        without = no_gpu._evidence(1, pids)
    finally:
        seg.close()
        for p in ranks:
            p.kill()
            p.wait()
    assert set(evidence["ranks"]) == {"0", "1"}, "the slow rank's and one peer's /proc deltas"
    assert evidence["ranks"]["1"]["window_seconds"] >= 0.2 and evidence["ranks"]["1"]["pid"] == pids[1]
    assert evidence["gpu"]["1"]["sm_clock_mhz"] == 1110 and evidence["gpu"]["0"]["index"] == 0
    assert "its GPU 1 ran at 1,110 of 1,980 MHz (hardware thermal slowdown, 88 C, 700 W)" in evidence["explanation"]
    assert without["gpu"] == {} and "GPU" not in without["explanation"]


def test_a_rank_moved_into_a_cpu_limited_cgroup_during_the_window_is_said_to_be_throttled(tmp_path):
    """Readings before the move are of another cgroup: the throttling is counted from the first reading in the
    cgroup the rank is in now (the benchmark's quota trials read "CPU contention" before this)."""
    from tests.dumps.test_slowness import busy, cpu_cgroup_v1

    seg = hb.HeartbeatSegment(tmp_path / "hb", 2, uuid.uuid4().hex, time.monotonic())
    try:
        with cpu_cgroup_v1(quota_us=10_000) as cgroup, busy() as slow, busy() as peer:
            pids = {0: peer.pid, 1: slow.pid}
            thread = StragglerThread(StragglerConfig(), seg, attempt=lambda: None, post=lambda _e: None,
                                     on_report=lambda _r: None)
            thread._sample(pids, time.monotonic())  # before the move: the root cgroup
            time.sleep(0.3)
            (cgroup / "cgroup.procs").write_text(str(slow.pid))
            thread._sample(pids, time.monotonic())  # in the limited cgroup
            time.sleep(1.5)
            evidence = thread._evidence(1, pids)
    finally:
        seg.close()
    assert "throttled by its cgroup" in evidence["explanation"], evidence
    assert evidence["ranks"]["1"]["cgroup_throttled_share"] > 0.3, evidence["ranks"]["1"]
