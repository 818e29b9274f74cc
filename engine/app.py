"""Bootstrap and lifecycle of one engine rank.

Order: logging -> torch threads -> process groups -> this rank's weights ->
(rank 0) HTTP frontend bound -> control plane set up -> one startup broadcast
from rank 0 (ok / error, plan port; also a barrier) -> ``ready()`` -> loop ->
clean shutdown.

Shutdown: SIGTERM/SIGINT only hand off (the bridge wakes rank 0's loop, which
stops accepting, tells the workers, answers in-flight requests with an error
and returns).  A guard thread sees the signal through ``signal.set_wakeup_fd``
even while the main thread is blocked inside a collective, and hard-exits
with ``FORCED_EXIT_CODE`` if the clean path has not finished within
``SHUTDOWN_GRACE_S`` (e.g. a peer is gone and a collective never returns).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading

from tp_supervise.supervisor.rank.heartbeat import RENDEZVOUS_PHASE

from . import instrument
from .args import DistEnv, EngineConfig
from .log import configure as configure_logging
from .log import get_logger
from .model_config import ModelConfig

READY_PREFIX = "engine ready: "
SUBSCRIBE_TIMEOUT_S = 60.0
SHUTDOWN_GRACE_S = 5.0
FORCED_EXIT_CODE = 1
STARTUP_FAILED_EXIT_CODE = 1
DEVICE_EXIT_CODE = 2
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)

log = get_logger()


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class ShutdownGuard:
    """SIGTERM/SIGINT hand-off plus the hard-exit deadline behind it."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.requested = False
        self._on_request = None
        self._done = threading.Event()
        self._rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        self._wfd = wfd
        self._thread = threading.Thread(target=self._watch, name="engine-shutdown-guard", daemon=True)

    def install(self, on_request) -> None:
        self._on_request = on_request
        for sig in SHUTDOWN_SIGNALS:
            signal.signal(sig, self._handler)
        signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        self._thread.start()

    def set_callback(self, on_request) -> None:
        self._on_request = on_request
        if self.requested and on_request is not None:
            on_request("shutdown requested during startup")

    def _handler(self, signum, _frame) -> None:
        self.requested = True
        if self._on_request is not None:
            self._on_request(f"received {signal.Signals(signum).name}")

    def _watch(self) -> None:
        wanted = {int(s) for s in SHUTDOWN_SIGNALS}
        while True:
            select.select([self._rfd], [], [])
            data = os.read(self._rfd, 64)
            if any(b in wanted for b in data):
                break
        if not self._done.wait(self.grace_s):
            print(f"engine: clean shutdown did not finish within {self.grace_s} s; exiting",
                  file=sys.stderr, flush=True)
            os._exit(FORCED_EXIT_CODE)

    def done(self) -> None:
        self._done.set()


def _print_ready(cfg: EngineConfig, port: int, world_size: int) -> None:
    host = "127.0.0.1" if cfg.host in ("", "0.0.0.0", "::") else cfg.host
    url = f"http://{host}:{port}"
    print(f"{READY_PREFIX}{url} (model {cfg.model_name}, tp {world_size}, control plane {cfg.control_plane}, "
          f"device {cfg.device})", flush=True)
    print(f"  try: curl -s {url}/v1/completions -H 'Content-Type: application/json' "
          "-d '{\"prompt\": \"Hello\", \"max_tokens\": 16}'", flush=True)


def run(cfg: EngineConfig, dist_env: DistEnv, model_cfg: ModelConfig) -> int:
    configure_logging(dist_env.rank)
    instrument.configure_trace(cfg.trace_events, dist_env.rank)
    guard = ShutdownGuard(SHUTDOWN_GRACE_S)
    guard.install(None)
    try:
        return _run(cfg, dist_env, model_cfg, guard)
    finally:
        guard.done()


def _run(cfg: EngineConfig, dist_env: DistEnv, model_cfg: ModelConfig, guard: ShutdownGuard) -> int:
    import torch

    from .bridge import EngineBridge
    from .comm import TPComm, destroy_groups, init_groups
    from .core import BroadcastLeader, BroadcastWorker, ReplicatedRank
    from .inject import FaultInjector
    from .model import LlamaShard
    from .planes import PlanPublisher, PlanSubscriber, RequestExchange, startup_exchange
    from .runner import ModelRunner
    from .scheduler import Scheduler, SchedulerConfig
    from .server import Frontend, ServingLimits
    from .sharding import plan_shards
    from .tokenizer import load_tokenizer
    from .weights import load_weights, random_weights

    rank, world = dist_env.rank, dist_env.world_size
    threads = cfg.threads or max(1, _cpu_count() // dist_env.local_world_size)
    torch.set_num_threads(threads)
    if cfg.device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() <= dist_env.local_rank:
            print(f"engine: error: --device cuda but CUDA device {dist_env.local_rank} is not available",
                  file=sys.stderr, flush=True)
            return DEVICE_EXIT_CODE
        torch.cuda.set_device(dist_env.local_rank)
        device = torch.device("cuda", dist_env.local_rank)
    else:
        device = torch.device("cpu")
    dtype = getattr(torch, cfg.dtype)

    instrument.phase(RENDEZVOUS_PHASE)
    injector = FaultInjector(cfg.injections, rank)
    model_group, control_group = init_groups(dist_env, cfg.device)
    instrument.phase("load")
    shard = plan_shards(model_cfg, world, rank)
    if cfg.model_dir:
        weights = load_weights(cfg.model_dir, model_cfg, shard, dtype, device)
    else:
        weights = random_weights(model_cfg, shard, cfg.seed, dtype, device)
    comm = TPComm(model_group, world, injector)
    model = LlamaShard(model_cfg, shard, weights, comm, cfg.max_context, device, dtype, max_seqs=cfg.max_batch)
    runner = ModelRunner(model, injector)
    log.info("shard loaded", tp=world, threads=threads, device=str(device), dtype=cfg.dtype,
             params_total=model_cfg.num_params, model=cfg.model_name)

    broadcast = cfg.control_plane == "broadcast"
    bridge = frontend = publisher = subscriber = None
    status = None
    if rank == 0:
        bridge = EngineBridge()
        tokenizer = load_tokenizer(cfg.model_dir, model_cfg.vocab_size)
        frontend = Frontend(bridge, tokenizer, model_name=cfg.model_name, max_context=cfg.max_context,
                            vocab_size=model_cfg.vocab_size, host=cfg.host, port=cfg.port, seed=cfg.seed,
                            limits=ServingLimits(max_waiting=cfg.max_waiting, read_timeout_s=cfg.read_timeout,
                                                 max_prompt_tokens=cfg.max_prompt_tokens or cfg.max_context - 1))
        status = {"ok": True, "error": "", "plan_port": None}
        try:
            frontend.start()
        except OSError as exc:
            status = {"ok": False, "error": f"HTTP frontend cannot listen on {cfg.host}:{cfg.port}: {exc}",
                      "plan_port": None}
        if status["ok"] and broadcast and world > 1:
            publisher = PlanPublisher("127.0.0.1" if dist_env.single_node else "*")
            status["plan_port"] = publisher.port
    status = startup_exchange(control_group, rank, world, status)
    if not status["ok"]:
        log.error("startup failed", error=status["error"])
        print(f"engine: error: {status['error']}", file=sys.stderr, flush=True)
        destroy_groups()
        return STARTUP_FAILED_EXIT_CODE
    if broadcast and rank > 0:
        host = "127.0.0.1" if dist_env.single_node else dist_env.master_addr
        subscriber = PlanSubscriber(host, status["plan_port"])
    if publisher is not None and not publisher.wait_subscribers(world - 1, SUBSCRIBE_TIMEOUT_S):
        log.error("workers did not subscribe to the plan channel", timeout_s=SUBSCRIBE_TIMEOUT_S)
        return STARTUP_FAILED_EXIT_CODE

    sched_cfg = SchedulerConfig(cfg.max_batch, cfg.max_batch_tokens, cfg.max_context, model_cfg.eos_token_ids)
    if broadcast:
        loop = (BroadcastLeader(runner, Scheduler(sched_cfg), bridge, publisher, injector) if rank == 0
                else BroadcastWorker(runner, subscriber, injector))
    else:
        exchange = RequestExchange(control_group, rank, world)
        loop = ReplicatedRank(rank, runner, Scheduler(sched_cfg), exchange, comm, injector, bridge,
                              cfg.sync_token_ids)
    if bridge is not None:
        guard.set_callback(bridge.request_shutdown)
    instrument.ready()
    if rank == 0:
        _print_ready(cfg, frontend.port, world)
    log.info("serving", control_plane=cfg.control_plane, injections=[str(i) for i in injector.injections])
    with torch.inference_mode():
        loop.run()
    log.info("shutting down")
    if frontend is not None:
        frontend.stop()
    for channel in (publisher, subscriber):
        if channel is not None:
            channel.close()
    destroy_groups()
    instrument.finished()
    return 0
