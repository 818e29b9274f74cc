"""Restart policy: whether a finished attempt is launched again, and when.

::

    restartable outcome (rank exit, hang,      ─▶ restart at once the first time (clients held by
    divergence, startup timeout), no stop          the relay are waiting), then after
                                                   min(BASE · 2^(restarts-1), MAX) seconds: 1, 2, 4 ...
    signal, restarts < --max-restarts
    an attempt that stayed up RESTART_STABLE_S ─▶ was no crash loop: the count starts over
    restartable, but out of restarts           ─▶ "crash loop: giving up" (with --max-restarts > 0)

Time is an argument; the main loop does the waiting (and keeps answering
signals and control requests while it waits).

Several nodes restart as one group: node 0's policy decides for all (its
decision, backoff and count go through the store, supervisor/multinode.py
``GroupOfNodes.restart_delay``), so the crash-loop limit counts group attempts.
"""

from __future__ import annotations

import structlog

from .outcome import Outcome

log = structlog.get_logger("supervise")

RESTART_BACKOFF_BASE_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
# A run that stayed up this long resets the backoff (not a crash loop).
RESTART_STABLE_S = 300.0


def crash_loop_over(uptime_s: float) -> bool:
    """An attempt that ran this long before it failed was no crash loop: what came before is forgotten (the restart
    count here, the quarantine's suspicions in incidents/quarantine.py).  The one definition of the window."""
    return uptime_s >= RESTART_STABLE_S


class RestartPolicy:
    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.restarts = 0  # restarts of the current crash loop

    def follow(self, restarts: int) -> None:
        """A group of nodes: node 0's policy decided this restart, and its count is the group's."""
        self.restarts = restarts

    def after(self, outcome: Outcome, *, stopping: bool, uptime_s: float, group: bool = False) -> float | None:
        """Seconds to wait before launching again, or None: the run is over.

        ``uptime_s``: how long the attempt that ended had run.  ``group``: a
        multi-node run, where another node's fault (``peer_failed``) ends the
        attempt of the whole group and is restarted like a fault of this node's,
        unless that node said it is final (``--on-straggler kill`` there).
        """
        restartable = outcome.restartable or (group and outcome.reason == "peer_failed" and not outcome.final)
        if restartable and crash_loop_over(uptime_s):
            self.restarts = 0  # it ran long enough: not a crash loop, the budget starts over
        if not restartable or stopping or self.restarts >= self.max_restarts:
            if restartable and self.max_restarts > 0 and not stopping:
                log.error(
                    "crash loop: giving up",
                    restarts=self.restarts,
                    max_restarts=self.max_restarts,
                    last_reason=outcome.reason,
                )
            return None
        delay = (
            0.0 if not self.restarts else min(RESTART_BACKOFF_BASE_S * 2 ** (self.restarts - 1), RESTART_BACKOFF_MAX_S)
        )
        self.restarts += 1
        log.warning(
            "restarting the group",
            restart=self.restarts,
            max_restarts=self.max_restarts,
            backoff_s=delay,
            after=outcome.reason,
        )
        return delay
