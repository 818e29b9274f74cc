"""GPU telemetry: the no-NVML path here, the real path where a GPU exists, and the pure signature helper."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import structlog
from wdfakes import Driver, SteadyGroup

from tp_supervise.watchdogs.gpu import (
    BUSY_UTILIZATION_PCT,
    GpuProcess,
    GpuSample,
    GpuTelemetry,
    clock_event_reasons,
    explain_gpu,
    gpus_busy_without_progress,
    holding_memory,
)
from tp_supervise.watchdogs.policy import VerdictKind, WatchdogConfig


def _nvml_present() -> bool:
    t = GpuTelemetry()
    try:
        return t.available
    finally:
        t.close()


HAVE_NVML = _nvml_present()


@pytest.mark.skipif(HAVE_NVML, reason="this machine has NVML; the unavailable path is tested where it has none")
def test_without_nvml_is_quiet_and_empty():
    with structlog.testing.capture_logs() as logs:
        t = GpuTelemetry()
        assert t.available is False
        assert t.sample() == []
        assert holding_memory(t.sample(), {os.getpid()}) == []
        t.close()
        t.close()
    assert [(e["event"], e["log_level"]) for e in logs] == [("gpu telemetry unavailable", "info")]
    assert "NVML" in logs[0]["reason"] or "nvml" in logs[0]["reason"].lower()


def test_missing_pynvml_module_is_quiet(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # the module is really absent for this import
    with structlog.testing.capture_logs() as logs:
        t = GpuTelemetry()
    assert not t.available and t.sample() == [] and "pynvml" in t.reason
    assert len(logs) == 1 and logs[0]["log_level"] == "info"


@pytest.mark.skipif(not HAVE_NVML, reason="needs NVML and a GPU")
def test_real_gpus_report_memory_and_utilisation():
    t = GpuTelemetry()
    try:
        samples = t.sample()
        assert samples, "NVML is present but listed no GPU"
        for s in samples:
            assert s.uuid and s.memory_total and s.memory_total > 0
            assert s.utilization_pct is None or 0.0 <= s.utilization_pct <= 100.0
            # what a straggler verdict reads of the rank's GPU
            assert s.sm_clock_max_mhz is None or s.sm_clock_max_mhz > 0
            assert s.sm_clock_mhz is None or s.sm_clock_max_mhz is None or s.sm_clock_mhz <= s.sm_clock_max_mhz * 1.05
            assert s.temperature_c is None or 0 < s.temperature_c < 120
            assert s.clock_reasons is None or isinstance(s.clock_reasons, tuple)
    finally:
        t.close()


HOLDER = textwrap.dedent(
    """
    import sys, torch
    x = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("held", flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.skipif(not HAVE_NVML, reason="needs NVML and a GPU")
def test_process_holding_gpu_memory_is_found_and_released():
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    t = GpuTelemetry()
    try:
        if proc.stdout.readline().strip() != "held":
            pytest.skip("torch cannot allocate on the GPU here")
        held = holding_memory(t.sample(), {proc.pid})
        if not held:
            pytest.skip("NVML lists no PIDs of this namespace (container)")
        assert {pid for _gpu, pid, _b in held} == {proc.pid}
        proc.stdin.close()
        proc.wait(timeout=60)
        assert holding_memory(t.sample(), {proc.pid}) == []
    finally:
        t.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        if not proc.stdin.closed:
            proc.stdin.close()


# -- pure helpers -------------------------------------------------------------------


def gpu(index: int, util: float | None, pids: tuple[int, ...]) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        utilization_pct=util,
        power_w=300.0,
        memory_used=10 << 30,
        memory_total=80 << 30,
        processes=tuple(GpuProcess(p, 1 << 30) for p in pids),
    )


def verdicts():
    """(a stalled verdict, an ok verdict) from the real policy; rank pids are 1000 and 1001."""
    d = Driver(WatchdogConfig(soft_timeout=1.0, hard_timeout=2.0))
    g = SteadyGroup()
    ok = d.tick(g.advance(0.05))
    since = d.now
    for _ in range(15):
        d.tick(g.stopped(1, since))
    stalled = d.verdicts[-1]
    assert stalled.kind is VerdictKind.SUSPECT and ok.kind is VerdictKind.OK
    return stalled, ok


def test_busy_gpus_without_progress_signature():
    stalled, ok = verdicts()
    full = [gpu(0, 100.0, (1000,)), gpu(1, 99.0, (1001,))]
    assert gpus_busy_without_progress(full, stalled)
    assert not gpus_busy_without_progress(full, ok)
    assert not gpus_busy_without_progress([gpu(0, BUSY_UTILIZATION_PCT - 1, (1000,))], stalled)
    assert not gpus_busy_without_progress([gpu(0, None, (1000,))], stalled)
    assert not gpus_busy_without_progress([], stalled)


def test_signature_looks_at_the_ranks_gpus_then_falls_back_to_all():
    stalled, _ = verdicts()
    # Rank GPUs idle, another job's GPU busy: not our signature.
    assert not gpus_busy_without_progress([gpu(0, 0.0, (1000,)), gpu(1, 100.0, (77,))], stalled)
    # No GPU lists a rank PID (PID namespace): every GPU counts.
    assert gpus_busy_without_progress([gpu(0, 0.0, (5,)), gpu(1, 100.0, ())], stalled)


def test_holding_memory_filters_by_pid():
    samples = [gpu(0, 0.0, (10, 11)), GpuSample(1, "GPU-1", None, None, None, None, (GpuProcess(11, None),))]
    assert holding_memory(samples, {11}) == [(0, 11, 1 << 30), (1, 11, None)]
    assert holding_memory(samples, {99}) == []
    assert samples[1].to_dict()["processes"] == [{"pid": 11, "used_bytes": None}]


def test_clock_event_reasons_are_named_by_bit():
    assert clock_event_reasons(0) == ()
    assert clock_event_reasons(0x1) == ("idle",)
    assert clock_event_reasons(0x20 | 0x4) == ("software power cap", "software thermal slowdown")
    assert clock_event_reasons(0x40 | 0x800) == ("hardware thermal slowdown", "reason 0x800")


def _gpu(**kw) -> GpuSample:
    base = dict(index=1, uuid="GPU-1", utilization_pct=99.0, power_w=298.4, memory_used=1, memory_total=2,
                processes=(), sm_clock_mhz=1980, sm_clock_max_mhz=1980, temperature_c=61, clock_reasons=())
    base.update(kw)
    return GpuSample(**base)


def test_a_gpu_that_runs_slower_than_it_can_is_explained():
    hot = _gpu(sm_clock_mhz=1110, temperature_c=84, clock_reasons=("software thermal slowdown",))
    assert explain_gpu(hot) == "its GPU 1 ran at 1,110 of 1,980 MHz (software thermal slowdown, 84 C, 298 W)"
    capped = _gpu(sm_clock_mhz=1900, clock_reasons=("software power cap",))  # near its maximum, still capped
    assert "software power cap" in explain_gpu(capped)
    low = _gpu(sm_clock_mhz=900)  # lower clocks with no reason NVML gives
    assert explain_gpu(low).startswith("its GPU 1 ran at 900 of 1,980 MHz")


def test_a_gpu_at_full_clock_idle_or_on_chosen_clocks_is_not_a_reason():
    assert explain_gpu(_gpu()) == ""
    assert explain_gpu(_gpu(sm_clock_mhz=210, clock_reasons=("idle",))) == ""
    assert explain_gpu(_gpu(clock_reasons=("application clocks setting",))) == ""
    assert explain_gpu(_gpu(sm_clock_mhz=None, sm_clock_max_mhz=None, clock_reasons=None)) == ""
