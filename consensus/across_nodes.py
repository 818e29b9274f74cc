"""Consensus across nodes: the per-step digests each node agreed on, compared through the store.

Each node's ``ConsensusMonitor`` compares its own ranks; a step they all
agreed on leaves one digest for the node (``ConsensusMonitor.take_agreed``).
``NodeDigests`` publishes those in batches to the supervisors' store (the
node-0-hosted TCPStore of supervisor/nodes/link.py), reads the other nodes'
batches and compares them step by step with the same ``StepTable`` the ranks
use, its members being node ranks.  A node whose digest differs is named at
its step by its global ranks.

Store traffic is bounded, whatever the step rate:

* writes: at most one batch per ``publish_every_s`` (default 0.2 s), each
  two calls (the batch, then its counter): <= 10 writes/s per node;
* reads: at most ``reads_per_s`` calls per second (default 20), spent round
  robin on the other nodes (a counter read, then the batches it announces),
  so 64 nodes cost the store what a handful does, at the price of a slower
  comparison: with ``N`` nodes a peer is read about every ``N / reads_per_s``
  seconds.

Keys, under the store's ``tpsv/v1/`` prefix (docs/multinode.md)::

    consensus/<a>/<R>/n      add-counter: how many batches node R published in group attempt a
    consensus/<a>/<R>/<i>    batch i of node R (0-based): JSON [[step, "<digest hex>"], ...]

Nothing here blocks on its own: the caller (a supervisor thread) owns the
store client, whose every call has the store's timeout.  Pure apart from the
store calls; time is an argument.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from .compare import Decision, Outcome, StepTable, split_digests
from .verdict import DivergenceVerdict

PUBLISH_EVERY_S = 0.2
READS_PER_S = 20.0
BATCH_MAX = 512  # steps per batch; a backlog is sent in several batches
LOCAL_BACKLOG = 8192  # agreed steps kept while the store is slow; the oldest are dropped first
WAIT_S = 5.0  # a node that has not published a step this long after a mismatch is judged without it


class DigestStore(Protocol):
    """The part of supervisor.nodes.store.Store this needs."""

    def set(self, key: str, value: bytes) -> None: ...
    def get_nowait(self, key: str) -> bytes | None: ...
    def add(self, key: str, amount: int) -> int: ...


def encode_batch(entries: Sequence[tuple[int, bytes]]) -> bytes:
    return json.dumps([[step, digest.hex()] for step, digest in entries], separators=(",", ":")).encode()


def decode_batch(raw: bytes) -> list[tuple[int, bytes]]:
    """A peer's batch; anything malformed raises ValueError (the caller skips that batch)."""
    data = json.loads(raw)
    if not isinstance(data, list):
        raise ValueError("a digest batch is a JSON list")
    out = []
    for item in data:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], int)
            or isinstance(item[0], bool)
            or not isinstance(item[1], str)
        ):
            raise ValueError(f"bad digest batch entry {item!r:.80}")
        out.append((item[0], bytes.fromhex(item[1])))
    return out


@dataclass
class _Peer:
    node: int
    read: int = 0  # batches of this node already read
    missing_since: float | None = None  # batch `read` is counted but not readable since then


def ranks_of(node: int, nproc_per_node: int) -> tuple[int, ...]:
    return tuple(range(node * nproc_per_node, (node + 1) * nproc_per_node))


class NodeDigests:
    """One node's side of the cross-node comparison."""

    def __init__(
        self,
        store: DigestStore,
        node_rank: int,
        nnodes: int,
        nproc_per_node: int,
        publish_every_s: float = PUBLISH_EVERY_S,
        reads_per_s: float = READS_PER_S,
        wait_s: float = WAIT_S,
        max_pending: int = 1024,
        attempt: int = 1,
    ):
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"node rank {node_rank} outside 0..{nnodes - 1}")
        self.store = store
        self.prefix = f"consensus/{attempt}"  # steps count from 0 again in every group attempt
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node
        self.publish_every_s = publish_every_s
        self.read_interval_s = 1.0 / reads_per_s
        self.table: StepTable[None] = StepTable(range(nnodes), wait_s, max_pending)  # no handle per digest
        self._outbox: deque[tuple[int, bytes]] = deque(maxlen=LOCAL_BACKLOG)
        self._published = 0
        self._next_publish = 0.0
        self._next_read = 0.0
        self._peers = deque(_Peer(n) for n in range(nnodes) if n != node_rank)
        self._arrived: dict[int, float] = {}  # step -> when its latest digest arrived (monotonic)
        self.store_calls = 0
        self.bad_batches = 0

    # -- local side

    def agreed(self, steps: Sequence[tuple[int, bytes]], now: float) -> None:
        """Steps this node's ranks agreed on (step, digest), in any order."""
        for step, digest in steps:
            self._outbox.append((step, digest))
            self._add(self.node_rank, step, digest, now)

    def _add(self, node: int, step: int, digest: bytes, now: float) -> None:
        self.table.add(node, step, digest, 1, None, now)
        if self.table.is_pending(step):  # a late digest of a decided step is only counted by the table
            self._arrived[step] = now

    # -- one pass: publish, read, judge

    def tick(self, now: float) -> list[DivergenceVerdict]:
        """Publish what is due, read what the budget allows, return new divergences (first of each episode)."""
        self._publish(now)
        self._read(now)
        out = []
        for decision in self.table.decide(now):
            arrived = self._arrived.pop(decision.step, now)
            if decision.outcome is Outcome.DIVERGED and decision.first_of_episode:
                out.append(self._verdict(decision, arrived, now))
        return out

    def _publish(self, now: float) -> None:
        if not self._outbox or now < self._next_publish:
            return
        self._next_publish = now + self.publish_every_s
        batch = [self._outbox.popleft() for _ in range(min(BATCH_MAX, len(self._outbox)))]
        try:
            self.store.set(f"{self.prefix}/{self.node_rank}/{self._published}", encode_batch(batch))
            self.store.add(f"{self.prefix}/{self.node_rank}/n", 1)
            self.store_calls += 2
        except Exception:
            self._outbox.extendleft(reversed(batch))  # try again next time; the deque bound drops the oldest
            raise
        self._published += 1

    def _read(self, now: float) -> None:
        if not self._peers or now < self._next_read or not self._published:
            return  # nothing of this node's to compare yet (ranks that record no consensus events): no reads
        peer = self._peers[0]
        self._peers.rotate(-1)
        available = self.store.add(f"{self.prefix}/{peer.node}/n", 0)
        self.store_calls += 1
        calls = 1
        while peer.read < available:
            raw = self.store.get_nowait(f"{self.prefix}/{peer.node}/{peer.read}")
            self.store_calls += 1
            calls += 1
            if raw is None:
                # Announced but not readable: written next round, or never (the peer's counter add was
                # applied although its answer timed out, and it wrote that batch again at the next index).
                peer.missing_since = peer.missing_since or now
                if now - peer.missing_since < self.table.wait_s:
                    break
                self.bad_batches += 1
            peer.missing_since = None
            peer.read += 1
            if raw is None:
                continue
            try:
                entries = decode_batch(raw)
            except ValueError:
                self.bad_batches += 1
                continue
            for step, digest in entries:
                self._add(peer.node, step, digest, now)
        self._next_read = now + calls * self.read_interval_s

    # -- the verdict

    def _ranks(self, nodes: Collection[int]) -> tuple[int, ...]:
        return tuple(r for n in sorted(nodes) for r in ranks_of(n, self.nproc_per_node))

    def _verdict(self, decision: Decision[None], published_at: float, now: float) -> DivergenceVerdict:
        split = split_digests(decision.digests)
        ranks = self._ranks
        culprit_nodes = split.culprits
        text = (
            f"{_nodes(culprit_nodes, self.nproc_per_node)} diverged from "
            f"{_nodes(split.reference, self.nproc_per_node)} at step {decision.step}: the step's agreed "
            f"digests differ across nodes (decided by {split.decided_by}"
            f"{'; the reference holds the lowest rank' if split.decided_by == 'tie' else ''})"
        )
        if decision.missing:
            text += f"; {_nodes(decision.missing, self.nproc_per_node)} had not published that step"
        return DivergenceVerdict(
            step=decision.step,
            ranks=ranks(decision.digests),
            culprit_ranks=ranks(culprit_nodes),
            reference_ranks=ranks(split.reference),
            groups=tuple((g.digest.hex(), ranks(g.ranks)) for g in split.groups),
            decided_by=split.decided_by,
            missing_ranks=ranks(decision.missing),
            first_difference=None,
            event_counts={},
            verdict=text,
            detected_at=now,
            published_at=published_at,
            log_notes={
                r: "cross-node comparison: the events stay in the culprit node's own bundle"
                for r in ranks(culprit_nodes)
            },
        )


def _nodes(nodes: Sequence[int], nproc_per_node: int) -> str:
    parts = []
    for n in sorted(nodes):
        r = ranks_of(n, nproc_per_node)
        parts.append(f"node {n} (rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))})")
    return " and ".join(parts)
