"""A torch-free fake TP rank: steps, plus a blocking pairwise exchange standing in for an all-reduce.

Usage: wd_fake_rank.py STEP_SECONDS MODE [STOP_AFTER_STEPS]
  MODE loop   steady loop of steps, each ending in an exchange with the peer
  MODE idle   ready, then idle outside steps and collectives
The exchange: write one byte to SEND_FD, block until the peer's byte arrives on RECV_FD.
With STOP_AFTER_STEPS the rank prints its monotonic clock and SIGSTOPs itself after that many steps.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from tp_supervise.supervisor.rank import runtime as sv


def exchange(send_fd: int, recv_fd: int) -> None:
    os.write(send_fd, b"x")
    if os.read(recv_fd, 1) != b"x":
        raise SystemExit("peer went away")


def main() -> None:
    step_s = float(sys.argv[1])
    mode = sys.argv[2]
    stop_after = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    send_fd, recv_fd = int(os.environ["WD_SEND_FD"]), int(os.environ["WD_RECV_FD"])
    sv.starting()
    sv.ready()
    print("ready", flush=True)
    if mode == "idle":
        while True:
            time.sleep(1.0)
    step = 0
    while True:
        if step == stop_after:
            print(f"stopping {time.monotonic()!r}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        with sv.step():
            time.sleep(step_s)
            with sv.collective("all_reduce", "1 byte"):
                exchange(send_fd, recv_fd)
        step += 1


if __name__ == "__main__":
    main()
