"""Blame across nodes (issue 19): the right node named, fast, with real supervisors on loopback.

- A node's supervisor SIGKILLed: its kernel closes the link to node 0's gate, node 0 knows at once;
  node 0's own rank dies of the broken gloo connection within milliseconds, and that death is ruled a
  consequence (the incident is node 1's loss: 84 node_lost), not node 0's rank failure (80).
- A rank SIGKILLed on node 1: node 1 rules it (80) and rings; node 0 follows (84), one incident id.
- Node 0's supervisor SIGSTOPped: node 1 hears nothing on its link and its store calls hit their
  deadline; it tears down and exits 84 within the node timeout.
- Two supervisors told --node-rank 0: the second finds a gate on the port, both exit 64 saying so.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import wait_no_marked
from tests.e2e.test_multinode import wait_joined
from tp_supervise.supervisor.rank.net import free_port

pytestmark = pytest.mark.e2e

GLOO = str(Path(__file__).resolve().parents[1] / "fakes" / "gloo_loop.py")
EXIT_TIMEOUT_S = 60
NODE_TIMEOUT_S = 3.0


def gloo_nodes(supervise, tmp_path, extra=(), gloo_args=("--iters", "1000000")):
    port, store_port = free_port(), free_port()
    runs = []
    for node in range(2):
        args = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port), "--store-port",
                str(store_port), "--nproc-per-node", "1", "--kill-grace", "2", "--node-timeout", str(NODE_TIMEOUT_S),
                "--stack-method", "none", *extra]
        runs.append(supervise(args, [sys.executable, GLOO, *gloo_args], dump_dir=tmp_path / f"dumps-{node}"))
    return runs


def test_a_sigkilled_node_1_is_lost_to_node_0_not_its_own_rank(supervise, tmp_path):
    node0, node1 = gloo_nodes(supervise, tmp_path)
    wait_joined(tmp_path, 2)
    time.sleep(1.0)  # the ranks are in their collectives
    killed = time.monotonic()
    os.kill(node1.proc.pid, signal.SIGKILL)
    node1.proc.wait(timeout=10)
    assert node0.wait(EXIT_TIMEOUT_S) == 84, node0.stderr[-4000:]
    took = node0.ended - killed
    print(f"node 0 exited {took:.2f} s after the kill")
    summary = node0.summary("node_lost")
    assert summary["culprit_node"] == 1 and "node 1" in summary["verdict"], summary["verdict"]
    assert not [b for b in node0.bundles() if "rank_exit" in b.name], "node 0 blamed its own rank"
    # node 0's rank died of the broken connection first: said as a consequence, not a cause
    assert node0.events("rank_exit_consequence") or node0.events("peer node lost"), node0.stderr[-3000:]
    assert took < 5.0, f"node 0 exited {took:.2f} s after node 1's supervisor was killed"
    assert wait_no_marked(supervise.mark, 3.0) == []  # node 1's rank died with its supervisor too


def test_a_sigkilled_rank_on_node_1_is_node_1s_incident_on_both(supervise, tmp_path):
    node0, node1 = gloo_nodes(supervise, tmp_path)
    wait_joined(tmp_path, 2)
    time.sleep(1.0)
    rank_pid = next(line["pid"] for line in _lines_until(node1, "rank started"))
    killed = time.monotonic()
    os.kill(rank_pid, signal.SIGKILL)
    assert node1.wait(EXIT_TIMEOUT_S) == 80, node1.stderr[-4000:]
    assert node0.wait(EXIT_TIMEOUT_S) == 84, node0.stderr[-4000:]
    origin, peer = node1.summary("rank_exit"), node0.summary("peer_failed")
    assert origin["incident_id"] == peer["incident_id"]
    assert origin["culprit_ranks"] == [1] and peer["culprit_ranks"] == [1]
    assert "rank 1 on node 1" in peer["verdict"]
    print(f"both exited {max(node0.ended, node1.ended) - killed:.2f} s after the rank kill")
    assert max(node0.ended, node1.ended) - killed < 6.0


def _lines_until(run, text: str, timeout: float = 30.0) -> list[dict]:
    """JSON lines of a running supervisor's stderr up to the first whose event or text matches ``text``."""
    import json

    deadline = time.monotonic() + timeout
    seen = []
    assert run.proc.stderr is not None
    while time.monotonic() < deadline:
        raw = run.proc.stderr.readline()
        if not raw:
            break
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        seen.append(line)
        if text in (line.get("message", ""), line.get("event", "")):
            return seen[-1:]
    raise AssertionError(f"no {text!r} line within {timeout} s")


@pytest.mark.slow
def test_a_frozen_node_0_is_a_lost_store_for_node_1(supervise, tmp_path):
    node0, node1 = gloo_nodes(supervise, tmp_path)
    wait_joined(tmp_path, 2)
    os.kill(node0.proc.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert node1.wait(EXIT_TIMEOUT_S) == 84, node1.stderr[-4000:]
        took = node1.ended - stopped
        print(f"node 1 exited {took:.2f} s after node 0 froze")
        lost = node1.events("peer node lost")
        assert lost and lost[0]["node"] == 0, node1.stderr[-3000:]
        assert took < NODE_TIMEOUT_S + 4.0, f"node 1 exited {took:.1f} s after node 0 froze"
    finally:
        os.kill(node0.proc.pid, signal.SIGKILL)
        os.kill(node0.proc.pid, signal.SIGCONT)
        node0.proc.wait(timeout=10)


@pytest.mark.slow
def test_two_node_0s_both_refuse_naming_the_node_rank(supervise, tmp_path):
    port, store_port = free_port(), free_port()
    runs = []
    for i in range(2):
        args = ["--nnodes", "2", "--node-rank", "0", "--master-port", str(port), "--store-port", str(store_port),
                "--nproc-per-node", "1", "--rendezvous-timeout", "60"]
        runs.append(supervise(args, [sys.executable, "-c", "pass"], dump_dir=tmp_path / f"dumps-{i}"))
        time.sleep(2.0 if i == 0 else 0)  # the first is up (its store child started) before the second tries
    started = time.monotonic()
    codes = [run.wait(EXIT_TIMEOUT_S) for run in runs]
    assert codes == [64, 64], [run.stderr[-2000:] for run in runs]
    assert max(run.ended for run in runs) - started < 10.0
    for run in runs:
        assert "--node-rank 0" in run.stderr and "twice" in run.stderr, run.stderr[-2000:]
