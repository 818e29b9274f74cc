"""Prometheus metrics of one supervisor process.

Every metric lives in a private ``CollectorRegistry`` owned by one
``SupervisorMetrics`` instance (no module-level metrics), so a process, or a
test, can build as many independent sets as it likes.  docs/metrics.md is the
operator-facing catalogue; the alert rules in docs/prometheus/alerts.yml and
the dashboard in docs/grafana/ are written against exactly these names.

Conventions:

* base units (seconds, bytes, watts, ratios 0..1), counters end in ``_total``;
* bounded labels only: ``rank`` (global rank), ``gpu`` (NVML index),
  ``kind``, ``reason``, ``result``, ``state`` — never pids, request ids or
  free text; a label value outside its documented set is folded into
  ``other`` so a caller bug cannot explode cardinality;
* every label value of a closed set is created at start-up with value 0
  (counters) or its real initial value (one-hot engine state), so alert
  rules and ``increase()`` see a 0 → 1 step on the very first incident
  instead of a series that appears already at 1.

Threading: prometheus_client metrics are thread safe.  ``observe_ranks``
keeps the previous snapshot per slot to derive durations; it is meant to be
called from one thread (the watchdog tick) and guards its own state anyway.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from tp_supervise.watchdogs.straggler import StragglerReport

from ..outcome import TEARDOWN_EXIT
from ..processes import exits
from ..rank.heartbeat import SlotSnapshot
from ..state import EngineState

log = structlog.get_logger()

PREFIX = "supervise"
OTHER = "other"

ENGINE_STATES: tuple[str, ...] = tuple(s.value for s in EngineState)
HANG_KINDS = ("soft", "hard")
THRESHOLD_KINDS = ("soft", "hard", "startup")
# Exits the supervisor caused itself while tearing the group down: counted
# apart so that a clean shutdown never looks like a crashed rank.
RANK_EXIT_REASONS: tuple[str, ...] = (exits.CLEAN, *exits.REASONS, TEARDOWN_EXIT, OTHER)
# Bundle reasons of the incident bundle (docs/bundle.md, docs/contracts.md).
DUMP_REASONS = (
    "rank_exit",
    "hang",
    "hang_suspected",
    "straggler",
    "divergence",
    "startup_timeout",
    "peer_failed",
    "node_lost",
    "on_demand",
    OTHER,
)
DUMP_OK = "ok"
DUMP_FAILED = "failed"  # no bundle, or a bundle without any rank's stacks
DUMP_RESULTS = (DUMP_OK, DUMP_FAILED)
TEARDOWN_COMPLETE = "complete"
TEARDOWN_INCOMPLETE = "incomplete"  # a process survived SIGKILL or GPU memory stayed held
TEARDOWN_RESULTS = (TEARDOWN_COMPLETE, TEARDOWN_INCOMPLETE)

# Step time: sub-millisecond CPU toy steps up to minute-long prefills.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Collective waits as the watchdog tick sees them: a tick is milliseconds, a
# hang is seconds to minutes.
COLLECTIVE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# A full dump: py-spy per rank in parallel, goal <= 1 s for 8 ranks.
DUMP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# One call to the supervisors' store: ~0.1 ms on loopback, ~1 ms in a rack, tens of ms across sites; a call
# times out at 3 s (supervisor.nodes.store.STORE_TIMEOUT_S), so 5 s is the last finite bucket.
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# The ``op`` label: the calls of supervisor.nodes.store.TorchStore (the one list of them).
STORE_OPS = ("connect", "set", "get", "add", "compare_set", "multi_get", OTHER)

PERCENT = 100.0


def package_version() -> str:
    try:
        return metadata.version("tp-supervise")
    except metadata.PackageNotFoundError:
        return "unknown"


def _state_name(state: str | enum.Enum) -> str:
    if isinstance(state, enum.Enum):
        value = state.value
        return value if isinstance(value, str) else state.name.lower()
    return str(state)


def _threshold(value: float | None) -> float:
    """A timeout for export: NaN when that watchdog is off (None or infinite)."""
    return math.nan if value is None or not math.isfinite(value) else float(value)


RELAY = {  # counts line key (supervisor/relay/protocol.py) -> (metric name between supervise_relay_ and _total, help)
    "requests": (
        "requests",
        "Generation requests the relay (built-in engine, or a COMMAND's --relay) took from clients.",
    ),
    "resent": ("resends", "Requests the relay sent again after a failed attempt's answer (resumed streams included)."),
    "resumed_streams": (
        "resumed_streams",
        "Streams the relay continued on a new attempt from the tokens the client already had.",
    ),
    "given_up": (
        "gave_up",
        "Requests the relay answered 503: no attempt answered within its hold (--relay-hold) of a failure, too "
        "many were held (--relay-max-held), a stream could not be continued, or the run ended.",
    ),
    "quarantined": (
        "quarantined_answers",
        "Requests the relay answered 400 because their fingerprint is quarantined (a COMMAND's engine behind "
        "--relay; the built-in engine answers these itself).",
    ),
}


class GpuReading(Protocol):
    """What observe_gpus reads from one sample (watchdogs.gpu.GpuSample has these, read-only: it is frozen)."""

    @property
    def index(self) -> int: ...
    @property
    def utilization_pct(self) -> float | None: ...
    @property
    def power_w(self) -> float | None: ...
    @property
    def memory_used(self) -> int | None: ...
    @property
    def memory_total(self) -> int | None: ...


@dataclass(frozen=True)
class _RankSeries:
    """The per-rank children of the rank families."""

    up: Gauge
    heartbeat_age: Gauge
    step: Gauge
    collective_seq: Gauge
    busy: Gauge
    collective_wait: Gauge
    step_duration: Histogram
    collective_duration: Histogram


class SupervisorMetrics:
    """All metrics of one supervised run, in one private registry.

    ``slot_ranks[i]`` is the global rank expected in heartbeat slot ``i``
    (spawn mode: ``rank_offset + i``).  It names the ``rank`` label of a slot
    before its rank claims it; once claimed, the rank the slot reports wins.
    """

    def __init__(
        self,
        run_id: str,
        slot_ranks: Sequence[int] = (),
        *,
        node: int = 0,
        version: str | None = None,
    ):
        self.registry = CollectorRegistry(auto_describe=True)
        self.run_id = run_id
        self.slot_ranks = tuple(slot_ranks)
        reg = self.registry

        def name(base: str) -> str:
            return f"{PREFIX}_{base}"

        # -- identity and state --------------------------------------------
        self.info = Gauge(
            name("info"), "Constant 1; labels identify the supervised run.", ["run_id", "version", "node"], registry=reg
        )
        self.engine_state = Gauge(
            name("engine_state"), "1 for the engine's current state, 0 for every other state.", ["state"], registry=reg
        )
        self.incident_open = Gauge(
            name("incident_open"), "1 while an incident (hang, divergence, rank exit) is being handled.", registry=reg
        )
        # -- per rank ----------------------------------------------------------
        self.rank_up = Gauge(name("rank_up"), "1 while the rank's process is alive.", ["rank"], registry=reg)
        self.nodes_up = Gauge(
            name("nodes_up"), "Nodes of the run whose supervisor is alive (this one included).", registry=reg
        )
        self.peer_node_up = Gauge(
            name("peer_node_up"),
            "1 while the other node's supervisor heartbeats (multi-node).",
            ["node_rank"],
            registry=reg,
        )
        self.nodes_up.set(1)
        self.store_latency = Histogram(
            name("store_latency_seconds"),
            "Duration of each call this supervisor made to the multi-node store (node 0's TCPStore), by operation.",
            ["op"],
            buckets=STORE_BUCKETS,
            registry=reg,
        )
        self.rank_heartbeat_age = Gauge(
            name("rank_heartbeat_age_seconds"),
            "Seconds since the rank last wrote its heartbeat slot (grows while idle too).",
            ["rank"],
            registry=reg,
        )
        self.rank_step = Gauge(name("rank_step"), "Engine steps the rank completed.", ["rank"], registry=reg)
        self.rank_arrival_lag = Gauge(
            name("rank_arrival_lag_seconds"),
            "How late the rank enters its collectives: its arrival minus the median arrival of its peers, over the "
            "straggler window (quantile 0.5, 0.9, 0.99).",
            ["rank", "quantile"],
            registry=reg,
        )
        self.straggler = Gauge(
            name("straggler"), "1 while the rank is named a straggler (the group waits for it).", ["rank"], registry=reg
        )
        self.rank_collective_seq = Gauge(
            name("rank_collective_seq"), "Collectives the rank entered.", ["rank"], registry=reg
        )
        # -- per process of the engine's control plane (docs/supervisor.md, "Roles") ----------------------
        self.control_up = Gauge(
            name("control_plane_up"),
            "1 while the engine's process of this role (scheduler: vLLM's engine core; frontend: its API server) "
            "is alive and reports through its control slot.",
            ["role"],
            registry=reg,
        )
        self.control_step = Gauge(
            name("control_plane_step_seconds"),
            "Seconds the process of this role has been inside its current step (scheduler) or holding requests "
            "with no output (frontend); 0 between steps.",
            ["role"],
            registry=reg,
        )
        self._control_roles: set[str] = set()
        self.rank_busy = Gauge(
            name("rank_busy"), "1 while the rank is inside a step or a collective.", ["rank"], registry=reg
        )
        self.rank_collective_wait = Gauge(
            name("rank_collective_wait_seconds"),
            "Seconds the rank has been inside its current collective (0 when outside).",
            ["rank"],
            registry=reg,
        )
        self.step_duration = Histogram(
            name("step_duration_seconds"),
            "Engine step durations, one sample per rank per watchdog tick in which the rank completed steps.",
            ["rank"],
            buckets=STEP_BUCKETS,
            registry=reg,
        )
        self.collective_duration = Histogram(
            name("collective_duration_seconds"),
            "How long collectives seen in progress by a watchdog tick had lasted when last seen (a lower bound).",
            ["rank"],
            buckets=COLLECTIVE_BUCKETS,
            registry=reg,
        )
        # -- watchdog ------------------------------------------------------------
        self.watchdog_threshold = Gauge(
            name("watchdog_threshold_seconds"),
            "Timeout in force (explicit or adaptive); NaN when that watchdog is off.",
            ["kind"],
            registry=reg,
        )
        self.stall = Gauge(
            name("stall_seconds"),
            "Seconds the group has been busy without progress (0 while idle or progressing).",
            registry=reg,
        )
        self.hangs = Counter(
            name("hangs_total"), "Hang verdicts of the soft and hard watchdogs.", ["kind"], registry=reg
        )
        # -- consensus -----------------------------------------------------------
        self.divergences = Counter(name("divergences_total"), "Divergence incidents between ranks.", registry=reg)
        self.consensus_comparisons = Counter(
            name("consensus_comparisons_total"), "Per-step digest comparisons across the TP group.", registry=reg
        )
        self.consensus_mismatches = Counter(
            name("consensus_mismatches_total"), "Digest comparisons that found ranks disagreeing.", registry=reg
        )
        # -- lifecycle -------------------------------------------------------------
        self.rank_exits = Counter(
            name("rank_exits_total"), "Rank process exits by classified reason.", ["reason"], registry=reg
        )
        self.restarts = Counter(name("restarts_total"), "Restarts of the rank group.", registry=reg)
        self.quarantined_requests = Counter(
            name("quarantined_requests_total"),
            "Requests quarantined for the run: scheduled by the failing step of --quarantine-after failed attempts.",
            registry=reg,
        )
        self.teardown_seconds = Gauge(
            name("teardown_seconds"), "Duration of the last teardown; NaN before the first.", registry=reg
        )
        # the relay's counts (supervisor/relay/process.py), by the key of its counts line
        self.relay = {
            key: Counter(name(f"relay_{metric}_total"), text, registry=reg) for key, (metric, text) in RELAY.items()
        }
        self._relay_seen: dict[str, int] = {}
        self.relay_held = Gauge(
            name("relay_held_requests"),
            "Requests the relay holds now, waiting for the group's next attempt to answer.",
            registry=reg,
        )
        self.teardowns = Counter(name("teardowns_total"), "Teardowns by outcome.", ["result"], registry=reg)
        self.dumps = Counter(
            name("dumps_total"), "Incident bundles by reason and outcome.", ["reason", "result"], registry=reg
        )
        self.dump_duration = Histogram(
            name("dump_duration_seconds"),
            "Wall time to capture and write one incident bundle.",
            buckets=DUMP_BUCKETS,
            registry=reg,
        )
        # -- GPU (only set where NVML works) ------------------------------------
        self.gpu_utilization = Gauge(
            name("gpu_utilization_ratio"), "GPU busy ratio (0..1) from NVML.", ["gpu"], registry=reg
        )
        self.gpu_power = Gauge(name("gpu_power_watts"), "GPU power draw from NVML.", ["gpu"], registry=reg)
        self.gpu_memory_used = Gauge(name("gpu_memory_used_bytes"), "GPU memory in use.", ["gpu"], registry=reg)
        self.gpu_memory_total = Gauge(name("gpu_memory_total_bytes"), "GPU memory size.", ["gpu"], registry=reg)

        self._lock = threading.Lock()
        self._prev: dict[int, tuple[SlotSnapshot, float]] = {}
        self._ranks: dict[str, _RankSeries] = {}
        self._consensus_seen = (0, 0)
        self._state = ""
        self._store_ops = {op: self.store_latency.labels(op=op) for op in STORE_OPS}  # resolved once: hot path
        self._preinitialise(version or package_version(), node)

    def _preinitialise(self, version: str, node: int) -> None:
        self.info.labels(run_id=self.run_id, version=version, node=str(node)).set(1)
        self.set_engine_state(EngineState.STARTING)
        for kind in HANG_KINDS:
            self.hangs.labels(kind=kind)
        for kind in THRESHOLD_KINDS:
            self.watchdog_threshold.labels(kind=kind).set(math.nan)
        for reason in RANK_EXIT_REASONS:
            self.rank_exits.labels(reason=reason)
        for reason in DUMP_REASONS:
            for result in DUMP_RESULTS:
                self.dumps.labels(reason=reason, result=result)
        for result in TEARDOWN_RESULTS:
            self.teardowns.labels(result=result)
        self.teardown_seconds.set(math.nan)
        for rank in self.slot_ranks:
            # Creating the children also exports the histograms at zero.
            self._rank_series(str(rank)).up.set(0)

    # -- state -------------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    def set_engine_state(self, state: str | enum.Enum) -> None:
        """One-hot: the given state 1, every other state 0."""
        name = _state_name(state)
        if name not in ENGINE_STATES:
            raise ValueError(f"unknown engine state {name!r}; expected one of {', '.join(ENGINE_STATES)}")
        for s in ENGINE_STATES:
            self.engine_state.labels(state=s).set(1 if s == name else 0)
        self._state = name

    def set_incident_open(self, is_open: bool) -> None:
        self.incident_open.set(1 if is_open else 0)

    # -- ranks -----------------------------------------------------------------
    def rank_label(self, snap: SlotSnapshot) -> str | None:
        """The ``rank`` label of a slot, or None for a slot nobody will use."""
        if snap.claimed and snap.rank >= 0:
            return str(snap.rank)
        if snap.slot < len(self.slot_ranks):
            return str(self.slot_ranks[snap.slot])
        return None

    def observe_ranks(self, snapshots: Iterable[SlotSnapshot], now: float, alive: Mapping[int, bool]) -> None:
        """Update per-rank gauges from one watchdog tick's heartbeat reads.

        ``now`` is ``time.monotonic()`` of the reads (the heartbeat clock);
        ``alive`` maps slot -> whether its process is alive (missing: dead).
        Step durations are sampled: the last completed step's duration, once
        per tick in which the rank completed at least one step.
        """
        with self._lock:
            for snap in snapshots:
                label = self.rank_label(snap)
                if label is None:
                    continue
                series = self._rank_series(label)
                series.up.set(1 if alive.get(snap.slot, False) else 0)
                if not snap.claimed:
                    continue
                series.heartbeat_age.set(max(0.0, now - snap.ts_heartbeat))
                series.step.set(snap.step)
                series.collective_seq.set(snap.coll_seq)
                series.busy.set(1 if snap.busy else 0)
                series.collective_wait.set(max(0.0, now - snap.ts_coll_begin) if snap.in_collective else 0.0)
                if not snap.torn:
                    self._observe_durations(series, snap, now)

    def observe_control(self, control: Iterable[SlotSnapshot], now: float) -> None:
        """The control plane's live slots as one watchdog tick read them (a role absent now reads 0)."""
        with self._lock:
            seen = set()
            for snap in control:
                role = snap.role_name
                seen.add(role)
                self.control_up.labels(role=role).set(1)
                self.control_step.labels(role=role).set(max(0.0, now - snap.ts_step_begin) if snap.in_step else 0.0)
            for role in self._control_roles - seen:
                self.control_up.labels(role=role).set(0)
                self.control_step.labels(role=role).set(0.0)
            self._control_roles |= seen

    def _rank_series(self, label: str) -> _RankSeries:
        """The children of one rank, resolved once (``labels()`` costs a lock and a lookup)."""
        series = self._ranks.get(label)
        if series is None:
            series = _RankSeries(
                up=self.rank_up.labels(rank=label),
                heartbeat_age=self.rank_heartbeat_age.labels(rank=label),
                step=self.rank_step.labels(rank=label),
                collective_seq=self.rank_collective_seq.labels(rank=label),
                busy=self.rank_busy.labels(rank=label),
                collective_wait=self.rank_collective_wait.labels(rank=label),
                step_duration=self.step_duration.labels(rank=label),
                collective_duration=self.collective_duration.labels(rank=label),
            )
            series.heartbeat_age.set(math.nan)  # no heartbeat until the rank claims its slot
            self._ranks[label] = series
        return series

    def _observe_durations(self, series: _RankSeries, snap: SlotSnapshot, now: float) -> None:
        prev_entry = self._prev.get(snap.slot)
        self._prev[snap.slot] = (snap, now)
        if prev_entry is None:
            return
        prev, prev_now = prev_entry
        if prev.pid != snap.pid:
            return  # a new process in the slot: its counters start over
        if snap.step > prev.step and snap.last_step_s > 0:
            series.step_duration.observe(snap.last_step_s)
        if prev.in_collective and (snap.coll_seq != prev.coll_seq or not snap.in_collective):
            series.collective_duration.observe(max(0.0, prev_now - prev.ts_coll_begin))

    # -- watchdog ------------------------------------------------------------------
    def set_watchdog(
        self,
        *,
        soft: float | None,
        hard: float | None,
        startup: float | None = None,
        stalled_s: float = 0.0,
    ) -> None:
        """Thresholds in force (None: that watchdog is off) and the current stall."""
        self.watchdog_threshold.labels(kind="soft").set(_threshold(soft))
        self.watchdog_threshold.labels(kind="hard").set(_threshold(hard))
        self.watchdog_threshold.labels(kind="startup").set(_threshold(startup))
        self.stall.set(max(0.0, stalled_s))

    def record_hang(self, kind: str) -> None:
        if kind not in HANG_KINDS:
            raise ValueError(f"hang kind {kind!r}: expected one of {', '.join(HANG_KINDS)}")
        self.hangs.labels(kind=kind).inc()

    # -- consensus ---------------------------------------------------------------
    def record_divergence(self) -> None:
        self.divergences.inc()

    def set_consensus_counts(self, comparisons: int, mismatches: int) -> None:
        """Feed the consensus monitor's cumulative counts; the counters advance by the difference."""
        with self._lock:
            seen_cmp, seen_mis = self._consensus_seen
            if comparisons < seen_cmp or mismatches < seen_mis:
                seen_cmp, seen_mis = 0, 0  # a new monitor (restart) counts from zero
            self.consensus_comparisons.inc(comparisons - seen_cmp)
            self.consensus_mismatches.inc(mismatches - seen_mis)
            self._consensus_seen = (comparisons, mismatches)

    def set_relay_counts(self, counts: Mapping[str, int]) -> None:
        """Feed the relay's cumulative counts (supervisor/relay/process.py); counters advance by the difference."""
        with self._lock:
            self.relay_held.set(counts.get("held", 0))
            for key, counter in self.relay.items():
                value = counts.get(key, 0)
                seen = self._relay_seen.get(key, 0)
                if value > seen:
                    counter.inc(value - seen)
                    self._relay_seen[key] = value

    # -- lifecycle -------------------------------------------------------------------
    def record_rank_exit(self, reason: str) -> None:
        """Count one rank exit (``supervisor.processes.exits`` reasons, or ``TEARDOWN_EXIT``)."""
        self.rank_exits.labels(reason=self._bounded(reason, RANK_EXIT_REASONS, "rank exit reason")).inc()

    def observe_stragglers(self, report: StragglerReport) -> None:
        """From the straggler thread: the window's lag quantiles per rank, and who is named."""
        for rank, lag in report.ranks.items():
            for q, value in (("0.5", lag.lag_p50_s), ("0.9", lag.lag_p90_s), ("0.99", lag.lag_p99_s)):
                self.rank_arrival_lag.labels(rank=str(rank), quantile=q).set(value)
            self.straggler.labels(rank=str(rank)).set(1 if rank in report.named else 0)

    def set_nodes(self, peers_up: Mapping[int, bool]) -> None:
        """Multi-node: which other nodes' supervisors are alive (from the node-link thread; gauges are thread safe)."""
        for node, up in peers_up.items():
            self.peer_node_up.labels(node_rank=str(node)).set(1 if up else 0)
        self.nodes_up.set(1 + sum(1 for up in peers_up.values() if up))

    def observe_store_latency(self, op: str, seconds: float) -> None:
        """One store call (``supervisor.nodes.store.StoreLatency`` sink; called from the node-link thread)."""
        child = self._store_ops.get(op)
        if child is None:
            child = self._store_ops[self._bounded(op, STORE_OPS, "store op")]
        child.observe(max(0.0, seconds))

    def record_restart(self) -> None:
        self.restarts.inc()

    def record_quarantined(self, count: int) -> None:
        self.quarantined_requests.inc(count)

    def record_teardown(self, duration_s: float, complete: bool) -> None:
        self.teardown_seconds.set(duration_s)
        self.teardowns.labels(result=TEARDOWN_COMPLETE if complete else TEARDOWN_INCOMPLETE).inc()

    def record_dump(self, reason: str, ok: bool, duration_s: float) -> None:
        reason = self._bounded(reason, DUMP_REASONS, "dump reason")
        self.dumps.labels(reason=reason, result=DUMP_OK if ok else DUMP_FAILED).inc()
        self.dump_duration.observe(max(0.0, duration_s))

    # -- GPU -------------------------------------------------------------------------
    def set_gpu(
        self,
        index: int,
        *,
        utilization_pct: float | None,
        power_watts: float | None,
        memory_used_bytes: float | None,
        memory_total_bytes: float | None = None,
    ) -> None:
        """One NVML sample of one GPU; None leaves a reading that NVML refused untouched."""
        gpu = str(index)
        if utilization_pct is not None:
            self.gpu_utilization.labels(gpu=gpu).set(utilization_pct / PERCENT)
        if power_watts is not None:
            self.gpu_power.labels(gpu=gpu).set(power_watts)
        if memory_used_bytes is not None:
            self.gpu_memory_used.labels(gpu=gpu).set(memory_used_bytes)
        if memory_total_bytes is not None:
            self.gpu_memory_total.labels(gpu=gpu).set(memory_total_bytes)

    def observe_gpus(self, samples: Iterable[GpuReading]) -> None:
        """All GPUs of one telemetry sample (e.g. ``watchdogs.gpu.GpuTelemetry.sample()``)."""
        for g in samples:
            self.set_gpu(
                g.index,
                utilization_pct=g.utilization_pct,
                power_watts=g.power_w,
                memory_used_bytes=g.memory_used,
                memory_total_bytes=g.memory_total,
            )

    # -- exposition ------------------------------------------------------------------
    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """(body, content type) for a scrape, in the format ``accept`` asks for."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    @staticmethod
    def _bounded(value: str, allowed: Sequence[str], what: str) -> str:
        if value in allowed:
            return value
        log.warning("metrics_label_folded", label=what, value=value, folded_to=OTHER)
        return OTHER
