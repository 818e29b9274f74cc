"""The supervisor's side services: metrics + health HTTP, control socket,
consensus poller, GPU telemetry, and the per-rank environment they need.

GPU telemetry is the ``gpu-sampler`` thread (``watchdogs.gpu.GpuSampler``):
NVML is initialised and called there only, so a wedged driver stalls no
other thread; the watchdog tick and the incident desk read its cached
reading, and teardown's GPU-memory check waits for a fresh one at most
``GPU_QUERY_TIMEOUT_S``.

The main loop calls the ``on_*`` methods, the watchdog thread ``on_tick``;
nothing here decides anything.  The services get the run's fixed facts
(spec, run id, run dir) and ``post`` (the control socket and the consensus
poller hand their events to the main loop through it); what changes is
passed in by the caller.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from tp_supervise.watchdogs.gpu import GpuSampler, holding_memory
from tp_supervise.watchdogs.straggler import StragglerReport

from .. import logs
from .. import state as engine_state
from ..events import ControlRequest
from ..rank.heartbeat import SlotSnapshot
from .http_server import HealthCell, HealthServer, HealthStatus, Liveness
from .metrics import SupervisorMetrics
from .status import StatusBoard

if TYPE_CHECKING:
    from tp_supervise.consensus.monitor import ConsensusMonitor

    from ..processes.attempt import AttemptView
    from ..processes.teardown import TeardownResult
    from ..spec import LaunchSpec
    from .consensus_thread import ConsensusThread, NodeConsensusThread
    from .control_socket import ControlServer

log = structlog.get_logger("supervise")

# GPU telemetry is sampled this often on its own thread (NVML calls cost milliseconds).
GPU_SAMPLE_INTERVAL_S = 1.0
# Teardown's GPU-memory check waits this long for a fresh NVML reading before it gives up on one.
GPU_QUERY_TIMEOUT_S = 1.0
# How long stop() waits for the sampler thread (it may be stuck in a driver call: then it is left behind).
GPU_STOP_JOIN_S = 1.0
CONTROL_DUMP_TIMEOUT_S = 60.0
LIVEZ_MARGIN_S = 30.0
TEXTFILE_TIMEOUT_S = 2.0  # a --metrics-textfile write never holds the main thread longer


class Services:
    def __init__(
        self,
        spec: LaunchSpec,
        run_id: str,
        run_dir: Path,
        post: Callable[[object], None],
        attempt: Callable[[], AttemptView],
        run_key: str | None = None,
    ):
        self.spec = spec
        self.attempt = attempt  # the main thread's latest AttemptView: the consensus threads tag their events with it
        self.run_id = run_id
        self.run_key = run_key or run_id  # names this node's registry entry (several nodes may share a host)
        self._textfile_writer: threading.Thread | None = None
        # /livez: stale only past the longest legitimate pause of the loop (a teardown plus a fatal capture)
        self.liveness = Liveness(stale_after_s=spec.kill_grace + spec.dumps.timeout + LIVEZ_MARGIN_S)
        self.run_dir = run_dir
        self.post = post
        slot_ranks = [spec.rank_offset + i for i in range(spec.nproc_per_node)]
        self.metrics = SupervisorMetrics(run_id, slot_ranks, node=spec.node_rank)
        self.health = HealthCell(HealthStatus.for_state(engine_state.EngineState.STARTING, "starting"))
        self.http: HealthServer | None = None
        if spec.metrics.addr is not None:
            self.http = HealthServer(
                self.metrics, self.health, spec.metrics.addr[0], spec.metrics.addr[1], liveness=self.liveness
            )
        self.health_http: HealthServer | None = None
        if spec.metrics.health_addr is not None:
            self.health_http = HealthServer(
                self.metrics,
                self.health,
                spec.metrics.health_addr[0],
                spec.metrics.health_addr[1],
                liveness=self.liveness,
                serve_metrics=False,
            )
        self.gpu = GpuSampler(GPU_SAMPLE_INTERVAL_S)
        self._gpu_seen = 0  # seq of the last reading put into the metrics
        self._gpu_unverified_logged = False
        self.consensus_monitor: ConsensusMonitor | None = None
        self.relay_counts: Callable[[], Mapping[str, int]] | None = None  # the relay's counts (built-in engine)
        self.consensus_thread: ConsensusThread | None = None
        self.node_consensus: NodeConsensusThread | None = None
        if spec.consensus != "off":
            self._init_consensus()
        self.control: ControlServer | None = None
        # `supervise status`: answered on the control socket's thread from what the other threads publish
        self.status = StatusBoard(
            self.run_id, spec.node_rank, run_dir / "heartbeat", attempt, self.gpu, control_path=run_dir / "control"
        )
        self.metrics.set_engine_state(engine_state.EngineState.STARTING)

    def _init_consensus(self) -> None:
        from tp_supervise.consensus.monitor import ConsensusMonitor

        from .consensus_thread import ConsensusThread

        self.consensus_monitor = ConsensusMonitor(self.run_dir, self.spec.nproc_per_node)
        self.consensus_thread = ConsensusThread(self.consensus_monitor, self.post, self.attempt)

    def compare_across_nodes(self, group) -> None:
        """Multi-node: also compare this node's agreed steps with the other nodes' (consensus.across_nodes)."""
        if self.consensus_monitor is None or group.nnodes < 2:
            return
        from ..nodes import store as stores
        from .consensus_thread import NodeConsensusThread

        def connect():
            store = stores.client(group.connect_addr)
            store.latency.attach(self.metrics.observe_store_latency)  # supervise_store_latency_seconds too
            return store

        self.node_consensus = NodeConsensusThread(
            self.consensus_monitor,
            connect,
            group.node_rank,
            group.nnodes,
            self.spec.nproc_per_node,
            self.post,
            self.attempt,
        )

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.gpu.start()
        if self.http is not None:
            self.http.start()
            log.info("metrics and health", url=self.http.url, endpoints="/metrics /healthz /readyz /livez")
        if self.health_http is not None:
            self.health_http.start()
            log.info("health endpoints", url=self.health_http.url, endpoints="/healthz /readyz /livez")
        from .control_socket import ControlServer

        self.control = ControlServer(
            self.run_key,
            self._control_request,
            {
                "metrics": self.metrics_url,
                "dump_dir": str(self.spec.dumps.dir.resolve()),
                "run_dir": str(self.run_dir),
            },
        )
        self.control.start()
        if self.consensus_thread is not None:
            self.consensus_thread.start()
        if self.node_consensus is not None:
            self.node_consensus.start()

    def stop(self) -> None:
        if self.consensus_thread is not None:
            self.consensus_thread.stop()
        if self.node_consensus is not None:
            self.node_consensus.stop()
        if self.control is not None:
            self.control.close()
        self.status.close()
        if self.http is not None:
            self.http.stop()
        if self.health_http is not None:
            self.health_http.stop()
        self.gpu.stop(GPU_STOP_JOIN_S)

    @property
    def metrics_url(self) -> str | None:
        return None if self.http is None else self.http.url

    # ------------------------------------------------------------ rank env
    def rank_env(self, slot: int | None) -> dict[str, str]:
        """Extra environment for one rank (the user's own values win)."""
        env: dict[str, str] = {}
        run_dir = self.run_dir
        try:
            from ..rank import flight

            env.update(flight.rank_env(run_dir, slot if slot is not None else -1))
        except ImportError:
            pass
        if self.spec.consensus != "off" or self.spec.consensus_inband:
            from ..rank.channel import rank_env as consensus_env

            env.update(
                consensus_env(
                    run_dir,
                    slot if slot is not None else -1,
                    self.spec.consensus,
                    inband_every=self.spec.consensus_inband,
                )
            )
        return env

    # ------------------------------------------------------------ events
    def on_state(self, state: engine_state.EngineState) -> None:
        self.status.set_state(state)
        self.metrics.set_engine_state(state)
        self.metrics.set_incident_open(engine_state.is_fault(state) or state is engine_state.EngineState.SUSPECT)
        self.health.set(HealthStatus.for_state(state, detail=state.value))
        if engine_state.is_fault(state) or state is engine_state.EngineState.STOPPED:
            self.write_textfile()

    def write_textfile(self) -> None:
        """--metrics-textfile: the exposition, written atomically on a helper thread with a deadline (a hung
        disk never holds the main thread)."""
        path = self.spec.metrics.textfile
        if path is None:
            return
        from prometheus_client import write_to_textfile

        def write() -> None:
            try:
                write_to_textfile(str(path), self.metrics.registry)
            except OSError as exc:
                log.warning("metrics textfile not written", path=str(path), error=repr(exc))

        if self._textfile_writer is not None and self._textfile_writer.is_alive():
            log.warning("metrics textfile write skipped: the previous write is still blocked", path=str(path))
            return
        # fire and forget (at most one writer): a fault transition never waits on the disk
        self._textfile_writer = threading.Thread(target=write, name="metrics-textfile", daemon=True)
        self._textfile_writer.start()

    def flush_textfile(self) -> None:
        """At exit: give the last write up to TEXTFILE_TIMEOUT_S to land."""
        if self._textfile_writer is not None:
            self._textfile_writer.join(TEXTFILE_TIMEOUT_S)

    def on_ready(self, ranks: int) -> None:
        spec = self.spec
        if spec.builtin:
            url = f"http://{spec.engine.host}:{spec.engine.port}"
            example = (
                f"curl -s {url}/v1/completions -H 'Content-Type: application/json' "
                '-d \'{"prompt": "Hello", "max_tokens": 16}\''
            )
            log.info("engine ready", url=url, metrics=self.metrics_url, try_it=example)
            logs.write(sys.stdout, f"ready: {example}\n")
        else:
            log.info("every rank is ready", ranks=ranks, metrics=self.metrics_url)

    def on_straggler_report(self, report: StragglerReport) -> None:
        """Runs on the straggler thread."""
        self.status.set_straggler_report(report)
        self.metrics.observe_stragglers(report)

    def on_tick(self, snaps: Sequence[SlotSnapshot], verdict, now: float, alive: Mapping[int, bool]) -> None:
        """Runs on the watchdog thread; ``alive``: slot → whether its process is alive."""
        self.metrics.observe_ranks(snaps, now, alive)
        self.metrics.observe_control(verdict.control, now)
        self.metrics.set_watchdog(
            soft=verdict.soft_timeout,
            hard=verdict.hard_timeout,
            startup=self.spec.watchdog.startup_timeout,
            stalled_s=verdict.stalled_s,
        )
        if self.consensus_monitor is not None:
            comparisons, mismatches = self.consensus_monitor.counts()
            self.metrics.set_consensus_counts(comparisons, mismatches)
        if self.relay_counts is not None:
            self.metrics.set_relay_counts(self.relay_counts())
        reading = self.gpu.latest()  # the cache only: NVML is called on the gpu-sampler thread
        if reading is not None and reading.seq != self._gpu_seen:
            self._gpu_seen = reading.seq
            self.metrics.observe_gpus(reading.samples)

    def on_hang(self, kind: str) -> None:
        self.metrics.record_hang(kind)

    def on_divergence(self) -> None:
        self.metrics.record_divergence()

    def on_rank_exit(self, reason: str) -> None:
        self.metrics.record_rank_exit(reason)

    def on_restart(self) -> None:
        self.metrics.record_restart()

    def on_dump(self, reason: str, ok: bool, duration_s: float) -> None:
        self.metrics.record_dump(reason, ok, duration_s)

    def on_teardown(self, result: TeardownResult) -> None:
        self.metrics.record_teardown(result.duration_s, result.complete)

    def linger(self, seconds: float, interrupt, until_scraped: bool = False) -> None:
        """Keep /metrics up after the incident so Prometheus scrapes its last counts.

        ``until_scraped`` (the default linger): only while a scraper exists, i.e. not at all when /metrics was
        never scraped in this run, else until the first scrape of the final state, at most ``seconds``."""
        self.flush_textfile()
        if self.http is None or seconds <= 0:
            return
        scrapes = self.http.scrapes
        if until_scraped and scrapes.count == 0:
            log.info("metrics linger skipped: /metrics was never scraped in this run", url=self.metrics_url)
            return
        log.info(
            "metrics stay up before exit",
            seconds=seconds,
            url=self.metrics_url,
            until="the first scrape of the final state" if until_scraped else "the time is up",
            skip="a second Ctrl-C ends it",
        )
        if not until_scraped:
            interrupt.wait(seconds)
            return
        began = time.monotonic()
        if scrapes.wait_after(began, seconds, interrupt):
            log.info("final metrics scraped", waited_s=round(time.monotonic() - began, 3))

    def settle_consensus(self, now: float) -> list:
        """Divergences still in flight (a rank that died mid-step, e.g. gloo
        aborting on a batch of another size): the root cause of what follows."""
        if self.consensus_monitor is None:
            return []
        return self.consensus_monitor.settle(now)

    def divergences_posted(self, attempt: int) -> list:
        """What the consensus thread already posted for ``attempt`` (DivergenceFound events)."""
        return self.consensus_thread.posted(attempt) if self.consensus_thread is not None else []

    def gpu_holders(self, pids: set[int]) -> list[tuple[int, int, int | None]]:
        """Teardown's check: which of ``pids`` still hold GPU memory, from a fresh
        NVML reading waited for at most ``GPU_QUERY_TIMEOUT_S`` (none: [] and a warning)."""
        samples = self.gpu.fresh(GPU_QUERY_TIMEOUT_S)
        if samples is None:
            if not self._gpu_unverified_logged:
                self._gpu_unverified_logged = True
                log.warning(
                    "GPU memory release not verified: NVML gave no fresh reading in time",
                    timeout_s=GPU_QUERY_TIMEOUT_S,
                    reason=self.gpu.reason or "a driver call is not returning",
                )
            return []
        return holding_memory(samples, pids) if pids else []

    def gpu_check(self) -> Callable[[set[int]], list[tuple[int, int, int | None]]] | None:
        """What teardown calls to verify GPU memory was released; None without NVML, or
        while the sampler is stuck in a driver call (teardown then does not wait on it)."""
        if not self.gpu.available or self.gpu.wedged(GPU_QUERY_TIMEOUT_S):
            return None
        return self.gpu_holders

    # ------------------------------------------------------------ control
    def _control_request(self, request: dict) -> dict:
        """Runs on a control-socket thread: ``status`` is answered here (read-only sources, so it answers
        while the main loop is busy); anything else is handed to the main loop, whose reply it waits for."""
        if request.get("cmd") == "status":
            return {"ok": True, "status": self.status.snapshot()}
        box: queue.SimpleQueue = queue.SimpleQueue()
        self.post(ControlRequest(request, box))
        try:
            return box.get(timeout=CONTROL_DUMP_TIMEOUT_S)
        except queue.Empty:
            return {"ok": False, "error": f"no reply within {CONTROL_DUMP_TIMEOUT_S:.0f} s"}
