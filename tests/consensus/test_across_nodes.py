"""Consensus across nodes (issue 12) on a real TCPStore: each node publishes the digests its ranks agreed on,
reads the others', and a node that differs is named at its step by its global ranks, with bounded store traffic."""

from __future__ import annotations

import hashlib
import time

import pytest

from tp_supervise.consensus.across_nodes import PUBLISH_EVERY_S, NodeDigests, decode_batch, encode_batch
from tp_supervise.supervisor.nodes import handshake
from tp_supervise.supervisor.nodes import store as node_store
from tp_supervise.supervisor.rank.net import free_port


def digest(step: int, variant: str = "") -> bytes:
    return hashlib.blake2b(f"step {step}{variant}".encode(), digest_size=16).digest()


@pytest.fixture
def stores():
    port = free_port()
    deadline = time.monotonic() + 10
    master = node_store.TorchStore("127.0.0.1", port, True)
    made = [master]

    def client():
        s = node_store.TorchStore("127.0.0.1", port, False)
        made.append(s)
        return s

    yield master, client


def run(sides: list[NodeDigests], steps: range, variant_of=lambda node, step: "", seconds: float = 3.0):
    """Every node agrees on ``steps`` (node n's digest of step s from variant_of(n, s)), then ticks for a while
    on a simulated clock that starts at the real one; returns each node's verdicts."""
    now = time.monotonic()
    verdicts = {s.node_rank: [] for s in sides}
    for side in sides:
        side.agreed([(st, digest(st, variant_of(side.node_rank, st))) for st in steps], now)
    end = now + seconds
    while now < end:
        for side in sides:
            verdicts[side.node_rank] += side.tick(now)
        now += 0.01
    return verdicts


def test_agreeing_nodes_raise_nothing(stores):
    master, client = stores
    sides = [NodeDigests(master, 0, 2, 2), NodeDigests(client(), 1, 2, 2)]
    verdicts = run(sides, range(1, 301))
    assert verdicts == {0: [], 1: []}
    assert all(s.table.pending == 0 for s in sides)  # every step was compared and agreed


def test_a_diverging_node_is_named_by_its_global_ranks_at_its_step(stores):
    master, client = stores
    sides = [NodeDigests(master, n, 3, 2) if n == 0 else NodeDigests(client(), n, 3, 2) for n in range(3)]
    verdicts = run(sides, range(1, 101), variant_of=lambda node, step: "x" if node == 2 and step >= 40 else "")
    for node in range(3):
        assert len(verdicts[node]) == 1, verdicts  # the first step of the episode, once
        v = verdicts[node][0]
        assert v.step == 40
        assert v.culprit_ranks == (4, 5) and v.reference_ranks == (0, 1, 2, 3)
        assert v.decided_by == "majority"
        assert "node 2 (ranks 4,5) diverged from node 0 (ranks 0,1) and node 1 (ranks 2,3) at step 40" in v.verdict


def test_two_nodes_tie_names_the_node_without_rank_0(stores):
    master, client = stores
    sides = [NodeDigests(master, 0, 2, 4), NodeDigests(client(), 1, 2, 4)]
    verdicts = run(sides, range(1, 30), variant_of=lambda node, step: "y" if node == 1 and step == 21 else "")
    v = verdicts[0][0]
    assert (v.step, v.culprit_ranks, v.decided_by) == (21, (4, 5, 6, 7), "tie")
    assert [x.step for x in verdicts[1]] == [21]


def test_store_writes_stay_bounded_whatever_the_step_rate(stores):
    master, client = stores
    side, peer = NodeDigests(master, 0, 2, 1), NodeDigests(client(), 1, 2, 1)
    now = time.monotonic()
    writes_before = side.store_calls
    for i in range(200):  # 2,000 agreed steps per simulated second for one second
        side.agreed([(s, digest(s)) for s in range(i * 10, i * 10 + 10)], now + i * 0.005)
        side.tick(now + i * 0.005)
    # publishing: at most one batch (two writes) per PUBLISH_EVERY_S, plus the reads of the one peer
    batches = master.add("consensus/1/0/n", 0)
    assert batches <= 1 / PUBLISH_EVERY_S + 1, batches
    assert side.store_calls - writes_before <= 2 * batches + 1 * 20 + 1
    peer.agreed([(s, digest(s)) for s in range(2000)], now)
    for i in range(400):  # the peer reads everything that was published, in order, and all of it agrees
        assert peer.tick(now + 1 + i * 0.05) == []
        side.tick(now + 1 + i * 0.05)
    assert peer.table.pending == 0


def test_a_malformed_batch_is_skipped_not_fatal(stores):
    master, client = stores
    other = client()
    other.set("consensus/1/1/0", b"{not json")
    other.add("consensus/1/1/n", 1)
    other.set("consensus/1/1/1", encode_batch([(1, digest(1))]))
    other.add("consensus/1/1/n", 1)
    side = NodeDigests(master, 0, 2, 1)
    side.agreed([(1, digest(1))], time.monotonic())
    now = time.monotonic()
    for i in range(50):
        assert side.tick(now + i * 0.1) == []
    assert side.bad_batches == 1 and side.table.pending == 0


@pytest.mark.parametrize("raw", [b"{}", b"[[1]]", b'[["1", "00"]]', b'[[true, "00"]]', b'[[1, "zz"]]'])
def test_decode_batch_refuses_what_is_not_a_batch(raw):
    with pytest.raises(ValueError):
        decode_batch(raw)


def test_a_batch_announced_but_never_written_is_skipped_after_the_wait(stores):
    """A peer whose counter add was applied although its answer timed out writes its batch again at the
    next index: the announced index stays empty for good, and the reader must not stop there."""
    master, client = stores
    other = client()
    other.add("consensus/1/1/n", 2)  # index 0 never written
    other.set("consensus/1/1/1", encode_batch([(1, digest(1))]))
    side = NodeDigests(master, 0, 2, 1, wait_s=1.0)
    side.agreed([(1, digest(1))], time.monotonic())
    now = time.monotonic()
    for i in range(40):
        assert side.tick(now + i * 0.1) == []
    assert side.bad_batches == 1 and side.table.pending == 0
