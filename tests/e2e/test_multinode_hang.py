"""A hang whose culprit is on another node (issue 12): two node supervisors, one real gloo rank each
(world 2, zero-code), rank 1 on node 1 SIGSTOPs itself.  Node 0 only sees its rank waiting in an
all_reduce; node 1 sees the stopped rank.  Both write a bundle of one incident, the verdict names
global rank 1 on node 1, node 1 exits 81 and node 0 exits 84."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tp_supervise.supervisor.rank.net import free_port

pytestmark = pytest.mark.e2e

GLOO = str(Path(__file__).resolve().parents[1] / "fakes" / "gloo_loop.py")
EXIT_TIMEOUT_S = 120


def test_a_stopped_rank_on_node_1_is_named_by_both_nodes(supervise, tmp_path):
    port, store_port = free_port(), free_port()
    runs = []
    for node in range(2):
        args = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port), "--store-port", str(store_port),
                "--nproc-per-node", "1", "--soft-timeout", "3", "--hard-timeout", "6", "--kill-grace", "2"]
        cmd = [sys.executable, GLOO, "--iters", "100000", "--fault", "stop", "--fault-rank", "1", "--fault-at", "30"]
        runs.append(supervise(args, cmd, dump_dir=tmp_path / f"dumps-{node}"))
    node0, node1 = runs
    assert node1.wait(EXIT_TIMEOUT_S) == 81, node1.stderr[-4000:]
    assert node0.wait(EXIT_TIMEOUT_S) == 84, node0.stderr[-4000:]
    hang = node1.summary("-hang")
    assert hang["culprit_ranks"] == [1] and "stopped" in hang["verdict"], hang["verdict"]
    peer = node0.summary("peer_failed")
    assert peer["incident_id"] == hang["incident_id"]
    assert "rank 1 on node 1" in peer["verdict"], peer["verdict"]
