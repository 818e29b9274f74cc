"""``supervise drill``: the fault matrix against the built-in engine.

For each inject kind: start ``supervise serve --tp N --inject KIND@1:STEP``
on free ports, drive completion requests at it until the supervisor exits (or
a time limit), and check the outcome against what the kind must produce::

    kind              exit  bundle            culprit
    crash/exit/segfault/abort   80  rank_exit  [1]
    stop/hang_collective/hang_scheduler  81  hang  [1]
    diverge_token/diverge_batch (replicated, enforce)  82  divergence  [1]
    slow              0 after SIGTERM, no bundle (slow is not a hang)

Prints a table (rich) or ``--json``; exit 0 only when every kind passed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from tp_supervise.engine.inject import KINDS as INJECT_KINDS  # the engine owns its fault kinds

from .rank.net import free_port

FAULT_RANK = 1
FAULT_STEP = 20
DRILL_LIMIT_S = 120.0
SLOW_OBSERVE_S = 15.0
READY_TIMEOUT_S = 90.0
LOAD_THREADS = 4
REQUEST_TIMEOUT_S = 30.0
HEALTH_POLL_S = 0.2

EXPECT = {
    "crash": (80, "rank_exit"),
    "exit": (80, "rank_exit"),
    "segfault": (80, "rank_exit"),
    "abort": (80, "rank_exit"),
    "stop": (81, "hang"),
    "hang_collective": (81, "hang"),
    "hang_scheduler": (81, "hang"),
    "diverge_token": (82, "divergence"),
    "diverge_batch": (82, "divergence"),
    "slow": (0, None),
}


@dataclass
class DrillResult:
    kind: str
    passed: bool
    exit_code: int | None
    expected_exit: int
    bundle_reason: str | None
    culprit_ranks: list[int] | None
    detect_s: float | None
    verdict: str
    note: str = ""


def _load(port: int, stop: threading.Event) -> None:
    body = json.dumps({"prompt": "drill", "max_tokens": 64, "ignore_eos": True, "temperature": 0}).encode()
    url = f"http://127.0.0.1:{port}/v1/completions"
    while not stop.is_set():
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
                resp.read()
        except (urllib.error.URLError, OSError, ValueError):
            stop.wait(0.2)


def wait_engine_health(port: int, proc: subprocess.Popen, deadline: float) -> bool:
    """Until the engine's /health answers 200, ``proc`` exits, or the monotonic deadline."""
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(HEALTH_POLL_S)
    return False


def run_one(kind: str, tp: int, dump_root: Path) -> DrillResult:
    expected_exit, expected_reason = EXPECT[kind]
    dump_dir = dump_root / kind
    port = free_port()
    plane = "replicated" if kind.startswith("diverge") else "broadcast"
    argv = [
        sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--tp", str(tp), "--port", str(port),
        "--metrics-addr", "127.0.0.1:0", "--metrics-linger", "0", "--dump-dir", str(dump_dir), "--log-format", "json",
        "--soft-timeout", "3", "--hard-timeout", "6", "--kill-grace", "3",
        "--control-plane", plane, "--consensus", "enforce",
        "--inject", f"{kind}@{FAULT_RANK}:{FAULT_STEP}",
    ]
    log_path = dump_root / f"{kind}.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
        stop = threading.Event()
        threads = []
        try:
            if not wait_engine_health(port, proc, time.monotonic() + READY_TIMEOUT_S):
                proc.kill()
                proc.wait()
                return DrillResult(kind, False, proc.returncode, expected_exit, None, None, None, "", "engine never became ready")
            started = time.monotonic()
            threads = [threading.Thread(target=_load, args=(port, stop), daemon=True) for _ in range(LOAD_THREADS)]
            for t in threads:
                t.start()
            limit = SLOW_OBSERVE_S if kind == "slow" else DRILL_LIMIT_S
            try:
                code = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                if kind == "slow":
                    proc.send_signal(signal.SIGTERM)
                    code = proc.wait(timeout=60)
                else:
                    proc.kill()
                    code = proc.wait()
            ended = time.monotonic()
        finally:
            stop.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    bundles = sorted(p for p in dump_dir.iterdir() if p.is_dir() and not p.name.startswith(".")) if dump_dir.is_dir() else []
    fatal = [b for b in bundles if "hang_suspected" not in b.name]
    summary = json.loads((fatal[-1] / "summary.json").read_text()) if fatal else {}
    reason = summary.get("reason")
    culprits = summary.get("culprit_ranks")
    passed = code == expected_exit and reason == expected_reason
    if expected_reason is not None:
        passed = passed and culprits == [FAULT_RANK]
    return DrillResult(
        kind, passed, code, expected_exit, reason, culprits,
        round(ended - started, 2) if expected_reason else None, summary.get("verdict", ""), f"log: {log_path}",
    )


def main(args) -> int:
    kinds = list(INJECT_KINDS) if args.kinds == "all" else [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in EXPECT]
    if unknown:
        print(f"supervise drill: unknown kind(s) {', '.join(unknown)}; choose from {', '.join(EXPECT)}", file=sys.stderr)
        return 64
    dump_root = Path(args.dump_dir)
    dump_root.mkdir(parents=True, exist_ok=True)
    results = [run_one(kind, args.tp, dump_root) for kind in kinds]
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"supervise drill (TP={args.tp}, fault on rank {FAULT_RANK} at step {FAULT_STEP})")
        for col in ("kind", "result", "exit", "bundle", "culprit", "detected after", "verdict"):
            table.add_column(col)
        for r in results:
            table.add_row(
                r.kind,
                "[green]pass[/]" if r.passed else "[red]FAIL[/]",
                f"{r.exit_code} (want {r.expected_exit})",
                r.bundle_reason or "-",
                str(r.culprit_ranks) if r.culprit_ranks is not None else "-",
                f"{r.detect_s:.1f} s" if r.detect_s is not None else "-",
                r.verdict or r.note,
            )
        Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0 if all(r.passed for r in results) else 1


__all__ = ["main", "run_one", "EXPECT"]
