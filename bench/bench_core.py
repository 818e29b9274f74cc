"""Issue 2 benchmark: how fast a death is noticed, how fast teardown finishes.

    .venv/bin/python -m bench.bench_core [--kills 50] [--ranks 8]

1. Death notice: 8 real rank processes under the exit monitor (pidfds); one
   is SIGKILLed at t0 (time.monotonic in this process); the monitor's event
   carries the monotonic time it saw the exit.  50 kills → median and p99.
2. Teardown: 8 ranks (each its own session, parent-death signal), fault →
   last process reaped, with well-behaved ranks and with ranks that ignore
   SIGTERM (which must wait out --kill-grace, then SIGKILL).
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tp_supervise.supervisor.processes import spawn as launch
from tp_supervise.supervisor.processes import pidfds as procs
from tp_supervise.supervisor.processes.spawn import RankSpec, RunContext
from tp_supervise.supervisor.processes.exit_monitor import ExitMonitor
from tp_supervise.supervisor.processes.teardown import KillPolicy, teardown

SLEEPER = "import time\nwhile True: time.sleep(3600)\n"
IGNORER = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\nwhile True: time.sleep(3600)\n"


def _ctx(run_dir: Path, death_r: int, n: int) -> RunContext:
    return RunContext(
        run_id=f"bench-{os.getpid()}",
        run_dir=run_dir,
        heartbeat_path=run_dir / "hb",
        death_fd=death_r,
        supervisor_pid=os.getpid(),
        world_size=n,
        nproc_per_node=n,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
        zero_code_hook=False,
    )


def _spawn(ctx: RunContext, slot: int, code: str):
    env = launch.rank_env(dict(os.environ), ctx, slot)
    handle = launch.spawn(RankSpec(slot, slot, (sys.executable, "-c", code), env), ctx)
    handle.proc = procs.Pidfd(handle.pid, os.pidfd_open(handle.pid), child=True)
    return handle


def _reap(handle) -> None:
    handle.proc.wait(reap=True)  # the monitor leaves the zombie (WNOWAIT): its owner reaps
    handle.proc.close()
    handle.popen.returncode = -9


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def death_notice(kills: int, ranks: int) -> list[float]:
    events: queue.SimpleQueue = queue.SimpleQueue()
    monitor = ExitMonitor(events.put)
    monitor.start()
    death_r, death_w = os.pipe()
    latencies = []
    with tempfile.TemporaryDirectory() as tmp:
        ctx = _ctx(Path(tmp), death_r, ranks)
        handles = {slot: _spawn(ctx, slot, SLEEPER) for slot in range(ranks)}
        for slot, h in handles.items():
            monitor.watch(slot, h.proc)
        time.sleep(0.5)
        for i in range(kills):
            slot = i % ranks
            h = handles[slot]
            t0 = time.monotonic()
            os.kill(h.pid, signal.SIGKILL)
            ev = events.get(timeout=10)
            latencies.append(ev.at - t0)
            monitor.release([h.proc])
            _reap(h)
            handles[slot] = _spawn(ctx, slot, SLEEPER)
            monitor.watch(slot, handles[slot].proc)
            time.sleep(0.02)
        for h in handles.values():
            os.kill(h.pid, signal.SIGKILL)
        for _ in handles:
            events.get(timeout=10)
        for h in handles.values():
            monitor.release([h.proc])
            _reap(h)
    monitor.stop()
    os.close(death_r)
    os.close(death_w)
    return latencies


def teardown_time(ranks: int, ignore_term: bool, grace: float, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        events: queue.SimpleQueue = queue.SimpleQueue()
        monitor = ExitMonitor(events.put)
        monitor.start()
        death_r, death_w = os.pipe()
        with tempfile.TemporaryDirectory() as tmp:
            ctx = _ctx(Path(tmp), death_r, ranks)
            code = IGNORER if ignore_term else SLEEPER
            handles = [_spawn(ctx, slot, code) for slot in range(ranks)]
            for h in handles:
                monitor.watch(("rank", h.slot), h.proc)
            time.sleep(1.0)
            keys = {("rank", h.slot) for h in handles}
            t0 = time.monotonic()
            result = teardown(
                handles,
                ctx.run_id,
                KillPolicy(grace_s=grace),
                wait_ranks_reported=lambda d: monitor.wait_all_exited(keys, d),
            )
            monitor.release([h.proc for h in handles])
            for h in handles:
                h.proc.close()
            times.append(time.monotonic() - t0)
            assert result.complete, result
        monitor.stop()
        os.close(death_r)
        os.close(death_w)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--grace", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    lat = death_notice(args.kills, args.ranks)
    print(f"death notice over {len(lat)} SIGKILLs, {args.ranks} ranks: "
          f"median {statistics.median(lat) * 1e3:.2f} ms, p99 {_pct(lat, 0.99) * 1e3:.2f} ms, "
          f"max {max(lat) * 1e3:.2f} ms")
    good = teardown_time(args.ranks, False, args.grace, args.rounds)
    bad = teardown_time(args.ranks, True, args.grace, args.rounds)
    print(f"teardown, {args.ranks} ranks that honour SIGTERM: median {statistics.median(good):.3f} s, "
          f"max {max(good):.3f} s")
    print(f"teardown, {args.ranks} ranks ignoring SIGTERM (kill-grace {args.grace} s): "
          f"median {statistics.median(bad):.3f} s, max {max(bad):.3f} s, "
          f"max - grace {max(bad) - args.grace:.3f} s")


if __name__ == "__main__":
    main()
