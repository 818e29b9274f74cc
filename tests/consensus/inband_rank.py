"""One rank of the in-band test: real gloo collectives over a file store.

    python inband_rank.py RANK WORLD STORE_FILE

Prints one JSON line: the results of the checks it ran.
"""

import json
import os
import sys

import torch.distributed as dist

from tp_supervise.supervisor.rank import encoding
from tp_supervise.supervisor.rank import consensus as consensus
from tp_supervise.supervisor.rank.inband import InbandChecker, world_cpu_group


def main() -> int:
    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = world_cpu_group()
    out = {}
    for fused in (False, True):
        checker = InbandChecker(group, every_n=2, fused=fused)
        results = []
        for step in range(6):
            diverge = rank == 1 and step == 4
            results.append(checker.check(step, encoding.digest(f"{step}{'x' if diverge else ''}".encode())))
        out["fused" if fused else "minmax"] = [results, checker.checks, checker.mismatches]
    # the recorder's in-band mode (SUPERVISE_CONSENSUS_INBAND=1 in the env): lazily uses the world group
    for step in range(5):
        consensus.record("sample", {"tokens": [step, 99 if (rank == 1 and step == 3) else step]})
        consensus.end_step(step)
    rec = consensus.recorder()
    out["recorder"] = [rec.inband_checks, rec.inband_mismatches]
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's finalisation: torch's gloo objects destroyed there aborted this
    # process once in CI ("terminate called without an active exception", exit -6) after it had printed
    # its result; what this test checks is that result, not torch's teardown.
    os._exit(code)
