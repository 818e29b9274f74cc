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
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, Protocol, TypeVar

from ..outcome import LAUNCHER_KEY, Outcome
from ..rank.engines import role_from_title, role_words, serves_api
from . import shm
from .exits import ExitInfo
from .spawn import RankHandle

T = TypeVar("T")
C = TypeVar("C")

LAUNCHER_SLOT = -1
ENGINE_PROCESS = "engine-process"  # exit-monitor key kind: (ENGINE_PROCESS, pid)

# Roles of the processes of a run (docs/supervisor.md, "Roles"): a TP/PP rank; an engine's front end (vLLM's
# API server, SGLang's tokenizer manager) and scheduler (vLLM's engine core), known from the engine adapter's
# claim of a control slot or, second, from the process's title; a helper (SGLang's detokenizer).  A process
# of the tree whose role is not known is the ``launcher`` (the process the supervisor started) or an
# ``engine process`` (one between it and the ranks).
ROLE_RANK = "rank"
ROLE_FRONTEND = "frontend"
ROLE_SCHEDULER = "scheduler"
ROLE_HELPER = "helper"
ROLE_LAUNCHER = "launcher"
ROLE_ENGINE_PROCESS = "engine process"
ROLE_WORDS = {
    ROLE_FRONTEND: "front end",
    ROLE_SCHEDULER: "scheduler",
    ROLE_HELPER: "helper process",
    ROLE_LAUNCHER: "launcher",
    ROLE_ENGINE_PROCESS: "engine process",
}


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
    role: str = ROLE_RANK  # ROLE_*: what the process is

    @classmethod
    def of(cls, handle: RankHandle) -> RankView:
        return cls(
            handle.slot,
            handle.rank,
            handle.pid,
            handle.started_at,
            handle.exit,
            handle.exited_at,
            handle.title,
            role_of(handle),
        )

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
    def who(self) -> str:
        """``rank 1``, or the process in its engine's words (``vLLM's engine core``), else its role's
        (``the scheduler``, ``the front end``, ``the launcher``, ``the engine process``)."""
        if self.slot >= 0:
            return f"rank {self.rank}"
        return role_words(self.role, self.title) or f"the {ROLE_WORDS.get(self.role, self.role)}"


def role_of(handle: RankHandle) -> str:
    """A process's role: a rank by its slot; else what the engine adapter said (``handle.role``), else what
    its title says (the engine's own name for it), else launcher or engine process by its place."""
    if handle.slot >= 0:
        return ROLE_RANK
    if handle.role:
        return handle.role
    by_title = role_from_title(handle.title)
    if by_title and by_title != ROLE_RANK:
        return by_title
    if handle.slot == LAUNCHER_SLOT:
        return ROLE_FRONTEND if serves_api(handle.title) else ROLE_LAUNCHER
    return ROLE_ENGINE_PROCESS


@dataclass(frozen=True, eq=False)
class AttemptView:
    """An immutable snapshot of one attempt.  ``started_at`` 0: nothing launched yet."""

    started_at: float
    ranks: Mapping[int, RankView]  # slot → rank, in the order they started (or joined)
    launcher: RankView | None
    restarts: int  # restarts before this attempt (what its bundles report)
    finished: bool  # the attempt's outcome is decided: no more verdicts wanted
    number: int = 0  # 1, 2, … one per launch of the group (0: none yet); events carry it
    # Tree mode: the processes between the launcher and the ranks (vLLM's engine core), by pid.
    engine_processes: Mapping[int, RankView] = field(default_factory=lambda: MappingProxyType({}))

    def control_plane(self) -> list[RankView]:
        """Every process of the attempt that is not a rank: the launcher first, then the engine processes."""
        launcher = [self.launcher] if self.launcher is not None else []
        return [*launcher, *self.engine_processes.values()]

    def pids(self) -> set[int]:
        """Every process of the attempt the supervisor knows: its ranks, launcher and engine processes."""
        return {view.pid for view in (*self.ranks.values(), *self.control_plane()) if view.pid}

    def process(self, pid: int) -> RankView | None:
        """The process of this attempt with ``pid`` (a rank, the launcher or an engine process)."""
        for view in (*self.ranks.values(), *self.control_plane()):
            if view.pid == pid:
                return view
        return None

    @property
    def launched(self) -> bool:
        """A process of this attempt was started (a watch can begin)."""
        return bool(self.ranks) or self.launcher is not None

    def live_ranks(self) -> list[RankView]:
        return [r for r in self.ranks.values() if r.alive]


NOT_STARTED = AttemptView(started_at=0.0, ranks=MappingProxyType({}), launcher=None, restarts=0, finished=False)


class PerAttempt(Generic[T]):
    """What an observer thread keeps of one attempt: ``of(view)`` is a fresh ``make(previous)`` for each attempt the
    published view shows (``make(view, previous)``; ``previous``: the ended attempt's, for what the observer carries over on purpose), so
    nothing of an attempt is reset field by field.  The observer's own thread only."""

    def __init__(self, make: Callable[[AttemptView, T | None], T]):
        self._make = make
        self._key: tuple[int, float] | None = None
        self._state: T | None = None

    def of(self, view: AttemptView) -> T:
        key = (view.number, view.started_at)
        if key != self._key or self._state is None:
            self._state = self._make(view, self._state)
            self._key = key
        return self._state


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Attempt(Generic[C]):
    """Live state of one launch of the group (a new one on restart).  Main thread only.

    ``publish`` receives a new ``AttemptView`` after every change.
    """

    def __init__(
        self,
        publish: Callable[[AttemptView], None],
        started_at: float = 0.0,
        restarts: int = 0,
        number: int = 0,
        case: C | None = None,
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
        # The decider's own of this attempt (its suspicions, what it holds for the other nodes: state.AttemptCase)
        # and the loop timers armed for it: dropped with the attempt, cancelled at its teardown.
        self.case = case
        self.timers: list[Cancellable] = []
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
        self._changed()
        return (ENGINE_PROCESS, handle.pid)

    def set_role(self, pid: int, role: str) -> bool:
        """The engine adapter said what process ``pid`` is (its claim of a control slot); False: not held.  A
        rank that is also the scheduler (TP=1: vLLM runs its worker inside the engine core) stays a rank, held
        once."""
        for handle in self.processes():
            if handle.pid != pid:
                continue
            if handle.slot < 0 and handle.role != role:
                handle.role = role
                self._changed()
            return True
        return False

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
            engine_processes=MappingProxyType({pid: RankView.of(h) for pid, h in self._engine_processes.items()}),
        )
