"""``supervise drill -- COMMAND``: the fault matrix against the user's own engine, behind the relay.

A COMMAND cannot be asked to inject a fault, so each fault comes from outside, as it does in production: a
signal to TP rank 1 (found through the supervisor's status, as ``supervise status`` shows it)::

    kind       signal    the supervisor must rule
    kill       SIGKILL   rank_exit [1]  (an OOM kill, a crash without a trace)
    segfault   SIGSEGV   rank_exit [1]  (a native crash; faulthandler prints the stacks first)
    abort      SIGABRT   rank_exit [1]  (a C++ abort)
    stop       SIGSTOP   hang [1]       (a rank that stopped running while its peers wait in a collective)

Each kind is one ``supervise serve --relay 127.0.0.1:PUB --max-restarts 1 [--serve-flags] -- COMMAND`` under the
drill's load (long completions and a short probe, every request through the relay, as a client sends it).  The
fault fires once, so the group restarts once and serves again; the drill then stops the run with SIGTERM.  A kind
passes when the bundle names rank 1 with the reason above, a request was served after the fault, no client got an
answer other than 200 (the relay held what was in flight across the restart), and the run exits 0.

Two times per kind, both from the signal: *detected after* (→ the ruling's log line) and *serving again* (→ the
first probe answered 200 after the ruling: what a client that sends at the fault waits, through the relay).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .drill import DrillResult, Traffic, end_run, fatal_bundles, first_ruling, report, wait_answering
from .drill import serve_argv as drill_serve_argv
from .observers import control_socket as control
from .observers.status_view import fetch
from .rank.net import free_port

FAULT_RANK = 1
COMMAND_KINDS = {
    "kill": (signal.SIGKILL, "rank_exit"),
    "segfault": (signal.SIGSEGV, "rank_exit"),
    "abort": (signal.SIGABRT, "rank_exit"),
    "stop": (signal.SIGSTOP, "hang"),
}
DEFAULT_KINDS = ("kill", "stop")
# The drill chooses these itself: the relay's address, where bundles and the log go, their format, no injection.
OWNED_FLAGS = ("--relay", "--dump-dir", "--log-format", "--inject", "--listen")
POLL_S = 0.5
STATUS_TIMEOUT_S = 3.0
STOP_TIMEOUT_S = 120.0  # SIGTERM → exit: the engine's own shutdown, then the supervisor's teardown
CLIENT_SLACK_S = 60.0  # a client's timeout: the engine's start (--ready-timeout) and this


class UsageError(Exception):
    """The drill's flags cannot make a run (exit 64, before anything starts)."""


def parse_kinds(text: str | None) -> list[str]:
    if text is None:
        return list(DEFAULT_KINDS)
    kinds = list(COMMAND_KINDS) if text == "all" else [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in COMMAND_KINDS]
    if unknown or not kinds:
        raise UsageError(
            f"unknown kind(s) {', '.join(unknown) or '(none)'} for a COMMAND; choose from {', '.join(COMMAND_KINDS)} "
            "(the built-in engine's inject kinds need the built-in engine: drop the COMMAND)"
        )
    return kinds


def parse_serve_flags(text: str) -> list[str]:
    try:
        flags = shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"--serve-flags: {exc}") from None
    owned = [f for f in flags if f.split("=", 1)[0] in OWNED_FLAGS]
    if owned:
        raise UsageError(f"--serve-flags: {', '.join(owned)} is the drill's own choice; leave it out")
    if "--" in flags:
        raise UsageError("--serve-flags: the COMMAND goes after the drill's own '--', not into --serve-flags")
    return flags


def serve_argv(public: int, dump_dir: Path, serve_flags: list[str], command: list[str]) -> list[str]:
    return [*drill_serve_argv(dump_dir), "--relay", f"127.0.0.1:{public}", "--max-restarts", "1", *serve_flags,
            "--", *command]  # fmt: skip


def _get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError, ValueError):
        return None, b""


def served_model(public: int) -> str | None:
    """The first model the engine lists (OpenAI servers want ``model`` in every request), or None."""
    status, body = _get(public, "/v1/models")
    try:
        data = json.loads(body)["data"] if status == 200 else []
        return str(data[0]["id"]) if data else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def rank_pid(proc: subprocess.Popen, rank: int, deadline: float) -> int | None:
    """The pid of ``rank`` in the run ``proc`` supervises, from its status (the registry and control socket)."""
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            job = next((j for j in control.list_jobs() if j.pid == proc.pid), None)
            status = fetch(job, STATUS_TIMEOUT_S) if job is not None else {}
        except (OSError, ValueError, RuntimeError, control.RegistryError):
            status = {}
        for r in status.get("ranks") or []:
            if r.get("rank") == rank and r.get("alive") and r.get("pid"):
                return int(r["pid"])
        time.sleep(POLL_S)
    return None


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def run_kind(
    kind: str, command: list[str], serve_flags: list[str], dump_root: Path, ready_s: float, load_s: float
) -> DrillResult:
    signum, expected_reason = COMMAND_KINDS[kind]
    dump_dir = dump_root / kind
    public = free_port()
    log_path = dump_root / f"{kind}.log"
    failed = DrillResult(kind, False, None, 0, None, None, None, "", f"log: {log_path}")
    # the clients wait as an SDK's do (the OpenAI SDK's default timeout is 600 s): a request held across the
    # restart is answered when the engine serves again
    traffic = Traffic(public, timeout_s=ready_s + CLIENT_SLACK_S)
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            serve_argv(public, dump_dir, serve_flags, command), stdout=log_file, stderr=subprocess.STDOUT
        )
        try:
            if not wait_answering(public, "/readyz", proc, time.monotonic() + ready_s):
                ended = proc.poll() is not None
                failed.exit_code = _stop(proc)
                failed.verdict = (
                    f"supervise serve exited {failed.exit_code} before serving (its log says why)"
                    if ended
                    else f"the engine did not serve through the relay within {ready_s:g} s"
                )
                return failed
            traffic.model = served_model(public)
            traffic.start()
            time.sleep(load_s)  # requests in flight at the fault, and the watchdog's thresholds learned from steps
            pid = rank_pid(proc, FAULT_RANK, time.monotonic() + 30.0)
            if pid is None:
                failed.exit_code = _stop(proc)
                failed.verdict = f"the supervisor's status names no live rank {FAULT_RANK}"
                return failed
            fault_at = time.time()
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
            ruled_at = None
            deadline = time.monotonic() + ready_s
            while ruled_at is None and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(POLL_S)
                ruled_at = first_ruling(log_path)
            served_at = traffic.wait_served_after(ruled_at, ready_s) if ruled_at is not None else None
            alive = proc.poll() is None
            traffic.stop()  # the answers to the drill's own SIGTERM are not the fault's
            code = _stop(proc)
        finally:
            end_run(proc, traffic)
    fatal = fatal_bundles(dump_dir)
    summary = fatal[0] if fatal else {}
    reason, culprits = summary.get("reason"), summary.get("culprit_ranks")
    errors = traffic.errors
    passed = (
        alive and code == 0 and reason == expected_reason and culprits == [FAULT_RANK] and served_at is not None
    ) and not errors
    if not alive:
        verdict = "the run ended by itself after the fault (did the group restart?)"
    elif served_at is None:
        verdict = "no request was served after the fault"
    elif errors:
        verdict = f"{len(errors)} client(s) got an error, the first: {errors[0]}"
    else:
        verdict = summary.get("verdict", "")
    return DrillResult(
        kind,
        passed,
        code,
        0,
        reason,
        culprits,
        None if ruled_at is None else round(ruled_at - fault_at, 2),
        verdict,
        f"log: {log_path}",
        None if served_at is None else round(served_at - fault_at, 2),
        len(errors),
    )


def main(args, command: list[str]) -> int:
    try:
        kinds = parse_kinds(args.kinds)
        serve_flags = parse_serve_flags(args.serve_flags or "")
    except UsageError as exc:
        print(f"supervise drill: {exc}", file=sys.stderr)
        return 64
    dump_root = Path(args.dump_dir)
    dump_root.mkdir(parents=True, exist_ok=True)
    results = [run_kind(kind, command, serve_flags, dump_root, args.ready_timeout, args.load_before) for kind in kinds]
    title = f"supervise drill -- {shlex.join(command)[:80]} (signal to rank {FAULT_RANK}, one restart, via the relay)"
    return report(results, title, args.json)


__all__ = ["COMMAND_KINDS", "main", "parse_kinds", "parse_serve_flags", "run_kind"]
