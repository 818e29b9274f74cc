"""Issue 2/11/18 benchmark: how fast a death is noticed, how long from a fault until no process is left.

    .venv/bin/python -m bench.bench_core [--kills 50] [--ranks 8] [--grace 2] [--rounds 5]
                                         [--quick] [--update-docs [FILE]]

1. Death notice, in process: real rank processes (started as ``supervise serve``
   starts them) under the exit monitor (pidfds); one is SIGKILLed at t0
   (``time.monotonic`` here), the monitor's event carries the monotonic time
   it saw the exit.
2. Teardown from the fault, end to end: ``supervise serve --nproc-per-node N``
   around ``bench/teardown_rank.py`` (stdlib ranks with heartbeats).  The
   fault instant is the stamp rank 1 writes just before it SIGKILLs itself,
   or, for a hang (rank 1 SIGSTOPs itself inside a step, ``--hard-timeout``),
   the time of the supervisor's ``hang`` log line.  The end is the moment the
   last rank process is reaped, seen from here: a pidfd on every rank, and
   ``pidfd_send_signal(0)`` failing once the supervisor has reaped it.  So
   the figure holds the notice, the incident capture before the teardown,
   the teardown itself and the reaping; the teardown call's own duration
   (``duration_s`` of ``teardown_complete``) is shown next to it.
3. Teardown with a survivor of SIGKILL: a rank's child in a frozen cgroup v1
   freezer (state D, SIGKILL stays pending), SIGTERM to the supervisor:
   exit 85, the teardown's own duration and its /proc marker scans, and
   SIGTERM -> exit.  Skipped where no v1 freezer is mounted.
"""

from __future__ import annotations

import argparse
import os
import queue
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench._docs import ROOT, Stamp, add_common_args, replace_section
from bench.teardown_rank import STEP_S
from tests.support.freezer import FREEZER_ROOT, FROZEN_CHILD, freeze_survivor, remove_run_cgroups, thaw, wait_empty
from tests.support.logs import json_lines
from tp_supervise.supervisor.processes import pidfds as procs
from tp_supervise.supervisor.processes import spawn as launch
from tp_supervise.supervisor.processes.exit_monitor import ExitMonitor
from tp_supervise.supervisor.processes.spawn import RankSpec, RunContext

HEADING = "## Supervisor core: death notice and teardown"
SURVIVOR_HEADING = "## Teardown with a process that survives SIGKILL (issue 11, process handling)"
MODULE = "bench.bench_core"
RANK = ROOT / "bench" / "teardown_rank.py"
SUPERVISE = Path(sys.executable).with_name("supervise")
SLEEPER = "import time\nwhile True: time.sleep(3600)\n"
RUN_LIMIT_S = 60.0
CHILD_LIMIT_S = 30.0  # until rank 0's child is in the freezer
HARD_TIMEOUT_S = 1.0
NOTICE_GOAL_MS = 50.0


# -- 1. death notice, in process ---------------------------------------------------------------
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


# -- 2. teardown from the fault, end to end -------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str  # kill | stop
    ignore_term: bool

    @property
    def fault_instant(self) -> str:
        return "rank 1's stamp before its SIGKILL" if self.fault == "kill" else "the `hang` verdict's log line"


SCENARIOS = (
    Scenario("rank SIGKILLed, ranks honour SIGTERM", "kill", False),
    Scenario("rank SIGKILLed, ranks ignore SIGTERM", "kill", True),
    Scenario("hang verdict (rank SIGSTOPped), ranks honour SIGTERM", "stop", False),
)


@dataclass
class TeardownRun:
    exit_code: int | None
    noticed_s: float | None  # fault -> the supervisor's rank_exited line (kill) / - (a verdict is the fault)
    reaped_s: float | None  # fault -> last rank process reaped (seen from here)
    complete_s: float | None  # fault -> teardown_complete line
    call_s: float | None  # the teardown call's own duration_s
    captured_s: float | None  # fault -> dump_captured line (the capture the teardown waits for)


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _log_events(text: str) -> dict[str, dict]:
    """The first JSON line of each event name."""
    out: dict[str, dict] = {}
    for ev in json_lines(text):
        out.setdefault(str(ev.get("event")), ev)
    return out


def _wait_files(paths: list[Path], proc: subprocess.Popen, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    return False


def last_reaped(pidfds: list[int], limit_s: float) -> float | None:
    """Wall-clock instant the last of these processes was reaped by its parent (None: not within the limit).

    A pidfd turns readable when its process exits (a zombie); signal 0 through it fails only once the
    zombie is gone, i.e. reaped.  Polled every 0.2 ms after the exit."""
    deadline = time.monotonic() + limit_s
    last = 0.0
    for fd in pidfds:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([fd], [], [], min(left, 0.5))[0]:
                break
        while True:
            try:
                signal.pidfd_send_signal(fd, 0)
            except ProcessLookupError:
                last = max(last, time.time())
                break
            except PermissionError:
                return None
            if time.monotonic() > deadline:
                return None
            time.sleep(0.0002)
    return last


def teardown_run(sc: Scenario, ranks: int, grace: float, work: Path) -> TeardownRun:
    out = work / "ranks"
    out.mkdir(parents=True)
    argv = [str(SUPERVISE), "serve", "--nproc-per-node", str(ranks), "--kill-grace", str(grace),
            "--metrics-addr", "none", "--metrics-linger", "0", "--dump-dir", str(work / "dumps"),
            "--log-format", "json"]  # fmt: skip
    if sc.fault == "stop":
        argv += ["--hard-timeout", str(HARD_TIMEOUT_S), "--soft-timeout", str(HARD_TIMEOUT_S / 2)]
    argv += ["--", sys.executable, str(RANK), str(out), "--fault", sc.fault] + (
        ["--ignore-term"] if sc.ignore_term else []
    )
    env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(work / "registry"))
    log_path = work / "supervise.log"
    fds: list[int] = []
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(argv, cwd=work, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        pid_files = [out / f"pid-{r}" for r in range(ranks)]
        if not _wait_files(pid_files, proc, RUN_LIMIT_S):
            raise RuntimeError(f"ranks did not start:\n{log_path.read_text()[-3000:]}")
        fds = [os.pidfd_open(int(p.read_text())) for p in pid_files]
        time.sleep(0.3)  # a few steps: the watchdog has seen progress
        (out / "go").touch()
        reaped = last_reaped(fds, RUN_LIMIT_S)
        code = proc.wait(timeout=RUN_LIMIT_S)
    finally:
        for fd in fds:
            os.close(fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = json_lines(log_path.read_text())
    events = _log_events(log_path.read_text())
    if sc.fault == "kill":
        fault = float((out / "fault").read_text()) if (out / "fault").exists() else None
    else:
        fault = _ts(events["hang"]["timestamp"]) if "hang" in events else None

    def since(name: str) -> float | None:
        """Fault -> the first line of the event at or after the fault (a soft dump may come before a hang)."""
        if fault is None:
            return None
        at = [_ts(ev["timestamp"]) for ev in lines if ev.get("event") == name]
        at = [t for t in at if t >= fault - 0.001]  # the log's clock is the same wall clock, in microseconds
        return min(at) - fault if at else None

    done = events.get("teardown_complete") or {}
    return TeardownRun(
        exit_code=code,
        noticed_s=since("rank_exited") if sc.fault == "kill" else None,
        reaped_s=None if fault is None or reaped is None else reaped - fault,
        complete_s=since("teardown_complete"),
        call_s=done.get("duration_s"),
        captured_s=since("dump_captured"),
    )


# -- 3. a survivor of SIGKILL -------------------------------------------------------------------
@dataclass
class SurvivorRun:
    exit_code: int | None
    teardown_s: float | None  # teardown_incomplete's duration_s
    marker_scans: int | None
    stop_to_exit_s: float
    survivor_reported: bool


def _freezer_reason() -> str | None:
    if not FREEZER_ROOT.is_dir():
        return "no cgroup v1 freezer hierarchy is mounted (a frozen task is the only survivor of SIGKILL)"
    probe = FREEZER_ROOT / f"tp-supervise-bench-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot create a freezer cgroup: {exc}"
    return None


def survivor_run(grace: float, work: Path) -> SurvivorRun:
    work.mkdir(parents=True)
    script = work / "frozen.py"
    script.write_text(FROZEN_CHILD)
    freezer = FREEZER_ROOT / f"tp-supervise-bench-{os.getpid()}-{time.monotonic_ns()}"
    freezer.mkdir()
    log_path = work / "supervise.log"
    argv = [str(SUPERVISE), "serve", "--nproc-per-node", "2", "--kill-grace", str(grace), "--metrics-addr", "none",
            "--metrics-linger", "0", "--dump-dir", str(work / "dumps"), "--log-format", "json", "--",
            sys.executable, str(script), str(freezer)]  # fmt: skip
    env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(work / "registry"))
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(argv, cwd=work, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    run_id = None
    try:
        survivor = freeze_survivor(freezer, CHILD_LIMIT_S)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=RUN_LIMIT_S)
        stop_to_exit = time.monotonic() - t0
    finally:
        thaw(freezer)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        wait_empty(freezer)
        events = _log_events(log_path.read_text())
        run_id = (events.get("supervise_starting") or {}).get("run_id")
        freezer.rmdir()
        if run_id:  # the run's cgroup could not be removed while the survivor was in it
            remove_run_cgroups(run_id)  # best effort: what stays does not fail the benchmark
    incomplete = events.get("teardown_incomplete") or {}
    return SurvivorRun(
        exit_code=code,
        teardown_s=incomplete.get("duration_s"),
        marker_scans=incomplete.get("marker_scans"),
        stop_to_exit_s=stop_to_exit,
        survivor_reported=any(f"pid {survivor} " in s for s in incomplete.get("survivors", [])),
    )


# -- report ---------------------------------------------------------------------------------------
def _f(values: list[float | None], fmt: str = ".3f", unit: str = " s") -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:{fmt}}{unit}"
    return f"median {statistics.median(vals):{fmt}}{unit}, max {max(vals):{fmt}}{unit}"


def core_section(stamp: Stamp, args, lat: list[float], runs: dict[Scenario, list[TeardownRun]]) -> str:
    med, p99 = statistics.median(lat) * 1e3, _pct(lat, 0.99) * 1e3
    rows = [
        f"| death noticed by the exit monitor, {len(lat)} SIGKILLs of {args.ranks} ranks (in process) "
        f"| median {med:.2f} ms, p99 {p99:.2f} ms | <= {NOTICE_GOAL_MS:.0f} ms "
        f"| {'met' if p99 <= NOTICE_GOAL_MS else 'not met'} |"
    ]
    lines = []
    for sc, rs in runs.items():
        reaped = [r.reaped_s for r in rs]
        bound = args.grace + 0.5  # issue 2's goal, now counted from the fault
        bound_text = f"kill-grace + 0.5 s = {bound:g} s"
        ok = all(r is not None and r <= bound for r in reaped)
        codes = sorted({r.exit_code for r in rs}, key=str)
        rows.append(
            f"| {sc.name}: fault -> last rank reaped, {args.ranks} ranks | {_f(reaped)} | <= {bound_text} "
            f"| {'met' if ok else 'not met'} |"
        )
        lines.append(
            f"| {sc.name} | {sc.fault_instant} | {len(rs)} | {codes} | {_f([r.noticed_s for r in rs])} "
            f"| {_f([r.captured_s for r in rs])} | {_f(reaped)} | {_f([r.complete_s for r in rs])} "
            f"| {_f([r.call_s for r in rs])} |"
        )
    return f"""{HEADING}

{stamp.text()}

Death notice, in process: real rank processes started the way `supervise serve` starts them (own
session, parent-death signal, death pipe), watched by the exit monitor (pidfds); `time.monotonic()`
just before `kill(SIGKILL)` here -> the monotonic time stamped on the monitor's event.

Teardown from the fault, end to end: `supervise serve --nproc-per-node {args.ranks} --kill-grace {args.grace:g}`
around `bench/teardown_rank.py` (stdlib ranks running instrumented {STEP_S * 1e3:g} ms steps), {args.rounds} run(s) per
row.
Fault: the wall-clock stamp rank 1 writes just before it SIGKILLs itself, or, for a hang (rank 1 SIGSTOPs
itself inside a step; `--hard-timeout {HARD_TIMEOUT_S:g}`), the time of the supervisor's `hang` log line. End:
the last rank process reaped by the supervisor, seen from the benchmark (a pidfd per rank; signal 0
through it fails once the zombie is gone). So the figure holds the death notice, the incident capture
the main thread waits for before it tears down, the teardown and the reaping.

| measure | result | goal | goal met |
|---|---|---|---|
{chr(10).join(rows)}

Where the time goes (same runs; all from the fault instant, except the last column):

| scenario | fault instant | runs | exit | -> `rank_exited` logged | -> `dump_captured` logged | -> last rank reaped | -> `teardown_complete` logged | teardown call alone (`duration_s`) |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(lines)}

`teardown_complete` is logged after the dump's bundle write has settled, so it can come after the last
reap; the teardown call's own `duration_s` starts only after the capture, so it is smaller than the
fault-to-reaped figure by the notice and the capture.
"""


def survivor_section(stamp: Stamp, grace: float, runs: list[SurvivorRun], skipped: str | None) -> str:
    if skipped:
        body = f"Not measured on this machine: {skipped}."
    else:
        rows = "\n".join(
            f"| {i + 1} | {r.exit_code} | {'yes' if r.survivor_reported else 'no'} | {r.marker_scans} "
            f"| {r.teardown_s:.3f} s | {r.stop_to_exit_s:.2f} s |"
            if r.teardown_s is not None
            else f"| {i + 1} | {r.exit_code} | {'yes' if r.survivor_reported else 'no'} | - | - | {r.stop_to_exit_s:.2f} s |"
            for i, r in enumerate(runs)
        )
        teardown = [r.teardown_s for r in runs if r.teardown_s is not None]
        over = f"{max(teardown) - grace:.3f} s" if teardown else "-"
        body = f"""| run | exit (want 85) | survivor named | marker scans of /proc | teardown `duration_s` | SIGTERM -> exit |
|---|---|---|---|---|---|
{rows}

The teardown's duration is the grace ({grace:g} s) plus the kill confirmation, which a process in state D
outlasts: at most {over} over the grace in these runs; one scan of /proc for the run marker per teardown. The rest of
SIGTERM -> exit is the run cgroup's removal, which waits for a cgroup that still holds the survivor."""
    return f"""{SURVIVOR_HEADING}

{stamp.text()}

A rank's child in a frozen cgroup v1 freezer (state D: SIGKILL stays pending, a real survivor),
`supervise serve --nproc-per-node 2 --kill-grace {grace:g}`, SIGTERM to the supervisor; figures from its
`teardown_incomplete` line and the benchmark's clock.

{body}
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--grace", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=5, help="end-to-end runs per teardown scenario")
    p.add_argument("--survivor-rounds", type=int, default=3)
    add_common_args(p, "10 kills, 4 ranks, grace 0.5 s, one run per scenario")
    args = p.parse_args(argv)
    if args.quick:
        args.kills, args.ranks, args.grace, args.rounds, args.survivor_rounds = 10, 4, 0.5, 1, 1
    stamp = Stamp.begin(MODULE, argv)
    lat = death_notice(args.kills, args.ranks)
    print(
        f"death notice over {len(lat)} SIGKILLs, {args.ranks} ranks: median {statistics.median(lat) * 1e3:.2f} ms, "
        f"p99 {_pct(lat, 0.99) * 1e3:.2f} ms, max {max(lat) * 1e3:.2f} ms",
        flush=True,
    )
    runs: dict[Scenario, list[TeardownRun]] = {sc: [] for sc in SCENARIOS}
    with tempfile.TemporaryDirectory(prefix="bench-core-") as tmp:
        for i in range(args.rounds):
            for j, sc in enumerate(SCENARIOS):  # interleaved: the machine's load drifts
                r = teardown_run(sc, args.ranks, args.grace, Path(tmp) / f"{i}-{j}")
                runs[sc].append(r)
                print(
                    f"{sc.name}: exit {r.exit_code}, fault -> reaped {r.reaped_s}, teardown call {r.call_s}", flush=True
                )
        skipped = _freezer_reason()
        survivors = []
        if skipped:
            print(f"survivor: skipped: {skipped}", flush=True)
        else:
            for i in range(args.survivor_rounds):
                s = survivor_run(args.grace, Path(tmp) / f"survivor-{i}")
                survivors.append(s)
                print(
                    f"survivor: exit {s.exit_code}, teardown {s.teardown_s} s, SIGTERM -> exit "
                    f"{s.stop_to_exit_s:.2f} s",
                    flush=True,
                )
    core = core_section(stamp, args, lat, runs)
    surv = survivor_section(stamp, args.grace, survivors, skipped)
    print(core)
    print(surv)
    if args.update_docs:
        replace_section(args.update_docs, HEADING, core)
        replace_section(args.update_docs, SURVIVOR_HEADING, surv)
    bad = [sc.name for sc, rs in runs.items() for r in rs if r.reaped_s is None or r.exit_code not in (80, 81)]
    bad += [f"survivor exit {s.exit_code}" for s in survivors if s.exit_code != 85]
    if bad:
        print(f"runs that did not measure: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
