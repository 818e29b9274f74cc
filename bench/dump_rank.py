"""A real torch.distributed (gloo) rank for bench/bench_dumps.py: a plain program, as a user's would be.

    python bench/dump_rank.py RANK WORLD PORT

Run with the zero-code hook on PYTHONPATH and the SUPERVISE_* environment (the
benchmark gives both, as ``supervise serve`` does), so the rank has what a
supervised rank has: heartbeats from its collectives, torch's flight recorder
and its worker server, the stack signal, and torch's and gloo's own threads.

Every rank runs three all_reduces of a 64x256 float32 tensor; then rank 1
sleeps in ``skip_the_collective`` (a Python function, outside any collective)
while every other rank enters a fourth all_reduce and blocks inside gloo,
waiting for it.  Prints "parked <pid>" when in place.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

PARK_S = 3600.0
GLOO_TIMEOUT = datetime.timedelta(seconds=600)
SKIPPING_RANK = 1


def skip_the_collective() -> None:
    print(f"parked {os.getpid()}", flush=True)  # inline: this function is the innermost frame
    time.sleep(PARK_S)


def main() -> int:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=GLOO_TIMEOUT
    )
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
