"""Node loss, again and again (issue 26): two supervisors on loopback, one real gloo rank each, default flags.

- Node 1's supervisor SIGKILLed, REPEAT times (3 here, 10 by hand: ``NODE_LOSS_REPEAT=10``): node 0 sees
  node 1's link close (not its beats stop) and exits 84 ``node_lost`` every time, its own rank's death
  of the broken gloo connection a consequence.  It was 80, blaming node 0's rank, in 1 of 3 runs: a dial
  that node 1 had given up on finished its hello late at node 0's gate and took the real link's place,
  so the real link's close was nobody's loss and the loss waited for the beats' timeout.
- A rank SIGKILLed on node 1: both supervisors gone within moments (they took 5.4 s: node 0 kept its store
  up for the whole linger, waiting for a "done" the node where the incident began never writes).
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
from tests.e2e.test_multinode_fate import _lines_until
from tp_supervise.supervisor.rank.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # tens of seconds of real time each: make test-slow

GLOO = str(Path(__file__).resolve().parents[1] / "fakes" / "gloo_loop.py")
REPEAT = int(os.environ.get("NODE_LOSS_REPEAT", "3"))
EXIT_TIMEOUT_S = 60
READY_TIMEOUT_S = 120.0  # two torch imports and a gloo rendezvous on a loaded 2-core host
NODE_TIMEOUT_S = 4.0  # the default --node-timeout: a loss seen through the beats takes at least this long
TEARDOWN_BOUND_S = 4.0  # both supervisors gone after a rank kill (measured about 1 s on the loaded host)


def gloo_pair(supervise, tmp_path):
    """Two nodes as a user starts them: default flags but the ports (free ones, chosen now)."""
    port, store_port = free_port(), free_port()
    runs = []
    for node in range(2):
        args = [
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-port",
            str(port),
            "--store-port",
            str(store_port),
            "--nproc-per-node",
            "1",
        ]
        runs.append(supervise(args, [sys.executable, GLOO, "--iters", "1000000"], dump_dir=tmp_path / f"dumps-{node}"))
    return runs


def in_collectives(*runs) -> None:
    """Every rank passed its rendezvous and runs its all_reduce loop."""
    for run in runs:
        _lines_until(run, "every_rank_is_ready", timeout=READY_TIMEOUT_S)
    time.sleep(1.0)


@pytest.mark.parametrize("attempt", range(REPEAT))
def test_a_sigkilled_node_1_supervisor_is_node_lost_on_node_0_every_time(supervise, tmp_path, attempt):
    node0, node1 = gloo_pair(supervise, tmp_path)
    wait_joined(tmp_path, 2)
    in_collectives(node0, node1)
    killed = time.monotonic()
    os.kill(node1.proc.pid, signal.SIGKILL)  # its rank follows it (parent-death signal)
    node1.proc.wait(timeout=10)
    code = node0.wait(EXIT_TIMEOUT_S)
    took = node0.ended - killed
    print(f"attempt {attempt}: node 0 exited {code} {took:.2f} s after node 1's supervisor was killed")
    assert code == 84, node0.stderr[-4000:]
    assert not [b for b in node0.bundles() if "rank_exit" in b.name], "node 0 blamed its own rank"
    summary = node0.summary("node_lost")
    assert summary["culprit_node"] == 1, summary["verdict"]
    lost = node0.events("peer node lost")
    assert lost and lost[0]["node"] == 1, node0.stderr[-3000:]
    detail = lost[0]["detail"]
    assert "closed its link" in detail or "broke" in detail, f"seen through the beats, not the link: {detail}"
    assert took < NODE_TIMEOUT_S, f"node 0 exited {took:.2f} s after the kill"
    assert wait_no_marked(supervise.mark, 3.0) == []


def test_a_sigkilled_rank_on_node_1_ends_both_supervisors_within_moments(supervise, tmp_path):
    node0, node1 = gloo_pair(supervise, tmp_path)
    wait_joined(tmp_path, 2)
    rank_pid = _lines_until(node1, "rank started", timeout=READY_TIMEOUT_S)[0]["pid"]
    in_collectives(node0, node1)
    killed = time.monotonic()
    os.kill(rank_pid, signal.SIGKILL)
    assert node1.wait(EXIT_TIMEOUT_S) == 80, node1.stderr[-4000:]
    assert node0.wait(EXIT_TIMEOUT_S) == 84, node0.stderr[-4000:]
    origin, peer = node1.summary("rank_exit"), node0.summary("peer_failed")
    assert origin["incident_id"] == peer["incident_id"] and peer["culprit_ranks"] == [1]
    took = max(node0.ended, node1.ended) - killed
    print(f"both supervisors gone {took:.2f} s after the rank kill (node 1 {node1.ended - killed:.2f} s)")
    assert took < TEARDOWN_BOUND_S, f"both supervisors gone only {took:.2f} s after the rank kill"
