"""How a run ends and what names it: the exit codes of ``supervise serve``
(docs/supervisor.md, "Exit codes"); ``Outcome``, an attempt's end (its code,
bundle reason, culprit, and whether it ends the run whatever --max-restarts
says); the run id (``new_run_id``, ``valid_run_id``); the incident id every
node's bundle of one incident carries (``new_incident_id``); and the run's
scratch directory (``run_dir_for``).

Events are in ``events``, the live state of an attempt in
``processes/attempt``, what an exit means in ``arbitration``, the restart
policy in ``restart``."""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

EXIT_OK = 0
EXIT_USAGE = 64  # EX_USAGE: a usage error or invalid launch arithmetic; nothing was started
EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug in the supervisor (ranks are still torn down)
EXIT_RANK = 80
EXIT_HANG = 81
EXIT_DIVERGENCE = 82
EXIT_STARTUP = 83
EXIT_PEER = 84  # multi-node: a peer node failed or was lost (the originating node keeps its own code; a hang: 81)
EXIT_TEARDOWN = 85

LAUNCHER_KEY = "launcher"
RELAY_KEY = "relay"  # exit-monitor key of the relay process (a process of the run, not of an attempt)
TEARDOWN_EXIT = "teardown"  # metrics reason of exits caused by our own teardown


@dataclass(frozen=True)
class Outcome:
    code: int
    reason: str  # bundle reason, or "clean" / "shutdown"
    culprit: int | None = None
    final: bool = False  # the run ends whatever --max-restarts says (--on-straggler kill, here or on another node)

    @property
    def restartable(self) -> bool:
        return not self.final and self.code in (EXIT_RANK, EXIT_HANG, EXIT_DIVERGENCE, EXIT_STARTUP)


RUN_ID_PATTERN = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]{0,47}")


def valid_run_id(text: str) -> bool:
    """1-48 letters, digits, '.', '_', '-', starting with a letter or digit, no '..': it names files,
    directories and cgroups, so it must never be a path (it may come from another node)."""
    return bool(RUN_ID_PATTERN.fullmatch(text)) and ".." not in text


def new_run_id() -> str:
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def new_incident_id(run_id: str) -> str:
    """The id every node's bundle of one incident carries."""
    return f"{run_id}-{secrets.token_hex(4)}"


def run_dir_for(run_id: str) -> Path:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    root = base or Path(os.environ.get("TMPDIR", "/tmp"))
    path = root / f"tp-supervise-{run_id}"
    path.mkdir(mode=0o700)
    return path
