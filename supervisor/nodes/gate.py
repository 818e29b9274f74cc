"""Node 0's gate: the one port the other nodes reach, in front of the store and the node links.

The store itself (torch's ``TCPStore``, in its own child process: ``store_host``)
listens on loopback only; the gate listens on the address the nodes use
(``--master-addr``) and lets a connection through only after its hello (and,
with ``--join-token``, the challenge-response of ``wire``).  Three kinds of
connection:

- ``store``: a tunnelled store client of another node; its frames are piped to
  the loopback store and back;
- ``link``: one per node, for as long as its supervisor lives: the connection
  that carries its frames (a dial abandoned after its hello carries none, and
  is nobody's link).  The node pings every ``BEAT_S`` and the gate answers;
  ``ring`` frames (something was published: a fault, a stop, a hang query)
  are passed to every other node at once, so nobody waits for a poll; ``bye``
  says the node ends (cleanly, or with its end known to the group).  The link
  closing without ``bye`` (the supervisor died: the kernel closed its sockets)
  or staying silent for ``NODE_LOST_S`` (its host is gone, or a partition)
  makes the node lost here and, through a ``lost`` frame, on every other node
  within moments;
- ``probe``: a second supervisor that was told ``--node-rank 0`` too found
  the port taken and asks who holds it; both refuse (exit 64).

One thread per connection (a few per node), blocking reads with timeouts; the
number of connections is bounded, so is every buffer (a frame is at most 64
KiB), and a connection that does not finish its hello in 3 s is closed.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import structlog

from .wire import Channel, ChannelError, Refused, WrongToken, server_hello, splice

log = structlog.get_logger("supervise.nodes")

BEAT_S = 0.25  # link pings (the node's side) and the read timeout of a link connection here
NODE_LOST_S = 4.0  # a link silent this long is a lost node (no FIN: host loss, partition)
STORE_CONNECT_S = 2.0
CONNECTIONS_PER_NODE = 8
REFUSAL_REPORT_EVERY_S = 5.0


class Gate:
    """Accepts on ``listener`` (bound to the nodes' address); calls back on the gate's threads:
    ``on_lost(node, detail)``, ``on_ring()``, ``on_refused(kind, node, detail)`` (a wrong token, a
    duplicate link, a probe by a second node 0)."""

    def __init__(
        self,
        listener: socket.socket,
        store_port: int,
        token: str | None,
        nnodes: int,
        on_lost: Callable[[int, str], None],
        on_ring: Callable[[], None],
        on_refused: Callable[[str, int, str], None],
        node_lost_s: float = NODE_LOST_S,
    ):
        self.listener = listener
        self.store_port = store_port
        self.token = token
        self.nnodes = nnodes
        self.on_lost, self.on_ring, self.on_refused = on_lost, on_ring, on_refused
        self.node_lost_s = node_lost_s
        self._lock = threading.Lock()
        self._links: dict[int, Channel] = {}  # node -> its link: the connection that carried its frames
        self._pending: dict[Channel, int] = {}  # links past their hello that carried no frame yet
        self._done: set[int] = set()
        self._conns = 0
        self._max_conns = CONNECTIONS_PER_NODE * nnodes + 16
        self._closing = False
        self._last_refusal_log = 0.0
        self._thread = threading.Thread(target=self._accept, name="node-gate", daemon=True)

    @property
    def address(self) -> str:
        host, port = self.listener.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def ring(self) -> None:
        """Node 0 published something: every other node reads the store now."""
        self._broadcast(b"ring", skip=None)

    def bye(self) -> None:
        """Node 0 ends cleanly: its links closing from now on is no loss."""
        self._broadcast(b"bye", skip=None)

    def lost(self, node: int, detail: str) -> None:
        """Node 0 learnt that ``node`` is lost: the others hear it from the gate at once."""
        self._broadcast(f"lost {node} {detail}".encode()[:1024], skip=node)

    def departed(self) -> set[int]:
        """The other nodes whose link is down (their supervisor exited) or said goodbye."""
        with self._lock:
            return {n for n in range(1, self.nnodes) if n not in self._links or n in self._done}

    def close(self) -> None:
        self._closing = True
        try:
            self.listener.close()
        except OSError:
            pass
        with self._lock:
            links = list(self._links.values()) + list(self._pending)
        for chan in links:
            chan.close()

    # -- threads -----------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                if self._closing:
                    return
                time.sleep(0.05)
                continue
            with self._lock:
                full = self._conns >= self._max_conns
                if not full:
                    self._conns += 1
            if full:
                sock.close()
                self._refusal("too many connections", -1, f"from {peer[0]}: at most {self._max_conns}")
                continue
            threading.Thread(target=self._serve, args=(sock, peer[0]), name="node-gate-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            try:
                kind, node, chan = server_hello(sock, self.token, self.nnodes)
            except WrongToken as exc:
                self._refusal("token", exc.node, f"from {peer}: {exc}")
                return
            except Refused as exc:
                self._refusal("hello", -1, f"from {peer}: {exc}")
                return
            except (ChannelError, OSError):
                return  # a port scanner, a half-open connection, a slow client: nothing to say
            if kind == "store":
                self._pipe_to_store(chan)
            elif kind == "link":
                self._serve_link(node, chan, peer)
            else:
                self._refusal("probe", node, f"another supervisor at {peer} also started as node 0 for this group")
                try:
                    chan.send(b"node0")
                except OSError:
                    pass
        finally:
            sock.close()
            with self._lock:
                self._conns -= 1

    def _refusal(self, kind: str, node: int, detail: str) -> None:
        try:
            self.on_refused(kind, node, detail)
        except Exception as exc:
            log.error("node gate: refusal not handled", event_name="gate_refusal_not_handled", error=repr(exc)[:200])
        now = time.monotonic()
        if now - self._last_refusal_log >= REFUSAL_REPORT_EVERY_S:  # a flood of strangers is one line a while
            self._last_refusal_log = now
            log.warning("node gate refused a connection", event_name="gate_refused", kind=kind, detail=detail[:300])

    def _pipe_to_store(self, chan: Channel) -> None:
        try:
            store = socket.create_connection(("127.0.0.1", self.store_port), timeout=STORE_CONNECT_S)
        except OSError:
            return
        splice(chan, store, "node-gate-pipe", STORE_CONNECT_S)

    def _serve_link(self, node: int, chan: Channel, peer: str) -> None:
        """A link becomes ``node``'s life line with its first frame, not with its hello: a dial its client
        gave up on (its hello timed out on a busy gate, and it dialled again) waited in the backlog with its
        hello and may finish it after the real link did, but it never carries a frame.  Registered at its
        hello it took the real link's place, and the real link's close (the supervisor SIGKILLed) was then
        nobody's loss: the node was lost only when its beats stopped (issue 26)."""
        with self._lock:
            self._pending[chan] = node  # rings reach it from its hello on
        chan.sock.settimeout(BEAT_S)
        last = time.monotonic()
        why = ""
        mine = False  # this connection carried a frame: it is the node's link
        try:
            while not self._closing:
                try:
                    frame = chan.recv()
                except TimeoutError:
                    silent = time.monotonic() - last
                    if silent >= self.node_lost_s:
                        why = f"node {node} ({peer}) did not answer for {silent:.1f} s (host down or network partition)"
                        break
                    continue
                if frame is None:
                    why = f"node {node}'s supervisor ({peer}) closed its link without saying goodbye: it is gone"
                    break
                last = time.monotonic()
                if not mine:
                    with self._lock:
                        self._pending.pop(chan, None)
                        mine = node not in self._links
                        if mine:
                            self._links[node] = chan
                    if not mine:  # another live link of this node beats already: two supervisors, one rank
                        self._refusal(
                            "link",
                            node,
                            f"a second link for node {node} from {peer}: is --node-rank {node} given twice?",
                        )
                        return
                if frame == b"ping":
                    chan.send(b"pong %.9f" % time.monotonic())  # node 0's clock: the others' offset to it
                elif frame == b"ring":
                    self.on_ring()
                    self._broadcast(b"ring", skip=node)
                elif frame == b"bye":
                    with self._lock:
                        self._done.add(node)
        except (OSError, ChannelError) as exc:
            why = f"node {node}'s link ({peer}) broke: {exc}"[:300]
        finally:
            with self._lock:
                self._pending.pop(chan, None)
                if mine:
                    del self._links[node]
                done = node in self._done
            chan.close()
        # A link that never carried a frame was never a node's life line (an abandoned dial): no loss.
        if why and mine and not done and not self._closing:
            self.on_lost(node, why)
            self.lost(node, why)

    def _broadcast(self, frame: bytes, skip: int | None) -> None:
        with self._lock:
            targets = [(n, c) for n, c in self._links.items() if n != skip]
            targets += [(n, c) for c, n in self._pending.items() if n != skip]
        for _node, chan in targets:
            try:
                chan.send(frame)
            except OSError:
                pass  # that link's own thread sees it end
