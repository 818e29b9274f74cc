"""Exit classification (pure) and the real kernel statuses it is fed."""

import os
import signal
import subprocess
import sys

import pytest

from tp_supervise.supervisor.processes import exits
from tp_supervise.supervisor.processes.exits import ExitStatus, classify


def test_codes():
    assert classify(ExitStatus(0, None), peers_running=False).reason == exits.CLEAN
    assert classify(ExitStatus(0, None), peers_running=True).reason == exits.EARLY_EXIT
    info = classify(ExitStatus(3, None), peers_running=True)
    assert info.reason == exits.NONZERO and "code 3" in info.description


@pytest.mark.parametrize(
    "sig,reason",
    [
        (signal.SIGABRT, exits.NATIVE_ABORT),
        (signal.SIGSEGV, exits.SEGFAULT),
        (signal.SIGBUS, exits.SEGFAULT),
        (signal.SIGKILL, exits.SIGNALED),
        (signal.SIGTERM, exits.SIGNALED),
    ],
)
def test_signals(sig, reason):
    info = classify(ExitStatus(None, sig, core_dumped=True), peers_running=True)
    assert info.reason == reason
    assert signal.Signals(sig).name in info.description
    assert "core dumped" in info.description
    assert info.to_dict()["signal"] == signal.Signals(sig).name


def test_oom_only_with_sigkill_and_rising_counter():
    said = "the kernel: Memory cgroup out of memory: Killed process 4437 (VLLM::Worker_TP)"
    oom = classify(ExitStatus(None, signal.SIGKILL), peers_running=True, oom_said=said)
    assert oom.reason == exits.OOM_KILLED and "OOM killer" in oom.description and "4437" in oom.description
    assert classify(ExitStatus(None, signal.SIGSEGV), peers_running=True, oom_said=said).reason == exits.SEGFAULT


@pytest.mark.parametrize(
    "code,expect",
    [
        ("import os; os._exit(5)", ExitStatus(5, None)),
        ("import os,signal; os.kill(os.getpid(), signal.SIGKILL)", ExitStatus(None, signal.SIGKILL)),
    ],
)
def test_from_waitid_on_real_processes(code, expect):
    proc = subprocess.Popen([sys.executable, "-c", code])
    fd = os.pidfd_open(proc.pid)
    try:
        import select

        select.select([fd], [], [], 10)
        result = os.waitid(os.P_PIDFD, fd, os.WEXITED)
    finally:
        os.close(fd)
        proc.returncode = 0
    st = ExitStatus.from_waitid(result)
    assert (st.code, st.signal) == (expect.code, expect.signal)


def test_oom_counter_reads_without_error():
    counter = exits.OomCounter()
    assert counter.rose() is False
