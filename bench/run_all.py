"""`make bench`: every benchmark in one go, each rewriting its own section(s) of docs/benchmarks.md.

    .venv/bin/python -m bench.run_all              # the full run: every benchmark with --update-docs
    .venv/bin/python -m bench.run_all --quick      # every benchmark's --quick mode, docs untouched
    .venv/bin/python -m bench.run_all --only bench_core,bench_dumps [--quick]

The full run re-measures every section of docs/benchmarks.md (each stamped
with its date, commit, load average, machine and exact command); run it on a
quiet machine.  ``--quick`` runs each benchmark's smoke mode (a few seconds
each, the same code paths with fewer rounds, ranks or iterations) so that a
broken benchmark fails: tests/test_bench_quick.py runs it.  What needs
something this machine lacks (a GPU, Prometheus, transformers) is skipped
with the reason printed; without a GPU the full run records the GPU check's
CPU dry run, saying so.  Exit 1 when a benchmark that ran failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench._docs import dirty

ROOT = Path(__file__).resolve().parent.parent
DOCS = Path("docs") / "benchmarks.md"
QUICK_LIMIT_S = 150  # one benchmark's quick mode; the whole --quick run must stay under 3 minutes
FULL_LIMIT_S = 3600


def gpu_reason() -> str | None:
    """None where an NVIDIA GPU is visible, else why not (no torch import: this runs before every benchmark)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if (gpus.is_dir() and any(gpus.iterdir())) or shutil.which("nvidia-smi"):
        return None
    return "needs an NVIDIA GPU (no /proc/driver/nvidia/gpus, no nvidia-smi)"


def prometheus_reason() -> str | None:
    return None if shutil.which("prometheus") else "needs a Prometheus server on PATH (apt-get install prometheus)"


def transformers_reason() -> str | None:
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    return f"needs {' and '.join(missing)} (the dev extra)" if missing else None


@dataclass(frozen=True)
class Bench:
    module: str
    full: tuple[str, ...] = ()  # extra arguments of the full run (it adds --update-docs)
    needs: Callable[[], str | None] = lambda: None  # a reason to skip, or None
    # The full run on a machine that lacks what ``needs`` checks: other arguments instead of a skip.
    full_without: tuple[str, ...] | None = None
    note: str = ""

    @property
    def name(self) -> str:
        return self.module.rsplit(".", 1)[-1]

    def argv(self, quick: bool, docs: Path) -> tuple[list[str] | None, str | None]:
        """(arguments, None) to run it, or (None, the reason it is skipped)."""
        reason = self.needs()
        if quick:
            return (None, reason) if reason else (["--quick"], None)
        if reason and self.full_without is None:
            return None, reason
        extra = list(self.full_without if reason else self.full)
        return [*extra, "--update-docs", str(docs)], None


BENCHES = [
    Bench("bench.bench_core"),
    Bench("bench.bench_heartbeat"),
    Bench("bench.bench_control_plane"),
    Bench("bench.bench_dumps"),
    Bench("bench.bench_dump_deadline"),
    Bench("bench.bench_consensus"),
    Bench("bench.bench_detection"),
    Bench("bench.bench_early_detection"),
    Bench("bench.bench_hook_startup"),
    Bench("bench.bench_serving"),
    Bench("bench.bench_straggler"),
    Bench("bench.bench_engine", needs=transformers_reason),
    Bench("bench.bench_alert_delivery", needs=prometheus_reason),
    # Without a GPU the full run records the CPU dry run of the script's plumbing (the section says so).
    Bench("bench.gpu_check", needs=gpu_reason, full_without=("--dry-run-cpu",)),
    # 64 nodes (the goal) needs more than 2 cores: docs/benchmarks.md, "Multi-node".
    Bench("bench.bench_multinode", full=("--nodes", "24")),
]


@dataclass
class Outcome:
    name: str
    status: str  # ok, FAILED, skipped
    seconds: float = 0.0
    detail: str = ""
    argv: list[str] = field(default_factory=list)


_running: list[subprocess.Popen] = []


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _on_stop_signal(signum: int, _frame) -> None:
    """SIGTERM / SIGINT: the benchmark in progress runs in its own session, so stop it first."""
    for proc in list(_running):
        _stop(proc)
    raise SystemExit(128 + signum)


def run_one(bench: Bench, quick: bool, docs: Path, allow_dirty: bool = False) -> Outcome:
    args, reason = bench.argv(quick, docs)
    if args is None:
        print(f"=== {bench.name}: skipped: {reason}", flush=True)
        return Outcome(bench.name, "skipped", detail=reason or "")
    if allow_dirty and not quick:
        args.append("--allow-dirty")
    argv = [sys.executable, "-m", bench.module, *args]
    print(f"=== {bench.name}: {' '.join(['python', '-m', bench.module, *args])}", flush=True)
    limit = QUICK_LIMIT_S if quick else FULL_LIMIT_S
    t0 = time.monotonic()
    # Its own session: a benchmark that overruns (or a stopped run_all) is stopped with everything it started.
    proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)
    _running.append(proc)
    try:
        code = proc.wait(timeout=limit)
        detail = "" if code == 0 else f"exit {code}"
    except subprocess.TimeoutExpired:
        _stop(proc)
        code, detail = -1, f"ran past {limit} s"
    finally:
        _running.remove(proc)
    seconds = time.monotonic() - t0
    status = "ok" if code == 0 else "FAILED"
    print(f"--- {bench.name}: {status}{f' ({detail})' if detail else ''} in {seconds:.1f} s", flush=True)
    return Outcome(bench.name, status, seconds, detail, args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every benchmark's smoke mode; docs untouched")
    ap.add_argument("--only", default="", help="comma-separated benchmark names (bench_core, gpu_check, ...)")
    ap.add_argument("--docs", type=Path, default=DOCS, help="the file the full run rewrites (default %(default)s)")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and what each needs")
    ap.add_argument("--allow-dirty", action="store_true", help="the full run from a tree with uncommitted changes")
    args = ap.parse_args(argv)
    if not args.quick and not args.list and not args.allow_dirty and dirty():
        ap.error("the full run rewrites docs: tracked files have uncommitted changes (commit them, or --allow-dirty)")
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    unknown = only - {b.name for b in BENCHES}
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    benches = [b for b in BENCHES if not only or b.name in only]
    if args.list:
        for b in benches:
            reason = b.needs()
            print(f"{b.name}: {'runs here' if reason is None else reason}")
        return 0
    signal.signal(signal.SIGTERM, _on_stop_signal)
    signal.signal(signal.SIGINT, _on_stop_signal)
    t0 = time.monotonic()
    outcomes = [run_one(b, args.quick, args.docs, args.allow_dirty) for b in benches]
    total = time.monotonic() - t0
    print(f"\n{'quick' if args.quick else 'full'} run: {total:.1f} s")
    for o in outcomes:
        print(f"  {o.name:24s} {o.status:8s} {o.seconds:6.1f} s  {o.detail}")
    failed = [o.name for o in outcomes if o.status == "FAILED"]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
