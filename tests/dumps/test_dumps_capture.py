"""Stack capture against real fake-rank processes: py-spy, the faulthandler fallback, timeouts."""

from __future__ import annotations

import os
import signal
import stat
import time

import pytest

from tp_supervise.dumps.capture import ENV_PYSPY, RankTarget, capture_all, find_pyspy
from tp_supervise.supervisor.rank.runtime import stack_file_path

# Generous bounds: the machine is shared; timing goals live in bench/.
PER_RANK_S = 5.0
DEADLINE_S = 8.0


def main_functions(ev) -> list[str]:
    main = next(t for t in ev.threads if t.is_main)
    return [f.base_function for f in main.python_frames]


needs_pyspy = pytest.mark.skipif(find_pyspy() is None, reason="py-spy not installed")


def capture(ranks, method, **kw):
    return capture_all(
        ranks.targets(), run_dir=ranks.run_dir, method=method, per_rank_timeout_s=PER_RANK_S, deadline_s=DEADLINE_S, **kw
    )


@needs_pyspy
def test_pyspy_names_every_ranks_function(fake_ranks):
    ranks = fake_ranks(3)
    ranks.start({0: "collective", 1: "python", 2: "collective"})
    ev = capture(ranks, "py-spy")
    assert set(ev.ranks) == {0, 1, 2}
    for r in (0, 2):
        assert ev.ranks[r].method == "py-spy" and "wait_in_all_reduce" in main_functions(ev.ranks[r])
    assert main_functions(ev.ranks[1])[0] == "stuck_in_user_code"
    assert all(e.state in ("R", "S") and e.error is None for e in ev.ranks.values())
    assert all(e.proc.num_threads >= 2 for e in ev.ranks.values())  # main + death watch
    assert ev.ranks[1].heartbeat.phase == "user_code" and ev.ranks[0].heartbeat.in_collective


def test_faulthandler_fallback_names_every_ranks_function(fake_ranks):
    ranks = fake_ranks(3)
    ranks.start({0: "collective", 1: "python", 2: "collective"})
    ev = capture(ranks, "faulthandler")
    for r in (0, 2):
        assert ev.ranks[r].method == "faulthandler" and "wait_in_all_reduce" in main_functions(ev.ranks[r])
    assert main_functions(ev.ranks[1])[0] == "stuck_in_user_code"
    # the ranks survived their stack signal and keep their place
    assert all(p.poll() is None for p in ranks.procs.values())
    again = capture(ranks, "faulthandler")
    assert main_functions(again.ranks[1])[0] == "stuck_in_user_code"  # second dump reads only new bytes


def test_auto_falls_back_when_pyspy_configured_away(fake_ranks, monkeypatch):
    monkeypatch.setenv(ENV_PYSPY, "/nonexistent/py-spy")
    assert find_pyspy() is None
    ranks = fake_ranks(2)
    ranks.start({0: "collective", 1: "python"})
    ev = capture(ranks, "auto")
    assert ev.pyspy is None
    for e in ev.ranks.values():
        assert e.method == "faulthandler" and e.has_stacks
        assert "py-spy unavailable" in e.attempts[0]
    assert main_functions(ev.ranks[1])[0] == "stuck_in_user_code"


@needs_pyspy
def test_stopped_rank_pyspy_nonblocking(fake_ranks):
    ranks = fake_ranks(2)
    ranks.start({0: "collective", 1: "python"})
    ranks.stop(1)
    ev = capture(ranks, "py-spy")
    e = ev.ranks[1]
    assert e.state == "T" and e.method == "py-spy --nonblocking"
    assert main_functions(e)[0] == "stuck_in_user_code"
    assert ev.ranks[0].method == "py-spy"  # a running rank still gets the consistent (blocking) dump


def test_stopped_rank_fallback_says_so_and_sends_nothing(fake_ranks):
    ranks = fake_ranks(2)
    ranks.start({0: "collective", 1: "python"})
    ranks.stop(1)
    pid = ranks.procs[1].pid
    path = stack_file_path(ranks.run_dir, 1, pid)
    before = os.path.getsize(path)
    ev = capture(ranks, "faulthandler")
    e = ev.ranks[1]
    assert not e.has_stacks and e.state == "T"
    assert "stopped" in e.error and "cannot run its signal handler" in e.error
    assert ev.ranks[0].has_stacks
    os.kill(pid, signal.SIGCONT)
    time.sleep(0.3)
    assert os.path.getsize(path) == before  # no stack signal was queued for later


def test_rank_without_stack_signal_is_never_signalled(fake_ranks, monkeypatch):
    """SIGUSR2's default action would kill a rank that registered no handler."""
    monkeypatch.setenv(ENV_PYSPY, "off")
    ranks = fake_ranks(1, stack_signal=0)
    ranks.start({0: "python"})
    ev = capture(ranks, "auto")
    assert "registered no stack signal" in ev.ranks[0].error
    assert ranks.procs[0].poll() is None


def test_hanging_pyspy_is_bounded_by_the_deadline(fake_ranks, monkeypatch, tmp_path):
    hang = tmp_path / "py-spy"
    hang.write_text("#!/bin/sh\nexec sleep 60\n")
    hang.chmod(hang.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(ENV_PYSPY, str(hang))
    ranks = fake_ranks(2)
    ranks.start({0: "collective", 1: "python"})
    start = time.monotonic()
    ev = capture_all(ranks.targets(), run_dir=ranks.run_dir, method="py-spy", per_rank_timeout_s=0.6, deadline_s=1.0)
    took = time.monotonic() - start
    assert took < 4.0  # deadline 1 s; generous margin, the point is "not 60 s"
    for e in ev.ranks.values():
        assert not e.has_stacks and e.error.startswith("no stacks (timeout after")
    # auto: the fallback still gets stacks after py-spy timed out
    ev = capture_all(ranks.targets(), run_dir=ranks.run_dir, method="auto", per_rank_timeout_s=3.0, deadline_s=4.0)
    assert all(e.method == "faulthandler" and e.has_stacks for e in ev.ranks.values())


def test_dead_and_gone_ranks(fake_ranks):
    ranks = fake_ranks(3)
    ranks.start({0: "collective", 1: "python", 2: "collective"})
    exit_info = ranks.kill(1)
    targets = ranks.targets()
    ghost = RankTarget(rank=2, slot=2, pid=targets[2].pid, alive=True, heartbeat=targets[2].heartbeat)
    ranks.kill(2)  # the supervisor still believes rank 2 alive: its pid is gone
    ev = capture_all([targets[0], targets[1], ghost], run_dir=ranks.run_dir, per_rank_timeout_s=PER_RANK_S, deadline_s=DEADLINE_S)
    assert ev.ranks[1].error == "rank is not running" and ev.ranks[1].exit == exit_info
    assert ev.ranks[2].error == "process gone" and ev.ranks[2].proc is None
    assert ev.ranks[0].has_stacks


def test_cpu_use_and_previous_sample(fake_ranks):
    ranks = fake_ranks(2)
    ranks.start({0: "collective", 1: "spin"})
    ev = capture(ranks, "none")
    idle, spin = ev.ranks[0], ev.ranks[1]
    assert idle.cpu_window_s and idle.cpu_window_s >= 0.09
    assert idle.cpu_fraction < 0.2 and spin.cpu_fraction > idle.cpu_fraction
    assert spin.error == "stack capture off (method none)"
    time.sleep(0.2)
    later = capture(ranks, "none", previous=ev.samples)
    assert later.ranks[1].cpu_window_s >= 0.2  # measured since the previous sample
    assert later.ranks[1].cpu_used_s > 0
    assert later.ranks[0].prev_progress == (ev.ranks[0].heartbeat.step, ev.ranks[0].heartbeat.coll_seq)


def test_unknown_method_rejected(fake_ranks):
    with pytest.raises(ValueError):
        capture_all([], run_dir=".", method="gdb", per_rank_timeout_s=1, deadline_s=1)


@needs_pyspy
def test_native_frames_do_not_change_the_signature(fake_ranks):
    from tp_supervise.dumps.stacks import stack_signature

    ranks = fake_ranks(1)
    ranks.start({0: "python"})
    plain = capture(ranks, "py-spy").ranks[0]
    native = capture(ranks, "py-spy", native=True).ranks[0]
    assert any(f.native for t in native.threads for f in t.frames)
    assert "[native]" in native.stack_text
    assert stack_signature(native.threads) == stack_signature(plain.threads)
