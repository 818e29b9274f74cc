"""Thread ``straggler``: which rank the group waits for, from the arrival rings in shared memory.

Every ``TICK_S`` it copies the new arrival stamps of every live rank of this
node (``HeartbeatSegment.arrivals``: no message to or from the ranks, no
collective), hands them to the pure ``watchdogs.straggler`` detector, feeds
the metrics (``on_report``) and posts ``StragglerNamed`` / ``StragglerCleared``
when an episode starts or ends.  It also keeps, every ``SLOWNESS_EVERY_S``, a
``/proc`` reading of each rank (CPU time, context switches, run-queue delay,
cgroup throttling: ``dumps.slowness``), so a named straggler comes with what
its counters did over the window in which it held the group back, and a
cause only where one accounts for the waiting (else: the rank itself is
slow).  It never
acts: the main loop decides (a bundle, and with ``--on-straggler`` a restart
or a stop).

Across nodes (``nodes`` given): every ``PUBLISH_EVERY_S`` it publishes this
node's summary (``watchdogs.straggler_nodes.summarize``: per rank its lag and
share, and its ranks' arrivals at reference collectives, numbers that are
multiples of 64, moved to node 0's clock by the offset the link's pings
measured) and merges the other nodes' (``merge_nodes``); a rank named by its
node, or a whole node behind the others, is posted as ``StragglerAcrossNodes``
on every node, by global rank and node.  Arrivals on two clocks are compared
only beyond three times the offsets' uncertainty.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from statistics import median
from typing import TYPE_CHECKING, Protocol

import structlog

from tp_supervise.dumps.slowness import SlownessSample, explain, explain_straggler, read_slowness, slowness_delta
from tp_supervise.watchdogs.gpu import GpuReading, explain_gpu
from tp_supervise.watchdogs.straggler import NAMED, StragglerConfig, StragglerDetector, StragglerReport
from tp_supervise.watchdogs.straggler_nodes import NodeEpisodes, NodeSummary, summarize

from ..events import StragglerAcrossNodes, StragglerCleared, StragglerNamed
from ..processes.attempt import PerAttempt
from ..processes.pidfds import named_thread

if TYPE_CHECKING:
    from ..processes.attempt import AttemptView
    from ..rank.heartbeat import HeartbeatSegment

log = structlog.get_logger("supervise.straggler")

TICK_S = 0.05  # the ring keeps each rank's last 256 arrivals: read well before they roll over
SLOWNESS_EVERY_S = 2.0
STEP_EVERY_S = 1.0
THREAD_JOIN_S = 2.0
PUBLISH_EVERY_S = 2.0
FORGET_MERGES = 5  # a cross-node finding absent this many merges (10 s) is over: its next episode is posted again
# Reference collectives for the cross-node comparison: one in REF_STRIDE, picked by a hash of its number (the
# same on every node), so they fall at every position of a step, not always at the same one.
REF_STRIDE = 64
REF_KEEP = 128


def _cgroup_path(sample: SlownessSample) -> str | None:
    return sample.cgroup.path if sample.cgroup is not None else None


def is_reference(seq: int) -> bool:
    return ((seq * 2654435761) & 0xFFFFFFFF) % REF_STRIDE == 0


class NodeStragglers(Protocol):
    """What the thread needs of the node link (multi-node)."""

    node_rank: int

    def publish(self, summary: bytes) -> None: ...
    def peers(self) -> dict[int, bytes]: ...
    def clock_offset(self) -> tuple[float, float] | None: ...


ERROR_BACKOFF_S = 0.5


class StragglerWatch:
    """What the straggler thread keeps of one attempt (a fresh one per attempt: ``PerAttempt``)."""

    def __init__(self, config: StragglerConfig):
        self.detector = StragglerDetector(config)
        self.samples: deque[tuple[float, dict[int, SlownessSample]]] = deque()
        self.refs: dict[int, dict[int, float]] = {}  # reference collective -> rank -> arrival (local clock)
        self.refs_from: float | None = None  # references before this (the first collectives' warm-up) are not kept
        # Cross-node findings already posted, by what they are about (("rank", node, rank) or ("node", node)) ->
        # the last merge that still found them: one log line per episode, a new one after FORGET_MERGES without.
        self.said: dict[tuple, int] = {}
        self.episodes = NodeEpisodes(config)


class StragglerThread:
    def __init__(
        self,
        config: StragglerConfig,
        heartbeat: HeartbeatSegment,
        attempt: Callable[[], AttemptView],
        post: Callable[[object], None],
        on_report: Callable[[StragglerReport], None],
        nodes: NodeStragglers | None = None,
        gpu: Callable[[], GpuReading | None] | None = None,
    ):
        self.config = config
        self.gpu = gpu  # the GPU sampler's latest reading (never NVML from this thread)
        self.heartbeat = heartbeat
        self.attempt = attempt
        self.post = post
        self.on_report = on_report
        self.nodes = nodes
        self._next_publish = 0.0
        self._merges = 0
        self.watches: PerAttempt[StragglerWatch] = PerAttempt(lambda _view, _ended: StragglerWatch(config))
        self.watch = StragglerWatch(config)  # the attempt being watched (this tick's)
        self.step_s: float | None = None
        self._next_step = 0.0
        self._next_sample = 0.0
        self._stop = threading.Event()
        self._thread = named_thread(self._run, "straggler")

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
        self.watch = self.watches.of(attempt)
        live = {slot: r for slot, r in attempt.ranks.items() if r.alive and r.rank >= 0}
        windows = [self.heartbeat.arrivals(slot, since=self.watch.detector.since(r.rank)) for slot, r in live.items()]
        if now >= self._next_step:
            self._next_step = now + STEP_EVERY_S
            steps = [s.last_step_s for s in self.heartbeat.read_all() if s.claimed and s.last_step_s > 0]
            self.step_s = median(steps) if steps else None
        if now >= self._next_sample:
            self._next_sample = now + SLOWNESS_EVERY_S
            self._sample({r.rank: r.pid for r in live.values()}, now)
        if self.nodes is not None:
            self._keep_references(windows)
        report = self.watch.detector.observe(windows, now, self.step_s)
        self.on_report(report)
        if self.nodes is not None and now >= self._next_publish:
            self._next_publish = now + PUBLISH_EVERY_S
            self._across_nodes(report, attempt.number)
        for ev in report.events:
            if ev.kind == NAMED:
                pids = {r.rank: r.pid for r in live.values()}
                evidence = self._evidence(ev.rank, pids, since=ev.since, lateness=ev.lag.wait_share)
                self.post(StragglerNamed(ev, report, evidence, attempt.number))
            else:
                self.post(StragglerCleared(ev, attempt.number))

    def _sample(self, pids: dict[int, int], now: float) -> None:
        self.watch.samples.append((now, {rank: read_slowness(pid) for rank, pid in pids.items()}))
        while self.watch.samples and now - self.watch.samples[0][0] > self.config.window_s + SLOWNESS_EVERY_S:
            self.watch.samples.popleft()

    def _evidence(
        self, rank: int, pids: dict[int, int], since: float | None = None, lateness: float | None = None
    ) -> dict:
        """The slow rank's and one peer's counters over the window (deltas) and, where NVML is present, their
        GPUs' clocks, clock event reasons, temperature and power; a sentence fragment for the verdict.

        ``since``: when the run that named it began (the deltas start at the first reading from then on, where
        there is one); ``lateness``: its share of the group's time over that run, which a counter must account
        for to be said as the cause (``dumps.slowness.explain_straggler``); when neither a counter nor its GPU does,
        the fragment says the rank itself is slow."""
        peer = next((r for r in sorted(pids) if r != rank), None)
        out: dict = {"ranks": {}, "gpu": {}, "explanation": ""}
        slow_delta, gpu_said = None, ""
        reading = self.gpu() if self.gpu is not None else None
        for r in (rank, peer):
            if r is None:
                continue
            now = read_slowness(pids[r])
            # From the oldest reading of the run that named it, in the cgroup the rank is in now: a rank moved
            # into a CPU-limited cgroup during the window has its throttling counted since the move (counters
            # of two cgroups do not subtract).
            readings = [sample[r] for _at, sample in self.watch.samples if sample.get(r) is not None]
            in_run = [b for b in readings if since is None or b.at >= since - SLOWNESS_EVERY_S] or readings
            before = next((b for b in in_run if _cgroup_path(b) == _cgroup_path(now)), in_run[0] if in_run else None)
            if before is not None:
                delta = slowness_delta(before, now)
                out["ranks"][str(r)] = delta.to_dict() if delta is not None else None
                if r == rank:
                    slow_delta = delta
            gpu = None
            if reading is not None:
                gpu = next((g for g in reading.samples if any(p.pid == pids[r] for p in g.processes)), None)
            if gpu is not None:
                out["gpu"][str(r)] = gpu.to_dict()
                if r == rank:
                    gpu_said = explain_gpu(gpu)
        if lateness is None:
            out["explanation"] = "; ".join(part for part in (explain(slow_delta), gpu_said) if part)
        else:
            out["explanation"] = explain_straggler(slow_delta, lateness, gpu_said)
        return out

    # -- across nodes ----------------------------------------------------------------------------
    def _keep_references(self, windows: list) -> None:
        """Each rank's arrival at the reference collectives its window holds (also with one rank per node,
        where the detector has nobody to compare within the node), from ``warmup_s`` after the first arrival
        seen on: the first collectives (connections made, caches cold, a first step compiled) say nothing of
        a node's usual pace."""
        for w in windows:
            if w is None or not w.arrivals:
                continue
            if self.watch.refs_from is None:
                self.watch.refs_from = w.arrivals[0] + self.config.warmup_s
            for i, arrival in enumerate(w.arrivals):
                seq = w.first_seq + i
                if arrival >= self.watch.refs_from and is_reference(seq):
                    self.watch.refs.setdefault(seq, {})[w.rank] = arrival
        for seq in sorted(self.watch.refs)[:-REF_KEEP]:
            del self.watch.refs[seq]

    def _across_nodes(self, report: StragglerReport, attempt: int) -> None:
        assert self.nodes is not None
        offset = self.nodes.clock_offset()
        if offset is None:
            return
        # The references of the detector's window only: a node that turns late is judged on what it does now,
        # not diluted by minutes of its usual pace.
        since = report.at - self.config.window_s
        refs = {
            seq: tuple(sorted(by_rank.items()))
            for seq, by_rank in self.watch.refs.items()
            if max(by_rank.values()) >= since
        }
        mine = summarize(report, refs, self.nodes.node_rank, offset[0], offset[1])

        self.nodes.publish(json.dumps(mine.to_dict()).encode())
        summaries = [mine]
        for node, raw in self.nodes.peers().items():
            try:
                summary = NodeSummary.from_dict(json.loads(raw))
            except ValueError:
                continue  # not a summary (a stranger's value, an older format): ignored
            if summary.node == node:
                summaries.append(summary)
        judgement = self.watch.episodes.judge(summaries, report.at)
        self._merges += 1
        findings: dict[tuple, str] = {
            ("rank", node, rank): f"node {node}: {text}" for node, rank, text in judgement.named
        }
        findings.update({("node", late.node): late.sentence() for late in judgement.late_nodes})
        fresh = {key: text for key, text in findings.items() if key not in self.watch.said}
        for key in findings:
            self.watch.said[key] = self._merges
        for key, seen in list(self.watch.said.items()):
            if self._merges - seen > FORGET_MERGES:
                del self.watch.said[key]
        if fresh:
            ranks = sorted(
                {k[2] for k in fresh if k[0] == "rank"}
                | {r for late in judgement.late_nodes if ("node", late.node) in fresh for r in late.ranks}
            )
            nodes = sorted({k[1] for k in fresh})
            self.post(StragglerAcrossNodes(tuple(fresh.values()), tuple(ranks), tuple(nodes), attempt))
