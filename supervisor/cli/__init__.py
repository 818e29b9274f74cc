"""``supervise``: serve, dump, status, analyze, drill.

The flags are parsed in ``parser.py``; here they are mapped to a run (``spec_from_args``) and each subcommand
is dispatched.  Usage errors exit 64 (EX_USAGE) before anything is started.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

import structlog

from tp_supervise.engine.inject import ALL_KINDS as INJECT_KINDS  # the engine owns its fault kinds
from tp_supervise.engine.inject import REQUEST_KINDS

from .. import logs
from .. import preflight as host
from .. import spec as specs
from ..nodes.handshake import HandshakeError
from ..nodes.join import join_nodes
from ..outcome import EXIT_USAGE
from ..preflight import preflight
from ..processes.listen_socket import ListenSocket
from ..rank.engines import launcher_flags as launcher
from ..spec import EngineOptions, LaunchSpec, UsageError
from .parser import DISTRIBUTION, build_parser, errors_as_json, package_version, say_error, wants_json_logs


def _command(args: argparse.Namespace) -> list[str]:
    """The COMMAND after ``--`` (argparse's REMAINDER keeps the separator), or [] for the built-in engine."""
    command = list(args.command)
    return command[1:] if command and command[0] == "--" else command


def spec_from_args(args: argparse.Namespace) -> LaunchSpec:
    command = _command(args)
    builtin = not command
    try:
        launch = launcher.engine_launch(command) if args.tree else None
    except launcher.LaunchFlagError as exc:
        raise UsageError(f"{exc} (the COMMAND after --)") from None
    place = specs.node_place(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.store_port, launch)
    if args.standalone:
        if place.nnodes != 1:
            raise UsageError(f"--standalone is a single-node job, but --nnodes is {place.nnodes}")
        if place.master_addr not in ("127.0.0.1", "localhost"):
            raise UsageError("--standalone rendezvous is on localhost: leave out --master-addr")
    nproc = specs.resolve_nproc(
        args.nproc_per_node, args.tp, place.nnodes, builtin, command, args.tree, gpus=host.visible_gpu_count
    )
    if launch is not None and nproc != launch.nproc_per_node:
        raise UsageError(
            f"{nproc} ranks per node (--nproc-per-node/--tp) contradicts the launcher: {launch.engine} starts "
            f"{launch.nproc_per_node} here (a world of {launch.world} over {launch.nnodes} node(s)); leave it to the launcher"
        )
    if not builtin and (
        args.inject or args.model or args.engine_arg or args.max_waiting is not None or args.read_timeout is not None
    ):
        raise UsageError(
            "--inject, --model, --max-waiting, --read-timeout and --engine-arg apply to the built-in "
            "engine only (no COMMAND)"
        )
    if args.max_waiting is not None and args.max_waiting < 0:
        raise UsageError(f"--max-waiting {args.max_waiting}: must be >= 0")
    if args.read_timeout is not None and not 0.1 <= args.read_timeout <= 3600:
        raise UsageError(f"--read-timeout {args.read_timeout}: must be a number of seconds in 0.1..3600")
    injections = tuple(specs.parse_injection(text, INJECT_KINDS) for text in args.inject)
    for inj in injections:
        if inj.kind in REQUEST_KINDS and inj.step is not None:
            raise UsageError(f"--inject {inj}: {inj.kind} is triggered by a request, not a step: {inj.kind}@RANK")
    engine = EngineOptions(
        device=args.device,
        control_plane=args.control_plane,
        model=args.model,
        host=args.host,
        port=args.port,
        sync_token_ids=args.sync_token_ids,
        injections=injections,
        max_waiting=args.max_waiting,
        read_timeout=args.read_timeout,
        extra_args=tuple(args.engine_arg),
    )
    if args.model and not Path(args.model, "config.json").is_file():
        raise UsageError(f"--model {args.model!r}: no config.json there; give a Hugging Face Llama-format directory")
    metrics_url, metrics_kind = specs.engine_metrics_source(args.engine_metrics_url, command, args.tree)
    if args.relay and builtin:
        raise UsageError("--relay is for a COMMAND's engine; the built-in engine's relay already holds --host/--port")
    if args.relay_upstream is not None and not args.relay:
        raise UsageError("--relay-upstream names the engine behind --relay: give --relay HOST:PORT too")
    upstream, relay_engine = specs.relay_upstream(args.relay_upstream, command) if args.relay else (None, "builtin")
    relay = specs.RelayOptions(
        address=specs.parse_hostport(args.relay, "--relay", any_host=True) if args.relay else None,
        upstream=upstream,
        engine=relay_engine,
        hold=args.relay_hold,
        max_held=args.relay_max_held,
    )
    return LaunchSpec(
        command=tuple(command),
        nproc_per_node=nproc,
        nnodes=place.nnodes,
        node_rank=place.node_rank,
        master_addr=place.master_addr,
        master_port=place.master_port,
        tree=args.tree,
        engine_rendezvous=place.engine_rendezvous,
        engine_rendezvous_span=place.engine_rendezvous_span,
        kill_grace=args.kill_grace,
        consensus=args.consensus,
        consensus_inband=args.consensus_inband,
        max_restarts=args.max_restarts,
        quarantine_after=args.quarantine_after,
        listen=specs.parse_hostport(args.listen, "--listen") if args.listen else None,
        relay=relay,
        log_format=args.log_format,
        zero_code_hook=args.hook,
        watchdog=specs.WatchdogOptions(
            hard_timeout=args.hard_timeout,
            soft_timeout=args.soft_timeout,
            startup_timeout=args.startup_timeout,
            adaptive_floors=specs.parse_pair(args.adaptive_floors, "--adaptive-floors"),
            adaptive_ceilings=specs.parse_pair(args.adaptive_ceilings, "--adaptive-ceilings"),
            engine_metrics_url=metrics_url,
            engine_kind=args.engine_kind if args.engine_kind != "auto" else metrics_kind,
        ),
        dumps=specs.DumpOptions(
            dir=args.dump_dir,
            timeout=args.dump_timeout,
            keep=args.dump_keep,
            max_bytes=args.dump_max_bytes,
            stack_method=args.stack_method,
            native_stacks=args.native,
        ),
        metrics=specs.MetricsOptions(
            addr=specs.parse_hostport(args.metrics_addr, "--metrics-addr"),
            health_addr=specs.parse_hostport(args.health_addr, "--health-addr") if args.health_addr else None,
            linger=args.metrics_linger,
            textfile=args.metrics_textfile,
        ),
        straggler=specs.StragglerOptions(
            threshold=args.straggler_threshold, sustain=args.straggler_sustain, action=args.on_straggler
        ),
        nodes=specs.NodeOptions(
            store_port=place.store_port,
            run_id=args.run_id,
            rendezvous_timeout=args.rendezvous_timeout,
            node_timeout=args.node_timeout,
            join_token=args.join_token or os.environ.get("SUPERVISE_JOIN_TOKEN") or None,
            fingerprint_env=tuple(k.strip() for k in args.fingerprint_env.split(",") if k.strip()),
        ),
        engine=engine,
        output=specs.OutputOptions(
            log_dir=args.log_dir,
            redirects=None if args.redirects is None else specs.Std.parse(args.redirects, "--redirects"),
            tee=None if args.tee is None else specs.Std.parse(args.tee, "--tee"),
            local_ranks_filter=specs.parse_local_ranks(args.local_ranks_filter),
            log_max_bytes=args.log_max_bytes,
        ),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from ..observers import control_socket as control

    logs.configure(args.log_format, level=logging.getLevelName(args.log_level.upper()))
    ports = ServingPorts()
    try:
        spec = spec_from_args(args)
        preflight(spec)
        control.registry_dir()  # a registry another user controls is refused before anything starts
        spec, ports = bind_serving_port(spec)
    except (UsageError, control.RegistryError) as exc:
        ports.close()
        say_error(str(exc))
        return EXIT_USAGE
    try:
        return _serve(spec, args, ports)
    finally:
        ports.close()


@dataclasses.dataclass
class ServingPorts:
    """The sockets bound once for the whole run: ``rank0`` is handed to rank 0 of every attempt; ``public``,
    with the built-in engine, is the relay's (supervisor/relay/process.py) and ``rank0`` is then on loopback."""

    rank0: ListenSocket | None = None
    public: ListenSocket | None = None

    def close(self) -> None:
        for sock in (self.rank0, self.public):
            if sock is not None:
                sock.close()


def bind_serving_port(spec: LaunchSpec) -> tuple[LaunchSpec, ServingPorts]:
    """The serving port, bound once for the whole run (supervisor/processes/listen_socket.py): the built-in
    engine's --host/--port (the relay's; rank 0 gets a loopback port), --relay for a COMMAND (the relay's; the
    engine binds its own), or --listen for a COMMAND (rank 0's);
    only on the node that holds global rank 0.  A port that is taken is a usage error (64) before anything
    starts."""
    if spec.rank_offset != 0:
        return spec, ServingPorts()
    if spec.builtin:
        public = ListenSocket.bind(spec.engine.host, spec.engine.port, "--port")
        if spec.engine.port == 0:  # the port the kernel picked is the one the ready line names
            spec = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, port=public.port))
        try:
            rank0 = ListenSocket.bind("127.0.0.1", 0, "the relay's upstream port")
        except UsageError:
            public.close()
            raise
        return spec, ServingPorts(rank0=rank0, public=public)
    if spec.listen is not None:
        return spec, ServingPorts(rank0=ListenSocket.bind(spec.listen[0], spec.listen[1], "--listen", systemd=True))
    if spec.relay.address is not None:  # the engine binds its own port; the relay holds the public one
        host, port = spec.relay.address
        public = ListenSocket.bind(host, port, "--relay")
        if port == 0:
            spec = dataclasses.replace(spec, relay=dataclasses.replace(spec.relay, address=(host, public.port)))
        return spec, ServingPorts(public=public)
    return spec, ServingPorts()


def _serve(spec: LaunchSpec, args: argparse.Namespace, ports: ServingPorts) -> int:
    from ..core import Supervisor
    from ..processes import output_pump as output

    base_env = dict(os.environ)  # before anything of ours touches os.environ
    base_env.pop("SUPERVISE_JOIN_TOKEN", None)  # a secret of the supervisors, not of the ranks
    _explain_launch(args, spec)
    link = None
    if spec.nnodes > 1:
        try:
            link = join_nodes(spec)
        except HandshakeError as exc:
            say_error(str(exc))
            return exc.code
        except KeyboardInterrupt:
            print("supervise: stopped during the rendezvous of the nodes; nothing was started", file=sys.stderr)
            return 0
    run_id = link[1].run_id if link else spec.nodes.run_id
    with output.install(spec.output, spec.log_format):  # the ranks' stdout/stderr: pipes, read by one thread
        code = Supervisor(spec, base_env, run_id=run_id, nodes=link, listener=ports.rank0, public=ports.public).run()
    if link is not None:
        # Multi-node: a daemon thread may still sit in a TCPStore call (bounded by the store's timeout) and
        # torch's store objects must not meet the interpreter's finalisation: on a loaded host that ended in
        # C++ terminate() (SIGABRT) instead of our exit code.  Everything of ours is flushed and closed here.
        logs.drain()  # os._exit skips atexit: what is queued for a reader gets its bounded time here
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _explain_launch(args: argparse.Namespace, spec: LaunchSpec) -> None:
    """Say what was inferred, as torchrun would."""

    log = structlog.get_logger("supervise")
    if spec.tree and args.nproc_per_node is None and args.tp is None:
        log.info(
            "rank count read from the launcher's command line",
            nproc_per_node=spec.nproc_per_node,
            launcher=" ".join(spec.command[:3]),
        )
    if spec.nproc_per_node > 1 and not spec.tree and "OMP_NUM_THREADS" not in os.environ:
        log.warning(
            "OMP_NUM_THREADS set to 1 for each rank by default (as torchrun does), so the ranks do not "
            "overload the node; tune it for your program if needed"
        )


def cmd_dump(args: argparse.Namespace) -> int:
    from ..observers import control_socket as control

    try:
        jobs = control.list_jobs()
    except control.RegistryError as exc:
        print(f"supervise dump: {exc}", file=sys.stderr)
        return 2
    if args.run_id:
        jobs = [j for j in jobs if j.run_id == args.run_id]
        if not jobs:
            print(f"supervise dump: no running job with run id {args.run_id!r}", file=sys.stderr)
            return 2
    elif not jobs:
        print("supervise dump: no supervised job is running on this host", file=sys.stderr)
        return 2
    elif len(jobs) > 1:
        ids = ", ".join(j.run_id for j in jobs)
        print(f"supervise dump: {len(jobs)} jobs are running ({ids}); choose one with --run-id", file=sys.stderr)
        return 2
    job = jobs[0]
    try:
        reply = control.request(job.socket, {"cmd": "dump"}, timeout_s=args.timeout)
    except OSError as exc:
        print(f"supervise dump: cannot reach job {job.run_id} (pid {job.pid}): {exc}", file=sys.stderr)
        return 1
    if not reply.get("ok"):
        print(f"supervise dump: {reply.get('error', 'failed')}", file=sys.stderr)
        return 1
    print(reply["bundle"])
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ..observers import status_view

    return status_view.main(args)


def cmd_analyze(args: argparse.Namespace) -> int:
    from tp_supervise.dumps import analyze

    argv = [str(b) for b in args.bundle] + (["--json"] if args.json else [])
    return analyze.main(argv)


def cmd_drill(args: argparse.Namespace) -> int:
    command = _command(args)
    if command or args.list_kinds:  # the user's engine, behind the relay
        from ..drills import command as drill_command

        return drill_command.main(args, command)
    error = host.builtin_engine_error()  # each kind's run would fail in its ranks, one by one
    if error is not None:
        say_error(error)
        return EXIT_USAGE
    from ..drills import builtin

    return builtin.main(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    errors_as_json(wants_json_logs(argv))
    args = parser.parse_args(argv)
    handler = {"serve": cmd_serve, "dump": cmd_dump, "status": cmd_status, "analyze": cmd_analyze, "drill": cmd_drill}[
        args.cmd
    ]
    return handler(args)


__all__ = ["DISTRIBUTION", "build_parser", "main", "package_version", "spec_from_args"]
