"""Captured evidence as plain data: what ``dumps.capture`` gathers and ``dumps.diagnose`` judges.

``ProcInfo`` (one read of ``/proc/<pid>``), ``CpuSamples`` (CPU and progress
at one instant, carried from one capture to the next), ``RankEvidence`` (all
that is known about one rank) and ``Evidence`` (one capture pass).  The
readers live at the edges (``dumps.procinfo.read_proc``,
``dumps.capture.capture_all``); this module does no I/O and loads no I/O
library, so the verdict over it stays a pure function (docs/contracts.md,
"Package boundaries").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tp_supervise.supervisor.rank.heartbeat import SlotSnapshot

from .stacks import ThreadStack

STATE_NAMES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible I/O",
    "T": "stopped",
    "t": "tracing stop",
    "Z": "zombie",
    "X": "dead",
    "I": "idle",
}


@dataclass(frozen=True)
class ProcInfo:
    """One read of a process; ``state`` is the leader thread's letter."""

    pid: int
    state: str
    wchan: str
    cpu_s: float
    num_threads: int
    thread_states: Mapping[str, int] = field(default_factory=dict)
    title: str = ""  # its command line now (an engine's setproctitle shows here: VLLM::Worker_TP1)

    @property
    def stopped(self) -> bool:
        return self.state == "T"

    def to_dict(self) -> dict:
        return {
            "pid": self.pid,
            "title": self.title,
            "state": self.state,
            "state_name": STATE_NAMES.get(self.state, "unknown"),
            "wchan": self.wchan,
            "cpu_seconds": round(self.cpu_s, 6),
            "num_threads": self.num_threads,
            "thread_states": dict(self.thread_states),
        }


@dataclass(frozen=True)
class CpuSamples:
    """CPU seconds per pid and progress per rank at one monotonic instant.

    ``capture_all`` returns one; pass it back as ``previous`` next time so
    the CPU delta covers the whole interval between two dumps (or two
    watchdog ticks), not only the capture window.
    """

    at: float
    cpu_s: Mapping[int, float] = field(default_factory=dict)
    progress: Mapping[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (step, coll_seq)


@dataclass(frozen=True)
class RankEvidence:
    """Everything captured about one rank; pure data for ``diagnose``."""

    rank: int
    slot: int
    pid: int | None
    alive: bool
    exit: dict | None
    heartbeat: SlotSnapshot | None
    proc: ProcInfo | None = None
    cpu_used_s: float | None = None
    cpu_window_s: float | None = None
    prev_progress: tuple[int, int] | None = None  # (step, coll_seq) at the previous sample
    threads: tuple[ThreadStack, ...] = ()
    stack_text: str = ""  # readable rendering of ``threads``
    method: str = "none"  # how the stacks were obtained
    error: str | None = None  # why there are no (or partial) stacks
    attempts: tuple[str, ...] = ()
    capture_s: float = 0.0
    title: str = ""  # the process title the supervisor last saw (a dead rank's too)
    role: str = ""  # not a rank (a negative key): its role, e.g. "scheduler" (``capture.RankTarget.role``)
    words: str = ""  # ... and what its engine calls it ("vLLM's engine core"; "" when not known)

    @property
    def has_stacks(self) -> bool:
        return bool(self.threads)

    @property
    def state(self) -> str | None:
        return self.proc.state if self.proc is not None else None

    @property
    def cpu_fraction(self) -> float | None:
        if self.cpu_used_s is None or not self.cpu_window_s:
            return None
        return self.cpu_used_s / self.cpu_window_s


@dataclass(frozen=True)
class Evidence:
    """One capture pass over all ranks."""

    ranks: Mapping[int, RankEvidence]
    started_at: float  # time.monotonic()
    duration_s: float
    method: str
    pyspy: str | None
    samples: CpuSamples = field(default_factory=lambda: CpuSamples(at=0.0))
