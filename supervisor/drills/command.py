"""``supervise drill -- COMMAND``: a fault campaign against the user's own engine, behind the relay.

Each kind (``kinds``: signals to every role, faults armed inside a
process through the injection lane, cgroup limits, a broken environment) is
one trial: ``supervise serve --relay 127.0.0.1:PUB --max-restarts 1
[--serve-flags] -- COMMAND`` started with a fresh lane token, the drill's
clients (completions and chat, streamed and not, every request through the
relay), ``--load-before`` seconds of load, then the fault in the process of
the kind's role (found through the supervisor's status).  The trial records
what the supervisor ruled (the first fatal bundle after the fault, or a
straggler's), whom it named, fault → ruling, ruling → the first request
served again, what the clients saw, and what the run left behind (processes
carrying the trial's token, /dev/shm entries made during it); ``kinds.
score`` compares that with what the kind expects.  A kind the drill cannot
do here (not root, two nodes) is reported as not run, with why.

Outputs: a live progress line (stderr), a rich table, ``--json`` (one record
per kind and trial), ``--markdown`` (a runbook's table).  ``--soak MINUTES``
runs the same clients with no fault and counts every verdict as a false
alarm.  docs/drills.md is the operator's page.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..observers import control_socket as control
from ..observers.status_view import fetch
from ..rank.drill_lane import ENV_DRILL
from ..rank.engines.launcher_flags import compiles_model
from ..rank.net import free_port
from . import host
from .builtin import bundles, log_records, rulings, wait_answering, wall_time
from .builtin import serve_argv as drill_serve_argv
from .clients import Clients, served_model
from .kinds import BY_NAME, KINDS, RUNS_ON, Kind, KindError, Observed, score, select

# The drill chooses these itself: the relay's address, where bundles and the log go, their format, no injection.
OWNED_FLAGS = ("--relay", "--dump-dir", "--log-format", "--inject", "--listen")
# The drill's former kind names (signals to TP rank 1), still accepted.
ALIASES = {"kill": "kill_rank", "segfault": "segv_rank", "abort": "abort_rank", "stop": "stop_rank"}
DEFAULT_KINDS = "kill_rank,stop_rank"
POLL_S = 0.5
SUPERVISOR_SHM = "tp-supervise-"  # a supervisor's own /dev/shm entries carry its run id
STATUS_TIMEOUT_S = 3.0
ARM_TIMEOUT_S = 10.0
FIND_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 120.0  # SIGTERM → exit: the engine's own shutdown, then the supervisor's teardown
CLIENT_SLACK_S = 60.0  # a client's timeout: the engine's start (--ready-timeout) and this
VERDICT_LIMIT_S = 120.0  # fault → ruling, at most (a hang's thresholds are learned from the load's steps)
STRAGGLER_WAIT_S = 40.0  # before a quota: the straggler detector's warm-up and baseline (20 s) and margin
STRAGGLER_LIMIT_S = 90.0  # quota → a straggler bundle, at most
RUNS_ON_S = 30.0  # a kind that must change nothing: how long the run is watched
LEFTOVER_WAIT_S = 5.0


class UsageError(Exception):
    """The drill's flags cannot make a run (exit 64, before anything starts)."""


def parse_kinds(kinds: str | None, roles: str | None = None) -> list[Kind]:
    text = DEFAULT_KINDS if kinds is None and roles is None else kinds
    if text:
        text = ",".join(ALIASES.get(w.strip(), w.strip()) for w in text.split(","))
    try:
        return select(text, roles)
    except KindError as exc:
        raise UsageError(
            f"{exc} (the built-in engine's inject kinds need the built-in engine: drop the COMMAND)"
        ) from None


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


# -- one trial -----------------------------------------------------------------------------------------------
def _status(proc: subprocess.Popen) -> dict:
    try:
        job = next((j for j in control.list_jobs() if j.pid == proc.pid), None)
        return fetch(job, STATUS_TIMEOUT_S) if job is not None else {}
    except (OSError, ValueError, RuntimeError, control.RegistryError):
        return {}


def target_pid(proc: subprocess.Popen, role: str, rank: int, deadline: float) -> int | None:
    """The pid of the live process of ``role`` (rank ``rank`` for a rank) in the run ``proc`` supervises."""
    while time.monotonic() < deadline and proc.poll() is None:
        status = _status(proc)
        if role == "rank":
            for r in status.get("ranks") or []:
                if r.get("rank") == rank and r.get("alive") and r.get("pid"):
                    return int(r["pid"])
        for p in status.get("processes") or []:
            if p.get("role") == role and p.get("alive") and p.get("pid"):
                return int(p["pid"])
        time.sleep(POLL_S)
    return None


def arm(folder: Path, token: str, pid: int, kind: str, seam: str) -> str:
    """Write the lane's order for ``pid`` (atomically) and wait for its answer (this trial's token): '' when armed,
    else why not.  An order nobody took is removed: a later process given the same pid never finds it."""
    order = folder / f"{pid}.json"
    answer = folder / f"{pid}.armed"
    answer.unlink(missing_ok=True)
    tmp = folder / f".{pid}.json.tmp"
    tmp.write_text(json.dumps({"token": token, "kind": kind, "seam": seam}))
    os.replace(tmp, order)
    deadline = time.monotonic() + ARM_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            try:
                said = json.loads(answer.read_text())
            except (OSError, ValueError):
                time.sleep(0.05)
                continue
            if said.get("token") == token:
                return str(said.get("problem", ""))
        if not Path(f"/proc/{pid}").exists():
            return ""  # gone at once: a fault that ends the process (exit0 at the next step) may beat the answer
        return f"pid {pid} did not answer the drill's lane within {ARM_TIMEOUT_S:g} s (is the hook in that process?)"
    finally:
        order.unlink(missing_ok=True)


def _culprit(summary: dict) -> tuple[str | None, int | None]:
    c = summary.get("culprit")
    if isinstance(c, dict) and c.get("role"):
        role = "frontend" if c["role"] == "launcher" and c.get("serves_api") else c["role"]
        return role, c.get("rank") if c.get("rank") is not None and c.get("rank", -1) >= 0 else None
    ranks = summary.get("culprit_ranks") or []
    return ("rank", int(ranks[0])) if len(ranks) == 1 else (None, None)


def _stacks_missing(bundle: Path) -> list[str]:
    """Live processes of the bundle (ranks and the others) whose Python stack it does not hold."""
    try:
        summary = json.loads((bundle / "summary.json").read_text())
    except (OSError, ValueError):
        return ["no summary.json"]
    out = []
    for group, label in (("ranks", "rank {}"), ("processes", "pid {}")):
        entries = summary.get(group)
        for key, p in entries.items() if isinstance(entries, dict) else ():
            if isinstance(p, dict) and p.get("alive") and not p.get("stack_method"):
                out.append(label.format(key) + (f" ({p['role']})" if p.get("role") else ""))
    return out


def _carrying(needle: bytes, found: list[int]) -> None:
    """Pids whose environment holds ``needle`` (each read takes the process's mmap lock: run on a thread)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read():
                    found.append(int(entry))
        except OSError:
            continue


def leftovers(token: str, shm_before: set[str], run_ids: tuple[str, ...] | set[str] = ()) -> list[str]:
    """Processes still carrying the trial's lane token (then SIGKILLed: the next trial needs the machine), and
    /dev/shm entries made during the trial (another supervisor's own, ``tp-supervise-<its run id>``, excepted:
    ``run_ids`` are the trial's).  The scan of /proc has a deadline (a process stuck in the kernel holds
    its mmap lock): what it did not reach by then is not reported."""
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    needle = f"{ENV_DRILL}={token}".encode()
    while True:
        found: list[int] = []
        scan = threading.Thread(target=_carrying, args=(needle, found), name="drill-leftovers", daemon=True)
        scan.start()
        scan.join(max(0.5, deadline - time.monotonic()))
        out = []
        for pid in list(found):
            try:
                out.append(f"pid {pid} ({Path(f'/proc/{pid}/comm').read_text().strip()})")
            except OSError:
                continue
        try:
            made = sorted(set(os.listdir(host.SHM)) - shm_before)
        except OSError:
            made = []
        out += [
            f"/dev/shm/{n}" for n in made if not n.startswith(SUPERVISOR_SHM) or any(run_id in n for run_id in run_ids)
        ]
        if not out or time.monotonic() >= deadline:
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            return out
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


@dataclass
class Trial:
    kind: str
    family: str
    role: str
    trial: int
    expected: str
    got: str
    localised: bool
    passed: bool
    why: str
    observed: dict
    run: bool = True  # False: the drill could not run this kind here (and says why)
    exit_code: int | None = None
    log: str = ""


@dataclass
class Setup:
    command: list[str]
    serve_flags: list[str]
    dump_root: Path
    ready_s: float
    load_s: float
    progress: Progress


def run_trial(kind: Kind, trial: int, setup: Setup) -> Trial:
    """One kind, once: start, load, fault, watch, stop, undo what the fault changed, score."""
    name = f"{kind.name}-{trial}"
    dump_dir = setup.dump_root / name
    log_path = setup.dump_root / f"{name}.log"
    token = secrets.token_hex(16)
    lane_dir = Path(tempfile.mkdtemp(prefix=f".lane-{name}-", dir=setup.dump_root))  # 0700, fresh every trial
    seen = Observed()
    undo: list = []
    public = free_port()
    shm_before = set(os.listdir(host.SHM))
    env = dict(os.environ, **{ENV_DRILL: f"{token}:{lane_dir}"})
    box: dict = {}  # the trial's clients, once started
    code = None
    try:
        with open(log_path, "w") as log_file:
            setup.progress.phase("starting the engine")
            launched = time.monotonic()
            proc = subprocess.Popen(
                [*(host.without_ptrace() if kind.environment == "ptrace_denied" else []),
                 *serve_argv(public, dump_dir, setup.serve_flags, setup.command)],
                stdout=log_file, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
            try:
                code = _drive(kind, setup, proc, public, launched, seen, undo, box, lane_dir, token, dump_dir, log_path)
            finally:
                if "clients" in box:
                    box["clients"].stop()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    except (OSError, subprocess.SubprocessError, host.DrillEnvError) as exc:
        seen.problem = seen.problem or f"the drill failed: {exc!r}"
    finally:
        for change in reversed(undo):
            try:
                change.undo()
            except (OSError, subprocess.SubprocessError, host.DrillEnvError) as exc:
                seen.leftovers.append(f"not undone: {exc}")
        shutil.rmtree(lane_dir, ignore_errors=True)
    clients = box.get("clients")
    if clients is not None:
        seen.client_errors = len(clients.errors)
        seen.streams_cut = clients.streams_cut
        if clients.errors:
            seen.verdict = seen.verdict or f"first client error: {clients.errors[0]}"
    return _finish(kind, trial, seen, code, log_path, token, shm_before)


def _drive(kind, setup, proc, public, launched, seen, undo, box, lane_dir, token, dump_dir, log_path) -> int:
    """The trial once ``supervise serve`` runs; its exit code (after the drill's SIGTERM, or its own)."""
    show = setup.progress.phase
    if not wait_answering(public, "/readyz", proc, time.monotonic() + setup.ready_s):
        ended = proc.poll() is not None
        code = _stop(proc)
        seen.problem = (
            f"supervise serve exited {code} before serving (its log says why)"
            if ended
            else f"the engine did not serve through the relay within {setup.ready_s:g} s"
        )
        return code
    seen.engine_start_s = round(time.monotonic() - launched, 2)
    clients = box["clients"] = Clients(public, served_model(public), setup.ready_s + CLIENT_SLACK_S).start()
    show("load before the fault")
    time.sleep(setup.load_s)
    if kind.cpu_share is not None:
        time.sleep(max(0.0, STRAGGLER_WAIT_S - setup.load_s))
    pid = target_pid(proc, kind.role, 1, time.monotonic() + FIND_TIMEOUT_S)
    if pid is None:
        seen.problem = f"the supervisor's status names no live {kind.role} process"
        return _stop(proc)
    show(f"fault: {kind.does[:60]}")
    seen.problem, fault_at = _inject(kind, pid, token, lane_dir, dump_dir, undo, seen)
    if seen.problem:
        return _stop(proc)
    if kind.expect.outcome == RUNS_ON:
        _watch_runs_on(kind, proc, dump_dir, log_path, fault_at, seen, show)
    else:
        show("waiting for the verdict")
        ruled = None
        deadline = time.monotonic() + VERDICT_LIMIT_S
        while ruled is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(POLL_S)
            ruled = next(iter(rulings(log_path, fault_at)), None)
        if ruled is None:
            ruled = next(iter(rulings(log_path, fault_at)), None)
        if ruled is not None:
            seen.verdict_s = round(ruled[0] - fault_at, 2)
            show("waiting for serving again")
            served = clients.wait_served_after(ruled[0], setup.ready_s)
            if served is not None and proc.poll() is None:
                seen.restarted = True
                seen.serving_again_s = round(served - ruled[0], 2)
            _read_bundle(dump_dir, seen, log_path=log_path, after=fault_at)
    show("stopping")
    clients.stop()
    return _stop(proc)


def _inject(
    kind: Kind, pid: int, token: str, lane_dir: Path, dump_dir: Path, undo: list, seen: Observed
) -> tuple[str, float]:
    """The fault itself: ('' when done, else why it could not be; when it was made, wall clock).  Every change it
    makes around the run goes on ``undo`` the moment it exists; what it set is said in ``seen.setup``."""
    group_name = f"tps-drill-{token[:12]}"
    at = time.time()
    try:
        if kind.environment == "shm_full":
            undo.append(host.FullFilesystem(host.SHM, remount=True))
            seen.setup = f"{host.SHM} remounted to what it holds + 4 MiB, filled"
            return "", at
        if kind.environment == "dump_disk_full":
            dump_dir.mkdir(parents=True, exist_ok=True)
            undo.append(host.FullFilesystem(dump_dir, remount=False))
            seen.setup = f"{dump_dir}: a 1 MiB tmpfs, filled"
        if kind.environment == "ptrace_denied":
            problem = arm(lane_dir, token, pid, "not_dumpable", "now")
            if problem:
                return problem, at
            seen.setup = "supervise serve without CAP_SYS_PTRACE; the process made not dumpable"
        if kind.cpu_share is not None:
            used = host.cpu_used(pid)
            group = host.Cgroup("cpu", pid, group_name)
            undo.append(group)
            seen.setup = group.cpu_quota(kind.cpu_share, used)
            return "", time.time()
        if kind.memory:
            group = host.Cgroup("memory", pid, group_name)
            undo.append(group)
            seen.setup = group.memory_headroom()
        at = time.time()
        if kind.lane is not None:
            return arm(lane_dir, token, pid, *kind.lane), at
        if kind.signum is not None:
            try:
                os.kill(pid, kind.signum)
            except ProcessLookupError:
                return f"pid {pid} ended before the signal", at
        return "", at
    except (host.DrillEnvError, OSError, subprocess.SubprocessError) as exc:
        return f"the drill could not set up {kind.name}: {exc}", at


def _watch_runs_on(kind: Kind, proc, dump_dir: Path, log_path: Path, fault_at: float, seen: Observed, show) -> None:
    if kind.expect.reason == "straggler":
        show("waiting for the straggler to be named")
        deadline = time.monotonic() + STRAGGLER_LIMIT_S
        named: list = []
        while not named and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(POLL_S)
            named = bundles(dump_dir, "straggler", after=fault_at)
        if named:
            path, summary = named[0]
            seen.reason = "straggler"
            seen.culprit_role, seen.culprit_rank = _culprit(summary)
            seen.verdict = str(summary.get("verdict", ""))
            detected = wall_time(summary.get("detected_at", ""))
            seen.verdict_s = round((detected if detected is not None else time.time()) - fault_at, 2)
    else:
        show(f"watching for {RUNS_ON_S:g} s: nothing may be ruled")
        end = time.monotonic() + RUNS_ON_S
        while time.monotonic() < end and proc.poll() is None:
            time.sleep(POLL_S)
    if rulings(log_path, fault_at):  # a fatal verdict where none was due
        _read_bundle(dump_dir, seen, log_path=log_path, after=fault_at)
    seen.restarted = proc.poll() is None  # here: the run stayed up


def _read_bundle(dump_dir: Path, seen: Observed, log_path: Path, after: float) -> None:
    """The first fatal bundle since the fault: its reason, culprit, verdict and which live process's stack it lacks;
    without one (a full disk), the ruling's log line (its event and the process it announced)."""
    found = bundles(dump_dir, after=after)
    if found:
        path, summary = found[0]
        seen.reason = summary.get("reason")
        seen.culprit_role, seen.culprit_rank = _culprit(summary)
        seen.verdict = str(summary.get("verdict", ""))
        seen.stacks_missing = _stacks_missing(path)
        return
    ruled = rulings(log_path, after)
    if ruled:
        record = ruled[0][1]
        seen.reason = {"rank_exited": "rank_exit"}.get(str(record.get("event")), str(record.get("event")))
        role = record.get("role")
        rank = record.get("rank")
        seen.culprit_role = role if role else ("rank" if isinstance(rank, int) and rank >= 0 else None)
        seen.culprit_rank = rank if isinstance(rank, int) and rank >= 0 else None
        seen.verdict = str(record.get("message", "")) + " (no bundle: see the log)"


def _finish(kind: Kind, trial: int, seen: Observed, code, log_path: Path, token: str, shm_before: set[str]) -> Trial:
    run_ids = {str(r.get("run_id")) for r in log_records(log_path) if r.get("event") == "supervise_starting"}
    seen.leftovers += leftovers(token, shm_before, run_ids)
    localised, passed, why = score(kind, seen)
    got = (
        "not ruled"
        if seen.reason is None
        else f"{seen.reason}, "
        + (
            "nobody"
            if seen.culprit_role is None
            else (f"rank {seen.culprit_rank}" if seen.culprit_role == "rank" else seen.culprit_role)
        )
    )
    return Trial(
        kind.name, kind.family, kind.role, trial, kind.expect.line(), got, localised, passed, why, asdict(seen),
        exit_code=code, log=str(log_path),
    )  # fmt: skip


def not_run(kind: Kind, trial: int, why: str) -> Trial:
    return Trial(
        kind.name, kind.family, kind.role, trial, kind.expect.line(), "not run", False, False, why, {}, run=False
    )


# -- progress and reports ------------------------------------------------------------------------------------
class Progress:
    """One line on stderr: kind n of N, trial, phase (rich's live status on a terminal)."""

    def __init__(self, total: int, quiet: bool):
        self.total = total
        self.n = 0
        self.label = ""
        self.quiet = quiet
        self._status = None
        if sys.stderr.isatty() and not quiet:
            from rich.console import Console

            self._status = Console(stderr=True).status("")
            self._status.start()

    def kind(self, kind: str, trial: int, trials: int) -> None:
        self.n += 1
        self.label = f"[{self.n}/{self.total}] {kind}" + (f" (trial {trial} of {trials})" if trials > 1 else "")
        self.phase("")

    def phase(self, text: str) -> None:
        line = f"{self.label}: {text}" if text else self.label
        if self._status is not None:
            self._status.update(line)
        elif not self.quiet:
            print(f"supervise drill {line}", file=sys.stderr, flush=True)

    def done(self, t: Trial) -> None:
        mark = "pass" if t.passed else ("not run" if not t.run else "FAIL")
        line = f"{self.label}: {mark}: {t.got}" + (f" ({t.why})" if t.why else "")
        if self._status is not None:
            self._status.console.print(line)
        elif not self.quiet:
            print(f"supervise drill {line}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"


def rows(trials: list[Trial]) -> list[dict]:
    """Per kind: localised n of N, verdict and serving-again median and worst, client errors, leftovers."""
    out = []
    for name in dict.fromkeys(t.kind for t in trials):
        ts = [t for t in trials if t.kind == name]
        ran = [t for t in ts if t.run]
        verdicts = [float(v) for t in ran if (v := t.observed.get("verdict_s")) is not None]
        serving = [float(v) for t in ran if (v := t.observed.get("serving_again_s")) is not None]
        starts = [float(v) for t in ran if (v := t.observed.get("engine_start_s")) is not None]
        out.append({
            "kind": name,
            "expected": ts[0].expected,
            "got": "; ".join(dict.fromkeys(t.got for t in ts)),
            "localised": f"{sum(t.localised for t in ran)} of {len(ran)}" if ran else "not run",
            "passed": f"{sum(t.passed for t in ran)} of {len(ran)}" if ran else "not run",
            "verdict_median_s": statistics.median(verdicts) if verdicts else None,
            "verdict_worst_s": max(verdicts) if verdicts else None,
            "serving_again_median_s": statistics.median(serving) if serving else None,
            "engine_start_median_s": statistics.median(starts) if starts else None,
            "client_errors": sum(t.observed.get("client_errors", 0) + t.observed.get("streams_cut", 0) for t in ran),
            "leftovers": sum(len(t.observed.get("leftovers", [])) for t in ran),
            "why": "; ".join(dict.fromkeys(t.why for t in ts if t.why)),
        })  # fmt: skip
    return out


def markdown(trials: list[Trial], title: str) -> str:
    lines = [f"**{title}**", "",
             "| kind | expected | got | localised | passed | verdict (median / worst) | serving again | engine start | client errors | left | why not |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows(trials):
        lines.append(
            f"| {r['kind']} | {r['expected']} | {r['got']} | {r['localised']} | {r['passed']} | "
            f"{_fmt(r['verdict_median_s'])} / {_fmt(r['verdict_worst_s'])} | {_fmt(r['serving_again_median_s'])} | "
            f"{_fmt(r['engine_start_median_s'])} | {r['client_errors']} | {r['leftovers']} | "
            f"{r['why'].replace('|', '/') or '-'} |"
        )
    ran = [t for t in trials if t.run]
    lines += ["", f"Localised {sum(t.localised for t in ran)} of {len(ran)} trials; passed {sum(t.passed for t in ran)} "
              f"of {len(ran)}; not run: {len(trials) - len(ran)}."]  # fmt: skip
    return "\n".join(lines)


def report(trials: list[Trial], title: str, fmt: str) -> int:
    if fmt == "json":
        print(json.dumps([asdict(t) for t in trials], indent=2))
    elif fmt == "markdown":
        print(markdown(trials, title))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for col in (
            "kind",
            "expected",
            "got",
            "localised",
            "verdict",
            "serving again",
            "engine start",
            "client errors",
            "left",
            "result",
        ):
            table.add_column(col)
        for r in rows(trials):
            ok = r["passed"].split(" of ")
            result = "not run" if r["passed"] == "not run" else ("[green]pass[/]" if ok[0] == ok[1] else "[red]FAIL[/]")
            table.add_row(
                r["kind"], r["expected"], r["got"], r["localised"],
                f"{_fmt(r['verdict_median_s'])} / {_fmt(r['verdict_worst_s'])}", _fmt(r["serving_again_median_s"]),
                _fmt(r["engine_start_median_s"]), str(r["client_errors"]), str(r["leftovers"]), result + (f" ({r['why']})" if r["why"] else ""),
            )  # fmt: skip
        Console(width=None if sys.stdout.isatty() else 220).print(table)
    ran = [t for t in trials if t.run]
    return 0 if ran and all(t.passed for t in ran) else 1


def list_kinds() -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="supervise drill -- COMMAND: kinds (--kinds NAME,FAMILY,... --roles ROLE,...)")
    for col in ("kind", "family", "role", "what it does", "a perfect supervisor"):
        table.add_column(col)
    for k in KINDS:
        table.add_row(k.name, k.family, k.role, k.does + (" [two nodes]" if k.nodes > 1 else ""), k.expect.line())
    Console(width=None if sys.stdout.isatty() else 220).print(table)
    return 0


# -- the soak ------------------------------------------------------------------------------------------------
def soak(setup: Setup, minutes: float, fmt: str) -> int:
    """Realistic load and no fault for ``minutes``: every ruling and every straggler named is a false alarm."""
    log_path = setup.dump_root / "soak.log"
    dump_dir = setup.dump_root / "soak"
    public = free_port()
    env = {k: v for k, v in os.environ.items() if k != ENV_DRILL}  # no fault: the run as production has it
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            serve_argv(public, dump_dir, setup.serve_flags, setup.command),
            stdout=log_file, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        clients = None
        try:
            setup.progress.phase("starting the engine")
            if not wait_answering(public, "/readyz", proc, time.monotonic() + setup.ready_s):
                _stop(proc)
                print(
                    f"supervise drill: the engine did not serve within {setup.ready_s:g} s ({log_path})",
                    file=sys.stderr,
                )
                return 1
            clients = Clients(public, served_model(public), setup.ready_s + CLIENT_SLACK_S, soak=True).start()
            start = time.monotonic()
            end = start + minutes * 60
            while time.monotonic() < end and proc.poll() is None:
                left = (end - time.monotonic()) / 60
                setup.progress.phase(
                    f"soak: {left:.1f} min left, {clients.served} served, {len(clients.errors)} errors"
                )
                time.sleep(5.0)
            hours = (time.monotonic() - start) / 3600
            clients.stop()
            alive = proc.poll() is None
            _stop(proc)
        finally:
            if clients is not None:
                clients.stop()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ruled = [record for _at, record in rulings(log_path)]
    stragglers = [r for r in log_records(log_path) if r.get("event") in ("straggler_named", "straggler_across_nodes")]
    said = [str(r.get("message", ""))[:300] for r in ruled + stragglers]
    result: dict = {
        "minutes": round(hours * 60, 1),
        "served": clients.served,
        "client_errors": len(clients.errors),
        "streams_cut": clients.streams_cut,
        "false_verdicts": len(ruled),
        "false_stragglers": len(stragglers),
        "false_verdicts_per_hour": round(len(ruled) / hours, 2) if hours else None,
        "run_stayed_up": alive,
        "verdicts": said,
        "log": str(log_path),
    }
    if fmt == "json":
        print(json.dumps(result, indent=2))
    else:
        print(
            f"soak: {result['minutes']} min, {result['served']} requests served, {result['client_errors']} client "
            f"errors, {result['streams_cut']} streams cut, {result['false_verdicts']} false verdicts "
            f"({result['false_verdicts_per_hour']} per hour), {result['false_stragglers']} stragglers named"
        )
        for line in said:
            print(f"  {line}")
    return 0 if alive and not ruled and not stragglers and not clients.errors else 1


def _interrupted(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(args, command: list[str]) -> int:
    if getattr(args, "list_kinds", False):
        return list_kinds()
    try:
        kinds = parse_kinds(args.kinds, getattr(args, "roles", None))
        serve_flags = parse_serve_flags(args.serve_flags or "")
    except UsageError as exc:
        print(f"supervise drill: {exc}", file=sys.stderr)
        return 64
    trials = max(1, int(getattr(args, "trials", 1) or 1))
    fmt = "json" if args.json else ("markdown" if getattr(args, "markdown", False) else "table")
    dump_root = Path(args.dump_dir).resolve()  # the lane's folder is read by processes with another cwd
    dump_root.mkdir(parents=True, exist_ok=True)
    soak_minutes = getattr(args, "soak", None)
    progress = Progress(1 if soak_minutes else len(kinds) * trials, quiet=False)
    setup = Setup(command, serve_flags, dump_root, args.ready_timeout, args.load_before, progress)
    # SIGTERM / SIGHUP end the drill through its finally clauses: every cgroup, mount and /dev/shm size put back
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupted)
    try:
        if soak_minutes:
            progress.kind("soak", 1, 1)
            return soak(setup, soak_minutes, fmt)
        problems = host.host_problems()
        compiled = compiles_model(command)
        results = []
        for kind in kinds:
            for trial in range(1, trials + 1):
                progress.kind(kind.name, trial, trials)
                if kind.nodes > 1:
                    t = not_run(kind, trial, "needs the engine on two nodes: `make bench-vllm-multinode` drills it")
                elif problems and (kind.cpu_share is not None or kind.memory or kind.environment):
                    t = not_run(kind, trial, problems[0])
                elif compiled and kind.lane is not None and kind.lane[1] == "collective":
                    t = not_run(kind, trial, f"{compiled}: its collectives run inside the compiled graph, where neither "
                                "the drill's lane nor any Python of ours runs; drill this kind in eager mode")  # fmt: skip
                else:
                    t = run_trial(kind, trial, setup)
                progress.done(t)
                results.append(t)
    except KeyboardInterrupt:
        print(
            "supervise drill: interrupted; the run was stopped and what the drill changed was put back", file=sys.stderr
        )
        return 130
    finally:
        progress.close()
    title = f"supervise drill -- {shlex.join(command)[:80]} ({trials} trial(s) a kind, behind the relay)"
    return report(results, title, fmt)


__all__ = ["BY_NAME", "KINDS", "main", "parse_kinds", "parse_serve_flags", "run_trial", "rows", "markdown"]
