"""Control-plane transports.

broadcast plane: rank 0 publishes each :class:`StepPlan` once on a ZeroMQ
XPUB socket; every worker holds a SUB socket.  XPUB (verbose) reports each
subscription, so rank 0 knows every worker is connected before the first
plan and no plan is lost to a late joiner.  Wire format: one frame,
``pickle((WIRE_VERSION, payload))`` where payload is a StepPlan or
:class:`Shutdown`; plans stay far below a megabyte (token ids only).

replicated plane: once per loop iteration rank 0 broadcasts the
:class:`ControlMessage` it drained (new requests, aborts, shutdown) through the
gloo control group; every rank then schedules from identical inputs.  The
broadcast is also a barrier, so ranks never drift apart in loop count.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import TypedDict

import torch.distributed as dist
import zmq

from .bridge import ControlMessage
from .scheduler import WIRE_VERSION, StepPlan

SUBSCRIBE_MSG = 1  # first byte of an XPUB subscription notice


class WireError(RuntimeError):
    """A control-plane message of another version or kind."""


@dataclass(frozen=True)
class Shutdown:
    reason: str


class StartupStatus(TypedDict):
    """Rank 0's startup outcome, sent to every rank (a plain dict on the wire)."""

    ok: bool
    error: str
    plan_port: int | None  # the broadcast plane's port, when there is one


def _encode(payload) -> bytes:
    return pickle.dumps((WIRE_VERSION, payload), protocol=pickle.HIGHEST_PROTOCOL)


def _decode(frame: bytes):
    version, payload = pickle.loads(frame)
    if version != WIRE_VERSION:
        raise WireError(f"control message version {version}, this engine speaks {WIRE_VERSION}")
    if not isinstance(payload, (StepPlan, Shutdown)):
        raise WireError(f"unexpected control message {type(payload).__name__}")
    return payload


class PlanPublisher:
    """Rank 0's end of the broadcast plane."""

    def __init__(self, bind_host: str):
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a plan
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        self.port = port

    def wait_subscribers(self, count: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while seen < count:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                return False
            msg = self._sock.recv()
            if msg and msg[0] == SUBSCRIBE_MSG:
                seen += 1
        return True

    def publish(self, payload: StepPlan | Shutdown) -> None:
        self._sock.send(_encode(payload))

    def close(self) -> None:
        self._sock.close(linger=0)


class PlanSubscriber:
    """A worker's end of the broadcast plane."""

    def __init__(self, connect_host: str, port: int):
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{connect_host}:{port}")
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")

    def recv(self, timeout_s: float) -> StepPlan | Shutdown | None:
        """The next message, or None after ``timeout_s`` (blocks in poll: no spinning)."""
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        return _decode(self._sock.recv())

    def close(self) -> None:
        self._sock.close(linger=0)


class RequestExchange:
    """The replicated plane's per-iteration broadcast of rank 0's inputs."""

    def __init__(self, group, rank: int, world_size: int):
        self._group = group
        self._rank = rank
        self._size = world_size

    def exchange(self, message: ControlMessage | None) -> ControlMessage:
        """Rank 0 passes its message, the others None; every rank returns rank 0's message."""
        if self._size == 1:
            return message if message is not None else ControlMessage()
        box = [message if self._rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        if not isinstance(box[0], ControlMessage):
            raise WireError(f"unexpected replicated control message {type(box[0]).__name__}")
        return box[0]


def startup_exchange(group, rank: int, world_size: int, status: StartupStatus | None) -> StartupStatus:
    """One broadcast from rank 0 at startup (rank 0 passes its status, the others None); a barrier as well."""
    box = [status if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is None:
        raise WireError("rank 0 sent no startup status")
    return box[0]
