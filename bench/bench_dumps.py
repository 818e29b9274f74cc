"""Issue 5/11 benchmark: wall time of an incident dump of real torch ranks, py-spy and fallback paths.

    .venv/bin/python -m bench.bench_dumps [--repeat 10] [--ranks 2,4,8] [--quick] [--update-docs [FILE]]

The ranks are real torch.distributed programs (``bench/dump_rank.py``, gloo)
with what a supervised rank has: the zero-code hook on PYTHONPATH (heartbeats
from their collectives, torch's flight recorder and its worker server, the
stack signal), ``OMP_NUM_THREADS=1`` as ``supervise serve`` gives them, and
so torch's and gloo's own threads (the count is measured and shown).  Rank 1
is stuck in a Python function; every other rank blocks inside a gloo
all_reduce waiting for it.  One set of ranks per rank count serves every
dump of that count.

1. **Dumps** (the soft path, ``dumps.incident.write_incident``): /proc and
   heartbeat of every rank, stacks of every rank in parallel, flight-recorder
   collection over the ranks' worker sockets, the verdict, the bundle written
   atomically.  Goal (issue 5): <= 1 s for 8 ranks.
2. **Freeze, then dump** (the fatal path, ``capture_incident(freeze=True)``):
   reads every rank's state, SIGSTOPs them all, waits until each reads
   stopped, takes the stacks of the frozen ranks, resumes them and reads
   their flight recorders (the capture, all the teardown waits for); then
   ``write_captured`` writes the bundle.

Every dump must name rank 1 as the culprit; every frozen rank must have stacks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "dumps"))

import structlog  # noqa: E402
from dumps_fakes import FakeRankSet  # noqa: E402

from bench._docs import Stamp, add_common_args, replace_section  # noqa: E402
from tp_supervise.dumps.bundle import BundleWriter  # noqa: E402
from tp_supervise.dumps.capture import ENV_PYSPY, MIN_CPU_WINDOW_S, find_pyspy  # noqa: E402
from tp_supervise.dumps.incident import capture_incident, write_captured, write_incident  # noqa: E402
from tp_supervise.supervisor.processes.spawn import HOOK_DIR  # noqa: E402
from tp_supervise.supervisor.rank import flight as rank_flight  # noqa: E402
from tp_supervise.supervisor.rank.net import free_port  # noqa: E402

MODULE = "bench.bench_dumps"
GOAL_S = 1.0
DEADLINE_S = 5.0
START_TIMEOUT_S = 300.0
SECTION = "## Dumps"
FREEZE_SECTION = "## Freeze, then dump"
METHODS = ("py-spy", "faulthandler")
RANK = ROOT / "bench" / "dump_rank.py"
CULPRIT = 1


def start_ranks(root: Path, n: int) -> FakeRankSet:
    """``n`` real gloo ranks, parked: rank 1 in a Python function, the others inside all_reduce #4."""
    import subprocess

    ranks = FakeRankSet(root, n)
    port = free_port()
    for r in range(n):
        env = ranks.env(r)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HOOK_DIR), env.get("PYTHONPATH", "")) if p)
        env.update(rank_flight.rank_env(ranks.run_dir, r, environ=env))
        env.setdefault("OMP_NUM_THREADS", "1")  # what supervise serve gives each of several ranks
        ranks.procs[r] = subprocess.Popen(
            [sys.executable, str(RANK), str(r), str(n), str(port)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        )
    try:
        ranks.wait_parked(START_TIMEOUT_S)
        deadline = time.monotonic() + 30
        while not all(ranks.segment.read(r).in_collective for r in range(n) if r != CULPRIT):
            if time.monotonic() > deadline:
                raise TimeoutError("the ranks did not all enter the collective")
            time.sleep(0.02)
    except BaseException:
        ranks.close()
        raise
    return ranks


def threads(ranks: FakeRankSet) -> list[int]:
    return [len(os.listdir(f"/proc/{p.pid}/task")) for p in ranks.procs.values()]


def _check_flight(path: Path | None, n: int) -> None:
    """Every rank's flight-recorder trace is in the bundle: the collection over the worker sockets ran."""
    got = sorted(x.name for x in (path / "fr").iterdir()) if path is not None and (path / "fr").is_dir() else []
    if got != [f"rank-{r}" for r in range(n)]:
        raise RuntimeError(f"flight-recorder traces in the bundle: {got}, want all {n} ranks")


def dump_once(ranks: FakeRankSet, writer: BundleWriter, method: str) -> float:
    res = write_incident(writer, reason="hang", run_id=ranks.run_id, targets=ranks.targets(), run_dir=ranks.run_dir,
                         method=method, deadline_s=DEADLINE_S)
    if not res.ok or res.diagnosis is None or res.diagnosis.culprit_ranks != [CULPRIT]:
        raise RuntimeError(f"bad dump: {res}")
    _check_flight(res.path, len(ranks.procs))
    return res.duration_s


def frozen_once(ranks: FakeRankSet, writer: BundleWriter, method: str) -> tuple[float, float, float, float]:
    """(all stopped, freeze, capture incl. freeze, whole dump) seconds of one fatal dump."""
    captured = capture_incident(ranks.targets(), reason="hang", run_dir=ranks.run_dir, method=method,
                                deadline_s=DEADLINE_S, freeze=True)
    res = write_captured(writer, captured, reason="hang", run_id=ranks.run_id)
    frozen = captured.frozen
    if frozen is None or len(frozen.stopped) != len(ranks.procs) or not frozen.settled:
        raise RuntimeError(f"bad freeze: {frozen}")
    if not res.ok or res.diagnosis is None or res.diagnosis.culprit_ranks != [CULPRIT]:
        raise RuntimeError(f"bad dump: {res}")
    if any(not ev.has_stacks for ev in captured.evidence.ranks.values()):
        raise RuntimeError("a frozen rank has no stacks")
    _check_flight(res.path, len(ranks.procs))
    return frozen.signalled_s, frozen.duration_s, captured.duration_s, res.duration_s


def table(results: dict[tuple[str, int], list[float]]) -> str:
    lines = [
        "| ranks | stacks | median s | max s | goal met (<= 1 s) |",
        "|---:|---|---:|---:|---|",
    ]
    for (method, n), times in sorted(results.items()):
        med, worst = statistics.median(times), max(times)
        lines.append(f"| {n} | {method} | {med:.3f} | {worst:.3f} | {'yes' if worst <= GOAL_S else 'no'} |")
    return "\n".join(lines)


def frozen_table(results: dict[tuple[str, int], list[tuple[float, float, float, float]]]) -> str:
    lines = [
        "| ranks | stacks | all stopped after, median ms | freeze median ms | capture median s (max) "
        "| whole dump median s (max) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for (method, n), times in sorted(results.items()):
        signalled, freeze, capture, whole = zip(*times, strict=True)
        lines.append(
            f"| {n} | {method} | {statistics.median(signalled) * 1e3:.2f} | {statistics.median(freeze) * 1e3:.1f} "
            f"| {statistics.median(capture):.3f} ({max(capture):.3f}) | {statistics.median(whole):.3f} "
            f"({max(whole):.3f}) |"
        )
    return "\n".join(lines)


def _ranks_text(counts: list[int], nthreads: dict[int, list[int]]) -> str:
    return "; ".join(f"{n} ranks: {min(t)}-{max(t)} threads each" if min(t) != max(t) else f"{n} ranks: {t[0]} threads each"
                     for n, t in sorted(nthreads.items()) if n in counts)


def dumps_section(stamp: Stamp, repeat: int, counts: list[int], nthreads: dict[int, list[int]], out: str,
                  skipped: str) -> str:
    return f"""{SECTION}

{stamp.text()}

Wall time of one full incident dump (`dumps.incident.write_incident`: /proc and heartbeat of every rank,
Python stacks of every rank in parallel, flight-recorder collection over the ranks' worker sockets, verdict,
atomic bundle write) of real torch ranks (`bench/dump_rank.py`: gloo, the zero-code hook, torch's flight
recorder, `OMP_NUM_THREADS=1` as `supervise serve` gives; threads per rank, counted in /proc:
{_ranks_text(counts, nthreads)}). Rank 1 is stuck in a Python function, the others block inside a gloo
all_reduce waiting for it; every dump names rank 1. No previous CPU sample is passed, so each dump also
spends the minimum {MIN_CPU_WINDOW_S:g} s CPU-measurement window. Dumps per row: {repeat}; figures are
`IncidentResult.duration_s`; every bundle held every rank's flight-recorder trace.{skipped}

{out}
"""


def freeze_section(stamp: Stamp, repeat: int, counts: list[int], nthreads: dict[int, list[int]], out: str,
                   skipped: str) -> str:
    return f"""{FREEZE_SECTION}

{stamp.text()}

The fatal path (hard hang, enforced divergence): `dumps.incident.capture_incident(freeze=True)` reads every
rank's state, SIGSTOPs every rank (**all stopped after**), reads the rest of /proc and waits until each
reads stopped (**freeze**), takes the stacks of the frozen ranks (py-spy `--nonblocking`; with the
faulthandler fallback each rank is resumed only for its own capture), resumes them and reads their flight
recorders (**capture**: all the main thread waits for, at most `--dump-timeout`, before the teardown); then
the verdict and the atomic bundle write (**whole dump**, which may finish after the teardown). The same
real torch ranks as "Dumps" ({_ranks_text(counts, nthreads)}): rank 1 stuck in a Python function, the
others inside a gloo all_reduce; no previous CPU sample, and none is measured across a freeze. Dumps per
row: {repeat}; figures are `Frozen.signalled_s`, `Frozen.duration_s`, `Captured.duration_s` and
`IncidentResult.duration_s`; every frozen rank had stacks.{skipped}

{out}
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=10, help="dumps per row")
    p.add_argument("--ranks", default="2,4,8", help="rank counts, comma-separated")
    add_common_args(p, "2 ranks, one dump per row")
    args = p.parse_args(argv)
    if args.quick:
        args.repeat, args.ranks = 1, "2"
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # quiet: errors only
    stamp = Stamp.begin(MODULE, argv)
    counts = [int(x) for x in args.ranks.split(",")]
    methods = [m for m in METHODS if m != "py-spy" or find_pyspy() is not None]
    skipped = "" if "py-spy" in methods else " py-spy is not installed here: its rows are missing."
    plain: dict[tuple[str, int], list[float]] = {}
    frozen: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    nthreads: dict[int, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-dumps-") as tmp:
        for n in counts:
            t0 = time.monotonic()
            ranks = start_ranks(Path(tmp) / f"ranks-{n}", n)
            try:
                nthreads[n] = threads(ranks)
                print(f"{n} ranks parked in {time.monotonic() - t0:.1f} s, threads {nthreads[n]}", flush=True)
                for method in methods:
                    writer = BundleWriter(Path(tmp) / f"dumps-{method}-{n}", keep=2, max_bytes=0)
                    plain[(method, n)] = [dump_once(ranks, writer, method) for _ in range(args.repeat)]
                    frozen[(method, n)] = [frozen_once(ranks, writer, method) for _ in range(args.repeat)]
                    print(f"{method:13s} {n} ranks: dump {[round(t, 3) for t in plain[(method, n)]]}, freeze "
                          f"{[tuple(round(x, 4) for x in t) for t in frozen[(method, n)]]}", flush=True)
            finally:
                ranks.close()
    one = dumps_section(stamp, args.repeat, counts, nthreads, table(plain), skipped)
    two = freeze_section(stamp, args.repeat, counts, nthreads, frozen_table(frozen), skipped)
    print(one)
    print(two)
    if args.update_docs:
        replace_section(args.update_docs, SECTION, one)
        replace_section(args.update_docs, FREEZE_SECTION, two)
    return 0


if __name__ == "__main__":
    # the py-spy path must really be py-spy: do not let a stray setting turn it off
    if os.environ.get(ENV_PYSPY):
        print(f"note: ${ENV_PYSPY}={os.environ[ENV_PYSPY]}", file=sys.stderr)
    sys.exit(main())
