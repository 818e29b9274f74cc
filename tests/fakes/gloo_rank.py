"""A real torch.distributed (gloo) rank, parked: rank 1 outside the collective its peers block in.

    python tests/fakes/gloo_rank.py RANK WORLD PORT [GLOO_TIMEOUT_S]

Run with the zero-code hook on PYTHONPATH, the SUPERVISE_* environment and the
flight-recorder variables of ``tp_supervise.supervisor.rank.flight.rank_env``
(the caller gives them, as ``supervise serve`` does), so the rank has what a
supervised rank has: heartbeats from its collectives, torch's flight recorder
and its worker server, the stack signal, and torch's and gloo's own threads.

Every rank runs three all_reduces of a 64x256 float32 tensor; then rank 1
sleeps in ``skip_the_collective`` (a Python function, outside any collective)
while every other rank enters a fourth all_reduce and blocks inside gloo,
waiting for it.  The caller may also SIGSTOP rank 1 there.  Prints
"parked <pid>" when in place.  GLOO_TIMEOUT_S: how long the peers wait inside
gloo (default 120).

The one copy for tests/dumps/test_dumps_flight_gloo.py and, through
bench/dump_rank.py, bench/bench_dumps.py.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from tp_supervise.supervisor.rank import flight

PARK_S = 3600.0
DEFAULT_GLOO_TIMEOUT_S = 120.0
SKIPPING_RANK = 1


def skip_the_collective() -> None:
    print(f"parked {os.getpid()}", flush=True)  # inline: this function is the innermost frame
    time.sleep(PARK_S)


def main() -> int:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    timeout_s = float(sys.argv[4]) if len(sys.argv) > 4 else DEFAULT_GLOO_TIMEOUT_S
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if not flight.serve_in_rank():  # the hook started it already (idempotent): say so if there is none
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
