"""Issue 11 benchmark: a fatal dump that cannot be written never holds up the teardown.

    .venv/bin/python -m bench.bench_dump_deadline [--runs 3] [--quick] [--update-docs [FILE]]

Real processes, ``--kill-grace 2 --dump-timeout 3``, the dump directory
blocking every write: a tmpfs watched by a fanotify listener that never
answers the kernel's permission requests once armed, so every open(2) in it
sleeps in the kernel as on a hung NFS mount (needs CAP_SYS_ADMIN); where that
cannot be mounted, the FIFO stall of ``tests/fakes/stall_dumps.py`` (the
bundle writer first opens a FIFO nobody reads); both in ``tests/support/blockers.py``,
shared with tests/e2e/test_dump_deadline.py.  The blocker is armed once the
supervisor registered (after its start-up check wrote into the directory).
Kinds:

hang        gloo ranks (``tests/fakes/gloo_loop.py``), rank 1 SIGSTOPs itself;
            ``--soft-timeout 2 --hard-timeout 4``: exit 81.
rank_exit   three fake ranks, rank 1 SIGKILLs itself: exit 80.
wedged_nvml the hang again, the dump directory writable, but a stand-in
            ``pynvml`` whose device calls never return (a wedged GPU driver).

Measured from the supervisor's JSON log (same clock): the fault (the ``hang``
or ``rank_exited`` line) -> the last rank process reaped (a pidfd per rank, seen
from here), -> ``teardown_complete`` (logged once the dumps settled) and ->
``supervise_exiting``;
whether the bundle was reported as not written within the deadline; and that
no rank process is left (the ranks' pids from ``rank_started``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil

from bench._docs import ROOT, Stamp, add_common_args, replace_section
from bench.bench_core import last_reaped
from tests.support.blockers import BlockingMount, FifoStall, wedged_pynvml
from tests.support.procs import alive

HEADING = "## Fatal dumps against a blocked dump directory"
MODULE = "bench.bench_dump_deadline"
GLOO = ROOT / "tests" / "fakes" / "gloo_loop.py"
FAKE_RANK = ROOT / "tests" / "fakes" / "rank.py"
STALL_WRAPPER = ROOT / "tests" / "fakes" / "stall_dumps.py"
KILL_GRACE_S = 2.0
DUMP_TIMEOUT_S = 3.0
RUN_LIMIT_S = 120.0
KINDS = ("hang", "rank_exit", "wedged_nvml")
HANG_ARGS = ["--soft-timeout", "2", "--hard-timeout", "4"]


class Writable:
    """The wedged_nvml kind's dump directory: nothing blocks it."""

    kind = "writable"

    def __init__(self, path: Path):
        path.mkdir(parents=True)

    def arm(self) -> None:
        pass

    def close(self) -> None:
        pass


def blocker_for(path: Path) -> tuple[object, Path | None, str | None]:
    """(blocker, wrapper entry point or None, why the mount could not be used)."""
    try:
        return BlockingMount(path), None, None
    except (OSError, subprocess.CalledProcessError) as exc:
        return FifoStall(path), STALL_WRAPPER, f"{type(exc).__name__}: {exc}"


@dataclass
class Run:
    kind: str
    blocker: str
    exit_code: int | None
    fault_to_reaped_s: float | None  # the last rank process reaped by the supervisor, seen by pidfd
    fault_to_teardown_s: float | None  # teardown_complete: logged once the dumps settled (their deadline)
    fault_to_exit_s: float | None
    not_written_reported: bool
    bundle_written: bool
    left: list[int]
    gpu_telemetry: bool  # the stand-in NVML was loaded (wedged_nvml)
    gpu_verified: bool | None


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _ranks(proc: subprocess.Popen, n: int) -> list[int]:
    """The supervisor's ``n`` rank processes (its children), once all started."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            kids = [c.pid for c in psutil.Process(proc.pid).children()]
        except psutil.Error:
            kids = []
        if len(kids) >= n:
            return kids
        time.sleep(0.02)
    raise RuntimeError("the ranks did not start")


def run_one(kind: str, work: Path) -> Run:
    dump_dir = work / "dumps"
    env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(work / "registry"))
    reason = None
    if kind == "wedged_nvml":
        blocker, entry = Writable(dump_dir), None
        env["PYTHONPATH"] = wedged_pynvml(work / "wedged-nvml", env.get("PYTHONPATH", ""))
    else:
        blocker, entry, reason = blocker_for(dump_dir)
    if reason:
        print(f"  {kind}: no blocking mount here ({reason}); the FIFO stall instead", file=sys.stderr)
    nproc = 3 if kind == "rank_exit" else 2
    if kind == "rank_exit":
        args = ["--nproc-per-node", "3"]
        command = [sys.executable, str(FAKE_RANK), "--all", "sleep", "--on", "1=sigkill", "--delay", "2"]
    else:
        args = ["--nproc-per-node", "2", *HANG_ARGS]
        command = [sys.executable, str(GLOO), "--iters", "100000", "--fault", "stop", "--fault-at", "30"]
    head = [sys.executable, str(entry)] if entry is not None else [sys.executable, "-m", "tp_supervise.supervisor.cli"]
    argv = [*head, "serve", "--log-format", "json", "--metrics-addr", "127.0.0.1:0", "--metrics-linger", "0",
            "--dump-dir", str(dump_dir), "--kill-grace", str(KILL_GRACE_S), "--dump-timeout", str(DUMP_TIMEOUT_S),
            *args, "--", *command]  # fmt: skip
    log_path = work / "supervise.log"
    try:
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            registry = work / "registry"
            while not (registry.is_dir() and any(registry.glob("*.json"))):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the supervisor did not register:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.05)
            blocker.arm()  # past the start-up check, which writes into the dump directory
            fds = [os.pidfd_open(p) for p in _ranks(proc, nproc)]
            reaped: list[float | None] = []
            watcher = threading.Thread(target=lambda: reaped.append(last_reaped(fds, RUN_LIMIT_S)), daemon=True)
            watcher.start()
            code = proc.wait(timeout=RUN_LIMIT_S)
            watcher.join(RUN_LIMIT_S)
            for fd in fds:
                os.close(fd)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        blocker.close()
    lines = []
    for line in log_path.read_text().splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass

    def first(name: str) -> dict | None:
        return next((ev for ev in lines if ev.get("event") == name), None)

    fault = first("rank_exited" if kind == "rank_exit" else "hang")
    done = first("teardown_complete") or first("teardown_incomplete")
    exiting = first("supervise_exiting")

    def since(ev: dict | None) -> float | None:
        return None if fault is None or ev is None else _ts(ev["timestamp"]) - _ts(fault["timestamp"])

    time.sleep(0.2)
    pids = [int(ev["pid"]) for ev in lines if ev.get("event") == "rank_started"]
    reaped_at = reaped[0] if reaped else None
    return Run(
        kind=kind,
        blocker=blocker.kind,
        exit_code=code,
        fault_to_reaped_s=None if fault is None or reaped_at is None else reaped_at - _ts(fault["timestamp"]),
        fault_to_teardown_s=since(done),
        fault_to_exit_s=since(exiting),
        not_written_reported=first("incident_bundle_not_written_within_dump_timeout") is not None,
        bundle_written=first("incident_bundle_written") is not None,
        left=[p for p in pids if alive(p)],
        gpu_telemetry=first("gpu_telemetry_enabled") is not None,
        gpu_verified=(done or {}).get("gpu_memory_verified"),
    )


def _range(values: list[float | None]) -> str:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return "-"
    return f"{vals[0]:.2f}" if len(vals) == 1 else f"{vals[0]:.2f}-{vals[-1]:.2f}"


def section(stamp: Stamp, runs: list[Run]) -> str:
    rows = []
    for kind in dict.fromkeys(r.kind for r in runs):
        rs = [r for r in runs if r.kind == kind]
        extra = ""
        if kind == "wedged_nvml":
            extra = (
                f"; stand-in NVML loaded: {sum(r.gpu_telemetry for r in rs)}/{len(rs)}, GPU memory check "
                f"skipped: {sum(r.gpu_verified is False for r in rs)}/{len(rs)}"
            )
        rows.append(
            f"| {kind} | {rs[0].blocker} | {len(rs)} | {sorted({r.exit_code for r in rs}, key=str)} "
            f"| {_range([r.fault_to_reaped_s for r in rs])} | {_range([r.fault_to_teardown_s for r in rs])} "
            f"| {_range([r.fault_to_exit_s for r in rs])} "
            f"| {sum(r.not_written_reported for r in rs)}/{len(rs)} | {sum(r.bundle_written for r in rs)}/{len(rs)} "
            f"| {sum(len(r.left) for r in rs)}{extra} |"
        )
    bound = KILL_GRACE_S + DUMP_TIMEOUT_S
    worst = max((r.fault_to_exit_s for r in runs if r.fault_to_exit_s is not None), default=None)
    return f"""{HEADING}

{stamp.text()}

End to end with real processes, `supervise serve --kill-grace {KILL_GRACE_S:g} --dump-timeout {DUMP_TIMEOUT_S:g}`, the
dump directory blocking every write from the moment the supervisor registered (the kinds: `hang`, gloo
ranks, rank 1 SIGSTOPped, `{" ".join(HANG_ARGS)}`; `rank_exit`, three fake ranks, rank 1
SIGKILLed; `wedged_nvml`, the hang with a writable dump directory and a stand-in `pynvml` whose device
calls never return). Times from the supervisor's log line that names the fault (`hang`, `rank_exited`).

| kind | dump directory | runs | exit | fault -> last rank reaped s | fault -> `teardown_complete` s | fault -> `supervise exiting` s | "not written within --dump-timeout" | bundle written | rank processes left |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

The ranks are gone soon after the fault (the last one reaped by the supervisor, seen from the benchmark
by pidfd); the rest, up to `teardown_complete` and the exit, is the wait for the bundle write, given up at
the dump's deadline (`--dump-timeout` after it started). Bound: kill-grace + dump-timeout =
{bound:g} s; the slowest exit here came {"-" if worst is None else f"{worst:.2f}"} s after its fault.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per kind")
    ap.add_argument("--kinds", default=",".join(KINDS))
    add_common_args(ap, "one rank_exit run (the blocked directory, fake ranks)")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.kinds = 1, "rank_exit"
    stamp = Stamp.begin(MODULE, argv)
    kinds = [k for k in args.kinds.split(",") if k]
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-dump-deadline-") as tmp:
        for i in range(args.runs):
            for kind in kinds:
                r = run_one(kind, Path(tmp) / f"{kind}-{i}")
                runs.append(r)
                print(
                    f"{kind} run {i + 1}: exit {r.exit_code}, fault -> teardown {r.fault_to_teardown_s}, "
                    f"-> exit {r.fault_to_exit_s}, left {r.left}",
                    file=sys.stderr,
                    flush=True,
                )
    text = section(stamp, runs)
    print(text)
    if args.update_docs:
        replace_section(args.update_docs, HEADING, text)
    want = {"hang": 81, "rank_exit": 80, "wedged_nvml": 81}
    bad = [f"{r.kind}: exit {r.exit_code}, left {r.left}" for r in runs if r.exit_code != want[r.kind] or r.left]
    if bad:
        print(f"runs that failed: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
