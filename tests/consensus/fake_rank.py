"""A torch-free fake TP rank that records consensus events like the engine does.

    python fake_rank.py --steps 40 [--diverge-at 20 --diverge-kind token]
                        [--then stop|hang|continue] [--step-sleep 0.002]

Consensus configuration comes from the environment (supervisor.rank.channel.rank_env).
Rank ``RANK`` diverges when ``--diverge-at`` is given and ``RANK`` is in
``--culprits``.  After the diverging step: ``stop`` SIGSTOPs itself, ``hang``
blocks forever (as a rank stuck in a collective would), ``continue`` goes on.
Right after recording the diverging batch, before the step ends:
``hang-in-step`` blocks forever, ``exit-in-step`` exits 134 (as gloo aborts
on a collective of another size).  ``--freeze-in-step S`` makes any rank
block right after recording the batch of step S (a peer stuck in that
step's first collective).  Prints "ready" after configuring and "done" at the end.
"""

import argparse
import os
import signal
import sys
import threading
import time

from tp_supervise.supervisor.rank import consensus as consensus


@consensus.rank_consensus(args=("step",))
def admit(step, queue):
    return sorted(queue)[: 2 + step % 3]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--diverge-at", type=int, default=-1)
    parser.add_argument("--diverge-kind", choices=("token", "batch"), default="token")
    parser.add_argument("--culprits", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    parser.add_argument(
        "--then", choices=("stop", "hang", "continue", "hang-in-step", "exit-in-step"), default="continue"
    )
    parser.add_argument("--freeze-in-step", type=int, default=-1)
    parser.add_argument("--hang-after", type=int, default=-1, help="block forever after this step")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    print("ready" if consensus.enabled() else "disabled", flush=True)
    for step in range(args.steps):
        diverging = step == args.diverge_at and rank in args.culprits
        ids = [f"req-{i}" for i in range(step % 5 + 1)]
        if diverging and args.diverge_kind == "batch":
            ids = ids[:-1] or ["req-x"]
        consensus.record("batch", {"request_ids": ids, "positions": [step] * len(ids), "lengths": [step + 1] * len(ids)})
        if diverging and args.then == "exit-in-step":
            os._exit(134)
        if (diverging and args.then == "hang-in-step") or step == args.freeze_in_step:
            threading.Event().wait()
        admit(step, ["c", "a", "b", "d"])
        tokens = [(step * 31 + i) % 1000 for i in range(len(ids))]
        if diverging and args.diverge_kind == "token":
            tokens[0] = 17 if tokens[0] != 17 else 18
        consensus.record("sample", {"tokens": tokens})
        consensus.record("stop", {"finished": [i for i in ids if step % 7 == 0]})
        consensus.end_step(step)
        if diverging and args.then == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if (diverging and args.then == "hang") or step == args.hang_after:
            threading.Event().wait()
        if args.step_sleep:
            time.sleep(args.step_sleep)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
