"""The network lab itself (tests/netlab.py): namespaces that talk, a partition that is silence (no FIN,
no RST, a connect that times out), a heal that restores, a proxy that delays, loss that drops, and
nothing left behind."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.netlab import PREFIX, DelayProxy, NetlabUnavailable, netlab, netlab_fixture, sweep_leftovers

lab = netlab_fixture(nodes=2)
PORT = 5000


def listener(lab, node: int, port: int = PORT) -> socket.socket:
    srv = lab.socket(node)
    srv.bind((lab.addr(node), port))
    srv.listen(8)
    srv.settimeout(5.0)
    return srv


def connected(lab, srv: socket.socket, node: int, to: tuple[str, int] | None = None):
    client = lab.socket(node)
    client.settimeout(5.0)
    client.connect(to or srv.getsockname())
    server_side, _ = srv.accept()
    server_side.settimeout(5.0)
    return client, server_side


def test_two_namespaces_talk_over_tcp(lab):
    srv = listener(lab, 0)
    client, server_side = connected(lab, srv, 1)
    client.sendall(b"ping")
    assert server_side.recv(16) == b"ping"
    server_side.sendall(b"pong")
    assert client.recv(16) == b"pong"
    assert server_side.getpeername()[0] == lab.addr(1)
    for s in (client, server_side, srv):
        s.close()


def test_a_process_runs_inside_its_namespace(lab):
    out = lab.run_in(1, ["ip", "-o", "-4", "addr", "show", "dev", "eth0"], stdout=subprocess.PIPE, text=True)
    shown, _ = out.communicate(timeout=10)
    assert out.returncode == 0 and f"{lab.addr(1)}/24" in shown


def test_a_partition_is_silence_and_heal_restores(lab):
    srv = listener(lab, 0)
    client, server_side = connected(lab, srv, 1)
    lab.partition(1)
    client.sendall(b"held")  # no error: the bytes wait in the send queue
    server_side.settimeout(1.0)
    with pytest.raises(socket.timeout):  # nothing arrives, and no FIN/RST either (recv would return b"" / raise)
        server_side.recv(16)
    client.settimeout(0.5)
    with pytest.raises(socket.timeout):
        client.recv(16)
    fresh = lab.socket(1)
    fresh.settimeout(1.5)
    began = time.monotonic()
    with pytest.raises(socket.timeout):  # a SYN into the void: no RST (refused), no ICMP (unreachable)
        fresh.connect((lab.addr(0), PORT))
    assert time.monotonic() - began >= 1.4
    fresh.close()

    lab.heal(1)
    server_side.settimeout(10.0)  # TCP retransmits what was held (RTO backoff: under a few seconds here)
    assert server_side.recv(16) == b"held"
    server_side.sendall(b"back")
    client.settimeout(10.0)
    assert client.recv(16) == b"back"
    again, _ = connected(lab, listener(lab, 0, PORT + 1), 1)
    again.close()
    for s in (client, server_side, srv):
        s.close()


def test_a_black_holed_node_is_silent_to_every_other_host(lab):
    srv = listener(lab, 0)
    client, server_side = connected(lab, srv, 1)
    lab.black_hole(0)
    client.sendall(b"x")
    server_side.settimeout(1.0)
    with pytest.raises(socket.timeout):
        server_side.recv(16)
    hub = lab.socket("hub")  # the hub (where a DelayProxy runs) does not reach it either
    hub.settimeout(1.0)
    with pytest.raises(socket.timeout):
        hub.connect((lab.addr(0), PORT))
    lab.heal()
    server_side.settimeout(10.0)
    assert server_side.recv(16) == b"x"
    for s in (client, server_side, srv, hub):
        s.close()


def test_the_proxy_delays_each_way_and_keeps_order(lab):
    srv = listener(lab, 0)
    with DelayProxy((lab.hub_addr, PORT), (lab.addr(0), PORT), 0.2, netns=lab.ns("hub")) as proxy:
        client, server_side = connected(lab, srv, 1, to=(lab.hub_addr, PORT))
        began = time.monotonic()
        client.sendall(b"a")
        assert server_side.recv(16) == b"a"
        one_way = time.monotonic() - began
        began = time.monotonic()
        server_side.sendall(b"b")
        assert client.recv(16) == b"b"
        back = time.monotonic() - began
        assert 0.2 <= one_way < 2.0 and 0.2 <= back < 2.0, (one_way, back)
        sent = b"".join(i.to_bytes(4, "big") for i in range(20000))  # 80 kB in many chunks: in order, whole
        for i in range(0, len(sent), 4000):
            client.sendall(sent[i:i + 4000])
        client.shutdown(socket.SHUT_WR)
        got = b""
        while True:
            chunk = server_side.recv(65536)
            if not chunk:
                break  # the client's end of stream reached the far side
            got += chunk
        assert got == sent
        assert proxy.connections == 1 and proxy.bytes_up == 1 + len(sent) and proxy.bytes_down == 1
        for s in (client, server_side):
            s.close()
    srv.close()


def test_the_proxy_stops_by_itself_and_closes_its_connections(lab):
    srv = listener(lab, 0)
    proxy = DelayProxy((lab.hub_addr, PORT), (lab.addr(0), PORT), 0.05, netns=lab.ns("hub"), max_seconds=1.0)
    client, server_side = connected(lab, srv, 1, to=(lab.hub_addr, PORT))
    client.settimeout(5.0)
    assert client.recv(16) == b""  # closed when its time was up
    proxy._thread.join(5.0)
    assert not proxy._thread.is_alive()
    refused = lab.socket(1)
    refused.settimeout(2.0)
    with pytest.raises(ConnectionRefusedError):
        refused.connect((lab.hub_addr, PORT))
    for s in (client, server_side, srv, refused):
        s.close()


def test_loss_drops_some_packets_but_not_all(lab):
    if shutil.which("nft") is None:
        pytest.skip("random loss needs nftables' `nft` (Debian package nftables)")
    rx = lab.socket(0, kind=socket.SOCK_DGRAM)
    rx.bind((lab.addr(0), PORT))
    rx.settimeout(0.1)
    tx = lab.socket(1, kind=socket.SOCK_DGRAM)

    def delivered(count: int) -> int:
        got = 0
        for batch in range(0, count, 100):  # in batches: the receiver's buffer holds a few hundred datagrams
            for i in range(batch, min(count, batch + 100)):
                tx.sendto(i.to_bytes(4, "big"), (lab.addr(0), PORT))
            try:
                while True:
                    rx.recv(16)
                    got += 1
            except TimeoutError:
                pass
        return got

    lab.lossy(1, 0.3)
    got = delivered(1000)
    assert 550 <= got <= 850, got  # about 700 expected
    lab.lossy(1, 0.0)
    assert delivered(200) == 200
    rx.close()
    tx.close()


def test_the_lab_leaves_nothing_and_sweeps_what_a_crashed_run_left():
    try:
        with netlab(1) as one:
            names = [one.ns(0), one.ns("hub")]
            raise RuntimeError("a test failing inside the lab")
    except NetlabUnavailable as exc:
        pytest.skip(f"no network namespaces: {exc}")
    except RuntimeError:
        pass
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names), listed
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs: as if its run had crashed
    orphan = f"{PREFIX}{gone.pid}x0-hub"
    assert not os.path.exists(f"/proc/{gone.pid}")
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    try:
        assert orphan in sweep_leftovers()
        assert orphan not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", orphan], capture_output=True)
