"""What the relay and the supervisor tell each other: the one definition of each file and message they share.

=====================  ==========  ==============================================
what                   writer      read by
=====================  ==========  ==============================================
``relay.json``         the relay   the supervisor's metrics (``Counts``)
``inflight-relay``     the relay   the supervisor's quarantine
                                   (supervisor/incidents/quarantine.py); the
                                   layout of engine/runfiles.py's in-flight
                                   files, ``step`` the relay's epoch
=====================  ==========  ==============================================

docs/engine.md, "Files in $SUPERVISE_RUN_DIR".
"""

from __future__ import annotations

MODULE = "tp_supervise.supervisor.relay"  # python -m MODULE: the relay process (supervisor/relay/main.py)
COUNTS_FILE = "relay.json"  # in the run dir: the relay's counts, for the supervisor's metrics
COUNTS_VERSION = 1
COUNT_KEYS = ("requests", "resent", "resumed_streams", "given_up", "quarantined")  # cumulative per relay process
GAUGE_KEYS = ("held",)  # the relay process's value now (requests waiting for the next attempt)
RELAY_INFLIGHT_FILE = "inflight-relay"  # in the run dir: the relay's requests in flight (the quarantine's evidence)


class Counts:
    """The relay's counts (``COUNT_KEYS`` and ``GAUGE_KEYS``); ``dirty`` until the next publish."""

    def __init__(self) -> None:
        self.values: dict[str, int] = dict.fromkeys(COUNT_KEYS + GAUGE_KEYS, 0)
        self.dirty = False

    def add(self, key: str, by: int = 1) -> None:
        self.values[key] += by
        self.dirty = True

    def set(self, key: str, value: int) -> None:
        self.values[key] = value
        self.dirty = True

    def record(self, pid: int) -> dict[str, int]:
        """What is published: the version, the relay's pid (the supervisor sums over relay restarts), the values."""
        self.dirty = False
        return {"version": COUNTS_VERSION, "pid": pid, **self.values}
