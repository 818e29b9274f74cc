"""``--on-straggler restart|kill`` (issue 26), with real supervisors and torch-free ranks.

The ranks run a real blocking exchange over TCP (rank 0 of the world is the hub, on MASTER_ADDR:MASTER_PORT),
entered through the runtime's collective (its arrival stamps are what the straggler detector reads); one rank
is slow from the start by most of the step, so the detector names it by its gross share within seconds.

What is checked:
* the straggler bundle carries the incident id that was announced (the quarantine's incident file, which a
  rank reads when its teardown's SIGTERM comes; on two nodes, the other node's ``peer_failed`` bundle), and the
  next bundle of the run (an on-demand dump of the next attempt) does not;
* ``kill`` ends the run (exit 80) whatever ``--max-restarts`` says, on one node and when the straggler is on a
  node other than 0 (node 0 follows with 84, no node restarts); ``restart`` restarts the group.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from tp_supervise.supervisor.rank.net import free_port

pytestmark = pytest.mark.slow  # straggler runs: a rank named after a sustained window (make test-slow)

RANK = textwrap.dedent(
    """
    import os, signal, socket, sys, time
    from tp_supervise.engine.runfiles import read_incident
    from tp_supervise.supervisor.rank import runtime as sv

    slow_rank, dump_in_attempt = int(sys.argv[1]), int(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # The first attempt has the straggler and runs until it is torn down; a later one runs clean and ends.
    slow = rank == slow_rank and attempt == 0
    run_s = float(sys.argv[3] if attempt == 0 else sys.argv[4])
    STEP_S, LAG_S = 0.005, 0.04  # the slow rank keeps the others waiting ~90 % of the step

    def torn_down(_signum, _frame):  # the incident file is written before the teardown signals any rank
        if os.environ["LOCAL_RANK"] == "0":
            print(f"announced incident {read_incident(os.environ[sv.ENV_RUN_DIR])}", flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, torn_down)
    sv.starting()
    hub = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if rank == 0:
        server = socket.create_server(hub, reuse_port=False, backlog=world)
        peers = [server.accept()[0] for _ in range(world - 1)]
    else:
        while True:
            try:
                conn = socket.create_connection(hub, timeout=60)
                conn.settimeout(None)
                break
            except OSError:
                time.sleep(0.05)
    sv.ready()
    if attempt == dump_in_attempt and rank == 0:
        os.kill(int(os.environ[sv.ENV_SUPERVISOR_PID]), signal.SIGUSR1)  # an on-demand dump of this attempt

    def broken():  # a peer is gone (another node's teardown came first): wait for this node's own
        while True:
            time.sleep(3600)

    def exchange(last):  # every rank waits for the last to arrive; rank 0 says whether this was the last
        try:
            if rank == 0:
                for c in peers:
                    if not c.recv(1):
                        broken()
                for c in peers:
                    c.sendall(b"s" if last else b"x")
                return last
            conn.sendall(b"x")
            answer = conn.recv(1)
        except OSError:
            broken()
        if not answer:
            broken()
        return answer == b"s"

    t0 = time.monotonic()
    while True:
        time.sleep(STEP_S)
        if slow:
            time.sleep(LAG_S)
        with sv.collective("all_reduce", "8 float32"):
            done = exchange(rank == 0 and time.monotonic() - t0 >= run_s)
        if done:
            break
    sv.finished()
    sys.exit(0)
    """
)
NEVER = -1
FIRST_S = 120.0  # the straggler's attempt, never torn down, would end by itself after this: a bound, not a pace
LATER_S = 3.0  # an attempt after the straggler's runs this long, then ends cleanly
STRAGGLER_ARGS = ["--straggler-sustain", "2", "--kill-grace", "2"]
EXIT_S = 150  # the detector's warm-up and 2 s sustained, on a loaded 2-core host: generous


def ranks(slow_rank: int, dump_in_attempt: int = NEVER) -> list[str]:
    """``dump_in_attempt``: the attempt (TORCHELASTIC_RESTART_COUNT) whose rank 0 asks for an on-demand dump."""
    return [sys.executable, "-c", RANK, str(slow_rank), str(dump_in_attempt), str(FIRST_S), str(LATER_S)]


def announced(run) -> list[str]:
    """The incident ids the ranks read from the quarantine's incident file when their teardown came."""
    return [line["message"].split()[-1] for line in run.events("rank_output")
            if "announced incident" in line.get("message", "")]


def attempts(run) -> list[int]:
    return sorted({line["attempt"] for line in run.events("rank started")})


def test_kill_ends_the_run_with_80_and_a_bundle_under_the_announced_id(supervise):
    run = supervise(["--nproc-per-node", "2", "--on-straggler", "kill", "--max-restarts", "2", *STRAGGLER_ARGS],
                    ranks(slow_rank=1))
    assert run.wait(EXIT_S) == 80, run.stderr[-4000:]
    named = run.events("straggler_named")
    assert [line["rank"] for line in named] == [1] and named[0]["action"] == "kill", run.stderr[-3000:]
    assert attempts(run) == [1], "kill is final: no restart although --max-restarts 2"
    summary = run.summary("straggler")
    assert summary["culprit_ranks"] == [1] and "rank 1 arrives" in summary["verdict"]
    assert announced(run) == [summary["incident_id"]], (announced(run), summary["incident_id"])
    assert run.events("supervise exiting")[-1]["reason"] == "straggler"


def test_restart_restarts_the_group_and_the_announced_id_stays_with_its_bundle(supervise):
    """The straggler's incident id is on its own bundle, and on no later one: the next attempt's on-demand dump
    names an incident of its own (the issue: the announced id was stamped on the next bundle of any kind)."""
    run = supervise(["--nproc-per-node", "2", "--on-straggler", "restart", "--max-restarts", "1", *STRAGGLER_ARGS],
                    ranks(slow_rank=1, dump_in_attempt=1))
    assert run.wait(EXIT_S) == 0, run.stderr[-4000:]
    assert attempts(run) == [1, 2], run.stderr[-3000:]
    assert [line["rank"] for line in run.events("straggler_named")] == [1]
    straggler, on_demand = run.summary("straggler"), run.summary("on_demand")
    assert straggler["attempt"] == 1 and on_demand["attempt"] == 2
    assert announced(run) == [straggler["incident_id"]], (announced(run), straggler["incident_id"])
    assert on_demand["incident_id"] != straggler["incident_id"]


@pytest.mark.alone  # node timeouts of seconds: no second busy test meanwhile
def test_kill_on_node_1_is_final_for_the_group_and_every_bundle_names_one_incident(supervise, tmp_path):
    """The straggler (rank 3) is on node 1 and --max-restarts is 1: node 1 ends with 80, node 0 with 84, no node
    starts a second attempt; node 0's peer_failed bundle and node 1's straggler bundle carry the same id."""
    port, store_port = free_port(), free_port()
    runs = []
    for node in range(2):
        args = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port), "--store-port", str(store_port),
                "--nproc-per-node", "2", "--on-straggler", "kill", "--max-restarts", "1", "--rendezvous-timeout",
                "60", *STRAGGLER_ARGS]
        runs.append(supervise(args, ranks(slow_rank=3), dump_dir=tmp_path / f"dumps-{node}"))
    node0, node1 = runs
    assert node1.wait(EXIT_S) == 80, node1.stderr[-4000:]
    assert node0.wait(EXIT_S) == 84, node0.stderr[-4000:]
    assert [line["rank"] for line in node1.events("straggler_named")] == [3], node1.stderr[-3000:]
    assert attempts(node0) == attempts(node1) == [1], "kill is final on every node"
    heard = node0.events("peer_node_failed")
    assert heard and heard[0]["reason"] == "straggler" and heard[0]["final"] is True, node0.stderr[-3000:]
    straggler, peer = node1.summary("straggler"), node0.summary("peer_failed")
    assert straggler["incident_id"] == peer["incident_id"] == heard[0]["incident_id"]
    assert announced(node1) == announced(node0) == [straggler["incident_id"]]
