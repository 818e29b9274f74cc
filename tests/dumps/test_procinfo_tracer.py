"""A tracing stop held by our own stack capture (a child of this process attached with ptrace, as py-spy is) is not
the process's state; a tracer that is not ours (a debugger) is.  Real processes, a real PTRACE_ATTACH."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tp_supervise.dumps.procinfo import CAPTURE_HELD, held_by_our_capture, proc_state, read_proc

ATTACH = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
if libc.ptrace(16, int(sys.argv[1]), None, None) != 0:  # PTRACE_ATTACH
    sys.exit(f"ptrace: errno {ctypes.get_errno()}")
print("attached", flush=True)
time.sleep(60)
"""
# A tracer that is not our child: our child starts it and waits (its parent is that child, not us).
GRANDCHILD = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]])"


def raw_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def wait_state(pid: int, letter: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while raw_state(pid) != letter:
        assert time.monotonic() < deadline, raw_state(pid)
        time.sleep(0.05)


@pytest.mark.skipif(os.geteuid() != 0, reason="attaching to a process that is not the tracer's child needs root")
@pytest.mark.parametrize("ours", [True, False])
def test_a_tracing_stop_is_the_processes_only_when_the_tracer_is_not_ours(ours):
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    argv = [sys.executable, "-c", ATTACH, str(target.pid)]
    tracer = subprocess.Popen(argv if ours else [sys.executable, "-c", GRANDCHILD, ATTACH, str(target.pid)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        assert tracer.stdout.readline().strip() == "attached"
        wait_state(target.pid, "t")
        assert held_by_our_capture(target.pid) is ours
        expected = CAPTURE_HELD if ours else "t"
        assert proc_state(target.pid) == expected and read_proc(target.pid).state == expected
    finally:
        os.killpg(tracer.pid, signal.SIGKILL)  # the tracer, and its wrapper's child where it is a grandchild
        target.kill()
        for p in (tracer, target):
            p.wait()
