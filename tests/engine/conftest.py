"""Fixtures for the engine tier: launch real engine ranks, real checkpoints, a real heartbeat segment.

``launch_engine(*engine_args, nproc=2, ...)`` starts N ``python -m tp_supervise.engine``
ranks with the torchrun environment on a free MASTER_PORT (``--port 0``: the
frontend picks its own port, read from the ready line) and kills every
rank's process group after the test; nothing may survive.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.live import wait_for  # noqa: F401  (re-exported for the engine tests)

from tp_supervise.engine.launch import LaunchSpec, LocalEngine
from tests.conftest import MARK_VAR, wait_no_marked

ROOT = Path(__file__).resolve().parents[2]
from tp_supervise.supervisor.processes.spawn import HOOK_DIR  # noqa: E402
STACK_SIGNAL = signal.SIGUSR1
HTTP_TIMEOUT_S = 60.0


class Launcher:
    def __init__(self, base: Path):
        self.base = base
        self.mark = uuid.uuid4().hex
        self.engines: list[LocalEngine] = []

    def __call__(self, *engine_args: str, nproc: int = 2, env: dict | None = None,
                 rank_env: dict | None = None, ready: bool = True, rank_fds: dict | None = None) -> LocalEngine:
        full_env = {MARK_VAR: self.mark, **(env or {})}
        spec = LaunchSpec(nproc, ("--port", "0", *engine_args), env=full_env, rank_env=rank_env or {},
                          rank_fds=rank_fds or {})
        engine = LocalEngine(spec, self.base / f"engine-{len(self.engines)}")
        self.engines.append(engine)
        engine.start()
        if ready:
            engine.wait_ready()
        return engine

    def cleanup(self) -> None:
        for engine in self.engines:
            engine.kill()
        leaked = wait_no_marked(self.mark, timeout=5.0)
        for pid in leaked:
            os.kill(pid, signal.SIGKILL)
        assert not leaked, f"engine processes leaked: {leaked}"


@pytest.fixture
def launch_engine(tmp_path):
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.cleanup()


@pytest.fixture(scope="module")
def module_launcher(tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("engines"))
    yield launcher
    launcher.cleanup()


# -- checkpoints ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def ckpt_a(tmp_path_factory) -> Path:
    """Odd vocabulary (251) and a single KV head: both need the uneven paths at TP=2."""
    from tp_supervise.engine.checkpoint_gen import CheckpointSpec, write_random_checkpoint

    spec = CheckpointSpec(vocab_size=251, num_key_value_heads=1, initializer_range=0.1, seed=1)
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt-a"), spec)


@pytest.fixture(scope="session")
def ckpt_b(tmp_path_factory) -> Path:
    """Tied embeddings, 2 KV heads, odd intermediate size, Llama-3 RoPE scaling."""
    from tp_supervise.engine.checkpoint_gen import CheckpointSpec, write_random_checkpoint

    spec = CheckpointSpec(vocab_size=256, num_key_value_heads=2, intermediate_size=175, tie_word_embeddings=True,
                          rope_theta=500000.0, llama3_rope_factor=8.0, llama3_original_max_position=16,
                          initializer_range=0.1, seed=2)
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt-b"), spec)


# -- heartbeat segment (what the supervisor would give the ranks) --------------------
class Heartbeat:
    def __init__(self, base: Path, nslots: int):
        from tp_supervise.supervisor.rank.heartbeat import HeartbeatSegment

        self.run_dir = base / "run"
        self.run_dir.mkdir()
        self.segment = HeartbeatSegment(base / "heartbeat", nslots, "engine-test", time.monotonic())

    def rank_env(self, nslots: int) -> dict[int, dict[str, str]]:
        common = {
            "SUPERVISE_HEARTBEAT": str(self.segment.path),
            "SUPERVISE_RUN_ID": "engine-test",
            "SUPERVISE_STACK_SIGNAL": str(int(STACK_SIGNAL)),
            "SUPERVISE_RUN_DIR": str(self.run_dir),
            "PYTHONPATH": os.pathsep.join([str(HOOK_DIR), str(ROOT)]),
        }
        return {r: {**common, "SUPERVISE_SLOT": str(r)} for r in range(nslots)}

    def read(self, slot: int):
        return self.segment.read(slot)

    def stacks(self, slot: int, pid: int, timeout_s: float = 10.0) -> str:
        """All threads' Python stacks of a rank, via the faulthandler the rank-side runtime registered."""
        from tp_supervise.supervisor.rank.runtime import stack_file_path

        path = Path(stack_file_path(self.run_dir, slot, pid))
        before = path.stat().st_size if path.exists() else 0
        os.kill(pid, STACK_SIGNAL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists() and path.stat().st_size > before:
                time.sleep(0.2)  # let the dump finish
                return path.read_text(errors="replace")[before:]
            time.sleep(0.05)
        raise AssertionError(f"rank in slot {slot} wrote no stacks")


@pytest.fixture
def heartbeat(tmp_path):
    hb = Heartbeat(tmp_path, 2)
    yield hb
    hb.segment.close()


# -- HTTP helpers ------------------------------------------------------------------
def post(url: str, body, timeout: float = HTTP_TIMEOUT_S, path: str = "/v1/completions") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def stream(url: str, body: dict, timeout: float = HTTP_TIMEOUT_S, events: list | None = None,
           path: str = "/v1/completions") -> list:
    """The SSE payloads of a streamed completion ("[DONE]" kept as a string).

    Pass ``events`` to watch them arrive from another thread.
    """
    request = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    events = [] if events is None else events
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def get(url: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + path, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def read_trace(path: Path, partial: bool = False) -> list[dict]:
    """A --trace-events file as a list of steps: {"index": i, "events": {kind: payload}}.

    With ``partial``, events after the last completed step form a last entry with index None.
    """
    steps, events = [], {}
    for line in path.read_text().splitlines():
        item = json.loads(line)
        if "end_step" in item:
            steps.append({"index": item["end_step"], "events": events})
            events = {}
        else:
            events[item["kind"]] = item["payload"]
    if partial and events:
        steps.append({"index": None, "events": events})
    return steps
