"""What the relay and the supervisor tell each other: the one definition of each message and file they share.

Two pipes, both made by the supervisor (supervisor/relay/process.py), and
one file::

    supervisor ── stdin ──────────────▶ relay      Notice lines: the incident ruled, the quarantine
    supervisor ◀── --counts-fd ───────── relay      counts lines, when they changed
    supervisor ◀── $RUN_DIR/inflight-relay ─ relay  the requests in flight (the quarantine's evidence)

**Notice** (supervisor → relay, one JSON line on the relay's stdin, whole
each time: the newest supersedes every earlier one)::

    {"version": 1, "incident": "<id>" | null,
     "fingerprints": {"<32 hex>": ["<incident id>", ...]}, "suspects": ["<32 hex>", ...]}

``incident`` is the incident the supervisor ruled, from its ruling (before
any rank is signalled) until the next attempt starts (null); the 503s of
what the relay holds name it.  ``fingerprints`` and ``suspects`` are
``quarantine.json``'s (engine/runfiles.py, whose reader parses them here
too): a relay in front of an engine that does not check the quarantine
itself refuses those fingerprints (400) and sends each suspect alone.  The
supervisor sends one when any of these changes, and the latest to every
relay process it starts; it never waits for the relay to read it (a line the
pipe has no room for waits for the next one).  The end of stdin means the
supervisor is gone or the run ends.

**Counts** (relay → supervisor, one JSON line on the pipe named by
``--counts-fd``)::

    {"version": 1, "pid": <relay pid>, "requests": n, "resent": n, "resumed_streams": n,
     "given_up": n, "quarantined": n, "held": n}

``COUNT_KEYS`` are cumulative for that relay process (the supervisor sums
them over relay restarts, by pid), ``GAUGE_KEYS`` its value now.  Written
when they changed (at most every ``COUNTS_EVERY_S``) and when the relay
stops; a line is smaller than ``PIPE_BUF``, so it is written whole or not at
all, and one the pipe has no room for is dropped (the next supersedes it).

**inflight-relay** (a file in the run dir, ``RELAY_INFLIGHT_FILE``): the
layout of engine/runfiles.py's in-flight files, written by the relay (its
pid; attempt 0; ``step`` the relay's epoch), read by the supervisor's
quarantine after a failure (supervisor/incidents/quarantine.py): it must
survive the relay's death, which a pipe would not.

docs/engine.md, "The relay".
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tp_supervise.engine.runfiles import MAX_INCIDENT_CHARS, parse_quarantine_file

MODULE = "tp_supervise.supervisor.relay"  # python -m MODULE: the relay process (supervisor/relay/main.py)
VERSION = 1
COUNT_KEYS = ("requests", "resent", "resumed_streams", "given_up", "quarantined")  # cumulative per relay process
GAUGE_KEYS = ("held",)  # the relay process's value now (requests waiting for the next attempt)
COUNTS_EVERY_S = 0.1  # a counts line at most this often
READ_BYTES = 65536  # one read of a pipe of either side
RELAY_INFLIGHT_FILE = "inflight-relay"  # in the run dir: the relay's requests in flight (the quarantine's evidence)


@dataclass(frozen=True)
class Notice:
    """What the supervisor tells the relay: the incident ruled now, the quarantined fingerprints, the suspects."""

    incident: str | None = None
    quarantined: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    suspects: frozenset[str] = frozenset()

    def line(self) -> bytes:
        record = {
            "version": VERSION,
            "incident": self.incident,
            "fingerprints": {fp: list(ids) for fp, ids in self.quarantined.items()},
            "suspects": sorted(self.suspects),
        }
        return json.dumps(record, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> Notice:
        """One line (ValueError for one that is not a notice of this version)."""
        quarantined, suspects = parse_quarantine_file(line)
        incident = json.loads(line).get("incident")
        if incident is not None and not (
            isinstance(incident, str) and 0 < len(incident) <= MAX_INCIDENT_CHARS and incident.isprintable()
        ):
            raise ValueError(f"incident {str(incident)[:40]!r}: not an incident id")
        return cls(incident, quarantined, suspects)


def _nothing() -> None:
    pass


class Counts:
    """The relay's counts (``COUNT_KEYS`` and ``GAUGE_KEYS``); ``on_change`` is called after each change."""

    def __init__(self) -> None:
        self.values: dict[str, int] = dict.fromkeys(COUNT_KEYS + GAUGE_KEYS, 0)
        self.on_change: Callable[[], None] = _nothing

    def add(self, key: str, by: int = 1) -> None:
        self.values[key] += by
        self.on_change()

    def set(self, key: str, value: int) -> None:
        self.values[key] = value
        self.on_change()

    def line(self, pid: int) -> bytes:
        return json.dumps({"version": VERSION, "pid": pid, **self.values}, separators=(",", ":")).encode() + b"\n"


def parse_counts(line: bytes) -> tuple[int, dict[str, int], dict[str, int]]:
    """A counts line: the relay's pid, its cumulative counts, its gauges (ValueError for a bad line)."""
    try:
        data = json.loads(line)
        if data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version')!r}")
        pid = int(data["pid"])
        counts = {key: max(0, int(data.get(key, 0))) for key in COUNT_KEYS}
        gauges = {key: max(0, int(data.get(key, 0))) for key in GAUGE_KEYS}
    except (KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from None
    return pid, counts, gauges


def read_now(fd: int) -> bytes | None:
    """What a non-blocking pipe holds now (either side's): b"" at its end (or when it cannot be read), None when
    nothing is there yet."""
    try:
        return os.read(fd, READ_BYTES)
    except BlockingIOError:
        return None
    except OSError:
        return b""
