"""Issue 12 benchmark: multi-node fault propagation, handshake time and store load, on loopback.

    .venv/bin/python -m bench.bench_multinode [--nodes 64] [--ranks 8] [--pair-rounds 5]
                                              [--skip-pair] [--skip-sim] [--update-docs docs/benchmarks.md]

Real ``supervise serve`` processes, one per simulated node, all on this host
(``--nnodes N --node-rank i``, one store on node 0, explicit ports), each with
``--ranks`` fake ranks that are ``sleep`` processes (no Python, ~1 MiB each:
the supervisors are what is measured).  Measured:

* **peer-loss propagation**: one rank of one node (the last one) is SIGKILLed
  at t0; for every *other* node, the time until the last of its rank processes
  is gone (a pidfd per rank, polled here: the kernel says when each process
  ended).  Node k itself exits 80; every other node must tear down and exit 84.
* **handshake**: from each supervisor's ``joining the nodes`` log line to its
  ``every node joined`` (includes waiting for slower nodes), and for the group,
  from the last node's ``joining`` to the last ``joined`` (the protocol alone,
  once everyone is there).
* **store operations**: each node's ``supervise_store_latency_seconds_count``
  scraped twice ``SCRAPE_WINDOW_S`` apart: calls per second into node 0's store
  (summed over nodes) and the p99 call latency across nodes.
* **memory**: RSS of each supervisor once running.

``pair``: 2 nodes, several faults (a new group per fault).  ``sim``: N nodes,
one fault (the group is gone after it).  Everything started here is killed on
every exit path (each supervisor leads its own session; its ranks die with it).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import random
import socket

import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench._docs import replace_section

HEADING = "## Multi-node: fault propagation, handshake, store load"
ROOT = Path(__file__).resolve().parent.parent
SUPERVISE = [sys.executable, "-m", "tp_supervise.supervisor.cli"]
RENDEZVOUS_TIMEOUT_S = 600.0
JOIN_LIMIT_S = 900.0
PROPAGATION_LIMIT_S = 60.0
EXIT_LIMIT_S = 120.0
SCRAPE_WINDOW_S = 5.0
SETTLE_S = 2.0
KILL_GRACE_S = 2.0
STOP_WAIT_S = 15.0
POLL_MS = 50
PORTS_FROM = 20000


@dataclass
class Node:
    rank: int
    proc: subprocess.Popen
    log: Path
    metrics_port: int
    rank_pids: list[int] = field(default_factory=list)


def ports_below_ephemeral(count: int) -> list[int]:
    """Free ports under the kernel's ephemeral range: 64 store clients' own ephemeral ports cannot take them
    between this choice and the supervisors' bind (free_port() picks from that range)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    out, port = [], random.randrange(PORTS_FROM, low - 4 * count)
    while len(out) < count and port < low:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                out.append(port)
            except OSError:
                pass
        port += 1
    if len(out) < count:
        raise RuntimeError(f"not {count} free ports under {low}")
    return out


def start_group(nnodes: int, ranks: int, workdir: Path) -> list[Node]:
    port, store_port, *metrics_ports = ports_below_ephemeral(nnodes + 2)
    nodes = []
    for i in range(nnodes):
        mport = metrics_ports[i]
        log = workdir / f"node-{i}.log"
        cmd = [*SUPERVISE, "serve", "--nnodes", str(nnodes), "--node-rank", str(i), "--master-port", str(port),
               "--store-port", str(store_port), "--nproc-per-node", str(ranks), "--no-hook",
               "--rendezvous-timeout", str(RENDEZVOUS_TIMEOUT_S), "--kill-grace", str(KILL_GRACE_S),
               "--stack-method", "none", "--startup-timeout", "3600", "--metrics-addr", f"127.0.0.1:{mport}", "--metrics-linger", "0",
               "--dump-dir", str(workdir / f"dumps-{i}"), "--log-format", "json", "--", "sleep", "infinity"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=workdir)
        nodes.append(Node(i, proc, log, mport))
    return nodes


def stop_group(nodes: list[Node]) -> None:
    """SIGTERM every supervisor's session, then SIGKILL what is left; never raises."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for n in nodes:
            if n.proc.poll() is None:
                try:
                    os.killpg(n.proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_WAIT_S
        for n in nodes:
            try:
                n.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for n in nodes:
        for pid in n.rank_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def events(log: Path) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def event_time(evs: list[dict], name: str) -> float | None:
    for ev in evs:
        if ev.get("message", ev.get("event")) == name:
            return datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
    return None


def wait_running(nodes: list[Node], ranks: int) -> None:
    """Every supervisor runs its ranks (``sleep`` children)."""
    deadline = time.monotonic() + JOIN_LIMIT_S
    pending = list(nodes)
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"nodes {[n.rank for n in pending]} never started their ranks")
        for n in list(pending):
            if n.proc.poll() is not None:
                raise RuntimeError(f"node {n.rank} exited {n.proc.returncode} before running: {n.log.read_text()[-2000:]}")
            try:
                kids = [c for c in psutil.Process(n.proc.pid).children() if c.name() == "sleep"]
            except psutil.Error:
                continue
            if len(kids) == ranks:
                n.rank_pids = [c.pid for c in kids]
                pending.remove(n)
        time.sleep(0.5)


def scrape_counts(n: Node) -> tuple[float, dict[float, float]]:
    """(calls so far, cumulative buckets by le) of supervise_store_latency_seconds, all ops."""
    with urllib.request.urlopen(f"http://127.0.0.1:{n.metrics_port}/metrics", timeout=10) as reply:
        body = reply.read().decode()
    count, buckets = 0.0, {}
    for fam in text_string_to_metric_families(body):
        if fam.name != "supervise_store_latency_seconds":
            continue
        for s in fam.samples:
            if s.name.endswith("_count"):
                count += s.value
            elif s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return count, buckets


def quantile_le(q: float, buckets: dict[float, float]) -> float | None:
    """Upper bound of the bucket holding quantile q (cumulative counts)."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    for le, c in items:
        if c >= q * items[-1][1]:
            return le
    return None


def store_load(nodes: list[Node]) -> dict:
    first = {n.rank: scrape_counts(n) for n in nodes}
    t0 = time.monotonic()
    time.sleep(SCRAPE_WINDOW_S)
    second = {n.rank: scrape_counts(n) for n in nodes}
    dt = time.monotonic() - t0
    per_node = [(second[r][0] - first[r][0]) / dt for r in first]
    window = {}
    for r in first:
        for le, c in second[r][1].items():
            window[le] = window.get(le, 0.0) + c - first[r][1].get(le, 0.0)
    return {"ops_per_s_total": sum(per_node), "ops_per_s_per_node_median": statistics.median(per_node),
            "p50_le_s": quantile_le(0.5, window), "p99_le_s": quantile_le(0.99, window)}


def propagate(nodes: list[Node], victim: Node) -> dict[int, float]:
    """SIGKILL one rank of ``victim``; per other node, seconds until its last rank process is gone."""
    fds = {}
    for n in nodes:
        if n is victim:
            continue
        for pid in n.rank_pids:
            try:
                fds[os.pidfd_open(pid)] = n.rank
            except ProcessLookupError:
                fds[-pid] = n.rank  # already gone: counts as 0
    gone_at: dict[int, float] = {}
    poller = select.poll()
    for fd in fds:
        if fd >= 0:
            poller.register(fd, select.POLLIN)
    t0 = time.monotonic()
    os.kill(victim.rank_pids[-1], signal.SIGKILL)
    left = {fd for fd in fds if fd >= 0}
    for fd in set(fds) - left:
        gone_at[fd] = t0
    try:
        while left and time.monotonic() - t0 < PROPAGATION_LIMIT_S:
            for fd, _ev in poller.poll(POLL_MS):
                if fd in left:
                    gone_at[fd] = time.monotonic()
                    left.discard(fd)
                    poller.unregister(fd)
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
    last: dict[int, float] = {}
    for fd, node in fds.items():
        if fd in gone_at:
            last[node] = max(last.get(node, 0.0), gone_at[fd] - t0)
        else:
            last[node] = float("inf")
    return last


def handshake_times(nodes: list[Node]) -> dict:
    joining, joined = [], []
    for n in nodes:
        evs = events(n.log)
        a, b = event_time(evs, "joining the nodes"), event_time(evs, "every node joined")
        if a is not None and b is not None:
            joining.append(a)
            joined.append(b)
    if not joined:
        return {}
    per_node = [b - a for a, b in zip(joining, joined)]
    return {"group_s": max(joined) - max(joining), "per_node_median_s": statistics.median(per_node),
            "per_node_max_s": max(per_node), "start_spread_s": max(joining) - min(joining)}


def exit_codes(nodes: list[Node]) -> dict[int, int]:
    codes = {}
    deadline = time.monotonic() + EXIT_LIMIT_S
    for n in nodes:
        try:
            n.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        rc = n.proc.poll()
        codes[rc] = codes.get(rc, 0) + 1
    return codes


def one_group(nnodes: int, ranks: int, measure_load: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-multinode-") as tmp:
        nodes = start_group(nnodes, ranks, Path(tmp))
        try:
            t_start = time.monotonic()
            try:
                wait_running(nodes, ranks)
            except RuntimeError as exc:  # the group fell apart before the fault: say how
                codes = exit_codes(nodes)
                lost = sum(1 for n in nodes for ev in events(n.log) if ev.get("message") == "peer node lost")
                return {"nodes": nnodes, "ranks": ranks, "failed": str(exc)[:300], "node_lost_events": lost,
                        "exit_codes": {str(k): v for k, v in codes.items()}, "loadavg": os.getloadavg()}
            running_s = time.monotonic() - t_start
            time.sleep(SETTLE_S)
            rss = [psutil.Process(n.proc.pid).memory_info().rss for n in nodes]
            load = store_load(nodes) if measure_load else {}
            lost_before = [n.rank for n in nodes if n.proc.poll() is not None]
            prop = propagate(nodes, nodes[-1])
            codes = exit_codes(nodes)
            return {"nodes": nnodes, "ranks": ranks, "all_running_s": running_s, "handshake": handshake_times(nodes),
                    "propagation_s": sorted(prop.values()), "exit_codes": {str(k): v for k, v in codes.items()},
                    "exited_before_fault": lost_before, "rss_mib_median": statistics.median(rss) / 2**20,
                    "rss_mib_total": sum(rss) / 2**20, "store": load, "loadavg": os.getloadavg()}
        finally:
            stop_group(nodes)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def render(pair: list[dict], sim: dict | None) -> list[str]:
    lines = []
    if pair:
        prop = [p for r in pair for p in r["propagation_s"]]
        hs = [r["handshake"]["group_s"] for r in pair if r["handshake"]]
        lines.append(f"- **2 nodes x {pair[0]['ranks']} ranks, {len(pair)} faults**: peer-loss propagation (rank "
                     f"SIGKILLed on node 1 -> last rank process gone on node 0) median {statistics.median(prop)*1e3:.0f} "
                     f"ms, max {max(prop)*1e3:.0f} ms; handshake (last node in -> all joined) median "
                     f"{statistics.median(hs)*1e3:.0f} ms; exit codes {pair[-1]['exit_codes']}; supervisor RSS "
                     f"{pair[0]['rss_mib_median']:.0f} MiB; store {pair[0]['store'].get('ops_per_s_total', 0):.0f} "
                     "calls/s, p99 <= "
                     f"{(pair[0]['store'].get('p99_le_s') or 0)*1e3:g} ms.")
    if sim and "failed" in sim:
        lines.append(f"- **{sim['nodes']} nodes x {sim['ranks']} ranks: the group fell apart before the fault**: "
                     f"{sim['failed'][:120]}...; `peer node lost` events: {sim['node_lost_events']}; exit codes "
                     f"{sim['exit_codes']}; load average {sim['loadavg'][0]:.0f}.")
    elif sim:
        prop = sim["propagation_s"]
        finite = [p for p in prop if p != float("inf")]
        hs = sim["handshake"]
        st = sim["store"]
        lines.append(
            f"- **{sim['nodes']} nodes x {sim['ranks']} ranks, one fault** (rank SIGKILLed on node {sim['nodes']-1}; "
            f"{len(prop)} other nodes): propagation p50 {pct(finite, 0.5)*1e3:.0f} ms, p99 {pct(finite, 0.99)*1e3:.0f} "
            f"ms, max {max(finite)*1e3:.0f} ms ({len(prop) - len(finite)} nodes not down within "
            f"{PROPAGATION_LIMIT_S:.0f} s); exit codes {sim['exit_codes']}; nodes gone before the fault: "
            f"{sim['exited_before_fault'] or 'none'}.")
        if hs:
            lines.append(f"  Handshake: last node in -> all joined {hs['group_s']*1e3:.0f} ms; per node (incl. "
                         f"waiting for the others) median {hs['per_node_median_s']:.1f} s, max "
                         f"{hs['per_node_max_s']:.1f} s; the supervisors' start-up spread {hs['start_spread_s']:.1f} s "
                         f"(importing torch {sim['nodes']} times on this host); all ranks running after "
                         f"{sim['all_running_s']:.0f} s.")
        lines.append(f"  Store: {st.get('ops_per_s_total', 0):.0f} calls/s into node 0's TCPStore (median "
                     f"{st.get('ops_per_s_per_node_median', 0):.0f} per node), call latency p50 <= "
                     f"{(st.get('p50_le_s') or 0)*1e3:g} ms, p99 <= {(st.get('p99_le_s') or 0)*1e3:g} ms (bucket "
                     f"bounds). Memory: supervisor RSS median {sim['rss_mib_median']:.0f} MiB, "
                     f"{sim['rss_mib_total']/1024:.1f} GiB for all {sim['nodes']}. Load average during the run "
                     f"{sim['loadavg'][0]:.1f}.")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--pair-rounds", type=int, default=5)
    parser.add_argument("--skip-pair", action="store_true")
    parser.add_argument("--skip-sim", action="store_true")
    parser.add_argument("--update-docs", type=Path)
    args = parser.parse_args()

    def interrupted(_signum, _frame):  # SIGTERM: unwind through every finally (stop_group)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    pair = []
    for _ in range(0 if args.skip_pair else args.pair_rounds):
        pair.append(one_group(2, args.ranks, measure_load=not pair))
        print(json.dumps(pair[-1]), flush=True)
    sim = None if args.skip_sim else one_group(args.nodes, args.ranks, measure_load=True)
    if sim:
        print(json.dumps(sim), flush=True)
    lines = render(pair, sim)
    print("\n".join(lines))
    if args.update_docs:
        cmd = (f".venv/bin/python -m bench.bench_multinode --nodes {args.nodes} --ranks {args.ranks} "
               f"--pair-rounds {args.pair_rounds}" + (" --skip-pair" if args.skip_pair else "")
               + (" --skip-sim" if args.skip_sim else ""))
        replace_section(args.update_docs, HEADING, "\n".join([
            HEADING, "",
            f"`{cmd}`: real `supervise serve` processes on loopback, one per simulated node, each with "
            f"`--nproc-per-node {args.ranks}` fake ranks (`sleep` processes), `--stack-method none`, "
            "`--kill-grace 2`; a rank of the last node is SIGKILLed and the time until every other node's last "
            f"rank process is gone is read from pidfds. {os.cpu_count()} CPU cores shared with other work "
            "(load average in the figures).", "", *lines, ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
