"""Incidents span nodes (issue 12): the node summary, the merged verdict (pure, dumps.node_merge), the atomic
amendment of a written bundle, and the exchange through a real TCPStore between two nodes' dump threads."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

import pytest

from tp_supervise.dumps import node_merge
from tp_supervise.dumps.analyze import check_summary
from tp_supervise.dumps.bundle import SUMMARY_JSON, SUMMARY_TXT, BundleWriter, amend_summary
from tp_supervise.supervisor.nodes import handshake
from tp_supervise.supervisor.nodes import store as stores
from tp_supervise.supervisor.incidents.exchange import IncidentExchange, summary_key
from tp_supervise.supervisor.signals import Hurry

WAITING = {"state": "S", "alive": True, "exit": None, "in_collective": True,
           "collective": "all_reduce #31 [64x256 float32]", "collective_seq": 31, "step": 4, "phase": "decode",
           "heartbeat_age_s": 6.2, "where": "all_reduce (distributed_c10d.py)", "culprit": False,
           "stack_signature": "all_reduce < …", "pid": 11}
STOPPED = {"state": "T", "alive": True, "exit": None, "in_collective": False, "collective": "", "collective_seq": 30,
           "step": 4, "phase": "decode", "heartbeat_age_s": 6.4, "where": "sample (engine.py)", "culprit": True}


def bundle_summary(reason: str, ranks: dict, culprits: list[int], verdict: str) -> dict:
    return {"reason": reason, "incident_id": "run-1234", "run_id": "run", "detected_at": "2026-01-01T00:00:00Z",
            "verdict": verdict, "culprit_ranks": culprits, "ranks": ranks}


def summary_of(node: int, reason: str, ranks: dict, culprits=(), verdict="v", waits=None) -> dict:
    return node_merge.node_summary(bundle_summary(reason, ranks, list(culprits), verdict), node_rank=node,
                                   host=f"host{node}", bundle=f"/dumps/n{node}", last_waits=waits)


# -- the node summary ---------------------------------------------------------------------------------
def test_node_summary_keeps_where_each_rank_is_and_drops_the_rest():
    record = summary_of(1, "hang", {"2": STOPPED, "3": WAITING}, [2], "rank 2 is stopped")
    assert record["node_rank"] == 1 and record["host"] == "host1" and record["bundle"] == "/dumps/n1"
    assert record["reason"] == "hang" and record["incident_id"] == "run-1234" and record["culprit_ranks"] == [2]
    assert record["ranks"]["3"]["collective"] == "all_reduce #31 [64x256 float32]"
    assert record["ranks"]["3"]["heartbeat_age_s"] == 6.2 and record["ranks"]["3"]["phase"] == "decode"
    assert "stack_signature" not in record["ranks"]["3"] and "pid" not in record["ranks"]["3"]
    assert node_merge.decode(node_merge.encode(record)) == record


def test_an_exit_becomes_its_sentence():
    dead = dict(STOPPED, state=None, alive=False, exit={"code": 3, "signal": None, "description": "exited with code 3"})
    assert summary_of(1, "rank_exit", {"1": dead}, [1])["ranks"]["1"]["exit"] == "exited with code 3"


def test_node_summary_stays_under_its_bound_keeping_culprits():
    ranks = {str(r): dict(WAITING, where="x" * 500, collective="all_reduce #31 " + "y" * 500) for r in range(200)}
    ranks["150"] = dict(STOPPED)
    record = summary_of(0, "hang", ranks, [150], "v" * 5000)
    assert len(node_merge.encode(record)) <= node_merge.MAX_NODE_SUMMARY_BYTES
    assert "150" in record["ranks"] and record["ranks_omitted"] > 0
    assert len(record["ranks"]) + record["ranks_omitted"] == 200
    assert len(record["verdict"]) <= node_merge.VERDICT_CHARS


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"version": 2, "node_rank": 0, "ranks": {}}',
                                 b'{"version": 1, "node_rank": "0", "ranks": {}}',
                                 b'{"version": 1, "node_rank": 0, "ranks": {"0": 5}}'])
def test_decode_refuses_what_is_not_a_node_summary(raw):
    assert node_merge.decode(raw) is None


# -- the merged verdict -------------------------------------------------------------------------------
def test_the_culprit_is_named_by_rank_and_node_then_where_the_others_wait():
    nodes_ = {1: summary_of(1, "hang", {"2": STOPPED, "3": WAITING}, [2], "rank 2 is stopped (state T, …)"),
              0: summary_of(0, "peer_failed", {"0": WAITING, "1": WAITING}, [2])}
    fields = node_merge.merge(1, nodes_, expected=[0, 1])
    assert fields["verdict"] == (
        "rank 2 on node 1 is stopped (state T) in sample (engine.py) at step 4; ranks 0,1 on node 0 and rank 3 on "
        "node 1 wait in all_reduce #31 [64x256 float32]. Node 1's own verdict: rank 2 is stopped (state T, …)")
    assert fields["node_verdict"] == "rank 2 is stopped (state T, …)"
    assert set(fields["nodes"]) == {"0", "1"} and fields["culprit_node"] == 1
    assert fields["peer_bundles"] == {"0": {"host": "host0", "bundle": "/dumps/n0", "reason": "peer_failed"}}
    assert "nodes_missing" not in fields


def test_a_rank_the_broken_group_threw_out_of_its_collective_is_shown_where_it_waited():
    out = dict(WAITING, in_collective=False, collective="", where="")
    nodes_ = {1: summary_of(1, "hang", {"1": STOPPED}, [1]),
              0: summary_of(0, "peer_failed", {"0": out}, [1], waits={0: "all_reduce #31 [64x256 float32]"})}
    assert "; rank 0 on node 0 waited in all_reduce #31 [64x256 float32] until the group broke." in \
        node_merge.merged_verdict(1, nodes_)
    dead = dict(out, alive=False, state=None, exit={"description": "was killed by SIGABRT"})
    nodes_[0] = summary_of(0, "peer_failed", {"0": dead}, [1], waits={0: "all_reduce #31"})
    assert "rank 0 on node 0 waited in all_reduce #31 until the group broke, then was killed by SIGABRT" in \
        node_merge.merged_verdict(1, nodes_)


def test_a_node_that_sent_nothing_is_named():
    fields = node_merge.merge(0, {0: summary_of(0, "rank_exit", {"0": dict(STOPPED, state="R")}, [0], "r0 died")},
                              expected=[1, 2])
    assert fields["nodes_missing"] == [1, 2]
    assert "; nodes 1,2 sent no summary in time (see their own bundles). Node 0's own verdict: r0 died" in fields["verdict"]


def test_no_culprit_groups_every_rank_and_keeps_the_nodes_verdict():
    nodes_ = {0: summary_of(0, "hang", {"0": WAITING}, [], "all wait: suspect the transport"),
              1: summary_of(1, "peer_failed", {"1": dict(WAITING, collective="all_reduce #30")}, [])}
    assert node_merge.merged_verdict(0, nodes_) == (
        "rank 0 on node 0 waits in all_reduce #31 [64x256 float32]; rank 1 on node 1 waits in all_reduce #30. "
        "Node 0's own verdict: all wait: suspect the transport")


@pytest.mark.parametrize("entry,phrase", [
    (None, "was not captured"),
    ({"state": "D", "alive": True, "where": "read (io.py)"}, "is in uninterruptible I/O (state D) in read (io.py)"),
    ({"state": "t", "alive": True}, "is held by a debugger (state t)"),
    ({"state": "Z", "alive": False}, "is a zombie"),
    ({"state": "R", "alive": True, "step": 0, "collective_seq": 12}, "is outside collectives after 12 collectives"),
    ({"state": "S", "alive": True, "in_collective": True}, "waits in a collective"),
])
def test_whereabouts(entry, phrase):
    assert node_merge.whereabouts(entry)[0] == phrase


def test_the_merge_module_is_pure():
    code = ("import sys; before = set(sys.modules); import tp_supervise.dumps.node_merge; "
            "print(sorted(set(sys.modules) - before))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       timeout=60).stdout.replace("'", '"'))
    forbidden = {"socket", "subprocess", "structlog", "rich", "torch", "tp_supervise.dumps.bundle"}
    assert not forbidden & set(loaded), loaded


# -- the bundle, amended ------------------------------------------------------------------------------
def written_bundle(tmp_path, node: int, reason: str, ranks: dict, culprits: list[int], verdict: str):
    writer = BundleWriter(tmp_path / f"dumps-{node}", keep=5, max_bytes=0)
    summary = bundle_summary(reason, ranks, culprits, verdict)
    summary["node_rank"] = node
    summary["attempt"] = 1
    return writer.write(reason, summary, {"stacks/rank-0.txt": "# rank 0\n\nmain (x.py:1)\n"},
                        datetime.now(timezone.utc))


def test_amend_summary_replaces_both_files_whole_and_analyze_accepts_it(tmp_path):
    path = written_bundle(tmp_path, 1, "hang", {"1": STOPPED}, [1], "rank 1 is stopped")
    before = {p.name: p.stat().st_ino for p in path.iterdir()}
    nodes_ = {1: summary_of(1, "hang", {"1": STOPPED}, [1], "rank 1 is stopped"),
              0: summary_of(0, "peer_failed", {"0": WAITING}, [1])}
    amended = amend_summary(path, node_merge.merge(1, nodes_, [0]))
    on_disk = json.loads((path / SUMMARY_JSON).read_text())
    assert on_disk == amended and on_disk["verdict"].startswith("rank 1 on node 1 is stopped")
    assert on_disk["reason"] == "hang" and on_disk["format_version"] == 1  # the rest is kept
    after = {p.name: p.stat().st_ino for p in path.iterdir()}
    assert set(after) == set(before)  # no temp file left behind
    assert after[SUMMARY_JSON] != before[SUMMARY_JSON] and after[SUMMARY_TXT] != before[SUMMARY_TXT]  # renamed over
    text = (path / SUMMARY_TXT).read_text()
    assert "evidence of 2 nodes merged" in text and "rank 0 on node 0 waits in" in text
    assert "node 1 (host1): hang, bundle /dumps/n1" in text
    check_summary(on_disk)


# -- the exchange, through a real store ---------------------------------------------------------------
def test_two_nodes_exchange_through_the_store(tmp_path):
    store = stores.TorchStore("127.0.0.1", 0, True)
    addr = f"127.0.0.1:{store.port}"
    store.first_writer("fault/1", json.dumps({"incident_id": "run-1234"}).encode())
    hurry = Hurry()
    origin = written_bundle(tmp_path, 1, "hang", {"1": STOPPED}, [1], "rank 1 is stopped")
    peer = written_bundle(tmp_path, 0, "peer_failed", {"0": WAITING}, [1], "rank 1 on node 1 failed first")
    exchanges = [IncidentExchange(handshake.NodeGroup("run", 2, node, addr, {0: "a", 1: "b"}), hurry) for node in (0, 1)]
    deadline = time.monotonic() + 8.0
    threads = [threading.Thread(target=exchanges[0].share, args=(peer, deadline, 1)),
               threading.Thread(target=exchanges[1].share, args=(origin, deadline, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    merged = json.loads((origin / SUMMARY_JSON).read_text())
    assert set(merged["nodes"]) == {"0", "1"} and merged["nodes"]["0"]["host"] == "a"
    assert merged["verdict"].startswith("rank 1 on node 1 is stopped (state T)")
    assert json.loads((peer / SUMMARY_JSON).read_text())["peer_bundles"]["1"]["bundle"] == str(origin.resolve())
    assert store.get_nowait(summary_key("run-1234", 0)) is not None
    hurry.close()


def test_a_fault_that_lost_the_bus_is_not_merged(tmp_path):
    """Another node's incident went out first: nobody publishes under this one's id, so it waits for none."""
    store = stores.TorchStore("127.0.0.1", 0, True)
    store.first_writer("fault/1", json.dumps({"incident_id": "another"}).encode())
    hurry = Hurry()
    path = written_bundle(tmp_path, 1, "rank_exit", {"1": STOPPED}, [1], "rank 1 exited")
    exchange = IncidentExchange(handshake.NodeGroup("run", 2, 1, f"127.0.0.1:{store.port}", {}), hurry)
    started = time.monotonic()
    exchange.share(path, time.monotonic() + 8.0, 1)
    assert time.monotonic() - started < 1.5
    assert "nodes" not in json.loads((path / SUMMARY_JSON).read_text())
    assert store.get_nowait(summary_key("run-1234", 1)) is not None  # published all the same
    hurry.close()


def test_a_store_that_is_gone_costs_one_line_and_leaves_the_bundle_as_it_was(tmp_path):
    from tp_supervise.supervisor.rank.net import free_port

    hurry = Hurry()
    path = written_bundle(tmp_path, 1, "hang", {"1": STOPPED}, [1], "rank 1 is stopped")
    before = (path / SUMMARY_JSON).read_bytes()
    exchange = IncidentExchange(handshake.NodeGroup("run", 2, 1, f"127.0.0.1:{free_port()}", {}), hurry)
    started = time.monotonic()
    exchange.share(path, time.monotonic() + 6.0, 1)
    assert time.monotonic() - started < 2.5  # the connect is bounded well inside the dump's deadline
    assert (path / SUMMARY_JSON).read_bytes() == before
    hurry.close()


# -- the engine's control plane across nodes (vLLM's engine core and API server on node 0) ----------
CORE = {"role": "scheduler", "who": "vLLM's engine core (pid 12, VLLM::EngineCore)", "pid": 12, "state": "S",
        "alive": True, "exit": None, "in_step": True, "phase": "execute", "where": "acquire_read (shm_broadcast.py)",
        "culprit": False, "stack_signature": "…"}
API = {"role": "frontend", "who": "vLLM's API server (pid 10)", "pid": 10, "state": "S", "alive": True, "exit": None,
       "in_step": True, "phase": "", "where": "run (runners.py)", "culprit": False}
HELPER = {"role": "helper", "who": "the helper (pid 13)", "pid": 13, "state": "S", "alive": True, "exit": None}


def test_each_nodes_control_plane_is_published_and_named_after_the_ranks():
    summary = bundle_summary("peer_failed", {"0": WAITING}, [], "v") | {
        "processes": {"10": API, "12": CORE, "13": HELPER}}
    record = node_merge.node_summary(summary, node_rank=0, host="host0", bundle="/dumps/n0")
    assert [p["role"] for p in record["processes"]] == ["frontend", "scheduler"]  # helpers are not the plane
    assert "stack_signature" not in record["processes"][1]
    nodes_ = {1: summary_of(1, "hang", {"1": STOPPED}, [1], "rank 1 is stopped"), 0: record}
    assert node_merge.merged_verdict(1, nodes_) == (
        "rank 1 on node 1 is stopped (state T) in sample (engine.py) at step 4; rank 0 on node 0 waits in "
        "all_reduce #31 [64x256 float32]; vLLM's API server (pid 10) on node 0 holds requests in flight, waiting "
        "for their outputs; vLLM's engine core (pid 12, VLLM::EngineCore) on node 0 waits inside its step (phase "
        "execute) for the ranks. Node 1's own verdict: rank 1 is stopped")


def test_a_control_plane_culprit_leads_the_verdict_with_its_exit():
    dead = dict(CORE, alive=False, state=None, exit={"code": None, "signal": "SIGKILL", "description": "was killed by SIGKILL"})
    summary = bundle_summary("rank_exit", {"0": WAITING}, [], "vLLM's engine core was killed") | {
        "processes": {"10": API, "12": dead}, "culprit": {"role": "scheduler", "pid": 12, "title": "VLLM::EngineCore"}}
    record = node_merge.node_summary(summary, node_rank=0, host="host0", bundle="/dumps/n0")
    assert record["processes"][0]["culprit"] and record["processes"][0]["exit"] == "was killed by SIGKILL"
    verdict = node_merge.merged_verdict(0, {0: record, 1: summary_of(1, "peer_failed", {"1": WAITING}, [])})
    assert verdict.startswith("vLLM's engine core (pid 12, VLLM::EngineCore) on node 0 was killed by SIGKILL; "), verdict
