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
from .wire import ChannelError, Refused, refuse_hello

log = structlog.get_logger("supervise.nodes")

RETRY_S = 0.2  # a node dialling node 0 before it is up tries again this often
# A node > 0 on the host --master-addr names, refused there (nothing listens) this long: no node 0 is coming to
# this host (its supervisor binds the port within a second or two of its start).  Then it stands in on the port
# for STAND_IN_S, telling whoever dials why (a second --node-rank R elsewhere learns it is a duplicate), and exits.
NO_NODE_0_S = 8.0
STAND_IN_S = 3.0
# A second node 0 finds the port taken and probes the holder: a node 0 still starting (its store child, then its
# gate) may take seconds to answer on a loaded host; past this, the holder is something else.
PROBE_PATIENCE_S = 10.0
PROGRESS_S = 3.0


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


def dial_problem(exc: BaseException | None) -> str:
    """What a failed dial of node 0 says about it, in an operator's words."""
    if exc is None:
        return "not tried yet"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (the host answers but nothing listens on the port: node 0's supervisor is not up)"
    if isinstance(exc, socket.gaierror):
        return f"the name does not resolve ({exc.strerror or exc})"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "no answer (timed out: the host is down, unreachable or firewalled, or the address is wrong)"
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return f"no route to the host ({exc.strerror})"
    return f"{type(exc).__name__}: {str(exc)[:160]}"


def stand_in(addr: tuple[str, int], port: int, master_addr: str, node_rank: int) -> str | None:
    """This host holds --master-addr, but its node is not node 0 and nothing listens on the store port: nobody
    is node 0 here.  Hold the port for ``STAND_IN_S`` telling every node that dials why, then return this node's
    own refusal (it names a duplicate --node-rank when another node dialled claiming this node's rank).  None: the
    port was taken meanwhile (a node 0 came up after all)."""
    try:
        listener = socket.create_server(addr, backlog=64)
    except OSError:
        return None
    host = socket.gethostname()
    seen: list[tuple[str, int]] = []  # (address, node rank) of whoever dialled

    def reason(kind: str, node: int) -> str:
        if node == node_rank:
            return (
                f"duplicate --node-rank {node}: the supervisor on {host} ({master_addr}, the --master-addr) was "
                f"given --node-rank {node} too, and nobody is node 0; the node at --master-addr must be "
                "--node-rank 0"
            )
        return (
            f"nobody is node 0: the supervisor on {host} ({master_addr}, the --master-addr) was given "
            f"--node-rank {node_rank}; the node at --master-addr must be --node-rank 0"
        )

    end = time.monotonic() + STAND_IN_S
    listener.settimeout(0.2)
    try:
        while time.monotonic() < end:
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            with conn:
                try:
                    kind, node = refuse_hello(conn, reason, timeout_s=1.0)
                    seen.append((str(peer[0]), node))
                except (OSError, ChannelError):
                    pass
    finally:
        listener.close()
    twins = sorted({peer for peer, node in seen if node == node_rank})
    if twins:
        return (
            f"duplicate --node-rank {node_rank}: a supervisor at {', '.join(twins)} claims node {node_rank} too, "
            f"and nobody is node 0 at {master_addr}:{port}; --master-addr {master_addr} is this host's, so this "
            "node must be --node-rank 0"
        )
    return (
        f"nobody is node 0: nothing listens on {master_addr}:{port} and --master-addr {master_addr} is this "
        f"host's, but this node was given --node-rank {node_rank}; give the node at --master-addr --node-rank 0 "
        f"(is --node-rank {node_rank} given twice?)"
    )


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
    here = bind_host(master_addr)[1]  # --master-addr is this host's: node 0 would run here
    started = time.monotonic()
    next_progress = started + PROGRESS_S
    tries = 0
    last: Exception | None = None
    refused_since: float | None = None
    transport: NodeTransport | None = None
    link = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if now >= next_progress:
            next_progress = now + PROGRESS_S
            say(
                "waiting for nodes",
                {
                    "missing_node_ranks": [0],
                    "store": f"{master_addr}:{port}",
                    "tried": tries,
                    "for_s": round(now - started, 1),
                    "detail": f"node 0 hosts the store and has not answered yet: {dial_problem(last)}",
                },
            )
        try:
            tries += 1
            link = LinkClient(
                gate_addr, node_rank, token, on_lost=lambda n, d: None, on_ring=lambda: None, node_lost_s=node_lost_s
            )
            link.start()
            break
        except Refused as exc:
            raise TransportError(f"node 0 at {master_addr}:{port} refused this node: {exc}", EXIT_USAGE) from None
        except (OSError, ChannelError) as exc:
            last = exc
            if here and isinstance(exc, ConnectionRefusedError):
                refused_since = refused_since if refused_since is not None else now
                if now - refused_since >= NO_NODE_0_S:
                    message = stand_in(gate_addr, port, master_addr, node_rank)
                    if message is not None:
                        raise TransportError(message, EXIT_USAGE) from None
                    refused_since = None  # the port was taken meanwhile: dial whoever holds it
            else:
                refused_since = None
            time.sleep(RETRY_S)
    else:
        raise TransportError(
            f"rendezvous timeout: node 0's store at {master_addr}:{port} never answered: tried {tries} times over "
            f"{time.monotonic() - started:.0f} s; last: {dial_problem(last)}. Start node 0 (supervise serve "
            "--node-rank 0) there, or check --master-addr/--store-port",
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


def _who_holds(host: str, port: int, token: str | None, patience_s: float = PROBE_PATIENCE_S) -> str:
    """The gate port is taken: by another node 0 of this group (the usual mistake), or by something else.

    A node 0 binds its port before its store child is up and answers a hello only once its gate runs (seconds
    on a loaded host): a probe left unanswered is sent again until ``patience_s`` before the holder is called a
    stranger."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            chan = open_channel((host, port), "probe", 0, token)
            chan.close()
            return (
                f"another supervisor already hosts node 0 for this group at {host}:{port}: is `--node-rank 0` given "
                "twice? Give each node its own --node-rank"
            )
        except Refused as exc:
            if str(exc).startswith(("duplicate", "nobody is node 0")):  # a node > 0 standing in: it exits soon
                return f"port {port} on {host} is held by a supervisor that is not node 0: {exc}"
            return (
                f"another supervisor already hosts node 0 at {host}:{port} (with another --join-token): is "
                "`--node-rank 0` given twice, or is another job using this --store-port?"
            )
        except (OSError, ChannelError):
            if time.monotonic() >= deadline:
                return (
                    f"port {port} on {host} is in use by something that is not a tp-supervise store; stop it or "
                    "pick another --store-port"
                )
            time.sleep(RETRY_S)
