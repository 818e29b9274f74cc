"""Issue 34 measure: what the control-plane seams cost vLLM's engine core and API server, per step.

    .venv/bin/python -m bench.bench_control_plane [--quick] [--update-docs [FILE]]

The engine adapter wraps, in vLLM's engine core, ``EngineCoreProc._process_engine_step`` (step begin/end),
``_process_input_queue`` (phase idle) and ``Scheduler.schedule`` (phase, then the step's tokens), and in its API
server ``OutputProcessor.add_request`` / ``process_outputs`` / ``abort_requests`` (requests in flight, each batch
of outputs).  This times one engine-core step (the three wrapped calls around methods that do nothing) and one
front-end output batch, wrapped and unwrapped, on classes with vLLM 0.32's names and signatures, writing a real
control segment in /dev/shm as a supervised run does: best of ``--repeat`` rounds of ``--number`` calls.  The
difference is what the supervisor adds to every step of the engine; a real step on the tiny CPU model takes
tens of milliseconds, a decode step of a large model on GPUs a few.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import timeit
import types
from pathlib import Path

from bench._docs import Stamp, add_common_args, replace_section

HEADING = "## Control-plane seams: cost per engine step"
MODULE = "bench.bench_control_plane"
NS = 1e9


class _Output:
    total_num_scheduled_tokens = 17


class Scheduler:
    def schedule(self, throttle_prefills=False):
        return _Output()


class EngineCoreProc:
    def __init__(self):
        self.scheduler = Scheduler()

    def _process_input_queue(self):
        return None

    def _process_engine_step(self):
        self.scheduler.schedule()
        return True


class OutputProcessor:
    def __init__(self):
        self.request_states = {"a": 0, "b": 0}

    def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None):
        return None

    def process_outputs(self, engine_core_outputs, engine_core_timestamp=None, iteration_stats=None):
        return None

    def abort_requests(self, request_ids, internal):
        return []


def _step(core: EngineCoreProc) -> None:
    core._process_input_queue()
    core._process_engine_step()


def measure(number: int, repeat: int) -> dict[str, float]:
    """ns per engine-core step and per front-end output batch: (plain, wrapped)."""
    plain_core, plain_front = EngineCoreProc(), OutputProcessor()

    def best(stmt) -> float:
        return min(timeit.repeat(stmt, number=number, repeat=repeat)) / number * NS

    plain_step = best(lambda: _step(plain_core))
    plain_batch = best(lambda: plain_front.process_outputs([1]))
    with tempfile.TemporaryDirectory(prefix="bench-control-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        from tp_supervise.supervisor.rank import engines, runtime
        from tp_supervise.supervisor.rank import heartbeat as hb

        segment = hb.HeartbeatSegment(Path(tmp) / "control", hb.CONTROL_SLOTS, "bench", 0.0)
        os.environ[runtime.ENV_CONTROL] = str(segment.path)
        try:
            wrapped = {}
            for name, cls in (
                ("vllm.v1.core.sched.scheduler", "Scheduler"),
                ("vllm.v1.engine.core", "EngineCoreProc"),
                ("vllm.v1.engine.output_processor", "OutputProcessor"),
            ):
                base = globals()[cls]
                copy = type(cls, (), dict(base.__dict__))  # a fresh class: the plain one stays plain
                module = types.ModuleType(name)
                setattr(module, cls, copy)
                engines.patcher(lambda _label, fn: fn)(module)
                wrapped[cls] = copy
            core = wrapped["EngineCoreProc"]()
            core.scheduler = wrapped["Scheduler"]()
            front = wrapped["OutputProcessor"]()
            _step(core)
            front.add_request("a", "x")  # the claims happen here, once
            step = best(lambda: _step(core))
            batch = best(lambda: front.process_outputs([1]))
            written = segment.read(hb.control_slot(hb.ROLE_SCHEDULER))
            assert written.claimed and written.step > 0 and written.last_step_tokens == 17, written
        finally:
            os.environ.pop(runtime.ENV_CONTROL, None)
            engines.uninstrument()
            segment.close()
    return {"step_plain": plain_step, "step": step, "batch_plain": plain_batch, "batch": batch}


def markdown(stamp: Stamp, r: dict[str, float], number: int, repeat: int) -> str:
    return f"""{HEADING}

{stamp.text()}

What the control-plane seams (docs/watchdogs.md, "The control plane") add to vLLM's own calls, timed on classes
with vLLM 0.32's names and signatures whose methods do nothing, writing a real control segment: best of {repeat}
rounds of {number:,} calls.

| per | unwrapped ns | wrapped ns | added ns |
|---|---|---|---|
| engine-core step (`_process_input_queue` + `_process_engine_step` + `Scheduler.schedule`) | {r["step_plain"]:,.0f} | {r["step"]:,.0f} | {r["step"] - r["step_plain"]:,.0f} |
| front-end output batch (`OutputProcessor.process_outputs`, requests in flight) | {r["batch_plain"]:,.0f} | {r["batch"]:,.0f} | {r["batch"] - r["batch_plain"]:,.0f} |

Reading: the engine core pays about {(r["step"] - r["step_plain"]) / 1000:.1f} us per step and the API server
about {(r["batch"] - r["batch_plain"]) / 1000:.1f} us per batch of outputs (a few locked stores into a shared-memory
slot, a comparison of the phase's text, no string formatted): against a step of the tiny CPU model (tens of ms)
under 0.1 %; against a 5 ms GPU decode step, well under 1 %.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=MODULE, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    add_common_args(ap, "2,000 calls x 3 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.number, args.repeat = 2000, 3
    stamp = Stamp.begin(MODULE, argv)
    r = measure(args.number, args.repeat)
    section = markdown(stamp, r, args.number, args.repeat)
    print(section)
    if args.update_docs:
        replace_section(args.update_docs, HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
