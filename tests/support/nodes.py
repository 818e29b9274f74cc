"""Supervisors of one job on several nodes, each in a network namespace of tests/netlab.py's lab: a node's
JSON log and bundles as a test reads them, and a pair of real vLLM nodes (vLLM's own multi-node launch under
``supervise serve --tree``) with clients inside node 0's namespace.  Shared by the tests and the benchmarks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.conftest import MARK_VAR, ROOT, event_name, marked_pids
from tests.netlab import Lab, in_netns
from tests.support.sweep import sweep_killed

VLLM_CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
}
RDZV_PORT = 29500  # vLLM's --master-port on node 0 (each namespace has its own ports)
API_PORT = 8000
RELAY_PORT = 8080
SERVE_TIMEOUT_S = 300


def mapped_shm() -> set[str]:
    """/dev/shm names some process maps now."""
    names = set()
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/maps") as f:
                names.update(line.rsplit("/dev/shm/", 1)[1].strip() for line in f if "/dev/shm/" in line)
        except OSError:
            continue
    return names


@dataclass
class Node:
    """One node's supervisor, started in its namespace; its log is a file (no pipe to drain)."""

    rank: int
    ns: int  # the lab's node index that hosts it
    proc: subprocess.Popen
    log: Path
    dump_dir: Path
    mark: str
    ended: float | None = None  # monotonic
    at_bound: list[int] | None = None  # its marked processes at the fault + NODE_LOST_S + MARGIN_S
    alive_at_bound: bool | None = None
    stacks: str = ""  # py-spy of a supervisor still running at the end of the watch
    _lines: list[dict] | None = None
    registry: Path | None = None  # its SUPERVISE_REGISTRY_DIR, where it has one of its own

    @property
    def code(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> None:
        if self.ended is None and self.proc.poll() is not None:
            self.ended = time.monotonic()

    def lines(self) -> list[dict]:
        if self._lines is None or self.ended is None:
            found = []
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    try:
                        found.append(json.loads(line))
                    except ValueError:
                        pass
            self._lines = found
        return self._lines

    def events(self, text: str) -> list[dict]:
        name = event_name(text)
        return [line for line in self.lines() if line.get("event") == name or text in str(line.get("message", ""))]

    def bundles(self) -> list[Path]:
        return sorted(p for p in self.dump_dir.iterdir() if p.is_dir()) if self.dump_dir.is_dir() else []

    def summary(self, reason: str) -> dict:
        found = [b for b in self.bundles() if reason in b.name]
        assert found, f"node {self.rank}: no {reason} bundle in {[b.name for b in self.bundles()]}\n{self.tail()}"
        return json.loads((found[-1] / "summary.json").read_text())

    def ranks_at_bound(self) -> list[int]:
        return [pid for pid in self.at_bound or [] if pid != self.proc.pid]

    def tail(self, lines: int = 25) -> str:
        text = [line for line in self.log.read_text(errors="replace").splitlines() if "rank_output" not in line]
        shown = "\n".join(text[-lines:])
        return f"--- node {self.rank} (exit {self.code}) log tail:\n{shown}" + (
            f"\n--- node {self.rank} stacks when the watch ended:\n{self.stacks}" if self.stacks else ""
        )


def stop_nodes(nodes: list[Node]) -> None:
    """Kill every node's supervisor that still runs, then whatever carries its mark (its ranks, its engine)."""
    for n in nodes:
        if n.proc.poll() is None:
            n.proc.kill()
            n.proc.wait(10)
        for pid in marked_pids(n.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if n.registry is not None and n.proc.returncode == -signal.SIGKILL:
            sweep_killed(n.registry, {n.proc.pid})


def vllm_line(python: Path, model: Path, node: int, master: str, api_port: int = API_PORT) -> list[str]:
    line = [
        str(python),
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model),
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--served-model-name",
        "tiny",
        "--nnodes",
        "2",
        "--node-rank",
        str(node),
        "--master-addr",
        master,
        "--master-port",
        str(RDZV_PORT),
    ]
    return line + (["--host", "127.0.0.1", "--port", str(api_port)] if node == 0 else ["--headless"])


def http(lab, path: str, body: dict | None = None, port: int = API_PORT, timeout: float = 60.0) -> dict:
    """A request to node 0's API from inside node 0's namespace."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"})
    with in_netns(lab.ns(0)), urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw.strip().startswith(b"{") else {}


@dataclass
class VllmPair:
    """Two supervisors of one vLLM job, node R in the lab's namespace R; their logs are files."""

    lab: Lab
    tmp: Path
    python: Path  # vLLM's interpreter
    model: Path
    supervise_args: dict[int, list[str]] = field(default_factory=dict)
    supervised: bool = True  # False: vLLM alone, its launcher where the supervisor would be
    nodes: list[Node] = field(default_factory=list)
    shm_before: set[str] = field(default_factory=set)
    fault_at: float = 0.0

    def start(self) -> None:
        self.shm_before = set(os.listdir("/dev/shm"))
        self.tmp.mkdir(parents=True, exist_ok=True)
        master = self.lab.addr(0)
        for node in (0, 1):
            mark = uuid.uuid4().hex
            env = dict(
                os.environ,
                **VLLM_CPU_ENV,
                **{
                    MARK_VAR: mark,
                    "SUPERVISE_REGISTRY_DIR": str(self.tmp / f"registry-{node}"),
                    # what an operator sets on a multi-NIC host: the address vLLM's processes and gloo use
                    "VLLM_HOST_IP": self.lab.addr(node),
                    "GLOO_SOCKET_IFNAME": "eth0",
                },
            )
            dump_dir, log = self.tmp / f"dumps-{node}", self.tmp / f"node{node}.log"
            supervisor = [
                sys.executable,
                "-m",
                "tp_supervise.supervisor.cli",
                "serve",
                "--log-format",
                "json",
                "--metrics-addr",
                "127.0.0.1:0",
                "--metrics-linger",
                "0",
                "--dump-dir",
                str(dump_dir),
                "--tree",
                "--kill-grace",
                "3",
                *self.supervise_args.get(node, []),
                "--",
            ]
            argv = [*(supervisor if self.supervised else []), *vllm_line(self.python, self.model, node, master)]
            with open(log, "w") as out:
                proc = self.lab.run_in(
                    node, argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
            self.nodes.append(Node(node, node, proc, log, dump_dir, mark, registry=self.tmp / f"registry-{node}"))

    def wait_serving(self, port: int = API_PORT) -> None:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while time.monotonic() < deadline:
            for n in self.nodes:
                assert n.proc.poll() is None, f"node {n.rank}'s supervisor exited before vLLM served\n{n.tail()}"
            try:
                with (
                    in_netns(self.lab.ns(0)),
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response,
                ):
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1)
        raise AssertionError(
            f"vLLM did not serve within {SERVE_TIMEOUT_S} s\n{self.nodes[0].tail()}\n{self.nodes[1].tail()}"
        )

    def process(self, node: int, title: str) -> psutil.Process:
        """The process of node ``node``'s tree whose title starts with ``title``."""
        for proc in psutil.Process(self.nodes[node].proc.pid).children(recursive=True):
            try:
                if " ".join(proc.cmdline()).startswith(title):
                    return proc
            except psutil.Error:
                continue
        raise AssertionError(f"no {title} under node {node}'s supervisor")

    def fault(self) -> None:
        self.fault_at = time.monotonic()

    def watch(self, until_s: float) -> dict[int, float | None]:
        """Seconds from the fault to each node's exit (None: still running after ``until_s``)."""
        ended: dict[int, float | None] = {n.rank: None for n in self.nodes}
        while time.monotonic() < self.fault_at + until_s and None in ended.values():
            for n in self.nodes:
                if ended[n.rank] is None and n.proc.poll() is not None:
                    ended[n.rank] = time.monotonic() - self.fault_at
            time.sleep(0.05)
        return ended

    def left(self) -> dict[int, list[int]]:
        """Processes of each node still running a moment after its supervisor ended (vLLM's included: they
        carry the node's mark in their environment)."""
        time.sleep(1.0)
        return {n.rank: marked_pids(n.mark) for n in self.nodes}

    def shm_left(self) -> list[str]:
        new = set(os.listdir("/dev/shm")) - self.shm_before - mapped_shm()
        return sorted(n for n in new if n.startswith(("vllm", "psm_")))

    def stop(self) -> None:
        stop_nodes(self.nodes)


class NodeZeroLoad:
    """Two clients inside node 0's namespace: completions and chat, until closed (errors after a fault are
    expected and counted)."""

    def __init__(self, lab, port: int = API_PORT):
        self.lab, self.port = lab, port
        self.done = self.errors = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        with in_netns(self.lab.ns(0)):
            while not self.stop.is_set():
                body = (
                    {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0}
                    if i == 0
                    else {"model": "tiny", "max_tokens": 24, "messages": [{"role": "user", "content": "a story"}]}
                )
                path = "/v1/completions" if i == 0 else "/v1/chat/completions"
                try:
                    request = urllib.request.Request(
                        f"http://127.0.0.1:{self.port}{path}",
                        json.dumps(body).encode(),
                        {"Content-Type": "application/json"},
                    )
                    with urllib.request.urlopen(request, timeout=30) as response:
                        response.read()
                    self.done += 1
                except (OSError, urllib.error.URLError):
                    self.errors += 1
                    time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(40)


def incident_ids(pair: VllmPair) -> set[str]:
    ids = set()
    for n in pair.nodes:
        for b in n.bundles():
            summary = json.loads((b / "summary.json").read_text())
            if summary.get("reason") not in ("hang_suspected", "on_demand"):
                ids.add(summary.get("incident_id"))
    return ids
