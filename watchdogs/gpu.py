"""GPU telemetry through NVML (nvidia-ml-py), for hang evidence and teardown checks.

A hang in a TP group looks like work from the outside: peers spin inside a
collective at full utilisation.  "GPUs busy, no progress" is therefore part
of the hang evidence, and after teardown the supervisor checks that no process
of the run still holds GPU memory.

A wedged GPU driver can block an NVML call for ever, so the supervisor never
calls NVML on a thread that matters: ``GpuSampler`` initialises NVML and
samples it on its own thread (``gpu-sampler``) and publishes the latest
reading; the watchdog, the incident desk and the metrics read that cache.
Teardown's "GPU memory released" check asks the sampler for a fresh reading
and waits for it with a deadline (``GpuSampler.fresh``).

Without NVML (no driver, no GPU, library missing) ``available`` is False,
one info line says why, and every method returns empty results.  NVML errors
never propagate: a call that fails leaves its field ``None``.

Note: inside a container NVML may report host PIDs, which then match none of
the ranks' PIDs; ``gpus_busy_without_progress`` falls back to every GPU then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from .policy import Verdict

log = structlog.get_logger()

MILLIWATTS_PER_WATT = 1000.0
# A GPU at or above this utilisation while its group makes no progress is "busy".
BUSY_UTILIZATION_PCT = 90.0

T = TypeVar("T")


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None: the driver does not say (e.g. no permission)


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment; a field is None when NVML could not read it."""

    index: int
    uuid: str
    utilization_pct: float | None
    power_w: float | None
    memory_used: int | None
    memory_total: int | None
    processes: tuple[GpuProcess, ...]
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    temperature_c: int | None = None
    clock_reasons: tuple[str, ...] | None = None  # why the clocks are below their maximum (clock_event_reasons)

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "utilization_pct": self.utilization_pct,
            "power_w": self.power_w,
            "memory_used_bytes": self.memory_used,
            "memory_total_bytes": self.memory_total,
            "processes": [{"pid": p.pid, "used_bytes": p.used_bytes} for p in self.processes],
            "sm_clock_mhz": self.sm_clock_mhz,
            "sm_clock_max_mhz": self.sm_clock_max_mhz,
            "temperature_c": self.temperature_c,
            "clock_reasons": None if self.clock_reasons is None else list(self.clock_reasons),
        }


# NVML's clocks event (formerly "throttle") reasons, by bit (nvmlClocksEventReason*/nvmlClocksThrottleReason*).
CLOCK_REASONS = (
    (0x1, "idle"),
    (0x2, "application clocks setting"),
    (0x4, "software power cap"),
    (0x8, "hardware slowdown"),
    (0x10, "sync boost"),
    (0x20, "software thermal slowdown"),
    (0x40, "hardware thermal slowdown"),
    (0x80, "power brake"),
    (0x100, "display clock setting"),
    (0x200, "board limit"),
    (0x400, "reliability"),
)
# Reasons that slow a busy GPU down against its will (not idle, not a setting an operator chose).
SLOWING_REASONS = frozenset(
    {
        "software power cap",
        "hardware slowdown",
        "software thermal slowdown",
        "hardware thermal slowdown",
        "power brake",
        "board limit",
        "reliability",
    }
)
CLOCK_NOTABLE = 0.9  # an SM clock below this share of its maximum is worth a word


def clock_event_reasons(mask: int) -> tuple[str, ...]:
    """The names of the bits set in an NVML clocks event reasons mask (unknown bits as hex)."""
    names = [name for bit, name in CLOCK_REASONS if mask & bit]
    unknown = mask & ~sum(bit for bit, _ in CLOCK_REASONS)
    if unknown:
        names.append(f"reason {unknown:#x}")
    return tuple(names)


def explain_gpu(sample: GpuSample) -> str:
    """A sentence fragment when the GPU runs slower than it can ("its GPU 1 ran at 1,110 of 1,980 MHz
    (software thermal slowdown, 84 C, 298 W)"), else "" (the reasons an operator chose or idleness are no
    slowdown)."""
    slowing = [r for r in (sample.clock_reasons or ()) if r in SLOWING_REASONS]
    low = (
        sample.sm_clock_mhz is not None
        and sample.sm_clock_max_mhz
        and sample.sm_clock_mhz < CLOCK_NOTABLE * sample.sm_clock_max_mhz
        and "idle" not in (sample.clock_reasons or ())
    )
    if not slowing and not low:
        return ""
    clock = (
        f"ran at {sample.sm_clock_mhz:,} of {sample.sm_clock_max_mhz:,} MHz"
        if sample.sm_clock_mhz is not None and sample.sm_clock_max_mhz
        else "had its clocks lowered"
    )
    details = list(slowing)
    if sample.temperature_c is not None:
        details.append(f"{sample.temperature_c} C")
    if sample.power_w is not None:
        details.append(f"{sample.power_w:.0f} W")
    return f"its GPU {sample.index} {clock}" + (f" ({', '.join(details)})" if details else "")


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class GpuTelemetry:
    """NVML, initialised once.  Thread safe; call ``close()`` at shutdown."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._reported: set[str] = set()
        self.available = False
        self.reason = ""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded …
            self.reason = f"{type(exc).__name__}: {exc}"
            log.info("gpu telemetry unavailable", reason=self.reason)
            return
        self._nvml = pynvml
        self.available = True
        log.info("gpu telemetry enabled", gpus=self._call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount))

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T | None:
        """One guarded NVML call: None on any error (each kind of failure logged once)."""
        try:
            return fn(*args)
        except Exception as exc:
            key = f"{what}:{type(exc).__name__}"
            if key not in self._reported:
                self._reported.add(key)
                log.info("nvml call failed", call=what, error=f"{type(exc).__name__}: {exc}")
            return None

    def _processes(self, handle: Any) -> tuple[GpuProcess, ...]:
        nvml = self._nvml
        seen: dict[int, GpuProcess] = {}
        for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(nvml, name, None)
            if fn is None:
                continue
            for proc in self._call(name, fn, handle) or ():
                pid = int(getattr(proc, "pid", 0) or 0)
                used = getattr(proc, "usedGpuMemory", None)
                if pid and pid not in seen:
                    seen[pid] = GpuProcess(pid, int(used) if isinstance(used, int) else None)
        return tuple(seen[p] for p in sorted(seen))

    def _device(self, index: int) -> GpuSample | None:
        nvml = self._nvml
        handle = self._call("nvmlDeviceGetHandleByIndex", nvml.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            return None
        uuid = self._call("nvmlDeviceGetUUID", nvml.nvmlDeviceGetUUID, handle)
        util = self._call("nvmlDeviceGetUtilizationRates", nvml.nvmlDeviceGetUtilizationRates, handle)
        power = self._call("nvmlDeviceGetPowerUsage", nvml.nvmlDeviceGetPowerUsage, handle)
        mem = self._call("nvmlDeviceGetMemoryInfo", nvml.nvmlDeviceGetMemoryInfo, handle)
        sm = getattr(nvml, "NVML_CLOCK_SM", 1)
        clock = self._call("nvmlDeviceGetClockInfo", nvml.nvmlDeviceGetClockInfo, handle, sm)
        clock_max = self._call("nvmlDeviceGetMaxClockInfo", nvml.nvmlDeviceGetMaxClockInfo, handle, sm)
        temperature = self._call(
            "nvmlDeviceGetTemperature", nvml.nvmlDeviceGetTemperature, handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        )
        # nvml-py 12.535+ names it "clocks event reasons"; older bindings only "throttle reasons".
        reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        reasons = self._call("nvmlDeviceGetCurrentClocksEventReasons", reasons_fn, handle) if reasons_fn else None
        return GpuSample(
            index=index,
            uuid=_text(uuid) if uuid is not None else "",
            utilization_pct=float(util.gpu) if util is not None else None,
            power_w=power / MILLIWATTS_PER_WATT if power is not None else None,
            memory_used=int(mem.used) if mem is not None else None,
            memory_total=int(mem.total) if mem is not None else None,
            processes=self._processes(handle),
            sm_clock_mhz=int(clock) if clock is not None else None,
            sm_clock_max_mhz=int(clock_max) if clock_max is not None else None,
            temperature_c=int(temperature) if temperature is not None else None,
            clock_reasons=clock_event_reasons(int(reasons)) if reasons is not None else None,
        )

    def sample(self) -> list[GpuSample]:
        """Every GPU's utilisation, power, memory and processes (empty without NVML)."""
        with self._lock:
            if not self.available:
                return []
            count = self._call("nvmlDeviceGetCount", self._nvml.nvmlDeviceGetCount) or 0
            out = []
            for index in range(count):
                sample = self._device(index)
                if sample is not None:
                    out.append(sample)
            return out

    def close(self) -> None:
        with self._lock:
            if self.available:
                self._call("nvmlShutdown", self._nvml.nvmlShutdown)
            self.available = False


@dataclass(frozen=True)
class GpuReading:
    """One published sample of every GPU, taken at ``at`` (time.monotonic) on the sampler thread."""

    samples: tuple[GpuSample, ...]
    at: float
    seq: int  # 1 for the first reading, +1 for each one after

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.at)


class GpuSampler:
    """NVML on its own named thread; everyone else reads ``latest()``.

    The thread creates the ``GpuTelemetry`` (``nvmlInit`` may block too),
    then samples every ``interval_s`` or at once when ``fresh`` asks.  No
    other thread ever calls NVML, so a call that never returns stalls only
    this thread: ``latest()`` keeps the last reading, ``fresh()`` answers
    None after its deadline (at once while a call is already overdue), and
    ``stop()`` gives up on the thread after its join limit (it is a daemon).
    """

    def __init__(
        self,
        interval_s: float,
        telemetry: Callable[[], GpuTelemetry] = GpuTelemetry,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.interval_s = interval_s
        self._make_telemetry = telemetry
        self._clock = clock
        self._cond = threading.Condition()
        self._latest: GpuReading | None = None
        self._wanted = 0  # readings asked for by ``fresh`` (seq to reach)
        self._busy_since: float | None = None  # an NVML call (init or sample) is running since
        self._stopping = False
        self.available = False
        self.reason = "not initialised yet"
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float) -> bool:
        """Stop and join at most ``join_s``; False when the thread is stuck in NVML (left behind)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join(join_s)
        stuck = self._thread.is_alive()
        if stuck:
            log.warning("gpu sampler did not stop: an NVML call is not returning (left behind)", waited_s=join_s)
        return not stuck

    def latest(self) -> GpuReading | None:
        """The last reading (None before the first, or without NVML); never waits."""
        return self._latest

    def wedged(self, limit_s: float) -> bool:
        """Whether an NVML call has been running for longer than ``limit_s``."""
        since = self._busy_since
        return since is not None and self._clock() - since > limit_s

    def fresh(self, timeout_s: float) -> tuple[GpuSample, ...] | None:
        """A reading taken after this call, waited for at most ``timeout_s``; None when
        NVML is unavailable, did not answer in time, or is already stuck in a call."""
        if not self.available or self.wedged(timeout_s):
            return None
        deadline = self._clock() + timeout_s
        with self._cond:
            current = self._latest.seq if self._latest is not None else 0
            # A sample already running may have read the GPUs before this call: ask for the one after it.
            target = current + (2 if self._busy_since is not None else 1)
            self._wanted = max(self._wanted, target)
            self._cond.notify_all()
            while not self._stopping:
                got = self._latest
                if got is not None and got.seq >= target:
                    return got.samples
                left = deadline - self._clock()
                if left <= 0:
                    return None
                self._cond.wait(left)
        return None

    def _run(self) -> None:
        self._busy_since = self._clock()
        try:
            telemetry = self._make_telemetry()
        except Exception as exc:  # GpuTelemetry itself never raises; a replacement might
            telemetry = None
            self.reason = f"{type(exc).__name__}: {exc}"
            log.warning("gpu telemetry failed to start", error=self.reason)
        finally:
            self._busy_since = None
        if telemetry is None or not telemetry.available:
            self.reason = telemetry.reason if telemetry is not None else self.reason
            return
        self.available, self.reason = True, ""
        seq = 0
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        return
                    if self._wanted <= seq:
                        self._cond.wait(self.interval_s)
                    if self._stopping:
                        return
                self._busy_since = self._clock()
                try:
                    samples = tuple(telemetry.sample())
                except Exception as exc:  # sample() guards every call; never let the thread die of one pass
                    log.warning("gpu sample failed", error=repr(exc))
                    samples = ()
                finally:
                    self._busy_since = None
                seq += 1
                with self._cond:
                    self._latest = GpuReading(samples, self._clock(), seq)
                    self._cond.notify_all()
        finally:
            self.available = False
            telemetry.close()


def holding_memory(samples: Iterable[GpuSample], pids: set[int]) -> list[tuple[int, int, int | None]]:
    """(gpu index, pid, bytes or None) for each of ``pids`` still present on a GPU in ``samples`` (the
    teardown's check behind exit 85)."""
    return [(s.index, p.pid, p.used_bytes) for s in samples for p in s.processes if p.pid in pids]


def gpus_busy_without_progress(samples: Iterable[GpuSample], verdict: Verdict) -> bool:
    """The hang signature: the group is stalled while its GPUs run at full utilisation.

    Looks at the GPUs that host a rank of the verdict; when none of them lists
    a rank's PID (no process info, or a PID namespace), at every GPU.
    """
    if not verdict.stalled:
        return False
    samples = list(samples)
    rank_pids = {pid for _rank, pid in verdict.rank_pids}
    hosting = [s for s in samples if any(p.pid in rank_pids for p in s.processes)]
    considered = hosting or samples
    return any(s.utilization_pct is not None and s.utilization_pct >= BUSY_UTILIZATION_PCT for s in considered)
