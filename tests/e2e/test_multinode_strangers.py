"""Strangers on the network (issue 19): what a client that is not a node can do to a two-node group.

Real supervisors (two nodes on this host, torch-free fake ranks) and a stranger that is a real client:
torch's own ``TCPStore``, raw sockets that speak the gate's hello, and the product's own ``Tunnel``
(hello + frames) with a ``TCPStore`` client behind it.  What each probe expects is issue 19's
"Strangers on the network":

With ``--join-token`` (one group shared by the probes a-f, then stopped with SIGTERM: both exit 0, no
bundle, nobody saw a fault, a hang or a lost node):
  a. a plain ``TCPStore`` client pointed at node 0's gate cannot connect, sets nothing;
  b. a correct hello with a wrong MAC is told ``TPSV1 NO``;
  c. a forged fault and a forged hang query, through every way a stranger has to the gate, reach
     nothing: both nodes keep running, no bundle;
  d. node 1 dials the gate through a recording proxy; every connection it made, replayed byte for byte
     on a new connection, is refused (the gate's nonce differs) and changes nothing in the store;
  e. a stranger claiming node 1's link without the token is refused; the real node 1 keeps beating;
  f. the gate listens on --master-addr only; the store child listens on loopback, on another port.

Without a token (the hello is enough; the operator was warned):
  g. a non-JSON value in ``fault/1`` is logged (``store_value_dropped``) and dropped, and a real fault
     afterwards still propagates (node 1 exits 80, node 0 exits 84): the link was not blinded;
  h. a forged fault of rank 99 on node 7 of a 2-node group is dropped, nobody exits because of it;
  j. the issue's flood (256 values of 4 MiB) is bounded in the store child (its memory cap), never in
     node 0's supervisor (its RSS stays flat); more, smaller values until the full store fails the group:
     both nodes exit 84 (the store is lost), none hangs, and node 0 names its own store (the child ended at
     its memory cap), not node 1;
  i. a forged run id ``..`` written before node 1 joins: refused (exit 64), no file outside the dirs;
  k. a stranger's refusal text with escape sequences reaches the terminal escaped (exit 64).

The test process reads node 0's store directly on its loopback port (as the host's owner can) to see
that nothing a stranger tried landed there.  Every group comes up when the module starts, side by side
(g, i and k run whole on threads of their own), so their startups and waits overlap.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import psutil
import pytest

from tests.conftest import MARK_VAR, ROOT, event_name, fake_rank, marked_pids
from tests.live import wait_for
from tp_supervise.supervisor.nodes.tunnel import Tunnel, open_channel
from tp_supervise.supervisor.nodes.wire import Refused
from tp_supervise.supervisor.rank.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # tens of seconds of real time each: make test-slow

PREFIX = "tpsv/v1/"
TOKEN = "strangers-test-token"
EXIT_S = 60.0  # a supervisor's exit, generous for a loaded 2-core host
JOIN_S = 60.0  # both nodes past the handshake, their links running
# Every group of the module comes up at once on a 2-core host: a link silent for the default 4 s there is
# load, not a stranger.  The probes are about strangers, so silence counts after this.
NODE_TIMEOUT_S = 10
QUIET_S = 4.0  # after a forged write: nobody reacts within this (a pass is 0.25 s, a ring is at once)
STRANGER_TIMEOUT_S = 2.0  # what a stranger's store client is given to connect (loopback: ms would do)
JUNK_DELAY_S = 10  # probe g: the fake rank's fault comes this long after its start (the junk goes first)
FLOOD_VALUES = 256
FLOOD_VALUE_BYTES = 4 << 20
FLOOD_SMALLER = (256 << 10, 16 << 10, 1 << 10)  # then these, until the store's cap is full
FLOOD_BUDGET_S = 40.0
RSS_GROWTH_MAX = 200 << 20
FORGED_FAULT = json.dumps({"node": 1, "rank": 1, "reason": "rank_exit", "incident_id": "forged-fault",
                           "verdict": "forged by a stranger"}).encode()
# seq far ahead of any rank: every node that read it would find its ranks behind and raise the hang
FORGED_HANG = json.dumps({"node": 1, "incident_id": "forged-hang", "seq": 10**9,
                          "verdict": "forged by a stranger"}).encode()
OUT_OF_RANGE_FAULT = json.dumps({"node": 7, "rank": 99, "reason": "rank_exit", "incident_id": "forged-99",
                                 "verdict": "rank 99 on node 7 failed"}).encode()
WATCHED = ("fault/1", "hang/1", "stop", "refused", "ready", "node/0/claims", "node/1/claims")


# -- supervisors ---------------------------------------------------------------------------------------


@dataclass
class Node:
    """One supervisor; its log goes to a file (a long run never fills a pipe nobody reads)."""

    proc: subprocess.Popen
    log: Path
    dump_dir: Path
    started: float
    ended: float | None = None
    stderr: str = ""
    lines: list[dict] = field(default_factory=list)

    def wait(self, timeout: float = EXIT_S) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            self.read()
            pytest.fail(f"supervise did not exit within {timeout} s\n{self.stderr[-4000:]}")
        if self.ended is None:
            self.ended = time.monotonic()
        self.read()
        return self.proc.returncode

    def read(self) -> None:
        self.stderr = self.log.read_text(errors="replace") if self.log.exists() else ""
        self.lines = []
        for line in self.stderr.splitlines():
            if line.startswith("{"):
                try:
                    self.lines.append(json.loads(line))
                except ValueError:
                    pass

    def events(self, name: str) -> list[dict]:
        """JSON lines of event ``name`` (docs/logs.md; a text such as "peer node lost" names it too)."""
        return [line for line in self.lines if line.get("event") == event_name(name)]

    def bundles(self) -> list[Path]:
        if not self.dump_dir.is_dir():
            return []
        return sorted(p for p in self.dump_dir.iterdir() if p.is_dir() and not p.name.startswith("."))

    def summary(self, reason: str) -> dict:
        matches = [b for b in self.bundles() if reason in b.name]
        assert matches, f"no {reason} bundle in {[b.name for b in self.bundles()]}\n{self.stderr[-3000:]}"
        return json.loads((matches[-1] / "summary.json").read_text())


@dataclass
class Group:
    """The supervisors of one group (each process carries the group's test mark)."""

    root: Path
    mark: str
    port: int  # --master-port
    gate_port: int  # --store-port of node 0: its gate
    addr: str  # --master-addr
    token: str | None
    nnodes: int
    runs: dict[int, Node] = field(default_factory=dict)

    @property
    def gate(self) -> tuple[str, int]:
        return (self.addr, self.gate_port)

    def start(self, node: int, ranks: tuple[str, ...] = ("--all", "loop"), store_port: int | None = None,
              log_format: str = "json", extra: tuple[str, ...] = ()) -> Node:
        env = dict(os.environ)
        env.pop("SUPERVISE_JOIN_TOKEN", None)
        env[MARK_VAR] = self.mark
        env["SUPERVISE_REGISTRY_DIR"] = str(self.root / "registry")
        dump_dir = self.root / f"dumps-{node}"
        argv = [sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--log-format", log_format,
                "--metrics-addr", "127.0.0.1:0", "--metrics-linger", "0", "--dump-dir", str(dump_dir),
                "--nnodes", str(self.nnodes), "--node-rank", str(node), "--master-addr", self.addr,
                "--master-port", str(self.port), "--store-port", str(store_port or self.gate_port),
                "--nproc-per-node", "1", "--kill-grace", "2", "--rendezvous-timeout", "60",
                "--node-timeout", str(NODE_TIMEOUT_S),
                *(("--join-token", self.token) if self.token else ()), *extra, "--", *fake_rank(*ranks)]
        log = self.root / f"node{node}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT)
        self.runs[node] = Node(proc=proc, log=log, dump_dir=dump_dir, started=time.monotonic())
        return self.runs[node]

    def wait_hosting(self) -> None:
        """Node 0 hosts the store and its own client of it is connected (its torch import is behind it): the
        other nodes start then, so the probes are about strangers, not about a node dialling a gate whose
        supervisor is still busy starting."""
        child = self.store_child()
        wait_for(lambda: any(c.status == psutil.CONN_ESTABLISHED for c in child.net_connections("tcp")), JOIN_S,
                 "node 0 connected to its store")

    def start_all(self, **kw) -> None:
        self.start(0, **kw)
        self.wait_hosting()
        for node in range(1, self.nnodes):
            self.start(node, **kw)

    def running(self) -> bool:
        return all(run.proc.poll() is None for run in self.runs.values())

    def exits(self) -> dict[int, int | None]:
        return {node: run.proc.poll() for node, run in self.runs.items()}

    def bundles(self) -> list[Path]:
        return [b for run in self.runs.values() for b in run.bundles()]

    def wait_joined(self) -> None:
        """Every node runs its ranks (registered its control socket) and its link created the bus keys."""
        try:
            wait_for(lambda: len(list((self.root / "registry").glob("*.json"))) >= self.nnodes or not self.running(),
                     JOIN_S, f"{self.nnodes} nodes running")
            assert self.running(), self.exits()
            inside = self.inside()
            wait_for(lambda: read(inside, "fault/1") is not None and all(
                int(read(inside, f"beat/{n}") or 0) > 0 for n in range(self.nnodes)), JOIN_S, "the nodes beating")
        except Exception as exc:
            for run in self.runs.values():
                if run.proc.poll() is None:
                    run.proc.kill()
                run.wait()
            tails = {node: run.stderr[-3000:] for node, run in self.runs.items()}
            raise AssertionError(f"the group did not come up ({exc!r}): {tails}") from exc

    def store_child(self) -> psutil.Process:
        """Node 0's store process (``supervisor.nodes.store_host``)."""
        node0 = psutil.Process(self.runs[0].proc.pid)

        def is_store(child: psutil.Process) -> bool:
            try:
                return "store_host" in " ".join(child.cmdline())
            except psutil.Error:  # a short-lived child that already ended (a zombie until reaped)
                return False

        return wait_for(lambda: next((c for c in node0.children() if is_store(c)), None),
                        JOIN_S, "node 0's store process")

    def inside(self):
        """A client of node 0's store on its loopback port: the host owner's view, not a stranger's."""
        child = self.store_child()
        port = wait_for(lambda: next((c.laddr.port for c in child.net_connections("tcp")
                                      if c.status == psutil.CONN_LISTEN), None), JOIN_S, "the store's port")
        return plain_store("127.0.0.1", port, timeout_s=5.0)

    def stop(self) -> None:
        """Kill what is left and report what leaked (the group's mark)."""
        for run in self.runs.values():
            if run.proc.poll() is None:
                run.proc.kill()
                run.wait()
        deadline = time.monotonic() + 5.0
        while (left := marked_pids(self.mark)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert not left, f"processes leaked: {left}"


def new_group(root: Path, nnodes: int = 2, token: str | None = None, addr: str = "127.0.0.1") -> Group:
    root.mkdir(parents=True, exist_ok=True)
    return Group(root=root, mark=uuid.uuid4().hex, port=free_port(), gate_port=free_port(addr), addr=addr,
                 token=token, nnodes=nnodes)


def host_address() -> str | None:
    """An IPv4 address of this host that is not loopback (an interface that is up), if there is one."""
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        if not stats.get(name) or not stats[name].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def unprotected_addr() -> str:
    """Without a token: an address of this host beyond loopback when there is one (the operator's warning
    is due then)."""
    return host_address() or "127.0.0.1"


def stamp(line: dict) -> float:
    """A JSON log line's time, in seconds (to compare two supervisors' lines)."""
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


class Side(threading.Thread):
    """A piece of the module run on a thread from its start (a group coming up, a whole probe), so the
    groups' startups and waits overlap; ``outcome`` hands its result, or its failure, to the test."""

    def __init__(self, name: str, fn, *args):
        super().__init__(name=name, daemon=True)
        self.fn, self.args = fn, args
        self.result: object = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:
            self.error = exc

    def outcome(self, timeout: float = 240.0):
        self.join(timeout)
        if self.is_alive():
            pytest.fail(f"{self.name} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result


# -- the stranger's tools -----------------------------------------------------------------------------


def plain_store(host: str, port: int, timeout_s: float = 5.0):
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # as the product does: no C++ backtrace per refusal
    from torch.distributed import TCPStore

    return TCPStore(host, port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False)


def read(store, key: str) -> bytes | None:
    if not store.check([PREFIX + key]):
        return None
    return bytes(store.get(PREFIX + key))


def snapshot(store) -> dict[str, bytes | None]:
    return {key: read(store, key) for key in WATCHED}


class Stranger:
    """Anyone who reaches node 0's gate, through the product's own tunnel (hello + frames), claiming ``node``."""

    def __init__(self, gate: tuple[str, int], node: int = 1, token: str | None = None, timeout_s: float = 10.0):
        self.tunnel = Tunnel(gate, node, token)
        try:
            self.store = plain_store("127.0.0.1", self.tunnel.port, timeout_s)
        except BaseException:
            self.tunnel.close()
            raise

    def close(self) -> None:
        del self.store
        self.tunnel.close()


def read_line(sock: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        b = sock.recv(1)
        if not b:
            break
        buf += b
    return buf


def read_rest(sock: socket.socket) -> bytes:
    """Whatever comes until the gate closes (or a quiet 3 s)."""
    out = b""
    sock.settimeout(3.0)
    try:
        while chunk := sock.recv(4096):
            out += chunk
    except OSError:
        pass
    return out


class RecordingProxy:
    """Node 1 dials the gate through this: every connection's bytes, both ways, are kept for a replay."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sessions: list[tuple[bytearray, bytearray]] = []  # (node -> gate, gate -> node)
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, name="recording-proxy", daemon=True).start()

    def recorded(self) -> list[tuple[bytes, bytes]]:
        with self._lock:
            return [(bytes(up), bytes(down)) for up, down in self.sessions]

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=3.0)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            up, down = bytearray(), bytearray()
            with self._lock:
                self.sessions.append((up, down))
                self._socks += [client, upstream]
            for src, dst, rec in ((client, upstream, up), (upstream, client, down)):
                threading.Thread(target=self._pump, args=(src, dst, rec), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    record += data
                dst.sendall(data)
        except OSError:
            pass
        finally:  # one side ended: so does the other (a node's death still closes its link at the gate)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def write(stranger: Stranger, key: str, value: bytes) -> None:
    """Set ``key`` and wait until the store holds it (a TCPStore ``set`` is not answered; a ``get`` on the
    same connection is, after it)."""
    stranger.store.set(PREFIX + key, value)
    assert bytes(stranger.store.get(PREFIX + key)) == value


def _try(make):
    try:
        return make()
    except Exception:
        return None


def dropped(run: Node, key: str) -> list[dict]:
    return [e for e in run.events("store_value_dropped") if e.get("key") == key]


# -- every group of the module comes up at its start ---------------------------------------------------


@dataclass
class TokenRun:
    group: Group
    proxy: RecordingProxy
    inside: object  # the host owner's client of node 0's store
    joined_at: float


@dataclass
class OpenRun:
    group: Group
    inside: object
    flood: dict = field(default_factory=dict)  # what probe j measured, for the check after it


def bring_up(group: Group, proxy: RecordingProxy | None = None) -> float:
    group.start(0)
    group.wait_hosting()
    group.start(1, store_port=proxy.port if proxy else None)
    group.wait_joined()
    return time.monotonic()


@pytest.fixture(scope="module")
def side(request, tmp_path_factory):
    """Starts every group the selected tests of this module need, at once: the token group (a-f) and the
    open group (h, j) come up on threads; g, i and k run whole on threads of their own."""
    selected = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    token = new_group(tmp_path_factory.mktemp("token"), token=TOKEN)
    proxy = RecordingProxy(token.gate)
    opened = new_group(tmp_path_factory.mktemp("open"), addr=unprotected_addr())
    wanted = {
        "token": (lambda: Side("the token group", bring_up, token, proxy), "token_group"),
        "open": (lambda: Side("the open group", bring_up, opened), "open_group"),
        "g": (lambda: Side("probe g", probe_g, tmp_path_factory.mktemp("junk")), "test_g_"),
        "i": (lambda: Side("probe i", probe_i, tmp_path_factory.mktemp("runid")), "test_i_"),
        "k": (lambda: Side("probe k", probe_k, tmp_path_factory.mktemp("escapes")), "test_k_"),
    }
    sides = {name: make() for name, (make, used_by) in wanted.items()
             if any(used_by in item.fixturenames or item.name.startswith(used_by) for item in selected)}
    try:
        yield {"sides": sides, "token": token, "proxy": proxy, "open": opened}
    finally:
        for thread in sides.values():
            thread.join(240.0)
        proxy.close()
        leaks = []
        for group in (token, opened):
            try:
                group.stop()
            except AssertionError as exc:
                leaks.append(str(exc))
        assert not leaks, leaks


@pytest.fixture(scope="module")
def token_group(side):
    joined_at = side["sides"]["token"].outcome()
    return TokenRun(side["token"], side["proxy"], side["token"].inside(), joined_at)


@pytest.fixture(scope="module")
def open_group(side):
    side["sides"]["open"].outcome()
    return OpenRun(side["open"], side["open"].inside())


# -- with --join-token: a-f on one group ---------------------------------------------------------------


def assert_undisturbed(tr: TokenRun, before: dict[str, bytes | None], quiet_s: float = QUIET_S) -> None:
    """Nothing was written; both nodes keep running ``quiet_s``, and wrote no bundle."""
    assert snapshot(tr.inside) == before
    deadline = time.monotonic() + quiet_s
    while time.monotonic() < deadline:
        assert tr.group.running(), tr.group.exits()
        time.sleep(0.2)
    assert snapshot(tr.inside) == before
    assert tr.group.bundles() == []


def test_a_plain_store_client_cannot_reach_the_store_through_the_gate(token_group):
    before = snapshot(token_group.inside)
    assert before["fault/1"] == b"" and before["hang/1"] == b""
    t0 = time.monotonic()
    with pytest.raises(Exception) as caught:  # torch's DistNetworkError, DistStoreError or a timeout
        host, port = token_group.group.gate
        store = plain_store(host, port, timeout_s=STRANGER_TIMEOUT_S)
        store.set(PREFIX + "fault/1", FORGED_FAULT)
        store.get(PREFIX + "fault/1")
    print(f"\n(a) plain TCPStore client at the gate: {type(caught.value).__name__} after {time.monotonic() - t0:.1f} s")
    assert_undisturbed(token_group, before)


def test_b_a_correct_hello_with_a_wrong_mac_is_refused(token_group):
    with socket.create_connection(token_group.group.gate, timeout=5.0) as s:
        s.sendall(f"TPSV1 store 1 {os.urandom(16).hex()}\n".encode())
        ok = read_line(s).decode()
        assert ok.startswith("TPSV1 OK ") and ok.split()[3] == "1", ok  # the gate asks for the token
        s.sendall(b"00" * 32 + b"\n")
        answer = read_rest(s)
    assert answer.startswith(b"TPSV1 NO ") and b"token" in answer, answer
    print(f"\n(b) wrong MAC: {answer.decode().strip()}")


def test_c_forged_fault_and_hang_reach_no_node(token_group):
    """Every way a stranger has: no token, a guessed one, the token's digest (what the old handshake
    published); each a real store client through the product's own tunnel."""
    before = snapshot(token_group.inside)
    digest = hmac.new(TOKEN.encode(), b"tp-supervise join token v1", hashlib.sha256).hexdigest()
    tried = {}
    for way, token in (("no token", None), ("a guessed token", "guessed"), ("the token's digest", digest)):
        try:
            stranger = Stranger(token_group.group.gate, node=1, token=token, timeout_s=STRANGER_TIMEOUT_S)
        except Exception as exc:
            tried[way] = f"no store: {type(exc).__name__}"
            continue
        try:  # reaching here is the bug: try to do the damage
            write(stranger, "fault/1", FORGED_FAULT)
            write(stranger, "hang/1", FORGED_HANG)
            tried[way] = "WROTE"
        except Exception as exc:
            tried[way] = f"write failed: {type(exc).__name__}"
        finally:
            stranger.close()
    print(f"\n(c) forged fault and hang: {tried}")
    assert "WROTE" not in tried.values(), tried
    assert_undisturbed(token_group, before)


def test_d_replayed_connections_of_node_1_are_refused(token_group):
    recorded = token_group.proxy.recorded()
    kinds = [up.split(b" ", 2)[1].decode() for up, _ in recorded if up.startswith(b"TPSV1 ")]
    assert "link" in kinds and "store" in kinds, kinds
    before = snapshot(token_group.inside)
    # the handshakes node 1 completed (a loaded host may also record one the gate cut before its OK: nothing to replay)
    recorded = [(up, down) for up, down in recorded if down.startswith(b"TPSV1 OK ") and len(down.split()) >= 3]
    assert recorded, "no complete handshake of node 1 was recorded"
    for up, down in recorded:
        hello, _, rest = up.partition(b"\n")
        proof, _, frames = rest.partition(b"\n")
        with socket.create_connection(token_group.group.gate, timeout=5.0) as s:
            s.sendall(hello + b"\n")  # node 1's bytes in the order it sent them, each after the gate's turn
            ok = read_line(s)
            assert ok.startswith(b"TPSV1 OK ") and ok.split()[2] != down.split()[2], (ok, down[:80])
            s.sendall(proof + b"\n")
            answer = read_line(s)
            try:
                s.sendall(frames)
            except OSError:
                pass
            answer += read_rest(s)
        assert answer.startswith(b"TPSV1 NO ") and b"token" in answer, answer
    print(f"\n(d) replayed {len(recorded)} recorded connections of node 1 ({', '.join(kinds)}, "
          f"{sum(len(up) for up, _ in recorded)} bytes): all refused")
    assert_undisturbed(token_group, before, QUIET_S / 2)


def test_e_a_stranger_cannot_join_as_node_1(token_group):
    inside = token_group.inside
    before = snapshot(inside)
    with pytest.raises(Refused, match="token"):  # the gate said no
        open_channel(token_group.group.gate, "link", 1, "guessed")
    with socket.create_connection(token_group.group.gate, timeout=5.0) as s:  # no token at all: any proof
        s.sendall(f"TPSV1 link 1 {os.urandom(16).hex()}\n".encode())
        assert read_line(s).startswith(b"TPSV1 OK ")
        s.sendall(hmac.new(b"", b"client", hashlib.sha256).hexdigest().encode() + b"\n")
        assert read_rest(s).startswith(b"TPSV1 NO ")
    beats = int(read(inside, "beat/1") or 0)
    assert_undisturbed(token_group, before, QUIET_S / 2)
    assert int(read(inside, "beat/1") or 0) > beats, "the real node 1 stopped beating"


def test_f_the_gate_listens_on_master_addr_only_and_the_store_on_loopback(token_group):
    group = token_group.group
    gate_listeners = [c.laddr for c in psutil.Process(group.runs[0].proc.pid).net_connections("inet")
                      if c.status == psutil.CONN_LISTEN and c.laddr.port == group.gate_port]
    assert [a.ip for a in gate_listeners] == ["127.0.0.1"], gate_listeners
    child = group.store_child()
    store_listeners = [c.laddr for c in child.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert store_listeners and all(a.ip == "127.0.0.1" for a in store_listeners), store_listeners
    assert group.gate_port not in {a.port for a in store_listeners}
    other = host_address()
    if other is not None:  # the gate's port at another address of this host: nobody there
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((other, group.gate_port), timeout=3.0).close()
    print(f"\n(f) gate {gate_listeners[0].ip}:{gate_listeners[0].port}; store child "
          f"{store_listeners[0].ip}:{store_listeners[0].port}; {other or '(no other address)'}:{group.gate_port} "
          "refused")


def test_the_token_group_ran_through_every_probe_untouched(token_group):
    group = token_group.group
    assert group.running(), group.exits()
    up_s = time.monotonic() - token_group.joined_at
    group.runs[1].proc.send_signal(signal.SIGTERM)  # a clean stop of the group: both exit 0
    codes = {node: run.wait(EXIT_S) for node, run in group.runs.items()}
    assert codes == {0: 0, 1: 0}, {n: r.stderr[-3000:] for n, r in group.runs.items()}
    assert group.bundles() == []
    for run in group.runs.values():
        for name in ("peer_node_failed", "peer_node_lost", "hang_query_received", "hang"):
            assert not run.events(name), run.events(name)
    refused = group.runs[0].events("gate_refused")
    assert refused, "node 0 never said its gate refused a stranger"
    print(f"\n(a-f) token group: up {up_s:.1f} s through the probes, then exits {codes}; node 0 logged "
          f"{len(refused)} gate_refused lines (one per 5 s at most)")


# -- without a token: h and j on one group -------------------------------------------------------------


def test_h_a_forged_fault_out_of_range_is_dropped(open_group):
    stranger = Stranger(open_group.group.gate, node=1)
    try:
        write(stranger, "fault/1", OUT_OF_RANGE_FAULT)  # it reaches the store (no token) ...
        assert read(open_group.inside, "fault/1") == OUT_OF_RANGE_FAULT
    finally:
        stranger.close()
    deadline = time.monotonic() + QUIET_S
    while time.monotonic() < deadline:  # ... and nobody takes it for a fault
        assert open_group.group.running(), open_group.group.exits()
        time.sleep(0.2)
    assert open_group.group.bundles() == []
    print("\n(h) rank 99 on node 7 in fault/1: both nodes running, no bundle")


class Watch:
    """Every 50 ms on a thread until ``stop``: the highest RSS of node 0's supervisor, and when its store
    child was first seen dead."""

    def __init__(self, node0: psutil.Process, child: psutil.Process):
        self.node0, self.child = node0, child
        self.before = self.peak = node0.memory_info().rss
        self.child_died: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            if self.child_died is None and not alive(self.child):
                self.child_died = time.time()
            try:
                self.peak = max(self.peak, self.node0.memory_info().rss)
            except psutil.Error:
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def flood(gate: tuple[str, int], size: int, count: int, go_on, until: float) -> tuple[int, str]:
    """Send up to ``count`` values of ``size`` bytes through the gate while ``go_on()``, one stranger connection
    after another (the store drops a connection whose value it cannot hold); (values sent, the last error).
    A TCPStore ``set`` is not answered: a value counts as sent, and the store's refusal shows on a later one."""
    blob, sent, error = os.urandom(size), 0, ""
    while sent < count and go_on() and time.monotonic() < until:
        try:
            stranger = Stranger(gate, node=1, timeout_s=STRANGER_TIMEOUT_S)
        except Exception as exc:
            error = f"connect: {type(exc).__name__}"
            continue
        try:
            while sent < count and time.monotonic() < until:
                stranger.store.set(f"{PREFIX}flood/{size}/{sent}", blob)
                sent += 1
        except Exception as exc:
            error = f"set: {type(exc).__name__}: {str(exc)[:60]}"
            if size == FLOOD_VALUE_BYTES:
                break  # the flood is one client's 256 values: it ends when the store drops it
        finally:
            stranger.close()
    return sent, error


def test_j_a_flood_is_bounded_and_ends_in_84_on_both_nodes(open_group):
    """The issue's flood (256 values of 4 MiB on one connection): node 0's supervisor RSS stays flat and the
    store (a child under a memory cap) refuses what it cannot hold; the group goes on.  Then smaller values
    until the full store costs the group: both nodes exit 84, the store lost, none hangs or is OOM-killed."""
    group, inside, out = open_group.group, open_group.inside, open_group.flood
    node0 = psutil.Process(group.runs[0].proc.pid)
    child = group.store_child()
    assert group.running(), group.exits()
    child_before = child.memory_info().rss
    rss = Watch(node0, child)
    t0, t0_wall = time.monotonic(), time.time()
    big, big_error = flood(group.gate, FLOOD_VALUE_BYTES, FLOOD_VALUES, lambda: alive(child), t0 + FLOOD_BUDGET_S)
    big_s = time.monotonic() - t0
    child_big = child.memory_info().rss if alive(child) else None
    report = [f"(j) {big} of {FLOOD_VALUES} values of {FLOOD_VALUE_BYTES >> 20} MiB sent in {big_s:.1f} s "
              f"({big_error or 'no error'}); store child RSS {child_before >> 20} -> "
              f"{child_big >> 20 if child_big else 'dead'} MiB; node 0 supervisor RSS {rss.before >> 20} MiB "
              f"before, peak {rss.peak >> 20} MiB"]
    assert big < FLOOD_VALUES, report  # the store's memory is bounded: it refused the rest
    assert rss.peak - rss.before < RSS_GROWTH_MAX, report
    if alive(child):  # the store still serves the group
        try:
            assert group.running() and group.bundles() == [], (report, group.exits())
            beats = int(read(inside, "beat/1") or 0)
            wait_for(lambda: int(read(inside, "beat/1") or 0) > beats, 10.0, "node 1 beating after the flood")
            report.append("the store child refused the rest and kept serving, both nodes running")
        except (AssertionError, RuntimeError):  # DistNetworkError is a RuntimeError
            if alive(child):
                raise
            # its memory cap ended it a moment after the flood did: the exits below are checked all the same
            report.append("the store child reached its memory cap just after the flood")
    smaller = []
    for size in FLOOD_SMALLER:
        if not (alive(child) and group.running()):
            break
        n, error = flood(group.gate, size, 1 << 20, lambda: alive(child) and group.running(), t0 + FLOOD_BUDGET_S)
        smaller.append(f"{n} x {size >> 10} KiB ({error or 'no error'})")
    report.append(f"then {', '.join(smaller) or 'nothing'} until +{time.monotonic() - t0:.1f} s")
    codes = {node: run.wait(EXIT_S) for node, run in group.runs.items()}
    time.sleep(0.2)
    rss.stop()
    exiting = {node: run.events("supervise_exiting") for node, run in group.runs.items()}
    report.append("exits " + ", ".join(f"node {node} {codes[node]} at +{stamp(e[0]) - t0_wall:.1f} s" if e else
                                       f"node {node} {codes[node]}" for node, e in exiting.items())
                  + (f"; the store child died at +{rss.child_died - t0_wall:.1f} s" if rss.child_died else "")
                  + f"; node 0 supervisor peak RSS {rss.peak >> 20} MiB")
    out["report"] = "; ".join(report)
    print("\n" + out["report"])
    assert rss.peak - rss.before < RSS_GROWTH_MAX, report
    assert codes == {0: 84, 1: 84}, {n: r.stderr[-3000:] for n, r in group.runs.items()}
    lost = group.runs[1].events("peer node lost")
    assert lost and lost[0]["node"] == 0 and "store" in lost[0]["detail"], group.runs[1].stderr[-3000:]
    for run in group.runs.values():  # the forged fault of probe h never took: nobody named rank 99 on node 7
        assert dropped(run, "fault/1") and "node=7" in dropped(run, "fault/1")[0]["why"], run.stderr[-3000:]
        assert "rank 99" not in json.dumps(run.summary("node_lost"))
    if group.addr != "127.0.0.1":
        assert group.runs[0].events("store_unauthenticated")


def test_j_node_0_rules_its_flooded_store_lost_not_node_1(open_group):
    out = open_group.flood
    if "report" not in out:
        pytest.skip("the flood probe did not run to its end")
    lost = open_group.group.runs[0].events("peer node lost")
    assert lost and lost[0]["node"] == 0 and "store" in lost[0]["detail"], (out["report"], lost)


# -- without a token: g, i and k, each on a group of its own, run whole from the module's start --------


def probe_g(root: Path) -> str:
    """A non-JSON value in fault/1, then a real fault (rank 1 exits 3): dropped, and the fault still goes."""
    group = new_group(root, addr=unprotected_addr())
    stranger = None
    junk = b"\xff\x00not json {"
    try:
        group.start_all(ranks=("--all", "loop", "--on", "1=exit:3", "--delay", str(JUNK_DELAY_S)))
        group.wait_joined()
        stranger = Stranger(group.gate, node=1)
        won = bytes(stranger.store.compare_set(PREFIX + "fault/1", "", junk))
        assert won == junk, f"the real fault came first ({won!r}): too slow a host for this probe"
        node0, node1 = group.runs[0], group.runs[1]
        assert node1.wait() == 80, node1.stderr[-3000:]
        assert node0.wait() == 84, node0.stderr[-3000:]
        for run in (node0, node1):
            assert dropped(run, "fault/1") and "not JSON" in dropped(run, "fault/1")[0]["why"], run.stderr[-3000:]
        peer = node0.summary("peer_failed")
        assert "rank 1 on node 1" in peer["verdict"] and peer["culprit_ranks"] == [1]
        exited, heard = node1.events("rank_exited"), node0.events("peer_node_failed")
        assert exited and heard, (node1.stderr[-2000:], node0.stderr[-2000:])
        propagation = stamp(heard[0]) - stamp(exited[0])
        assert propagation < 5.0, propagation
        if group.addr != "127.0.0.1":
            assert node0.events("store_unauthenticated")
        return (f"(g) junk in fault/1 dropped on both nodes; then rank 1 exited 3: node 1 exit 80, node 0 heard "
                f"it {propagation * 1000:.0f} ms after node 1 saw it, exit 84")
    finally:
        if stranger is not None:
            stranger.close()
        group.stop()


def test_g_a_junk_fault_value_is_dropped_and_a_real_fault_still_propagates(side):
    print("\n" + side["sides"]["g"].outcome())


def probe_i(root: Path) -> str:
    """A forged run id ``..`` written after node 0 published its own, before node 1 joins."""
    group = new_group(root, addr=unprotected_addr())
    log_dir = root / "logs"
    stranger = None
    before = set(os.listdir(root))
    try:
        group.start(0, extra=("--log-dir", str(log_dir)))
        stranger = wait_for(lambda: _try(lambda: Stranger(group.gate, node=1, timeout_s=STRANGER_TIMEOUT_S)),
                            JOIN_S, "node 0's gate")
        wait_for(lambda: read(stranger.store, "run_id"), JOIN_S, "node 0's run id")
        write(stranger, "run_id", b"..")
        group.start(1, extra=("--log-dir", str(log_dir)))
        codes = {node: run.wait() for node, run in group.runs.items()}
        assert codes == {0: 64, 1: 64}, {n: r.stderr[-3000:] for n, r in group.runs.items()}
        assert "run id" in group.runs[1].stderr, group.runs[1].stderr[-3000:]
        for run in group.runs.values():
            assert not run.events("rank started")
        new = set(os.listdir(root)) - before - {"logs", "dumps-0", "dumps-1", "registry", "node0.log", "node1.log"}
        assert not new, new
        assert not log_dir.exists() or list(log_dir.rglob("*")) == []
        for where in ("/dev/shm", os.environ.get("TMPDIR", "/tmp")):
            assert not os.path.lexists(os.path.join(where, "tp-supervise-..")), where
        said = next(line for line in group.runs[1].lines if "run id" in str(line.get("message", "")))["message"]
        return f"(i) forged run id '..': exits {codes}; node 1 said: {said[:160]}"
    finally:
        if stranger is not None:
            stranger.close()
        group.stop()


def test_i_a_forged_run_id_is_refused_and_nothing_lands_outside_the_dirs(side):
    print("\n" + side["sides"]["i"].outcome())


def probe_k(root: Path) -> str:
    """A stranger's refusal with escape sequences while nodes 0 and 1 wait for node 2 (which never comes)."""
    group = new_group(root, nnodes=3, addr=unprotected_addr())
    stranger = None
    text = "\x1b[31mnode 2 says: \x1b]0;pwned\x07 run rm -rf /\x1b[0m\u202e"
    try:
        group.start(0)
        group.wait_hosting()
        group.start(1, log_format="console")  # what a person at a terminal reads
        stranger = wait_for(lambda: _try(lambda: Stranger(group.gate, node=1, timeout_s=STRANGER_TIMEOUT_S)),
                            JOIN_S, "node 0's gate")
        wait_for(lambda: read(stranger.store, "node/1/info"), JOIN_S, "node 1 registered")
        write(stranger, "refused", text.encode())
        codes = {node: run.wait() for node, run in group.runs.items()}
        assert codes == {0: 64, 1: 64}, {n: r.stderr[-3000:] for n, r in group.runs.items()}
        node1 = group.runs[1].stderr
        assert "\\x1b[31mnode 2 says" in node1 and "\\u202e" in node1, node1[-3000:]
        for run in group.runs.values():
            assert not any(ch in run.stderr for ch in "\x1b\x07\u202e"), run.stderr[-3000:]
            assert "\\u001b" not in run.stderr  # nor raw inside a JSON line
        return "(k) the refusal as node 1 printed it: " + next(
            line for line in node1.splitlines() if "node 2 says" in line)[:200]
    finally:
        if stranger is not None:
            stranger.close()
        group.stop()


def test_k_a_strangers_refusal_text_reaches_the_terminal_escaped(side):
    print("\n" + side["sides"]["k"].outcome())
