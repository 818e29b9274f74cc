"""Before any rank starts: every node registers, the group is validated, all pass the start barrier.

Bounded by ``--rendezvous-timeout``; refused on every node, with what to
change and nothing started: a duplicate ``--node-rank``, a fingerprint
mismatch (the command and its arguments, or an engine launcher's job field by
field and the engine's version; ``--nnodes``, ``--nproc-per-node``,
tp-supervise, Python and torch versions, ``--fingerprint-env`` keys), a wrong
``--join-token``.
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
from typing import TYPE_CHECKING

import structlog

from ..outcome import valid_run_id
from .messages import MAX_INFO_BYTES, shown
from .store import Store

if TYPE_CHECKING:
    from .transport import NodeTransport

log = structlog.get_logger("supervise.nodes")

POLL_S = 0.1
# A node refused by node 0's gate for its token makes every node refuse once its rank has stayed missing this
# long (a stranger trying tokens while the real node is registered, or about to be, changes nothing).
WRONG_TOKEN_GRACE_S = 5.0


PROGRESS_EVERY_S = 3.0  # handshake progress lines
# The first one: nodes started together register within moments; a node still missing after this is worth a
# line (and so is one still missing when the rendezvous times out, however soon that is).
FIRST_PROGRESS_S = 1.0


TOKEN_MESSAGE = b"tp-supervise join token v1"


def token_digest(token: str | None) -> str:
    """What a node registers instead of its join token (an HMAC: the token itself never leaves the node)."""
    if not token:
        return ""
    return hmac.new(token.encode(), TOKEN_MESSAGE, hashlib.sha256).hexdigest()


def fingerprint(
    command: Sequence[str],
    nproc_per_node: int,
    env_keys: Sequence[str],
    environ: Mapping[str, str] = os.environ,
    max_restarts: int = 0,
    nnodes: int = 1,
    job: Mapping[str, str] | None = None,
    engine_versions: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """What must be equal on every node of one TP group.  ``job``: an engine launcher's job field by field
    (supervisor/launcher.py), compared instead of its command line, whose node-specific flags differ by design;
    ``engine_versions``: the engine's and torch's versions where the launcher runs."""
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    out = {"command": " ".join(command)} if job is None else {f"job.{k}": v for k, v in job.items()}
    out |= {f"engine.{k}": v for k, v in (engine_versions or {}).items()}
    out |= {
        "nnodes": str(nnodes),
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
    store_addr: str  # what the nodes dial (node 0's gate): for messages
    hosts: Mapping[int, str] = field(default_factory=dict)
    client_addr: str = ""  # where one more store client of this supervisor connects (loopback); "" = store_addr

    @property
    def connect_addr(self) -> str:
        return self.client_addr or self.store_addr


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
        raise HandshakeError(
            f"rendezvous failed: the store at {kw.get('store_addr')} stopped answering during the "
            f"handshake ({type(exc).__name__}: {str(exc)[:200]}); is node 0 still running?",
            EXIT_STARTUP,
        ) from None


def _handshake(
    store: Store,
    *,
    nnodes: int,
    node_rank: int,
    run_id: str | None,
    fp: Mapping[str, str],
    token: str | None,
    deadline: float,
    store_addr: str,
    progress: Callable[[str, dict], None] | None = None,
    transport: NodeTransport | None = None,
) -> NodeGroup:
    from ..outcome import EXIT_STARTUP, EXIT_USAGE

    say = progress or (lambda event, fields: log.info(event, **fields))
    if node_rank == 0:
        shared = store.first_writer("run_id", (run_id or "").encode()).decode("utf-8", "replace")
        if not shared:
            raise HandshakeError("node 0 could not publish a run id", EXIT_USAGE)
    host = socket.gethostname()
    claims = store.add(f"node/{node_rank}/claims", 1)
    own = {"host": host, "pid": os.getpid(), "fingerprint": dict(fp), "token": token_digest(token)}
    if claims > 1:
        other = _info(store.get_nowait(f"node/{node_rank}/info"), node_rank)
        who = other["host"] if other else "another supervisor"
        _refuse(
            store,
            f"duplicate --node-rank {node_rank}: {who} registered as node {node_rank} first; give "
            f"every node its own --node-rank in 0..{nnodes - 1}",
        )
    store.set(f"node/{node_rank}/info", json.dumps(own).encode())
    first_progress = time.monotonic() + FIRST_PROGRESS_S
    next_progress = min(first_progress, deadline)
    while True:
        refused = store.get_nowait("refused")
        if refused:
            raise HandshakeError(shown(refused), EXIT_USAGE)
        infos: dict[int, dict] = {}
        for node in range(nnodes):
            info = _info(store.get_nowait(f"node/{node}/info"), node)
            if info is not None:
                infos[node] = info
            if store.add(f"node/{node}/claims", 0) > 1:
                _refuse(
                    store,
                    f"duplicate --node-rank {node}: two supervisors registered as node {node}; "
                    f"give every node its own --node-rank in 0..{nnodes - 1}",
                )
        missing = [node for node in range(nnodes) if node not in infos]
        if transport is not None:
            _what_the_transport_saw(store, transport, missing, nnodes)
        if not missing:
            break
        now = time.monotonic()
        if now >= next_progress:  # before the deadline's refusal: the nodes missing are named at least once
            next_progress = now + PROGRESS_EVERY_S
            say("waiting for nodes", {"missing_node_ranks": missing, "store": store_addr, "registered": sorted(infos)})
        if now >= deadline:
            raise HandshakeError(
                f"rendezvous timeout: node rank(s) {missing} never registered at the store {store_addr}; start a "
                f"supervise serve with --node-rank {missing[0]} (same --master-addr/--master-port), or raise "
                "--rendezvous-timeout",
                EXIT_STARTUP,
            )
        time.sleep(POLL_S)
    tokens = {node: info.get("token", "") for node, info in infos.items()}
    if len(set(tokens.values())) > 1:
        wrong = sorted(node for node, digest in tokens.items() if digest != tokens[0])
        _refuse(
            store,
            f"join token mismatch: node(s) {wrong} did not give node 0's --join-token; give every "
            "node the same --join-token",
        )
    differing = mismatches(infos)
    if differing:
        _refuse(
            store, "fingerprint mismatch between nodes (every node must run the same job): " + " | ".join(differing)
        )
    shared = ""
    while not shared:
        raw = store.get_nowait("run_id")
        shared = raw.decode("utf-8", "replace") if raw else ""
        if shared and not valid_run_id(shared):
            raise HandshakeError(
                f"node 0 published a run id that is not one ({shown(raw or b'')}): refusing it; "
                "run ids are letters, digits, '.', '_' and '-'",
                EXIT_USAGE,
            )
        if not shared:
            if time.monotonic() >= deadline:
                raise HandshakeError(f"rendezvous timeout: node 0 published no run id at {store_addr}", EXIT_STARTUP)
            time.sleep(POLL_S)
    store.add("ready", 1)
    while store.add("ready", 0) < nnodes:
        refused = store.get_nowait("refused")
        if refused:
            raise HandshakeError(shown(refused), EXIT_USAGE)
        if transport is not None:
            _what_the_transport_saw(store, transport, [], nnodes)
        if time.monotonic() >= deadline:
            raise HandshakeError(
                f"rendezvous timeout: not every node passed the start barrier at {store_addr}", EXIT_STARTUP
            )
        time.sleep(POLL_S)
    return NodeGroup(
        run_id=shared,
        nnodes=nnodes,
        node_rank=node_rank,
        store_addr=store_addr,
        hosts={node: info["host"] for node, info in infos.items()},
        client_addr=transport.client_addr if transport is not None else "",
    )


def _refuse(store: Store, message: str) -> None:
    from ..outcome import EXIT_USAGE

    won = store.first_writer("refused", message.encode())
    raise HandshakeError(shown(won) if won else message, EXIT_USAGE)


def _info(raw: bytes | None, node: int) -> dict | None:
    """Node ``node``'s registration, or None when absent or not one (logged: a stranger's value is data)."""
    if raw is None:
        return None
    try:
        info = json.loads(raw)
        if (
            isinstance(info, dict)
            and isinstance(info.get("host"), str)
            and isinstance(info.get("fingerprint"), dict)
            and len(raw) <= MAX_INFO_BYTES
        ):
            info["host"] = shown(info["host"].encode(), 255)
            return info
    except ValueError:
        pass
    log.warning(
        "a registration in the store is not one: ignored",
        event_name="store_value_dropped",
        key=f"node/{node}/info",
        value=shown(raw, 120),
    )
    return None


def _what_the_transport_saw(store: Store, transport: NodeTransport, missing: list[int], nnodes: int) -> None:
    """What the gate or the link reported during the handshake: a second node 0, a node refused for its token
    (once it is clear the real node of that rank is not coming), node 0 gone."""
    from ..outcome import EXIT_STARTUP

    now = time.monotonic()
    for kind, node, detail, at in list(transport.refusals):
        if kind == "probe":
            _refuse(
                store,
                f"{detail}: is `--node-rank 0` given twice? Give each node its own --node-rank in 0..{nnodes - 1}",
            )
        if kind == "token" and node in missing and now - at >= WRONG_TOKEN_GRACE_S:
            _refuse(
                store,
                f"join token mismatch: a supervisor claiming node {node} ({detail}) gave another "
                "--join-token; give every node the same --join-token",
            )
    for node, detail in list(transport.lost):
        if node == 0:
            raise HandshakeError(f"rendezvous failed: {detail}", EXIT_STARTUP)
