"""Node 0's gate with real sockets (issue 19): who is a lost node and who is not, and what gets in."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tp_supervise.supervisor.nodes.gate import Gate
from tp_supervise.supervisor.nodes.tunnel import LinkClient, open_channel
from tp_supervise.supervisor.nodes.wire import ChannelError, Refused

TOKEN = "s3cret"


@pytest.fixture
def gate():
    lost: list[tuple[int, str]] = []
    refused: list[tuple[str, int, str]] = []
    listener = socket.create_server(("127.0.0.1", 0))
    g = Gate(listener, store_port=1, token=TOKEN, nnodes=3, on_lost=lambda n, d: lost.append((n, d)),
             on_ring=lambda: None, on_refused=lambda k, n, d: refused.append((k, n, d)), node_lost_s=1.0)
    g.start()
    g.lost_seen, g.refused_seen = lost, refused
    yield g
    g.close()


def _addr(g: Gate) -> tuple[str, int]:
    host, port = g.address.rsplit(":", 1)
    return host, int(port)


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_a_link_that_dies_after_beating_is_a_lost_node(gate):
    link = LinkClient(_addr(gate), 1, TOKEN, on_lost=lambda n, d: None, on_ring=lambda: None)
    link.start()
    assert _wait(lambda: 1 not in gate.departed())
    time.sleep(0.3)  # it pinged
    link._chan.sock.close()  # the kernel closes a dead supervisor's sockets: no goodbye
    assert _wait(lambda: gate.lost_seen), "the gate did not see node 1 go"
    assert gate.lost_seen[0][0] == 1 and "without saying goodbye" in gate.lost_seen[0][1]


def test_an_abandoned_dial_is_no_lost_node_and_does_not_block_the_real_link(gate):
    chan = open_channel(_addr(gate), "link", 2, TOKEN)  # a hello that completed, then the client gave up
    chan.close()
    link = LinkClient(_addr(gate), 2, TOKEN, on_lost=lambda n, d: None, on_ring=lambda: None)
    link.start()  # the retry of the same node
    time.sleep(1.5)
    assert gate.lost_seen == [] and not [r for r in gate.refused_seen if r[0] == "link"]
    assert 2 not in gate.departed()
    link.bye()
    link.close()
    time.sleep(0.3)
    assert gate.lost_seen == []  # said goodbye


def test_a_silent_link_is_lost_after_the_node_timeout(gate):
    chan = open_channel(_addr(gate), "link", 1, TOKEN)
    chan.send(b"ping")
    t0 = time.monotonic()
    assert _wait(lambda: gate.lost_seen, timeout=5.0)
    assert 0.9 <= time.monotonic() - t0 < 4.0 and "did not answer" in gate.lost_seen[0][1]
    chan.close()


def test_strangers_are_refused_without_counting_as_anyone(gate):
    with pytest.raises(Refused):
        open_channel(_addr(gate), "link", 1, "guessed")
    with pytest.raises(Refused):
        open_channel(_addr(gate), "store", 7, TOKEN)  # node rank out of range
    raw = socket.create_connection(_addr(gate))
    raw.sendall(b"\x00\x00\x00\x10not a hello at all\n")
    raw.settimeout(5)
    assert raw.recv(100).startswith(b"TPSV1 NO")
    raw.close()
    assert _wait(lambda: len(gate.refused_seen) >= 3)
    assert gate.departed() == set(range(1, gate.nnodes)) and gate.lost_seen == []


def test_a_forged_frame_ends_the_connection(gate):
    chan = open_channel(_addr(gate), "link", 1, TOKEN)
    chan.send(b"ping")
    assert chan.recv().startswith(b"pong ")  # with node 0's clock, for the offset
    chan.sock.sendall(b"\x00\x00\x00\x04ring" + b"\x00" * 16)  # a frame with a made-up MAC
    chan.sock.settimeout(5)
    with pytest.raises((ChannelError, OSError)):
        while chan.recv() is not None:
            pass
        raise ChannelError("closed")
    threading.Event().wait(0.2)
