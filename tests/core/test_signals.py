"""Every catchable signal to `supervise serve` has a defined meaning (issue 14; supervisor/signals.py).

SIGHUP (and the other stop signals) stop gracefully with exit 0 and leave
nothing: no process, no run directory, no registry entry.  SIGUSR1 writes an
on-demand bundle and the run goes on.  SIGQUIT writes a bundle, then stops.
A second stop signal cuts the grace short in any state.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import fake_rank
from tests.live import wait_for, wait_registry


def _started(supervise, tmp_path, action: str = "loop", grace: str = "3"):
    run = supervise(["--nproc-per-node", "2", "--kill-grace", grace], fake_rank("--all", action))
    entry = wait_registry(tmp_path / "registry")
    wait_for(lambda: run.proc.poll() is not None or any(Path("/dev/shm").glob(f"tp-supervise-{entry['run_id']}")),
             10, "the run directory")
    time.sleep(0.5)
    return run, entry


def _left_behind(tmp_path, entry) -> list[str]:
    left = [str(p) for p in (tmp_path / "registry").glob("*") if not p.name.startswith(".")]
    left += [str(p) for p in Path("/dev/shm").glob(f"tp-supervise-{entry['run_id']}")]
    return left


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR2, signal.SIGALRM],
                         ids=["SIGHUP", "SIGUSR2", "SIGALRM"])
def test_stop_signals_stop_gracefully_and_leave_nothing(supervise, tmp_path, signum):
    run, entry = _started(supervise, tmp_path)
    run.proc.send_signal(signum)
    assert run.wait(timeout=30) == 0, run.stderr[-3000:]
    stops = run.events("stopping on signal")
    assert stops and stops[0]["signal"] == signal.Signals(signum).name
    assert run.bundles() == []
    assert _left_behind(tmp_path, entry) == []
    assert run.events("teardown complete")


def test_sigusr1_writes_a_bundle_and_the_run_goes_on(supervise, tmp_path):
    run, entry = _started(supervise, tmp_path)
    run.proc.send_signal(signal.SIGUSR1)
    wait_for(lambda: [b for b in run.bundles() if (b / "summary.json").exists()], 30, "an on-demand bundle")
    assert run.proc.poll() is None, "SIGUSR1 must not stop the run"
    bundle = run.bundles()[0]
    summary = json.loads((bundle / "summary.json").read_text())
    assert summary["reason"] == "on_demand" and set(summary["ranks"]) == {"0", "1"}
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 0, run.stderr[-3000:]
    assert _left_behind(tmp_path, entry) == []


def test_sigquit_writes_a_bundle_then_stops(supervise, tmp_path):
    run, entry = _started(supervise, tmp_path)
    run.proc.send_signal(signal.SIGQUIT)
    assert run.wait(timeout=60) == 0, run.stderr[-3000:]
    bundles = [b for b in run.bundles() if "on_demand" in b.name]
    assert len(bundles) == 1, run.stderr[-3000:]
    summary = json.loads((bundles[0] / "summary.json").read_text())
    assert set(summary["ranks"]) == {"0", "1"} and all(r["pid"] for r in summary["ranks"].values())
    assert _left_behind(tmp_path, entry) == []


def _ignoring_sigterm(pid: int) -> list[int]:
    """The supervisor's children whose SIGTERM disposition is SIG_IGN (their /proc status)."""
    out = []
    for child in psutil.Process(pid).children():
        try:
            status = Path(f"/proc/{child.pid}/status").read_text()
        except OSError:
            continue
        ignored = int(status.split("SigIgn:")[1].split()[0], 16)
        if ignored & (1 << (signal.SIGTERM - 1)):
            out.append(child.pid)
    return out


def test_a_second_sigterm_cuts_the_grace_short(supervise, tmp_path):
    run, _entry = _started(supervise, tmp_path, action="ignore_term", grace="30")
    # Both ranks ignore SIGTERM before the first one comes (on a loaded host the run directory exists before a
    # rank has run that far: a rank that died of the first SIGTERM ended the run inside the grace).
    wait_for(lambda: len(_ignoring_sigterm(run.proc.pid)) == 2, 30, "both ranks ignoring SIGTERM")
    run.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=20) == 0
    assert time.monotonic() - t0 < 10, "a second SIGTERM must not wait for the 30 s grace"
    assert run.events("second stop signal")
