"""One launch of the rank group: the main thread's live state and the
read-only view of it that other threads get.

Only the main thread holds an ``Attempt`` and changes it, through its
methods; each change that other threads could care about (a rank started or
joined, a rank exited, the attempt's outcome decided) publishes a fresh
``AttemptView``: a frozen value the main thread swaps in with one reference
assignment (atomic in CPython).  The watchdog, the services and the dump
worker read that reference and never see a half-made state::

    main thread                         other threads
    Attempt.add_rank / record_exit      view = published()   # one read
      / set_launcher / finish  ──set──▶ view.ranks[slot].alive ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, TypeVar

from ..outcome import LAUNCHER_KEY, Outcome
from . import shm
from .exits import ExitInfo
from .spawn import RankHandle

T = TypeVar("T")

LAUNCHER_SLOT = -1
ENGINE_PROCESS = "engine-process"  # exit-monitor key kind: (ENGINE_PROCESS, pid)


class Published(Generic[T]):
    """The latest value of something the main thread owns: one writer, any readers.

    Pass the cell itself where a reader wants ``() -> value``.
    """

    def __init__(self, value: T):
        self._value = value

    def set(self, value: T) -> None:
        self._value = value

    def __call__(self) -> T:
        return self._value


@dataclass(frozen=True)
class RankView:
    """One rank (or a tree-mode process that is not a rank: the launcher, slot -1, or an engine process
    between it and the ranks, slot ≤ -2) as the main thread last saw it."""

    slot: int
    rank: int
    pid: int
    started_at: float
    exit: ExitInfo | None = None
    exited_at: float | None = None
    title: str = ""

    @classmethod
    def of(cls, handle: RankHandle) -> RankView:
        return cls(handle.slot, handle.rank, handle.pid, handle.started_at, handle.exit, handle.exited_at, handle.title)

    def describe(self, who: str) -> str:
        """``rank 1 (pid 123, VLLM::Worker_TP1)``: who, by pid and by the name the process gave itself (a title
        that is a name; a plain command line, a path and its arguments, says nothing the pid does not)."""
        named = self.title and not any(c.isspace() or c == "/" for c in self.title)
        return f"{who} (pid {self.pid}, {self.title})" if named else f"{who} (pid {self.pid})"

    @property
    def alive(self) -> bool:
        return self.exit is None

    @property
    def is_launcher(self) -> bool:
        """Not a rank: the launcher or an engine process of its tree."""
        return self.slot < 0

    @property
    def role(self) -> str:
        """``rank 1``, ``launcher`` or ``engine process`` (e.g. vLLM's ``VLLM::EngineCore``)."""
        if self.slot >= 0:
            return f"rank {self.rank}"
        return "launcher" if self.slot == LAUNCHER_SLOT else "engine process"


@dataclass(frozen=True, eq=False)
class AttemptView:
    """An immutable snapshot of one attempt.  ``started_at`` 0: nothing launched yet."""

    started_at: float
    ranks: Mapping[int, RankView]  # slot → rank, in the order they started (or joined)
    launcher: RankView | None
    restarts: int  # restarts before this attempt (what its bundles report)
    finished: bool  # the attempt's outcome is decided: no more verdicts wanted
    number: int = 0  # 1, 2, … one per launch of the group (0: none yet); events carry it

    @property
    def launched(self) -> bool:
        """A process of this attempt was started (a watch can begin)."""
        return bool(self.ranks) or self.launcher is not None

    def live_ranks(self) -> list[RankView]:
        return [r for r in self.ranks.values() if r.alive]


NOT_STARTED = AttemptView(started_at=0.0, ranks=MappingProxyType({}), launcher=None, restarts=0, finished=False)


class Attempt:
    """Live state of one launch of the group (a new one on restart).  Main thread only.

    ``publish`` receives a new ``AttemptView`` after every change.
    """

    def __init__(
        self, publish: Callable[[AttemptView], None], started_at: float = 0.0, restarts: int = 0, number: int = 0
    ):
        self.started_at = started_at
        self.restarts = restarts
        self.number = number
        self._ranks: dict[int, RankHandle] = {}  # slot → handle
        self.launcher: RankHandle | None = None
        # Tree mode: the processes between the launcher and its ranks (vLLM's engine core), by pid.
        self._engine_processes: dict[int, RankHandle] = {}
        self.shm = shm.Watch()  # /dev/shm files its processes were seen mapping (the teardown removes them)
        self.shm_looked_at = 0.0
        self.first_failure: tuple[RankHandle, ExitInfo] | None = None
        self.outcome: Outcome | None = None
        self._publish = publish
        self.view = self._snapshot()
        publish(self.view)

    @property
    def ranks(self) -> Mapping[int, RankHandle]:
        return MappingProxyType(self._ranks)

    def live_ranks(self) -> list[RankHandle]:
        return [h for h in self._ranks.values() if h.alive]

    @property
    def engine_processes(self) -> list[RankHandle]:
        return list(self._engine_processes.values())

    def holds_process(self, pid: int) -> bool:
        return any(h.pid == pid for h in self.processes())

    def look_at_shm(self, now: float, every_s: float) -> None:
        """Note what the live processes map in /dev/shm, at most once per ``every_s`` (off this thread)."""
        if now - self.shm_looked_at >= every_s:
            self.shm_looked_at = now
            self.shm.look(h.pid for h in self.processes() if h.alive)

    def processes(self) -> list[RankHandle]:
        """Every process this attempt holds: ranks, the launcher, engine processes."""
        launcher = [self.launcher] if self.launcher is not None else []
        return [*self._ranks.values(), *launcher, *self._engine_processes.values()]

    def handle_for(self, key: object) -> RankHandle | None:
        """The handle an exit-monitor key names (as ``core`` watches them)."""
        if key == LAUNCHER_KEY:
            return self.launcher
        if isinstance(key, tuple) and key[0] in ("rank", "tree-rank"):
            return self._ranks.get(key[1])
        if isinstance(key, tuple) and key[0] == ENGINE_PROCESS:
            return self._engine_processes.get(key[1])
        return None

    # ------------------------------------------------------------ changes
    def add_rank(self, handle: RankHandle) -> None:
        self._ranks[handle.slot] = handle
        self._changed()

    def set_launcher(self, handle: RankHandle) -> None:
        self.launcher = handle
        self._changed()

    def add_engine_process(self, handle: RankHandle) -> tuple[str, int]:
        """Hold a tree process that is not a rank; returns the exit-monitor key to watch it under."""
        self._engine_processes[handle.pid] = handle
        return (ENGINE_PROCESS, handle.pid)

    def record_exit(self, handle: RankHandle, info: ExitInfo, at: float) -> None:
        handle.exit, handle.exited_at = info, at
        self._changed()

    def finish(self, outcome: Outcome) -> None:
        """The first outcome decided wins; later ones are consequences."""
        if self.outcome is None:
            self.outcome = outcome
            self._changed()

    def _changed(self) -> None:
        self.view = self._snapshot()
        self._publish(self.view)

    def _snapshot(self) -> AttemptView:
        return AttemptView(
            started_at=self.started_at,
            ranks=MappingProxyType({slot: RankView.of(h) for slot, h in self._ranks.items()}),
            launcher=None if self.launcher is None else RankView.of(self.launcher),
            restarts=self.restarts,
            finished=self.outcome is not None,
            number=self.number,
        )
