"""A zero-code rank for bench/bench_hook_startup.py: time from exec to init_process_group returning.

Writes ``OUT/rank-<RANK>.json``: seconds from this process's exec (its start
time in /proc) to ``init_process_group`` returning, resident memory after one
all_reduce, and which of the supervisor's libraries the rank has loaded.
"""

import json
import os
import sys
import time

HEAVY = ("structlog", "rich", "prometheus_client", "psutil", "pynvml", "aiohttp", "zmq",
         "dumps", "watchdogs", "consensus", "tp_supervise.dumps", "tp_supervise.watchdogs",
         "tp_supervise.consensus")


def since_exec() -> float:
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    ready = since_exec()
    t = torch.ones(4)
    dist.all_reduce(t)
    loaded = sorted(m for m in HEAVY if m in sys.modules)
    out = {"init_s": ready, "rss_kib": rss_kib(), "loaded": loaded}
    with open(os.path.join(sys.argv[1], f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
