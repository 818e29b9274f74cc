"""Start N engine ranks on this machine with the torchrun environment, unsupervised.

For development, tests and benchmarks (``supervise serve`` is the supervised
way)::

    python -m tp_supervise.engine.launch --nproc 2 -- --port 8000 --control-plane replicated

Each rank is its own session (process group), logs to ``<log_dir>/rank-<r>.
{out,err}``, and is SIGTERMed then SIGKILLed on ``stop()``; the rank-0 ready
line (``engine ready: URL``) gives the frontend URL.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tp_supervise.supervisor.rank.net import free_port

from .app import READY_PREFIX

READY_POLL_S = 0.05
DEFAULT_READY_TIMEOUT_S = 120.0
DEFAULT_STOP_TIMEOUT_S = 10.0
_URL = re.compile(re.escape(READY_PREFIX) + r"(http://\S+)")


class EngineStartError(RuntimeError):
    pass


@dataclass(frozen=True)
class LaunchSpec:
    nproc: int
    engine_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # merged into every rank's environment
    rank_env: Mapping[int, Mapping[str, str]] = field(default_factory=dict)  # per rank, merged last
    python: str = sys.executable
    rank_fds: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # fds a rank inherits (pass_fds)

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError("nproc must be >= 1")


class LocalEngine:
    """The ranks of one locally launched engine."""

    def __init__(self, spec: LaunchSpec, log_dir: str | os.PathLike):
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.procs: list[subprocess.Popen] = []
        self.url: str | None = None
        self.master_port = free_port()

    def rank_environ(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.spec.nproc),
                "LOCAL_WORLD_SIZE": str(self.spec.nproc),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.master_port),
            }
        )
        env.update(self.spec.env)
        env.update(self.spec.rank_env.get(rank, {}))
        return env

    def start(self) -> LocalEngine:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(self.spec.nproc):
            with open(self.out_path(rank), "wb") as out, open(self.err_path(rank), "wb") as err:
                self.procs.append(
                    subprocess.Popen(
                        [self.spec.python, "-m", "tp_supervise.engine", *self.spec.engine_args],
                        env=self.rank_environ(rank),
                        stdout=out,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        pass_fds=tuple(self.spec.rank_fds.get(rank, ())),
                    )
                )
        return self

    def out_path(self, rank: int) -> Path:
        return self.log_dir / f"rank-{rank}.out"

    def err_path(self, rank: int) -> Path:
        return self.log_dir / f"rank-{rank}.err"

    def stderr(self, rank: int) -> str:
        return self.err_path(rank).read_text(errors="replace")

    def wait_ready(self, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = _URL.search(self.out_path(0).read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                return self.url
            dead = [(r, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                rank, code = dead[0]
                raise EngineStartError(f"rank {rank} exited with {code} before ready:\n{self.stderr(rank)[-3000:]}")
            time.sleep(READY_POLL_S)
        raise EngineStartError(f"engine not ready within {timeout_s} s:\n{self.stderr(0)[-3000:]}")

    def signal_all(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    def wait(self, timeout_s: float) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> list[int | None]:
        """SIGTERM every rank, wait, then SIGKILL each rank's whole process group."""
        self.signal_all(signal.SIGTERM)
        codes = self.wait(timeout_s)
        self.kill()
        return codes

    def kill(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.procs:
            try:
                p.wait(DEFAULT_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> LocalEngine:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.kill()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tp_supervise.engine.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("engine_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    args = ns.engine_args[1:] if ns.engine_args[:1] == ["--"] else ns.engine_args
    log_dir = ns.log_dir or tempfile.mkdtemp(prefix="engine-logs-")
    engine = LocalEngine(LaunchSpec(ns.nproc, tuple(args)), log_dir)
    engine.start()
    try:
        print(f"ranks started, logs in {log_dir}", flush=True)
        print(f"{READY_PREFIX}{engine.wait_ready()}", flush=True)
        while all(p.poll() is None for p in engine.procs):
            time.sleep(DEFAULT_STOP_TIMEOUT_S / 10)
    except KeyboardInterrupt:
        pass
    except EngineStartError as exc:
        print(exc, file=sys.stderr)
    finally:
        codes = engine.stop()
    print(f"rank exit codes: {codes}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
