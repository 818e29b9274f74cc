"""Incidents span nodes (issue 12): every node's bundle of one incident is published to the supervisors'
store as a node summary; the originating node merges them into its summary.json (``nodes`` and a verdict
naming the culprit by global rank and node, and where the other nodes' ranks wait), and the other nodes'
bundles point at the originating node's (``peer_bundles``).  Two real supervisors on loopback.

The stopped-rank case is also the hang query's acceptance run: rank 1 on node 1 stops outside collectives,
so only node 0 sees a busy group; it asks, node 1 raises the hang (81, culprit [1]) under that incident id,
and node 0 follows it (81 too: a hang is the whole group's), its verdict naming rank 1 on node 1."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tp_supervise.supervisor.rank.net import free_port

pytestmark = pytest.mark.e2e

GLOO = str(Path(__file__).resolve().parents[1] / "fakes" / "gloo_loop.py")
EXIT_TIMEOUT_S = 120


def bundle(run, reason: str) -> Path:
    found = [b for b in run.bundles() if reason in b.name]
    assert found, f"no {reason} bundle in {[b.name for b in run.bundles()]}\n{run.stderr[-3000:]}"
    return found[-1]


def exchange_log(run) -> list[str]:
    return [f"{line.get('event')}: {line.get('error') or line.get('verdict') or ''}" for line in run.lines
            if str(line.get("event", "")).startswith("incident_")]


def read(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


def analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_a_stopped_rank_on_node_1_is_merged_with_node_0s_waiting_rank(supervise, tmp_path):
    port, store_port = free_port(), free_port()
    runs = []
    for node in range(2):
        args = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port), "--store-port", str(store_port),
                "--nproc-per-node", "1", "--soft-timeout", "3", "--hard-timeout", "6", "--kill-grace", "2"]
        cmd = [sys.executable, GLOO, "--iters", "100000", "--fault", "stop", "--fault-rank", "1", "--fault-at", "30"]
        runs.append(supervise(args, cmd, dump_dir=tmp_path / f"dumps-{node}"))
    node0, node1 = runs
    assert node1.wait(EXIT_TIMEOUT_S) == 81, node1.stderr[-4000:]
    assert node0.wait(EXIT_TIMEOUT_S) == 81, node0.stderr[-4000:]
    origin_path, peer_path = bundle(node1, "-hang"), bundle(node0, "peer_failed")
    origin, peer = read(origin_path), read(peer_path)
    assert origin["incident_id"] == peer["incident_id"]
    # the originating node (1) merged both nodes' summaries
    assert set(origin.get("nodes") or {}) == {"0", "1"}, (exchange_log(node1), exchange_log(node0))
    assert origin["nodes"]["0"]["bundle"] == str(peer_path.resolve())
    # rank 0 waited in the all_reduce rank 1 never entered: still inside it when node 0 captured, or (node 1's
    # teardown broke the collective first) last seen inside it by its heartbeat slot
    waiting = origin["nodes"]["0"]["ranks"]["0"]
    assert waiting["in_collective"] or waiting["last_wait"].startswith("all_reduce #"), waiting
    assert origin["nodes"]["1"]["ranks"]["1"]["state"] == "T"
    assert origin["culprit_ranks"] == [1] and origin["culprit_node"] == 1
    verdict = origin["verdict"]
    assert verdict.startswith("rank 1 on node 1 is stopped (state T)"), verdict
    assert re.search(r"; rank 0 on node 0 wait(s|ed) in all_reduce #\d+", verdict), verdict
    assert "stopped" in origin["node_verdict"] and "nodes_missing" not in origin
    assert origin["peer_bundles"]["0"]["bundle"] == str(peer_path.resolve())
    assert "rank 1 on node 1" in peer["verdict"], peer["verdict"]
    # summary.txt was rewritten with it
    assert "evidence of 2 nodes merged" in (origin_path / "summary.txt").read_text()
    # the peer's bundle points at the originating node's
    assert peer["peer_bundles"]["1"]["bundle"] == str(origin_path.resolve())
    assert peer["peer_bundles"]["1"]["reason"] == "hang"
    merged = node1.events("incident_nodes_merged")
    assert merged and merged[0]["nodes"] == [0, 1] and merged[0]["missing"] == []
    # analyze of the one bundle shows the merged view
    shown = analyze(str(origin_path))
    assert shown.returncode == 0, shown.stderr
    assert "evidence of 2 nodes merged" in shown.stdout, shown.stdout
    assert f"node 0 ({origin['nodes']['0']['host']}): peer_failed, bundle" in shown.stdout, shown.stdout
    # ... and the two bundles together still render as one incident
    both = analyze(str(peer_path), str(origin_path), "--json")
    assert both.returncode == 0, both.stderr
    whole = json.loads(both.stdout)
    assert whole["reason"] == "hang" and whole["verdict"] == verdict and set(whole["nodes"]) == {"0", "1"}


# The rank-exit case (origin verdict naming where node 0 was, peer_bundles) is asserted on the shared
# two-node rank-exit run: test_multinode.py::test_a_rank_exit_on_node_1_names_it_and_where_node_0_was.
