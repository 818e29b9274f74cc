"""Stacks without root: a rank lets the supervisor and its descendants (py-spy) ptrace it.

Under Yama ``ptrace_scope=1`` a process may attach only to its descendants;
py-spy is the supervisor's child, the rank's sibling.  This test process
plays the supervisor: it starts a "rank" and then py-spy, both its children.
The Yama tests run only where they can fail: Yama enabled at scope 1, and
this process without ``CAP_SYS_PTRACE`` (which bypasses scope 1); elsewhere
they skip and say which condition is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tp_supervise.dumps.capture import find_pyspy
from tp_supervise.supervisor.rank import ptrace
from tp_supervise.supervisor.rank.runtime import ENV_SUPERVISOR_PID

CAP_SYS_PTRACE = 19
PYSPY_TIMEOUT_S = 30
RANK_LIFETIME_S = 60
# A "rank": optionally names its tracer through the runtime, says so, then waits in a named function.
RANK = """
import sys, time
if sys.argv[1] == "runtime":
    from tp_supervise.supervisor.rank import runtime
    runtime._allow_supervisor_to_trace()
def waiting_for_py_spy():
    print("ready", flush=True)
    time.sleep(float(sys.argv[2]))
waiting_for_py_spy()
"""


def _has_cap_sys_ptrace() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    return False


def _yama_scope_1_applies() -> None:
    scope = ptrace.yama_scope()
    if scope is None:
        pytest.skip(f"Yama is not enabled on this kernel ({ptrace.YAMA_SCOPE_FILE} missing)")
    if scope != 1:
        pytest.skip(f"kernel.yama.ptrace_scope is {scope}; this test needs 1 (0: no restriction, 2/3: PR_SET_PTRACER does not help)")
    if _has_cap_sys_ptrace():
        pytest.skip("this process has CAP_SYS_PTRACE (root or the capability), which scope 1 does not restrict")
    if find_pyspy() is None:
        pytest.skip("py-spy not found")


def _start_rank(mode: str, preexec_fn=None) -> subprocess.Popen:
    env = dict(os.environ, **{ENV_SUPERVISOR_PID: str(os.getpid())})
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK, mode, str(RANK_LIFETIME_S)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=preexec_fn,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _pyspy_dump(pid: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [find_pyspy(), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=PYSPY_TIMEOUT_S
    )


@pytest.fixture
def ranks():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_allow_tracer_is_a_bool_and_never_raises():
    for bad in (0, -1, "1", None, 2**70):
        assert ptrace.allow_tracer(bad) is False
    # Naming oneself succeeds exactly where Yama is there to take it.
    assert ptrace.allow_tracer(os.getpid()) is (ptrace.yama_scope() is not None)


def test_py_spy_is_refused_without_the_relation_and_allowed_with_it(ranks):
    _yama_scope_1_applies()
    plain = _start_rank("plain")
    ranks.append(plain)
    refused = _pyspy_dump(plain.pid)
    assert refused.returncode != 0, "scope 1 let a sibling attach: this test cannot show anything here"

    rank = _start_rank("runtime")  # the rank-side runtime names the supervisor (this process)
    ranks.append(rank)
    allowed = _pyspy_dump(rank.pid)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "waiting_for_py_spy" in allowed.stdout


def test_relation_set_between_fork_and_exec_survives_exec(ranks):
    """What the spawn path does: the child names its tracer before it runs the rank's program."""
    _yama_scope_1_applies()
    supervisor = os.getpid()
    rank = _start_rank("plain", preexec_fn=lambda: ptrace.allow_tracer(supervisor))
    ranks.append(rank)
    allowed = _pyspy_dump(rank.pid)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "waiting_for_py_spy" in allowed.stdout
