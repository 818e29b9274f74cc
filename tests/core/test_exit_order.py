"""The exit monitor reports a cause before its consequence across wake-ups.

Real processes: a parent (the monitor's child, as a launcher is) starts a child
that asks for SIGKILL at its parent's death, as a tree-mode rank does.  One
thread of the parent is frozen (cgroup v1 freezer), so the parent's exit stays
unreadable after its first thread has exited and the child has died of its
parent-death signal: the child's exit is readable first, in its own wake-up.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.live import wait_for
from tests.support.freezer import freeze_thread, thaw
from tp_supervise.supervisor.events import ProcessExited
from tp_supervise.supervisor.processes import pidfds as procs
from tp_supervise.supervisor.processes.exit_monitor import PARENT_WAIT_S, ExitMonitor

# Prints "<child pid> <the id of the parent's second thread>" (the child prints it once its parent-death signal is
# set: on a loaded host a child printed for by its parent could still be without one when the parent exits), then
# the parent exits with code 3 once its stdin closes.
PARENT = r"""
import ctypes, os, sys, threading, time
side = threading.Thread(target=time.sleep, args=(10**6,), daemon=True)
side.start()
child = os.fork()
if child == 0:
    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    print(os.getpid(), side.native_id, flush=True)
    while True:
        time.sleep(1)
sys.stdin.read()
os._exit(3)
"""


class Family:
    """The monitor, what it reported, and one parent (with its child) under watch."""

    def __init__(self, tmp_path: Path):
        self.got: queue.SimpleQueue = queue.SimpleQueue()
        self.monitor = ExitMonitor(self.got.put)
        self.monitor.start()
        script = tmp_path / "parent.py"
        script.write_text(PARENT)
        self.parent = subprocess.Popen(
            [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.child, self.thread = (int(x) for x in self.parent.stdout.readline().split())
        self.fds = [procs.Pidfd.open(self.parent.pid, child=True), procs.Pidfd.open(self.child)]
        assert None not in self.fds
        self.monitor.watch("parent", self.fds[0], 1)
        self.monitor.watch("child", self.fds[1], 1, parent=self.parent.pid)

    def reports(self, n: int) -> list[ProcessExited]:
        return [self.got.get(timeout=10) for _ in range(n)]

    def close(self) -> None:
        self.parent.kill()
        self.parent.wait()
        self.parent.stdin.close()
        self.parent.stdout.close()
        self.monitor.stop()
        for fd in self.fds:
            fd.close()


@pytest.fixture
def family(tmp_path, freezer):
    """A watched parent and child; the parent's second thread is thawed (the freezer fixture) before the parent
    is killed and reaped, whatever the test did."""
    fam = Family(tmp_path)
    yield fam
    thaw(freezer)
    fam.close()


def wait_child_dead(fam: Family) -> None:
    wait_for(lambda: procs.is_gone(fam.child), 10, "the child dead of its parent-death signal")
    time.sleep(0.3)  # the monitor has read the child's exit by now


def test_a_child_dead_of_its_killed_parent_is_reported_after_the_parent(family, freezer):
    freeze_thread(freezer, family.thread)
    family.parent.kill()
    wait_child_dead(family)
    assert family.got.empty(), "the child's exit was reported while its parent's was not readable yet"
    thaw(freezer)
    first, second = family.reports(2)
    assert (first.key, second.key) == ("parent", "child")
    assert first.status is not None and first.status.signal == signal.SIGKILL
    assert second.status is not None and second.status.signal == signal.SIGKILL
    assert second.at < first.at, "the child's exit keeps the time it was read"


def test_a_parent_that_exits_on_its_own_after_its_child_comes_second(family, freezer):
    """A launcher that returns after its rank died is a consequence: the rank's exit is reported first."""
    freeze_thread(freezer, family.thread)
    family.parent.stdin.close()  # the parent exits (code 3) with one thread unable to follow
    wait_child_dead(family)
    assert family.got.empty()
    thaw(freezer)
    first, second = family.reports(2)
    assert (first.key, second.key) == ("child", "parent")
    assert second.status is not None and second.status.code == 3


def test_a_child_killed_while_its_parent_lives_is_reported_at_once(family):
    killed = time.monotonic()
    os.kill(family.child, signal.SIGKILL)
    (report,) = family.reports(1)
    assert report.key == "child" and report.status is not None and report.status.signal == signal.SIGKILL
    assert report.at - killed < PARENT_WAIT_S / 2, "held although its parent is not exiting"


def test_a_parent_that_only_lost_a_thread_delays_the_report_by_the_wait_at_most(family, freezer):
    """The parent seen exiting (its first thread gone) but not finished within the wait: the child's exit is
    reported after PARENT_WAIT_S, not later."""
    freeze_thread(freezer, family.thread)
    family.parent.kill()
    (report,) = family.reports(1)
    assert report.key == "child"
    assert time.monotonic() - report.at >= PARENT_WAIT_S * 0.9
    thaw(freezer)
    (last,) = family.reports(1)
    assert last.key == "parent"
