"""The relay process: ``python -m tp_supervise.supervisor.relay``, started by the supervisor (process.py).

    python -m tp_supervise.supervisor.relay --upstream HOST:PORT|URL [--engine builtin|vllm|openai]
        [--run-dir DIR] [--read-timeout S] [--hold S] [--max-held N]

The public socket is inherited, named by ``SUPERVISE_LISTEN_FDS``
(supervisor/rank/listen.py).  The relay serves it until SIGTERM or SIGINT,
or the end of its stdin (the supervisor closed it, or died); then what it
still holds gets its 503 (``DRAIN_S``), its counts are published a last
time and ``relay_stopped`` says them.  The parent-death signal its starter
sets ends it with the supervisor too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from .protocol import COUNT_KEYS, COUNTS_FILE, MODULE, Counts

LINGER_S = 1.0
DRAIN_S = 2.0  # at SIGTERM: handlers answering their 503 get this long
COUNTS_EVERY_S = 0.5  # the counts are written at most this often, when they changed
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


class _CountsFile:
    """``relay.json`` in the run dir (temporary file + rename: a reader never sees half of it); tmpfs, so cheap."""

    def __init__(self, counts: Counts, run_dir: str | None):
        self.counts = counts
        self.run_dir = run_dir
        self._write_failed = False

    def publish(self) -> None:
        record = self.counts.record(os.getpid())
        if not self.run_dir:
            return
        path = os.path.join(self.run_dir, COUNTS_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        except OSError as exc:
            if not self._write_failed:
                log.warning("relay counts not written", path=path, error=str(exc))
            self._write_failed = True

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(COUNTS_EVERY_S)
            if self.counts.dirty:
                self.publish()


async def serve(relay: Relay, sock: socket.socket, run_dir: str | None) -> None:
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

    def stdin_readable() -> None:
        try:
            data = os.read(sys.stdin.fileno(), 4096)
        except OSError:
            data = b""
        if not data:  # the supervisor closed it, or died
            loop.remove_reader(sys.stdin.fileno())
            group.ending.set()

    loop.add_reader(sys.stdin.fileno(), stdin_readable)
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
    counts_file = _CountsFile(relay.counts, run_dir)
    publisher = asyncio.ensure_future(counts_file.loop())
    watcher = asyncio.ensure_future(group.watch_incidents()) if run_dir else None
    await group.ending.wait()
    publisher.cancel()
    if watcher is not None:
        watcher.cancel()
    await site.stop()  # closes our copy; the supervisor's copy keeps the port until the run ends
    await runner.cleanup()  # handlers get DRAIN_S to write their 503s
    counts_file.publish()
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
    parser.add_argument("--run-dir", default=os.environ.get("SUPERVISE_RUN_DIR"))
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
    counts = Counts()
    group = Group(args.upstream, engine, counts, args.run_dir, args.hold, max(1, args.max_held))
    relay = Relay(group, counts, args.read_timeout)
    asyncio.run(serve(relay, sock, args.run_dir))
    return 0
