"""Issue 4 benchmark: what heartbeats cost a rank.

    .venv/bin/python -m bench.bench_heartbeat [--quick] [--update-docs docs/benchmarks.md]

1. Per call (in-process, many iterations): ``with sv.step()``,
   ``with sv.collective(op, desc)``, ``sv.phase(name)``, and the zero-code
   wrapper the autohook puts around a torch.distributed collective (shape
   description + heartbeat), each minus the cost of the empty loop.
2. On a realistic loop, same run: a decode step of a small Llama-like TP
   shard in plain torch (per layer: QKV, attention-sized matmul, o_proj,
   all_reduce, gate/up, down, all_reduce) on a real single-rank gloo group,
   as pairs of steps with and without the runtime calls (which one runs
   first alternates), timed in process CPU time.  The overhead is the median
   over pairs of (time with) / (time without) - 1, robust to bursts of noise.
   A timed pass measures the runtime calls where they run (minus the cost of
   timing an empty context the same way).
   torch runs on one thread so the two variants see the same machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.rank import runtime
from bench._docs import replace_section

HEADING = "## Heartbeat cost"
NS = 1e9


@dataclass(frozen=True)
class LoopShape:
    layers: int = 8
    hidden: int = 512
    ffn: int = 1408
    batch: int = 8
    context: int = 256  # attention reads a KV block of this many positions


@dataclass(frozen=True)
class Result:
    per_call_ns: dict[str, float]
    step_ms_without: float
    step_ms_with: float
    overhead_pct: float
    overhead_spread_pct: tuple[float, float]
    predicted_pct: float
    in_loop_ns_per_call: float  # step() or collective() enter+exit, timed inside the model loop
    in_loop_pct: float
    load: tuple[float, float]  # 1-minute load average before and after
    collectives_per_step: int
    pairs: int
    shape: LoopShape


def _attach(tmp: Path) -> hb.HeartbeatSegment:
    """A real heartbeat segment with this process as rank 0 of a supervised run."""
    seg = hb.HeartbeatSegment(tmp / "hb", 1, uuid.uuid4().hex, time.monotonic())
    os.environ[runtime.ENV_HEARTBEAT] = str(seg.path)
    os.environ[runtime.ENV_SLOT] = "0"
    os.environ["RANK"] = "0"
    runtime.starting()
    runtime.ready()
    assert runtime.slot_writer() is not None, "runtime did not claim the slot"
    return seg


def _per_call(number: int, repeat: int, dist, tensor) -> dict[str, float]:
    from tp_supervise.supervisor.rank import autohook

    def best(stmt, n: int = number) -> float:
        return min(timeit.repeat(stmt, number=n, repeat=repeat)) / n * NS

    empty = best(lambda: None)
    noop = lambda *a, **k: None  # noqa: E731 (stands for the wrapped torch function)
    wrapped = autohook._wrap_collective("all_reduce", noop)

    def step():
        with runtime.step():
            pass

    def coll():
        with runtime.collective("all_reduce", "8x512 float32"):
            pass

    return {
        "step() begin+end": best(step) - empty,
        "collective() begin+end": best(coll) - empty,
        "phase()": best(lambda: runtime.phase("decode")) - empty,
        "zero-code wrapper (describe + heartbeat)": best(lambda: wrapped(tensor)) - empty,
        "for scale: gloo all_reduce, world 1": best(lambda: dist.all_reduce(tensor), max(1, number // 100)) - empty,
    }


def _model(torch, shape: LoopShape):
    g = torch.Generator().manual_seed(0)

    def w(*dims):
        return torch.randn(*dims, generator=g) * 0.02

    layers = [
        {
            "qkv": w(shape.hidden, 3 * shape.hidden),
            "kv": w(shape.context, shape.hidden),
            "o": w(shape.hidden, shape.hidden),
            "gate_up": w(shape.hidden, 2 * shape.ffn),
            "down": w(shape.ffn, shape.hidden),
        }
        for _ in range(shape.layers)
    ]
    x = torch.randn(shape.batch, shape.hidden, generator=g)
    return layers, x


class _Bare:
    """No runtime calls (the baseline)."""

    def step(self):
        return nullcontext()

    def collective(self, op: str, desc: str):
        return nullcontext()


class _Instrumented:
    """The rank-side runtime, as an instrumented engine calls it."""

    def step(self):
        return runtime.step()

    def collective(self, op: str, desc: str):
        return runtime.collective(op, desc)


class _Timed:
    """Times every step()/collective() where it runs: caches as the model's matmuls leave them.

    ``real`` False wraps ``nullcontext`` the same way, to subtract the timer's own cost.
    """

    def __init__(self, real: bool) -> None:
        self.real = real
        self.spent = 0.0

    def step(self):
        return _TimedContext(self, runtime.step if self.real else nullcontext)

    def collective(self, op: str, desc: str):
        return _TimedContext(self, (lambda: runtime.collective(op, desc)) if self.real else nullcontext)


class _TimedContext:
    def __init__(self, owner: _Timed, make) -> None:
        self.owner = owner
        self.make = make
        self.inner = None

    def __enter__(self):
        t0 = time.perf_counter()
        self.inner = self.make()
        self.inner.__enter__()
        self.owner.spent += time.perf_counter() - t0

    def __exit__(self, *exc):
        t0 = time.perf_counter()
        self.inner.__exit__(*exc)
        self.owner.spent += time.perf_counter() - t0
        return False


def _decode_step(torch, dist, layers, x, hooks):
    with hooks.step():
        for p in layers:
            q = (x @ p["qkv"])[:, : x.shape[1]]
            scores = torch.softmax(q @ p["kv"].T, dim=-1)
            h = (scores @ p["kv"]) @ p["o"]
            with hooks.collective("all_reduce", "8x512 float32"):
                dist.all_reduce(h)
            x = x + h
            gate, up = (x @ p["gate_up"]).chunk(2, dim=-1)
            h = (torch.nn.functional.silu(gate) * up) @ p["down"]
            with hooks.collective("all_reduce", "8x512 float32"):
                dist.all_reduce(h)
            x = x + h
            x = x / (x.norm(dim=-1, keepdim=True) + 1.0)
    return x


def _loop(torch, dist, shape: LoopShape, pairs: int):
    """Per-step pairs (with, without) in alternating order.

    Step times are process CPU time, so time spent descheduled by other jobs
    on the machine does not count.  Returns the pair ratios, the median step
    times with and without, and the in-loop cost of the runtime calls
    (seconds per step) from timed passes.
    """
    layers, x = _model(torch, shape)
    bare, instrumented = _Bare(), _Instrumented()
    for _ in range(max(10, pairs // 20)):  # warm up caches and allocator
        _decode_step(torch, dist, layers, x, instrumented)
        _decode_step(torch, dist, layers, x, bare)
    ratios, with_t, without_t = [], [], []
    clock = time.process_time
    for i in range(pairs):
        times = {}
        for hooks in ((bare, instrumented) if i % 2 == 0 else (instrumented, bare)):
            t0 = clock()
            _decode_step(torch, dist, layers, x, hooks)
            times[hooks is instrumented] = clock() - t0
        ratios.append(times[True] / times[False])
        with_t.append(times[True])
        without_t.append(times[False])
    timed, calibration = _Timed(real=True), _Timed(real=False)
    timed_steps = max(10, pairs // 4)
    for _ in range(timed_steps):
        _decode_step(torch, dist, layers, x, timed)
        _decode_step(torch, dist, layers, x, calibration)
    in_loop = max(0.0, timed.spent - calibration.spent) / timed_steps
    return ratios, statistics.median(with_t), statistics.median(without_t), in_loop


def run(quick: bool) -> Result:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    shape = LoopShape()
    load_before = os.getloadavg()[0]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # where the supervisor puts the segment
    with tempfile.TemporaryDirectory(prefix="bench-hb-", dir=shm) as tmp:
        seg = _attach(Path(tmp))
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            tensor = torch.zeros(shape.batch, shape.hidden)
            per_call = _per_call(20_000 if quick else 200_000, 5, dist, tensor)
            ratios, t_with, t_without, in_loop_s = _loop(torch, dist, shape, 100 if quick else 1000)
            snap = seg.read(0)
            assert snap.step > 0 and snap.coll_seq > 0, "the runtime did not write the segment"
        finally:
            dist.destroy_process_group()
            seg.close()
    colls = 2 * shape.layers
    predicted_s = (per_call["step() begin+end"] + colls * per_call["collective() begin+end"]) / NS
    overheads = sorted((r - 1.0) * 100.0 for r in ratios)
    return Result(
        per_call_ns=per_call,
        step_ms_without=t_without * 1e3,
        step_ms_with=t_with * 1e3,
        overhead_pct=statistics.median(overheads),
        overhead_spread_pct=(overheads[len(overheads) // 4], overheads[(3 * len(overheads)) // 4]),
        predicted_pct=predicted_s / t_without * 100.0,
        in_loop_ns_per_call=in_loop_s / (colls + 1) * NS,
        in_loop_pct=in_loop_s / t_without * 100.0,
        load=(load_before, os.getloadavg()[0]),
        collectives_per_step=colls,
        pairs=len(ratios),
        shape=shape,
    )


def markdown(res: Result, command: str) -> str:
    s = res.shape
    rows = "\n".join(f"| {name} | {ns:,.0f} |" for name, ns in res.per_call_ns.items())
    lo, hi = res.overhead_spread_pct
    return f"""{HEADING}

Command: `{command}` (CPU, torch on one thread; numbers from one run on the
shared {os.cpu_count()}-core development machine, 1-minute load average {res.load[0]:.1f} before and
{res.load[1]:.1f} after: other jobs were running, so small timings are inflated).

Per call, in-process, best of 5 repeats, empty-loop cost subtracted:

| call | ns |
|---|---|
{rows}

Realistic loop, same run: a decode step of a Llama-like TP shard in plain
torch ({s.layers} layers, hidden {s.hidden}, FFN {s.ffn}, batch {s.batch}, attention over {s.context}
positions, {res.collectives_per_step} gloo all_reduces per step on a single-rank group), {res.pairs} pairs of
steps with and without `step()` + `collective()` calls, alternating which goes first:

| | value |
|---|---|
| step CPU time without runtime calls (median) | {res.step_ms_without:.3f} ms |
| step CPU time with runtime calls (median) | {res.step_ms_with:.3f} ms |
| throughput overhead (median of per-step pair ratios) | {res.overhead_pct:+.2f} % (interquartile {lo:+.2f} … {hi:+.2f} %) |
| overhead predicted from the per-call table (hot caches) | {res.predicted_pct:.2f} % |
| runtime calls timed inside the loop: per `step()`/`collective()` | {res.in_loop_ns_per_call:,.0f} ns |
| runtime calls timed inside the loop: share of the step | {res.in_loop_pct:.2f} % |

Goal: overhead <= 1 %; this run: {res.in_loop_pct:.2f} % measured inside the loop
({"met" if res.in_loop_pct <= 1.0 else "not met"}), {res.predicted_pct:.2f} % predicted from hot per-call costs.
Reading the three estimates: the per-call table is
measured with hot caches and is a lower bound; inside the model loop the same
calls run with caches the matmuls just evicted and cost several times more
(the "timed inside the loop" rows, the most direct figure); the pair ratio
measures throughput directly (CPU time, so waiting for the CPU does not
count) but caches shared with other jobs keep it noisy (see its interquartile
range).  The cost is per call, so the overhead scales with
collectives per step / step time: an eager GPU engine with many more
collectives per step and a shorter step pays proportionally more, an engine
whose collectives run inside CUDA graphs pays only the per-step calls.  On a
GPU the matmuls do not evict the CPU caches, so the in-loop cost per call
there should sit closer to the hot-cache table than on this CPU loop.
"""


def update_docs(path: Path, section: str) -> None:
    replace_section(path, HEADING, section)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    ap.add_argument("--update-docs", type=Path, metavar="FILE", help="rewrite the Heartbeat cost section of FILE")
    args = ap.parse_args(argv)
    res = run(args.quick)
    command = ".venv/bin/python -m bench.bench_heartbeat" + (" --quick" if args.quick else "")
    section = markdown(res, command)
    print(section)
    if args.update_docs:
        update_docs(args.update_docs, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
