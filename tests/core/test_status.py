"""`supervise status` against a running supervised job: JSON, a table once, and a live table under a terminal."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from rich.console import Console

from tests.conftest import ROOT, fake_rank
from tests.live import wait_registry
from tp_supervise.supervisor.observers import control_socket as control
from tp_supervise.supervisor.observers.status_view import render

CLI = [sys.executable, "-m", "tp_supervise.supervisor.cli"]
RANK_FIELDS = {
    "rank",
    "slot",
    "pid",
    "alive",
    "state",
    "step",
    "collective",
    "heartbeat_age_seconds",
    "lag",
    "straggler",
    "cpu_percent",
    "rss_bytes",
    "gpu",
}


def _cli(*args: str, registry, timeout: float = 30) -> subprocess.CompletedProcess:
    env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(registry))
    return subprocess.run([*CLI, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _status(registry, *args: str) -> dict:
    done = _cli("status", "--json", *args, registry=registry)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _wait_for(registry, ok, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = _status(registry)
        if ok(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.3)


def test_status_json_table_and_watch_show_every_rank(supervise, tmp_path):
    registry = tmp_path / "registry"
    run = supervise(["--nproc-per-node", "3"], fake_rank("--all", "loop"))
    entry = wait_registry(registry)
    status = _wait_for(
        registry,
        lambda s: s["engine_state"] == "ready" and all(r["step"] for r in s["ranks"]) and s["straggler"] is not None,
    )
    assert status["version"] == 1
    assert status["run_id"] == entry["run_id"]
    assert status["engine_state"] == "ready" and status["incident_open"] is False
    ranks = status["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    for r in ranks:
        assert RANK_FIELDS <= set(r), r
        assert r["alive"] and r["state"] in ("running", "sleeping"), r
        assert r["step"] > 0 and 0 <= r["heartbeat_age_seconds"] < 5, r
        assert r["rss_bytes"] > 1_000_000 and r["cpu_percent"] is not None, r
        assert r["straggler"] is False
    pids = {r["pid"] for r in ranks}
    assert len(pids) == 3

    by_id = _status(registry, "--run-id", entry["run_id"])
    assert {r["pid"] for r in by_id["ranks"]} == pids
    wrong = _cli("status", "--run-id", "no-such-run", registry=registry)
    assert wrong.returncode == 2 and "no-such-run" in wrong.stderr

    table = _cli("status", registry=registry)
    assert table.returncode == 0, table.stderr
    assert entry["run_id"] in table.stdout and "ready" in table.stdout
    for pid in pids:
        assert str(pid) in table.stdout, table.stdout

    watched = _watch_in_a_terminal(registry, seconds=2.5)
    assert watched["rc"] == 0, watched["out"][-2000:]
    for pid in pids:
        assert str(pid) in watched["out"], watched["out"][-2000:]
    assert watched["out"].count(entry["run_id"]) >= 2, "the live table must refresh"

    assert run.proc.poll() is None, "status must not disturb the job"
    # `top -H` says which of the supervisor's threads uses the CPU: the long-lived ones carry their names.
    threads = {(task / "comm").read_text().strip() for task in Path(f"/proc/{run.proc.pid}/task").iterdir()}
    assert {"tps-watchdog", "tps-straggler", "tps-exit-monito", "tps-control-soc"} <= threads  # 15 bytes, threads
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 0


def test_status_shows_stopped_ranks_and_answers_while_the_main_loop_handles_the_hang(supervise, tmp_path):
    """Both ranks stop themselves inside an all_reduce: status shows them stopped, the collective in flight for
    longer and longer, and keeps answering after the hang (the main loop busy with the fatal dump)."""
    registry = tmp_path / "registry"
    run = supervise(["--nproc-per-node", "2", "--hard-timeout", "3"], [sys.executable, "-c", STOPS_IN_A_COLLECTIVE])
    sock = wait_registry(registry)["socket"]
    replies = []
    while run.proc.poll() is None:
        t0 = time.monotonic()
        try:
            reply = control.request(sock, {"cmd": "status"}, timeout_s=10)
        except OSError:  # the job ended: its socket is gone
            break
        replies.append((t0, time.monotonic(), reply["status"]))
        time.sleep(0.05)
    assert run.wait(timeout=60) == 81, run.stderr[-3000:]
    stopped = [
        (t0, s)
        for t0, _, s in replies
        if s["engine_state"] == "ready" and len(s["ranks"]) == 2
        and all(r["state"] == "stopped" and r["collective"] for r in s["ranks"])
    ]
    assert len(stopped) >= 3, [s for _, _, s in replies][-3:]
    (t_a, a), (t_b, b) = stopped[0], stopped[-1]
    for before, after in zip(a["ranks"], b["ranks"], strict=True):
        assert after["collective"]["seq"] == before["collective"]["seq"] and after["collective"]["op"] == "all_reduce"
        grew = after["collective"]["for_seconds"] - before["collective"]["for_seconds"]
        assert grew >= (t_b - t_a) - 0.5, (before, after)
        assert after["heartbeat_age_seconds"] >= before["heartbeat_age_seconds"] + (t_b - t_a) - 0.5
        assert after["step"] == before["step"]
    # After the verdict (the hang, its teardown, the stopped group while the bundle is finished): still answered.
    hung = [(t1 - t0, s) for t0, t1, s in replies if s["engine_state"] in ("hung", "tearing_down", "stopped")]
    assert hung, f"no status answered after the hang verdict: {[s['engine_state'] for _, _, s in replies]}"
    assert all(s["incident_open"] for _, s in hung)
    assert min(latency for latency, _ in hung) < 2.0


# Each rank runs a few steps, then stops itself (SIGSTOP) inside an all_reduce.
STOPS_IN_A_COLLECTIVE = """
import os, signal, time
from tp_supervise.supervisor.rank import runtime as sv
sv.ready()
step = 0
while True:
    with sv.step():
        with sv.collective("all_reduce", "64x256 float32"):
            if step == 20 + 5 * int(os.environ["RANK"]):
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(0.002)
    step += 1
"""


def test_status_without_a_job_says_so(tmp_path):
    done = _cli("status", registry=tmp_path / "empty")
    assert done.returncode == 2 and "no supervised job" in done.stderr


def test_the_table_marks_the_straggler_and_an_open_incident():
    rank = {
        "pid": 11,
        "alive": True,
        "state": "running",
        "step": 5,
        "collective": None,
        "heartbeat_age_seconds": 0.01,
        "lag": {"p50_seconds": 0.0, "p99_seconds": 0.001, "wait_share": 0.01, "late_fraction": 0.1},
        "straggler": False,
        "cpu_percent": 50.0,
        "rss_bytes": 2 << 20,
        "gpu": None,
    }
    slow = dict(
        rank,
        rank=1,
        pid=12,
        straggler=True,
        lag={"p50_seconds": 0.041, "p99_seconds": 0.05, "wait_share": 0.34, "late_fraction": 0.97},
        gpu={
            "index": 1,
            "utilization_pct": 97.0,
            "memory_used_bytes": 3 << 30,
            "memory_total_bytes": 80 << 30,
            "power_w": 300.0,
            "process_used_bytes": 3 << 30,
            "sm_clock_mhz": 1110,
            "sm_clock_max_mhz": 1980,
            "temperature_c": 88,
            "clock_reasons": ["hardware thermal slowdown"],
        },
    )
    status = {
        "version": 1,
        "run_id": "r1",
        "node": 0,
        "engine_state": "suspect",
        "incident_open": True,
        "attempt": 1,
        "restarts": 0,
        "straggler": {
            "state": "straggler",
            "named": [1],
            "step_seconds": 0.12,
            "sentences": {"1": "rank 1 arrives 41 ms late"},
        },
        "gpu": {"available": True, "reason": ""},
        "ranks": [dict(rank, rank=0), slow],
    }
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render(status))
    text = console.export_text()
    assert "INCIDENT OPEN" in text and "suspect" in text
    assert "1 STRAGGLER" in text and "0 STRAGGLER" not in text
    assert "rank 1 arrives 41 ms late" in text
    assert "41.0ms/50.0ms 34%" in text
    assert "97%" in text and "3.0GiB/80.0GiB" in text
    assert "1110/1980MHz (hardware thermal slowdown)" in text

    # An 80-column terminal (or COLUMNS=80): the wide columns give way, rank, pid and state stay whole.
    narrow = Console(width=80, record=True, file=io.StringIO())
    narrow.print(render(status, narrow.width))
    shown = narrow.export_text()
    rows = [line for line in shown.splitlines() if " 11 " in line or " 12 " in line]
    assert len(rows) == 2, shown
    assert "1 STRAGGLER" in rows[1] and "running" in rows[0] and "running" in rows[1], rows
    assert "41.0ms/50.0ms 34%" in rows[1], "the lag column is kept before the GPU's"


def _watch_in_a_terminal(registry, seconds: float) -> dict:
    """`supervise status --watch` on a pseudo-terminal for ``seconds``, then SIGINT (Ctrl-C)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 220, 0, 0))
    env = dict(os.environ, SUPERVISE_REGISTRY_DIR=str(registry), TERM="xterm-256color")
    for inherited in ("NO_COLOR", "COLUMNS", "LINES"):  # the terminal's own size (set below) decides
        env.pop(inherited, None)
    proc = subprocess.Popen(
        [*CLI, "status", "--watch", "--interval", "0.5"],
        cwd=ROOT,
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + seconds
        interrupted = False
        while True:
            # Ctrl-C once the live view has drawn at least twice (a loaded host may still be importing rich)
            if not interrupted and time.monotonic() > deadline and (out.lower().count(b"rank") >= 2
                                                                   or time.monotonic() > deadline + 15):
                proc.send_signal(signal.SIGINT)
                interrupted = True
                deadline = time.monotonic() + 10
            elif interrupted and time.monotonic() > deadline:
                break
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                if not chunk and proc.poll() is not None:
                    break
                out += chunk
            elif proc.poll() is not None and interrupted:
                break
        # keep draining the terminal while it exits: a child blocked writing its last frame to a full pty never would
        end = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < end:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    out += os.read(master, 65536)
                except OSError:
                    pass
        rc = proc.wait(timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return {"rc": rc, "out": out.decode(errors="replace")}
