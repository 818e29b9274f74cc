"""A launcher that spawns its TP ranks with multiprocessing, the way vLLM and
SGLang do (spawn context, ranks are grandchildren of the supervisor).

    python mp_launcher.py --tp 2 [--fault stop|stall|crash|port-taken|none] [--fault-rank 1] [--iters N] [--set-title]
                          [--engine-core PIDFILE] [--restart-delay S]

``--fault port-taken``: the launcher listens on the port it hands its workers, so rank 0's store cannot bind
it (``EADDRINUSE`` inside ``init_process_group``: multiprocessing's bootstrap prints the traceback and exits 1)
and rank 1 waits forever on a store that never answers; the launcher waits for rank 1 (a launcher that does
not watch its workers, as a port race in a real deployment leaves it).

``--set-title``: each worker names itself with the real ``setproctitle`` once it
joined, as vLLM's (``VLLM::Worker_TP<r>``) and SGLang's workers do; that
overwrites the environment block /proc/<pid>/environ shows.

``--engine-core PIDFILE``: the workers are started by an engine-core process between
the launcher and them, as vLLM's ``VLLM::EngineCore`` (api_server -> engine core ->
workers); its pid is written to PIDFILE once its workers are started, and each
worker creates ``PIDFILE.joined-<rank>`` once it joined the group; the thread id of the core's second thread
is in ``PIDFILE.thread``.

``--restart-delay S``: in a restarted attempt (``TORCHELASTIC_RESTART_COUNT`` > 0) the workers start S seconds
late, as vLLM's do after loading the model again.

The launcher waits for its workers and exits with the first non-zero code.
No supervisor code here: the zero-code hook must find the ranks.
"""

import argparse
import multiprocessing as mp
import os
import signal
import socket
import sys
import time


def worker(rank, world, port, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if args.set_title:
        import setproctitle

        setproctitle.setproctitle(f"VLLM::Worker_TP{rank}")
        dist.barrier()  # both renamed before the loop: the supervisor holds them through it
    if args.engine_core:
        open(f"{args.engine_core}.joined-{rank}", "w").close()
    x = torch.ones(32, 128)
    for i in range(args.iters):
        if rank == args.fault_rank and i == args.fault_at:
            if args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "stall":
                while True:
                    time.sleep(0.01)
            elif args.fault == "crash":
                os._exit(3)
        dist.all_reduce(x)
        x.mul_(0.5)
        time.sleep(args.sleep)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--fault", default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-at", type=int, default=30)
    p.add_argument("--sleep", type=float, default=0.01)
    p.add_argument("--set-title", action="store_true")
    p.add_argument("--engine-core", default="")
    p.add_argument("--restart-delay", type=float, default=0.0)
    args = p.parse_args()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        time.sleep(args.restart_delay)
    # The port stays bound here (SO_REUSEADDR, never listening) while the workers run: rank 0's TCPStore,
    # which sets SO_REUSEADDR too, can bind it, and no other process on the host can take it meanwhile (a
    # port picked and released first was once taken by a parallel test before rank 0 listened).
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        if args.fault == "port-taken":
            held.listen()
        ctx = mp.get_context("spawn")
        if args.engine_core:
            core = ctx.Process(target=engine_core, args=(port, args), name="EngineCore")
            core.start()
            core.join()
            code = core.exitcode if core.exitcode >= 0 else 128 - core.exitcode
        else:
            code = run_workers(port, args)
    sys.exit(code)


def run_workers(port, args):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, args.tp, port, args), name=f"Worker_TP{r}") for r in range(args.tp)]
    for proc in procs:
        proc.start()
    if args.engine_core:
        with open(args.engine_core + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(args.engine_core + ".tmp", args.engine_core)
    code = 0
    for proc in procs:
        proc.join()
        if proc.exitcode and not code:
            code = proc.exitcode if proc.exitcode > 0 else 128 - proc.exitcode
    return code


def engine_core(port, args):
    # A second thread, as every real engine core has; its id is in PIDFILE.thread (a test freezes it to make
    # the core's exit slow: the core is gone only when its last thread is).
    import threading

    side = threading.Thread(target=time.sleep, args=(10**6,), daemon=True)
    side.start()  # returns once the thread runs: its native id is set
    with open(args.engine_core + ".thread", "w") as f:
        f.write(str(side.native_id))
    if args.set_title:
        import setproctitle

        setproctitle.setproctitle("VLLM::EngineCore")
    sys.exit(run_workers(port, args))


if __name__ == "__main__":
    main()
