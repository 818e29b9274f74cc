"""A real torch.distributed (gloo) rank for the flight-recorder tests.

Usage: gloo_rank.py RANK WORLD PORT

Every rank runs three all_reduces of a 64x256 float32 tensor; then every
rank but 1 enters a fourth, which rank 1 skips (it sleeps in
``skip_the_collective``), so its peers block inside gloo.  The test may
also SIGSTOP rank 1 there.

The test passes the SUPERVISE_* environment (the zero-code hook is on
PYTHONPATH) and the flight-recorder variables from ``tp_supervise.supervisor.rank.flight.rank_env``.
Prints "parked <pid>" when in place.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from tp_supervise.supervisor.rank import flight

PARK_S = 3600.0
GLOO_TIMEOUT = datetime.timedelta(seconds=120)
SKIPPING_RANK = 1


def skip_the_collective() -> None:
    print(f"parked {os.getpid()}", flush=True)  # inline: this function is the innermost frame
    time.sleep(PARK_S)


def main() -> int:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=GLOO_TIMEOUT
    )
    if not flight.serve_in_rank():
        print("no worker server", file=sys.stderr, flush=True)
    t = torch.ones(64, 256)
    for _ in range(3):
        dist.all_reduce(t)
    if rank == SKIPPING_RANK:
        skip_the_collective()
    else:
        print(f"parked {os.getpid()}", flush=True)
        dist.all_reduce(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
