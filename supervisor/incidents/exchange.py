"""Multi-node: the nodes' bundles of one incident learn of each other through the supervisors' store.

After a node wrote its bundle of a fatal multi-node incident (its own fault, or ``peer_failed``), its
dump thread (never the main thread, never ``node-link``):

1. publishes the bundle's node summary (``dumps.node_merge.node_summary``: at most 16 KiB of JSON) under
   ``tpsv/v1/incident/<incident_id>/node/<R>``, through a short-lived store client of its own;
2. waits a bounded time for the others': the **originating** node (whose fault the others followed)
   for every other node's, up to ``MERGE_WAIT_S``; a **peer** node for the originating node's only, up
   to ``PEER_WAIT_S``;
3. amends its bundle's ``summary.json`` atomically (``dumps.bundle.amend_summary``): the originating
   node with ``nodes``, the merged ``verdict`` (its own kept as ``node_verdict``), ``culprit_node``,
   ``peer_bundles`` and ``nodes_missing``; a peer with ``peer_bundles`` (where the others' bundles are).

All of it fits in what is left of the dump's ``--dump-timeout`` (less ``MARGIN_S``, so the bundle's
dump counts as finished in time), every store call has the store's timeout or less, a second stop
signal ends the wait, and a store that is gone costs one log line: the bundle on disk is already whole.
A node whose fault lost the race for the fault bus (another node's incident went out first) has no
one to merge: it publishes and goes on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from tp_supervise.dumps import node_merge
from tp_supervise.dumps.bundle import SUMMARY_JSON, amend_summary

from ..nodes import store as stores

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tp_supervise.dumps.capture import RankTarget

    from ..nodes.handshake import NodeGroup
    from ..nodes.store import Store
    from ..signals import Hurry

log = structlog.get_logger("supervise.incident")

# The originating node waits at most this long for the other nodes' summaries: a peer hears of the fault
# within a node-link pass (0.25 s), then captures its own ranks for up to the hang capture budget (3 s,
# supervisor/incidents.HANG_CAPTURE_S) before it writes and publishes; a wait of 3 s lost that race on a
# loaded host about half the time.
MERGE_WAIT_S = 5.0
PEER_WAIT_S = 2.0  # a peer node waits at most this long to learn where the originating node's bundle is
# A store that does not take a connection within this is gone (c10d adds a retry pause: ~1.3 s in all).
CONNECT_S = 0.8
MARGIN_S = 0.5  # kept from the dump's deadline for amending the bundle
POLL_S = 0.1
MIN_CALL_S = 0.2  # no store call gets less than this (a shorter one cannot succeed)


def summary_key(incident_id: str, node_rank: int) -> str:
    return f"incident/{incident_id}/node/{node_rank}"


def last_waits(targets: Sequence[RankTarget]) -> dict[int, str]:
    """Rank -> the collective it waited in until it ended without it: out of it now, and its heartbeat slot
    not written since it entered it (a collective that completes writes the slot as it ends).  A peer node's
    capture comes after the originating node began its teardown, which breaks the group's collectives:
    this is where such a rank was."""
    out = {}
    for t in targets:
        hb = t.heartbeat
        if hb is None or not hb.claimed or hb.in_collective or not hb.coll_op or hb.coll_seq <= 0:
            continue
        if hb.ts_coll_begin > 0 and hb.ts_heartbeat <= hb.ts_coll_begin:
            out[t.rank] = f"{hb.coll_op} #{hb.coll_seq}" + (f" [{hb.coll_desc}]" if hb.coll_desc else "")
    return out


def _connect(group: NodeGroup, timeout_s: float) -> Store:
    return stores.client(
        group.connect_addr, timeout_s, connect_timeout_s=max(MIN_CALL_S, min(CONNECT_S, timeout_s / 2))
    )


class IncidentExchange:
    """One node's side of the exchange; ``share`` runs on a dump thread and never raises."""

    def __init__(self, group: NodeGroup, hurry: Hurry, connect: Callable[[NodeGroup, float], Store] = _connect):
        self.group = group
        self.hurry = hurry
        self.connect = connect

    def share(self, bundle: Path, deadline: float, origin: int, targets: Sequence[RankTarget] = ()) -> None:
        """``bundle``: this node's, just written; ``deadline``: the dump's (monotonic); ``origin``: the node
        whose fault this is (this node's own rank when it is the originating one); ``targets``: the ranks as
        the capture read them (their heartbeat slots say where a rank waited before the group broke)."""
        try:
            self._share(Path(bundle), deadline - MARGIN_S, origin, last_waits(targets))
        except Exception as exc:  # the exchange adds to a bundle already whole: it never fails one
            log.warning(
                "incident evidence not exchanged: the bundle keeps this node's evidence only",
                event_name="incident_exchange_failed",
                bundle=str(bundle),
                error=repr(exc)[:300],
            )

    def _share(self, bundle: Path, deadline: float, origin: int, waits: dict[int, str]) -> None:
        me = self.group.node_rank
        summary = json.loads((bundle / SUMMARY_JSON).read_text(encoding="utf-8"))
        incident_id = summary.get("incident_id")
        left = deadline - time.monotonic()
        if not incident_id or left < MIN_CALL_S or self.hurry.is_set():
            return
        host = self.group.hosts.get(me) or ""
        mine = node_merge.node_summary(summary, node_rank=me, host=host, bundle=str(bundle.resolve()), last_waits=waits)
        try:
            store = self.connect(self.group, min(stores.STORE_TIMEOUT_S, left))
            store.set(summary_key(incident_id, me), node_merge.encode(mine))
        except Exception as exc:
            log.warning(
                "node summary not published: the store did not answer (node 0 gone?)",
                event_name="incident_summary_not_published",
                incident_id=incident_id,
                store=self.group.store_addr,
                error=repr(exc)[:300],
            )
            return
        log.info(
            "node summary published",
            event_name="incident_summary_published",
            incident_id=incident_id,
            node=me,
            bytes=len(node_merge.encode(mine)),
        )
        if origin == me:
            won = self._won(store, incident_id, summary.get("attempt"))
            expected = [n for n in range(self.group.nnodes) if n != me] if won else []
            wait_s = MERGE_WAIT_S
        else:
            expected, wait_s = [origin], PEER_WAIT_S
        heard = self._collect(store, incident_id, expected, min(deadline, time.monotonic() + wait_s))
        if origin == me:
            if not expected:
                return  # another node's incident went out first: nobody publishes under this id
            fields = node_merge.merge(me, {me: mine, **heard}, expected)
            amend_summary(bundle, fields)
            log.info(
                "incident evidence merged across nodes",
                event_name="incident_nodes_merged",
                incident_id=incident_id,
                nodes=sorted([me, *heard]),
                missing=fields.get("nodes_missing", []),
                verdict=fields["verdict"],
            )
        elif heard:
            amend_summary(bundle, {"peer_bundles": node_merge.peer_bundles(heard, me)})
            log.info(
                "peer bundles recorded",
                event_name="incident_peer_bundles_recorded",
                incident_id=incident_id,
                peer_bundles={n: r.get("bundle") for n, r in heard.items()},
            )
        else:
            log.info(
                "originating node's summary not heard in time: this bundle does not point at its bundle",
                event_name="incident_origin_not_heard",
                incident_id=incident_id,
                node=origin,
                waited_s=wait_s,
            )

    def _won(self, store: Store, incident_id: str, attempt) -> bool:
        """Whether this incident is the one on the fault bus of its group attempt (the one the others follow)."""
        raw = store.get_nowait(f"fault/{attempt}") if isinstance(attempt, int) else None
        if not raw:
            return True  # not there yet: the node-link thread publishes it; the others will follow it
        try:
            return json.loads(raw).get("incident_id") == incident_id
        except (ValueError, AttributeError):
            return False

    def _collect(self, store: Store, incident_id: str, expected: list[int], until: float) -> dict[int, dict]:
        heard: dict[int, dict] = {}
        while True:
            for node in expected:
                if node in heard:
                    continue
                left = until - time.monotonic()
                if left < MIN_CALL_S:
                    return heard
                if hasattr(store, "call_timeout"):
                    store.call_timeout(left / 2)  # a check and a get: together within what is left
                raw = store.get_nowait(summary_key(incident_id, node))
                record = node_merge.decode(raw) if raw is not None else None
                if record is not None and record.get("node_rank") == node:
                    heard[node] = record
            left = until - time.monotonic()
            if len(heard) == len(expected) or left <= 0 or self.hurry.wait(min(POLL_S, left)):
                return heard


__all__ = ["IncidentExchange", "MERGE_WAIT_S", "PEER_WAIT_S", "summary_key"]
