"""Two supervisors on one host as two nodes of one TP group (issue 12), with torch-free fake ranks.

Node 0 hosts the supervisors' TCPStore on --master-port + 1.  A fatal
incident on one node takes the other down within moments (exit 84, naming
the node and global rank that failed first); a SIGKILLed supervisor is a
lost node; a bad group is refused on every node before anything starts.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tp_supervise.supervisor.rank.net import free_port
from tests.conftest import fake_rank, marked_pids
from tests.live import wait_for

pytestmark = pytest.mark.e2e

EXIT_TIMEOUT_S = 60


def two_nodes(supervise, tmp_path, node_args, ranks_args, nnodes=2, node_ranks=None):
    port, store_port = free_port(), free_port()  # explicit: master port + 1 may be taken on a busy host
    runs = []
    for i, node_rank in enumerate(node_ranks if node_ranks is not None else range(nnodes)):
        args = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-port", str(port),
                "--store-port", str(store_port),
                "--nproc-per-node", "1", "--kill-grace", "2", *node_args(i)]
        runs.append(supervise(args, fake_rank(*ranks_args(i)), dump_dir=tmp_path / f"dumps-{i}"))
    return runs


def wait_joined(tmp_path, nodes: int, timeout: float = 120.0) -> None:
    """Every node passed the handshake and runs its ranks: each registered its control socket."""
    wait_for(lambda: len(list((tmp_path / "registry").glob("*.json"))) >= nodes, timeout, f"{nodes} nodes running")
    time.sleep(1.0)


def summary(run, reason):
    return run.summary(reason)


@pytest.fixture(scope="module")
def rank_exit_on_node_1(supervise_module):
    """Rank 1 (on node 1) exits 3 two seconds in: run once, asserted by the tests below and by
    test_multinode_evidence's (node 1 exits 80, node 0 follows with 84)."""
    node0, node1 = two_nodes(supervise_module, supervise_module.tmp, lambda i: [],
                             lambda i: ("--all", "loop", "--on", "1=exit:3", "--delay", "2"))
    code1 = node1.wait(EXIT_TIMEOUT_S)  # node 1 first: node 0's end is then timed from node 1's
    return node0, node1, (node0.wait(EXIT_TIMEOUT_S), code1)


def test_a_rank_exit_on_node_1_takes_node_0_down_with_84(rank_exit_on_node_1):
    node0, node1, codes = rank_exit_on_node_1
    assert codes == (84, 80), node1.stderr[-3000:] + node0.stderr[-3000:]
    # one run id on both nodes
    assert node0.run_id() == node1.run_id()
    lost = node0.events("peer node failed")
    assert lost and lost[0]["node"] == 1 and lost[0]["rank"] == 1
    peer = summary(node0, "peer_failed")
    assert "rank 1 on node 1" in peer["verdict"] and peer["culprit_ranks"] == [1]
    assert peer["incident_id"] and peer["node_rank"] == 0
    # node 0 tore down within moments of node 1's fault (not after a collective timeout)
    assert node0.ended - node1.ended < 10


@pytest.mark.slow
def test_a_sigkilled_node_1_is_a_lost_node(supervise, tmp_path):
    node0, node1 = two_nodes(supervise, tmp_path, lambda i: [], lambda i: ("--all", "loop"))
    wait_joined(tmp_path, 2)
    os.kill(node1.proc.pid, signal.SIGKILL)
    node1.proc.wait(timeout=10)
    assert node0.wait(EXIT_TIMEOUT_S) == 84, node0.stderr[-3000:]
    lost = node0.events("peer node lost")
    assert lost and lost[0]["node"] == 1
    assert summary(node0, "node_lost")["reason"] == "node_lost"


def test_node_0_lost_takes_the_store_and_the_others_exit_84(supervise, tmp_path):
    node0, node1 = two_nodes(supervise, tmp_path, lambda i: [], lambda i: ("--all", "loop"))
    wait_joined(tmp_path, 2)
    os.kill(node0.proc.pid, signal.SIGKILL)
    node0.proc.wait(timeout=10)
    assert node1.wait(EXIT_TIMEOUT_S) == 84, node1.stderr[-3000:]
    lost = node1.events("peer node lost")
    assert lost and lost[0]["node"] == 0 and "store" in lost[0]["detail"]


def test_a_clean_finish_on_both_nodes_exits_0(supervise, tmp_path):
    node0, node1 = two_nodes(supervise, tmp_path, lambda i: [], lambda i: ("--all", "finish", "--steps", "20"))
    assert node1.wait(EXIT_TIMEOUT_S) == 0, node1.stderr[-3000:]
    assert node0.wait(EXIT_TIMEOUT_S) == 0, node0.stderr[-3000:]
    assert node0.bundles() == [] and node1.bundles() == []


def test_a_stop_signal_on_one_node_stops_the_group_gracefully(supervise, tmp_path):
    node0, node1 = two_nodes(supervise, tmp_path, lambda i: [], lambda i: ("--all", "loop"))
    wait_joined(tmp_path, 2)
    node1.proc.send_signal(signal.SIGTERM)
    assert node1.wait(EXIT_TIMEOUT_S) == 0, node1.stderr[-3000:]
    assert node0.wait(EXIT_TIMEOUT_S) == 0, node0.stderr[-3000:]


@pytest.mark.parametrize("problem", ["duplicate", "mismatch"])
def test_a_bad_group_is_refused_on_every_node_and_nothing_starts(supervise, tmp_path, problem):
    if problem == "duplicate":
        runs = two_nodes(supervise, tmp_path, lambda i: ["--rendezvous-timeout", "30"], lambda i: ("--all", "loop"),
                         nnodes=3, node_ranks=[0, 1, 1])
        needle = "duplicate --node-rank 1"
    else:
        runs = two_nodes(supervise, tmp_path, lambda i: ["--fingerprint-env", "MODEL_REV"],
                         lambda i: ("--all", "loop", "--steps", str(10 + i)))
        needle = "mismatch"
    codes = [run.wait(EXIT_TIMEOUT_S) for run in runs]
    assert codes == [64] * len(runs), [run.stderr[-1500:] for run in runs]
    for run in runs:
        assert needle in run.stderr, run.stderr[-2000:]
        assert not run.events("rank started"), "a rank was started before the group was agreed"
    if problem == "mismatch":
        assert "command: node 0:" in runs[0].stderr and "--steps 10" in runs[0].stderr and "--steps 11" in runs[0].stderr
    assert marked_pids(supervise.mark) == []


def test_a_missing_node_is_exit_83_naming_it(supervise, tmp_path):
    port = free_port()
    run = supervise(["--nnodes", "2", "--node-rank", "0", "--master-port", str(port), "--store-port", str(free_port()),
                     "--nproc-per-node", "1",
                     "--rendezvous-timeout", "8"], fake_rank("--all", "loop"))
    assert run.wait(EXIT_TIMEOUT_S) == 83, run.stderr[-3000:]
    assert "node rank(s) [1] never registered" in run.stderr
    waiting = run.events("waiting for nodes")
    assert waiting and waiting[0]["missing_node_ranks"] == [1]


def test_both_nodes_bundles_share_the_incident_id_and_analyze_renders_them_as_one(rank_exit_on_node_1):
    import json
    import subprocess
    import sys

    node0, node1, codes = rank_exit_on_node_1
    assert codes == (84, 80)
    origin = [b for b in node1.bundles() if "rank_exit" in b.name][0]
    peer = [b for b in node0.bundles() if "peer_failed" in b.name][0]
    ids = {json.loads((b / "summary.json").read_text())["incident_id"] for b in (origin, peer)}
    assert len(ids) == 1 and None not in ids
    out = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(peer), str(origin), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    whole = json.loads(out.stdout)
    assert whole["incident_id"] == ids.pop() and whole["reason"] == "rank_exit" and whole["culprit_ranks"] == [1]
    assert set(whole["nodes"]) == {"0", "1"}
    shown = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(peer), str(origin)],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "400"})  # a long tmp path must not wrap "(node 0)"
    assert shown.returncode == 0 and "2 node bundles" in shown.stdout
    assert shown.stdout.index("(node 1)") < shown.stdout.index("(node 0)")  # where it began comes first


def test_a_rank_exit_on_node_1_names_it_and_where_node_0_was(rank_exit_on_node_1):
    """Issue 12's evidence exchange on the shared run: the origin merges every node's summary."""
    import json

    node0, node1, codes = rank_exit_on_node_1
    assert codes == (84, 80), node1.stderr[-3000:] + node0.stderr[-3000:]
    origin_path = [b for b in node1.bundles() if "rank_exit" in b.name][-1]
    peer_path = [b for b in node0.bundles() if "peer_failed" in b.name][-1]
    origin, peer = (json.loads((p / "summary.json").read_text()) for p in (origin_path, peer_path))
    exchange = [f"{line.get('event')}: {line.get('error') or line.get('verdict') or ''}"
                for run in (node1, node0) for line in run.lines if str(line.get("event", "")).startswith("incident_")]
    assert set(origin.get("nodes") or {}) == {"0", "1"}, exchange
    assert origin["nodes"]["1"]["ranks"]["1"]["exit"] == "exited with code 3"
    verdict = origin["verdict"]
    assert verdict.startswith("rank 1 on node 1 exited with code 3; rank 0 on node 0 "), verdict
    assert "Node 1's own verdict: rank 1 (pid" in verdict, verdict
    assert peer["peer_bundles"]["1"]["bundle"] == str(origin_path.resolve())
    # the whole node summary fits the store record's bound
    assert len(json.dumps(origin["nodes"]["0"])) < 16 * 1024
