"""Two threads of one rank in collectives at once (a plain torch.distributed program).

    python gloo_threads.py

Every rank joins the default gloo group and a group of rank 0 alone.  Rank 1
then stops itself (SIGSTOP).  On rank 0 one thread finishes barriers on its
own group, one every few milliseconds, while the main thread blocks in an
all_reduce on the default group that rank 1 never joins.  Rank 0 writes
"barriers running" to stdout once the barrier thread has finished its first
barriers; the program never ends by itself.
"""

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist


def barriers(group, first: threading.Event) -> None:
    done = 0
    while True:
        dist.barrier(group=group)
        done += 1
        if done == 20:
            first.set()
        time.sleep(0.002)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    alone = dist.new_group([0])
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    first = threading.Event()
    threading.Thread(target=barriers, args=(alone, first), name="barriers", daemon=True).start()
    first.wait()
    print("barriers running", flush=True)
    dist.all_reduce(torch.ones(64, 256))  # rank 1 never comes
    sys.exit("all_reduce returned")


if __name__ == "__main__":
    main()
