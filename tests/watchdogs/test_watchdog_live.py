"""The policy on a real heartbeat segment written by real rank processes (torch-free)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.rank import runtime
from tp_supervise.watchdogs.policy import VerdictKind as K, WatchdogConfig, WatchdogState, observe

HERE = Path(__file__).resolve().parent
RANK_SCRIPT = HERE / "wd_fake_rank.py"
TICK = 0.05
STEP_S = 0.01
DEADLINE_S = 40.0


@contextmanager
def group(tmp_path: Path, mode: str, stop_after: int = -1):
    """Two fake ranks on one heartbeat segment, wired by two pipes; everything cleaned up after."""
    seg = hb.HeartbeatSegment(tmp_path / "hb", 2, uuid.uuid4().hex, time.monotonic())
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    wiring = [(a_w, b_r), (b_w, a_r)]  # rank 0 sends on A, receives on B; rank 1 the reverse
    procs: list[subprocess.Popen] = []
    try:
        for rank, (send, recv) in enumerate(wiring):
            env = dict(os.environ)
            env.update(
                {
                    runtime.ENV_HEARTBEAT: str(seg.path),
                    runtime.ENV_SLOT: str(rank),
                    runtime.ENV_SUPERVISOR_PID: str(os.getpid()),  # ranks exit if the test dies
                    "RANK": str(rank),
                    "WD_SEND_FD": str(send),
                    "WD_RECV_FD": str(recv),
                }
            )
            stop = str(stop_after) if rank == 1 else "-1"
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(RANK_SCRIPT), str(STEP_S), mode, stop],
                    env=env,
                    pass_fds=(send, recv),
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for fd in (a_r, a_w, b_r, b_w):
            os.close(fd)
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        yield seg, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
            p.stdout.close()
        for fd in (a_r, a_w, b_r, b_w):
            try:
                os.close(fd)
            except OSError:
                pass
        seg.close()


def watch(seg: hb.HeartbeatSegment, config: WatchdogConfig, seconds: float, until: K | None = None):
    """The supervisor's tick loop in miniature: read every slot, decide, keep (time, verdict)."""
    state = WatchdogState.initial(time.monotonic())
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = time.monotonic()
        state, verdict = observe(state, seg.read_all(), now, config)
        out.append((now, verdict))
        if until is not None and verdict.kind is until:
            break
        time.sleep(TICK)
    return out


def test_adaptive_detects_a_self_stopped_rank(tmp_path):
    """No timeout flags: after warm-up a rank that SIGSTOPs itself is named well under 60 s."""
    with group(tmp_path, "loop", stop_after=300) as (seg, procs):
        verdicts = watch(seg, WatchdogConfig(), DEADLINE_S, until=K.HARD)
        line = procs[1].stdout.readline()
    assert line.startswith("stopping "), line
    stopped_at = float(line.split()[1])
    before = [v for t, v in verdicts if t < stopped_at]
    assert before and not any(v.stalled for v in before), [v.message for v in before if v.stalled]
    assert before[-1].soft_source == "learned"  # warm-up finished before the fault
    fired = [(t, v) for t, v in verdicts if v.fired]
    assert [v.kind for _, v in fired] == [K.SOFT, K.HARD]
    (t_soft, soft), (t_hard, hard) = fired
    assert t_hard - stopped_at < 60.0 / 4  # "well under 60 s"; the floors make it ~3 s
    assert soft.in_collective and soft.in_collective[0].rank == 0 and soft.in_collective[0].op == "all_reduce"
    assert soft.outside_collective == (1,)
    print(f"detection: soft {t_soft - stopped_at:.2f} s, hard {t_hard - stopped_at:.2f} s after SIGSTOP")


def test_idle_ranks_never_hang_with_short_explicit_timeouts(tmp_path):
    with group(tmp_path, "idle") as (seg, _procs):
        verdicts = watch(seg, WatchdogConfig(soft_timeout=0.5, hard_timeout=1.0), 3.0)
    assert verdicts and {v.kind for _, v in verdicts} == {K.IDLE}
