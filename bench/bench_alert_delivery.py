"""Issue 13 acceptance: with the shipped Prometheus config and default metrics flags, a hard hang is seen.

    .venv/bin/python -m bench.bench_alert_delivery [--runs 10] [--control-runs 3] [--quick] [--update-docs [FILE]]

Each run is independent: a fresh real Prometheus (Debian's ``prometheus``)
loads docs/prometheus/prometheus.yml and alerts.yml unchanged (5 s scrapes
of 127.0.0.1:9180, 5 s evaluations), then ``supervise serve`` runs with the
default metrics flags (``--metrics-addr 127.0.0.1:9180``, the default linger
after a fault) and two fake ranks that SIGSTOP themselves inside a step after
running longer than one scrape interval, ``--hard-timeout 3``: the supervisor exits 81.  A run counts as seen when
Prometheus stored ``supervise_hangs_total{kind="hard"} >= 1`` from that run,
and as alerting when the ``TPSuperviseHang`` rule's own expression (read
from alerts.yml) is true at the supervisor's exit (evaluated there through
the query API).  The control runs add ``--metrics-linger 0`` (the old
default): they show what the check catches.  Prints one line per run and the
section; exit 1 if a run with the defaults was missed (or a control run did
not exit 81), 2 without Prometheus.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from bench._docs import Stamp, add_common_args, replace_section

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Alert delivery with defaults (issue 13 acceptance)"
MODULE = "bench.bench_alert_delivery"
PROM_DIR = ROOT / "docs" / "prometheus"
FAKE_RANK = ROOT / "tests" / "fakes" / "rank.py"
METRICS_PORT = 9180  # the default --metrics-addr, which the shipped prometheus.yml scrapes
RUN_LIMIT_S = 120.0
PORT_WAIT_S = 60.0
# The ranks run this long before they stop: longer than one scrape interval, so Prometheus has scraped the
# live run (the default linger after a fault waits for a scraper that exists: docs/metrics.md).
RUN_BEFORE_FAULT_S = 6.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hang_expr() -> str:
    rules = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "TPSuperviseHang":
                return rule["expr"]
    raise SystemExit("TPSuperviseHang is not in docs/prometheus/alerts.yml")


def query(base: str, expr: str, at: float) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
    with urllib.request.urlopen(url, timeout=10) as resp:
        doc = json.loads(resp.read())
    return doc["data"]["result"] if doc.get("status") == "success" else []


def start_prometheus(work: Path) -> tuple[subprocess.Popen, str]:
    conf = work / "prom"
    conf.mkdir()
    for name in ("prometheus.yml", "alerts.yml"):
        shutil.copy(PROM_DIR / name, conf / name)  # unchanged
    port = free_port()
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={conf / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("prometheus did not become ready")


def scrape_interval_s() -> float:
    """The shipped config's global scrape interval, in seconds."""
    text = str(yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())["global"]["scrape_interval"])
    units = {"ms": 0.001, "s": 1.0, "m": 60.0}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * units[unit]
    raise SystemExit(f"cannot read the scrape interval {text!r} of docs/prometheus/prometheus.yml")


def wait_port_free(port: int, limit_s: float) -> None:
    """The default --metrics-addr is one fixed port: wait while another process on this host holds it."""
    import socket

    deadline = time.monotonic() + limit_s
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"127.0.0.1:{port} stayed in use for {limit_s:.0f} s: another process holds "
                                     "the default metrics port") from None
        time.sleep(0.5)


def one_run(work: Path, expr: str, extra: list[str]) -> dict:
    wait_port_free(METRICS_PORT, PORT_WAIT_S)
    prom, base = start_prometheus(work)
    try:
        time.sleep(1.0)
        started = time.time()
        cmd = [sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--nproc-per-node", "2",
               "--hard-timeout", "3", "--soft-timeout", "1.5", "--kill-grace", "2", "--dump-dir", str(work / "dumps"),
               "--log-format", "json", *extra, "--", sys.executable, str(FAKE_RANK), "--all", "stop", "--steps", "20",
               "--delay", f"{RUN_BEFORE_FAULT_S:g}"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_LIMIT_S, cwd=work)
        ended = time.time()
        if run.returncode != 81:
            print(f"supervise exited {run.returncode}:\n{run.stderr[-3000:]}", file=sys.stderr)
        hung = [json.loads(line) for line in run.stderr.splitlines()
                if line.startswith("{") and '"event": "hang"' in line]
        fault_at = ended
        if hung:
            from datetime import datetime

            fault_at = datetime.fromisoformat(hung[0]["timestamp"].replace("Z", "+00:00")).timestamp()
        time.sleep(6.0)  # one more evaluation round after the exit
        window = max(1, int(ended - started) + 2)
        seen = query(base, f'max_over_time(supervise_hangs_total{{kind="hard"}}[{window}s]) >= 1', ended)
        alerting = query(base, expr, ended)
        return {"exit": run.returncode, "seen": bool(seen), "alert_expr_true": bool(alerting),
                "linger_s": round(ended - fault_at, 1)}
    finally:
        prom.terminate()
        try:
            prom.wait(15)
        except subprocess.TimeoutExpired:
            prom.kill()


def summary(results: list[dict]) -> tuple[int, int, int]:
    return (sum(r["seen"] for r in results), sum(r["alert_expr_true"] for r in results),
            sum(r["exit"] == 81 for r in results))


def section(stamp: Stamp, defaults: list[dict], control: list[dict]) -> str:
    rows = []
    for flags, results in (("defaults (linger after a fault)", defaults), ("`--metrics-linger 0` (control)", control)):
        if not results:
            rows.append(f"| {flags} | not run | | | |")
            continue
        seen, alerting, exits = summary(results)
        n = len(results)
        lingers = [r["linger_s"] for r in results]
        rows.append(f"| {flags} | {seen}/{n} | {alerting}/{n} | {exits}/{n} | {min(lingers):.1f}-{max(lingers):.1f} s |")
    return f"""{HEADING}

{stamp.text()}

Each run starts a fresh real Prometheus loading `docs/prometheus/prometheus.yml` and `alerts.yml` unchanged
({scrape_interval_s():g} s scrapes of 127.0.0.1:{METRICS_PORT}), then `supervise serve --hard-timeout 3` with the default
metrics flags and two fake ranks that run {RUN_BEFORE_FAULT_S:g} s (longer than one scrape interval of
{scrape_interval_s():g} s: the default linger after a fault waits for a scraper that exists) and then stop
inside a step; the supervisor exits 81. A run counts when
Prometheus stored `supervise_hangs_total{{kind="hard"}} >= 1` from it, and when the `TPSuperviseHang`
expression (read from alerts.yml) is true at the supervisor's exit. The control runs add
`--metrics-linger 0`, the old default: they show what the check catches.

| flags | counter seen | alert expression true | exit 81 | exit after the verdict |
|---|---|---|---|---|
{chr(10).join(rows)}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="runs with the default flags")
    ap.add_argument("--control-runs", type=int, default=3, help="control runs with --metrics-linger 0")
    ap.add_argument("--control", action="store_true", help="only the control runs (--control-runs of them)")
    add_common_args(ap, "one run with the default flags, no control run")
    args = ap.parse_args(argv)
    if shutil.which("prometheus") is None:
        print("prometheus is not installed (apt-get install prometheus)", file=sys.stderr)
        return 2
    if args.quick:
        args.runs, args.control_runs = 1, 0
    stamp = Stamp.begin(MODULE, argv)
    expr = hang_expr()
    results: dict[bool, list[dict]] = {False: [], True: []}
    plan = ([False] * (0 if args.control else args.runs)) + [True] * args.control_runs
    for i, control in enumerate(plan):
        with tempfile.TemporaryDirectory(prefix="tp-alert-") as tmp:
            res = one_run(Path(tmp), expr, ["--metrics-linger", "0"] if control else [])
        results[control].append(res)
        print(f"run {i + 1}{' (control)' if control else ''}: exit {res['exit']}, counter seen by Prometheus: "
              f"{res['seen']}, TPSuperviseHang expression true: {res['alert_expr_true']}, exited "
              f"{res['linger_s']} s after the hang verdict", flush=True)
    text = section(stamp, results[False], results[True])
    print(text)
    if args.update_docs:
        replace_section(args.update_docs, HEADING, text)
    seen, alerting, exits = summary(results[False])
    n = len(results[False])
    return 0 if seen == alerting == exits == n and all(r["exit"] == 81 for r in results[True]) else 1


if __name__ == "__main__":
    sys.exit(main())
