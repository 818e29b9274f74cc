"""supervise_store_latency_seconds (issue 12): every call a supervisor makes to node 0's real TCPStore is
timed, the handshake's (made before the metrics exist) included, and a store that went away is timed too."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from prometheus_client.parser import text_string_to_metric_families

from tp_supervise.supervisor.nodes import handshake

from tp_supervise.supervisor.nodes import link as links

from tp_supervise.supervisor.nodes import store as stores
from tp_supervise.supervisor.observers.metrics import STORE_BUCKETS, SupervisorMetrics
from tp_supervise.supervisor.rank.net import free_port

FP = {"command": "python serve.py", "nproc_per_node": "1"}
LINK_RUN_S = 1.0  # four beats of the node link
LOOPBACK_CALL_MAX_S = 1.0  # generous: one loopback call on a loaded 2-core host


def latency_counts(metrics: SupervisorMetrics) -> dict[str, tuple[float, float]]:
    """op -> (count, sum) from a real exposition."""
    body, _ = metrics.exposition()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        if family.name != "supervise_store_latency_seconds":
            continue
        for sample in family.samples:
            op = sample.labels.get("op")
            if sample.name.endswith("_count"):
                out.setdefault(op, [0.0, 0.0])[0] = sample.value
            elif sample.name.endswith("_sum"):
                out.setdefault(op, [0.0, 0.0])[1] = sample.value
    return {op: (c, s) for op, (c, s) in out.items()}


def two_node_handshake(port: int):
    deadline = time.monotonic() + 20
    master = stores.TorchStore("127.0.0.1", port, True)
    client = stores.TorchStore("127.0.0.1", port, False)
    groups: dict[int, object] = {}

    def join(store, rank):
        groups[rank] = handshake.handshake(store, nnodes=2, node_rank=rank, run_id="latency", fp=FP, token=None,
                                       deadline=deadline, store_addr=f"127.0.0.1:{port}")

    threads = [threading.Thread(target=join, args=(s, r)) for r, s in enumerate((master, client))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return master, client, groups


def test_every_store_call_is_timed_into_the_metric_the_handshakes_first():
    port = free_port()
    master, client, groups = two_node_handshake(port)
    assert set(groups) == {0, 1}, groups
    metrics = SupervisorMetrics("latency", [1], node=1)
    before = latency_counts(metrics)
    assert set(before) == {"connect", "set", "get", "add", "compare_set", "multi_get", "other"}
    assert all(count == 0 for count, _ in before.values()), before  # every op exported at 0 from the start

    # node 1's link: the handshake's calls (made before any metrics) arrive when it attaches
    link = links.NodeLink(client, groups[1], lambda _ev: None, on_store_latency=metrics.observe_store_latency)
    attached = latency_counts(metrics)
    assert attached["connect"][0] == 1  # node 1 connected once
    assert attached["set"][0] >= 1 and attached["get"][0] >= 2 and attached["add"][0] >= 3
    assert attached["compare_set"][0] == 0  # only node 0 publishes the run id

    node0 = links.NodeLink(master, groups[0], lambda _ev: None)
    node0.start()
    link.start()
    time.sleep(LINK_RUN_S)
    link.finished()
    link.stop()
    node0.finished()
    node0.stop()
    after = latency_counts(metrics)
    # the beats (add), the one read of every watched key per pass (multi_get) and "done" (set) are timed
    assert after["add"][0] >= attached["add"][0] + 2, (attached, after)
    assert after["multi_get"][0] >= attached["multi_get"][0] + 2, (attached, after)
    assert after["set"][0] == attached["set"][0] + 1, (attached, after)
    for op, (count, total) in after.items():
        if count:
            assert 0 < total / count < LOOPBACK_CALL_MAX_S, (op, count, total)


def test_a_call_to_a_store_that_went_away_is_timed_too():
    """Node 0's store lives in another process; SIGKILL it: the client's next calls fail, and still count."""
    port = free_port()
    host = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom tp_supervise.supervisor.nodes import store as stores\n"
         f"store = stores.TorchStore('127.0.0.1', {port}, True)\nprint('up', flush=True)\ntime.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "up"
        client = stores.TorchStore("127.0.0.1", port, False, connect_timeout_s=20)
        seen: list[tuple[str, float]] = []
        client.latency.attach(lambda op, s: seen.append((op, s)))
        assert client.add("beat/1", 1) == 1
        host.kill()
        host.wait(10)
        failures = 0
        for _ in range(3):
            try:
                client.add("beat/1", 1)
            except Exception:
                failures += 1
        assert failures == 3
        adds = [s for op, s in seen if op == "add"]
        assert len(adds) == 4, seen  # the one that worked and the three that failed
        assert all(s <= stores.STORE_TIMEOUT_S + 1.0 for s in adds), adds  # bounded by the store's timeout
    finally:
        host.kill()
        host.wait(10)
        host.stdout.close()


def test_the_buffer_is_bounded_and_a_broken_sink_breaks_no_call():
    latency = stores.StoreLatency(keep=3)
    for i in range(5):
        latency.record("get", float(i))
    got: list[tuple[str, float]] = []
    latency.attach(lambda op, s: got.append((op, s)))
    assert got == [("get", 2.0), ("get", 3.0), ("get", 4.0)]  # the newest survive

    def broken(_op, _s):
        raise RuntimeError("sink down")

    latency.attach(broken)
    latency.record("set", 0.001)  # must not raise


def test_an_unknown_op_is_folded_and_buckets_span_loopback_to_the_timeout():
    metrics = SupervisorMetrics("latency", [0])
    metrics.observe_store_latency("watch", 0.002)
    assert latency_counts(metrics)["other"][0] == 1
    assert STORE_BUCKETS[0] <= 0.0005 and STORE_BUCKETS[-1] > stores.STORE_TIMEOUT_S
