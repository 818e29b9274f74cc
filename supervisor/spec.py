"""What to launch: a frozen, self-validating description of a supervised run.

``LaunchSpec`` checks the arithmetic (node rank, world size, timeouts) on
construction; ``preflight`` checks the world (executable, ports, dump dir,
GPUs) before anything is started.  Both raise ``UsageError`` whose message
names the flag and the fix; the CLI turns it into exit code 64.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tp_supervise.watchdogs.straggler import StragglerConfig

from .outcome import valid_run_id
from .rank.engines import BY_NAME
from .rank.engines.launcher_flags import (
    EngineLaunch,
    LaunchFlagError,
    engine_launch,
    launcher_engine,
    launcher_metrics_url,
    launcher_nproc,
)

CONSENSUS_MODES = ("off", "observe", "enforce")
STACK_METHODS = ("auto", "py-spy", "faulthandler", "none")
DEFAULT_BUILTIN_TP = 2
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_KILL_GRACE_S = 5.0
DEFAULT_DUMP_TIMEOUT_S = 10.0  # a fatal dump never delays the teardown longer than this
# After a fault, /metrics stays up this long: two scrapes of docs/prometheus/prometheus.yml (5 s) and a
# margin, so the final counts (a hang, a death, a divergence) reach Prometheus with default flags.
DEFAULT_FAULT_LINGER_S = 11.0
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0  # multi-node: every node must have registered by then (exit 83)
DEFAULT_STRAGGLER_THRESHOLD = 0.10
DEFAULT_STRAGGLER_WINDOW_S = 20.0
STRAGGLER_ACTIONS = ("dump", "restart", "kill")
DEFAULT_NODE_TIMEOUT_S = 4.0  # multi-node: no FIN (host down, partition, frozen): lost after this
DEFAULT_METRICS_ADDR = "127.0.0.1:9180"
DEFAULT_ENGINE_PORT = 8000
DEFAULT_DUMP_KEEP = 50
DEFAULT_DUMP_MAX_BYTES = 1 << 30
DEFAULT_LOG_MAX_BYTES = 100 << 20  # each --log-dir file, before it is rotated
DEFAULT_QUARANTINE_AFTER = 2  # failed attempts a request must have been scheduled in before it is refused

_INJECT_RE = re.compile(r"^(?P<kind>[a-z_]+)@(?P<rank>\d+)(?::(?P<step>\d+))?$")


class UsageError(ValueError):
    """Invalid invocation; nothing has been started.  Exit code 64."""


@dataclass(frozen=True)
class Injection:
    kind: str
    rank: int
    step: int | None

    def __str__(self) -> str:
        return f"{self.kind}@{self.rank}" + (f":{self.step}" if self.step is not None else "")


def parse_injection(text: str, kinds: Sequence[str]) -> Injection:
    """``KIND@RANK[:STEP]``; ``kinds`` are the engine's fault kinds (the engine owns them)."""
    m = _INJECT_RE.match(text)
    if not m:
        raise UsageError(f"--inject {text!r}: expected KIND@RANK[:STEP], e.g. stop@1 or diverge_token@1:20")
    kind = m.group("kind")
    if kind not in kinds:
        raise UsageError(f"--inject {text!r}: unknown kind {kind!r}; choose one of {', '.join(kinds)}")
    step = m.group("step")
    return Injection(kind, int(m.group("rank")), int(step) if step is not None else None)


def parse_pair(text: str | None, flag: str) -> tuple[float, float] | None:
    """``SOFT,HARD`` seconds."""
    if text is None:
        return None
    soft, sep, hard = text.partition(",")
    try:
        if not sep:
            raise ValueError
        return float(soft), float(hard)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected SOFT,HARD in seconds, e.g. 1.5,3") from None


ALL_INTERFACES = "0.0.0.0"


def parse_hostport(text: str, flag: str, any_host: bool = False) -> tuple[str, int] | None:
    """``HOST:PORT`` (or 'none'); with ``any_host``, ``:PORT`` is every interface (a serving port, as an engine's
    own ``--host`` default; never for the supervisor's own endpoints, which say where they bind)."""
    if text == "none":
        return None
    host, sep, port = text.rpartition(":")
    if any_host and sep and not host:
        host = ALL_INTERFACES
    if not sep or not port.isdigit() or not host:
        raise UsageError(f"{flag} {text!r}: expected HOST:PORT or 'none', e.g. 127.0.0.1:9180")
    value = int(port)
    if not 0 <= value <= 65535:
        raise UsageError(f"{flag} {text!r}: port must be between 0 and 65535")
    return host.strip("[]"), value


STD_NAMES = {1: ("stdout",), 2: ("stderr",), 3: ("stdout", "stderr")}  # torchrun's Std: 0 none, 1, 2, 3 both


@dataclass(frozen=True)
class Std:
    """torchrun's ``--redirects``/``--tee`` value: ``0``-``3`` for every local rank, or per local rank
    (``0:1,1:2``; ranks not named get 0).  1 is stdout, 2 stderr, 3 both."""

    default: int = 0
    per_rank: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, text: str, flag: str) -> Std:
        def value(part: str) -> int:
            if part.strip() not in ("0", "1", "2", "3"):
                raise UsageError(
                    f"{flag} {text!r}: each value is 0 (none), 1 (stdout), 2 (stderr) or 3 (both), e.g. 3 or 0:1,1:2"
                )
            return int(part)

        if ":" not in text:
            return cls(default=value(text))
        per_rank = {}
        for item in text.split(","):
            rank, sep, std = item.partition(":")
            if not sep or not rank.strip().isdigit():
                raise UsageError(f"{flag} {text!r}: expected 0-3, or LOCAL_RANK:VALUE pairs such as 0:1,1:2")
            per_rank[int(rank)] = value(std)
        return cls(per_rank=tuple(sorted(per_rank.items())))

    def streams(self, local_rank: int | None) -> tuple[str, ...]:
        code = dict(self.per_rank).get(local_rank, self.default) if local_rank is not None else self.default
        return STD_NAMES.get(code, ())


def parse_local_ranks(text: str | None, flag: str = "--local-ranks-filter") -> frozenset[int] | None:
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        raise UsageError(f"{flag} {text!r}: expected comma-separated local ranks, e.g. 0 or 0,1")
    return frozenset(int(p) for p in parts)


@dataclass(frozen=True)
class OutputOptions:
    """Where the ranks' stdout/stderr go (supervisor/processes/output_pump.py), with torchrun's flags."""

    log_dir: Path | None = None
    redirects: Std | None = None  # None: not given
    tee: Std | None = None
    local_ranks_filter: frozenset[int] | None = None  # None: every local rank reaches the console
    log_max_bytes: int = DEFAULT_LOG_MAX_BYTES  # each file's cap before rotation; 0: no cap

    def __post_init__(self) -> None:
        if self.log_max_bytes < 0:
            raise UsageError(f"--log-max-bytes {self.log_max_bytes}: must be >= 0 (0: no cap)")
        for flag, value in (("--redirects", self.redirects), ("--tee", self.tee)):
            if value is not None and self.log_dir is None:
                raise UsageError(f"{flag} sends rank output to files: give --log-dir DIR too")

    def route(self, local_rank: int | None, stream: str) -> tuple[bool, bool]:
        """(to a file, to the console) for one stream of one local rank (None: the tree-mode launcher).

        Redirected: the file only; teed: file and console; with --log-dir and neither flag, both streams
        are teed (torchrun would write no file then)."""
        if self.log_dir is None:
            to_file, to_console = False, True
        elif self.redirects is None and self.tee is None:
            to_file, to_console = True, True
        else:
            redirected = self.redirects is not None and stream in self.redirects.streams(local_rank)
            teed = self.tee is not None and stream in self.tee.streams(local_rank)
            to_file, to_console = redirected or teed, teed or not redirected
        if local_rank is not None and self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter:
            to_console = False
        return to_file, to_console

    def check(self, nproc_per_node: int, tree: bool) -> None:
        """Against the launch: local ranks that exist; in tree mode the launcher's output is one stream."""
        named = set(self.local_ranks_filter or ())
        for value in (self.redirects, self.tee):
            named |= {rank for rank, _ in (value.per_rank if value is not None else ())}
        if tree and (self.local_ranks_filter is not None or len(named)):
            raise UsageError(
                "--tree: the launcher's output cannot be split by local rank; give --redirects/--tee "
                "as one value 0-3, and --local-ranks-filter to the launcher itself (torchrun has it)"
            )
        beyond = sorted(r for r in named if r >= nproc_per_node)
        if beyond:
            raise UsageError(
                f"local rank(s) {beyond} named in --redirects/--tee/--local-ranks-filter do not exist: "
                f"--nproc-per-node is {nproc_per_node} (local ranks 0..{nproc_per_node - 1})"
            )


@dataclass(frozen=True)
class EngineOptions:
    """Flags of the built-in engine (used only when no command is given)."""

    device: str = "cpu"
    control_plane: str = "broadcast"
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_ENGINE_PORT
    sync_token_ids: bool = False
    injections: tuple[Injection, ...] = ()
    max_waiting: int | None = None
    read_timeout: float | None = None
    extra_args: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        args = [
            "--device",
            self.device,
            "--control-plane",
            self.control_plane,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.model:
            args += ["--model", self.model]
        if self.sync_token_ids:
            args.append("--sync-token-ids")
        for inj in self.injections:
            args += ["--inject", str(inj)]
        if self.max_waiting is not None:
            args += ["--max-waiting", str(self.max_waiting)]
        if self.read_timeout is not None:
            args += ["--read-timeout", repr(self.read_timeout)]
        return args + list(self.extra_args)


def _positive_seconds(flag: str, value: float | None) -> None:
    if value is not None and not 0 < value < math.inf:
        raise UsageError(f"{flag} {value}: must be a positive, finite number of seconds")


def _one_of(flag: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise UsageError(f"{flag} {value!r}: choose one of {', '.join(choices)}")


@dataclass(frozen=True)
class WatchdogOptions:
    """When no progress is a hang (docs/watchdogs.md): fixed timeouts, or adaptive bounds; other progress
    sources (an engine's own /metrics, for engines whose collectives skip Python)."""

    hard_timeout: float | None = None  # None: adaptive
    soft_timeout: float | None = None
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S
    # Adaptive watchdog bounds (soft, hard) in seconds; None keeps watchdogs/adaptive.py's defaults.
    adaptive_floors: tuple[float, float] | None = None
    adaptive_ceilings: tuple[float, float] | None = None
    engine_metrics_url: str | None = None  # external progress (engines whose collectives skip Python)
    engine_kind: str = "auto"

    def __post_init__(self) -> None:
        _positive_seconds("--hard-timeout", self.hard_timeout)
        _positive_seconds("--soft-timeout", self.soft_timeout)
        _positive_seconds("--startup-timeout", self.startup_timeout)
        if self.soft_timeout is not None and self.hard_timeout is not None and self.soft_timeout >= self.hard_timeout:
            raise UsageError(
                f"--soft-timeout {self.soft_timeout} must be shorter than --hard-timeout {self.hard_timeout} "
                "(the soft watchdog dumps before the hard one kills)"
            )
        for flag, pair in (
            ("--adaptive-floors", self.adaptive_floors),
            ("--adaptive-ceilings", self.adaptive_ceilings),
        ):
            if pair is not None and not (0 < pair[0] <= pair[1] < math.inf):
                raise UsageError(f"{flag} {pair[0]:g},{pair[1]:g}: give SOFT,HARD seconds with 0 < SOFT <= HARD")
        try:
            self.adaptive_params()
        except ValueError as exc:
            raise UsageError(f"--adaptive-floors/--adaptive-ceilings: {exc}") from None
        if self.engine_metrics_url is not None and not self.engine_metrics_url.startswith(("http://", "https://")):
            raise UsageError(
                f"--engine-metrics-url {self.engine_metrics_url!r}: give the engine's Prometheus endpoint, "
                "e.g. http://127.0.0.1:8000/metrics"
            )
        _one_of("--engine-kind", self.engine_kind, ("auto", "vllm", "sglang"))

    def adaptive_params(self):
        """watchdogs.adaptive.AdaptiveParams with the floors/ceilings given (validated there)."""
        from tp_supervise.watchdogs.adaptive import AdaptiveParams

        floors, ceilings = self.adaptive_floors, self.adaptive_ceilings
        if floors is None:
            floors = (AdaptiveParams.soft_floor, AdaptiveParams.hard_floor)
        if ceilings is None:
            ceilings = (AdaptiveParams.soft_ceiling, AdaptiveParams.hard_ceiling)
        return AdaptiveParams(
            soft_floor=floors[0], hard_floor=floors[1], soft_ceiling=ceilings[0], hard_ceiling=ceilings[1]
        )


@dataclass(frozen=True)
class DumpOptions:
    """Incident bundles (docs/bundle.md): where, how many, how long a capture may take, how stacks are read."""

    dir: Path = Path("supervise-dumps")
    timeout: float = DEFAULT_DUMP_TIMEOUT_S  # a fatal dump never delays the teardown longer than this
    keep: int = DEFAULT_DUMP_KEEP
    max_bytes: int = DEFAULT_DUMP_MAX_BYTES
    stack_method: str = "auto"
    native_stacks: bool = False

    def __post_init__(self) -> None:
        _positive_seconds("--dump-timeout", self.timeout)
        if self.keep < 1:
            raise UsageError(f"--dump-keep {self.keep}: must keep at least 1 bundle")
        if self.max_bytes < 1:
            raise UsageError(f"--dump-max-bytes {self.max_bytes}: must be positive")
        _one_of("--stack-method", self.stack_method, STACK_METHODS)


@dataclass(frozen=True)
class MetricsOptions:
    """Prometheus metrics and health (docs/metrics.md)."""

    addr: tuple[str, int] | None = ("127.0.0.1", 9180)
    # /healthz /readyz /livez only (no /metrics), e.g. routable for Kubernetes probes while /metrics stays on
    # loopback; None: health is served on addr only.
    health_addr: tuple[str, int] | None = None
    linger: float | None = None  # None: until the first scrape, at most DEFAULT_FAULT_LINGER_S after a fault
    textfile: Path | None = None  # node_exporter textfile collector: written on every incident and at exit

    def __post_init__(self) -> None:
        if self.linger is not None and not 0 <= self.linger <= 3600:
            raise UsageError(f"--metrics-linger {self.linger}: must be in 0..3600 seconds")


@dataclass(frozen=True)
class StragglerOptions:
    """Slow ranks (docs/watchdogs.md, "Stragglers")."""

    threshold: float | None = DEFAULT_STRAGGLER_THRESHOLD  # share of the group's time; None: off
    sustain: float = DEFAULT_STRAGGLER_WINDOW_S  # sustained this long (busy time) before it is named
    action: str = "dump"  # --on-straggler

    def __post_init__(self) -> None:
        if self.threshold is not None and not 0 < self.threshold < 1:
            raise UsageError(
                f"--straggler-threshold {self.threshold}: a share of the step between 0 and 1 (e.g. 0.1), or 'off'"
            )
        if not 1.0 <= self.sustain < math.inf:
            raise UsageError(f"--straggler-sustain {self.sustain}: must be >= 1 second")
        _one_of("--on-straggler", self.action, STRAGGLER_ACTIONS)

    def config(self) -> StragglerConfig:
        """The detector's parameters: the window of statistics covers the sustain time and 10 s more."""
        return StragglerConfig(
            threshold=self.threshold,
            sustain_s=self.sustain,
            window_s=max(30.0, self.sustain + 10.0),
            clear_s=max(1.0, self.sustain / 2),
        )


@dataclass(frozen=True)
class NodeOptions:
    """What only a run of several nodes uses (docs/multinode.md): node 0's store, the handshake, liveness."""

    store_port: int | None = None  # node 0's TCPStore (default: master_port + 1)
    run_id: str | None = None  # shared by every node; node 0 decides when not given
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT_S
    node_timeout: float = DEFAULT_NODE_TIMEOUT_S  # a silent node (or store) is lost after this
    join_token: str | None = field(default=None, repr=False)  # never logged; compared as an HMAC digest
    fingerprint_env: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.store_port is not None and not 1 <= self.store_port <= 65535:
            raise UsageError(f"--store-port {self.store_port}: must be between 1 and 65535")
        if not 0 < self.rendezvous_timeout < math.inf:
            raise UsageError(f"--rendezvous-timeout {self.rendezvous_timeout}: must be > 0 seconds")
        if self.run_id is not None and not valid_run_id(self.run_id):
            raise UsageError(
                f"--run-id {self.run_id!r}: use 1-48 letters, digits, '.', '_' or '-', no '..' "
                "(it names files and cgroups)"
            )
        if not 0 < self.node_timeout < math.inf:
            raise UsageError(f"--node-timeout {self.node_timeout}: must be > 0 seconds")


DEFAULT_RELAY_HOLD_S = 180.0  # a COMMAND's engine (vLLM on a GPU node: weights, compile, graphs) takes minutes
BUILTIN_RELAY_HOLD_S = 90.0  # the built-in engine is back in seconds
DEFAULT_RELAY_MAX_HELD = 1024
RELAY_ENGINES = ("builtin", "vllm", "openai")


@dataclass(frozen=True)
class RelayOptions:
    """The relay in front of the group (supervisor/relay/; docs/engine.md, "The relay"): for a COMMAND, the public
    address (``--relay``) and the engine's own listener behind it (``upstream``: from the launcher's
    --host/--port, or ``--relay-upstream``); for both, how long and how many requests are held across a restart."""

    address: tuple[str, int] | None = None  # --relay HOST:PORT (a COMMAND); None: no relay for a COMMAND
    upstream: str | None = None  # http://HOST:PORT of the engine's own listener
    engine: str = "openai"  # the relay's adapter for a COMMAND (supervisor/relay/engines.py)
    hold: float | None = None  # None: DEFAULT_RELAY_HOLD_S for a COMMAND, BUILTIN_RELAY_HOLD_S for the built-in
    max_held: int = DEFAULT_RELAY_MAX_HELD

    def __post_init__(self) -> None:
        _positive_seconds("--relay-hold", self.hold)
        if self.max_held < 1:
            raise UsageError(f"--relay-max-held {self.max_held}: must be at least 1")
        _one_of("the relay's engine", self.engine, RELAY_ENGINES)
        if self.address is not None and self.upstream is None:
            raise UsageError(
                "--relay needs the engine's own address: the COMMAND is not a vLLM or SGLang launcher whose "
                "--host/--port say it; give --relay-upstream http://HOST:PORT"
            )
        if self.address is not None and self.upstream is not None:
            up = urllib.parse.urlsplit(self.upstream)
            if up.port == self.address[1] and (up.hostname or "") in (self.address[0], "127.0.0.1", "localhost"):
                raise UsageError(
                    f"--relay {self.address[0]}:{self.address[1]} is the engine's own port ({self.upstream}): "
                    "give the engine another --port; the relay holds the public one"
                )

    def hold_s(self, builtin: bool) -> float:
        if self.hold is not None:
            return self.hold
        return BUILTIN_RELAY_HOLD_S if builtin else DEFAULT_RELAY_HOLD_S


def relay_upstream(given: str | None, command: Sequence[str]) -> tuple[str | None, str]:
    """(URL of the engine's own listener, the relay's adapter) for ``--relay``: ``--relay-upstream`` as given,
    else what a vLLM or SGLang launcher's --host/--port say (the engine's defaults when absent)."""
    engine = launcher_engine(command)
    kind = BY_NAME[engine].RELAY_ADAPTER if engine is not None else "openai"
    if given is not None:
        if not given.startswith(("http://", "https://")):
            given = f"http://{given}"
        parts = urllib.parse.urlsplit(given)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise UsageError(f"--relay-upstream {given!r}: give http://HOST:PORT of the engine's own listener")
        return given.rstrip("/"), kind
    url = launcher_metrics_url(command)
    return (url[: -len("/metrics")] if url else None), kind


@dataclass(frozen=True)
class LaunchSpec:
    """A validated request to supervise one TP group on this node: the launch itself (what, how many, where
    the ranks meet, how they are stopped and restarted), and one options object per concern, each of which
    validates itself; what needs the host (paths, ports, GPUs) is preflight's."""

    command: tuple[str, ...]  # empty: the built-in engine
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port is chosen at launch
    tree: bool = False
    # --tree with an engine's own multi-node launch: node 0's rendezvous as its flags say (host, port) and how many
    # ports it takes from there (supervisor/launcher.py); the supervisors' store keeps clear of them.
    engine_rendezvous: tuple[str, int] | None = None
    engine_rendezvous_span: int = 1
    kill_grace: float = DEFAULT_KILL_GRACE_S
    max_restarts: int = 0
    consensus: str = "observe"
    consensus_inband: int = 0
    # A request scheduled by the failing step of this many failed attempts is refused for the run (0: never);
    # supervisor/incidents/quarantine.py.
    quarantine_after: int = DEFAULT_QUARANTINE_AFTER
    # --listen HOST:PORT: a COMMAND's rank 0 inherits this listening socket the systemd way (LISTEN_FDS)
    listen: tuple[str, int] | None = None
    log_format: str = "console"
    zero_code_hook: bool = True
    watchdog: WatchdogOptions = field(default_factory=WatchdogOptions)
    dumps: DumpOptions = field(default_factory=DumpOptions)
    metrics: MetricsOptions = field(default_factory=MetricsOptions)
    straggler: StragglerOptions = field(default_factory=StragglerOptions)
    nodes: NodeOptions = field(default_factory=NodeOptions)
    engine: EngineOptions = field(default_factory=EngineOptions)
    output: OutputOptions = field(default_factory=OutputOptions)
    relay: RelayOptions = field(default_factory=RelayOptions)

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise UsageError(f"--nnodes {self.nnodes}: must be at least 1")
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node {self.nproc_per_node}: must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank {self.node_rank} is outside [0, {self.nnodes}) for --nnodes {self.nnodes}: "
                "set it to this node's zero-based index"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise UsageError(f"--master-port {self.master_port}: must be between 1 and 65535")
        if self.nnodes > 1 and self.master_port is None:
            raise UsageError(
                f"--nnodes {self.nnodes} needs --master-port: every node must use the same rendezvous port "
                "(a free port picked on each node would never meet)"
            )
        store = self.resolved_store_port
        if self.nnodes > 1 and self.engine_rendezvous is not None and store is not None:
            first = self.engine_rendezvous[1]
            if first <= store < first + self.engine_rendezvous_span:
                taken = (
                    f"{first}"
                    if self.engine_rendezvous_span == 1
                    else f"{first}-{first + self.engine_rendezvous_span - 1}"
                )
                raise UsageError(
                    f"the supervisors' store port {store} is taken by the engine's own rendezvous (port {taken} "
                    f"at {self.engine_rendezvous[0]}): give --store-port another port, e.g. {first + self.engine_rendezvous_span}"
                )
        if self.nnodes > 1 and self.master_port is not None and self.resolved_store_port == self.master_port:
            raise UsageError(
                f"--store-port {self.nodes.store_port} is the ranks' --master-port: the supervisors' store "
                "and the ranks' rendezvous need different ports"
            )
        if not 0 <= self.kill_grace < math.inf:
            raise UsageError(f"--kill-grace {self.kill_grace}: must be >= 0 seconds")
        _one_of("--consensus", self.consensus, CONSENSUS_MODES)
        if self.consensus_inband < 0:
            raise UsageError("--consensus-inband N: N must be >= 0 (0 disables the in-band check)")
        if self.quarantine_after < 0:
            raise UsageError(f"--quarantine-after {self.quarantine_after}: must be >= 0 (0 never quarantines)")
        if self.listen is not None and (not self.command or self.tree):
            raise UsageError(
                "--listen hands a listening socket to a COMMAND's rank 0 (spawn mode); the built-in "
                "engine's socket is --host/--port, and in --tree mode the ranks are the launcher's"
            )
        if self.relay.address is not None and not self.command:
            raise UsageError(
                "--relay is for a COMMAND's engine; the built-in engine's relay already holds --host/--port"
            )
        if self.relay.address is not None and self.listen is not None:
            raise UsageError("--relay and --listen both take the public port: give one of them")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts {self.max_restarts}: must be >= 0")
        _one_of("--log-format", self.log_format, ("console", "json"))
        self.output.check(self.nproc_per_node, self.tree)
        if self.tree and not self.command:
            raise UsageError("--tree needs a COMMAND after '--' (a launcher such as torchrun or vllm serve)")
        for inj in self.engine.injections:
            if inj.rank >= self.world_size:
                raise UsageError(
                    f"--inject {inj}: rank {inj.rank} does not exist in a world of {self.world_size} ranks"
                )

    @property
    def builtin(self) -> bool:
        return not self.command

    @property
    def resolved_store_port(self) -> int | None:
        if self.nodes.store_port is not None:
            return self.nodes.store_port
        return None if self.master_port is None else self.master_port + 1

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def rank_offset(self) -> int:
        return self.node_rank * self.nproc_per_node

    def rank_argv(self) -> list[str]:
        if self.builtin:
            return [sys.executable, "-m", "tp_supervise.engine", *self.engine.argv()]
        return list(self.command)


ENGINE_METRICS_OFF = "none"


def engine_metrics_source(given: str | None, command: Sequence[str], tree: bool) -> tuple[str | None, str]:
    """(URL, engine kind) of the engine-metrics progress source: ``given`` (``none`` turns it off), else in tree
    mode the one a vLLM or SGLang launcher's flags name (docs/supervisor.md, ``--engine-metrics-url``); none for
    a launcher that serves no API on this node (``--headless``, a node > 0 of its own multi-node launch)."""
    if given is not None:
        return (None if given.strip().lower() == ENGINE_METRICS_OFF else given), "auto"
    if not tree:
        return None, "auto"
    engine = launcher_engine(command) or "auto"
    try:
        launch = engine_launch(command)
    except LaunchFlagError:
        launch = None
    if launch is not None and launch.headless:
        return None, engine
    return launcher_metrics_url(command), engine


@dataclass(frozen=True)
class NodePlace:
    """Where this node stands in the job: the supervisor's own flags, or (--tree) the engine launcher's."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    store_port: int | None = None
    engine_rendezvous: tuple[str, int] | None = None
    engine_rendezvous_span: int = 1


def node_place(
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    store_port: int | None,
    launch: EngineLaunch | None,
) -> NodePlace:
    """The node's place from the supervisor's flags (None: not given) and, in --tree mode, the engine launcher's
    own multi-node launch: what the supervisor was not told is the launcher's; what both say must agree (docs/
    multinode.md, "An engine's own multi-node launch")."""
    if launch is None:
        return NodePlace(
            nnodes=1 if nnodes is None else nnodes,
            node_rank=0 if node_rank is None else node_rank,
            master_addr=master_addr or "127.0.0.1",
            master_port=master_port,
            store_port=store_port,
        )
    engine = BY_NAME[launch.engine]
    for flag, ours, theirs, engine_flag in (
        ("--nnodes", nnodes, launch.nnodes, engine.NNODES_FLAGS[0]),
        ("--node-rank", node_rank, launch.node_rank, engine.NODE_RANK_FLAGS[0]),
    ):
        if ours is not None and ours != theirs:
            raise UsageError(
                f"supervise {flag} {ours} contradicts the launcher's {engine_flag} {theirs}: the engine starts its "
                f"ranks where its own flags say; give {flag} once (leave it to the launcher: supervise reads it)"
            )
    rendezvous = launch.rendezvous if launch.nnodes > 1 else None
    place = NodePlace(
        nnodes=launch.nnodes,
        node_rank=launch.node_rank,
        master_addr=master_addr or (rendezvous[0] if rendezvous else "127.0.0.1"),
        master_port=master_port if master_port is not None else (rendezvous[1] if rendezvous else None),
        store_port=store_port,
        engine_rendezvous=rendezvous,
        engine_rendezvous_span=launch.rendezvous_span,
    )
    if rendezvous is not None and store_port is None and place.master_port is not None:
        first, span = rendezvous[1], launch.rendezvous_span
        if place.master_port == first or first <= place.master_port + 1 < first + span:
            # the store's default (--master-port + 1) would fall among the engine's own ports: the first one after
            # them (only a --store-port given there is refused)
            place = dataclasses.replace(place, store_port=first + span)
    return place


def _nproc_number(text: str | int, gpus: Callable[[], int | None]) -> int:
    """``--nproc-per-node``: a number, or torchrun's gpu / auto / cpu (``gpus``: the GPUs this node can use,
    asked only for those words; the host probe is the caller's, as is all I/O)."""
    if isinstance(text, int):
        return text
    word = str(text).strip().lower()
    if word == "gpu":
        count = gpus() or 0
        if count < 1:
            raise UsageError("--nproc-per-node gpu: no GPU is visible on this node; give a number or 'cpu'")
        return count
    if word == "auto":
        return gpus() or os.cpu_count() or 1
    if word == "cpu":
        return os.cpu_count() or 1
    try:
        return int(word)
    except ValueError:
        raise UsageError(f"--nproc-per-node {text!r}: give a number, 'gpu', 'auto' or 'cpu'") from None


def resolve_nproc(
    nproc_per_node: str | int | None,
    tp: int | None,
    nnodes: int,
    builtin: bool,
    command: Sequence[str] = (),
    tree: bool = False,
    gpus: Callable[[], int | None] = lambda: None,
) -> int:
    """Launch arithmetic: ``--tp`` is the TP world size, split evenly across nodes (``gpus``: the GPU count
    for ``--nproc-per-node gpu|auto``, e.g. ``preflight.visible_gpu_count``)."""
    if nproc_per_node is not None:
        nproc_per_node = _nproc_number(nproc_per_node, gpus)
    if tp is not None:
        if tp < 1:
            raise UsageError(f"--tp {tp}: must be at least 1")
        if nnodes >= 1 and tp % nnodes != 0:
            raise UsageError(
                f"--tp {tp} is not divisible by --nnodes {nnodes}: the world size must split evenly across "
                "nodes; adjust --tp or --nnodes"
            )
        per_node = tp // max(nnodes, 1)
        if nproc_per_node is not None and nproc_per_node != per_node:
            raise UsageError(
                f"--nproc-per-node {nproc_per_node} contradicts --tp {tp} with --nnodes {nnodes} "
                f"({per_node} per node); give only one of them"
            )
        return per_node
    if nproc_per_node is not None:
        return nproc_per_node
    if builtin:
        return DEFAULT_BUILTIN_TP
    launcher_given = launcher_nproc(command) if tree else None
    if launcher_given is not None:
        return _nproc_number(launcher_given, gpus)
    raise UsageError("how many ranks? give --nproc-per-node N (or --tp N)")
