"""Node 0's gate and a dial its client gave up on (issue 26), with real sockets.

Under load node 1 dials node 0 before its gate accepts (node 0 binds its port, then starts its store
child): its hello times out, it closes and dials again, and every abandoned connection waits in the
gate's backlog with its hello in it.  When the gate catches up, an abandoned dial may finish its hello
after the real link did.  It must not take the real link's place: node 1's supervisor SIGKILLed must
still be a lost node at once (its link closes), not only after the beats' timeout.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from tests.core.test_gate import _addr, _wait
from tp_supervise.supervisor.nodes.gate import Gate
from tp_supervise.supervisor.nodes.tunnel import open_channel
from tp_supervise.supervisor.nodes.wire import MAGIC, NONCE_BYTES

NODE_LOST_S = 30.0  # far beyond the test: a loss seen here is the closed connection, never the silence


@pytest.fixture
def gate():
    lost: list[tuple[int, str]] = []
    rings: list[float] = []
    listener = socket.create_server(("127.0.0.1", 0))
    g = Gate(
        listener,
        store_port=1,
        token=None,
        nnodes=2,
        on_lost=lambda n, d: lost.append((n, d)),
        on_ring=lambda: rings.append(time.monotonic()),
        on_refused=lambda k, n, d: None,
        node_lost_s=NODE_LOST_S,
    )
    g.start()
    g.lost_seen = lost
    yield g
    g.close()


def _abandoned_dial(g: Gate) -> socket.socket:
    """A link dial whose hello the gate has not finished reading (a busy gate), left open for now."""
    sock = socket.create_connection(_addr(g))
    sock.sendall(f"{MAGIC} link 1 ".encode())  # the rest of the line arrives after the real link's hello
    return sock


def test_a_stale_dial_that_finishes_its_hello_late_does_not_replace_the_real_link(gate):
    stale = _abandoned_dial(gate)
    time.sleep(0.2)  # the gate's thread for it waits inside the hello
    real = open_channel(_addr(gate), "link", 1, None)  # the retry: its hello completes first
    stale.sendall(os.urandom(NONCE_BYTES).hex().encode() + b"\n")
    stale.close()  # the client had given up on it long ago: its hello is all it ever carries
    time.sleep(0.3)  # the gate finished the stale hello and saw it end
    real.send(b"ping")  # the real link beats
    assert _wait(lambda: 1 not in gate.departed()), "the real link is not node 1's link any more"
    assert gate.lost_seen == []
    t0 = time.monotonic()
    real.sock.close()  # node 1's supervisor SIGKILLed: its kernel closes the link, no goodbye
    assert _wait(lambda: gate.lost_seen, timeout=3.0), "node 1's link closed and the gate said nothing"
    node, detail = gate.lost_seen[0]  # a FIN, or an RST (a pong left unread)
    assert node == 1 and ("without saying goodbye" in detail or "broke" in detail), detail
    assert time.monotonic() - t0 < 2.0


def test_rings_reach_the_real_link_after_a_stale_dial(gate):
    stale = _abandoned_dial(gate)
    time.sleep(0.2)
    real = open_channel(_addr(gate), "link", 1, None)
    stale.sendall(os.urandom(NONCE_BYTES).hex().encode() + b"\n")
    stale.close()
    time.sleep(0.3)
    real.send(b"ping")
    assert _wait(lambda: 1 not in gate.departed())
    gate.ring()  # node 0 published a fault: every other node reads the store now
    real.sock.settimeout(3.0)
    frames = [real.recv(), real.recv()]  # the pong, then the ring
    assert b"ring" in frames, f"node 1 never heard node 0's ring: {frames}"
    real.send(b"bye")
    real.close()
