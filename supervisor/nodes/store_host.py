"""Node 0's store in a child process of its own, on loopback only, with bounded memory.

torch's ``TCPStore`` server keeps every value anyone writes; in the
supervisor's own process a flood of large values would take the supervisor
with it.  So node 0's supervisor runs the store in a child:

- the child is given a socket already bound to ``127.0.0.1`` (``master_listen_fd``):
  the store is reachable from this host only, and from the other nodes only
  through the gate (``gate``);
- once the store is up, its resident memory is capped: a watcher thread in the
  child ends it (exit ``EXIT_MEMORY_CAP``) when it holds more than it did at
  start plus 512 MiB, so a flood of values ends in the child's death, never in
  the supervisor's (an address-space limit instead makes torch's server drop
  the connection it cannot serve and go on at the cap, dropping the nodes'
  connections too: a half-alive store);
- it dies with the supervisor (parent-death signal, and the end of its stdin).

A dead store is a lost store like any other: node 0's link sees it and the
group ends with exit 84 on every node.

Run as ``python -m tp_supervise.supervisor.nodes.store_host FD LIMIT_BYTES``.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

from ..processes.pidfds import OWN_HELPERS

DEFAULT_MEMORY_BYTES = 512 << 20
EXIT_MEMORY_CAP = 75
WATCH_S = 0.05  # the watcher's period: a flood adds at most what the network carries in this long
START_TIMEOUT_S = 60.0  # the child imports torch: seconds on a loaded host


class StoreHostError(RuntimeError):
    pass


class StoreHost:
    """The running child; ``port`` is the loopback port of the store."""

    def __init__(self, memory_bytes: int = DEFAULT_MEMORY_BYTES, timeout_s: float = START_TIMEOUT_S):
        listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.port = listener.getsockname()[1]
        env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tp_supervise.supervisor.nodes.store_host",
                    str(listener.fileno()),
                    str(memory_bytes),
                ],
                pass_fds=(listener.fileno(),),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        finally:
            listener.close()  # the child holds it now
        OWN_HELPERS.add(self.proc.pid)  # not a process of the run: no teardown signals it, no reaper reaps it
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.stop()
            raise StoreHostError(
                f"node 0's store process did not start within {timeout_s:g} s (exit {self.proc.poll()})"
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe_exit(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "running"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
            return f"was killed by {name}"
        if code == EXIT_MEMORY_CAP:
            return "reached its memory cap (a flood of values?) and ended"
        return f"exited with {code}"

    def stop(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(2.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        OWN_HELPERS.discard(self.proc.pid)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _watch_memory(cap: int) -> None:
    while True:
        if _rss_bytes() > cap:
            print(f"store host: resident memory over its cap of {cap >> 20} MiB: ending", file=sys.stderr, flush=True)
            os._exit(EXIT_MEMORY_CAP)
        time.sleep(WATCH_S)


def main(argv: list[str]) -> int:
    import ctypes
    import threading
    from datetime import timedelta

    fd, limit = int(argv[1]), int(argv[2])
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    from torch.distributed import TCPStore

    port = socket.socket(fileno=os.dup(fd)).getsockname()[1]
    store = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False, master_listen_fd=fd)
    threading.Thread(target=_watch_memory, args=(_rss_bytes() + limit,), name="store-memory-cap", daemon=True).start()
    print("ready", flush=True)
    while sys.stdin.buffer.read(4096):  # until the supervisor closes it, or dies
        pass
    del store
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
