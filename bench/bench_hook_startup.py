"""Issue 10 benchmark: what the zero-code hook costs a rank at start-up.

    .venv/bin/python -m bench.bench_hook_startup [--rounds N] [--update-docs docs/benchmarks.md]

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

from bench._docs import replace_section

HEADING = "## Zero-code hook start-up cost"
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


def measure(rounds: int) -> dict:
    base = Path(tempfile.mkdtemp(prefix="hook-bench-"))
    results: dict[bool, list[dict]] = {True: [], False: []}
    try:
        one_run(True, base)  # warm the page cache for both variants
        for i in range(rounds):
            for hook in ((True, False) if i % 2 == 0 else (False, True)):
                results[hook] += one_run(hook, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summary = {}
    for hook, ranks in results.items():
        summary["hook" if hook else "no_hook"] = {
            "init_s": statistics.median(r["init_s"] for r in ranks),
            "rss_mib": statistics.median(r["rss_kib"] for r in ranks) / 1024,
            "loaded": sorted({m for r in ranks for m in r["loaded"]}),
            "samples": len(ranks),
        }
    summary["extra_init_ms"] = (summary["hook"]["init_s"] - summary["no_hook"]["init_s"]) * 1000
    summary["extra_rss_mib"] = summary["hook"]["rss_mib"] - summary["no_hook"]["rss_mib"]
    return summary


def render(s: dict, label: str) -> str:
    return (f"{label}: exec to init_process_group {s['hook']['init_s'] * 1000:.0f} ms with the hook vs "
            f"{s['no_hook']['init_s'] * 1000:.0f} ms without ({s['extra_init_ms']:+.0f} ms), resident memory "
            f"{s['hook']['rss_mib']:.1f} vs {s['no_hook']['rss_mib']:.1f} MiB ({s['extra_rss_mib']:+.1f} MiB); "
            f"libraries of the supervisor's set loaded in a hooked rank: {', '.join(s['hook']['loaded']) or 'none'}, "
            f"without the hook: {', '.join(s['no_hook']['loaded']) or 'none'} ({s['hook']['samples']} ranks each)")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--update-docs", type=Path)
    parser.add_argument("--before", help="a line measured on the previous tree, kept in the docs section")
    args = parser.parse_args()
    s = measure(args.rounds)
    line = render(s, args.label)
    print(line)
    print(json.dumps(s, indent=1))
    if args.update_docs:
        lines = [f"- {args.before}"] if args.before else []
        lines.append(f"- {line}")
        replace_section(args.update_docs, HEADING, "\n".join([
            HEADING, "",
            f"`.venv/bin/python -m bench.bench_hook_startup --rounds {args.rounds}` (2 zero-code gloo ranks under `supervise "
            "serve`, with and without `--no-hook`, alternating; medians over every rank; exec time from /proc, "
            "10 ms resolution):", "", *lines, ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
