"""Real network boundaries for tests: network namespaces joined by a bridge, and faults on the wire.

    with netlab(nodes=2) as lab:                  # or: lab = netlab_fixture(nodes=2) in a test module
        proc = lab.run_in(1, ["python", "-c", "..."])   # a process inside node 1's namespace
        lab.partition(1)                          # node 1's packets vanish, both ways
        lab.heal(1)
        lab.lossy(1, 0.01)                        # 1 % of node 1's packets vanish (needs nft)

Layout (every name and address exists only inside namespaces the lab made)::

      node 0 ns            node 1 ns                        hub ns
    +-----------+        +-----------+        +-----------------------------------+
    | eth0      |        | eth0      |        |  br0 10.211.0.254/24 (bridge)     |
    | 10.211.0.1|--veth--| 10.211.0.2|--veth--|   |- v0 (port of node 0)          |
    +-----------+        +-----------+        |   |- v1 (port of node 1)          |
                                              +-----------------------------------+

(each node's veth pairs with its own port ``vN`` on the hub's bridge.)  The hub
has an address too (``lab.hub_addr``) so a ``DelayProxy`` running in the hub
namespace can stand between a node and another.

Faults act on the hub's side, in transit, so a node sees nothing locally:

* ``partition(node)`` sets the node's bridge port to *disabled*: the bridge
  neither forwards nor delivers a frame from or to it.  Its own ``eth0`` stays
  up with carrier, no error reaches a socket, nothing is closed: no FIN, no
  RST, no ICMP; a ``connect`` times out and an established connection just
  stops hearing anything.  Every node knows every other's MAC address
  (permanent neighbour entries), so no ARP failure turns the silence into
  ``EHOSTUNREACH`` either.  ``heal(node)`` enables the port again, and TCP
  retransmits what was held.  (Taking the veth down instead gives the node a
  NO-CARRIER link and, without static neighbours, ``No route to host`` after
  the ARP probes: an operator's cable pull, not a partition.)
* ``black_hole(node)``: the node's host disappears for everyone else (power
  loss or a kernel panic, seen from outside); with the hub in between, the
  same as ``partition(node)``.
* ``lossy(node, p)``: each IP packet from or to the node is dropped with
  probability ``p`` by an nftables bridge rule in the hub (``numgen random``);
  raises ``NetlabUnavailable`` where ``nft`` is not installed (Debian package
  ``nftables``).  This kernel has no ``netem`` qdisc, so latency comes from
  ``DelayProxy``.

Names start with ``nl<pid>x<n>``; a lab deletes its namespaces on exit, even
after a failure, and every new lab first deletes those of processes that are
gone (a crashed run).  Needs root (``ip netns``); ``netlab_fixture`` skips with
the reason where that is not allowed.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import itertools
import os
import re
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

SUBNET = "10.211.0"  # /24, only ever inside the lab's namespaces
HUB_HOST = 254
PREFIX = "nl"
NAME_RE = re.compile(rf"^{PREFIX}(\d+)x\d+-")
NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000
_counter = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)


class NetlabUnavailable(RuntimeError):
    """The host cannot give this lab (or this fault): the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out


def unavailable_reason() -> str | None:
    """Why no lab can be made here, or None."""
    if shutil.which("ip") is None or shutil.which("bridge") is None:
        return "iproute2's `ip` and `bridge` are not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add` is not permitted)"
    probe = f"{PREFIX}{os.getpid()}x{next(_counter)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def sweep_leftovers() -> list[str]:
    """Delete the namespaces of labs whose process is gone (a crashed or killed run); returns their names."""
    out = _ip("netns", "list", check=False)
    swept = []
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        found = NAME_RE.match(name)
        if found and not os.path.exists(f"/proc/{found.group(1)}"):
            _ip("netns", "del", name, check=False)
            swept.append(name)
    return swept


@contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Run the block with this thread in namespace ``name`` (sockets made inside stay there)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}: {os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:  # never leave a thread in the lab's namespace
                raise OSError(ctypes.get_errno(), "setns back to the test's namespace failed")
    finally:
        os.close(target)
        os.close(own)


@dataclass
class Lab:
    """N node namespaces on one bridge (see the module's docstring).  Nodes are numbered 0..N-1."""

    nodes: int
    tag: str
    names: list[str] = field(default_factory=list)
    hub: str = ""
    _partitioned: set[int] = field(default_factory=set)
    _loss: dict[int, float] = field(default_factory=dict)

    # -- addresses and processes -------------------------------------------------------------------
    def ns(self, node: int | str) -> str:
        """The namespace's name of a node (or ``"hub"``)."""
        return self.names[node] if isinstance(node, int) else self.hub

    def addr(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @property
    def hub_addr(self) -> str:
        return f"{SUBNET}.{HUB_HOST}"

    def argv_in(self, node: int | str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the node's namespace (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.ns(node), *argv]

    def run_in(self, node: int | str, argv: Sequence[str], **popen_kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv_in(node, argv), **popen_kw)

    def socket(self, node: int | str, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM) -> socket.socket:
        """A socket of the node's namespace, made from this (the test's) process."""
        with in_netns(self.ns(node)):
            return socket.socket(family, kind)

    # -- faults -------------------------------------------------------------------------------------
    def partition(self, node: int) -> None:
        """Every packet from or to ``node`` vanishes in transit (no FIN, no RST, no ICMP) until ``heal``."""
        self._port_state(node, 0)  # BR_STATE_DISABLED
        self._partitioned.add(node)

    def black_hole(self, node: int) -> None:
        """The node's host is gone for everyone else, without a word (power loss, a panic)."""
        self.partition(node)

    def heal(self, node: int | None = None) -> None:
        """Undo ``partition``/``black_hole`` (of every node when None) and any ``lossy``."""
        for n in sorted(self._partitioned if node is None else {node} & self._partitioned):
            self._port_state(n, 3)  # BR_STATE_FORWARDING
            self._partitioned.discard(n)
        if node is None:
            self._loss.clear()
        else:
            self._loss.pop(node, None)
        self._apply_loss()

    def lossy(self, node: int, probability: float) -> None:
        """Drop each IP packet from or to ``node`` with ``probability`` (0 restores), in the hub's bridge."""
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability {probability} is not in [0, 1]")
        if shutil.which("nft") is None:
            raise NetlabUnavailable("random packet loss needs nftables' `nft` (Debian package nftables)")
        if probability:
            self._loss[node] = probability
        else:
            self._loss.pop(node, None)
        self._apply_loss()

    def _port_state(self, node: int, state: int) -> None:
        out = subprocess.run(["bridge", "-n", self.hub, "link", "set", "dev", f"v{node}", "state", str(state)],
                             capture_output=True, text=True, timeout=30)
        shown = subprocess.run(["bridge", "-n", self.hub, "link", "show", "dev", f"v{node}"],
                               capture_output=True, text=True, timeout=30).stdout
        wanted = "disabled" if state == 0 else "forwarding"
        if out.returncode != 0 or f"state {wanted}" not in shown:
            raise RuntimeError(f"bridge port v{node} of {self.hub} not {wanted}: {out.stderr.strip()} {shown.strip()}")

    def _apply_loss(self) -> None:
        if shutil.which("nft") is None:
            return
        rules = []
        for node, p in sorted(self._loss.items()):
            below = int(round(p * 1_000_000))
            for direction in ("saddr", "daddr"):
                rules.append(f"ip {direction} {self.addr(node)} numgen random mod 1000000 < {below} drop")
        chains = "".join(
            f"  chain {hook} {{ type filter hook {hook} priority -200; policy accept;\n"
            + "".join(f"    {rule}\n" for rule in rules) + "  }\n"
            for hook in ("forward", "input", "output"))
        script = ("add table bridge netlab\ndelete table bridge netlab\n"
                  + (f"table bridge netlab {{\n{chains}}}\n" if rules else ""))
        out = subprocess.run(["ip", "netns", "exec", self.hub, "nft", "-f", "-"], input=script,
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"nft in {self.hub}: {out.stderr.strip()}\n{script}")

    # -- life ---------------------------------------------------------------------------------------
    def _create(self) -> None:
        self.hub = f"{self.tag}-hub"
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip("-n", self.hub, "addr", "add", f"{self.hub_addr}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for node in range(self.nodes):
            name = f"{self.tag}-n{node}"
            _ip("netns", "add", name)
            self.names.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", f"v{node}", "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("-n", self.hub, "link", "set", f"v{node}", "master", "br0")
            _ip("-n", self.hub, "link", "set", f"v{node}", "up")
            _ip("-n", name, "addr", "add", f"{self.addr(node)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
        # Every host knows every other's MAC: a silent peer never becomes an ARP failure (EHOSTUNREACH).
        # (Read now: a bridge takes a port's MAC as ports join it.)
        macs: dict[int | str, str] = {node: _mac(self.names[node], "eth0") for node in range(self.nodes)}
        macs["hub"] = _mac(self.hub, "br0")
        for me in ["hub", *range(self.nodes)]:
            dev = "br0" if me == "hub" else "eth0"
            for other, mac in macs.items():
                if other != me:
                    where = self.addr(other) if isinstance(other, int) else self.hub_addr
                    _ip("-n", self.ns(me), "neigh", "replace", where, "lladdr", mac, "dev", dev, "nud", "permanent")

    def destroy(self) -> None:
        for name in [*self.names, self.hub]:
            if name:
                _ip("netns", "del", name, check=False)


def _mac(ns: str, dev: str) -> str:
    out = _ip("-n", ns, "-o", "link", "show", dev).stdout
    found = re.search(r"link/ether ([0-9a-f:]{17})", out)
    if found is None:
        raise RuntimeError(f"no MAC address for {dev} in {ns}: {out}")
    return found.group(1)


@contextmanager
def netlab(nodes: int = 2) -> Iterator[Lab]:
    """A lab of ``nodes`` namespaces on one bridge; everything is deleted at the end, whatever happened."""
    reason = unavailable_reason()
    if reason:
        raise NetlabUnavailable(reason)
    sweep_leftovers()
    lab = Lab(nodes=nodes, tag=f"{PREFIX}{os.getpid()}x{next(_counter)}")
    try:
        lab._create()
        yield lab
    finally:
        lab.destroy()


def netlab_fixture(nodes: int = 2, scope: Literal["function", "module"] = "function"):
    """A pytest fixture yielding a ``Lab``; skipped with the reason where namespaces cannot be made.

        lab = netlab_fixture(nodes=2)          # at a test module's top level
    """
    import pytest

    @pytest.fixture(scope=scope)
    def _lab():
        try:
            context = netlab(nodes)
            lab = context.__enter__()
        except NetlabUnavailable as exc:
            pytest.skip(f"no network namespaces: {exc}")
        try:
            yield lab
        finally:
            context.__exit__(None, None, None)

    return _lab


# -- latency ----------------------------------------------------------------------------------------
class _Direction:
    """Bytes read from ``src``, each chunk due at ``dst`` ``delay`` seconds after it arrived, in order."""

    def __init__(self, src: socket.socket, dst: socket.socket):
        self.src, self.dst = src, dst
        self.chunks: collections.deque = collections.deque()  # (due, bytes); b"" is the end of the stream
        self.queued = 0
        self.reading = True  # src not at its end yet
        self.closed = False  # the end was forwarded (dst shut for writing)

    def due_at(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None


class DelayProxy:
    """A TCP proxy that delays every chunk by ``delay`` seconds, one way, keeping order (TCP semantics:
    nothing dropped, nothing reordered).  Run it in a namespace (``netns``: a lab's namespace name) to
    put it between a node and another, e.g. ``DelayProxy((lab.hub_addr, port), (lab.addr(0), port),
    0.2, netns=lab.ns("hub"))``.

    One thread, select-based, at most ``max_connections`` at once (more are refused by closing them);
    it stops by itself after ``max_seconds`` (or on ``stop()``/the end of a ``with`` block), closing
    every connection.  A connection refused or reset upstream closes the client's too.
    ``connections``, ``bytes_up`` (client to target) and ``bytes_down`` count what it carried.
    """

    BUFFER_MAX = 4 << 20  # per direction: past this the proxy stops reading (back-pressure)

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay: float, *, netns: str | None = None,
                 max_connections: int = 32, max_seconds: float = 300.0):
        self.target, self.delay, self.netns = target, delay, netns
        self.max_connections, self.max_seconds = max_connections, max_seconds
        self.connections = self.bytes_up = self.bytes_down = 0
        self._conns: list[tuple[_Direction, _Direction]] = []
        self._connecting: dict[socket.socket, tuple[_Direction, _Direction]] = {}  # upstream -> its pair
        self._stop = threading.Event()
        with in_netns(netns) if netns else _nothing():
            self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(listen)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.address = self._listener.getsockname()
        self._thread = threading.Thread(target=self._run, name=f"delay-proxy-{self.address[1]}", daemon=True)
        self._thread.start()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        with in_netns(self.netns) if self.netns else _nothing():  # upstream sockets live there too
            try:
                self._loop()
            finally:
                for up, _down in self._conns:
                    _close(up.src)
                    _close(up.dst)
                self._conns.clear()
                _close(self._listener)

    def _loop(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        connecting = self._connecting
        while not self._stop.is_set() and time.monotonic() < deadline:
            now = time.monotonic()
            readers = [self._listener]
            writers = list(connecting)
            wake = now + 0.1
            for pair in self._conns:
                for d in pair:
                    if d.reading and d.queued < self.BUFFER_MAX:
                        readers.append(d.src)
                    due = d.due_at()
                    if due is not None and d.dst not in connecting:
                        if due <= now:
                            writers.append(d.dst)
                        else:
                            wake = min(wake, due)
            readable, writable, _ = select.select(readers, writers, [], max(0.0, wake - now))
            now = time.monotonic()
            if self._listener in readable:
                self._accept()
            for sock in [s for s in writable if s in connecting]:
                pair = connecting.pop(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    self._drop(pair)
            for pair in list(self._conns):
                for d in pair:
                    if d.src in readable and d.reading:
                        self._read(d, now, pair)
                    if d.dst not in connecting:
                        self._flush(d, now, pair)
                if all(d.closed for d in pair):
                    self._drop(pair)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        if len(self._conns) >= self.max_connections:
            _close(client)
            return
        client.setblocking(False)
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setblocking(False)
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = upstream.connect_ex(self.target)
        pair = (_Direction(client, upstream), _Direction(upstream, client))
        self._conns.append(pair)
        self.connections += 1
        if code not in (0, errno.EINPROGRESS):
            self._drop(pair)
        elif code == errno.EINPROGRESS:
            self._connecting[upstream] = pair

    def _read(self, d: _Direction, now: float, pair) -> None:
        try:
            data = d.src.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            self._drop(pair)
            return
        if not data:
            d.reading = False
        d.chunks.append((now + self.delay, data))
        d.queued += len(data)
        if d is pair[0]:
            self.bytes_up += len(data)
        else:
            self.bytes_down += len(data)

    def _flush(self, d: _Direction, now: float, pair) -> None:
        while d.chunks and d.chunks[0][0] <= now and not d.closed:
            due, data = d.chunks[0]
            if not data:
                d.chunks.popleft()
                try:
                    d.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                d.closed = True
                return
            try:
                sent = d.dst.send(data)
            except BlockingIOError:
                return
            except OSError:
                self._drop(pair)
                return
            d.queued -= sent
            if sent < len(data):
                d.chunks[0] = (due, data[sent:])
                return
            d.chunks.popleft()

    def _drop(self, pair) -> None:
        if pair in self._conns:
            self._conns.remove(pair)
        self._connecting.pop(pair[0].dst, None)
        for d in pair:
            d.closed, d.reading = True, False
            d.chunks.clear()
            _close(d.src)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
