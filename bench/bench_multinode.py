"""Issue 19 benchmark: multi-node fault propagation, handshake, node-loss detection, store load and memory,
this tree and the tree before issue 19's transport side by side, in one run.

    .venv/bin/python -m bench.bench_multinode [--sizes 2,8,24,64 | --nodes N] [--ranks 8]
                                              [--before REV | --no-before] [--update-docs docs/benchmarks.md]
    .venv/bin/python -m bench.bench_multinode --quick          # 2 nodes, 1 fault, this tree: a few seconds
    .venv/bin/python -m bench.bench_multinode --soak 10 [--update-docs docs/benchmarks.md]

Real ``supervise serve`` processes, one per simulated node (``--nnodes N
--node-rank i``), each with ``--ranks`` light ranks (bench/light_rank.py: the
rank-side runtime and nothing else, no torch, ~13 MiB each), all on this host
over loopback; the partition and the soak put each node in a network
namespace of its own (tests/netlab.py; needs root, skipped with the reason
otherwise).  "before" is ``git archive REV`` (default ``abe73a5^``, the tree
before the gate/link transport) run by the same code through ``PYTHONPATH``
(its ranks load that tree's rank package).  Measured, per tree:

* **propagation**: one rank of the last node is SIGKILLed at t0; for every
  other node, the time until its supervisor logs ``peer_node_failed`` (its
  JSON log's timestamp, same host clock), and until the last of its rank
  processes is gone (pidfds: the teardown included), at each of ``--sizes``;
* **handshake**: from the last supervisor's start (its ``Popen``) to the last
  ``every_node_joined``, and from the last ``joining_the_nodes`` to it;
* **node loss**: a node's supervisor SIGKILLed (its kernel closes its
  sockets) -> every other node logs ``peer_node_lost``; and a partition (node
  1's bridge port disabled: no FIN, no RST) -> node 0 rules node 1 lost and
  node 1 rules node 0 (the store) lost;
* **store load**: ``supervise_store_latency_seconds`` (the node link's calls)
  scraped twice ``SCRAPE_WINDOW_S`` apart on every node of the first group
  of each size: calls per second per node and the latency buckets;
* **memory and CPU**: RSS and PSS of every supervisor once running (node 0's
  store child on its own line when there is one), of the light ranks, the
  idle CPU of each supervisor over the scrape window; a single-node
  supervisor for reference (does it map libtorch?).

``--soak MINUTES``: a 4-node group in namespaces, nodes 1-3 reaching node 0
through a 200 ms-each-way proxy with 1 % packet loss, light ranks stepping at
10 Hz, for MINUTES; counts ``peer_node_lost`` and every other warning, then
makes one fault and times its propagation through the slow, lossy way.

Everything started here carries an environment mark and is killed on every
exit path (SIGTERM of this benchmark included).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench._docs import replace_section

HEADING = "## Multi-node: fault propagation, node loss, handshake, store load, memory"
SOAK_HEADING = "## Multi-node: false node losses under 200 ms latency and 1 % loss"
ROOT = Path(__file__).resolve().parent.parent
LIGHT_RANK = ROOT / "bench" / "light_rank.py"
BEFORE_REV = "abe73a5^"  # the tree before issue 19's transport (gate, link, store child)
MARK_VAR = "TP_SUPERVISE_BENCH_MARK"
DEFAULT_SIZES = (2, 8, 24, 64)
ROUNDS = {2: 20, 8: 3, 24: 2}  # fresh groups per size (one fault each); any other size: 1
LOSS_ROUNDS = 3  # per victim (node 1, node 0) at 2 nodes
PARTITION_ROUNDS = 3
FALLBACK_FROM = 24  # a first group this big that falls apart: again with a longer node timeout, then fewer ranks
FALLBACK_NODE_TIMEOUT_S = 120.0  # 30 s was not enough at 64 x 8 here: the store behind the gate stalled longer
TOGETHER_NODES, TOGETHER_ROUNDS = 8, 3  # every supervisor started at once (no wait for node 0's gate)
NODE_TIMEOUT_S = 4.0  # docs/multinode.md, both trees' default
JOIN_LIMIT_S = 900.0
EXIT_LIMIT_S = 60.0
LOSS_WATCH_S = NODE_TIMEOUT_S + 16.0  # after a node loss: what has not noticed by then never does
SCRAPE_WINDOW_S = 5.0
SETTLE_S = 2.0  # every node beat a few times before the fault
QUICK_SETTLE_S = 0.5
STOP_WAIT_S = 15.0
POLL_S = 0.05
PORTS_FROM = 20000
SUPERVISOR_PSS_GUESS = 200 << 20  # before anything is measured: torch in every supervisor
RANK_PSS_GUESS = 10 << 20
MEMORY_HEADROOM = 0.75  # a group may take this share of MemAvailable
SOAK_DELAY_S = 0.2
SOAK_LOSS = 0.01
SOAK_NODES = 4
SOAK_RANKS = 2
SOAK_STEPS_PER_S = 10.0


# -- trees ---------------------------------------------------------------------------------------------
@dataclass
class Tree:
    name: str  # "after" / "before"
    label: str  # what it is, for the docs
    pythonpath: str | None  # prepended to PYTHONPATH (the before tree's namespace folder)
    rank_package: str  # the supervisor/rank folder its light ranks load

    def has_flag(self, flag: str) -> bool:
        """Whether this tree's ``supervise serve`` knows ``flag`` (the tree before issue 19 has no --node-timeout)."""
        env = dict(os.environ)
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        out = subprocess.run([sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--help"], env=env,
                             capture_output=True, text=True, timeout=120)
        return flag in out.stdout


def after_tree() -> Tree:
    rev = git("rev-parse", "--short", "HEAD") or "?"
    dirty = [line[3:] for line in (git("status", "--porcelain", "--untracked-files=no") or "").splitlines()
             if line[3:].split("/")[0] in ("supervisor", "engine", "watchdogs", "consensus", "dumps")]
    label = f"this tree (HEAD {rev}" + (f", with uncommitted changes in {', '.join(dirty)}" if dirty else "") + ")"
    return Tree("after", label, None, str(ROOT / "supervisor" / "rank"))


def archived_tree(name: str, rev: str, workdir: Path) -> Tree:
    """``git archive rev`` under workdir, importable as ``tp_supervise.*`` through a folder of links."""
    sha = git("rev-parse", "--short", rev)
    if not sha:
        raise RuntimeError(f"git cannot resolve {rev!r} here (no repository?)")
    tree, ns = workdir / "tree", workdir / "ns" / "tp_supervise"
    tree.mkdir(parents=True)
    ns.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    for pkg in ("supervisor", "engine", "watchdogs", "consensus", "dumps"):
        (ns / pkg).symlink_to(tree / pkg)
    check = subprocess.run([sys.executable, "-c", "import tp_supervise.supervisor.cli as c; print(c.__file__)"],
                           env=dict(os.environ, PYTHONPATH=str(ns.parent)), capture_output=True, text=True)
    if not check.stdout.startswith(str(ns)):
        raise RuntimeError(f"the before tree is not what imports: {check.stdout or check.stderr}")
    return Tree(name, f"{rev} = {sha}", str(ns.parent), str(tree / "supervisor" / "rank"))


def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# -- processes -----------------------------------------------------------------------------------------
@dataclass
class Node:
    rank: int
    proc: subprocess.Popen
    log: Path
    metrics_port: int | None
    spawned: float  # wall clock
    ended: float | None = None  # wall clock, seen by polling
    rank_pids: list[int] = field(default_factory=list)
    _events: list[dict] | None = None

    def poll(self) -> bool:
        if self.ended is None and self.proc.poll() is not None:
            self.ended = time.time()
        return self.ended is not None

    def events(self, fresh: bool = True) -> list[dict]:
        if fresh or self._events is None:
            out = []
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
            self._events = out
        return self._events

    def first(self, name: str, fresh: bool = False) -> dict | None:
        for ev in self.events(fresh):
            if ev.get("event") == name:
                return ev
        return None

    def tail(self, lines: int = 12) -> str:
        text = [line for line in self.log.read_text(errors="replace").splitlines() if "rank_output" not in line]
        return f"--- node {self.rank} (exit {self.proc.poll()}):\n" + "\n".join(text[-lines:])


def stamp(ev: dict) -> float:
    return datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()


@dataclass
class Launch:
    """How the supervisors of one group are started."""

    tree: Tree
    workdir: Path
    mark: str
    ranks: int
    steps_per_s: float = 0.0
    node_timeout: float | None = None  # --node-timeout, where not the default
    lab: object | None = None  # tests.netlab.Lab: node i runs in the lab's namespace i
    extra: tuple[str, ...] = ()  # more `supervise serve` flags
    started: list[Node] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = dict(os.environ, **{MARK_VAR: self.mark, "SUPERVISE_REGISTRY_DIR": str(self.workdir / "registry")})
        if self.tree.pythonpath:
            env["PYTHONPATH"] = self.tree.pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def rank_argv(self) -> list[str]:
        argv = [sys.executable, "-S", str(LIGHT_RANK), "--package", self.tree.rank_package]
        return argv + (["--steps-per-s", f"{self.steps_per_s:g}"] if self.steps_per_s else [])

    def start(self, nnodes: int, tag: str, master_addrs: list[str] | None = None,
              ports: list[int] | None = None, ranks: int | None = None, together: bool = False) -> list[Node]:
        """Node 0 first, the others once its own store client is connected (its store and gate are up), unless
        ``together``: every supervisor at once, as a scheduler starting every pod does.  (Together, this
        tree's gate answers hellos only after node 0's store child imported torch; a node whose hello timed
        out meanwhile retries, and the gate later accepts the abandoned connection from its backlog, reads
        its end and rules that node lost: the group falls apart before any fault.  Measured on its own.)"""
        ranks = self.ranks if ranks is None else ranks
        if ports is None:
            ports = ports_below_ephemeral(2 + (nnodes if self.lab is None else 0))
        port, store_port, *metrics = ports
        nodes = []
        for i in range(nnodes):
            log = self.workdir / f"{tag}-node{i}.log"
            mport = metrics[i] if metrics else 9180  # in a namespace: its own loopback
            argv = [sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--log-format", "json"]
            if nnodes > 1:
                argv += ["--nnodes", str(nnodes), "--node-rank", str(i), "--master-port", str(port),
                         "--store-port", str(store_port), "--rendezvous-timeout", str(JOIN_LIMIT_S)]
                if self.node_timeout:
                    argv += ["--node-timeout", f"{self.node_timeout:g}"]
                if master_addrs:
                    argv += ["--master-addr", master_addrs[i]]
            argv += ["--nproc-per-node", str(ranks), "--no-hook", "--stack-method", "none", "--kill-grace", "2",
                     "--startup-timeout", str(JOIN_LIMIT_S), "--metrics-addr", f"127.0.0.1:{mport}",
                     "--metrics-linger", "0", "--dump-dir", str(self.workdir / f"{tag}-dumps{i}"), *self.extra, "--",
                     *self.rank_argv()]
            if self.lab is not None:
                argv = self.lab.argv_in(i, argv)
            with open(log, "wb") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, cwd=self.workdir, env=self.env())
            nodes.append(Node(i, proc, log, None if self.lab is not None else mport, time.time()))
            self.started.append(nodes[-1])
            if i == 0 and nnodes > 1 and not together:
                wait_store_client(nodes[0], JOIN_LIMIT_S)
        return nodes

    def stop(self) -> None:
        """SIGTERM every supervisor's session, SIGKILL what is left, then every process carrying the mark."""
        nodes = self.started
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
        kill_marked(self.mark)


def marked_pids(mark: str) -> list[int]:
    needle = f"{MARK_VAR}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def kill_marked(mark: str) -> None:
    for pid in marked_pids(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def ports_below_ephemeral(count: int) -> list[int]:
    """Free ports under the kernel's ephemeral range: the many store clients' own ports cannot take them
    between this choice and the supervisors' bind."""
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


class GroupFailed(RuntimeError):
    pass


def wait_store_client(node: Node, limit_s: float) -> None:
    """Node 0's own store client is connected: its store (and, in this tree, the gate in front of it,
    started just before that client) is up.  Read from /proc/<pid>/net/tcp, the process's own network
    namespace, so it works inside a lab too."""
    deadline = time.monotonic() + limit_s
    while not store_client_connected(node.proc.pid):
        if node.poll():
            raise GroupFailed(f"node {node.rank} exited {node.proc.returncode} before its store was up\n{node.tail()}")
        if time.monotonic() > deadline:
            raise GroupFailed(f"node {node.rank}'s store was not up within {limit_s:.0f} s")
        time.sleep(0.1)


def socket_inodes(pid: int) -> set[str]:
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(target[8:-1])
    except OSError:
        pass
    return found


def store_client_connected(pid: int) -> bool:
    """``pid`` holds an established TCP connection to a port that it, or one of its children, listens on."""
    try:
        family = [pid] + [c.pid for c in psutil.Process(pid).children()]
        rows = [line.split() for kind in ("tcp", "tcp6")  # torch's client dials ::ffff:127.0.0.1
                for line in Path(f"/proc/{pid}/net/{kind}").read_text().splitlines()[1:]]
    except (psutil.Error, OSError):
        return False
    inodes = {p: socket_inodes(p) for p in family}
    mine = inodes[pid]
    every = set().union(*inodes.values())
    listening = {row[1].split(":")[1] for row in rows if row[3] == "0A" and row[9] in every}
    return any(row[3] == "01" and row[9] in mine and row[2].split(":")[1] in listening for row in rows)


def wait_ready(nodes: list[Node], limit_s: float = JOIN_LIMIT_S) -> None:
    """Every supervisor logged ``every_rank_is_ready``; its rank pids come from ``rank_started``."""
    deadline = time.monotonic() + limit_s
    pending = list(nodes)
    while pending:
        for n in list(pending):
            if n.poll():
                raise GroupFailed(f"node {n.rank} exited {n.proc.returncode} before its ranks were ready\n{n.tail()}")
            evs = n.events()
            if any(ev.get("event") == "every_rank_is_ready" for ev in evs):
                n.rank_pids = [ev["pid"] for ev in evs if ev.get("event") == "rank_started"]
                pending.remove(n)
        if pending and time.monotonic() > deadline:
            raise GroupFailed(f"nodes {[n.rank for n in pending]} not ready within {limit_s:.0f} s")
        time.sleep(0.25)


def brief(exc: Exception) -> str:
    """The first line of a GroupFailed and the events of the node's log tail, not the whole JSON."""
    head, _, tail = str(exc).partition("\n")
    names = []
    for line in tail.splitlines():
        try:
            ev = json.loads(line)
            names.append(f"{ev.get('event')}: {str(ev.get('message'))[:160]}")
        except ValueError:
            names.append(line[:160])
    return " | ".join([head, *names])


def wait_exits(nodes: list[Node], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not all(n.poll() for n in nodes) and time.monotonic() < deadline:
        time.sleep(POLL_S)


def ranks_gone_after(nodes: list[Node], kill, limit_s: float) -> tuple[float, dict[int, float]]:
    """Run ``kill()`` (returns its wall-clock t0); per node, seconds until its last rank process is gone
    (pidfds, inf if not within ``limit_s``)."""
    fds: dict[int, int] = {}
    for n in nodes:
        for pid in n.rank_pids:
            try:
                fds[os.pidfd_open(pid)] = n.rank
            except ProcessLookupError:
                pass
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    left, gone = set(fds), {}
    t0_mono = time.monotonic()
    t0 = kill()
    try:
        while left and time.monotonic() - t0_mono < limit_s:
            for fd, _ev in poller.poll(int(POLL_S * 1000)):
                if fd in left:
                    gone[fd] = time.monotonic() - t0_mono
                    left.discard(fd)
                    poller.unregister(fd)
            for n in nodes:
                n.poll()
    finally:
        for fd in fds:
            os.close(fd)
    last: dict[int, float] = {n.rank: 0.0 for n in nodes}
    for fd, node in fds.items():
        last[node] = max(last[node], gone.get(fd, math.inf))
    return t0, last


# -- measurements on a running group ------------------------------------------------------------------
def scrape(n: Node) -> tuple[float, dict[float, float]]:
    """(calls so far, cumulative buckets by le) of supervise_store_latency_seconds, all ops (3 tries: on a
    loaded host an endpoint may reset a connection)."""
    for attempt in range(3):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{n.metrics_port}/metrics", timeout=20) as reply:
                return parse_store_latency(reply.read().decode())
        except OSError:
            if attempt == 2:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def parse_store_latency(body: str) -> tuple[float, dict[float, float]]:
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


def cpu_s(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return math.nan


def memory(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MiB."""
    try:
        info = psutil.Process(pid).memory_full_info()
        return info.rss / 2**20, info.pss / 2**20
    except psutil.Error:
        return math.nan, math.nan


def store_child(pid: int) -> int | None:
    try:
        for c in psutil.Process(pid).children():
            if "store_host" in " ".join(c.cmdline()):
                return c.pid
    except psutil.Error:
        pass
    return None


def maps_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def running_figures(nodes: list[Node], window_s: float) -> dict:
    """Memory, idle CPU and store calls of a running group (every supervisor scraped twice)."""
    sups = [n.proc.pid for n in nodes]
    child = store_child(nodes[0].proc.pid)
    watched = sups + ([child] if child else [])
    first = {n.rank: scrape(n) for n in nodes}
    cpu0 = {pid: cpu_s(pid) for pid in watched}
    t0 = time.monotonic()
    time.sleep(window_s)
    second = {n.rank: scrape(n) for n in nodes}
    cpu1 = {pid: cpu_s(pid) for pid in watched}
    dt = time.monotonic() - t0
    per_node = [(second[r][0] - first[r][0]) / dt for r in first]
    window: dict[float, float] = {}
    for r in first:
        for le, c in second[r][1].items():
            window[le] = window.get(le, 0.0) + c - first[r][1].get(le, 0.0)
    cpu = {pid: (cpu1[pid] - cpu0[pid]) / dt for pid in watched}
    mem = {pid: memory(pid) for pid in watched}
    rank_pss = [memory(pid)[1] for n in nodes for pid in n.rank_pids]
    others = [mem[p] for p in sups[1:]] or [(math.nan, math.nan)]
    return {
        "store_calls_per_s_node0": per_node[0],
        "store_calls_per_s_other_median": statistics.median(per_node[1:]) if len(per_node) > 1 else math.nan,
        "store_calls_per_s_total": sum(per_node),
        "store_p50_le_s": quantile_le(0.5, window), "store_p99_le_s": quantile_le(0.99, window),
        "rss_node0": mem[sups[0]][0], "pss_node0": mem[sups[0]][1],
        "rss_store_child": mem[child][0] if child else None, "pss_store_child": mem[child][1] if child else None,
        "rss_other_median": statistics.median(m[0] for m in others),
        "pss_other_median": statistics.median(m[1] for m in others),
        "pss_total_mib": sum(m[1] for m in mem.values()) + sum(rank_pss),
        "pss_rank_median": statistics.median(rank_pss) if rank_pss else math.nan,
        "cpu_node0": cpu[sups[0]], "cpu_store_child": cpu[child] if child else None,
        "cpu_other_median": statistics.median(cpu[p] for p in sups[1:]) if len(sups) > 1 else math.nan,
        "cpu_total": sum(cpu.values()),
        "torch_in_supervisor": maps_torch(sups[-1]),
    }


def loadavg() -> list[float]:
    return list(os.getloadavg())


# -- the scenarios --------------------------------------------------------------------------------------
def propagation_round(launch: Launch, nnodes: int, tag: str, measure: bool, ranks: int,
                      together: bool = False, settle_s: float = SETTLE_S) -> dict:
    """One group, one fault (a rank of the last node SIGKILLed)."""
    nodes = launch.started
    try:
        nodes = launch.start(nnodes, tag, ranks=ranks, together=together)
        wait_ready(nodes)
        ready_at = time.time()
        time.sleep(settle_s)
        if any(n.poll() for n in nodes):
            raise GroupFailed("a node exited before the fault:\n" + "\n".join(n.tail() for n in nodes if n.ended))
        try:
            figures = running_figures(nodes, SCRAPE_WINDOW_S) if measure else {}
        except OSError as exc:  # a metrics endpoint did not answer: the fault is still measured
            figures = {"figures_error": repr(exc)[:200]}
        if measure:
            time.sleep(settle_s)  # the scrapes and /proc reads of a big group load the host: not into the fault
        victim = nodes[-1]
        load = loadavg()

        def kill() -> float:
            t = time.time()
            os.kill(victim.rank_pids[-1], signal.SIGKILL)
            return t

        t0, gone = ranks_gone_after(nodes[:-1], kill, EXIT_LIMIT_S)
        wait_exits(nodes, EXIT_LIMIT_S)
        told, missing, lost_instead = [], [], []
        for n in nodes[:-1]:
            ev = n.first("peer_node_failed", fresh=True)
            (told.append(stamp(ev) - t0) if ev else missing.append(n.rank))
            if ev is None and (lost := n.first("peer_node_lost")) is not None:
                lost_instead.append(stamp(lost) - t0)  # it never read the fault: the origin's exit was a node loss
        joined = [n.first("every_node_joined") for n in nodes]
        joining = [n.first("joining_the_nodes") for n in nodes]
        handshake = {}
        if all(joined) and all(joining):
            last = max(stamp(e) for e in joined)
            handshake = {"from_last_start_s": last - max(n.spawned for n in nodes),
                         "from_last_joining_s": last - max(stamp(e) for e in joining),
                         "all_ready_s": ready_at - max(n.spawned for n in nodes)}
        return {"nodes": nnodes, "ranks": ranks, "told_s": told, "not_told": missing, "lost_instead_s": lost_instead,
                "ranks_gone_s": [gone[n.rank] for n in nodes[:-1]], "handshake": handshake,
                "exit_codes": dict(Counter(str(n.proc.poll()) for n in nodes)), "load": load, **figures}
    except GroupFailed as exc:
        lost = [ev for n in nodes if (ev := n.first("peer_node_lost", fresh=True))]
        first_lost = min(lost, key=stamp) if lost else None
        return {"nodes": nnodes, "ranks": ranks, "failed": brief(exc), "load": loadavg(),
                "first_loss": first_lost and f"{first_lost.get('node')}: {first_lost.get('detail')}",
                "exit_codes": dict(Counter(str(n.proc.poll()) for n in nodes))}
    finally:
        launch.stop()


def node_loss_round(launch: Launch, nnodes: int, victim: int, tag: str) -> dict:
    """A supervisor SIGKILLed: seconds until each other node logs ``peer_node_lost``."""
    try:
        nodes = launch.start(nnodes, tag, ranks=1)
        wait_ready(nodes)
        time.sleep(SETTLE_S)
        t0 = time.time()
        os.kill(nodes[victim].proc.pid, signal.SIGKILL)
        others = [n for n in nodes if n.rank != victim]
        wait_exits(others, LOSS_WATCH_S)
        told, missing = lost_times(others, t0)
        return {"nodes": nnodes, "victim": victim, "told_s": told, "not_told": missing,
                "exit_codes": dict(Counter(str(n.proc.poll()) for n in others)), "load": loadavg()}
    except GroupFailed as exc:
        return {"nodes": nnodes, "victim": victim, "failed": brief(exc), "load": loadavg()}
    finally:
        launch.stop()


def lost_times(nodes: list[Node], t0: float) -> tuple[list[float], list[int]]:
    told, missing = [], []
    for n in nodes:
        ev = n.first("peer_node_lost", fresh=True)
        (told.append(stamp(ev) - t0) if ev else missing.append(n.rank))
    return told, missing


def partition_rounds(tree: Tree, workdir: Path, rounds: int) -> dict:
    """Two nodes in namespaces; node 1 partitioned: when does each side rule the other lost?"""
    try:
        from tests.netlab import NetlabUnavailable, netlab
    except ImportError as exc:
        return {"skipped": f"tests/netlab.py not importable: {exc}"}
    out: list[dict] = []
    try:
        with netlab(2) as lab:
            for i in range(rounds):
                launch = Launch(tree, workdir, uuid.uuid4().hex, 1, lab=lab)
                port = 29500 + 10 * i
                try:
                    nodes = launch.start(2, f"{tree.name}-partition{i}", master_addrs=[lab.addr(0)] * 2,
                                         ports=[port, port + 1])
                    wait_ready(nodes, 180)
                    time.sleep(SETTLE_S)
                    t0 = time.time()
                    lab.partition(1)
                    wait_exits(nodes, LOSS_WATCH_S)
                    (t_node0, t_node1) = (lost_times([n], t0)[0] for n in nodes)
                    out.append({"node0_saw_s": t_node0[0] if t_node0 else None,
                                "node1_saw_s": t_node1[0] if t_node1 else None,
                                "exit_codes": [n.proc.poll() for n in nodes], "load": loadavg()})
                except GroupFailed as exc:
                    out.append({"failed": brief(exc)})
                finally:
                    launch.stop()
                    lab.heal()
    except NetlabUnavailable as exc:
        return {"skipped": str(exc)}
    return {"rounds": out}


def single_node(launch: Launch) -> dict:
    """One supervisor without --nnodes: its memory, and whether it maps libtorch."""
    try:
        nodes = launch.start(1, f"{launch.tree.name}-single", ranks=2)
        wait_ready(nodes, 120)
        time.sleep(SETTLE_S)
        pid = nodes[0].proc.pid
        rss, pss = memory(pid)
        return {"rss": rss, "pss": pss, "torch": maps_torch(pid)}
    except GroupFailed as exc:
        return {"failed": brief(exc)}
    finally:
        launch.stop()


def ranks_that_fit(nnodes: int, wanted: int, per_sup: float, per_rank: float) -> tuple[int, str]:
    """Ranks per node that fit in MemAvailable (with headroom), from measured (or guessed) PSS."""
    avail = psutil.virtual_memory().available
    for k in range(wanted, 0, -1):
        need = nnodes * (per_sup + k * per_rank)
        if need <= MEMORY_HEADROOM * avail:
            note = "" if k == wanted else (
                f"{wanted} ranks per node would need ~{nnodes * (per_sup + wanted * per_rank) / 2**30:.1f} GiB "
                f"of {avail / 2**30:.1f} GiB available: {k} per node")
            return k, note
    return 1, f"even 1 rank per node may not fit ({avail / 2**30:.1f} GiB available)"


def torch_import_s() -> float:
    """How long ``import torch`` takes on this host now: what a supervisor's handshake pays (the store client)."""
    code = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return float(out.stdout.strip() or "nan")


def run_tree(tree: Tree, sizes: list[int], ranks: int, workdir: Path, quick: bool, rounds_override: int | None) -> dict:
    res: dict = {"label": tree.label, "sizes": {}, "load_start": loadavg()}
    if not quick:
        res["torch_import_s"] = [torch_import_s() for _ in range(3)]
    per_sup, per_rank = float(SUPERVISOR_PSS_GUESS), float(RANK_PSS_GUESS)
    for size in sizes:
        rounds = 1 if quick else rounds_override or ROUNDS.get(size, 1)
        k, note = ranks_that_fit(size, ranks, per_sup, per_rank)
        runs, fell, node_timeout = [], [], None
        for r in range(rounds):
            while True:
                launch = Launch(tree, workdir, uuid.uuid4().hex, k, node_timeout=node_timeout)
                run = propagation_round(launch, size, f"{tree.name}-prop{size}-{r}-k{k}",
                                        measure=r == 0 and not quick, ranks=k,
                                        settle_s=QUICK_SETTLE_S if quick else SETTLE_S)
                run["node_timeout"] = node_timeout
                print(json.dumps({"tree": tree.name, **run}), flush=True)
                if "failed" in run and r == 0 and size >= FALLBACK_FROM:
                    # This host cannot hold the group through its start (64 supervisors starting their services
                    # at once on 2 cores starve the links past the default node timeout): a longer node timeout
                    # where the tree has the flag, then fewer ranks; the table says so.
                    if node_timeout is None and tree.has_flag("--node-timeout"):
                        fell.append(run)
                        node_timeout = FALLBACK_NODE_TIMEOUT_S
                        continue
                    if k > 1:
                        fell.append(run)
                        k = max(1, k // 4)
                        continue
                break
            runs.append(run)
        first = runs[0]
        if "pss_other_median" in first and not math.isnan(first["pss_other_median"]):
            per_sup = max(first["pss_other_median"], first["pss_node0"] / 2) * 2**20
            per_rank = max(first["pss_rank_median"], 1.0) * 2**20
        if fell:
            note = "; ".join(filter(None, [note] + [
                (f"with {f['ranks']} per node and --node-timeout {f['node_timeout'] or f'{NODE_TIMEOUT_S:g} (default)'} "
                 f"the group fell apart before the fault (first loss: {f.get('first_loss') or f['failed']})")[:420]
                for f in fell]))
        if node_timeout:
            note += f"; figures with --node-timeout {node_timeout:g}"
        res["sizes"][size] = {"runs": runs, "ranks_note": note}
    if quick:
        return res
    res["together"] = []
    for r in range(TOGETHER_ROUNDS):
        launch = Launch(tree, workdir, uuid.uuid4().hex, ranks)
        res["together"].append(propagation_round(launch, TOGETHER_NODES, f"{tree.name}-together-{r}", measure=False,
                                                 ranks=ranks, together=True))
        print(json.dumps({"tree": tree.name, "together": True, **res["together"][-1]}), flush=True)
    launch = Launch(tree, workdir, uuid.uuid4().hex, 1)
    res["single_node"] = single_node(launch)
    print(json.dumps({"tree": tree.name, "single_node": res["single_node"]}), flush=True)
    res["loss"] = []
    for victim in (1, 0):
        for r in range(LOSS_ROUNDS):
            launch = Launch(tree, workdir, uuid.uuid4().hex, 1)
            res["loss"].append(node_loss_round(launch, 2, victim, f"{tree.name}-loss{victim}-{r}"))
            print(json.dumps({"tree": tree.name, **res["loss"][-1]}), flush=True)
    launch = Launch(tree, workdir, uuid.uuid4().hex, 1)
    res["loss8"] = node_loss_round(launch, 8, 7, f"{tree.name}-loss8")
    print(json.dumps({"tree": tree.name, **res["loss8"]}), flush=True)
    res["partition"] = partition_rounds(tree, workdir, PARTITION_ROUNDS)
    print(json.dumps({"tree": tree.name, "partition": res["partition"]}), flush=True)
    res["load_end"] = loadavg()
    return res


# -- the soak -------------------------------------------------------------------------------------------
def scrape_in_ns(lab, node: int, port: int) -> str:
    """GET /metrics from inside a node's namespace (its loopback is its own)."""
    with lab.socket(node) as s:
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace").split("\r\n\r\n", 1)[-1]


def soak(minutes: float, workdir: Path) -> dict:
    from tests.netlab import DelayProxy, NetlabUnavailable, netlab

    tree = after_tree()
    seconds = minutes * 60.0
    try:
        with netlab(SOAK_NODES) as lab, ExitStack() as stack:
            port = 29600
            proxy = stack.enter_context(DelayProxy((lab.hub_addr, port + 1), (lab.addr(0), port + 1), SOAK_DELAY_S,
                                                   netns=lab.ns("hub"), max_connections=64,
                                                   max_seconds=seconds + 600))
            for n in range(1, SOAK_NODES):
                lab.lossy(n, SOAK_LOSS)
            # The light ranks' collectives are stamps, not communication: nothing couples one rank's steps to
            # another's, so their arrival order says nothing of who waits for whom (each node's sleep loop drifts
            # on its own).  The straggler detector is off; the soak counts false node losses.
            launch = Launch(tree, workdir, uuid.uuid4().hex, SOAK_RANKS, steps_per_s=SOAK_STEPS_PER_S, lab=lab,
                            extra=("--straggler-threshold", "off"))
            stack.callback(launch.stop)
            nodes = launch.start(SOAK_NODES, "soak", master_addrs=[lab.addr(0)] + [lab.hub_addr] * (SOAK_NODES - 1),
                                 ports=[port, port + 1])
            wait_ready(nodes, 300)
            start = time.time()
            loads = []
            while time.time() - start < seconds and not any(n.poll() for n in nodes):
                time.sleep(5.0)
                loads.append(os.getloadavg()[0])
            soak_end = time.time()
            early = [(n.rank, n.proc.returncode) for n in nodes if n.ended]
            latency = {}
            for n in nodes:
                try:
                    _count, buckets = parse_store_latency(scrape_in_ns(lab, n.rank, 9180))
                    latency[n.rank] = {"calls": _count, "p50_le_s": quantile_le(0.5, buckets),
                                       "p99_le_s": quantile_le(0.99, buckets)}
                except OSError as exc:
                    latency[n.rank] = {"error": repr(exc)}
            prop = {}
            if not early:
                victim = nodes[-1]

                def kill() -> float:
                    t = time.time()
                    os.kill(victim.rank_pids[-1], signal.SIGKILL)
                    return t

                t0, _gone = ranks_gone_after(nodes[:-1], kill, EXIT_LIMIT_S)
                wait_exits(nodes, EXIT_LIMIT_S)
                told = {n.rank: (stamp(ev) - t0 if (ev := n.first("peer_node_failed", fresh=True)) else None)
                        for n in nodes[:-1]}
                prop = {"told_s": told, "exit_codes": [n.proc.poll() for n in nodes]}
            counts: Counter = Counter()
            for n in nodes:
                for ev in n.events():
                    if start <= stamp(ev) <= soak_end and ev.get("level") in ("warning", "error"):
                        counts[ev.get("event", "?")] += 1
            return {"minutes": (soak_end - start) / 60.0, "nodes": SOAK_NODES, "ranks": SOAK_RANKS,
                    "ended_early": early, "warnings_in_soak": dict(counts),
                    "node_lost_in_soak": counts.get("peer_node_lost", 0), "store_latency": latency,
                    "proxy": {"connections": proxy.connections, "bytes_up": proxy.bytes_up,
                              "bytes_down": proxy.bytes_down},
                    "propagation_after": prop, "load_median": statistics.median(loads) if loads else None,
                    "load_max": max(loads) if loads else None, "tree": tree.label}
    except NetlabUnavailable as exc:
        return {"skipped": str(exc)}
    except GroupFailed as exc:
        return {"skipped": f"the group did not start: {brief(exc)}"}


# -- rendering ------------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of fewer than 100 values is their maximum)."""
    values = sorted(values)
    return values[max(0, math.ceil(q * len(values)) - 1)]


def ms(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v == math.inf:
        return "never"
    if v < 0.01:
        return f"{v * 1e3:.1f} ms"
    if v < 1:
        return f"{v * 1e3:.0f} ms"
    return f"{v:.2f} s" if v < 10 else f"{v:.1f} s"


def p50_p99(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{ms(pct(values, 0.5))} / {ms(pct(values, 0.99))} (n={len(values)})"


def size_cells(res: dict, size: int) -> dict[str, str]:
    entry = res["sizes"].get(size)
    if entry is None:
        return {}
    runs = entry["runs"]
    ok = [r for r in runs if "failed" not in r]
    cells: dict[str, str] = {}
    failed = [r for r in runs if "failed" in r]
    told = [t for r in ok for t in r["told_s"]]
    not_told = sum(len(r["not_told"]) for r in ok)
    lost_instead = [t for r in ok for t in r.get("lost_instead_s", [])]
    cells["prop"] = p50_p99(told) + (f"; {not_told} nodes never logged it" if not_told else "") + (
        f" ({len(lost_instead)} of them ruled the origin lost instead, when its link closed at its exit: "
        f"`peer_node_lost` p50 / p99 {p50_p99(lost_instead)})" if lost_instead else "") + (
        f"; {len(failed)} of {len(runs)} groups fell apart before the fault" if failed else "")
    cells["gone"] = p50_p99([t for r in ok for t in r["ranks_gone_s"]])
    hs = [r["handshake"] for r in ok if r.get("handshake")]
    if hs:
        cells["hs_start"] = " / ".join(ms(h["from_last_start_s"]) for h in hs)
        cells["hs_joining"] = " / ".join(ms(h["from_last_joining_s"]) for h in hs)
        cells["ready"] = " / ".join(ms(h["all_ready_s"]) for h in hs)
    codes: Counter = Counter()
    for r in runs:
        codes.update(r.get("exit_codes", {}))
    cells["codes"] = ", ".join(f"{c}: {k}" for c, k in sorted(codes.items()))
    cells["load"] = " / ".join(f"{r['load'][0]:.1f}" for r in runs)
    cells["ranks"] = f"{runs[0]['ranks']}" + (f" ({entry['ranks_note']})" if entry["ranks_note"] else "")
    m = runs[0]
    if "figures_error" in m:
        cells["store"] = f"not measured: {m['figures_error']}"
    if "store_calls_per_s_total" in m:
        cells["store"] = (f"node 0 {m['store_calls_per_s_node0']:.1f}, others {m['store_calls_per_s_other_median']:.1f}"
                          f" (median), all {m['store_calls_per_s_total']:.0f}; p50 <= {ms(m['store_p50_le_s'])}, "
                          f"p99 <= {ms(m['store_p99_le_s'])}")
        child = (f"; store child {m['rss_store_child']:.0f} / {m['pss_store_child']:.0f}"
                 if m.get("rss_store_child") is not None else "; no store child")
        cells["mem"] = (f"node 0 {m['rss_node0']:.0f} / {m['pss_node0']:.0f}{child}; others {m['rss_other_median']:.0f}"
                        f" / {m['pss_other_median']:.0f} (median); light rank PSS {m['pss_rank_median']:.1f}; group "
                        f"PSS {m['pss_total_mib'] / 1024:.1f} GiB")
        cpu_child = f", store child {m['cpu_store_child'] * 100:.1f} %" if m.get("cpu_store_child") is not None else ""
        cells["cpu"] = (f"node 0 {m['cpu_node0'] * 100:.1f} %{cpu_child}, others {m['cpu_other_median'] * 100:.1f} % "
                        f"(median); all {m['cpu_total']:.2f} cores")
    return cells


def loss_cells(res: dict) -> dict[str, str]:
    cells = {}
    for victim in (1, 0):
        rounds = [r for r in res.get("loss", []) if r["victim"] == victim and "failed" not in r]
        told = [t for r in rounds for t in r["told_s"]]
        missing = sum(len(r["not_told"]) for r in rounds)
        codes = Counter(c for r in rounds for c in r["exit_codes"] for _ in range(r["exit_codes"][c]))
        if not rounds:
            continue
        cells[f"loss{victim}"] = (", ".join(ms(t) for t in told) or "-") + (
            f"; {missing} never within {LOSS_WATCH_S:.0f} s" if missing else "") + (
            f" (exit {', '.join(f'{c}: {k}' for c, k in sorted(codes.items()))})" if codes else "")
    r8 = res.get("loss8")
    if r8 and "failed" not in r8:
        cells["loss8"] = p50_p99(r8["told_s"]) + (f"; {len(r8['not_told'])} never" if r8["not_told"] else "")
    elif r8:
        cells["loss8"] = "group fell apart before the kill"
    part = res.get("partition", {})
    if "skipped" in part:
        cells["part0"] = cells["part1"] = f"skipped: {part['skipped']}"
    elif part:
        rounds = [r for r in part["rounds"] if "failed" not in r]
        for side in (0, 1):
            vals = [r[f"node{side}_saw_s"] for r in rounds]
            cells[f"part{side}"] = ", ".join(ms(v) if v is not None else f"never within {LOSS_WATCH_S:.0f} s"
                                             for v in vals) or "-"
        cells["part_codes"] = "; ".join(str(r["exit_codes"]) for r in rounds)
    together = res.get("together")
    if together:
        broke = [r for r in together if "failed" in r]
        cells["together"] = (f"{len(broke)} of {len(together)} fell apart before the fault"
                             + "".join(f"; {r.get('first_loss') or r['failed'][:200]}" for r in broke[:1])
                             + (f"; the others: propagation {p50_p99([t for r in together if 'failed' not in r for t in r['told_s']])}"
                                if len(broke) < len(together) else ""))
    if res.get("torch_import_s"):
        cells["torch"] = " / ".join(ms(t) for t in res["torch_import_s"])
    single = res.get("single_node", {})
    if "rss" in single:
        cells["single"] = (f"RSS {single['rss']:.0f} MiB, PSS {single['pss']:.0f} MiB, libtorch "
                           f"{'mapped' if single['torch'] else 'not mapped'}")
    return cells


ROWS = [
    ("prop", "propagation: rank SIGKILLed on the last node -> each other node logs `peer_node_failed`, p50 / p99"),
    ("gone", "same fault -> each other node's last rank process gone (teardown included), p50 / p99"),
    ("hs_start", "handshake: last supervisor started -> last `every_node_joined` (per group)"),
    ("hs_joining", "handshake: last `joining_the_nodes` -> last `every_node_joined` (per group)"),
    ("ready", "last supervisor started -> every rank of every node ready (per group)"),
    ("store", "store calls/s per node (node link) and call latency, idle group"),
    ("mem", "memory, MiB RSS / PSS, idle group"),
    ("cpu", "CPU of the idle supervisors (share of one core)"),
    ("codes", "exit codes (origin 80, others 84)"),
    ("ranks", "light ranks per node"),
    ("load", "load average (1 min) at each fault"),
]


def render(results: dict[str, dict], sizes: list[int], command: str) -> list[str]:
    trees = [t for t in ("before", "after") if t in results]
    head = "| figure | " + " | ".join(f"{t}: {results[t]['label']}" for t in trees) + " |"
    lines = [f"All figures below: `{command}`.", "", head, "|---|" + "---|" * len(trees)]
    for size in sizes:
        cells = {t: size_cells(results[t], size) for t in trees}
        for key, title in ROWS:
            if any(key in cells[t] for t in trees):
                lines.append(f"| **{size} nodes**: {title} | " + " | ".join(cells[t].get(key, "-") for t in trees) + " |")
    lcells = {t: loss_cells(results[t]) for t in trees}
    for key, title in [("loss1", "node loss, 2 nodes: node 1's supervisor SIGKILLed -> node 0 logs `peer_node_lost`"),
                       ("loss0", "node loss, 2 nodes: node 0's supervisor SIGKILLed -> node 1 logs `peer_node_lost`"),
                       ("loss8", "node loss, 8 nodes: node 7's supervisor SIGKILLed -> the 7 others, p50 / p99"),
                       ("part0", "partition (node 1's bridge port disabled) -> node 0 rules node 1 lost"),
                       ("part1", "partition -> node 1 rules node 0 (the store) lost"),
                       ("part_codes", "partition: exit codes [node 0, node 1] (None: still running, killed)"),
                       ("together", f"{TOGETHER_NODES} nodes started all at once (not node 0 first), "
                                    f"{TOGETHER_ROUNDS} groups: fell apart before the fault? (first loss logged)"),
                       ("torch", "`import torch` alone on this host at the start of the tree's part (3 times): "
                                 "what every supervisor's handshake includes"),
                       ("single", "single node (no `--nnodes`), 2 light ranks: the supervisor")]:
        if any(key in lcells[t] for t in trees):
            lines.append(f"| {title} | " + " | ".join(lcells[t].get(key, "-") for t in trees) + " |")
    return lines


def stamp_line() -> str:
    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = psutil.virtual_memory().total / 2**30
    return (f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, commit {git('rev-parse', '--short', 'HEAD')}, "
            f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, shared with other engineers' test runs")


# -- main -----------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="node counts, comma-separated")
    parser.add_argument("--nodes", type=int, help="the largest node count: the default sizes up to it")
    parser.add_argument("--ranks", type=int, default=8, help="light ranks per node (fewer where memory is short)")
    parser.add_argument("--before", default=BEFORE_REV, help="git revision to compare with (default %(default)s)")
    parser.add_argument("--no-before", action="store_true", help="this tree only")
    parser.add_argument("--after", default="", metavar="REV",
                        help="measure git archive REV as 'after' instead of the working tree (others' edits in progress)")
    parser.add_argument("--rounds", type=int, help="groups per size (default: 20 at 2 nodes, 3 at 8, 2 at 24, else 1)")
    parser.add_argument("--quick", action="store_true", help="2 nodes, 1 fault, this tree only: a smoke run")
    parser.add_argument("--soak", type=float, metavar="MINUTES", help="only the latency + loss soak, this long")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep every log and bundle under DIR")
    parser.add_argument("--update-docs", type=Path)
    args = parser.parse_args()
    if args.quick and args.update_docs:
        parser.error("--quick figures are a smoke run: not for the docs")

    def interrupted(_signum, _frame):  # SIGTERM: unwind through every finally (the groups' stop)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    with tempfile.TemporaryDirectory(prefix="bench-multinode-") as tmp:
        workdir = Path(tmp) if args.keep is None else args.keep
        workdir.mkdir(parents=True, exist_ok=True)
        if args.soak is not None:
            return run_soak(args, workdir)
        sizes = [2] if args.quick else sorted({int(s) for s in args.sizes.split(",")})
        if args.nodes and not args.quick:
            sizes = [s for s in DEFAULT_SIZES if s < args.nodes] + [args.nodes]
        results: dict[str, dict] = {}
        after = archived_tree("after", args.after, workdir / "after") if args.after else after_tree()
        results["after"] = run_tree(after, sizes, 1 if args.quick else args.ranks, workdir, args.quick, args.rounds)
        if not (args.quick or args.no_before):
            try:
                before = archived_tree("before", args.before, workdir / "before")
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                print(f"no before tree: {exc}", file=sys.stderr)
            else:
                results["before"] = run_tree(before, sizes, args.ranks, workdir, False, args.rounds)
        command = ".venv/bin/python -m bench.bench_multinode" + (" --quick" if args.quick else (
            f" --sizes {','.join(map(str, sizes))} --ranks {args.ranks}"
            + (f" --rounds {args.rounds}" if args.rounds else "") + (f" --after {args.after}" if args.after else "")
            + (" --no-before" if args.no_before else f" --before '{args.before}'")))
        lines = render(results, sizes, command)
        print("\n".join(lines))
        if args.update_docs:
            loads = [results[t][k][0] for t in results for k in ("load_start", "load_end") if k in results[t]]
            replace_section(args.update_docs, HEADING, "\n".join([
                HEADING, "",
                f"{stamp_line()}; load average (1 min) {min(loads):.1f}-{max(loads):.1f} at the start and end of "
                "each tree's part, at each fault in the table.", "",
                "Real `supervise serve` processes on this host, one per simulated node, each with light ranks "
                "(bench/light_rank.py: the rank-side runtime only, no torch), `--stack-method none --kill-grace 2`; "
                "the partition in network namespaces (tests/netlab.py). \"before\" is the same benchmark run against "
                "`git archive` of that revision through `PYTHONPATH`. Propagation and node loss are read from each "
                "supervisor's JSON log timestamps against the wall-clock time of the SIGKILL; p99 of fewer than 100 "
                "values is their maximum.", "", *lines, ""]))
        if args.quick:
            return quick_verdict(results["after"])
    return 0


def quick_verdict(res: dict) -> int:
    run = res["sizes"][2]["runs"][0]
    if "failed" in run or run["not_told"] or run.get("exit_codes") != {"84": 1, "80": 1}:
        print(f"quick: the fault did not propagate as it should: {json.dumps(run)}", file=sys.stderr)
        return 1
    return 0


def run_soak(args, workdir: Path) -> int:
    res = soak(args.soak, workdir)
    print(json.dumps(res), flush=True)
    command = f".venv/bin/python -m bench.bench_multinode --soak {args.soak:g}"
    if "skipped" in res:
        lines = [f"Not run (`{command}`): {res['skipped']}."]
    else:
        prop = res["propagation_after"]
        told = prop.get("told_s", {})
        lat = "; ".join(f"node {n}: {v['calls']:.0f} calls, p50 <= {ms(v['p50_le_s'])}, p99 <= {ms(v['p99_le_s'])}"
                        if "calls" in v else f"node {n}: {v['error']}" for n, v in sorted(res["store_latency"].items()))
        lines = [
            f"`{command}` ({stamp_line()}; {res['tree']}): {res['nodes']} nodes in network namespaces, nodes "
            f"1-{res['nodes'] - 1} reach node 0's gate through a `DelayProxy` adding {SOAK_DELAY_S * 1e3:.0f} ms each "
            f"way, and each of their packets is dropped with probability {SOAK_LOSS:g} (nftables, in the hub); "
            f"{res['ranks']} light ranks per node stepping at {SOAK_STEPS_PER_S:g} Hz (fake collectives: the straggler detector is off); default `--node-timeout` "
            f"({NODE_TIMEOUT_S:g} s). Load average during the soak: median {res['load_median']}, max {res['load_max']}.",
            "",
            f"- **`peer_node_lost` during {res['minutes']:.1f} minutes: {res['node_lost_in_soak']}** (expected 0); "
            f"nodes that ended early: {res['ended_early'] or 'none'}; every warning or error logged in the soak "
            f"window: {res['warnings_in_soak'] or 'none'}.",
            f"- Store calls through the slow, lossy way (whole run, each node's node link): {lat}.",
            f"- Then a rank of node {res['nodes'] - 1} SIGKILLed: `peer_node_failed` logged on the others after "
            + (", ".join(f"node {n}: {ms(t) if t is not None else 'never'}" for n, t in sorted(told.items())) or "-")
            + f"; exit codes {prop.get('exit_codes')}.",
            f"- The proxy carried {res['proxy']['connections']} connections, {res['proxy']['bytes_up']} bytes up, "
            f"{res['proxy']['bytes_down']} bytes down.",
        ]
    print("\n".join(lines))
    if args.update_docs:
        replace_section(args.update_docs, SOAK_HEADING, "\n".join([SOAK_HEADING, "", *lines, ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
