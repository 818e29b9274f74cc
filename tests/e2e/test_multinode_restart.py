"""Restarts across nodes (issue 12): with --max-restarts, a fault on any node is a new attempt of the whole
group: every node tears down, node 0 decides through the store (its restart policy counts group attempts),
all meet at a barrier, and every node launches again; out of restarts, each node exits with its own code."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tp_supervise.supervisor.rank.net import free_port
from tests.conftest import fake_rank, marked_pids
from tests.live import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.alone]  # node timeouts of seconds: no second busy test meanwhile

EXIT_TIMEOUT_S = 120


def two_nodes(supervise, tmp_path, restarts: int, ranks_args):
    port, store_port = free_port(), free_port()
    runs = []
    for node in range(2):
        args = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port), "--store-port", str(store_port),
                "--nproc-per-node", "1", "--kill-grace", "2", "--max-restarts", str(restarts),
                "--rendezvous-timeout", "60"]
        runs.append(supervise(args, fake_rank(*ranks_args(node)), dump_dir=tmp_path / f"dumps-{node}"))
    return runs


def test_a_fault_on_node_1_restarts_the_whole_group_until_the_budget_is_spent(supervise, tmp_path):
    node0, node1 = two_nodes(supervise, tmp_path, 2, lambda node: ("--all", "loop", "--on", "1=exit:3", "--delay", "1"))
    assert node1.wait(EXIT_TIMEOUT_S) == 80, node1.stderr[-3000:]
    assert node0.wait(EXIT_TIMEOUT_S) == 84, node0.stderr[-3000:]
    for node in (node0, node1):
        started = node.events("rank started")
        assert [line["attempt"] for line in started] == [1, 2, 3], started  # three group attempts on every node
        assert len(node.events("every node is ready for the next attempt")) == 2
    assert len([b for b in node1.bundles() if "rank_exit" in b.name]) == 3
    assert len([b for b in node0.bundles() if "peer_failed" in b.name]) == 3
    assert node0.events("crash loop: giving up") and not node0.events("node 0 ends the group")
    assert node1.events("node 0 ends the group") and not node1.events("crash loop: giving up")
    # node 1 followed node 0's count and backoff
    assert [line["restart"] for line in node1.events("restarting the group with node 0")] == [1, 2]


@pytest.mark.slow
def test_a_stop_signal_during_the_backoff_stops_every_node(supervise, tmp_path):
    node0, node1 = two_nodes(supervise, tmp_path, 5, lambda node: ("--all", "loop", "--on", "1=exit:3", "--delay", "1"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list((tmp_path / "dumps-0").glob("*peer_failed*")):
        time.sleep(0.1)
    node0.proc.send_signal(signal.SIGTERM)  # node 0 is between attempts (backoff or barrier)
    assert node0.wait(EXIT_TIMEOUT_S) == 0, node0.stderr[-3000:]
    assert node1.wait(EXIT_TIMEOUT_S) == 0, node1.stderr[-3000:]


@pytest.mark.slow
def test_mismatched_max_restarts_are_refused_before_anything_starts(supervise, tmp_path):
    port, store_port = free_port(), free_port()
    runs = []
    for node, restarts in ((0, "1"), (1, "2")):
        args = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port), "--store-port", str(store_port),
                "--nproc-per-node", "1", "--max-restarts", restarts, "--rendezvous-timeout", "30"]
        runs.append(supervise(args, fake_rank("--all", "loop"), dump_dir=tmp_path / f"dumps-{node}"))
    for run in runs:
        assert run.wait(60) == 64, run.stderr[-3000:]
        assert "mismatch" in run.stderr and "max_restarts" in run.stderr


FIRST_ATTEMPT_FAULT = ('if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then sleep 1; exit 3; fi; '
                       'exec sleep 1000')


def _sh_nodes(supervise, tmp_path, restarts: int):
    port, store_port = free_port(), free_port()
    runs = []
    for node in range(2):
        args = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port), "--store-port", str(store_port),
                "--nproc-per-node", "1", "--kill-grace", "2", "--max-restarts", str(restarts), "--no-hook",
                "--rendezvous-timeout", "60"]
        runs.append(supervise(args, ["sh", "-c", FIRST_ATTEMPT_FAULT], dump_dir=tmp_path / f"dumps-{node}"))
    return runs


def _ranks_of_attempt(mark: str, restart_count: int) -> int:
    """How many ranks of this test run ``exec sleep 1000`` with TORCHELASTIC_RESTART_COUNT=restart_count."""
    want = f"TORCHELASTIC_RESTART_COUNT={restart_count}".encode()
    found = 0
    for pid in marked_pids(mark):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        found += argv[0] == b"sleep" and want in env
    return found


def _wait_bundle(path, pattern, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not list(path.glob(pattern)):
        time.sleep(0.1)
    assert list(path.glob(pattern)), f"no {pattern} in {path}"


@pytest.mark.slow
def test_a_node_lost_after_a_group_restart_is_still_seen(supervise, tmp_path):
    node0, node1 = _sh_nodes(supervise, tmp_path, 2)
    _wait_bundle(tmp_path / "dumps-0", "*peer_failed*")
    # backoff (1 s) and the barrier: attempt 2 runs on both nodes (each node's rank is attempt 2's `sleep`)
    wait_for(lambda: _ranks_of_attempt(supervise.mark, 1) == 2, 60, "attempt 2's rank on both nodes")
    os.kill(node1.proc.pid, signal.SIGKILL)
    node1.proc.wait(timeout=10)
    assert node0.wait(EXIT_TIMEOUT_S) == 84, node0.stderr[-3000:]
    assert node0.events("peer node lost")
    assert [line["attempt"] for line in node0.events("rank started")] == [1, 2]


@pytest.mark.slow
def test_a_stop_on_node_1_between_attempts_stops_node_0_too(supervise, tmp_path):
    node0, node1 = _sh_nodes(supervise, tmp_path, 3)
    _wait_bundle(tmp_path / "dumps-1", "*rank_exit*")
    node1.proc.send_signal(signal.SIGTERM)  # node 1 is between attempts (waiting for node 0, backoff or barrier)
    assert node1.wait(EXIT_TIMEOUT_S) == 0, node1.stderr[-3000:]
    assert node0.wait(EXIT_TIMEOUT_S) == 0, node0.stderr[-3000:]
