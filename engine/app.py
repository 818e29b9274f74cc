"""Bootstrap and lifecycle of one engine rank.

Order: logging -> torch threads -> process groups -> this rank's weights ->
(rank 0) HTTP frontend bound -> control plane set up -> one startup broadcast
from rank 0 (ok / error, plan port; also a barrier) -> ``ready()`` -> loop ->
clean shutdown.

Shutdown: SIGTERM/SIGINT only hand off (the bridge wakes rank 0's loop, which
stops accepting, tells the workers, answers in-flight requests with an error
and returns).  A guard thread sees the signal through ``signal.set_wakeup_fd``
even while the main thread is blocked inside a collective; on rank 0 it stops
the frontend from accepting and answers every request in flight with a 503
at once (the loop may never come back), and it hard-exits with
``FORCED_EXIT_CODE`` if the clean path has not finished within
``SHUTDOWN_GRACE_S`` (e.g. a peer is gone and a collective never returns).

Group failure: an exception out of rank 0's loop (a collective raised because
a peer died, an injected crash) first answers every request in flight with a
503 naming the incident (engine/server.py ``fail_group``), then propagates
(``__main__`` prints it and exits 1).  The same happens when startup fails
after the frontend started accepting.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading

from tp_supervise.supervisor.rank.heartbeat import RENDEZVOUS_PHASE
from tp_supervise.supervisor.rank.listen import RELAY_URL_ENV, ListenError, take_listen_socket

from . import instrument
from .args import DistEnv, EngineConfig
from .log import configure as configure_logging
from .log import get_logger
from .model_config import ModelConfig

READY_PREFIX = "engine ready: "
SUBSCRIBE_TIMEOUT_S = 60.0
SHUTDOWN_GRACE_S = 5.0
STOP_ANSWER_WAIT_S = 2.0  # after a shutdown signal, how long the main path waits for the guard thread's 503s
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
        self._on_signal_thread = None  # called from the guard thread when a signal arrives
        self._done = threading.Event()
        self._answered = threading.Event()  # the guard thread's callback returned (or there was none)
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

    def set_thread_callback(self, on_signal) -> None:
        """``on_signal(signal_name)`` runs in the guard thread, even while the main thread is blocked."""
        self._on_signal_thread = on_signal

    def _handler(self, signum, _frame) -> None:
        self.requested = True
        if self._on_request is not None:
            self._on_request(f"received {signal.Signals(signum).name}")

    def _watch(self) -> None:
        wanted = {int(s) for s in SHUTDOWN_SIGNALS}
        while True:
            select.select([self._rfd], [], [])
            data = os.read(self._rfd, 64)
            got = [b for b in data if b in wanted]
            if got:
                break
        callback = self._on_signal_thread
        if callback is not None:
            try:
                callback(signal.Signals(got[0]).name)
            except Exception as exc:  # the hard-exit deadline below must still hold
                log.error("stop serving failed", error=repr(exc)[:300])
        self._answered.set()
        if not self._done.wait(self.grace_s):
            print(
                f"engine: clean shutdown did not finish within {self.grace_s} s; exiting", file=sys.stderr, flush=True
            )
            os._exit(FORCED_EXIT_CODE)

    def done(self) -> None:
        self._done.set()

    def wait_answered(self, timeout_s: float) -> None:
        """After a signal ended the loop: let the guard thread finish its callback (the 503s and their log
        line) before the frontend is stopped and the process leaves, at most ``timeout_s``."""
        if self.requested and self._on_signal_thread is not None:
            self._answered.wait(timeout_s)


def _print_ready(cfg: EngineConfig, host: str, port: int, world_size: int) -> None:
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    relay = os.environ.get(RELAY_URL_ENV)  # clients reach rank 0 through the supervisor's relay (supervisor/relay/)
    where = f" (through the relay; rank 0 serves {url})" if relay else ""
    url = relay or url
    print(
        f"{READY_PREFIX}{url}{where} (model {cfg.model_name}, tp {world_size}, control plane {cfg.control_plane}, "
        f"device {cfg.device})",
        flush=True,
    )
    print(
        f"  try: curl -s {url}/v1/completions -H 'Content-Type: application/json' "
        '-d \'{"prompt": "Hello", "max_tokens": 16}\'',
        flush=True,
    )


class _Listen:
    """The inherited listening socket of rank 0, or why it cannot be used (supervisor/rank/listen.py)."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.error = ""


def run(cfg: EngineConfig, dist_env: DistEnv, model_cfg: ModelConfig) -> int:
    configure_logging(dist_env.rank)
    instrument.configure_trace(cfg.trace_events, dist_env.rank)
    # before anything can start a child: the listen variables are for this process only
    listen = _Listen()
    try:
        listen.sock = take_listen_socket(os.environ, os.getpid(), use=dist_env.rank == 0)
    except ListenError as exc:
        listen.error = str(exc)
    guard = ShutdownGuard(SHUTDOWN_GRACE_S)
    guard.install(None)
    try:
        return _run(cfg, dist_env, model_cfg, guard, listen)
    finally:
        guard.done()


def _run(cfg: EngineConfig, dist_env: DistEnv, model_cfg: ModelConfig, guard: ShutdownGuard, listen: _Listen) -> int:
    import torch

    from .bridge import EngineBridge
    from .chat_api import load_chat_template
    from .comm import TPComm, destroy_groups, init_groups
    from .inject import FaultInjector
    from .loops import BroadcastLeader, BroadcastWorker, ReplicatedRank
    from .model import LlamaShard
    from .planes import PlanPublisher, PlanSubscriber, RequestExchange, StartupStatus, WireError, startup_exchange
    from .runfiles import InflightFile, InflightRequests, attempt_from, inflight_path
    from .runner import ModelRunner
    from .scheduler import Scheduler, SchedulerConfig
    from .server import Frontend, FrontendSpec, ServingLimits
    from .sharding import plan_shards
    from .tokenizer import load_tokenizer
    from .weights import load_weights, random_weights

    rank, world = dist_env.rank, dist_env.world_size
    threads = cfg.threads or max(1, _cpu_count() // dist_env.local_world_size)
    torch.set_num_threads(threads)
    if cfg.device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() <= dist_env.local_rank:
            print(
                f"engine: error: --device cuda but CUDA device {dist_env.local_rank} is not available",
                file=sys.stderr,
                flush=True,
            )
            return DEVICE_EXIT_CODE
        torch.cuda.set_device(dist_env.local_rank)
        device = torch.device("cuda", dist_env.local_rank)
    else:
        device = torch.device("cpu")
    dtype = getattr(torch, cfg.dtype)

    instrument.phase(RENDEZVOUS_PHASE)
    poisoned = any(i.kind == "poison" and i.rank == rank for i in cfg.injections)
    tokenizer = load_tokenizer(cfg.model_dir, model_cfg.vocab_size) if rank == 0 or poisoned else None
    injector = FaultInjector(cfg.injections, rank, decode=tokenizer.decode if poisoned and tokenizer else None)
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
    log.info(
        "shard loaded",
        tp=world,
        threads=threads,
        device=str(device),
        dtype=cfg.dtype,
        params_total=model_cfg.num_params,
        model=cfg.model_name,
    )

    broadcast = cfg.control_plane == "broadcast"
    bridge = frontend = publisher = subscriber = None
    inflight = InflightRequests(None)
    status: StartupStatus | None = None
    if rank == 0:
        bridge = EngineBridge()
        spec = FrontendSpec(
            model_name=cfg.model_name,
            max_context=cfg.max_context,
            vocab_size=model_cfg.vocab_size,
            host=cfg.host,
            port=cfg.port,
            seed=cfg.seed,
            run_dir=cfg.run_dir,
            limits=ServingLimits(
                max_waiting=cfg.max_waiting,
                read_timeout_s=cfg.read_timeout,
                max_prompt_tokens=cfg.max_prompt_tokens or cfg.max_context - 1,
            ),
        )
        frontend = Frontend(
            bridge, tokenizer, spec, chat_template=load_chat_template(cfg.model_dir), listen_sock=listen.sock
        )
        status = {"ok": True, "error": "", "plan_port": None}
        if listen.error:
            status = {
                "ok": False,
                "error": f"HTTP frontend cannot use the inherited socket: {listen.error}",
                "plan_port": None,
            }
        else:
            try:
                frontend.start()
            except OSError as exc:
                where = "the inherited socket" if listen.sock is not None else f"{cfg.host}:{cfg.port}"
                status = {"ok": False, "error": f"HTTP frontend cannot listen on {where}: {exc}", "plan_port": None}
        if status["ok"] and broadcast and world > 1:
            publisher = PlanPublisher("127.0.0.1" if dist_env.single_node else "*")
            status["plan_port"] = publisher.port
        if status["ok"] and cfg.run_dir:
            try:
                inflight = InflightRequests(
                    InflightFile(inflight_path(cfg.run_dir, rank), cfg.max_batch, attempt_from(os.environ))
                )
            except OSError as exc:  # serving matters more than the record
                log.warning("in-flight record unavailable", run_dir=cfg.run_dir, error=str(exc)[:200])
        guard.set_thread_callback(frontend.stop_serving_on_signal)
    try:
        status = startup_exchange(control_group, rank, world, status)
        if not status["ok"]:
            log.error("startup failed", error=status["error"])
            print(f"engine: error: {status['error']}", file=sys.stderr, flush=True)
            if frontend is not None:
                frontend.fail_group(str(status["error"]))
            destroy_groups()
            return STARTUP_FAILED_EXIT_CODE
        if broadcast and rank > 0:
            host = "127.0.0.1" if dist_env.single_node else dist_env.master_addr
            if status["plan_port"] is None:
                raise WireError("rank 0 announced no plan port for the broadcast plane")
            subscriber = PlanSubscriber(host, status["plan_port"])
        if publisher is not None and not publisher.wait_subscribers(world - 1, SUBSCRIBE_TIMEOUT_S):
            log.error("workers did not subscribe to the plan channel", timeout_s=SUBSCRIBE_TIMEOUT_S)
            if frontend is not None:
                frontend.fail_group("workers did not subscribe to the plan channel")
            return STARTUP_FAILED_EXIT_CODE

        sched_cfg = SchedulerConfig(cfg.max_batch, cfg.max_batch_tokens, cfg.max_context, model_cfg.eos_token_ids)
        loop: BroadcastLeader | BroadcastWorker | ReplicatedRank
        if broadcast and rank == 0:
            if bridge is None:
                raise RuntimeError("rank 0 has no request bridge")
            loop = BroadcastLeader(runner, Scheduler(sched_cfg), bridge, publisher, injector, inflight)
        elif broadcast:
            if subscriber is None:
                raise RuntimeError(f"rank {rank} has no plan subscriber")
            loop = BroadcastWorker(runner, subscriber, injector)
        else:
            exchange = RequestExchange(control_group, rank, world)
            loop = ReplicatedRank(
                rank, runner, Scheduler(sched_cfg), exchange, comm, injector, bridge, cfg.sync_token_ids, inflight
            )
        if bridge is not None:
            guard.set_callback(bridge.request_shutdown)
        instrument.ready()
        if frontend is not None:  # rank 0
            _print_ready(cfg, frontend.host, frontend.port, world)
        log.info(
            "serving",
            control_plane=cfg.control_plane,
            injections=[str(i) for i in injector.injections],
            inherited_socket=listen.sock is not None,
        )
        with torch.inference_mode():
            loop.run()
    except BaseException as exc:
        if frontend is not None:
            frontend.fail_group(f"{type(exc).__name__}: {exc}")
        raise
    log.info("shutting down")
    guard.wait_answered(STOP_ANSWER_WAIT_S)
    if frontend is not None:
        frontend.stop()
    for channel in (publisher, subscriber):
        if channel is not None:
            channel.close()
    destroy_groups()
    instrument.finished()
    return 0
