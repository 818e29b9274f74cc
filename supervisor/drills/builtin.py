"""``supervise drill``: the fault matrix against the built-in engine (a COMMAND's drill: command.py).

For each inject kind: start ``supervise serve --tp N --max-restarts 1 --inject
KIND@1:STEP`` on free ports, drive completion requests at it until the
supervisor exits (or a time limit), and check the outcome against what the
kind must produce.  The injection fires in every attempt: the group fails,
restarts once, and fails again, so the exit code and the last bundle are the
second fault's::

    kind              exit  bundle            culprit
    crash/exit/segfault/abort   80  rank_exit  [1]
    stop/hang_collective/hang_scheduler  81  hang  [1]
    diverge_token/diverge_batch (replicated, enforce)  82  divergence  [1]
    slow              0 after SIGTERM, no fatal bundle (slow is not a hang), a straggler bundle naming the rank
    poison (poison@1, --max-restarts 3)  0 after SIGTERM  rank_exit  [1]: a request carrying
                      TPS_POISON, resent until it gets 400 request_quarantined, after at
                      most two group failures, while the other requests are served

Besides the outcome, two times: *detected after*, from the start of the load
to the fault's ruling (its log line), and *serving again*, from the ruling
to the first successful completion of a request sent after it (a short probe
goes out every ``clients.PROBE_EVERY_S``; during the restart it waits in the port's
backlog and the new attempt answers it).

Prints a table (rich) or ``--json``; exit 0 only when every kind passed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from tp_supervise.engine.inject import ALL_KINDS as INJECT_KINDS  # the engine owns its fault kinds
from tp_supervise.engine.inject import POISON_MARKER

from ..rank.net import free_port
from .clients import Clients, request

FAULT_RANK = 1
FAULT_STEP = 20
DRILL_LIMIT_S = 120.0
SLOW_OBSERVE_S = 60.0  # the straggler detector's warm-up and baseline (20 s), then its window (20 s)
READY_TIMEOUT_S = 90.0
HEALTH_POLL_S = 0.2
READY_POLL_TIMEOUT_S = 5.0  # one readiness poll (the relay's /readyz asks the engine's /health, up to 2 s)
PROBE_TOKENS = 2
RETRY_PAUSE_S = 1.0  # a client whose request failed (503, connection error) sends it again after this
SERVED_AFTER_S = 30.0  # poison: how long the other requests get to show they are served after the 400
# Log events of the supervisor that rule a fault (docs/logs.md).
RULINGS = ("rank_exited", "hang", "divergence", "startup_timeout")

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
    "poison": (0, "rank_exit"),
}


@dataclass
class DrillResult:
    kind: str
    passed: bool
    exit_code: int | None
    expected_exit: int
    bundle_reason: str | None
    culprit_ranks: list[int] | None
    detect_s: float | None  # the load's start → the fault's ruling
    verdict: str
    note: str = ""
    serving_again_s: float | None = None  # the ruling → the first request sent after it completed
    client_errors: int | None = None  # a COMMAND's drill: answers other than 200 the clients got (through the relay)


def wait_answering(port: int, path: str, proc: subprocess.Popen, deadline: float) -> bool:
    """Until ``GET path`` answers 200 (the engine's /health, the relay's /readyz), ``proc`` exits, or the monotonic
    deadline."""
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=READY_POLL_TIMEOUT_S) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(HEALTH_POLL_S)
    return False


def json_lines(text: str) -> list[dict]:
    """Every line of ``text`` that is a JSON object, in order (a supervisor's ``--log-format json`` lines; a
    rank's or an engine's own lines are not)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def log_records(log_path: Path) -> list[dict]:
    """``json_lines`` of a supervisor's log file; none while it cannot be read."""
    try:
        return json_lines(log_path.read_text(errors="replace"))
    except OSError:
        return []


def wall_time(stamp: object) -> float | None:
    """A log line's ``timestamp`` or a summary's ``detected_at`` (ISO 8601, UTC) as wall-clock seconds, or None."""
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def rulings(log_path: Path, after: float = float("-inf")) -> list[tuple[float, dict]]:
    """The supervisor's fault rulings (its log events of ``RULINGS``) at or after ``after`` (wall clock, 0.5 s of
    slack for the two clocks' rounding), with their time."""
    out = []
    for record in log_records(log_path):
        if record.get("event") in RULINGS and str(record.get("logger", "")).startswith("tp_supervise.supervisor"):
            at = wall_time(record.get("timestamp", ""))
            if at is not None and at >= after - 0.5:
                out.append((at, record))
    return out


def first_ruling(log_path: Path) -> float | None:
    """Wall-clock time of the supervisor's first fault ruling in its JSON log, or None."""
    found = rulings(log_path)
    return found[0][0] if found else None


SOFT_BUNDLES = ("hang_suspected", "straggler")  # bundles that stop nothing


def bundles(dump_dir: Path, kinds: str = "fatal", after: float = float("-inf")) -> list[tuple[Path, dict]]:
    """(folder, summary) of the bundles in ``dump_dir``, oldest first: ``fatal`` ones, or ``straggler`` ones;
    detected at or after ``after`` (wall clock).  A summary that cannot be read is skipped."""
    if not dump_dir.is_dir():
        return []
    out = []
    for path in sorted(p for p in dump_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        soft = any(word in path.name for word in SOFT_BUNDLES)
        if (kinds == "fatal" and soft) or (kinds == "straggler" and "straggler" not in path.name):
            continue
        try:
            summary = json.loads((path / "summary.json").read_text())
        except (OSError, ValueError):
            continue
        detected = wall_time(summary.get("detected_at", ""))
        if detected is None or detected >= after - 0.5:
            out.append((path, summary))
    return out


def fatal_bundles(dump_dir: Path) -> list[dict]:
    return [summary for _path, summary in bundles(dump_dir)]


def _straggler_bundles(dump_dir: Path) -> list[dict]:
    return [summary for _path, summary in bundles(dump_dir, "straggler")]


def _argv(port: int, tp: int, dump_dir: Path, plane: str, *extra: str) -> list[str]:
    return [
        *serve_argv(dump_dir),
        "--tp",
        str(tp),
        "--port",
        str(port),
        "--soft-timeout",
        "3",
        "--hard-timeout",
        "6",
        "--kill-grace",
        "3",
        "--control-plane",
        plane,
        "--consensus",
        "enforce",
        *extra,
    ]


def end_run(proc: subprocess.Popen, traffic: Clients) -> None:
    """The clients stop; the run too if it is still up (SIGKILL: the drill is done with it)."""
    traffic.stop()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def serve_argv(dump_dir: Path) -> list[str]:
    """``supervise serve`` as every drill run starts it: a JSON log the drill reads, bundles in ``dump_dir``,
    metrics on a free port and no linger after the run."""
    return [
        sys.executable,
        "-m",
        "tp_supervise.supervisor.cli",
        "serve",
        "--metrics-addr",
        "127.0.0.1:0",
        "--metrics-linger",
        "0",
        "--dump-dir",
        str(dump_dir),
        "--log-format",
        "json",
    ]


def _since(start: float, at: float | None) -> float | None:
    return None if at is None else round(at - start, 2)


def _not_ready(kind: str, proc: subprocess.Popen, port: int, expected_exit: int) -> DrillResult | None:
    """None once the engine answers /health; else the run is killed and the kind failed."""
    if wait_answering(port, "/health", proc, time.monotonic() + READY_TIMEOUT_S):
        return None
    proc.kill()
    proc.wait()
    return DrillResult(kind, False, proc.returncode, expected_exit, None, None, None, "", "engine never became ready")


def run_one(kind: str, tp: int, dump_root: Path) -> DrillResult:
    if kind == "poison":
        return run_poison(tp, dump_root)
    expected_exit, expected_reason = EXPECT[kind]
    dump_dir = dump_root / kind
    port = free_port()
    plane = "replicated" if kind.startswith("diverge") else "broadcast"
    argv = _argv(port, tp, dump_dir, plane, "--max-restarts", "1", "--inject", f"{kind}@{FAULT_RANK}:{FAULT_STEP}")
    log_path = dump_root / f"{kind}.log"
    traffic = Clients(port)
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            not_ready = _not_ready(kind, proc, port, expected_exit)
            if not_ready is not None:
                return not_ready
            started = time.time()
            traffic.start()
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
        finally:
            end_run(proc, traffic)
    fatal = fatal_bundles(dump_dir)
    summary = fatal[-1] if fatal else {}
    reason = summary.get("reason")
    culprits = summary.get("culprit_ranks")
    passed = code == expected_exit and reason == expected_reason
    if kind == "slow":  # not a hang and nothing killed, but the slow rank is named (a straggler bundle)
        named = _straggler_bundles(dump_dir)
        passed = passed and bool(named) and named[0].get("culprit_ranks") == [FAULT_RANK]
        if named:
            return DrillResult(
                kind,
                passed,
                code,
                expected_exit,
                "straggler",
                named[0].get("culprit_ranks"),
                _since(started, None),
                named[0].get("verdict", ""),
                f"log: {log_path}",
                None,
            )
    ruled_at = first_ruling(log_path) if expected_reason else None
    served_at = traffic.served_after(ruled_at) if ruled_at is not None else None
    if expected_reason is not None:
        passed = passed and culprits == [FAULT_RANK] and served_at is not None
    note = f"log: {log_path}" + (
        ""
        if served_at is not None or expected_reason is None
        else "; no request was served after the fault (did the group restart?)"
    )
    return DrillResult(
        kind,
        passed,
        code,
        expected_exit,
        reason,
        culprits,
        _since(started, ruled_at),
        summary.get("verdict", ""),
        note,
        _since(ruled_at, served_at) if ruled_at else None,
    )


def run_poison(tp: int, dump_root: Path) -> DrillResult:
    """A request carrying POISON_MARKER, sent again after every failure as a retrying client would: quarantined (400)
    after at most two group failures, the other requests served after it; then SIGTERM (exit 0)."""
    expected_exit, expected_reason = EXPECT["poison"]
    dump_dir = dump_root / "poison"
    port = free_port()
    argv = _argv(port, tp, dump_dir, "broadcast", "--max-restarts", "3", "--inject", f"poison@{FAULT_RANK}")
    log_path = dump_root / "poison.log"
    traffic = Clients(port)
    answer: tuple[int | None, bytes] = (None, b"")
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            not_ready = _not_ready("poison", proc, port, expected_exit)
            if not_ready is not None:
                return not_ready
            started = time.time()
            traffic.start()
            deadline = time.monotonic() + DRILL_LIMIT_S
            body = {"prompt": f"drill {POISON_MARKER}", "max_tokens": PROBE_TOKENS, "temperature": 0}
            while time.monotonic() < deadline and proc.poll() is None:
                answer = request(port, "/v1/completions", body)
                if answer[0] is not None and answer[0] < 500:
                    break
                time.sleep(RETRY_PAUSE_S)
            answered = time.time()
            served = traffic.wait_served_after(answered, SERVED_AFTER_S) if answer[0] == 400 else None
            alive = proc.poll() is None
            if alive:
                proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
        finally:
            end_run(proc, traffic)
    fatal = fatal_bundles(dump_dir)
    failures = len([s for s in fatal if s.get("reason") == expected_reason])
    quarantined = answer[0] == 400 and b"request_quarantined" in answer[1]
    passed = quarantined and alive and served is not None and code == expected_exit and 1 <= failures <= 2
    if quarantined:
        verdict = f"400 request_quarantined after {failures} group failure(s); the others " + (
            "served after it" if served is not None else "NOT served after it"
        )
    else:
        verdict = f"no quarantine: the last answer was {answer[0]} {answer[1][:200].decode(errors='replace')}"
    ruled_at = first_ruling(log_path)
    served_at = traffic.served_after(ruled_at) if ruled_at is not None else None
    return DrillResult(
        "poison",
        passed,
        code,
        expected_exit,
        expected_reason if failures else None,
        fatal[-1].get("culprit_ranks") if fatal else None,
        _since(started, ruled_at),
        verdict,
        f"log: {log_path}" + ("" if alive else "; the run did not stay up"),
        _since(ruled_at, served_at) if ruled_at else None,
    )


def main(args) -> int:
    if args.serve_flags:
        print("supervise drill: --serve-flags is for a COMMAND's drill (-- COMMAND ...)", file=sys.stderr)
        return 64
    kinds = (
        list(INJECT_KINDS) if args.kinds in (None, "all") else [k.strip() for k in args.kinds.split(",") if k.strip()]
    )
    unknown = [k for k in kinds if k not in EXPECT]
    if unknown:
        print(
            f"supervise drill: unknown kind(s) {', '.join(unknown)}; choose from {', '.join(EXPECT)}", file=sys.stderr
        )
        return 64
    dump_root = Path(args.dump_dir)
    dump_root.mkdir(parents=True, exist_ok=True)
    results = [run_one(kind, args.tp, dump_root) for kind in kinds]
    title = f"supervise drill (TP={args.tp}, fault on rank {FAULT_RANK} at step {FAULT_STEP}, one restart)"
    return report(results, title, args.json)


def report(results: list[DrillResult], title: str, as_json: bool) -> int:
    """Print the results (a rich table, or JSON records); the drill's exit code: 0 when every kind passed."""
    if as_json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        columns = ["kind", "result", "exit", "bundle", "culprit", "detected after", "serving again"]
        with_errors = any(r.client_errors is not None for r in results)
        if with_errors:
            columns.append("client errors")
        for col in (*columns, "verdict"):
            table.add_column(col)
        for r in results:
            row = [
                r.kind,
                "[green]pass[/]" if r.passed else "[red]FAIL[/]",
                f"{r.exit_code} (want {r.expected_exit})",
                r.bundle_reason or "-",
                str(r.culprit_ranks) if r.culprit_ranks is not None else "-",
                f"{r.detect_s:.1f} s" if r.detect_s is not None else "-",
                f"{r.serving_again_s:.1f} s" if r.serving_again_s is not None else "-",
            ]
            if with_errors:
                row.append(str(r.client_errors) if r.client_errors is not None else "-")
            table.add_row(*row, r.verdict or r.note)
        Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0 if all(r.passed for r in results) else 1


__all__ = ["main", "run_one", "report", "EXPECT"]
