"""Thread ``straggler``: which rank the group waits for, from the arrival rings in shared memory.

Every ``TICK_S`` it copies the new arrival stamps of every live rank of this
node (``HeartbeatSegment.arrivals``: no message to or from the ranks, no
collective), hands them to the pure ``watchdogs.straggler`` detector, feeds
the metrics (``on_report``) and posts ``StragglerNamed`` / ``StragglerCleared``
when an episode starts or ends.  It also keeps, every ``SLOWNESS_EVERY_S``, a
``/proc`` reading of each rank (CPU time, context switches, run-queue delay,
cgroup throttling: ``dumps.slowness``), so a named straggler comes with what
its counters did over the window in which it held the group back.  It never
acts: the main loop decides (a bundle, and with ``--on-straggler`` a restart
or a stop).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from statistics import median
from typing import TYPE_CHECKING

import structlog

from tp_supervise.dumps.slowness import SlownessSample, explain, read_slowness, slowness_delta
from tp_supervise.watchdogs.straggler import NAMED, StragglerConfig, StragglerDetector, StragglerReport

from ..events import StragglerCleared, StragglerNamed

if TYPE_CHECKING:
    from ..processes.attempt import AttemptView
    from ..rank.heartbeat import HeartbeatSegment

log = structlog.get_logger("supervise.straggler")

TICK_S = 0.05  # the ring keeps each rank's last 256 arrivals: read well before they roll over
SLOWNESS_EVERY_S = 2.0
STEP_EVERY_S = 1.0
THREAD_JOIN_S = 2.0
ERROR_BACKOFF_S = 0.5


class StragglerThread:
    def __init__(self, config: StragglerConfig, heartbeat: HeartbeatSegment, attempt: Callable[[], AttemptView],
                 post: Callable[[object], None], on_report: Callable[[StragglerReport], None]):
        self.config = config
        self.heartbeat = heartbeat
        self.attempt = attempt
        self.post = post
        self.on_report = on_report
        self.detector = StragglerDetector(config)
        self.watching: float | None = None  # started_at of the attempt watched
        self.step_s: float | None = None
        self._next_step = 0.0
        self._next_sample = 0.0
        self._samples: deque[tuple[float, dict[int, SlownessSample]]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="straggler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(THREAD_JOIN_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick(time.monotonic())
                self._stop.wait(TICK_S)
            except Exception as exc:  # a watchdog never dies of one bad pass
                log.error("straggler pass failed", event_name="straggler_pass_failed", error=repr(exc)[:300])
                self._stop.wait(ERROR_BACKOFF_S)

    def tick(self, now: float) -> None:
        attempt = self.attempt()
        if attempt.finished or not attempt.launched:
            return
        if attempt.started_at != self.watching:
            self.watching = attempt.started_at
            self.detector = StragglerDetector(self.config)
            self._samples.clear()
        live = {slot: r for slot, r in attempt.ranks.items() if r.alive and r.rank >= 0}
        windows = [self.heartbeat.arrivals(slot, since=self.detector.since(r.rank)) for slot, r in live.items()]
        if now >= self._next_step:
            self._next_step = now + STEP_EVERY_S
            steps = [s.last_step_s for s in self.heartbeat.read_all() if s.claimed and s.last_step_s > 0]
            self.step_s = median(steps) if steps else None
        if now >= self._next_sample:
            self._next_sample = now + SLOWNESS_EVERY_S
            self._sample({r.rank: r.pid for r in live.values()}, now)
        report = self.detector.observe(windows, now, self.step_s)
        self.on_report(report)
        for ev in report.events:
            if ev.kind == NAMED:
                pids = {r.rank: r.pid for r in live.values()}
                evidence = self._evidence(ev.rank, pids)
                self.post(StragglerNamed(ev, report, evidence, attempt.number))
            else:
                self.post(StragglerCleared(ev, attempt.number))

    def _sample(self, pids: dict[int, int], now: float) -> None:
        self._samples.append((now, {rank: read_slowness(pid) for rank, pid in pids.items()}))
        while self._samples and now - self._samples[0][0] > self.config.window_s + SLOWNESS_EVERY_S:
            self._samples.popleft()

    def _evidence(self, rank: int, pids: dict[int, int]) -> dict:
        """The slow rank's and one peer's counters over the window: deltas, and a sentence fragment."""
        peer = next((r for r in sorted(pids) if r != rank), None)
        out: dict = {"ranks": {}, "explanation": ""}
        if not self._samples:
            return out
        before = self._samples[0][1]
        for r in (rank, peer):
            if r is None or r not in before:
                continue
            delta = slowness_delta(before[r], read_slowness(pids[r]))
            out["ranks"][str(r)] = delta.to_dict() if delta is not None else None
            if r == rank:
                out["explanation"] = explain(delta)
        return out
