"""A TP rank on SGLang's own distributed layer (its real ``GroupCoordinator`` over gloo, no server: SGLang has no
CPU build), for tests/engines/test_sglang.py.  Names itself as SGLang's schedulers do (``setproctitle``).

    python sglang_rank.py --iters N [--stop-rank R --stop-at I]

Each iteration: an all-reduce, an all-gather and a barrier of the TP group, the calls a model's layers and the
scheduler make.  ``--stop-rank``: that rank SIGSTOPs itself at iteration ``--stop-at``.
"""

import argparse
import os
import signal

import setproctitle
import torch
import torch.distributed as dist
from sglang.srt.distributed import parallel_state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--stop-rank", type=int, default=-1)
    p.add_argument("--stop-at", type=int, default=0)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    setproctitle.setproctitle(f"sglang::scheduler_TP{rank}")
    tp = parallel_state.GroupCoordinator(
        [list(range(dist.get_world_size()))],
        int(os.environ["LOCAL_RANK"]),
        "gloo",
        use_pynccl=False,
        use_mscclpp=False,
        use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False,
        use_xpu_communicator=False,
        group_name="tp",
    )
    x = torch.ones(8, 256)
    for i in range(args.iters):
        if rank == args.stop_rank and i == args.stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)
        y = tp.all_reduce(x.clone())
        tp.all_gather(x, dim=0)
        tp.barrier()
    assert float(y[0, 0]) == dist.get_world_size()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
