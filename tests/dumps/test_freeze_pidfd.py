"""The freeze signals ranks through pidfds (issue 11): a group both ways, never a reaped rank.

Real processes: a rank that leads its session with a child, stopped and
resumed as a group through its pidfd (``PIDFD_SIGNAL_PROCESS_GROUP``) and,
as on kernels before 6.9, through the leader's pidfd then ``killpg``; a rank
reaped after its pidfd was opened is not signalled again, whichever way.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from tp_supervise.dumps.freeze import Held
from tp_supervise.dumps.procinfo import _group_by_pidfd
from tp_supervise.dumps.procinfo import proc_state

STATE_WAIT_S = 5.0


def wait_states(pids, letter: str) -> None:
    deadline = time.monotonic() + STATE_WAIT_S
    while time.monotonic() < deadline:
        if all(proc_state(pid) == letter for pid in pids):
            return
        time.sleep(0.01)
    pytest.fail(f"not all of {pids} reached state {letter}: {[proc_state(p) for p in pids]}")


@pytest.fixture
def group():
    """A rank leading its own session, with one child in its group."""
    leader = subprocess.Popen(["bash", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = int(leader.stdout.readline())
    yield leader, child
    leader.kill()
    subprocess.run(["kill", "-KILL", str(child)], check=False)
    leader.wait()
    leader.stdout.close()


@pytest.mark.parametrize("by_pidfd", [True, False], ids=["pidfd-group", "killpg-fallback"])
def test_a_group_is_stopped_and_resumed_through_the_leaders_pidfd(group, by_pidfd):
    leader, child = group
    held = Held.open(leader.pid)
    assert held is not None
    held.group = True
    saved = _group_by_pidfd[0]
    _group_by_pidfd[0] = by_pidfd and saved
    try:
        assert held.send(signal.SIGSTOP)
        wait_states([leader.pid, child], "T")
        assert held.send(signal.SIGCONT)
        wait_states([leader.pid, child], "S")
    finally:
        _group_by_pidfd[0] = saved
        held.close()
    assert not held.send(signal.SIGCONT), "a closed hold signals nobody"


@pytest.mark.parametrize("as_group", [False, True])
def test_a_reaped_rank_is_not_signalled(as_group):
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    held = Held.open(proc.pid)
    assert held is not None
    held.group = as_group
    proc.kill()
    proc.wait()  # reaped: its pid may be handed out again from now on
    try:
        assert not held.send(signal.SIGSTOP)
        saved = _group_by_pidfd[0]
        _group_by_pidfd[0] = False
        try:
            assert not held.send(signal.SIGSTOP), "the killpg fallback needs the leader to hold its pid"
        finally:
            _group_by_pidfd[0] = saved
    finally:
        held.close()
