"""Every way a torch.distributed rank waits on its peer, one after the other
(a plain program with no supervisor code in it).

    python gloo_ways.py [WAY ...]     (world size 2; default: every way in WAYS)

For each way, rank 1 first stops itself (SIGSTOP); whoever runs the test
resumes it (SIGCONT) once it has seen rank 0 blocked.  Rank 0 writes
"enter <way>" to stdout just before it starts waiting and "left <way>" once
the wait is over, then waits for a line on stdin before the next way; the ways that hold a work without waiting on it also write
"holding <way>" (the work is in flight) and, for ``dropped``, "dropped
<way>" after letting go of it while rank 1 is still stopped.
"""

import datetime
import gc
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

WAYS = (
    "all_reduce",
    "async_wait",
    "future_wait",
    "polled",
    "swept",
    "dropped",
    "recv",
    "irecv_wait",
    "batch_p2p",
    "barrier",
    "barrier_async",
    "objects",
    "coalesced",
    "monitored_barrier",
    "funcol",
)
SWEPT_HOLD_S = 2.0  # how long "swept" keeps its completed work without looking at it


def say(*words: str) -> None:
    print(*words, flush=True)


def rank0(way: str, x: torch.Tensor) -> None:
    if way == "all_reduce":
        say("enter", way)
        dist.all_reduce(x)
    elif way == "async_wait":
        work = dist.all_reduce(x, async_op=True)
        say("enter", way)
        work.wait()
    elif way == "future_wait":
        work = dist.all_reduce(x, async_op=True)
        say("enter", way)
        work.get_future().wait()
    elif way == "polled":
        work = dist.all_reduce(x, async_op=True)
        say("enter", way)
        while not work.is_completed():
            time.sleep(0.01)
    elif way == "swept":
        work = dist.all_reduce(x, async_op=True)
        say("holding", way)
        time.sleep(SWEPT_HOLD_S)  # completes meanwhile (rank 1 resumed); nobody asks it
        del work
    elif way == "dropped":
        work = dist.all_reduce(x, async_op=True)
        say("holding", way)
        sys.stdin.readline()
        del work
        gc.collect()
        say("dropped", way)
        sys.stdin.readline()  # rank 1 resumes and completes the collective with our backend
        dist.barrier()
    elif way == "recv":
        say("enter", way)
        dist.recv(x, src=1)
    elif way == "irecv_wait":
        request = dist.irecv(x, src=1)
        say("enter", way)
        request.wait()
    elif way == "batch_p2p":
        received = torch.empty_like(x)
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, received, 1)])
        say("enter", way)
        for request in requests:
            request.wait()
    elif way == "barrier":
        say("enter", way)
        dist.barrier()
    elif way == "barrier_async":
        work = dist.barrier(async_op=True)
        say("enter", way)
        work.wait()
    elif way == "objects":
        gathered = [None, None]
        say("enter", way)
        dist.all_gather_object(gathered, {"rank": 0})
    elif way == "coalesced":
        with dist._coalescing_manager(async_ops=True) as manager:
            dist.all_reduce(x)
            dist.all_reduce(x[:8])
        say("enter", way)
        manager.wait()
    elif way == "monitored_barrier":
        say("enter", way)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    elif way == "funcol":
        issued = funcol.all_reduce(x, "sum", dist.group.WORLD)
        say("enter", way)
        funcol.wait_tensor(issued)
    say("left", way)
    sys.stdin.readline()  # go on when told (the test checks the slot between ways)


def rank1(way: str, x: torch.Tensor) -> None:
    os.kill(os.getpid(), signal.SIGSTOP)
    if way in ("recv", "irecv_wait"):
        dist.send(x, dst=0)
    elif way == "batch_p2p":
        received = torch.empty_like(x)
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 0), dist.P2POp(dist.irecv, received, 0)]):
            request.wait()
    elif way in ("barrier", "barrier_async"):
        dist.barrier()
    elif way == "objects":
        dist.all_gather_object([None, None], {"rank": 1})
    elif way == "coalesced":
        with dist._coalescing_manager(async_ops=True) as manager:
            dist.all_reduce(x)
            dist.all_reduce(x[:8])
        manager.wait()
    elif way == "monitored_barrier":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    elif way == "funcol":
        funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))
    else:
        dist.all_reduce(x)
    if way == "dropped":
        dist.barrier()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    x = torch.ones(64, 256)
    for way in sys.argv[1:] or WAYS:
        (rank0 if dist.get_rank() == 0 else rank1)(way, x)
    dist.barrier()
    say("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
