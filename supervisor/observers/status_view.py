"""``supervise status [--watch] [--json]``: the client side of ``observers.status``.

Finds the job in the registry (like ``supervise dump``), asks its control
socket for ``{"cmd": "status"}`` and prints the reply: JSON for scripts, a rich
table once, or a live table refreshed every ``--interval`` until Ctrl-C (exit 0).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tp_supervise.watchdogs.gpu import SLOWING_REASONS

from . import control_socket as control

# A table printed to a pipe or a file is not wrapped at 80 columns.
PLAIN_WIDTH = 200


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 0:
        return "-" + _fmt_s(-value)
    if value < 1e-3:
        return f"{value * 1e6:.0f}µs"
    if value < 1.0:
        return f"{value * 1e3:.1f}ms"
    return f"{value:.1f}s"


def _fmt_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}GiB"


def _lag(rank: dict) -> str:
    lag = rank.get("lag")
    if not lag:
        return "-"
    return f"{_fmt_s(lag['p50_seconds'])}/{_fmt_s(lag['p99_seconds'])} {lag['wait_share'] * 100:.0f}%"


def _collective(rank: dict) -> str:
    coll = rank.get("collective")
    if not coll:
        return "-"
    return f"{coll['op'] or '?'} #{coll['seq']} {_fmt_s(coll['for_seconds'])}"


def _gpu(rank: dict) -> str:
    gpu = rank.get("gpu")
    if not gpu:
        return "-"
    util = "-" if gpu["utilization_pct"] is None else f"{gpu['utilization_pct']:.0f}%"
    mem = f"{_fmt_bytes(gpu['memory_used_bytes'])}/{_fmt_bytes(gpu['memory_total_bytes'])}"
    power = "" if gpu.get("power_w") is None else f" {gpu['power_w']:.0f}W"
    clock = ""
    if gpu.get("sm_clock_mhz") is not None and gpu.get("sm_clock_max_mhz"):
        clock = f" {gpu['sm_clock_mhz']}/{gpu['sm_clock_max_mhz']}MHz"
    slowing = [r for r in gpu.get("clock_reasons") or () if r in SLOWING_REASONS]
    why = f" ({', '.join(slowing)})" if slowing else ""
    return f"{gpu['index']}: {util} {mem}{power}{clock}{why}"


TITLE_WIDTH = 24


def _title(title: str | None) -> str:
    """The process's title, short (an engine's own name for it: VLLM::Worker_TP1)."""
    text = title or "-"
    return text if len(text) <= TITLE_WIDTH else text[: TITLE_WIDTH - 1] + "…"


_COLUMNS = (
    "rank",
    "pid",
    "title",
    "state",
    "step",
    "collective in flight",
    "lag p50/p99 wait",
    "heartbeat",
    "cpu",
    "rss",
    "gpu util mem",
)
_DROP_ORDER = ("gpu util mem", "title", "rss", "heartbeat", "cpu", "step", "lag p50/p99 wait", "collective in flight")


def render(status: dict, width: int | None = None) -> Group:
    """The status reply as a header line, a per-rank table and the straggler's sentence; columns that do not
    fit in ``width`` are left out, least telling first."""
    state = status.get("engine_state", "?")
    incident = status.get("incident_open")
    header = Text()
    header.append(f"run {status.get('run_id')}", style="bold")
    header.append(f"  node {status.get('node')}  attempt {status.get('attempt')}  restarts {status.get('restarts')}  ")
    header.append(f"engine {state}", style="bold red" if incident else "bold green" if state == "ready" else "bold")
    if incident:
        header.append("  INCIDENT OPEN", style="bold white on red")
    straggler = status.get("straggler") or {}
    named = set(straggler.get("named") or ())
    if straggler:
        header.append(f"  stragglers: {straggler.get('state')}")
        if straggler.get("step_seconds"):
            header.append(f" (step {_fmt_s(straggler['step_seconds'])})")
    rows = []
    for rank in status.get("ranks", []):
        style = None
        label = str(rank["rank"])
        if rank.get("straggler") or rank["rank"] in named:
            style, label = "bold yellow", f"{label} STRAGGLER"
        if not rank.get("alive", True) or rank.get("state") in ("stopped", "zombie", "gone"):
            style = "bold red"
        cpu = rank.get("cpu_percent")
        cells = (
            label,
            str(rank.get("pid")),
            _title(rank.get("title")),
            str(rank.get("state")),
            "-" if rank.get("step") is None else str(rank["step"]),
            _collective(rank),
            _lag(rank),
            _fmt_s(rank.get("heartbeat_age_seconds")),
            "-" if cpu is None else f"{cpu:.0f}%",
            _fmt_bytes(rank.get("rss_bytes")),
            _gpu(rank),
        )
        rows.append((cells, style))
    for proc in status.get("processes", []):
        in_step = proc.get("in_step")
        where = "-"
        if in_step:
            tokens = f", {proc['step_tokens']} tokens" if proc.get("step_tokens") else ""
            where = f"in step {_fmt_s(proc.get('in_step_seconds'))} {proc.get('phase') or ''}{tokens}".rstrip()
        elif in_step is not None:
            where = f"between steps ({proc.get('phase') or '-'})"
        cpu = proc.get("cpu_percent")
        cells = (
            str(proc.get("role")),
            str(proc.get("pid")),
            _title(proc.get("title")),
            str(proc.get("state")),
            "-" if proc.get("steps") is None else str(proc["steps"]),
            where,
            "-",
            _fmt_s(proc.get("heartbeat_age_seconds")),
            "-" if cpu is None else f"{cpu:.0f}%",
            _fmt_bytes(proc.get("rss_bytes")),
            "-",
        )
        bad = not proc.get("alive", True) or proc.get("state") in ("stopped", "zombie", "gone", "exited")
        rows.append((cells, "bold red" if bad else "dim"))
    # On a narrow terminal the least telling columns go first; who (rank, pid) and what state stay whole.
    shown = list(range(len(_COLUMNS)))
    natural = [max([len(name), *(len(cells[i]) for cells, _ in rows)]) for i, name in enumerate(_COLUMNS)]
    for dropped in _DROP_ORDER:
        if width is None or sum(natural[i] + 3 for i in shown) <= width:
            break
        shown.remove(_COLUMNS.index(dropped))
    table = Table(show_edge=False, pad_edge=False)
    right = {"rank", "pid", "step", "heartbeat", "cpu", "rss"}
    for i in shown:
        name = _COLUMNS[i]
        table.add_column(name, justify="right" if name in right else "left", no_wrap=True)
    for cells, style in rows:
        table.add_row(*(cells[i] for i in shown), style=style)
    parts: list = [header, table]
    for _rank, sentence in sorted((straggler.get("sentences") or {}).items()):
        parts.append(Text(f"straggler: {sentence}", style="bold yellow"))
    gpu = status.get("gpu")
    if gpu is not None and not gpu.get("available"):
        parts.append(Text(f"gpu: no NVML reading ({gpu.get('reason')})", style="dim"))
    return Group(*parts)


def _pick_job(run_id: str | None) -> tuple[control.JobEntry | None, str]:
    try:
        jobs = control.list_jobs()
    except control.RegistryError as exc:
        return None, str(exc)
    if run_id:
        jobs = [j for j in jobs if j.run_id == run_id]
        if not jobs:
            return None, f"no running job with run id {run_id!r}"
    elif not jobs:
        return None, "no supervised job is running on this host"
    elif len(jobs) > 1:
        ids = ", ".join(j.run_id for j in jobs)
        return None, f"{len(jobs)} jobs are running ({ids}); choose one with --run-id"
    return jobs[0], ""


def fetch(job: control.JobEntry, timeout_s: float) -> dict:
    reply = control.request(job.socket, {"cmd": "status"}, timeout_s=timeout_s)
    if not reply.get("ok"):
        raise RuntimeError(reply.get("error", "failed"))
    return reply["status"]


def main(args: argparse.Namespace) -> int:
    job, why = _pick_job(args.run_id)
    if job is None:
        print(f"supervise status: {why}", file=sys.stderr)
        return 2
    if args.watch and not args.json:
        return _watch(job, args)
    try:
        status = fetch(job, args.timeout)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"supervise status: cannot get the status of job {job.run_id} (pid {job.pid}): {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status))
        return 0
    console = Console() if sys.stdout.isatty() else Console(width=PLAIN_WIDTH)
    console.print(render(status, console.width))
    return 0


def _watch(job: control.JobEntry, args: argparse.Namespace) -> int:
    """Live table until Ctrl-C or SIGTERM (exit 0); a job that ends says so and exits 0 too.

    The signals set a flag the loop checks between frames (never a KeyboardInterrupt raised wherever the main
    thread happens to be: one raised inside a finaliser is printed and swallowed, and the view went on)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda _signum, _frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    console = Console()
    try:
        with Live(Text(f"asking job {job.run_id}..."), console=console, auto_refresh=False, screen=False) as live:
            while not stop.is_set():
                began = time.monotonic()
                view: Group | Text
                try:
                    view = render(fetch(job, args.timeout), console.width)
                except (OSError, ValueError, RuntimeError) as exc:
                    if not job.alive():
                        live.update(Text(f"job {job.run_id} has ended"), refresh=True)
                        return 0
                    view = Text(f"job {job.run_id}: no status ({exc}); retrying", style="bold red")
                live.update(view, refresh=True)
                stop.wait(max(0.0, args.interval - (time.monotonic() - began)))
    except KeyboardInterrupt:  # a signal before the handlers above were installed
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
