"""Node 0's store in a child process of its own, on loopback only, with bounded memory.

torch's ``TCPStore`` server keeps every value anyone writes; in the
supervisor's own process a flood of large values would take the supervisor
with it.  So node 0's supervisor runs the store in a child:

- the child is given a socket already bound to ``127.0.0.1`` (``master_listen_fd``):
  the store is reachable from this host only, and from the other nodes only
  through the gate (``gate``);
- once the store is up, its address space is capped (``RLIMIT_AS``: what it
  uses then plus ``--store-memory``'s worth, default 512 MiB): a flood ends in
  the child's death, never in the supervisor's;
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

from ..processes.pidfds import OWN_HELPERS

DEFAULT_MEMORY_BYTES = 512 << 20
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
                [sys.executable, "-m", "tp_supervise.supervisor.nodes.store_host", str(listener.fileno()),
                 str(memory_bytes)],
                pass_fds=(listener.fileno(),), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                start_new_session=True)
        finally:
            listener.close()  # the child holds it now
        OWN_HELPERS.add(self.proc.pid)  # not a process of the run: no teardown signals it, no reaper reaps it
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.stop()
            raise StoreHostError(f"node 0's store process did not start within {timeout_s:g} s "
                                 f"(exit {self.proc.poll()})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe_exit(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "running"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
            return f"killed by {name}"
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


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str]) -> int:
    import ctypes
    import resource
    from datetime import timedelta

    fd, limit = int(argv[1]), int(argv[2])
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    from torch.distributed import TCPStore

    port = socket.socket(fileno=os.dup(fd)).getsockname()[1]
    store = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False,
                     master_listen_fd=fd)
    cap = _vm_bytes() + limit
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    print("ready", flush=True)
    while sys.stdin.buffer.read(4096):  # until the supervisor closes it, or dies
        pass
    del store
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
