"""Multi-node handshake on node 0's real TCPStore (issue 12): every node registers, and a bad group is
refused on every node with what to change, before anything starts."""

from __future__ import annotations

import threading
import time

import pytest

from tp_supervise.supervisor.nodes import handshake
from tp_supervise.supervisor.nodes import store as stores
from tp_supervise.supervisor.nodes.transport import TransportError, open_transport
from tp_supervise.supervisor.outcome import EXIT_STARTUP, EXIT_USAGE
from tp_supervise.supervisor.rank.net import free_port

FP = {"command": "python train.py", "nproc_per_node": "2", "tp_supervise": "0.1.0", "python": "3.11", "torch": "2.13"}


def run_nodes(ranks, *, fps=None, tokens=None, timeout_s=10.0, run_id="shared-run"):
    """One handshake per entry of ``ranks`` (its --node-rank), each on its own thread; node 0's store first."""
    port = free_port()
    deadline = time.monotonic() + timeout_s
    master = stores.TorchStore("127.0.0.1", port, True)
    results: dict[int, object] = {}
    progress: dict[int, list] = {}

    def one(i, node_rank):
        store = master if i == 0 else stores.TorchStore("127.0.0.1", port, False)
        progress[i] = []
        try:
            results[i] = handshake.handshake(store, nnodes=nnodes, node_rank=node_rank, run_id=f"{run_id}-{i}",
                                         fp=(fps or {}).get(i, FP), token=(tokens or {}).get(i), deadline=deadline,
                                         store_addr=f"127.0.0.1:{port}",
                                         progress=lambda event, fields: progress[i].append((event, fields)))
        except handshake.HandshakeError as exc:
            results[i] = exc

    nnodes = max(ranks) + 1 if len(set(ranks)) == len(ranks) else len(ranks)
    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return results, progress


def test_nodes_agree_on_node_0s_run_id():
    results, _ = run_nodes([0, 1, 2])
    groups = [results[i] for i in range(3)]
    assert all(isinstance(g, handshake.NodeGroup) for g in groups), groups
    assert {g.run_id for g in groups} == {"shared-run-0"}
    assert [g.node_rank for g in groups] == [0, 1, 2]


def test_a_duplicate_node_rank_is_refused_on_every_node():
    results, _ = run_nodes([0, 1, 1], timeout_s=8.0)
    for i in range(3):
        exc = results[i]
        assert isinstance(exc, handshake.HandshakeError) and exc.code == EXIT_USAGE, exc
        assert "duplicate --node-rank 1" in str(exc) and "0..2" in str(exc)


def test_a_fingerprint_mismatch_names_the_fields_per_node():
    other = dict(FP, command="python train.py --lr 3", torch="2.12")
    results, _ = run_nodes([0, 1], fps={1: other})
    for i in range(2):
        exc = results[i]
        assert isinstance(exc, handshake.HandshakeError) and exc.code == EXIT_USAGE
        text = str(exc)
        assert "mismatch" in text
        assert "command: node 0: 'python train.py'; node 1: 'python train.py --lr 3'" in text
        assert "torch: node 0: '2.13'; node 1: '2.12'" in text and "python:" not in text


def test_a_wrong_join_token_is_refused_without_showing_it():
    results, _ = run_nodes([0, 1], tokens={0: "s3cret-A", 1: "s3cret-B"})
    for i in range(2):
        exc = results[i]
        assert isinstance(exc, handshake.HandshakeError) and "join token mismatch: node(s) [1]" in str(exc)
        assert "s3cret" not in str(exc)


def test_a_missing_node_times_out_with_83_and_progress_lines_naming_it():
    port = free_port()
    store = stores.TorchStore("127.0.0.1", port, True)
    lines = []
    t0 = time.monotonic()
    with pytest.raises(handshake.HandshakeError) as info:
        handshake.handshake(store, nnodes=3, node_rank=0, run_id="r", fp=FP, token=None,
                        deadline=time.monotonic() + 7.0, store_addr=f"127.0.0.1:{port}",
                        progress=lambda event, fields: lines.append(fields))
    assert info.value.code == EXIT_STARTUP and time.monotonic() - t0 >= 6.5
    assert "node rank(s) [1, 2] never registered" in str(info.value)
    assert lines and lines[0]["missing_node_ranks"] == [1, 2] and lines[0]["store"] == f"127.0.0.1:{port}"


def test_a_node_without_node_0_times_out_naming_the_store():
    port = free_port()
    with pytest.raises(TransportError) as info:
        open_transport("127.0.0.1", port, 2, 1, None, time.monotonic() + 3.0)
    assert info.value.code == EXIT_STARTUP and f"127.0.0.1:{port}" in str(info.value)
