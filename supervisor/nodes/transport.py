"""How a supervisor reaches the group: node 0 hosts (store child + gate), the others dial in (link + tunnel).

``open_transport`` runs before the handshake and returns a ``NodeTransport``:
this supervisor's store client, the loopback address where more clients of
it connect (the cross-node consensus, the incident exchange), and the link
(node 0: its ``Gate``; the others: their ``LinkClient``).  Until the node link
takes them over, what the gate or the link reports (a refused connection, a
lost node) waits in ``refusals`` and ``lost`` for the handshake to read.

Operator mistakes end here with exit 64 and the words for them: a second
``--node-rank 0`` finds a gate already on the port (and the first hears of
it and refuses too); a node whose ``--join-token`` differs is refused by the
gate (and, once it is clear the real node of that rank is not coming, the
others refuse too, rather than wait for the rendezvous timeout).
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from .gate import NODE_LOST_S, Gate
from .store import STORE_TIMEOUT_S, TorchStore
from .store_host import DEFAULT_MEMORY_BYTES, StoreHost, StoreHostError
from .tunnel import LinkClient, Tunnel, open_channel
from .wire import ChannelError, Refused

log = structlog.get_logger("supervise.nodes")

RETRY_S = 0.2  # a node dialling node 0 before it is up tries again this often


class TransportError(RuntimeError):
    """The group cannot be reached; ``code`` is the exit code (64 refused, 83 timeout)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass
class NodeTransport:
    store: TorchStore
    client_addr: str  # loopback host:port where another store client of this supervisor connects
    public_addr: str  # host:port the nodes use (node 0's gate)
    node_rank: int
    gate: Gate | None = None
    host: StoreHost | None = None
    link: LinkClient | None = None
    tunnel: Tunnel | None = None
    refusals: deque = field(default_factory=lambda: deque(maxlen=256))  # (kind, node, detail, monotonic)
    lost: deque = field(default_factory=lambda: deque(maxlen=64))  # (node, detail)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _handlers: tuple[Callable[[int, str], None], Callable[[], None]] | None = None

    # -- callbacks of the gate / the link ----------------------------------------------------------
    def _on_lost(self, node: int, detail: str) -> None:
        with self._lock:
            handlers = self._handlers
            if handlers is None:
                self.lost.append((node, detail))
        if handlers is not None:
            handlers[0](node, detail)

    def _on_ring(self) -> None:
        handlers = self._handlers
        if handlers is not None:
            handlers[1]()

    def _on_refused(self, kind: str, node: int, detail: str) -> None:
        self.refusals.append((kind, node, detail, time.monotonic()))

    def attach(self, on_lost: Callable[[int, str], None], on_ring: Callable[[], None]) -> None:
        """From now on the link's news goes to the node link (what came before first)."""
        with self._lock:
            self._handlers = (on_lost, on_ring)
            early = list(self.lost)
            self.lost.clear()
        for node, detail in early:
            on_lost(node, detail)

    # -- what the node link asks -------------------------------------------------------------------
    def ring(self) -> None:
        """Something was published: every node reads the store now."""
        if self.gate is not None:
            self.gate.ring()
        elif self.link is not None:
            self.link.ring()

    def bye(self) -> None:
        if self.gate is not None:
            self.gate.bye()
        elif self.link is not None:
            self.link.bye()

    def departed(self) -> set[int]:
        """Node 0: the nodes whose link is down or said goodbye (they read its store no more)."""
        return self.gate.departed() if self.gate is not None else set()

    def clock_offset(self) -> tuple[float, float] | None:
        """(offset, error) of node 0's monotonic clock against this host's; node 0: (0, 0)."""
        if self.gate is not None:
            return 0.0, 0.0
        return self.link.clock_offset() if self.link is not None else None

    def store_problem(self) -> str | None:
        """Node 0: its store process died (its memory cap, a kill)."""
        if self.host is not None and not self.host.alive():
            return f"node 0's store process {self.host.describe_exit()}"
        return None

    def close(self) -> None:
        for part in (self.link, self.tunnel, self.gate):
            if part is not None:
                part.close()
        if self.host is not None:
            self.host.stop()


def bind_host(master_addr: str) -> tuple[str, bool]:
    """The address node 0's gate listens on: ``--master-addr`` when it is an address of this host
    (True), else every interface (False: behind NAT, or a name that resolves elsewhere)."""
    addr = "127.0.0.1" if master_addr == "localhost" else master_addr
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return "0.0.0.0", False
    for family, _, _, _, sockaddr in infos:
        address = sockaddr[0]
        if not isinstance(address, str):  # not an IP family
            continue
        probe = socket.socket(family, socket.SOCK_DGRAM)
        try:
            probe.bind((address, 0))
            return address, True
        except OSError:
            continue
        finally:
            probe.close()
    return "0.0.0.0", False


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")


def open_transport(
    master_addr: str,
    port: int,
    nnodes: int,
    node_rank: int,
    token: str | None,
    deadline: float,
    progress: Callable[[str, dict], None] | None = None,
    store_memory: int = DEFAULT_MEMORY_BYTES,
    node_lost_s: float = NODE_LOST_S,
) -> NodeTransport:
    """Node 0 hosts; the others retry until ``deadline`` (node 0 may start later).  Raises TransportError."""
    from ..outcome import EXIT_STARTUP, EXIT_USAGE

    say = progress or (lambda event, fields: log.info(event, **fields))
    if node_rank == 0:
        return _host(master_addr, port, nnodes, token, store_memory, node_lost_s)
    gate_addr = ("127.0.0.1" if master_addr == "localhost" else master_addr, port)
    next_progress = time.monotonic() + 3.0
    last: Exception | None = None
    transport: NodeTransport | None = None
    link = None
    while time.monotonic() < deadline:
        if time.monotonic() >= next_progress:
            next_progress = time.monotonic() + 3.0
            say(
                "waiting for nodes",
                {
                    "missing_node_ranks": [0],
                    "store": f"{master_addr}:{port}",
                    "detail": "node 0 hosts the store and has not answered yet",
                },
            )
        try:
            link = LinkClient(
                gate_addr, node_rank, token, on_lost=lambda n, d: None, on_ring=lambda: None, node_lost_s=node_lost_s
            )
            link.start()
            break
        except Refused as exc:
            raise TransportError(f"node 0 at {master_addr}:{port} refused this node: {exc}", EXIT_USAGE) from None
        except (OSError, ChannelError) as exc:
            last = exc
            time.sleep(RETRY_S)
    else:
        raise TransportError(
            f"rendezvous timeout: node 0's store at {master_addr}:{port} never answered ({last}); "
            "start node 0 (supervise serve --node-rank 0) or check --master-addr/--store-port",
            EXIT_STARTUP,
        )
    tunnel = Tunnel(gate_addr, node_rank, token)
    try:
        store = TorchStore(
            "127.0.0.1",
            tunnel.port,
            False,
            connect_timeout_s=max(1.0, min(STORE_TIMEOUT_S * 3, deadline - time.monotonic())),
        )
    except Exception as exc:
        link.close()
        tunnel.close()
        if tunnel.refused:
            raise TransportError(
                f"node 0 at {master_addr}:{port} refused this node: {tunnel.refused}", EXIT_USAGE
            ) from None
        raise TransportError(
            f"node 0's store at {master_addr}:{port} did not answer through its gate ({exc})", EXIT_STARTUP
        ) from None
    transport = NodeTransport(
        store=store,
        client_addr=tunnel.address,
        public_addr=f"{master_addr}:{port}",
        node_rank=node_rank,
        link=link,
        tunnel=tunnel,
    )
    link.on_lost, link.on_ring = transport._on_lost, transport._on_ring
    return transport


def _host(
    master_addr: str, port: int, nnodes: int, token: str | None, store_memory: int, node_lost_s: float
) -> NodeTransport:
    from ..outcome import EXIT_USAGE

    host, local = bind_host(master_addr)
    try:
        listener = socket.create_server((host, port), backlog=1024)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise TransportError(_who_holds(master_addr if local else "127.0.0.1", port, token), EXIT_USAGE) from None
        raise TransportError(
            f"node 0 cannot listen on {host}:{port} ({exc}); pick another --store-port", EXIT_USAGE
        ) from None
    if not local:
        log.warning(
            "--master-addr is not an address of this host: node 0's store listens on every interface",
            event_name="store_listens_everywhere",
            master_addr=master_addr,
            port=port,
        )
    if not token and not (local and _is_loopback(host)):
        log.warning(
            "multi-node without --join-token: anyone who can reach this port can register as a node, "
            "stop every node or fake a fault; give every node the same --join-token (or "
            "SUPERVISE_JOIN_TOKEN) on any network you do not fully trust",
            event_name="store_unauthenticated",
            address=f"{host}:{port}",
        )
    try:
        store_host = StoreHost(store_memory)
    except StoreHostError as exc:
        listener.close()
        raise TransportError(str(exc), EXIT_USAGE) from None
    try:
        store = TorchStore("127.0.0.1", store_host.port, False)
    except Exception as exc:
        listener.close()
        store_host.stop()
        raise TransportError(f"node 0 could not reach its own store ({exc})", EXIT_USAGE) from None
    transport = NodeTransport(
        store=store,
        client_addr=f"127.0.0.1:{store_host.port}",
        public_addr=f"{master_addr}:{listener.getsockname()[1]}",
        node_rank=0,
        host=store_host,
    )
    gate = Gate(
        listener,
        store_host.port,
        token,
        nnodes,
        on_lost=transport._on_lost,
        on_ring=transport._on_ring,
        on_refused=transport._on_refused,
        node_lost_s=node_lost_s,
    )
    transport.gate = gate
    gate.start()
    return transport


def _who_holds(host: str, port: int, token: str | None) -> str:
    """The gate port is taken: by another node 0 of this group (the usual mistake), or by something else."""
    try:
        chan = open_channel((host, port), "probe", 0, token)
        chan.close()
        return (
            f"another supervisor already hosts node 0 for this group at {host}:{port}: is `--node-rank 0` given "
            "twice? Give each node its own --node-rank"
        )
    except Refused:
        return (
            f"another supervisor already hosts node 0 at {host}:{port} (with another --join-token): is "
            "`--node-rank 0` given twice, or is another job using this --store-port?"
        )
    except (OSError, ChannelError):
        return (
            f"port {port} on {host} is in use by something that is not a tp-supervise store; stop it or pick "
            "another --store-port"
        )
