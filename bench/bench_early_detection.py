"""Issue 11 benchmark: how fast the adaptive watchdogs name a hang early in a run.

    .venv/bin/python -m bench.bench_early_detection [--runs 2] [--fault-at 25,100,400]
                                                    [--json FILE] [--baseline FILE] [--quick] [--update-docs [FILE]]

Each run starts ``supervise serve --nproc-per-node 2 --kill-grace 2`` with NO
timeout flags (adaptive thresholds) around ``tests/fakes/gloo_loop.py``, a
plain torch.distributed gloo program (zero-code: one 64x256 all_reduce and a
10 ms sleep per iteration), whose rank 1 SIGSTOPs itself at iteration N.
Measured per run:

* the fault instant: the benchmark sees rank 1 stopped (state T) in /proc,
  polled every 10 ms;
* fault -> soft verdict (``hang suspected:``) and fault -> hard verdict
  (``hang:``) from the supervisor's log events (same host clock), fault ->
  the supervisor process exited;
* the thresholds in force, their source, the learner's basis and the progress
  events behind it, from the hang bundle's ``summary.json``.

``--json FILE`` writes the runs as JSON; ``--baseline FILE`` (such a JSON,
e.g. from the code before a change) adds its medians to the summary.
Goal (issue 11): exit 81 within 30 s of a fault ~1 s after the first collective.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from bench._docs import Stamp, add_common_args, replace_section
from bench.bench_detection import parse_log
from tp_supervise.supervisor.observers.watchdog_thread import TICK_S
from tp_supervise.watchdogs.adaptive import AdaptiveParams

HEADING = "## Early hang detection (adaptive warm-up)"
MODULE = "bench.bench_early_detection"
QUICK_FAULT_AT = 100
ROOT = Path(__file__).resolve().parent.parent
GLOO = ROOT / "tests" / "fakes" / "gloo_loop.py"
DEFAULT_RUNS = 2
DEFAULT_FAULT_AT = "25,100,400"
RUN_LIMIT_S = 180.0
POLL_S = 0.01
KILL_GRACE_S = 2.0
GOAL_S = 30.0


@dataclass
class RunResult:
    fault_at: int
    exit_code: int | None
    culprit_ranks: list | None
    soft_s: float | None  # fault -> "hang suspected"
    hard_s: float | None  # fault -> "hang"
    exit_s: float | None  # fault -> supervisor exited
    hard_threshold_s: float | None
    source: str | None
    basis_s: float | None
    events: int | None
    note: str = ""


def _stopped_at(proc: subprocess.Popen, limit_s: float) -> float | None:
    """Wall-clock instant a descendant of ``proc`` is first seen stopped (None: never, or proc exited)."""
    deadline = time.monotonic() + limit_s
    try:
        parent = psutil.Process(proc.pid)
    except psutil.Error:
        return None
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            for child in parent.children(recursive=True):
                try:
                    if child.status() == psutil.STATUS_STOPPED:
                        return time.time()
                except psutil.Error:
                    continue
        except psutil.Error:
            return None
        time.sleep(POLL_S)
    return None


def run_one(fault_at: int, work: Path) -> RunResult:
    dump_dir = work / "dumps"
    log_path = work / "supervise.log"
    argv = [
        sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--nproc-per-node", "2",
        "--kill-grace", str(KILL_GRACE_S), "--metrics-addr", "none", "--metrics-linger", "0",
        "--dump-dir", str(dump_dir), "--log-format", "json",
        "--", sys.executable, str(GLOO), "--iters", "100000", "--fault", "stop", "--fault-at", str(fault_at),
    ]
    env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(work / "registry"))
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    note = ""
    exited: float | None = None
    try:
        fault = _stopped_at(proc, RUN_LIMIT_S)
        try:
            proc.wait(timeout=RUN_LIMIT_S)
            exited = time.time()
        except subprocess.TimeoutExpired:
            note = f"no exit within {RUN_LIMIT_S:.0f} s"
            proc.send_signal(signal.SIGTERM)
    finally:
        if proc.poll() is None:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    events = parse_log(log_path.read_text())  # the same log reading as bench_detection
    if exited is not None:
        events["exit"] = exited

    def since(name: str) -> float | None:
        at = events.get(name)
        return None if fault is None or at is None else round(at - fault, 2)

    hangs = sorted(p for p in dump_dir.glob("*-hang*") if "hang_suspected" not in p.name) if dump_dir.is_dir() else []
    summary = json.loads((hangs[-1] / "summary.json").read_text()) if hangs else {}
    wd = summary.get("watchdog") or {}
    learned = wd.get("adaptive") or {}
    return RunResult(
        fault_at=fault_at,
        exit_code=proc.returncode,
        culprit_ranks=summary.get("culprit_ranks"),
        soft_s=since("soft"),
        hard_s=since("hard"),
        exit_s=since("exit"),
        hard_threshold_s=wd.get("hard_timeout_seconds"),
        source=wd.get("hard_source"),
        basis_s=learned.get("basis_seconds"),
        events=learned.get("events", learned.get("samples")),
        note=note or ("" if fault else "rank 1 never seen stopped"),
    )


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def reading(results: list[RunResult], baseline: list[dict] | None) -> str:
    """What the figures say, from the figures (warm-up size from the learner's defaults)."""
    params = AdaptiveParams()
    learned = [r for r in results if r.source == "learned" and r.exit_s is not None]
    warm = sorted({r.fault_at for r in results if r.source == "warmup"})
    text = [f"Reading: the learner warms up on {params.warmup_events} progress events of the group (collectives, "
            "measured by the ranks' own clocks)."]
    if learned:
        basis = [r.basis_s for r in learned if r.basis_s]
        text.append(
            f" A fault after that is named by the hard verdict {_f(min(r.hard_s for r in learned))}-"
            f"{_f(max(r.hard_s for r in learned))} s after it (the {params.hard_floor:.0f} s hard floor plus at most "
            f"a tick or two) and the supervisor has exited {_f(max(r.exit_s for r in learned))} s after it at most; "
            f"the learner's basis is the loop's own interval ({_f(min(basis), 3)}-{_f(max(basis), 3)} s), "
            f"not the {TICK_S:g} s tick."
        )
    if warm:
        text.append(
            f" A fault at iteration {', '.join(map(str, warm))} comes before the warm-up ends: the warm-up "
            f"thresholds ({params.warmup_soft:.0f} s / {params.warmup_hard:.0f} s) apply, as for a long first step."
        )
    if baseline:
        before = [b["exit_s"] for b in baseline if b.get("exit_s") is not None]
        if before:
            text.append(
                f" Before (the `--baseline` runs), every fault waited for the warm-up hard threshold: exit "
                f"{_f(min(before))}-{_f(max(before))} s after the fault."
            )
    return textwrap.fill("".join(text), width=110, break_on_hyphens=False)


def markdown(results: list[RunResult], cfg: dict, baseline: list[dict] | None) -> str:
    rows = [
        f"| {r.fault_at} | {r.exit_code} | {r.culprit_ranks} | {_f(r.soft_s)} | {_f(r.hard_s)} | {_f(r.exit_s)} "
        f"| {_f(r.hard_threshold_s)} ({r.source}) | {_f(r.basis_s or None, 4)} | {r.events} |"
        for r in results
    ]
    lines = []
    for n in dict.fromkeys(r.fault_at for r in results):
        mine = [r for r in results if r.fault_at == n]
        exit_s = _median([r.exit_s for r in mine])
        before = _median([b.get("exit_s") for b in baseline or [] if b.get("fault_at") == n])
        lines.append(
            f"| {n} | {len(mine)} | {_f(_median([r.hard_s for r in mine]))} | {_f(exit_s)} "
            + (f"| {_f(before)} " if baseline else "")
            + f"| {'yes' if all(r.exit_s is not None and r.exit_s <= GOAL_S for r in mine) else 'no'} |"
        )
    return f"""{HEADING}

{cfg['stamp']}

`supervise serve --nproc-per-node 2`, **no timeout flags**, around `tests/fakes/gloo_loop.py`: zero-code
gloo, one all_reduce and a 10 ms sleep per iteration; rank 1 SIGSTOPs itself at iteration N, i.e. after N
collectives, about N x 10 ms after the first. Fault instant: the benchmark sees rank 1 stopped in /proc;
verdicts: the supervisor's log events; exit: the process; thresholds, basis and events: the hang bundle's
`summary.json`.{cfg['baseline']}

| fault at iteration | exit | culprit | fault -> soft s | fault -> hard s | fault -> exit s | hard threshold s (source) | learner basis s | events learned |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

| fault at iteration | runs | fault -> hard s (median) | fault -> exit s (median) |{" before: fault -> exit s (median) |" if baseline else ""} within {GOAL_S:.0f} s |
|---|---|---|---|{"---|" if baseline else ""}---|
{chr(10).join(lines)}

{reading(results, baseline)}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="runs per fault iteration")
    ap.add_argument("--fault-at", default=DEFAULT_FAULT_AT, help="comma-separated iterations of the fault")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write every run as JSON to FILE")
    ap.add_argument("--baseline", type=Path, help="JSON of earlier runs (--json output) to compare with")
    ap.add_argument("--baseline-label", default="earlier runs", help="what --baseline measured (for the docs)")
    add_common_args(ap, f"one run, the fault at iteration {QUICK_FAULT_AT} (after the warm-up)")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.fault_at = 1, str(QUICK_FAULT_AT)
    stamp = Stamp.begin(MODULE, argv)
    fault_ats = [int(n) for n in args.fault_at.split(",") if n.strip()]
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-early-") as tmp:
        for i in range(args.runs):
            for n in fault_ats:  # interleaved: machine load drifts over time
                work = Path(tmp) / f"{n}-{i}"
                work.mkdir()
                r = run_one(n, work)
                print(f"fault at {n} run {i + 1}: exit {r.exit_code}, hard {r.hard_s} s, exit {r.exit_s} s, "
                      f"threshold {r.hard_threshold_s} ({r.source}), events {r.events} {r.note}",
                      file=sys.stderr, flush=True)
                results.append(r)
    cfg = {"stamp": stamp.text(),
           "baseline": f"\n\"Before\": `--baseline {args.baseline}`, {args.baseline_label}." if baseline else ""}
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    section = markdown(results, cfg, baseline)
    print(section)
    if args.update_docs:
        replace_section(args.update_docs, HEADING, section)
    return 0 if results and all(r.exit_code == 81 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
