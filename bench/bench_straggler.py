"""Issue 20 benchmark: naming the straggler rank, with default flags, on real gloo ranks.

    .venv/bin/python -m bench.bench_straggler [--quick] [--trials N] [--clean-minutes M] [--json OUT]
                                              [--update-docs [FILE]]

Every run is ``supervise serve --nproc-per-node N -- python tests/fakes/step_loop.py ...`` (a plain
torch.distributed gloo loop, zero code: the hook stamps the arrivals), default straggler flags (threshold
10 % of the step, window 20 s) unless said.  The loop's step is 50 ms: 8 all_reduces with compute between.

1. **Detection**, ``--trials`` per kind, rank 1 of TP=2 turned slow ``SLOW_AT_S`` into the run (after the
   detector's warm-up and baseline):
   * ``sleep``: the program sleeps 20 % of the step before the step's first collective;
   * ``cgroup quota``: the bench moves every thread of rank 1 into a cgroup v1 ``cpu`` child with a CFS
     quota of ``QUOTA_SHARE`` of a CPU (the ranks compute by spinning: ``--busy``);
   * ``CPU contention``: ranks pinned to CPU 0 and 1 from the start, then a busy process pinned to rank
     1's CPU (``--busy`` too).
   Time to detection: from the slowdown (the rank's own "slow from" stamp, or the bench's write/spawn) to the
   straggler event's time (both CLOCK_MONOTONIC of this host).  Accuracy: the first and only rank named is
   rank 1, the run exits 0 (SIGTERM after the bundle), nothing killed.  For the OS-made kinds, whether the
   verdict says throttled / contention.
2. **Slowdown sizes**: the ``sleep`` kind at 5, 10 and 15 % of the step (20 % is part 1), named or not within
   ``SIZE_LIMIT_S`` of the slowdown.
3. **False positives**: clean runs of ``--clean-minutes`` each, side by side: TP=2 and TP=4 with rank 0 doing
   30 % of the step as extra work after the step's collectives (a role uneven by design), and the built-in
   engine at TP=2 left idle; a straggler named in any is a false positive (per hour of run time).
4. **Supervisor CPU for the skew computation**: the CPU time of the supervisor's ``tps-straggler`` thread
   (``/proc/<pid>/task/*/comm``) over the clean runs, per rank and per 1,000 collectives judged, and at TP=8
   for scale (``SCALE_S`` seconds).

Needs root for the cgroup and affinity kinds (skipped with the reason otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench._docs import ROOT, Stamp, add_common_args, replace_section

MODULE = "bench.bench_straggler"
HEADING = "## Stragglers (issue 20)"
LOOP = ROOT / "tests" / "fakes" / "step_loop.py"
CPU_V1 = Path("/sys/fs/cgroup/cpu")
STEP_S = 0.05
COLLS = 8
SLOW_AT_S = 25.0  # warm-up 10 s + baseline 10 s (docs/watchdogs.md) and a margin
LIMIT_S = 45.0  # a trial ends here when nothing is named (default window 20 s)
SIZE_LIMIT_S = 45.0
QUOTA_SHARE = 0.3
SIZES = (0.05, 0.10, 0.15)
UNEVEN_SHARE = 0.3
SCALE_S = 60.0
BUSY = [sys.executable, "-c", "while True: pass"]


@contextlib.contextmanager
def cpu_quota_cgroup(quota_us: int, period_us: int = 100_000) -> Iterator[Path]:
    """A cgroup v1 ``cpu`` child with a CFS quota, removed on exit; RuntimeError where none can be made."""
    if not (CPU_V1 / "cpu.cfs_quota_us").exists():
        raise RuntimeError(f"no cgroup v1 cpu controller at {CPU_V1}")
    path = CPU_V1 / f"tp-supervise-bench-{uuid.uuid4().hex[:12]}"
    try:
        path.mkdir()
        (path / "cpu.cfs_period_us").write_text(str(period_us))
        (path / "cpu.cfs_quota_us").write_text(str(quota_us))
    except OSError as exc:
        if path.exists():
            path.rmdir()
        raise RuntimeError(f"cannot make a cgroup v1 cpu child with a quota here: {exc}") from exc
    try:
        yield path
    finally:
        end = time.monotonic() + 5.0
        while path.exists():
            try:
                path.rmdir()
            except OSError:  # its last task is still leaving
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)


def tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def pin(pid: int, cpu: int) -> None:
    for tid in tasks(pid):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, {cpu})


def thread_cpu_s(pid: int, comm: str) -> float | None:
    """utime + stime of the thread of ``pid`` named ``comm`` (seconds), None when it has none."""
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tasks(pid):
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() != comm:
                continue
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        return (int(fields[11]) + int(fields[12])) / tick
    return None


@dataclass
class Run:
    """One ``supervise serve`` of the loop (or the engine), its JSON log read as it comes."""

    name: str
    tp: int
    command: list[str] | None
    base: Path
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    lines: list[dict] = field(default_factory=list)
    rank_pids: dict[int, int] = field(default_factory=dict)
    slow_from: float | None = None
    started: float = 0.0
    _reader: threading.Thread | None = None

    @property
    def dump_dir(self) -> Path:
        return self.base / self.name / "dumps"

    def start(self) -> Run:
        (self.base / self.name).mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(self.base / self.name / "registry"))
        argv = [sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--log-format", "json",
                "--metrics-addr", "127.0.0.1:0", "--metrics-linger", "0", "--dump-dir", str(self.dump_dir),
                "--nproc-per-node", str(self.tp), *self.extra]
        if self.command is not None:
            argv += ["--", *self.command]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            self.lines.append(line)
            message = str(line.get("message", ""))
            if line.get("event") == "rank_output":
                words = message.split()
                if len(words) >= 4 and words[0] == "pid" and words[2] == "rank":
                    self.rank_pids[int(words[3])] = int(words[1])
                elif "slow from" in message and self.slow_from is None:
                    self.slow_from = float(words[-1])

    def wait_ranks(self, timeout: float = 60.0) -> bool:
        end = time.monotonic() + timeout
        while len(self.rank_pids) < self.tp:
            if time.monotonic() > end or (self.proc is not None and self.proc.poll() is not None):
                return False
            time.sleep(0.1)
        return True

    def straggler(self) -> dict | None:
        """The first straggler bundle's summary, once it is written."""
        if not self.dump_dir.is_dir():
            return None
        for bundle in sorted(self.dump_dir.glob("*straggler*")):
            path = bundle / "summary.json"
            if path.is_file():
                with contextlib.suppress(ValueError, OSError):
                    return json.loads(path.read_text())
        return None

    def named(self) -> list[int]:
        return [int(line["rank"]) for line in self.lines if line.get("event") == "straggler_named"]

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
            self.proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        return code


def loop(seconds: float, *extra: str) -> list[str]:
    return [sys.executable, str(LOOP), "--seconds", str(seconds), "--step", str(STEP_S), "--colls", str(COLLS),
            *extra]


@dataclass
class Trial:
    kind: str
    share: float | None
    named_after_s: float | None
    named_ranks: list[int]
    exit_code: int | None
    verdict: str
    says_why: bool | None
    error: str = ""

    @property
    def right(self) -> bool:
        return self.named_ranks == [1] and self.exit_code == 0


def trial(kind: str, base: Path, share: float = 0.2, slow_at: float = SLOW_AT_S, limit: float = LIMIT_S,
          window: float | None = None) -> Trial:
    name = f"{kind}-{share}-{uuid.uuid4().hex[:6]}"
    seconds = slow_at + limit + 30  # the loop outlives the trial: the bench stops it
    extra = [] if window is None else ["--straggler-sustain", str(window)]
    if kind == "sleep":
        command = loop(seconds, "--slow-rank", "1", "--slow-from", str(slow_at), "--slow-share", str(share))
    else:
        command = loop(seconds, "--busy")
    run = Run(name, 2, command, base, extra)
    applied: float | None = None
    error = ""
    with contextlib.ExitStack() as stack:
        try:
            run.start()
            if not run.wait_ranks():
                raise RuntimeError("the ranks did not start")
            if kind == "contention":
                pin(run.rank_pids[0], 0)
                pin(run.rank_pids[1], 1)
            time.sleep(max(0.0, slow_at - (time.monotonic() - run.started)))
            if kind == "quota":
                cgroup = stack.enter_context(cpu_quota_cgroup(int(QUOTA_SHARE * 100_000)))
                applied = time.monotonic()
                for tid in tasks(run.rank_pids[1]):
                    with contextlib.suppress(OSError):
                        (cgroup / "tasks").write_text(str(tid))
            elif kind == "contention":
                spinner = subprocess.Popen(BUSY, preexec_fn=lambda: os.sched_setaffinity(0, {1}))
                stack.callback(lambda: (spinner.kill(), spinner.wait()))
                applied = time.monotonic()
            end = time.monotonic() + limit
            while run.straggler() is None and time.monotonic() < end and run.proc and run.proc.poll() is None:
                time.sleep(0.2)
        except (RuntimeError, OSError) as exc:
            error = str(exc)
        finally:
            code = run.stop()
    summary = run.straggler()
    started = run.slow_from if kind == "sleep" else applied
    after = None
    verdict = ""
    if summary is not None and started is not None:
        after = summary["straggler"]["event"]["at"] - started
        verdict = summary.get("verdict", "")
    says = None
    if kind != "sleep" and summary is not None:
        says = ("throttled" in verdict) if kind == "quota" else ("contention" in verdict or "run queue" in verdict)
    return Trial(kind, share, after, run.named(), code, verdict, says, error)


@dataclass
class Clean:
    name: str
    tp: int
    minutes: float
    named: list[int]
    exit_code: int | None
    straggler_cpu_s: float | None
    collectives: int


def collectives(run: Run) -> int | None:
    """Rank 0's collective count, from ``supervise status --json`` (None when it cannot be asked)."""
    env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(run.base / run.name / "registry"))
    try:
        out = subprocess.run([sys.executable, "-m", "tp_supervise.supervisor.cli", "status", "--json"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=30)
        ranks = json.loads(out.stdout)["ranks"]
        return int(next(r["collectives"] for r in ranks if r["rank"] == 0))
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, StopIteration, TypeError):
        return None


def clean_run(kind: str, tp: int, base: Path, seconds: float) -> Clean:
    if kind == "engine":
        run = Run(f"clean-engine-{tp}", tp, None, base, ["--port", "0"])
    else:
        command = loop(seconds + 60, "--uneven-rank", "0", "--uneven-share", str(UNEVEN_SHARE))
        run = Run(f"clean-{kind}-{tp}", tp, command, base)
    run.start()
    if kind != "engine":
        run.wait_ranks(120)
    t0 = time.monotonic()
    first = collectives(run)
    cpu = None
    while time.monotonic() - t0 < seconds and run.proc and run.proc.poll() is None:
        time.sleep(1.0)
        cpu = thread_cpu_s(run.proc.pid, "tps-straggler") if run.proc.poll() is None else cpu
    last = collectives(run)
    minutes = (time.monotonic() - t0) / 60
    code = run.stop()
    counted = last - first if first is not None and last is not None else 0
    return Clean(run.name, tp, minutes, run.named(), code, cpu, counted)


def summarize(trials: list[Trial]) -> dict:
    times = [t.named_after_s for t in trials if t.right and t.named_after_s is not None]
    return {
        "trials": len(trials),
        "right": sum(t.right for t in trials),
        "median_s": statistics.median(times) if times else None,
        "worst_s": max(times) if times else None,
        "says_why": sum(bool(t.says_why) for t in trials),
        "errors": [t.error for t in trials if t.error],
        "wrong": [asdict(t) for t in trials if not t.right],
    }


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="trials per kind (default %(default)s)")
    parser.add_argument("--clean-minutes", type=float, default=10.0, help="minutes of each clean run")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    add_common_args(parser, "one sleep trial (rank 1 sleeps two steps' time per step from the start: named by the "
                            "gross-share rule, 2 s window) beside 15 s of one clean TP=2 run; no cgroup, contention, "
                            "sizes or TP=8")
    args = parser.parse_args(argv)
    stamp = Stamp.begin(MODULE, argv)
    base = Path(tempfile.mkdtemp(prefix="bench-straggler-"))
    root = os.geteuid() == 0
    results: dict = {"kinds": {}, "sizes": {}, "clean": [], "scale": None}
    try:
        if args.quick:
            with ThreadPoolExecutor(max_workers=2) as pool:
                slow = pool.submit(trial, "sleep", base, 2.0, 0.0, 35.0, 2.0)
                calm = pool.submit(clean_run, "uneven", 2, base, 15.0)
                quick, clean = slow.result(), calm.result()
            print(json.dumps({"trial": asdict(quick), "clean": asdict(clean)}, indent=1))
            ok = quick.named_ranks[:1] == [1] and quick.exit_code == 0 and clean.exit_code == 0
            return 0 if ok else 1
        clean_s = args.clean_minutes * 60
        with ThreadPoolExecutor(max_workers=5) as pool:
            # Clean runs beside the light (sleeping) trials: three processes groups mostly asleep.
            cleans = [pool.submit(clean_run, kind, tp, base, clean_s)
                      for kind, tp in (("uneven", 2), ("uneven", 4), ("engine", 2))]
            sleeps = []
            for _ in range(args.trials):
                sleeps.append(pool.submit(trial, "sleep", base))
            sizes = {share: [pool.submit(trial, "sleep", base, share, SLOW_AT_S, SIZE_LIMIT_S) for _ in range(3)]
                     for share in SIZES}
            results["kinds"]["sleep"] = summarize([f.result() for f in sleeps])
            results["sizes"] = {share: [asdict(f.result()) for f in fs] for share, fs in sizes.items()}
            results["clean"] = [asdict(f.result()) for f in cleans]
        for kind in ("quota", "contention"):  # one at a time: they use both CPUs
            if not root:
                results["kinds"][kind] = {"skipped": "needs root (cgroup, CPU affinity of another process)"}
                continue
            results["kinds"][kind] = summarize([trial(kind, base) for _ in range(args.trials)])
        scale = Run("scale-8", 8, loop(SCALE_S + 60), base).start()
        scale.wait_ranks(120)
        before = thread_cpu_s(scale.proc.pid, "tps-straggler") if scale.proc else None
        time.sleep(SCALE_S)
        after = thread_cpu_s(scale.proc.pid, "tps-straggler") if scale.proc else None
        scale.stop()
        if before is not None and after is not None:
            results["scale"] = {"tp": 8, "seconds": SCALE_S, "cpu_s": after - before}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(results, indent=1, default=str))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.update_docs:
        replace_section(args.update_docs, HEADING, section(stamp, args, results))
    return 0


def section(stamp: Stamp, args: argparse.Namespace, r: dict) -> str:
    out = [HEADING, "", stamp.text(), "",
           f"`supervise serve` with default straggler flags (threshold 10 % of the step, window 20 s) around "
           f"tests/fakes/step_loop.py: real gloo ranks, zero code (the hook stamps each arrival), a {STEP_S * 1000:.0f} ms "
           f"step of {COLLS} all_reduces with compute between. Rank 1 of TP=2 turns slow {SLOW_AT_S:.0f} s into the "
           "run; detection time is from the slowdown (the rank's own stamp, or the moment the bench applied the "
           "quota or started the competing process) to the straggler verdict's time, both CLOCK_MONOTONIC of this "
           "host. Right: rank 1 and only rank 1 named, and the run exited 0 when the bench stopped it (nothing "
           "killed).", "",
           "| kind | trials | right rank named | time to name it: median | worst | verdict says why |",
           "|---|---|---|---|---|---|"]
    what = {"sleep": "program sleeps 20 % of the step", "quota": f"cgroup CPU quota {QUOTA_SHARE:.0%} of a CPU",
            "contention": "a busy process pinned to its CPU"}
    for kind, s in r["kinds"].items():
        if "skipped" in s:
            out.append(f"| {what[kind]} | skipped: {s['skipped']} | | | | |")
            continue
        why = "-" if kind == "sleep" else f"{s['says_why']}/{s['trials']}"
        out.append(f"| {what[kind]} | {s['trials']} | {s['right']}/{s['trials']} | {fmt(s['median_s'])} s | "
                   f"{fmt(s['worst_s'])} s | {why} |")
    wrong = [w for s in r["kinds"].values() for w in s.get("wrong", [])]
    if wrong:
        out += ["", "Trials not right: " + "; ".join(
            f"{w['kind']}: named {w['named_ranks'] or 'nobody'}, exit {w['exit_code']}"
            + (f" ({w['error']})" if w["error"] else "") for w in wrong) + "."]
    out += ["", f"Slowdown sizes (the `sleep` kind, 3 trials each, {SIZE_LIMIT_S:.0f} s allowed after the slowdown; "
                "the default threshold is 10 % of the step):", "",
            "| rank 1 sleeps, share of the step | named (right rank) | time to name it |", "|---|---|---|"]
    for share, trials in r["sizes"].items():
        right = [t for t in trials if t["named_ranks"] == [1] and t["exit_code"] == 0]
        times = [t["named_after_s"] for t in right if t["named_after_s"] is not None]
        other = [t for t in trials if t["named_ranks"] and t["named_ranks"] != [1]]
        note = f" (wrong rank in {len(other)})" if other else ""
        out.append(f"| {float(share):.0%} | {len(right)}/{len(trials)}{note} | "
                   f"{fmt(statistics.median(times)) + ' s' if times else '-'} |")
    s20 = r["kinds"].get("sleep", {})
    if s20.get("trials"):
        out.append(f"| 20 % (the table above) | {s20['right']}/{s20['trials']} | {fmt(s20['median_s'])} s |")
    clean = r["clean"]
    hours = sum(c["minutes"] for c in clean) / 60
    fps = sum(len(c["named"]) for c in clean)
    desc = {"clean-uneven-2": f"TP=2, rank 0 does {UNEVEN_SHARE:.0%} of the step as extra work",
            "clean-uneven-4": f"TP=4, rank 0 does {UNEVEN_SHARE:.0%} of the step as extra work",
            "clean-engine-2": "built-in engine, TP=2, idle"}
    out += ["", f"False positives: {fps} straggler(s) named in {hours * 60:.0f} min of clean runs side by side "
                f"({fps / hours if hours else 0:.1f} per hour), while the trials above ran on the same 2 CPUs:", "",
            "| clean run | minutes | named | exit | supervisor's straggler thread CPU | per rank | per 1,000 collectives |",
            "|---|---|---|---|---|---|---|"]
    for c in clean:
        cpu = c["straggler_cpu_s"]
        share = None if cpu is None else cpu / (c["minutes"] * 60)
        per_rank = None if share is None else share / c["tp"]
        per_k = None if cpu is None or not c["collectives"] else cpu / (c["collectives"] / 1000) * 1000
        per_k_text = "-" if per_k is None else f"{per_k:.2f} ms"
        out.append(f"| {desc.get(c['name'], c['name'])} | {c['minutes']:.1f} | {c['named'] or 'nobody'} | "
                   f"{c['exit_code']} | {fmt(cpu, 2)} s ({fmt(None if share is None else share * 100, 2)} % of a core)"
                   f" | {fmt(None if per_rank is None else per_rank * 100, 3)} % | "
                   f"{per_k_text} |")
    if r.get("scale"):
        sc = r["scale"]
        share = sc["cpu_s"] / sc["seconds"]
        out += ["", f"At TP=8 (same loop, {sc['seconds']:.0f} s): the straggler thread used {sc['cpu_s']:.2f} s of "
                    f"CPU, {share * 100:.2f} % of a core, {share * 100 / 8:.3f} % per rank."]
    out += ["", "The thread copies new arrival stamps from shared memory 20 times a second and runs the pure "
                "detector (watchdogs/straggler.py); its cost grows with the collectives per second it judges, "
                "not with the step. The per-1,000-collectives figure counts one collective once, whatever the "
                "number of ranks that arrived at it."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
