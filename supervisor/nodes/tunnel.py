"""A node's side of the gate: its store connections tunnelled through it, and its one link to node 0.

``Tunnel`` listens on loopback; each store client of this supervisor (torch's
``TCPStore`` client) connects there, and the tunnel carries its bytes to node
0's gate in authenticated frames (``wire``).  A gate that refuses (wrong
token, wrong node rank) is remembered in ``refused``, so the handshake can say
why instead of timing out.

``LinkClient`` holds the link: it pings every ``BEAT_S`` and hears ``ring``
(read the store now), ``lost <node> <why>`` (node 0 saw a node go) and
``bye`` (node 0 ends cleanly).  The link closing without ``bye`` means node
0's supervisor died (its kernel closed the socket: known within
milliseconds); silence for ``NODE_LOST_S`` means its host or the network is
gone.  Either way ``on_lost(0, why)`` is called once.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import structlog

from .gate import BEAT_S, NODE_LOST_S
from .wire import Channel, ChannelError, Refused, client_hello, splice

log = structlog.get_logger("supervise.nodes")

CONNECT_TIMEOUT_S = 3.0
OFFSET_SAMPLES = 64


def open_channel(
    gate: tuple[str, int], kind: str, node: int, token: str | None, timeout_s: float = CONNECT_TIMEOUT_S
) -> Channel:
    """A connected, authenticated channel to node 0's gate (raises ``Refused``, ``ChannelError``, ``OSError``)."""
    sock = socket.create_connection(gate, timeout=timeout_s)
    try:
        return client_hello(sock, kind, node, token, timeout_s)
    except BaseException:
        sock.close()
        raise


class Tunnel:
    """Loopback listener whose connections go to node 0's store through the gate."""

    def __init__(self, gate: tuple[str, int], node: int, token: str | None):
        self.gate = gate
        self.node = node
        self.token = token
        self.refused: str | None = None  # the gate's last "no", for the handshake's message
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closing = False
        self._thread = threading.Thread(target=self._accept, name="node-tunnel", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closing = True
        try:
            self._listener.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._closing:
            try:
                local, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._carry, args=(local,), name="node-tunnel-conn", daemon=True).start()

    def _carry(self, local: socket.socket) -> None:
        try:
            chan = open_channel(self.gate, "store", self.node, self.token)
        except Refused as exc:
            self.refused = str(exc)
            local.close()
            return
        except (OSError, ChannelError):
            local.close()  # the store client sees the connection end: node 0 unreachable, as without us
            return
        splice(chan, local, "node-tunnel-pipe")


class LinkClient:
    """This node's link to node 0 (see the module docstring); callbacks run on its thread."""

    def __init__(
        self,
        gate: tuple[str, int],
        node: int,
        token: str | None,
        on_lost: Callable[[int, str], None],
        on_ring: Callable[[], None],
        node_lost_s: float = NODE_LOST_S,
    ):
        self.gate, self.node, self.token = gate, node, token
        self.node_lost_s = node_lost_s
        self.on_lost, self.on_ring = on_lost, on_ring
        self._chan: Channel | None = None
        self._closing = False
        self._offsets: deque[tuple[float, float]] = deque(maxlen=OFFSET_SAMPLES)  # (offset, error) per round trip
        self._node0_done = False
        self._thread = threading.Thread(target=self._run, name="node-link-conn", daemon=True)

    def start(self) -> None:
        """Connect (raises like ``open_channel``), then watch on a thread."""
        self._chan = open_channel(self.gate, "link", self.node, self.token)
        self._chan.sock.settimeout(BEAT_S)
        self._thread.start()

    def ring(self) -> None:
        self._send(b"ring")

    def clock_offset(self) -> tuple[float, float] | None:
        """(offset, error): node 0's monotonic clock = this host's + offset, within +- error (the round trip
        of the best of the recent pings: NTP's minimum-delay filter); None before the first pong."""
        return min(self._offsets, key=lambda s: s[1], default=None)

    def bye(self) -> None:
        """This node ends cleanly (its link closing is then no loss)."""
        self._send(b"bye")

    def close(self) -> None:
        self._closing = True
        if self._chan is not None:
            self._chan.close()

    def _send(self, frame: bytes) -> None:
        chan = self._chan
        if chan is None:
            return
        try:
            chan.send(frame)
        except OSError:
            pass  # the thread sees the link end

    def _run(self) -> None:
        chan = self._chan
        assert chan is not None
        last_heard = next_ping = sent = time.monotonic()
        why = ""
        try:
            while not self._closing:
                now = time.monotonic()
                if now >= next_ping:
                    chan.send(b"ping")
                    sent = time.monotonic()
                    next_ping = now + BEAT_S
                try:
                    frame = chan.recv()
                except TimeoutError:
                    silent = time.monotonic() - last_heard
                    if silent >= self.node_lost_s:
                        why = (
                            f"node 0 (the store's host) did not answer for {silent:.1f} s: its host is down, its "
                            "supervisor is frozen, or the network is partitioned"
                        )
                        break
                    continue
                if frame is None:
                    why = "the link to node 0 closed: its supervisor, and the store it hosts, are gone"
                    break
                last_heard = time.monotonic()
                if frame.startswith(b"pong "):
                    try:
                        remote = float(frame[5:])
                        self._offsets.append((remote - (sent + last_heard) / 2, (last_heard - sent) / 2))
                    except ValueError:
                        pass
                elif frame == b"ring":
                    self.on_ring()
                elif frame == b"bye":
                    self._node0_done = True
                elif frame.startswith(b"lost "):
                    self._peer_lost(frame)
        except (OSError, ChannelError) as exc:
            why = f"the link to node 0 (the store's host) broke: {exc}"[:300]
        if why and not self._closing and not self._node0_done:
            self.on_lost(0, why)

    def _peer_lost(self, frame: bytes) -> None:
        parts = frame.decode("utf-8", "replace").split(" ", 2)
        if len(parts) == 3 and parts[1].isdigit():
            self.on_lost(int(parts[1]), parts[2])
