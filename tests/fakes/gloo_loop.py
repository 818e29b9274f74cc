"""A plain torch.distributed gloo program with no supervisor code in it.

    python gloo_loop.py [--iters N] [--fault KIND] [--fault-rank R] [--fault-at I]
                        [--idle S] [--slow S]

Each iteration: a little compute, then all_reduce of a 64x256 float32 tensor.
Faults (on --fault-rank at iteration --fault-at):
  stop       the rank SIGSTOPs itself (peers block inside the next all_reduce)
  stall      the rank loops forever in `stuck_in_python()` outside collectives
  skip       the rank skips one all_reduce and then sleeps (peers wait in it)
Other behaviours:
  --idle S   after --fault-at iterations every rank sleeps S seconds outside
             collectives (an idle engine), then continues
  --slow S   the fault rank sleeps S seconds before each all_reduce from
             --fault-at on, so peers wait S seconds inside it (slow, not hung)
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist


def stuck_in_python():
    while True:
        time.sleep(0.01)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--fault", default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-at", type=int, default=50)
    p.add_argument("--idle", type=float, default=0.0)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--sleep", type=float, default=0.01)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(64, 256)
    w = torch.randn(256, 256)
    for i in range(args.iters):
        me = rank == args.fault_rank and i >= args.fault_at
        if i == args.fault_at and args.idle:
            time.sleep(args.idle)
        if me and i == args.fault_at:
            if args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "stall":
                stuck_in_python()
            elif args.fault == "skip":
                time.sleep(3600)
        if me and args.slow:
            time.sleep(args.slow)
        y = torch.tanh(x @ w) * 0.01
        dist.all_reduce(y)
        time.sleep(args.sleep)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
