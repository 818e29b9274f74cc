"""The flags of ``supervise serve``, in the groups ``--help`` shows them in (launch, watchdogs, dumps,
observability, rank output, built-in engine): parsing only, as ``parser.py``; what they mean for a run is
``spec_from_args`` (``cli/__init__.py``) and ``spec.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tp_supervise.engine.inject import ALL_KINDS as INJECT_KINDS  # the engine owns its fault kinds

from .. import spec as specs


def _share_or_off(text: str) -> float | None:
    if text.strip().lower() == "off":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share of the step (e.g. 0.1) or 'off'") from None


def seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("launch")
    g.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        metavar="N|gpu|auto|cpu",
        help="ranks on this node: a number, 'gpu' (one per visible GPU), 'auto' (GPUs if any, else CPU cores) or 'cpu'; default 2 for the built-in engine, and in --tree mode read from the launcher's own flags (torchrun --nproc-per-node, vllm --tensor-parallel-size, sglang --tp)",
    )
    g.add_argument("--tp", type=int, help="tensor-parallel world size, split evenly across --nnodes")
    g.add_argument(
        "--nnodes",
        type=int,
        help="nodes in the job, one supervisor on each (no MIN:MAX range) (default 1; in --tree mode, a vLLM or SGLang launcher's own --nnodes)",
    )
    g.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        help="this node's index in 0..nnodes-1 (default 0; in --tree mode, the launcher's own --node-rank)",
    )
    g.add_argument(
        "--master-addr",
        "--master_addr",
        help="address of node 0, for the ranks' rendezvous and the supervisors' store (default 127.0.0.1; in --tree mode, the launcher's own --master-addr / --dist-init-addr host)",
    )
    g.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        help="the ranks' rendezvous port; required with --nnodes > 1 (default: a free port; in --tree mode, the launcher's own --master-port / --dist-init-addr port)",
    )
    g.add_argument(
        "--store-port",
        type=int,
        help="multi-node: port of node 0's supervisor store (default: --master-port + 1, or the first port after an engine's own rendezvous ports)",
    )
    g.add_argument(
        "--run-id",
        help="id of the run, the same on every node (default: node 0 picks one; TORCHELASTIC_RUN_ID carries it)",
    )
    g.add_argument(
        "--rendezvous-timeout",
        type=seconds,
        default=specs.DEFAULT_RENDEZVOUS_TIMEOUT_S,
        metavar="SECONDS",
        help="multi-node: every node must have registered by then (exit 83, naming the missing ones)",
    )
    g.add_argument(
        "--node-timeout",
        type=seconds,
        default=specs.DEFAULT_NODE_TIMEOUT_S,
        metavar="SECONDS",
        help="multi-node: a node (or node 0's store) that goes silent without closing its connections (host down, network partition, frozen) is lost after this; a supervisor that dies is seen at once",
    )
    g.add_argument(
        "--join-token",
        help="multi-node: a shared secret every node must give (compared as a digest, never logged); also read from SUPERVISE_JOIN_TOKEN",
    )
    g.add_argument(
        "--fingerprint-env",
        default="",
        metavar="KEYS",
        help="multi-node: comma-separated environment variables that must be equal on every node (with the command, --nproc-per-node and the versions)",
    )
    g.add_argument(
        "--standalone",
        action="store_true",
        help="single node, rendezvous on localhost with a free port (torchrun's --standalone)",
    )
    g.add_argument(
        "--tree",
        action="store_true",
        help="COMMAND is itself a launcher (torchrun, vllm serve --tp N, ...); its ranks are found when they join torch.distributed",
    )
    g.add_argument(
        "--engine-metrics-url",
        metavar="URL",
        help="also read progress from the engine's own Prometheus endpoint (vLLM/SGLang generation-token and running-request counters): for engines whose collectives never reach Python (CUDA graphs); in --tree mode with a vLLM or SGLang launcher it is derived from the launcher's --host/--port unless 'none'",
    )
    g.add_argument(
        "--engine-kind",
        default="auto",
        choices=("auto", "vllm", "sglang"),
        help="metric family names of --engine-metrics-url",
    )
    g.add_argument(
        "--no-hook",
        dest="hook",
        action="store_false",
        help="do not put the zero-code torch.distributed hook on the ranks' PYTHONPATH",
    )
    g.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="relaunch the whole group after a fault this many times (the first at once, then backoff 1 s .. 30 s)",
    )
    g.add_argument(
        "--quarantine-after",
        type=int,
        default=specs.DEFAULT_QUARANTINE_AFTER,
        metavar="N",
        help="a request that the failing step of N failed attempts had just scheduled is answered 400 for the rest of the run (engines that write $SUPERVISE_RUN_DIR/inflight-rank0, as the built-in one does); 0: never",
    )
    g.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="with a COMMAND: bind HOST:PORT once for the whole run and hand it to rank 0 of every attempt the systemd way (LISTEN_FDS=1, fd 3, LISTEN_PID): connections wait in the backlog across restarts instead of being refused; for engines that support socket activation (the built-in engine's --host/--port are held across restarts without it, by the relay)",
    )
    r = serve.add_argument_group('serving through faults (the relay: docs/engine.md, "The relay")')
    r.add_argument(
        "--relay",
        metavar="[HOST]:PORT",
        help="with a COMMAND (vLLM, SGLang, any OpenAI-compatible server): hold HOST:PORT (:PORT: every interface) for the whole run and forward to the engine's own listener; requests and streams a failing group answered are held across the restart and sent again (streams resumed by token ids where the engine gives them)",
    )
    r.add_argument(
        "--relay-upstream",
        metavar="URL",
        help="the engine's own listener behind --relay (default: read from a vLLM or SGLang launcher's --host/--port)",
    )
    r.add_argument(
        "--relay-hold",
        type=seconds,
        metavar="SECONDS",
        help=f"how long a request is held for the group's next attempt before a 503 with Retry-After (default {specs.DEFAULT_RELAY_HOLD_S:g} s for a COMMAND, {specs.BUILTIN_RELAY_HOLD_S:g} s for the built-in engine)",
    )
    r.add_argument(
        "--relay-max-held",
        type=int,
        default=specs.DEFAULT_RELAY_MAX_HELD,
        metavar="N",
        help="requests held at once across a restart; past it a 503 with Retry-After (default %(default)s)",
    )
    w = serve.add_argument_group("watchdogs (omit timeouts for adaptive ones)")
    w.add_argument(
        "--hard-timeout",
        type=seconds,
        metavar="SECONDS",
        help="no progress while busy: dump, then kill the group (exit 81) (default: adaptive)",
    )
    w.add_argument(
        "--soft-timeout",
        type=seconds,
        metavar="SECONDS",
        help="no progress while busy: dump only, the run goes on (default: adaptive)",
    )
    w.add_argument(
        "--startup-timeout",
        type=seconds,
        default=specs.DEFAULT_STARTUP_TIMEOUT_S,
        metavar="SECONDS",
        help="every rank must report ready (or join the group) within this",
    )
    w.add_argument(
        "--adaptive-floors",
        metavar="SOFT,HARD",
        help="lowest adaptive soft/hard timeouts (default 1.5,3): below them a scheduler hiccup on a loaded host could look like a hang",
    )
    w.add_argument(
        "--adaptive-ceilings", metavar="SOFT,HARD", help="highest adaptive soft/hard timeouts (default 120,300)"
    )
    w.add_argument(
        "--kill-grace",
        type=seconds,
        default=specs.DEFAULT_KILL_GRACE_S,
        metavar="SECONDS",
        help="SIGTERM to SIGKILL escalation, one deadline shared by every process",
    )
    d = serve.add_argument_group("dumps")
    d.add_argument("--dump-dir", type=Path, default=Path("supervise-dumps"), help="where incident bundles go")
    d.add_argument(
        "--dump-timeout",
        type=seconds,
        default=specs.DEFAULT_DUMP_TIMEOUT_S,
        metavar="SECONDS",
        help="a fatal dump never delays the teardown longer than this (the bundle is finished afterwards, or marked incomplete)",
    )
    d.add_argument("--dump-keep", type=int, default=specs.DEFAULT_DUMP_KEEP, help="keep at most this many bundles")
    d.add_argument(
        "--dump-max-bytes",
        type=int,
        default=specs.DEFAULT_DUMP_MAX_BYTES,
        help="keep the bundles' total size under this many bytes",
    )
    d.add_argument(
        "--stack-method",
        default="auto",
        choices=specs.STACK_METHODS,
        help="auto: py-spy, falling back to the ranks' faulthandler",
    )
    d.add_argument("--native", action="store_true", help="include native frames in py-spy stacks")
    o = serve.add_argument_group("observability")
    o.add_argument(
        "--metrics-addr",
        default=specs.DEFAULT_METRICS_ADDR,
        metavar="HOST:PORT|none",
        help="HOST:PORT for /metrics /healthz /readyz /livez, or 'none' (binding beyond loopback exposes run state: see docs/metrics.md)",
    )
    o.add_argument(
        "--health-addr",
        metavar="HOST:PORT",
        default=None,
        help="also serve /healthz /readyz /livez (never /metrics) here, e.g. 0.0.0.0:9181 for Kubernetes "
        "probes while /metrics stays on loopback (default: health only on --metrics-addr)",
    )
    o.add_argument(
        "--metrics-linger",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help=f"keep /metrics up exactly this long after the run ends, so every scraper gets the final counts; a second Ctrl-C cuts it short (default: after a fault, until the first scrape of the final state, at most {specs.DEFAULT_FAULT_LINGER_S:g} s, and not at all if /metrics was never scraped; 0 after a clean run)",
    )
    o.add_argument(
        "--metrics-textfile",
        type=Path,
        metavar="PATH",
        help="also write the metrics to PATH (node_exporter's textfile collector) on every incident and at exit, atomically: the final state survives the process",
    )
    o.add_argument(
        "--consensus",
        default="observe",
        choices=specs.CONSENSUS_MODES,
        help="compare the ranks' per-step decisions: off, observe (bundle + metric) or enforce (also stop the group, exit 82)",
    )
    w.add_argument(
        "--straggler-threshold",
        type=_share_or_off,
        default=specs.DEFAULT_STRAGGLER_THRESHOLD,
        metavar="F|off",
        help="name a rank the group waits for when its peers spend this share of their time waiting for it, more than usual ('off': statistics only)",
    )
    w.add_argument(
        "--straggler-sustain",
        "--straggler-window",  # the old spelling, kept working: it never set the statistics' window
        type=seconds,
        default=specs.DEFAULT_STRAGGLER_WINDOW_S,
        metavar="SECONDS",
        help="a straggler is named once it held the group back this long (busy time), and cleared after half "
        "as long below half the threshold (--straggler-window: its old name, deprecated, still accepted)",
    )
    w.add_argument(
        "--on-straggler",
        default="dump",
        choices=specs.STRAGGLER_ACTIONS,
        help="dump: a bundle, the run goes on; restart: also end the attempt (restarted with --max-restarts); kill: end the run (exit 80)",
    )
    o.add_argument(
        "--consensus-inband",
        type=int,
        default=0,
        metavar="N",
        help="also compare digests in band (MIN/MAX all_reduce) every N steps; for benchmarks",
    )
    o.add_argument(
        "--log-format",
        default="console",
        choices=("console", "json"),
        help="console lines for people, one JSON object per line for machines",
    )
    o.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="the supervisor's own log level",
    )
    r = serve.add_argument_group("rank output (as torchrun; the ranks' stdout and stderr are pipes)")
    r.add_argument(
        "--log-dir",
        "--log_dir",
        type=Path,
        metavar="DIR",
        help="also write each rank's stdout and stderr to DIR/<run_id>/attempt_<n>/<global rank>/{stdout,stderr}.log (default: no files); without --redirects/--tee both streams are teed",
    )
    r.add_argument(
        "--redirects",
        metavar="0-3|LR:V,...",
        help="with --log-dir: streams that go to the files only, not the console: 0 none, 1 stdout, 2 stderr, 3 both, for every local rank or per local rank (0:1,1:2) (default: none)",
    )
    r.add_argument(
        "--tee",
        metavar="0-3|LR:V,...",
        help="with --log-dir: streams that go to the files and the console, same syntax as --redirects (default: both, when neither flag is given)",
    )
    r.add_argument(
        "--log-max-bytes",
        type=int,
        default=specs.DEFAULT_LOG_MAX_BYTES,
        metavar="N",
        help="with --log-dir: rotate each file at N bytes (stdout.log becomes stdout.log.1; 3 rotated files are kept); 0: no cap",
    )
    r.add_argument(
        "--local-ranks-filter",
        "--local_ranks_filter",
        metavar="LR,...",
        help="only these local ranks' output reaches the console (files and bundles keep every rank's) (default: every local rank)",
    )
    e = serve.add_argument_group("built-in engine (no COMMAND)")
    e.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="gloo on CPU, or NCCL on CUDA")
    e.add_argument(
        "--control-plane",
        default="broadcast",
        choices=("broadcast", "replicated"),
        help="how ranks learn each step's batch: rank 0 broadcasts it, or every rank schedules the same requests",
    )
    e.add_argument("--model", help="Hugging Face Llama-format directory (default: a seeded random tiny model)")
    e.add_argument("--host", default="127.0.0.1", help="engine HTTP host")
    e.add_argument(
        "--port",
        type=int,
        default=specs.DEFAULT_ENGINE_PORT,
        help="engine HTTP port, bound once for the whole run; 0: a free one, named in the ready line",
    )
    e.add_argument(
        "--sync-token-ids",
        action="store_true",
        help="replicated plane: agree on sampled token ids every step (MIN all-reduce)",
    )
    e.add_argument(
        "--max-waiting",
        type=int,
        metavar="N",
        help="requests that may wait for a batch slot before the API answers 429 with Retry-After (engine default 256)",
    )
    e.add_argument(
        "--read-timeout",
        type=seconds,
        metavar="SECONDS",
        help="a client must send a request's headers, then its body, within this (engine default 15)",
    )
    e.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@RANK[:STEP]",
        help=f"fault injection: {', '.join(INJECT_KINDS)}",
    )
    e.add_argument(
        "--engine-arg", action="append", default=[], metavar="ARG", help="extra argument passed to the engine"
    )
