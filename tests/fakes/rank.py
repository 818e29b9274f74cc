"""A torch-free fake rank for supervisor tests.

    python rank.py [--all ACTION] [--on RANK=ACTION ...] [--delay S] [--steps N]

ACTION (what this rank does after --delay seconds):
  sleep        block forever (a healthy idle rank)
  loop         instrumented steady loop: step + collective through the runtime
  finish       run --steps instrumented steps, then exit 0
  finish_late  like finish, but linger 2 s after saying so before exiting
  exit0        exit 0 (an early exit while peers run)
  exit:N       exit with code N
  raise        raise a Python exception (exit 1)
  sigkill      kill itself with SIGKILL
  segv         dereference NULL (SIGSEGV)
  abort        call abort() from a non-main thread (a C++ std::terminate)
  ignore_term  ignore SIGTERM and block forever
  doublefork   leave a setsid grandchild that ignores SIGTERM (its pid in $FAKE_ESCAPEE_FILE
               when set), then block
  scrubbed     like doublefork, but the grandchild execs `env -i` (no run marker, no test
               mark) and writes its pid to $FAKE_ESCAPEE_FILE; then block
  stop         SIGSTOP itself (inside a collective of the loop)
  stall        loop, then stall in a Python function outside collectives
"""

import argparse
import ctypes
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tp_supervise.supervisor.rank import runtime as sv  # noqa: E402


def announce_escapee() -> None:
    """Write this process's pid to $FAKE_ESCAPEE_FILE (when set), whole or not at all: a test
    reading it must never see a partial number."""
    path = os.environ.get("FAKE_ESCAPEE_FILE")
    if path:
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)


def block_forever():
    while True:
        time.sleep(3600)


def fake_collective_step(step: int, peers_wait: float = 0.002):
    with sv.step():
        with sv.collective("all_reduce", "64x256 float32"):
            time.sleep(peers_wait)


def stalled_outside_collectives():
    while True:
        time.sleep(0.05)


def act(action: str, steps: int) -> None:
    if action == "sleep":
        block_forever()
    if action == "loop":
        sv.ready()
        i = 0
        while True:
            fake_collective_step(i)
            i += 1
    if action == "finish":
        sv.ready()
        for i in range(steps):
            fake_collective_step(i)
        sv.finished()
        sys.exit(0)
    if action == "finish_late":
        sv.ready()
        for i in range(steps):
            fake_collective_step(i)
        sv.finished()
        time.sleep(2.0)  # peers exit first; this rank said it was done
        sys.exit(0)
    if action == "exit0":
        sys.exit(0)
    if action.startswith("exit:"):
        os._exit(int(action.split(":", 1)[1]))
    if action == "raise":
        raise RuntimeError("injected failure in fake rank")
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "segv":
        ctypes.string_at(0)
    if action == "abort":
        libc = ctypes.CDLL(None)
        t = threading.Thread(target=libc.abort, name="native-abort")
        t.start()
        t.join()
    if action == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        block_forever()
    if action == "scrubbed":
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                announce_escapee()
                os.execve("/bin/sh", ["sh", "-c", "trap '' TERM; while :; do sleep 1; done"], {})
            os._exit(0)
        os.wait()
        block_forever()
    if action == "doublefork":
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                announce_escapee()
                block_forever()
            os._exit(0)
        os.wait()
        block_forever()
    if action == "stop":
        sv.ready()
        for i in range(steps):
            fake_collective_step(i)
        with sv.step():
            os.kill(os.getpid(), signal.SIGSTOP)
        block_forever()
    if action == "stall":
        sv.ready()
        for i in range(steps):
            fake_collective_step(i)
        with sv.step():
            stalled_outside_collectives()
    raise SystemExit(f"unknown action {action!r}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--all", default="sleep")
    p.add_argument("--on", action="append", default=[])
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM whatever the action")
    args = p.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = int(os.environ.get("RANK", "0"))
    action = args.all
    for item in args.on:
        r, _, a = item.partition("=")
        if int(r) == rank:
            action = a
    sv.starting()
    if args.delay:
        sv.ready()
        time.sleep(args.delay)
    act(action, args.steps)


if __name__ == "__main__":
    main()
