"""Spawning fake ranks for the dump tests and bench/bench_dumps.py.

``FakeRankSet`` owns a real heartbeat segment and real rank processes
(``fake_rank.py``) with the SUPERVISE_* environment a supervisor would give
them; ``targets()`` builds the ``RankTarget`` list the supervisor would pass
to ``capture_all``.  ``close()`` resumes stopped ranks, kills and reaps all.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tp_supervise.dumps.capture import RankTarget
from tp_supervise.supervisor.rank.heartbeat import HeartbeatSegment
from tp_supervise.supervisor.rank import runtime

FAKE_RANK = Path(__file__).with_name("fake_rank.py")
STACK_SIGNAL = signal.SIGUSR2
PARK_TIMEOUT_S = 30.0


class FakeRankSet:
    def __init__(self, root: Path, nslots: int, *, stack_signal: int = STACK_SIGNAL):
        self.root = Path(root)
        self.run_dir = self.root / "run"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = str(uuid.uuid4())
        self.segment = HeartbeatSegment(self.root / "heartbeat", nslots, self.run_id, time.monotonic())
        self.stack_signal = int(stack_signal)
        self.procs: dict[int, subprocess.Popen] = {}
        self.exits: dict[int, dict] = {}

    def env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                runtime.ENV_RUN_ID: self.run_id,
                runtime.ENV_HEARTBEAT: str(self.segment.path),
                runtime.ENV_SLOT: str(rank),
                runtime.ENV_SUPERVISOR_PID: str(os.getpid()),
                runtime.ENV_STACK_SIGNAL: str(self.stack_signal),
                runtime.ENV_RUN_DIR: str(self.run_dir),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.segment.nslots),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def spawn(self, rank: int, mode: str, steps: int = 3) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, str(FAKE_RANK), mode, str(steps)],
            env=self.env(rank),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        self.procs[rank] = proc
        return proc

    def wait_parked(self, timeout_s: float = PARK_TIMEOUT_S) -> None:
        """Block until every spawned rank printed its "parked" line."""
        sel = selectors.DefaultSelector()
        waiting = {}
        for rank, proc in self.procs.items():
            if proc.poll() is None and proc.stdout is not None:
                sel.register(proc.stdout, selectors.EVENT_READ, rank)
                waiting[rank] = proc
        end = time.monotonic() + timeout_s
        while waiting:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(waiting)} did not park within {timeout_s} s")
            for key, _ in sel.select(left):
                line = key.fileobj.readline()
                if not line or line.startswith(b"parked"):
                    sel.unregister(key.fileobj)
                    waiting.pop(key.data, None)
        sel.close()

    def start(self, modes: dict[int, str], steps: int = 3) -> None:
        for rank, mode in modes.items():
            self.spawn(rank, mode, steps)
        self.wait_parked()

    def stop(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGSTOP)
        _wait_state(self.procs[rank].pid, "T")

    def kill(self, rank: int, signum: int = signal.SIGKILL) -> dict:
        proc = self.procs[rank]
        proc.send_signal(signum)
        code = proc.wait()
        name = signal.Signals(-code).name if code < 0 else None
        self.exits[rank] = {
            "code": code if code >= 0 else None,
            "signal": name,
            "core_dumped": False,
            "description": f"killed by {name}" if name else f"exit code {code}",
        }
        return self.exits[rank]

    def targets(self) -> list[RankTarget]:
        out = []
        for rank, proc in sorted(self.procs.items()):
            alive = proc.poll() is None
            out.append(
                RankTarget(
                    rank=rank,
                    slot=rank,
                    pid=proc.pid,
                    alive=alive,
                    exit=None if alive else self.exits.get(rank),
                    heartbeat=self.segment.read(rank),
                )
            )
        return out

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                except ProcessLookupError:
                    pass
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.segment.close()


def _wait_state(pid: int, letter: str, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        if text[text.rindex(")") + 2] == letter:
            return
        time.sleep(0.01)
    raise TimeoutError(f"pid {pid} did not reach state {letter}")
