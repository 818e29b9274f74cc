"""A rank for bench/bench_core.py's teardown runs: stdlib and the rank-side runtime only (no torch).

    python bench/teardown_rank.py OUT_DIR [--fault-rank R] [--fault kill|stop] [--ignore-term]

Every rank writes ``OUT_DIR/pid-<RANK>``, says ready through the runtime and
runs instrumented steps (one fake collective of 5 ms each), so the
watchdogs see progress.  Once ``OUT_DIR/go`` exists (the benchmark holds a
pidfd on every rank by then), the fault rank writes ``time.time()`` to
``OUT_DIR/fault`` and, with ``--fault kill``, SIGKILLs itself at once (the
fault instant is the stamp just before the death); with ``--fault stop`` it
SIGSTOPs itself inside a step and the others block in their next collective
(a hang: the fault instant the benchmark uses is then the supervisor's
verdict).  ``--ignore-term``: SIGTERM is ignored, so
the teardown must wait out ``--kill-grace`` and SIGKILL.
"""

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tp_supervise.supervisor.rank import runtime as sv  # noqa: E402

STEP_S = 0.005


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", help="directory for the pid files, the go file and the fault stamp")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault", choices=("kill", "stop"), default="kill")
    p.add_argument("--ignore-term", action="store_true")
    args = p.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = int(os.environ.get("RANK", "0"))
    sv.starting()
    with open(os.path.join(args.out, f"pid-{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(args.out, f"pid-{rank}.tmp"), os.path.join(args.out, f"pid-{rank}"))
    sv.ready()
    go = os.path.join(args.out, "go")
    faulty = rank == args.fault_rank
    while True:
        with sv.step():
            if os.path.exists(go):
                if faulty:
                    with open(os.path.join(args.out, "fault"), "w") as f:
                        f.write(repr(time.time()))
                        f.flush()
                    os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
                elif args.fault == "stop":  # the peers of a stopped rank wait for it in the next collective
                    with sv.collective("all_reduce", "64x256 float32"):
                        while True:
                            time.sleep(3600)
            with sv.collective("all_reduce", "64x256 float32"):
                time.sleep(STEP_S)


if __name__ == "__main__":
    main()
