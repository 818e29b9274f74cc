"""Multi-node start: host or reach node 0's store and pass the handshake, before any rank starts.

``supervise serve`` calls ``join_nodes`` once, on the main thread, with the run's spec; what comes back (the
node transport and the group) is what the node link (``link.py``) runs on.  Refusals are ``HandshakeError``
with the exit code to use (docs/multinode.md).
"""

from __future__ import annotations

import os
import signal
import time

import structlog

from ..outcome import EXIT_USAGE, new_run_id
from ..rank.engines import launcher_flags as launcher
from ..spec import LaunchSpec
from . import handshake, link
from .transport import TransportError, open_transport

log = structlog.get_logger("supervise")


def join_nodes(spec: LaunchSpec):
    """Host or reach node 0's store, and pass the handshake before any rank starts: (transport, group)."""
    deadline = time.monotonic() + spec.nodes.rendezvous_timeout
    host, port = spec.master_addr, spec.resolved_store_port
    if port is None:  # LaunchSpec refuses --nnodes > 1 without --master-port
        raise handshake.HandshakeError("multi-node needs --master-port (or --store-port)", EXIT_USAGE)

    def interrupt(_signum, _frame):  # a stop signal during the (long) rendezvous: nothing to tear down
        raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)
    log.info(
        "joining the nodes",
        node_rank=spec.node_rank,
        nnodes=spec.nnodes,
        store=f"{host}:{port}",
        hosts_store=spec.node_rank == 0,
    )
    try:
        transport = open_transport(
            host,
            port,
            spec.nnodes,
            spec.node_rank,
            spec.nodes.join_token,
            deadline,
            node_lost_s=spec.nodes.node_timeout,
        )
    except TransportError as exc:
        raise handshake.HandshakeError(str(exc), exc.code) from None
    command = list(spec.command) if not spec.builtin else ["(built-in engine)", *spec.engine.argv()]
    job = launcher.job_fields(command) if spec.tree else None
    fp = handshake.fingerprint(
        command,
        spec.nproc_per_node,
        spec.nodes.fingerprint_env,
        max_restarts=spec.max_restarts,
        nnodes=spec.nnodes,
        job=job,
        engine_versions=launcher.engine_versions(command, os.environ) if job is not None else None,
    )
    try:
        group = handshake.handshake(
            transport.store,
            nnodes=spec.nnodes,
            node_rank=spec.node_rank,
            run_id=spec.nodes.run_id or new_run_id(),
            fp=fp,
            token=spec.nodes.join_token,
            deadline=deadline,
            store_addr=transport.public_addr,
            transport=transport,
        )
    except handshake.HandshakeError:
        if spec.node_rank == 0:
            time.sleep(link.REFUSAL_LINGER_S)  # the store dies with us: let every node read the refusal
        transport.close()
        raise
    log.info(
        "every node joined",
        run_id=group.run_id,
        nnodes=group.nnodes,
        node_rank=group.node_rank,
        hosts=[group.hosts[n] for n in sorted(group.hosts)],
    )
    return transport, group
