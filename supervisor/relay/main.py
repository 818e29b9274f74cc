"""The relay process: ``python -m tp_supervise.supervisor.relay``, started by the supervisor (process.py).

    python -m tp_supervise.supervisor.relay --upstream HOST:PORT|URL [--engine builtin|vllm|openai]
        [--run-dir DIR] [--counts-fd FD] [--read-timeout S] [--hold S] [--max-held N]

The public socket is inherited, named by ``SUPERVISE_LISTEN_FDS``
(supervisor/rank/listen.py).  Its stdin carries the supervisor's notices
(the incident it ruled, its quarantine); ``--counts-fd`` is the pipe its
counts go to (supervisor/relay/protocol.py).  The relay serves until SIGTERM
or SIGINT, or the end of its stdin (the supervisor closed it, or died); then
what it still holds gets its 503 (``DRAIN_S``), its counts are sent a last
time and ``relay_stopped`` says them.  The parent-death signal its starter
sets ends it with the supervisor too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys

from aiohttp import web

from tp_supervise.engine.log import OneLineHttpLog, configure, get_logger
from tp_supervise.supervisor.rank.listen import ListenError, take_listen_socket, warn_if_exposed
from tp_supervise.supervisor.rank.net import listen_backlog

from .engines import adapter
from .hold import DEFAULT_MAX_HELD, HOLD_S, Group
from .http import DEFAULT_READ_TIMEOUT_S, Relay
from .protocol import COUNT_KEYS, COUNTS_EVERY_S, MODULE, Counts, Notice, read_now

LINGER_S = 1.0
DRAIN_S = 2.0  # at SIGTERM: handlers answering their 503 get this long
MAX_NOTICE_BYTES = 1 << 20  # a line on stdin longer than this is no notice: dropped
RELAY_RANK = -1  # not a rank
LOGGER = MODULE  # the ``logger`` of its JSON lines (docs/logs.md)

log = get_logger()


def _noted(_signum: int, _frame: object) -> None:
    """The Python-level handler of a stop signal: nothing; the wakeup socket tells the loop (``_StopSignals``)."""


class _StopSignals:
    """SIGTERM and SIGINT end the relay.  Not through the loop's ``add_signal_handler``: when the loop closes it
    puts SIG_DFL back (``remove_signal_handler`` does too), and a SIGTERM of the supervisor in that moment killed
    the relay (exit -15), one in the moment its wakeup pipe was closed printed a traceback.  Here a no-op
    handler and our own wakeup socket, read by the loop (a signal that comes just before the loop waits still
    wakes it); ``ignore()`` makes each signal SIG_IGN in one step, and only then lets the socket go."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, loop: asyncio.AbstractEventLoop, on_signal) -> None:
        self._loop = loop
        self._read, self._write = socket.socketpair()
        for end in (self._read, self._write):
            end.setblocking(False)
        loop.add_reader(self._read.fileno(), self._readable, on_signal)
        signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        for signum in self.SIGNALS:
            signal.signal(signum, _noted)

    def _readable(self, on_signal) -> None:
        try:
            numbers = self._read.recv(4096)  # one byte per signal: its number
        except OSError:
            return
        if any(number in self.SIGNALS for number in numbers):
            on_signal()

    def ignore(self) -> None:
        for signum in self.SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        signal.set_wakeup_fd(-1)
        self._loop.remove_reader(self._read.fileno())
        self._read.close()
        self._write.close()


class _CountsPipe:
    """The counts, one line on the supervisor's pipe (``--counts-fd``) when they changed, at most every
    ``COUNTS_EVERY_S``, and once more at the end.  Never blocks: a line the pipe has no room for is dropped, as
    the counts are cumulative and the next line supersedes it."""

    def __init__(self, counts: Counts, fd: int | None, loop: asyncio.AbstractEventLoop):
        self.counts = counts
        self.fd = fd
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0
        if fd is not None:
            counts.on_change = self.changed

    def changed(self) -> None:
        if self._timer is None and self.fd is not None:
            delay = max(0.0, self._last + COUNTS_EVERY_S - self._loop.time())
            self._timer = self._loop.call_later(delay, self.send)

    def send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.fd is None:
            return
        self._last = self._loop.time()
        try:
            os.write(self.fd, self.counts.line(os.getpid()))
        except BlockingIOError:
            pass  # the supervisor has not read the last ones yet: the next line says it all
        except OSError as exc:  # the supervisor is gone
            log.warning("relay counts not sent", fd=self.fd, error=str(exc))
            self.fd = None


class _Notices:
    """The supervisor's notices, one line each on stdin; its end ends the relay."""

    def __init__(self, group: Group, loop: asyncio.AbstractEventLoop):
        self.group = group
        self._loop = loop
        self._fd = sys.stdin.fileno()
        self._pending = b""
        loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:
        data = read_now(self._fd)
        if data is None:
            return
        if not data:  # the supervisor closed it, or died
            self._loop.remove_reader(self._fd)
            self.group.ending.set()
            return
        *lines, self._pending = (self._pending + data).split(b"\n")
        if len(self._pending) > MAX_NOTICE_BYTES:
            log.warning("notice dropped: too long", bytes=len(self._pending))
            self._pending = b""
        for line in lines:
            try:
                notice = Notice.parse(line)
            except ValueError as exc:
                log.warning("notice unreadable", error=str(exc)[:200])
                continue
            self.group.told(notice)


async def serve(relay: Relay, sock: socket.socket, counts_fd: int | None = None) -> None:
    """Serve the public socket until SIGTERM, SIGINT or the end of stdin; then drain and say the counts."""
    group = relay.group
    runner = web.AppRunner(
        relay.app(),
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=DRAIN_S,
        logger=OneLineHttpLog(),
        keepalive_timeout=relay.read_timeout_s,  # also closes a connection whose headers never complete
        lingering_time=LINGER_S,
    )
    await runner.setup()
    site = web.SockSite(runner, sock, backlog=listen_backlog())
    await site.start()
    loop = asyncio.get_running_loop()
    stop_signals = _StopSignals(loop, group.ending.set)
    _Notices(group, loop)
    counts = _CountsPipe(relay.counts, counts_fd, loop)
    host, port = runner.addresses[0][:2]
    log.info(
        "relay serving",
        address=f"{host}:{port}",
        upstream=group.upstream,
        engine=group.engine.name,
        hold_s=group.hold_s,
        max_held=group.max_held,
    )
    warn_if_exposed(host, port, log.warning)
    await group.ending.wait()
    await site.stop()  # closes our copy; the supervisor's copy keeps the port until the run ends
    await runner.cleanup()  # handlers get DRAIN_S to write their 503s
    counts.send()
    log.info("relay stopped", **{k: relay.counts.values[k] for k in COUNT_KEYS})
    # The supervisor's SIGTERM follows its closing our stdin and may come at any point of the exit from here on.
    stop_signals.ignore()


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a positive number")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--upstream", required=True, help="HOST:PORT (or URL) of the engine's own listener")
    parser.add_argument("--engine", default="builtin", help="the engine's adapter: builtin, vllm or openai")
    parser.add_argument("--run-dir", default=os.environ.get("SUPERVISE_RUN_DIR"), help="where inflight-relay goes")
    parser.add_argument("--counts-fd", type=int, help="the inherited pipe the counts go to (none: not sent)")
    parser.add_argument("--read-timeout", type=_positive, default=DEFAULT_READ_TIMEOUT_S, help="the engine's")
    parser.add_argument("--hold", type=_positive, default=HOLD_S, help="seconds a request is held after a failure")
    parser.add_argument("--max-held", type=int, default=DEFAULT_MAX_HELD, help="requests held at once")
    args = parser.parse_args(argv)
    configure(RELAY_RANK, process=LOGGER)
    try:
        engine = adapter(args.engine)
    except ValueError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 2
    try:
        sock = take_listen_socket(os.environ, os.getpid(), use=True)
    except ListenError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 2
    if sock is None:
        print("relay: no listening socket (SUPERVISE_LISTEN_FDS)", file=sys.stderr)
        return 2
    if args.counts_fd is not None:
        try:
            os.set_blocking(args.counts_fd, False)  # a line the pipe has no room for is dropped, never waited on
        except OSError as exc:
            print(f"relay: --counts-fd {args.counts_fd}: {exc.strerror}", file=sys.stderr)
            return 2
    counts = Counts()
    group = Group(args.upstream, engine, counts, args.run_dir, args.hold, max(1, args.max_held))
    relay = Relay(group, counts, args.read_timeout)
    asyncio.run(serve(relay, sock, args.counts_fd))
    return 0
