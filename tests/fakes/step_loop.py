"""A plain gloo TP-style loop with steps of a fixed length (no supervisor code in it).

    python step_loop.py --seconds D [--step S] [--colls N] [--slow-rank R --slow-from T --slow-share F]
                        [--uneven-rank R --uneven-share F]

Each step: N all_reduces of a small tensor, with compute (sleep) between them,
``--step`` seconds in all.  From ``--slow-from`` seconds on, ``--slow-rank``
sleeps ``--slow-share`` of the step before the step's first collective (or
collective ``--slow-at`` of the step; its peers wait for it there).  ``--uneven-rank`` does ``--uneven-share`` of the
step as extra work *after* the step's last collective, from the start (a role
that is uneven by design: rank 0 detokenising).  ``--child-rank R --child-at T --child-s S --child spin|sleep``:
once, at T seconds, rank R runs a child process for S seconds before the step's first collective and waits for it
(its peers wait in the collective): ``spin`` burns S seconds of CPU, as the compiler Inductor runs inside a step;
``sleep`` only waits.  Runs ``--seconds`` (rank 0's clock, agreed every step) and exits 0.
"""

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--step", type=float, default=0.05)
    ap.add_argument("--colls", type=int, default=8)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-from", type=float, default=0.0)
    ap.add_argument("--slow-share", type=float, default=0.2)
    ap.add_argument("--slow-at", type=int, default=0, help="the collective of the step the slow rank is late for")
    ap.add_argument("--uneven-rank", type=int, default=-1)
    ap.add_argument("--uneven-share", type=float, default=0.2)
    ap.add_argument("--busy", action="store_true", help="compute by spinning the CPU instead of sleeping")
    ap.add_argument("--child-rank", type=int, default=-1)
    ap.add_argument("--child-at", type=float, default=0.0)
    ap.add_argument("--child-s", type=float, default=0.0)
    ap.add_argument("--child", choices=("spin", "sleep"), default="spin")
    a = ap.parse_args()
    child = {
        "spin": [sys.executable, "-c", f"import time\nwhile time.process_time() < {a.child_s}: pass"],
        "sleep": ["sleep", str(a.child_s)],
    }[a.child]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"pid {os.getpid()} rank {rank}", flush=True)
    t = torch.ones(64)
    start = time.monotonic()
    slow_announced = False
    compute = a.step / (a.colls + 1)
    go = torch.ones(1)
    while True:
        # rank 0's clock decides when every rank stops (the same number of collectives on all of them)
        go.fill_(1.0 if rank != 0 or time.monotonic() - start < a.seconds else 0.0)
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        if go.item() == 0.0:
            break
        slow = rank == a.slow_rank and time.monotonic() - start >= a.slow_from
        if rank == a.child_rank and time.monotonic() - start >= a.child_at:
            print(f"child {a.child} from {time.monotonic()}", flush=True)
            subprocess.run(child, check=True)
            a.child_rank = -1
        if slow and not slow_announced:
            print(f"slow from {time.monotonic()}", flush=True)
            slow_announced = True
        for i in range(a.colls):
            if slow and i == a.slow_at:
                time.sleep(a.slow_share * a.step)
            dist.all_reduce(t)
            if a.busy:
                until = time.thread_time() + compute  # CPU time: a throttled or contended rank takes longer
                while time.thread_time() < until:
                    pass
            else:
                time.sleep(compute)
        if rank == a.uneven_rank:
            time.sleep(a.uneven_share * a.step)
    dist.barrier()
    os._exit(0)  # torch's gloo teardown at interpreter exit is not what this program is about


if __name__ == "__main__":
    main()
