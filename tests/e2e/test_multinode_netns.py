"""Two-node groups across real network boundaries (issue 19): each node's supervisor runs in a network
namespace of its own (tests/netlab.py), so a fault is a network fault, not a signal.

* A partition (node 1's packets vanish both ways: no FIN, no RST): node 0 rules node 1 lost (84,
  ``node_lost``) and node 1, cut off from the store, stops its own ranks and exits 84 too, each within
  the heartbeat timeout of docs/multinode.md (4 s) and a margin.
* The store's host (node 0) black-holed: node 1 exits 84 within the same timeout.
* 200 ms one way (a ``DelayProxy`` in the hub) and 1 % loss (nftables, where installed) between node 1
  and the store: a healthy run is not a node loss or a hang and ends with 0 on both nodes; a rank fault
  on node 1 still reaches node 0 (80 and 84, one incident).

Each phase runs its two groups side by side (a lab of four namespaces, one group per pair) and every
test reads what the phase's run left.  Fake ranks are torch-free (tests/fakes/rank.py); each node's
processes carry a test mark of their own, so what is left running is counted per node.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import MARK_VAR, ROOT, fake_rank, marked_pids
from tests.live import wait_for
from tests.netlab import DelayProxy, Lab, NetlabUnavailable, netlab
from tests.support.nodes import Node, stop_nodes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # tens of seconds of real time each: make test-slow

NODE_LOST_S = 4.0  # docs/multinode.md: a node that stopped heartbeating this long is lost
MARGIN_S = 5.0  # detection passes, teardown (--kill-grace 2), a loaded host
WATCH_S = NODE_LOST_S + 10.0  # after the fault: what is still running then is stopped and reported
DELAY_S = 0.2  # one way, node 1 <-> the store
LOSS = 0.01


@dataclass
class Group:
    """Two supervisors of one group, node 0 on lab node ``pair[0]`` (hosting the store), node 1 on ``pair[1]``;
    node 1 reaches the store through ``DelayProxy`` in the hub when ``delay`` is set."""

    lab: Lab
    tmp: Path
    pair: tuple[int, int]
    port: int  # --master-port; the store on port + 1
    rank_args: tuple[str, ...]
    delay: float = 0.0
    nodes: list[Node] = field(default_factory=list)
    proxy: DelayProxy | None = None
    fault_at: float = 0.0
    fault_wall: float = 0.0

    def start(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        store_port = self.port + 1
        store_host = self.lab.addr(self.pair[0])
        node1_sees = store_host
        if self.delay:
            self.proxy = DelayProxy((self.lab.hub_addr, store_port), (store_host, store_port), self.delay,
                                    netns=self.lab.ns("hub"), max_seconds=180)
            node1_sees = self.lab.hub_addr
        for rank, (ns, master) in enumerate(zip(self.pair, (store_host, node1_sees), strict=True)):
            mark = uuid.uuid4().hex
            env = dict(os.environ, **{MARK_VAR: mark, "SUPERVISE_REGISTRY_DIR": str(self.tmp / "registry")})
            dump_dir, log = self.tmp / f"dumps-{rank}", self.tmp / f"node{rank}.log"
            argv = [sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--log-format", "json",
                    "--metrics-addr", "127.0.0.1:0", "--metrics-linger", "0", "--dump-dir", str(dump_dir),
                    "--nnodes", "2", "--node-rank", str(rank), "--master-addr", master,
                    "--master-port", str(self.port), "--store-port", str(store_port),
                    "--nproc-per-node", "1", "--kill-grace", "2", "--", *fake_rank(*self.rank_args)]
            with open(log, "w") as out:
                proc = self.lab.run_in(ns, argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
            self.nodes.append(Node(rank, ns, proc, log, dump_dir, mark))

    def joined(self) -> bool:
        return len(list((self.tmp / "registry").glob("*.json"))) >= 2 if (self.tmp / "registry").is_dir() else False

    def note_fault(self) -> None:
        self.fault_at, self.fault_wall = time.monotonic(), time.time()

    def seconds_after_fault(self, line: dict) -> float:
        stamp = datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()
        return stamp - self.fault_wall

    def stop(self) -> None:
        stop_nodes(self.nodes)
        if self.proxy is not None:
            self.proxy.stop()


def stacks_of(pid: int) -> str:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy: {exc})"
    threads = [block for block in out.stdout.split("\nThread ") if "node-link" in block.split("\n", 1)[0]]
    return "".join(f"Thread {block}" for block in threads) or (out.stdout + out.stderr)[-1500:]


def watch(groups: list[Group], until_s: float) -> None:
    """Poll every node until all ended or ``until_s`` after its group's fault; at fault + NODE_LOST_S +
    MARGIN_S note what each node still runs (or when all ended, if sooner)."""
    nodes = [(g, n) for g in groups for n in g.nodes]
    while True:
        now = time.monotonic()
        for g, n in nodes:
            n.poll()
            if n.at_bound is None and (now >= g.fault_at + NODE_LOST_S + MARGIN_S or n.ended is not None):
                if n.ended is not None and now < g.fault_at + NODE_LOST_S + MARGIN_S:
                    time.sleep(0.3)  # the ranks of a supervisor that just exited are reaped by now
                n.alive_at_bound, n.at_bound = n.proc.poll() is None, marked_pids(n.mark)
        if all(n.ended is not None for _, n in nodes) or all(now >= g.fault_at + until_s for g in groups):
            break
        time.sleep(0.05)
    for _, n in nodes:
        if n.proc.poll() is None:
            n.stacks = stacks_of(n.proc.pid)


@pytest.fixture(scope="module")
def four_namespaces():
    try:
        with netlab(4) as lab:
            yield lab
    except NetlabUnavailable as exc:
        pytest.skip(f"no network namespaces: {exc}")


def start_and_join(groups: list[Group]) -> None:
    for g in groups:
        g.start()
    wait_for(lambda: all(g.joined() for g in groups), 90, "every node of every group running its ranks")
    time.sleep(2.0)  # every node beat a few times: a silence from now on is a loss after NODE_LOST_S
    gone = [n for g in groups for n in g.nodes if n.proc.poll() is not None]
    assert not gone, "a node ended before the fault was made:\n" + "\n".join(n.tail() for n in gone)


# -- a partition and a black-holed store host ----------------------------------------------------------
@pytest.fixture(scope="module")
def cut(four_namespaces, tmp_path_factory):
    """Group ``partition`` (lab nodes 0, 1): node 1 partitioned.  Group ``hole`` (lab nodes 2, 3): the
    store's host, node 0, black-holed.  Both at the same moment, mid-run."""
    lab, tmp = four_namespaces, tmp_path_factory.mktemp("cut")
    partition = Group(lab, tmp / "partition", (0, 1), 29500, ("--all", "loop"))
    hole = Group(lab, tmp / "hole", (2, 3), 29510, ("--all", "loop"))
    try:
        start_and_join([partition, hole])
        partition.note_fault()
        lab.partition(1)
        hole.note_fault()
        lab.black_hole(2)
        watch([partition, hole], WATCH_S)
        for g in (partition, hole):
            g.stop()  # what still runs now is stuck: it must not load the next phase
        lab.heal()
        yield {"partition": partition, "hole": hole}
    finally:
        for g in (partition, hole):
            g.stop()
        lab.heal()


def assert_lost(g: Group, node: Node, lost: int, *, store: bool = False) -> None:
    """``node`` ruled node ``lost`` lost (84, node_lost, within the timeout) and left nothing running."""
    assert node.code == 84, node.tail()
    said = node.events("peer node lost")
    assert said and said[0]["node"] == lost, node.tail()
    if store:
        assert "store" in said[0]["detail"], said[0]
    after = g.seconds_after_fault(said[0])
    # Silence, not a closed connection: a heartbeat timeout (docs/multinode.md), never before it, nor long after.
    assert NODE_LOST_S / 2 <= after <= NODE_LOST_S + MARGIN_S, (
        f"node {lost} ruled lost {after:.1f} s after the fault\n{node.tail()}")
    assert node.summary("node_lost")["reason"] == "node_lost"
    assert node.ranks_at_bound() == [], f"ranks of node {node.rank} still ran {NODE_LOST_S + MARGIN_S} s on"


def test_a_partitioned_node_1_is_lost_to_node_0(cut):
    g = cut["partition"]
    node0 = g.nodes[0]
    assert_lost(g, node0, 1)
    assert "node 1" in node0.summary("node_lost")["verdict"]


def test_node_0_is_gone_within_the_timeout_of_a_partition(cut):
    node0 = cut["partition"].nodes[0]
    assert node0.ended is not None and node0.code == 84, node0.tail()
    took = node0.ended - cut["partition"].fault_at
    assert took <= NODE_LOST_S + MARGIN_S, f"node 0 exited {took:.1f} s after the partition"


def test_a_partitioned_node_1_stops_its_ranks_and_exits_84(cut):
    g = cut["partition"]
    node1 = g.nodes[1]
    assert not node1.alive_at_bound, f"node 1 still ran {NODE_LOST_S + MARGIN_S} s after the partition\n{node1.tail()}"
    assert_lost(g, node1, 0, store=True)


def test_a_black_holed_store_host_is_a_lost_node_to_node_1(cut):
    g = cut["hole"]
    node1 = g.nodes[1]
    assert not node1.alive_at_bound, f"node 1 still ran {NODE_LOST_S + MARGIN_S} s after node 0 went dark\n{node1.tail()}"
    assert_lost(g, node1, 0, store=True)


def test_the_black_holed_store_host_stops_its_own_ranks(cut):
    """Cut off from everyone, node 0 hears no beat from node 1: it does not serve alone."""
    g = cut["hole"]
    assert_lost(g, g.nodes[0], 1)


# -- a slow, lossy way to the store ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slow(four_namespaces, tmp_path_factory, cut):  # after `cut`: one phase at a time on two cores
    """Node 1 of each group reaches the store through a 200 ms proxy (and 1 % loss where nft is).  Group
    ``healthy`` (lab nodes 0, 1) runs its ranks to the end (7000 steps of >= 2 ms: >= 14 s); group
    ``fault`` (lab nodes 2, 3) has rank 1 exit with 3 after 8 s."""
    lab, tmp = four_namespaces, tmp_path_factory.mktemp("slow")
    lab.heal()
    healthy = Group(lab, tmp / "healthy", (0, 1), 29520, ("--all", "finish", "--steps", "7000"), delay=DELAY_S)
    fault = Group(lab, tmp / "fault", (2, 3), 29530, ("--all", "loop", "--on", "1=exit:3", "--delay", "8"),
                  delay=DELAY_S)
    loss = 0.0
    try:
        if shutil.which("nft"):
            lab.lossy(1, LOSS)
            lab.lossy(3, LOSS)
            loss = LOSS
        for g in (healthy, fault):
            g.start()
            g.note_fault()
        watch([healthy, fault], 90)
        yield {"healthy": healthy, "fault": fault, "loss": loss}
    finally:
        for g in (healthy, fault):
            g.stop()
        lab.heal()


def test_a_slow_store_is_no_node_loss_and_no_hang(slow):
    g = slow["healthy"]
    for node in g.nodes:
        assert node.code == 0, node.tail()
        assert node.bundles() == [], node.tail()
        assert not node.events("peer node lost") and not node.events("peer node failed"), node.tail()
        assert not [line for line in node.lines() if "hang" in str(line.get("event", ""))], node.tail()
        assert marked_pids(node.mark) == []
    node1 = g.nodes[1]
    assert node1.events("joining the nodes")[0]["store"] == f"{g.lab.hub_addr}:{g.port + 1}"
    assert g.proxy.connections >= 1 and g.proxy.bytes_up > 0 and g.proxy.bytes_down > 0
    ready, finished = node1.events("every rank is ready"), node1.events("every rank finished with exit code 0")
    assert ready and finished
    ran = g.seconds_after_fault(finished[0]) - g.seconds_after_fault(ready[0])
    assert ran >= 10.0, f"the ranks ran {ran:.1f} s behind the slow store: too short to mean anything"


def test_a_rank_fault_on_node_1_still_propagates_through_the_slow_store(slow):
    g = slow["fault"]
    node0, node1 = g.nodes
    assert node1.code == 80, node1.tail()
    assert node0.code == 84, node0.tail()
    told = node0.events("peer node failed")
    assert told and told[0]["node"] == 1 and told[0]["rank"] == 1, node0.tail()
    assert not node0.events("peer node lost"), node0.tail()
    origin, peer = node1.summary("rank_exit"), node0.summary("peer_failed")
    assert origin["incident_id"] and origin["incident_id"] == peer["incident_id"]
    assert peer["culprit_ranks"] == [1] and "rank 1 on node 1" in peer["verdict"]
    assert node0.ended - node1.ended < 10, "node 0 did not follow node 1 within moments"
    for node in g.nodes:
        assert marked_pids(node.mark) == []


def test_the_way_to_the_store_was_lossy(slow):
    if not slow["loss"]:
        pytest.skip("no random loss: nftables' `nft` is not installed (Debian package nftables)")
    rules = subprocess.run(["ip", "netns", "exec", slow["healthy"].lab.ns("hub"), "nft", "list", "table", "bridge",
                            "netlab"], capture_output=True, text=True, timeout=10).stdout
    assert rules.count("numgen random") >= 4, rules  # both groups' node 1, each way
