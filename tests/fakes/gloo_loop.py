"""A plain torch.distributed gloo program with no supervisor code in it.

    python gloo_loop.py [--iters N] [--fault KIND] [--fault-rank R] [--fault-at I]
                        [--idle S] [--slow S] [--first-step S] [--async | --p2p]

Each iteration: a little compute, then one exchange of a 64x256 float32 tensor:
  (default)  all_reduce
  --async    all_reduce(async_op=True), then .wait() on the work (the overlap
             style of Megatron, FSDP, async TP: the rank blocks in the wait)
  --p2p      ring exchange with batch_isend_irecv (send to rank+1, receive
             from rank-1), then .wait() on each request (pipeline style)
Faults (on --fault-rank at iteration --fault-at):
  stop       the rank SIGSTOPs itself (peers block inside the next exchange)
  stall      the rank loops forever in `stuck_in_python()` outside collectives
  skip       the rank skips one exchange and then sleeps (peers wait in it)
The fault rank writes "fault <kind> at <time.monotonic()>" to stderr first.
Other behaviours:
  --idle S   after --fault-at iterations every rank sleeps S seconds outside
             collectives (an idle engine), then continues
  --slow S   the fault rank sleeps S seconds before each exchange from
             --fault-at on, so peers wait S seconds inside it (slow, not hung)
  --first-step S  the first iteration takes S seconds on the fault rank (a
             model warm-up or compile) while peers wait inside its exchange
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def stuck_in_python():
    while True:
        time.sleep(0.01)


def exchange(y: torch.Tensor, rank: int, world: int, mode: str) -> None:
    if mode == "async":
        dist.all_reduce(y, async_op=True).wait()
    elif mode == "p2p":
        received = torch.empty_like(y)
        ops = [dist.P2POp(dist.isend, y, (rank + 1) % world), dist.P2POp(dist.irecv, received, (rank - 1) % world)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    else:
        dist.all_reduce(y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--fault", default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-at", type=int, default=50)
    p.add_argument("--idle", type=float, default=0.0)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--sleep", type=float, default=0.01)
    p.add_argument("--first-step", type=float, default=0.0)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--async", dest="mode", action="store_const", const="async", default="blocking")
    mode.add_argument("--p2p", dest="mode", action="store_const", const="p2p")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(64, 256)
    w = torch.randn(256, 256)
    for i in range(args.iters):
        me = rank == args.fault_rank and i >= args.fault_at
        if i == args.fault_at and args.idle:
            time.sleep(args.idle)
        if me and i == args.fault_at and args.fault != "none":
            print(f"fault {args.fault} at {time.monotonic():.6f}", file=sys.stderr, flush=True)
            if args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "stall":
                stuck_in_python()
            elif args.fault == "skip":
                time.sleep(3600)
        if me and args.slow:
            time.sleep(args.slow)
        if i == 0 and rank == args.fault_rank and args.first_step:
            time.sleep(args.first_step)
        y = torch.tanh(x @ w) * 0.01
        exchange(y, rank, world, args.mode)
        time.sleep(args.sleep)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
