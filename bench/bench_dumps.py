"""Wall time of a full incident dump for 2, 4 and 8 fake ranks, py-spy and fallback paths.

A "full dump" is ``dumps.incident.write_incident``: /proc + heartbeat of
every rank, stacks of every rank in parallel, flight-recorder collection
(the fake ranks serve none, so each rank answers "no socket" at once),
the verdict, and the bundle written atomically.  Rank 1 is stuck in a
Python function, the others wait in a "collective" (torch-free fake ranks,
tests/dumps/fake_rank.py).

Usage:
    .venv/bin/python bench/bench_dumps.py [--repeat N] [--ranks 2,4,8] [--freeze] [--write-docs]

``--write-docs`` replaces the "## Dumps" section of docs/benchmarks.md.
Goal (issue 5): <= 1 s for 8 ranks (Python stacks).

``--freeze`` measures the fatal path instead (issue 11, "freeze, then
dump"): ``dumps.incident.capture_incident(freeze=True)`` reads /proc of
every rank, SIGSTOPs them and waits until each reads stopped (the
freeze), takes the stacks of the frozen ranks, resumes them and reads
their flight recorders (the capture, which is all the teardown waits
for); then ``write_captured`` writes the bundle.  With ``--write-docs`` it
replaces the "## Freeze, then dump" section.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "dumps"))

import structlog  # noqa: E402

from tp_supervise.dumps.bundle import BundleWriter  # noqa: E402
from tp_supervise.dumps.capture import ENV_PYSPY, find_pyspy  # noqa: E402
from tp_supervise.dumps.incident import capture_incident, write_captured, write_incident  # noqa: E402
from dumps_fakes import FakeRankSet  # noqa: E402

GOAL_S = 1.0
DEADLINE_S = 5.0
DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Dumps"
FREEZE_SECTION = "## Freeze, then dump"
METHODS = ("py-spy", "faulthandler")


def run_one(nranks: int, method: str, repeat: int, root: Path) -> list[float]:
    ranks = FakeRankSet(root / f"{method}-{nranks}", nranks)
    writer = BundleWriter(root / f"{method}-{nranks}" / "dumps", keep=repeat + 1, max_bytes=0)
    times = []
    try:
        ranks.start({r: ("python" if r == 1 else "collective") for r in range(nranks)})
        for _ in range(repeat):
            res = write_incident(
                writer,
                reason="hang",
                run_id=ranks.run_id,
                targets=ranks.targets(),
                run_dir=ranks.run_dir,
                method=method,
                deadline_s=DEADLINE_S,
            )
            if not res.ok or res.diagnosis is None or res.diagnosis.culprit_ranks != [1]:
                raise RuntimeError(f"bad dump: {res}")
            times.append(res.duration_s)
    finally:
        ranks.close()
    return times


def run_frozen(nranks: int, method: str, repeat: int, root: Path) -> list[tuple[float, float, float, float]]:
    """(all stopped, freeze, capture incl. freeze, whole dump) seconds per fatal dump of ``nranks`` ranks."""
    ranks = FakeRankSet(root / f"frozen-{method}-{nranks}", nranks)
    writer = BundleWriter(root / f"frozen-{method}-{nranks}" / "dumps", keep=repeat + 1, max_bytes=0)
    times = []
    try:
        ranks.start({r: ("python" if r == 1 else "collective") for r in range(nranks)})
        for _ in range(repeat):
            captured = capture_incident(
                ranks.targets(), reason="hang", run_dir=ranks.run_dir, method=method, deadline_s=DEADLINE_S,
                freeze=True,
            )
            res = write_captured(writer, captured, reason="hang", run_id=ranks.run_id)
            frozen = captured.frozen
            if frozen is None or len(frozen.stopped) != nranks or not frozen.settled:
                raise RuntimeError(f"bad freeze: {frozen}")
            if not res.ok or res.diagnosis is None or res.diagnosis.culprit_ranks != [1]:
                raise RuntimeError(f"bad dump: {res}")
            if any(not ev.has_stacks for ev in captured.evidence.ranks.values()):
                raise RuntimeError("a frozen rank has no stacks")
            times.append((frozen.signalled_s, frozen.duration_s, captured.duration_s, res.duration_s))
    finally:
        ranks.close()
    return times


def frozen_table(results: dict[tuple[str, int], list[tuple[float, float, float, float]]]) -> str:
    lines = [
        "| ranks | stacks | all stopped after, median ms | freeze median ms | capture median s (max) "
        "| whole dump median s (max) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for (method, n), times in sorted(results.items()):
        signalled, freeze, capture, whole = zip(*times)
        lines.append(
            f"| {n} | {method} | {statistics.median(signalled) * 1e3:.2f} | {statistics.median(freeze) * 1e3:.1f} "
            f"| {statistics.median(capture):.3f} ({max(capture):.3f}) | {statistics.median(whole):.3f} "
            f"({max(whole):.3f}) |"
        )
    return "\n".join(lines)


def table(results: dict[tuple[str, int], list[float]]) -> str:
    lines = [
        "| ranks | path | median s | max s | goal met (<= 1 s) |",
        "|---:|---|---:|---:|---|",
    ]
    for (method, n), times in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        med, worst = statistics.median(times), max(times)
        lines.append(f"| {n} | {method} | {med:.3f} | {worst:.3f} | {'yes' if worst <= GOAL_S else 'no'} |")
    return "\n".join(lines)


def write_docs(body: str, section: str = SECTION) -> None:
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    start = text.find(section + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        nxt = text.find("\n## ", start + len(section))
        text = text[:start] + body + (text[nxt + 1 :] if nxt >= 0 else "")
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    DOCS.write_text(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--freeze", action="store_true", help="measure freeze, then dump (the fatal path)")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # quiet: warnings+ only
    counts = [int(x) for x in args.ranks.split(",")]
    methods = [m for m in METHODS if m != "py-spy" or find_pyspy() is not None]
    if args.freeze:
        return main_frozen(args, counts, methods)
    results: dict[tuple[str, int], list[float]] = {}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-dumps-") as tmp:
        for method in methods:
            for n in counts:
                results[(method, n)] = run_one(n, method, args.repeat, Path(tmp))
                print(f"{method:13s} {n} ranks: {[round(t, 3) for t in results[(method, n)]]}", flush=True)
    out = table(results)
    print(out)
    if args.write_docs:
        cmd = f".venv/bin/python bench/bench_dumps.py --repeat {args.repeat} --ranks {args.ranks} --write-docs"
        body = (
            f"{SECTION}\n\n"
            "Wall time of one full incident dump (`dumps.incident.write_incident`: /proc and heartbeat of\n"
            "every rank, Python stacks of every rank in parallel, flight-recorder collection, verdict,\n"
            "atomic bundle write). Rank 1 is stuck in a Python function, the others wait in a\n"
            "\"collective\" (torch-free fake ranks). No previous CPU sample is passed, so each dump also\n"
            "spends the minimum 0.1 s CPU-measurement window.\n\n"
            f"Command: `{cmd}`\n\n"
            f"Machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
            f"{args.repeat} dumps per row, 1-minute load average {load:.1f} at the start (the machine is\n"
            f"shared); measured {time.strftime('%Y-%m-%d')}. Figures are `IncidentResult.duration_s`.\n\n"
            f"{out}\n"
        )
        write_docs(body)
        print(f"wrote {DOCS}")
    return 0


def main_frozen(args, counts: list[int], methods: list[str]) -> int:
    results: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-freeze-") as tmp:
        for method in methods:
            for n in counts:
                results[(method, n)] = run_frozen(n, method, args.repeat, Path(tmp))
                print(f"{method:13s} {n} ranks: {[tuple(round(x, 4) for x in t) for t in results[(method, n)]]}",
                      flush=True)
    out = frozen_table(results)
    print(out)
    if args.write_docs:
        cmd = f".venv/bin/python bench/bench_dumps.py --freeze --repeat {args.repeat} --ranks {args.ranks} --write-docs"
        body = (
            f"{FREEZE_SECTION}\n\n"
            "The fatal path (hard hang, enforced divergence): `dumps.incident.capture_incident(freeze=True)`\n"
            "reads every rank's state, SIGSTOPs every rank (**all stopped after**), reads the rest of /proc and\n"
            "waits until each reads stopped (**freeze**),\n"
            "takes the stacks of the frozen ranks (py-spy `--nonblocking`; with the faulthandler fallback each\n"
            "rank is resumed only for its own capture), resumes them and reads their flight recorders\n"
            "(**capture**: all the main thread waits for, at most `--dump-timeout`, before the teardown);\n"
            "then the verdict and the atomic bundle write (**whole dump**, which may finish after the\n"
            "teardown). Rank 1 is stuck in a Python function, the others wait in a \"collective\"\n"
            "(torch-free fake ranks); no previous CPU sample, and none is measured across a freeze.\n\n"
            f"Command: `{cmd}`\n\n"
            f"Machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
            f"{args.repeat} dumps per row, 1-minute load average {load:.1f} at the start (the machine is\n"
            f"shared); measured {time.strftime('%Y-%m-%d')}. Figures are `Frozen.signalled_s`,\n"
            "`Frozen.duration_s`, `Captured.duration_s` and `IncidentResult.duration_s`.\n\n"
            f"{out}\n"
        )
        write_docs(body, FREEZE_SECTION)
        print(f"wrote {DOCS}")
    return 0


if __name__ == "__main__":
    # py-spy path must really be py-spy: do not let a stray setting turn it off
    if os.environ.get(ENV_PYSPY):
        print(f"note: ${ENV_PYSPY}={os.environ[ENV_PYSPY]}", file=sys.stderr)
    sys.exit(main())
