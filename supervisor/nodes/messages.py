"""What the node link carries between supervisors, and the one place it is decoded and validated."""

from __future__ import annotations

import json
from dataclasses import dataclass

HANG_QUERY_WAIT_S = 3.0  # a node asking where the missing rank is rules alone after this


@dataclass(frozen=True)
class Fault:
    """A fatal incident on some node, as the fault bus carries it."""

    node: int
    rank: int | None
    reason: str
    incident_id: str
    verdict: str

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Fault":
        data = json.loads(raw)
        return cls(int(data["node"]), data.get("rank"), str(data["reason"]), str(data["incident_id"]),
                   str(data.get("verdict", "")))


@dataclass(frozen=True)
class HangQuery:
    """A node whose every rank waits inside a collective asks the others where the missing rank is.

    ``seq`` is the highest collective sequence number its ranks wait in.  A
    node that holds the rank that is elsewhere (stopped, outside collectives,
    behind) raises the hang itself, under ``incident_id``; when nobody does
    within ``HANG_QUERY_WAIT_S`` the asking node rules on its own evidence.
    """

    node: int
    incident_id: str
    seq: int
    verdict: str

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "HangQuery":
        data = json.loads(raw)
        return cls(int(data["node"]), str(data["incident_id"]), int(data["seq"]), str(data.get("verdict", "")))
