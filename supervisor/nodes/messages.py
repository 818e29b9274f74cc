"""What the node link carries between supervisors, and the one place it is decoded and validated.

Whatever comes out of the store is data from the network: every value is
size-capped, parsed, checked field by field (node and rank in range, known
reasons, ids that match their pattern) and a bad one raises ``BadValue``, which
the node link logs and drops; text meant for a person (a verdict, a refusal)
passes through ``shown`` so no control or escape sequence reaches a terminal.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass

from ..outcome import valid_run_id  # noqa: F401  (the one rule; the handshake checks node 0's)

HANG_QUERY_WAIT_S = 3.0  # a node asking where the missing rank is rules alone after this
MAX_VALUE_BYTES = 16 * 1024  # a fault or a hang query; anything longer is not ours
MAX_INFO_BYTES = 64 * 1024  # a node's registration (its fingerprint)
MAX_TEXT = 500
INCIDENT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,159}$")
COUNTER_RE = re.compile(rb"[0-9]{1,18}")  # an add-counter as the store holds it: decimal digits
# Bundle reasons a node may announce on the fault bus, and "shutdown" (a node stopped on a signal).
FAULT_REASONS = frozenset(
    {"rank_exit", "hang", "divergence", "startup_timeout", "peer_failed", "node_lost", "shutdown", "straggler"}
)


class BadValue(ValueError):
    """A value in the store that is not what a supervisor writes there."""


def shown(raw: bytes | str, limit: int = MAX_TEXT) -> str:
    """Text from another machine, safe to print: control and format characters (escape sequences, bidi
    overrides) become visible ``\\xNN``/``\\uNNNN`` escapes, and it is cut at ``limit`` characters."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    out = []
    for ch in text[:limit]:
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp"):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out) + ("…" if len(text) > limit else "")


def _load(raw: bytes) -> dict:
    if len(raw) > MAX_VALUE_BYTES:
        raise BadValue(f"{len(raw)} bytes (at most {MAX_VALUE_BYTES})")
    try:
        data = json.loads(raw)
    except ValueError:
        raise BadValue("not JSON") from None
    if not isinstance(data, dict):
        raise BadValue("not a JSON object")
    return data


def _int(data: dict, key: str, low: int, high: int | None) -> int:
    value = data.get(key)
    if type(value) is not int or value < low or (high is not None and value >= high):
        raise BadValue(f"{key}={value!r} out of range")
    return value


def _text(data: dict, key: str) -> str:
    value = data.get(key, "")
    if not isinstance(value, str):
        raise BadValue(f"{key} is not text")
    return shown(value)


def _incident_id(data: dict) -> str:
    value = data.get("incident_id")
    if not isinstance(value, str) or not (value == "" or INCIDENT_ID_RE.match(value)):
        raise BadValue("incident_id does not match its pattern")
    return value


def counter(raw: bytes) -> int:
    """An add-counter's value (``ready/<n>``, ``beat/<R>``); b"" is a key not written yet: 0."""
    if not raw:
        return 0
    if not COUNTER_RE.fullmatch(raw):
        raise BadValue("not a counter")
    return int(raw)


@dataclass(frozen=True)
class Fault:
    """A fatal incident on some node, as the fault bus carries it.  ``final``: the run ends whatever
    ``--max-restarts`` says (``--on-straggler kill``); every node's outcome says so, node 0's decides."""

    node: int
    rank: int | None
    reason: str
    incident_id: str
    verdict: str
    final: bool = False

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, raw: bytes, nnodes: int | None = None, world_size: int | None = None) -> Fault:
        """Raises ``BadValue`` for anything a supervisor of this group would not have written."""
        data = _load(raw)
        node = _int(data, "node", 0, nnodes)
        rank = data.get("rank")
        if rank is not None:
            rank = _int(data, "rank", 0, world_size)
        reason = data.get("reason")
        if reason not in FAULT_REASONS:
            raise BadValue(f"unknown reason {shown(str(reason), 40)!r}")
        final = data.get("final", False)  # absent: not final
        if type(final) is not bool:
            raise BadValue("final is not true or false")
        return cls(node, rank, reason, _incident_id(data), _text(data, "verdict"), final)


@dataclass(frozen=True)
class RestartDecision:
    """Node 0's decision after group attempt n (``restart/<n>``): whether every node launches again, the
    backoff they all wait, and node 0's restart count (every rank's ``TORCHELASTIC_RESTART_COUNT``)."""

    restart: bool
    delay_s: float
    restarts: int

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, raw: bytes, max_delay_s: float, max_restarts: int) -> RestartDecision:
        """Raises ``BadValue`` for what node 0's policy would not have decided: a backoff beyond
        ``max_delay_s`` (this node's own policy's longest) or a count beyond ``max_restarts``."""
        data = _load(raw)
        restart, delay = data.get("restart"), data.get("delay_s")
        if type(restart) is not bool:
            raise BadValue("restart is not true or false")
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= max_delay_s:
            raise BadValue(f"delay_s={shown(str(delay), 40)} out of range (0 to {max_delay_s:g} s)")
        return cls(restart, float(delay), _int(data, "restarts", 0, max_restarts + 1))


@dataclass(frozen=True)
class HangQuery:
    """A node whose every rank waits inside a collective asks the others where the missing rank is.

    ``seq`` is the highest collective sequence number its ranks wait in.  A
    node that holds the rank that is elsewhere (stopped, outside collectives,
    behind) raises the hang itself, under ``incident_id``; when nobody does
    within ``HANG_QUERY_WAIT_S`` the asking node rules on its own evidence.

    ``inside_step``: the asking node's ranks are inside step ``seq`` with no
    collective in view, as in an engine that compiled its model (its
    collectives run in the compiled graph, where the hook sees none): the
    rank that is elsewhere is stopped, dead, outside any step or behind that
    step; a rank inside a step outside collectives is where its peers are.
    Nodes that predate the field read it as False.
    """

    node: int
    incident_id: str
    seq: int
    verdict: str
    inside_step: bool = False

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, raw: bytes, nnodes: int | None = None) -> HangQuery:
        data = _load(raw)
        return cls(
            _int(data, "node", 0, nnodes),
            _incident_id(data),
            _int(data, "seq", 0, None),
            _text(data, "verdict"),
            data.get("inside_step") is True,
        )
