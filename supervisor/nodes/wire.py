"""The wire between a node's supervisor and node 0's gate: a hello, a challenge-response, then frames.

Every connection a supervisor makes to node 0 (its store connections, tunnelled,
and its one link connection) starts with this exchange, so nothing reaches the
store, and nobody is counted as a node, before it is authenticated::

    client -> gate   TPSV1 <kind> <node rank> <client nonce, 32 hex>\\n      kind: store | link | probe
    gate -> client   TPSV1 OK <gate nonce, 32 hex> <1: token | 0: none>\\n    or  TPSV1 NO <reason>\\n
    (token only)
    client -> gate   <HMAC(token, "client" | nonces | kind | node), hex>\\n
    gate -> client   <HMAC(token, "gate"   | nonces | kind | node), hex>\\n     or  TPSV1 NO <reason>\\n

Both nonces are fresh per connection, so a recorded exchange proves nothing
the next time (no replay), and each side proves it knows the token without
sending it.  Then both directions carry frames::

    +-----------+-------------------+---------------------------------------+
    | length u32| payload (<= 64 KiB)| MAC: HMAC-SHA256(key, seq u64 | payload)[:16]  (token only) |
    +-----------+-------------------+---------------------------------------+

with one key per direction derived from the token and both nonces, and a
sequence number per direction that is never sent: a frame that is forged,
changed, replayed, reordered or dropped fails the MAC and ends the
connection.  Without a token the frames have no MAC (the operator was
warned: anyone who reaches the port can then do what a node can).

Blocking sockets with a timeout on every read; one ``Channel`` per
connection, ``send`` safe from several threads.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Callable

MAGIC = "TPSV1"
KINDS = ("store", "link", "probe")
MAX_FRAME = 64 * 1024
MAX_LINE = 512
MAC_BYTES = 16
NONCE_BYTES = 16
HELLO_TIMEOUT_S = 3.0  # a connection that has not finished its hello by then is closed
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


class ChannelError(ConnectionError):
    """The peer broke the protocol (bad MAC, oversized frame, malformed hello) or the connection ended."""


class Refused(ConnectionError):
    """The other side said no (``TPSV1 NO <reason>``), or the token did not match."""


class WrongToken(Refused):
    """The gate's side: a client claiming ``node`` did not prove it knows the join token."""

    def __init__(self, message: str, node: int):
        super().__init__(message)
        self.node = node


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def _read_line(sock: socket.socket) -> str:
    """One ``\\n``-terminated ASCII line of at most MAX_LINE bytes, read a byte at a time (the hello is tiny
    and nothing after it may be consumed here)."""
    buf = bytearray()
    while len(buf) < MAX_LINE:
        b = sock.recv(1)
        if not b:
            raise ChannelError("connection closed during the hello")
        if b == b"\n":
            try:
                return buf.decode("ascii")
            except UnicodeDecodeError:
                raise ChannelError("hello is not ASCII") from None
        buf += b
    raise ChannelError("hello line too long")


class Channel:
    """Frames over one connected socket; MACed with per-direction keys when the run has a token."""

    def __init__(self, sock: socket.socket, send_key: bytes | None, recv_key: bytes | None):
        self.sock = sock
        self._send_key, self._recv_key = send_key, recv_key
        self._send_seq = self._recv_seq = 0
        self._lock = threading.Lock()
        self._buf = bytearray()  # bytes of the next frame(s) read so far: a read timeout never loses them

    def send(self, data: bytes) -> None:
        """Send ``data`` (split into frames of at most MAX_FRAME bytes); raises OSError when the connection is gone."""
        view = memoryview(data)
        with self._lock:
            for start in range(0, max(len(view), 1), MAX_FRAME):
                chunk = bytes(view[start : start + MAX_FRAME])
                mac = b""
                if self._send_key is not None:
                    mac = _mac(self._send_key, _SEQ.pack(self._send_seq), chunk)[:MAC_BYTES]
                self._send_seq += 1
                self.sock.sendall(_LEN.pack(len(chunk)) + chunk + mac)

    def recv(self) -> bytes | None:
        """The next frame's payload; None at a clean end of stream.  Raises ``ChannelError`` on a broken frame
        and ``socket.timeout`` when no whole frame arrived within the socket's timeout: the bytes read so far
        are kept, and the next call goes on from them."""
        mac_len = MAC_BYTES if self._recv_key is not None else 0
        while True:
            if len(self._buf) >= _LEN.size:
                (n,) = _LEN.unpack_from(self._buf)
                if n > MAX_FRAME:
                    raise ChannelError(f"frame of {n} bytes (at most {MAX_FRAME})")
                end = _LEN.size + n + mac_len
                if len(self._buf) >= end:
                    payload, mac = bytes(self._buf[_LEN.size : _LEN.size + n]), bytes(self._buf[_LEN.size + n : end])
                    del self._buf[:end]
                    break
            chunk = self.sock.recv(MAX_FRAME + 64)
            if not chunk:
                if self._buf:
                    raise ChannelError("connection closed inside a frame")
                return None
            self._buf += chunk
        if self._recv_key is not None:
            want = _mac(self._recv_key, _SEQ.pack(self._recv_seq), payload)[:MAC_BYTES]
            if not hmac.compare_digest(mac, want):
                raise ChannelError("frame failed authentication (forged, replayed or changed on the way)")
        self._recv_seq += 1
        return payload

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _keys(token: str, cn: bytes, gn: bytes) -> tuple[bytes, bytes]:
    """(client-to-gate key, gate-to-client key)."""
    secret = token.encode()
    return _mac(secret, b"c2g", cn, gn), _mac(secret, b"g2c", cn, gn)


def client_hello(
    sock: socket.socket, kind: str, node: int, token: str | None, timeout_s: float = HELLO_TIMEOUT_S
) -> Channel:
    """Open a channel to node 0's gate as ``node``; raises ``Refused`` (told no, or the gate does not know the
    token) or ``ChannelError``/``OSError``.  The socket's timeout is left as it was before."""
    previous = sock.gettimeout()
    sock.settimeout(timeout_s)
    cn = os.urandom(NONCE_BYTES)
    sock.sendall(f"{MAGIC} {kind} {node} {cn.hex()}\n".encode())
    reply = _read_line(sock).split(" ")
    if reply[:2] == [MAGIC, "NO"]:
        raise Refused(" ".join(reply[2:])[:300])
    if len(reply) != 4 or reply[:2] != [MAGIC, "OK"]:
        raise ChannelError("not a tp-supervise gate at the other end")
    try:
        gn = bytes.fromhex(reply[2])
    except ValueError:
        raise ChannelError("malformed gate nonce") from None
    gate_wants_token = reply[3] == "1"
    if gate_wants_token != bool(token):
        raise Refused(
            "join token mismatch: "
            + (
                "node 0 requires a --join-token"
                if gate_wants_token
                else "node 0 runs without --join-token; give none, or the same on every node"
            )
        )
    keys: tuple[bytes | None, bytes | None] = (None, None)
    if token:
        secret = token.encode()
        what = [cn, gn, kind.encode(), str(node).encode()]
        sock.sendall(_mac(secret, b"client", *what).hex().encode() + b"\n")
        answer = _read_line(sock)
        if answer.startswith(MAGIC + " NO"):
            raise Refused(answer[len(MAGIC) + 4 :][:300])
        if not hmac.compare_digest(answer.encode(), _mac(secret, b"gate", *what).hex().encode()):
            raise Refused("join token mismatch: node 0's gate did not prove it knows this --join-token")
        keys = _keys(token, cn, gn)
    sock.settimeout(previous)
    return Channel(sock, keys[0], keys[1])


def server_hello(
    sock: socket.socket, token: str | None, nnodes: int, timeout_s: float = HELLO_TIMEOUT_S
) -> tuple[str, int, Channel]:
    """The gate's side: (kind, node rank, channel).  Raises ``Refused`` after telling the client why."""
    sock.settimeout(timeout_s)
    parts = _read_line(sock).split(" ")
    if len(parts) != 4 or parts[0] != MAGIC or parts[1] not in KINDS or not parts[2].isdigit():
        _say_no(sock, "malformed hello")
        raise Refused("malformed hello")
    kind, node = parts[1], int(parts[2])
    if not 0 <= node < nnodes:
        _say_no(sock, f"node rank {node} is outside 0..{nnodes - 1}: node 0 was given --nnodes {nnodes}")
        raise Refused(f"node rank {node} out of range")
    try:
        cn = bytes.fromhex(parts[3])
    except ValueError:
        _say_no(sock, "malformed nonce")
        raise Refused("malformed nonce") from None
    gn = os.urandom(NONCE_BYTES)
    sock.sendall(f"{MAGIC} OK {gn.hex()} {1 if token else 0}\n".encode())
    keys: tuple[bytes | None, bytes | None] = (None, None)
    if token:
        secret = token.encode()
        what = [cn, gn, kind.encode(), str(node).encode()]
        proof = _read_line(sock)
        if not hmac.compare_digest(proof.encode(), _mac(secret, b"client", *what).hex().encode()):
            _say_no(sock, "join token mismatch: give every node the same --join-token")
            raise WrongToken(f"wrong join token from a client claiming node {node} ({kind})", node)
        sock.sendall(_mac(secret, b"gate", *what).hex().encode() + b"\n")
        c2g, g2c = _keys(token, cn, gn)
        keys = (g2c, c2g)
    return kind, node, Channel(sock, keys[0], keys[1])


def refuse_hello(
    sock: socket.socket, reason_for: Callable[[str, int], str], timeout_s: float = HELLO_TIMEOUT_S
) -> tuple[str, int]:
    """Read a client's hello and say no, with ``reason_for(kind, node)``: (kind, node) it claimed.  Raises
    ``ChannelError`` for a hello that is not one (nothing is said to it)."""
    sock.settimeout(timeout_s)
    parts = _read_line(sock).split(" ")
    if len(parts) != 4 or parts[0] != MAGIC or parts[1] not in KINDS or not parts[2].isdigit():
        raise ChannelError("malformed hello")
    kind, node = parts[1], int(parts[2])
    _say_no(sock, reason_for(kind, node)[: MAX_LINE - 16])
    return kind, node


def _say_no(sock: socket.socket, reason: str) -> None:
    try:
        sock.sendall(f"{MAGIC} NO {reason}\n".encode("ascii", "replace"))
    except OSError:
        pass


PIPE_CHUNK = 64 * 1024


def splice(chan: Channel, sock: socket.socket, name: str, join_s: float = HELLO_TIMEOUT_S) -> None:
    """Carry bytes both ways between a channel (framed, to or from the gate) and a plain socket (the store,
    or a local store client) until either side ends; then close both.  The socket-to-channel direction runs
    on a thread of its own (``name``), this call does the other and returns when both are done (at most
    ``join_s`` after its own side ended)."""
    chan.sock.settimeout(None)
    sock.settimeout(None)

    def sock_to_chan() -> None:
        try:
            while True:
                data = sock.recv(PIPE_CHUNK)
                if not data:
                    break
                chan.send(data)
        except OSError:
            pass
        finally:
            chan.close()

    back = threading.Thread(target=sock_to_chan, name=name, daemon=True)
    back.start()
    try:
        while True:
            data = chan.recv()
            if data is None:
                break
            sock.sendall(data)
    except (OSError, ChannelError):
        pass
    finally:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        chan.close()
        back.join(join_s)
