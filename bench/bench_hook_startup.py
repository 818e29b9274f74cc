"""Issue 10 benchmark: what the zero-code hook costs a rank at start-up.

    .venv/bin/python -m bench.bench_hook_startup [--rounds N] [--quick] [--update-docs [FILE]]

Runs ``supervise serve --nproc-per-node 2 -- python bench/hook_rank.py`` with
the hook and with ``--no-hook``, alternating, ``--rounds`` times each.  Each
rank reports the seconds from its exec to ``init_process_group`` returning
(its start time read from /proc, 10 ms resolution), its resident memory after
one all_reduce, and which supervisor-side libraries it loaded (torch.cuda
itself imports pynvml whenever it is installed, hook or not: the no-hook
column shows what is torch's doing).  The figures
are medians over every rank of every round; the hook's cost is the
difference of the medians, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._docs import Stamp, add_common_args, replace_section

HEADING = "## Zero-code hook start-up cost"
MODULE = "bench.bench_hook_startup"
ROOT = Path(__file__).resolve().parent.parent
RANK = ROOT / "bench" / "hook_rank.py"
SUPERVISE = Path(sys.executable).parent / "supervise"
NPROC = 2
RUN_TIMEOUT_S = 120


def one_run(hook: bool, base: Path) -> list[dict]:
    out = Path(tempfile.mkdtemp(dir=base))
    argv = [str(SUPERVISE), "serve", "--nproc-per-node", str(NPROC), "--metrics-addr", "none",
            "--dump-dir", str(out / "dumps"), "--log-format", "json"]
    if not hook:
        argv.append("--no-hook")
    argv += ["--", sys.executable, str(RANK), str(out)]
    proc = subprocess.run(argv, cwd=base, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env={**os.environ, "SUPERVISE_REGISTRY_DIR": str(out / "registry")})
    if proc.returncode != 0:
        raise SystemExit(f"supervise exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(NPROC)]


def measure(rounds: int, warm: bool = True) -> dict:
    base = Path(tempfile.mkdtemp(prefix="hook-bench-"))
    results: dict[bool, list[dict]] = {True: [], False: []}
    per_run: dict[bool, list[float]] = {True: [], False: []}  # each run's median start-up, seconds
    try:
        if warm:
            one_run(True, base)  # warm the page cache for both variants
        for i in range(rounds):
            for hook in ((True, False) if i % 2 == 0 else (False, True)):
                ranks = one_run(hook, base)
                results[hook] += ranks
                per_run[hook].append(statistics.median(r["init_s"] for r in ranks))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summary: dict = {}
    for hook, ranks in results.items():
        summary["hook" if hook else "no_hook"] = {
            "init_s": statistics.median(r["init_s"] for r in ranks),
            "runs_init_s": (min(per_run[hook]), max(per_run[hook])),
            "runs": len(per_run[hook]),
            "rss_mib": statistics.median(r["rss_kib"] for r in ranks) / 1024,
            "loaded": sorted({m for r in ranks for m in r["loaded"]}),
            "samples": len(ranks),
        }
    summary["extra_init_ms"] = (summary["hook"]["init_s"] - summary["no_hook"]["init_s"]) * 1000
    summary["extra_rss_mib"] = summary["hook"]["rss_mib"] - summary["no_hook"]["rss_mib"]
    return summary


def render(s: dict) -> str:
    def row(name: str, v: dict) -> str:
        lo, hi = v["runs_init_s"]
        return (f"| {name} | {v['init_s'] * 1000:.0f} | {lo * 1000:.0f}-{hi * 1000:.0f} | {v['rss_mib']:.1f} "
                f"| {', '.join(v['loaded']) or 'none'} | {v['runs']} runs, {v['samples']} ranks |")

    return "\n".join([
        "| ranks | exec to init_process_group, median ms | per-run medians, ms | resident memory, median MiB "
        "| libraries of the supervisor's set loaded | measured |",
        "|---|---|---|---|---|---|",
        row("with the hook", s["hook"]),
        row("without (`--no-hook`)", s["no_hook"]),
        f"| difference | {s['extra_init_ms']:+.0f} | | {s['extra_rss_mib']:+.1f} | | |",
    ])


def reading(s: dict) -> str:
    """What the figures say, from the figures."""
    hook, bare = s["hook"], s["no_hook"]
    spread_ms = max(hi - lo for lo, hi in (hook["runs_init_s"], bare["runs_init_s"])) * 1000
    extra = set(hook["loaded"]) - set(bare["loaded"])
    diff = f"the start-up difference (with - without) is {s['extra_init_ms']:+.0f} ms"
    if min(hook["runs"], bare["runs"]) < 2:
        start = f"{diff}, from one run of each: the noise between runs is not measured, so it is no cost figure"
    elif abs(s["extra_init_ms"]) <= spread_ms:
        start = f"{diff}, within the spread between runs of the same kind (up to {spread_ms:.0f} ms)"
    else:
        start = f"{diff}, more than the spread between runs of the same kind (up to {spread_ms:.0f} ms)"
    libs = ("it loads none of the supervisor's libraries beyond what the rank loads without it"
            + (f" ({', '.join(bare['loaded'])}: torch's own doing, e.g. torch.cuda imports pynvml whenever it is "
               "installed)" if bare["loaded"] else "")
            if not extra else f"it loads {', '.join(sorted(extra))} into every rank")
    return (f"Reading: per rank, the hook costs {s['extra_rss_mib']:+.1f} MiB of resident memory; {start}; {libs}. "
            "What it imports is the rank-side package only (stdlib, `supervisor/rank/`).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    add_common_args(parser, "one round (one run with the hook, one without), no page-cache warm-up run")
    args = parser.parse_args(argv)
    stamp = Stamp.begin(MODULE, argv)
    s = measure(1 if args.quick else args.rounds, warm=not args.quick)
    print(json.dumps(s, indent=1))
    section = "\n".join([
        HEADING, "", stamp.text(), "",
        f"{NPROC} zero-code gloo ranks (`bench/hook_rank.py`) under `supervise serve --nproc-per-node {NPROC}`, "
        "with the hook and with `--no-hook`, alternating; figures over every rank of every run; exec time from "
        "/proc (10 ms resolution); the libraries column lists which of structlog, rich, prometheus_client, "
        "psutil, pynvml, aiohttp, zmq and the supervisor's dumps/watchdogs/consensus packages a rank had loaded "
        "after one all_reduce.", "",
        render(s), "",
        reading(s), ""])
    print(section)
    if args.update_docs:
        replace_section(args.update_docs, HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
