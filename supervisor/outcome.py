"""Events, outcomes and per-attempt state of the supervisor's main loop, and
the exit codes of ``supervise serve`` (DESIGN.md's table)."""

from __future__ import annotations

import os
import queue
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .exits import ExitInfo
from .launch import RankHandle

EXIT_OK = 0
EXIT_RANK = 80
EXIT_HANG = 81
EXIT_DIVERGENCE = 82
EXIT_STARTUP = 83
EXIT_TEARDOWN = 85
EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug in the supervisor (ranks are still torn down)

# A rank that exits 0 is a fault only if its peers do not follow it within
# this window (all ranks of a finished job exit within moments of each other).
EARLY_EXIT_WINDOW_S = 0.5
RESTART_BACKOFF_BASE_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
# A run that stayed up this long resets the backoff (not a crash loop).
RESTART_STABLE_S = 300.0
LAUNCHER_KEY = "launcher"
TEARDOWN_EXIT = "teardown"  # metrics reason of exits caused by our own teardown


@dataclass(frozen=True)
class SignalReceived:
    signum: int


@dataclass(frozen=True)
class ControlRequest:
    request: dict
    reply: "queue.SimpleQueue[dict]"


@dataclass(frozen=True)
class EarlyExitCheck:
    slot: int


@dataclass(frozen=True)
class Outcome:
    code: int
    reason: str  # bundle reason, or "clean" / "shutdown"
    culprit: int | None = None

    @property
    def restartable(self) -> bool:
        return self.code in (EXIT_RANK, EXIT_HANG, EXIT_DIVERGENCE, EXIT_STARTUP)


@dataclass
class Attempt:
    """Live state of one launch of the group (reset on restart)."""

    ranks: dict[int, RankHandle] = field(default_factory=dict)  # slot → handle
    launcher: RankHandle | None = None
    started_at: float = 0.0
    first_failure: tuple[RankHandle, ExitInfo] | None = None
    outcome: Outcome | None = None


def new_run_id() -> str:
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def run_dir_for(run_id: str) -> Path:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    root = base or Path(os.environ.get("TMPDIR", "/tmp"))
    path = root / f"tp-supervise-{run_id}"
    path.mkdir(mode=0o700)
    return path
