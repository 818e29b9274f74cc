"""Store values on the group-restart path are data (issue 26): node 0's decision and the barrier's counter are
validated where they are read; a bad one is dropped with a line, never taken for a decision, never for a
store that stopped answering.  And a fault that says it is final is restarted by no node.

The decoders and the restart policy are pure; the node link runs for real against a real TCPStore on
loopback (the handshake of tests/core/test_store_latency.py), with junk written where a barrier waits; and two
real supervisors restart as a group while junk waits where node 1 reads node 0's decisions (the groups of
tests/e2e/test_multinode_strangers.py, whose store the test process reads and writes on its loopback port).
"""

from __future__ import annotations

import json
import time

import pytest
import structlog

from tests.core.test_store_latency import two_node_handshake
from tests.e2e.test_multinode_strangers import PREFIX, new_group
from tests.live import wait_for
from tp_supervise.supervisor.events import NodeLost, StoreKeySeen
from tp_supervise.supervisor.nodes import link as links
from tp_supervise.supervisor.nodes.messages import BadValue, Fault, RestartDecision, counter
from tp_supervise.supervisor.outcome import EXIT_PEER, EXIT_RANK, Outcome
from tp_supervise.supervisor.rank.net import free_port
from tp_supervise.supervisor.restart import RESTART_BACKOFF_MAX_S, RestartPolicy

MAX_RESTARTS = 3
NODE_LOST_S = 1.0  # the link's "store silent this long is node 0 lost"; the junk sits there for longer
JUNK_HELD_S = 3 * NODE_LOST_S
SEEN_S = 10.0  # a link pass is 0.25 s; generous for a loaded 2-core host
FAULT_AFTER_S = 8  # node 1's rank fails this long after it is ready, in every attempt: the junk is there first
EXIT_S = 120.0


def decision(**fields) -> bytes:
    return json.dumps(dict({"restart": True, "delay_s": 1.0, "restarts": 1}, **fields)).encode()


def decode(raw: bytes) -> RestartDecision:
    return RestartDecision.decode(raw, RESTART_BACKOFF_MAX_S, MAX_RESTARTS)


def test_node_0s_own_decisions_decode_as_written():
    for written in (RestartDecision(True, 0.0, 1), RestartDecision(True, RESTART_BACKOFF_MAX_S, MAX_RESTARTS),
                    RestartDecision(False, 0.0, MAX_RESTARTS), RestartDecision(True, 4, 0)):
        assert decode(written.encode()) == written


@pytest.mark.parametrize("raw, why", [
    (b"\xff\x00not json {", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (decision(delay_s=1e12), "delay_s"),  # the issue's: every other node parked in backoff
    (decision(delay_s=RESTART_BACKOFF_MAX_S + 0.001), "delay_s"),
    (decision(delay_s=-1), "delay_s"),
    (b'{"restart": true, "delay_s": NaN, "restarts": 1}', "delay_s"),
    (b'{"restart": true, "delay_s": Infinity, "restarts": 1}', "delay_s"),
    (decision(delay_s="1"), "delay_s"),
    (decision(delay_s=True), "delay_s"),
    (decision(restart="yes"), "restart"),
    (decision(restart=1), "restart"),
    (decision(restarts=MAX_RESTARTS + 1), "restarts"),
    (decision(restarts=-1), "restarts"),
    (decision(restarts=1.5), "restarts"),
    (json.dumps({"restart": True, "delay_s": 1.0}).encode(), "restarts"),
])
def test_a_decision_node_0s_policy_could_not_have_made_is_refused(raw, why):
    with pytest.raises(BadValue, match=why):
        decode(raw)


def test_a_counter_is_digits_and_an_unwritten_one_is_zero():
    assert counter(b"") == 0 and counter(b"2") == 2 and counter(b"17") == 17
    for junk in (b"junk", b"-1", b"2.0", b" 2", b"1e3", b"9" * 40):
        with pytest.raises(BadValue):
            counter(junk)


def test_final_travels_on_the_fault_bus_and_anything_else_there_is_refused():
    fault = Fault(node=1, rank=3, reason="straggler", incident_id="run-1-abcd", verdict="straggler: ...", final=True)
    assert Fault.decode(fault.encode(), nnodes=2, world_size=4) == fault
    plain = json.loads(fault.encode())
    del plain["final"]
    assert Fault.decode(json.dumps(plain).encode(), nnodes=2, world_size=4).final is False
    with pytest.raises(BadValue, match="final"):
        Fault.decode(json.dumps(dict(plain, final="yes")).encode(), nnodes=2, world_size=4)


def test_a_final_fault_of_another_node_is_restarted_by_no_policy():
    """Node 0 decides for the group: a peer's fault restarts the group unless that node said it is final
    (--on-straggler kill there), as a final fault of node 0's own does not."""
    for outcome, restarts in ((Outcome(EXIT_PEER, "peer_failed", culprit=3), True),
                              (Outcome(EXIT_PEER, "peer_failed", culprit=3, final=True), False),
                              (Outcome(EXIT_RANK, "straggler", culprit=1), True),
                              (Outcome(EXIT_RANK, "straggler", culprit=1, final=True), False)):
        delay = RestartPolicy(MAX_RESTARTS).after(outcome, stopping=False, uptime_s=1.0, group=True)
        assert (delay is not None) == restarts, outcome


def test_junk_where_the_barrier_waits_is_dropped_and_the_link_goes_on():
    """The issue's ``ready/<n>``: a value the barrier's check cannot read raised inside the link's loop, was taken
    for a store that no longer answers, and ended the run as node 0 lost (84).  Now it is said and ignored; the
    barrier is reached when the counter is."""
    master, client, groups = two_node_handshake(free_port())
    assert set(groups) == {0, 1}, groups
    seen: list[object] = []
    link = links.NodeLink(client, groups[1], seen.append, node_lost_s=NODE_LOST_S)
    master.set("ready/2", b"junk")
    with structlog.testing.capture_logs() as logs:
        link.start()
        try:
            link.watch("ready/2", lambda raw: counter(raw) >= 2)  # what GroupOfNodes.meet watches
            time.sleep(JUNK_HELD_S)
            assert not [ev for ev in seen if isinstance(ev, (NodeLost, StoreKeySeen))], seen
            master.set("ready/2", b"2")
            wait_for(lambda: any(isinstance(ev, StoreKeySeen) for ev in seen), SEEN_S, "the barrier reached")
        finally:
            link.stop()
    assert [ev for ev in seen if isinstance(ev, StoreKeySeen)] == [StoreKeySeen("ready/2", b"2")]
    assert not [ev for ev in seen if isinstance(ev, NodeLost)], seen
    dropped = [e for e in logs if e.get("event_name") == "store_value_dropped"]
    assert dropped and dropped[0]["key"] == "ready/2" and dropped[0]["why"] == "not a counter", logs


@pytest.mark.alone  # node timeouts of seconds: no second busy test meanwhile
@pytest.mark.slow  # two attempts of a two-node group, each decision after a 3 s kill grace (~26 s): make test-slow
def test_junk_decisions_are_dropped_and_node_1_follows_node_0s_real_ones(tmp_path):
    """``restart/1`` holds junk (the issue: json.loads on the main thread, exit 70) and ``restart/2`` a decision
    with a backoff of 1e12 s (every other node parked) before node 0 decides: node 0's rank ignores SIGTERM, so
    node 0 writes each decision only after its kill grace, while node 1, whose rank failed, already waits for
    it.  Node 1 drops both and follows node 0's own: one restart, then node 0 ends the group (80 and 84)."""
    group = new_group(tmp_path)
    try:
        group.start_all(ranks=("--all", "loop", "--on", "1=exit:3", "--delay", str(FAULT_AFTER_S), "--ignore-term"),
                        extra=("--max-restarts", "1", "--kill-grace", "3"))
        group.wait_joined()
        store = group.inside()
        parked = json.dumps({"restart": True, "delay_s": 1e12, "restarts": 1}).encode()
        for key, junk in (("restart/1", b"\xff not json {"), ("restart/2", parked)):
            store.set(PREFIX + key, junk)
            assert bytes(store.get(PREFIX + key)) == junk  # a TCPStore set is not answered: read it back
        node0, node1 = group.runs[0], group.runs[1]
        assert node1.wait(EXIT_S) == 80, node1.stderr[-4000:]
        assert node0.wait(EXIT_S) == 84, node0.stderr[-4000:]
        dropped = {line["key"]: line["why"] for line in node1.events("store_value_dropped")}
        assert dropped.get("restart/1") == "not JSON" and "delay_s" in dropped.get("restart/2", ""), dropped
        followed = node1.events("group_restart")
        assert [(line["restart"], line["backoff_s"]) for line in followed] == [(1, 0.0)], node1.stderr[-3000:]
        assert node1.events("group_restart_declined"), node1.stderr[-3000:]
        assert sorted({line["attempt"] for line in node1.events("rank started")}) == [1, 2]
    finally:
        group.stop()
