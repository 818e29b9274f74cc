"""A torch-free fake rank: claims its heartbeat slot, runs a few steps, then parks.

Usage: fake_rank.py MODE [STEPS]

Modes (where the rank parks after STEPS normal steps, each with one
"all_reduce" collective):

  collective  inside step + collective "all_reduce 64x256 float32", blocked in
              ``wait_in_all_reduce`` (what peers of a culprit look like)
  python      inside a step, outside collectives, sleeping in ``stuck_in_user_code``
  spin        inside a step, outside collectives, burning CPU in ``spin_in_user_code``
  idle        outside any step, sleeping in ``idle_between_requests``
  wrong       inside collective "all_gather 32x8 float16" (a shape/op peers do not share)

Prints "parked <pid>" on stdout from inside the parking function.  Everything it needs comes
from the SUPERVISE_* environment the test sets.
"""

import os
import sys
import time

from tp_supervise.supervisor.rank import runtime as sv

PARK_S = 3600.0


# Each parking function prints "parked" itself (inline, no helper frame on top),
# so a test that captures right after reading the line sees that function.
PARKED = "parked {}"


def wait_in_all_reduce() -> None:
    print(PARKED.format(os.getpid()), flush=True)
    time.sleep(PARK_S)  # a C call: no Python frame enters after "parked"


def stuck_in_user_code() -> None:
    print(PARKED.format(os.getpid()), flush=True)
    time.sleep(PARK_S)


def spin_in_user_code() -> None:
    print(PARKED.format(os.getpid()), flush=True)
    end = time.monotonic() + PARK_S
    x = 0
    while time.monotonic() < end:
        x += 1


def idle_between_requests() -> None:
    print(PARKED.format(os.getpid()), flush=True)
    time.sleep(PARK_S)


def main() -> int:
    mode = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    sv.starting()
    sv.ready()
    for _ in range(steps):
        with sv.step():
            with sv.collective("all_reduce", "64x256 float32"):
                pass
    if mode == "idle":
        idle_between_requests()
        return 0
    with sv.step():
        if mode == "collective":
            with sv.collective("all_reduce", "64x256 float32"):
                wait_in_all_reduce()
        elif mode == "wrong":
            with sv.collective("all_gather", "32x8 float16"):
                wait_in_all_reduce()
        elif mode == "python":
            sv.phase("user_code")
            stuck_in_user_code()
        elif mode == "spin":
            sv.phase("user_code")
            spin_in_user_code()
        else:
            print(f"unknown mode {mode}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
