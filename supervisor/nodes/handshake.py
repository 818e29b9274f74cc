"""Before any rank starts: every node registers, the group is validated, all pass the start barrier.

Bounded by ``--rendezvous-timeout``; refused on every node, with what to
change and nothing started: a duplicate ``--node-rank``, a fingerprint
mismatch (command and arguments, ``--nproc-per-node``, tp-supervise, Python
and torch versions, ``--fingerprint-env`` keys), a wrong ``--join-token``.
A node missing after the timeout is exit 83, with a progress line every few
seconds naming the missing node ranks and the store address.  The keys are
listed in docs/multinode.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from .store import STORE_TIMEOUT_S, Store, TorchStore

log = structlog.get_logger("supervise.nodes")

POLL_S = 0.1


PROGRESS_EVERY_S = 3.0  # handshake progress lines


TOKEN_MESSAGE = b"tp-supervise join token v1"


def token_digest(token: str | None) -> str:
    """What a node registers instead of its join token (an HMAC: the token itself never leaves the node)."""
    if not token:
        return ""
    return hmac.new(token.encode(), TOKEN_MESSAGE, hashlib.sha256).hexdigest()


def fingerprint(command: Sequence[str], nproc_per_node: int, env_keys: Sequence[str],
                environ: Mapping[str, str] = os.environ, max_restarts: int = 0) -> dict[str, str]:
    """What must be equal on every node of one TP group."""
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    out = {
        "command": " ".join(command),
        "nproc_per_node": str(nproc_per_node),
        "max_restarts": str(max_restarts),  # the group restarts together: every node must agree
        "tp_supervise": version("tp-supervise"),
        "python": platform.python_version(),
        "torch": version("torch"),
    }
    for key in env_keys:
        out[f"env:{key}"] = environ.get(key, "(unset)")
    return out


def mismatches(infos: Mapping[int, dict]) -> list[str]:
    """Fingerprint fields that differ across nodes, one line per field naming each node's value."""
    fields = sorted({k for info in infos.values() for k in info.get("fingerprint", {})})
    out = []
    for name in fields:
        values = {node: info.get("fingerprint", {}).get(name, "(missing)") for node, info in sorted(infos.items())}
        if len(set(values.values())) > 1:
            shown = "; ".join(f"node {node}: {value!r}" for node, value in values.items())
            out.append(f"{name}: {shown}")
    return out


class HandshakeError(RuntimeError):
    """The group cannot start; ``code`` is the exit code (64 refused, 83 timeout)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class NodeGroup:
    """What the handshake established: the shared run id and this node's place."""

    run_id: str
    nnodes: int
    node_rank: int
    store_addr: str
    hosts: Mapping[int, str] = field(default_factory=dict)


def handshake(store: Store, **kw) -> NodeGroup:
    """Register, validate every node, pass the start barrier; raises HandshakeError (64 or 83) only.

    A store that fails mid-way (node 0 gone, a network error) is a rendezvous failure (83), never a
    traceback."""
    from ..outcome import EXIT_STARTUP

    try:
        return _handshake(store, **kw)
    except HandshakeError:
        raise
    except Exception as exc:
        raise HandshakeError(f"rendezvous failed: the store at {kw.get('store_addr')} stopped answering during the "
                             f"handshake ({type(exc).__name__}: {str(exc)[:200]}); is node 0 still running?",
                             EXIT_STARTUP) from None


def _handshake(store: Store, *, nnodes: int, node_rank: int, run_id: str | None, fp: Mapping[str, str],
               token: str | None, deadline: float, store_addr: str,
               progress: Callable[[str, dict], None] | None = None) -> NodeGroup:
    from ..outcome import EXIT_STARTUP, EXIT_USAGE

    say = progress or (lambda event, fields: log.info(event, **fields))
    if node_rank == 0:
        shared = store.first_writer("run_id", (run_id or "").encode()).decode()
        if not shared:
            raise HandshakeError("node 0 could not publish a run id", EXIT_USAGE)
    host = socket.gethostname()
    claims = store.add(f"node/{node_rank}/claims", 1)
    info = {"host": host, "pid": os.getpid(), "fingerprint": dict(fp), "token": token_digest(token)}
    if claims > 1:
        other = store.get_nowait(f"node/{node_rank}/info")
        who = json.loads(other)["host"] if other else "another supervisor"
        _refuse(store, f"duplicate --node-rank {node_rank}: {who} registered as node {node_rank} first; give "
                f"every node its own --node-rank in 0..{nnodes - 1}")
    store.set(f"node/{node_rank}/info", json.dumps(info).encode())
    next_progress = time.monotonic() + PROGRESS_EVERY_S
    while True:
        refused = store.get_nowait("refused")
        if refused:
            raise HandshakeError(refused.decode(), EXIT_USAGE)
        infos = {}
        for node in range(nnodes):
            raw = store.get_nowait(f"node/{node}/info")
            if raw is not None:
                infos[node] = json.loads(raw)
            if store.add(f"node/{node}/claims", 0) > 1:
                _refuse(store, f"duplicate --node-rank {node}: two supervisors registered as node {node}; "
                        f"give every node its own --node-rank in 0..{nnodes - 1}")
        missing = [node for node in range(nnodes) if node not in infos]
        if not missing:
            break
        now = time.monotonic()
        if now >= deadline:
            raise HandshakeError(
                f"rendezvous timeout: node rank(s) {missing} never registered at the store {store_addr}; start a "
                f"supervise serve with --node-rank {missing[0]} (same --master-addr/--master-port), or raise "
                "--rendezvous-timeout", EXIT_STARTUP)
        if now >= next_progress:
            next_progress = now + PROGRESS_EVERY_S
            say("waiting for nodes", {"missing_node_ranks": missing, "store": store_addr,
                                      "registered": sorted(infos)})
        time.sleep(POLL_S)
    tokens = {node: info.get("token", "") for node, info in infos.items()}
    if len(set(tokens.values())) > 1:
        wrong = sorted(node for node, digest in tokens.items() if digest != tokens[0])
        _refuse(store, f"join token mismatch: node(s) {wrong} did not give node 0's --join-token; give every "
                "node the same --join-token")
    differing = mismatches(infos)
    if differing:
        _refuse(store, "fingerprint mismatch between nodes (every node must run the same job): "
                + " | ".join(differing))
    shared = ""
    while not shared:
        raw = store.get_nowait("run_id")
        shared = raw.decode() if raw else ""
        if not shared:
            if time.monotonic() >= deadline:
                raise HandshakeError(f"rendezvous timeout: node 0 published no run id at {store_addr}", EXIT_STARTUP)
            time.sleep(POLL_S)
    store.add("ready", 1)
    while store.add("ready", 0) < nnodes:
        refused = store.get_nowait("refused")
        if refused:
            raise HandshakeError(refused.decode(), EXIT_USAGE)
        if time.monotonic() >= deadline:
            raise HandshakeError(f"rendezvous timeout: not every node passed the start barrier at {store_addr}",
                                 EXIT_STARTUP)
        time.sleep(POLL_S)
    return NodeGroup(run_id=shared, nnodes=nnodes, node_rank=node_rank, store_addr=store_addr,
                     hosts={node: info["host"] for node, info in infos.items()})


def _refuse(store: Store, message: str) -> None:
    from ..outcome import EXIT_USAGE

    won = store.first_writer("refused", message.encode()).decode()
    raise HandshakeError(won or message, EXIT_USAGE)


def connect(host: str, port: int, is_master: bool, deadline: float,
            progress: Callable[[str, dict], None] | None = None) -> TorchStore:
    """Node 0 hosts the store; the others retry connecting until ``deadline`` (node 0 may start later)."""
    say = progress or (lambda event, fields: log.info(event, **fields))
    from ..outcome import EXIT_STARTUP, EXIT_USAGE

    if is_master:
        try:
            return TorchStore(host if host not in ("localhost",) else "127.0.0.1", port, True)
        except Exception as exc:
            raise HandshakeError(f"node 0 cannot host the store on port {port} ({exc}); free the port or choose "
                                 "another with --store-port", EXIT_USAGE) from None
    last = None
    next_progress = time.monotonic() + PROGRESS_EVERY_S
    while time.monotonic() < deadline:
        if time.monotonic() >= next_progress:
            next_progress = time.monotonic() + PROGRESS_EVERY_S
            say("waiting for nodes", {"missing_node_ranks": [0], "store": f"{host}:{port}",
                                      "detail": "node 0 hosts the store and has not answered yet"})
        try:
            return TorchStore(host, port, False, connect_timeout_s=max(0.5, min(STORE_TIMEOUT_S,
                                                                                deadline - time.monotonic())))
        except Exception as exc:
            last = exc
            time.sleep(0.5)
    raise HandshakeError(f"rendezvous timeout: node 0's store at {host}:{port} never answered ({last}); start node 0 "
                         "(supervise serve --node-rank 0) or check --master-addr/--store-port", EXIT_STARTUP)
