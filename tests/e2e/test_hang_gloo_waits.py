"""Issue 11: every way a rank waits on its peers is seen, with no supervisor
code in the program (the zero-code hook instruments torch.distributed).

Real processes, real gloo: an ``async_op=True`` all_reduce and a
``batch_isend_irecv`` ring whose ``wait()`` blocks on a stopped peer are
hangs; a thread finishing barriers does not make a rank blocked in an
all_reduce on another thread look idle.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tp_supervise.supervisor.processes.spawn import HOOK_DIR
from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.rank.net import free_port

pytestmark = pytest.mark.e2e

FAKES = Path(__file__).resolve().parents[1] / "fakes"
GLOO = str(FAKES / "gloo_loop.py")
THREADS = str(FAKES / "gloo_threads.py")
WAYS = str(FAKES / "gloo_ways.py")
SOFT_S, HARD_S = 3, 6
DETECTION_BOUND_S = HARD_S + 5  # fault -> supervisor exit (generous: a 2-core machine)
RUN_TIMEOUT_S = 120


def fault_instant(stderr: str) -> float:
    found = re.search(r"fault stop at ([0-9.]+)", stderr)  # a rank_output line (JSON) or raw
    assert found, f"the fault rank did not log its fault\n{stderr[-3000:]}"
    return float(found.group(1))


@pytest.mark.parametrize("mode, op", [("--async", "all_reduce"), ("--p2p", "batch_isend_irecv")])
def test_wait_on_a_stopped_peer_is_a_hang(supervise, mode, op):
    run = supervise(
        ["--nproc-per-node", "2", "--soft-timeout", str(SOFT_S), "--hard-timeout", str(HARD_S), "--kill-grace", "2"],
        [sys.executable, GLOO, mode, "--iters", "100000", "--fault", "stop", "--fault-at", "30"],
    )
    assert run.wait(timeout=RUN_TIMEOUT_S) == 81, run.stderr[-4000:]
    took = run.ended - fault_instant(run.stderr)
    assert took <= DETECTION_BOUND_S, f"exit {took:.1f} s after the fault"
    hang = run.summary("-hang")
    assert hang["reason"] == "hang"
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["ranks"]["1"]["state"] == "T"
    waiting = hang["ranks"]["0"]
    assert waiting["in_collective"] and waiting["collective"].startswith(op), waiting
    bundle = [b for b in run.bundles() if b.name.endswith("-hang") or "-hang-" in b.name][-1]
    assert (bundle / "stacks" / "rank-0.txt").read_text().strip()


def _start_rank(rank: int, world: int, port: int, seg: hb.HeartbeatSegment, script: str,
                *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH", "")) if p),
        "SUPERVISE_RUN_ID": seg.path.name,
        "SUPERVISE_HEARTBEAT": str(seg.path),
        "SUPERVISE_SLOT": str(rank),
        "SUPERVISE_SUPERVISOR_PID": str(os.getpid()),  # the rank exits if the test dies
    }
    return subprocess.Popen([sys.executable, script, *args], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_barriers_on_another_thread_do_not_hide_a_blocked_all_reduce(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / f"hb-{uuid.uuid4().hex}", 2, "threads", time.monotonic())
    port = free_port()
    ranks = [_start_rank(r, 2, port, seg, THREADS) for r in range(2)]
    try:
        line = ranks[0].stdout.readline()
        assert line.strip() == "barriers running", f"rank 0 said {line!r}, exit {ranks[0].poll()}"
        time.sleep(0.5)  # the main thread is inside its all_reduce by now
        first = seg.read(0)
        samples = []
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            samples.append(seg.read(0))
            time.sleep(0.005)
        last = seg.read(0)
        assert last.coll_seq > first.coll_seq, "the barrier thread made no progress"
        outside = [s for s in samples if not (s.in_collective or s.torn)]
        assert not outside, f"{len(outside)} of {len(samples)} reads saw rank 0 outside collectives"
        assert last.in_collective and last.pid == ranks[0].pid
    finally:
        _kill(ranks)
        seg.close()


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


# (way, op the slot names while rank 0 waits); gloo_ways.py does them in this order.
EXPECTED_OPS = [
    ("all_reduce", "all_reduce"),
    ("async_wait", "all_reduce"),
    ("future_wait", "all_reduce"),
    ("polled", "all_reduce"),
    ("swept", "all_reduce"),
    ("dropped", "all_reduce"),
    ("recv", "recv"),
    ("irecv_wait", "irecv"),
    ("batch_p2p", "batch_isend_irecv"),
    ("barrier", "barrier"),
    ("barrier_async", "barrier"),
    ("objects", "all_gather_object"),
    ("coalesced", "_coalescing_manager"),
    ("monitored_barrier", "monitored_barrier"),
    ("funcol", "funcol.all_reduce.wait"),
]
SEEN_WITHIN_S = 3.0  # the monitor publishes works in flight every 0.1 s; a loaded 2-core machine is slow


def _lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line.strip())
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _until(seg: hb.HeartbeatSegment, inside: bool, within: float = SEEN_WITHIN_S) -> hb.SlotSnapshot:
    deadline = time.monotonic() + within
    while True:
        snap = seg.read(0)
        if (snap.in_collective == inside and not snap.torn) or time.monotonic() > deadline:
            return snap
        time.sleep(0.01)


def _stopped(pid: int) -> None:
    deadline = time.monotonic() + SEEN_WITHIN_S
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError("rank 1 did not stop itself")


def test_every_way_of_waiting_on_a_peer_is_in_collective(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / f"hb-{uuid.uuid4().hex}", 2, "ways", time.monotonic())
    port = free_port()
    ranks = [_start_rank(r, 2, port, seg, WAYS, *[w for w, _ in EXPECTED_OPS]) for r in range(2)]
    lines = _lines(ranks[0])

    def said(*expected: str) -> None:
        line = lines.get(timeout=60)
        assert line in expected, f"rank 0 said {line!r}, expected {expected} (exit {ranks[0].poll()})"

    def tell_rank0() -> None:
        ranks[0].stdin.write("\n")
        ranks[0].stdin.flush()

    try:
        for way, op in EXPECTED_OPS:
            said(f"enter {way}", f"holding {way}")
            _stopped(ranks[1].pid)
            snap = _until(seg, inside=True)
            assert snap.in_collective, f"{way}: rank 0 waits on its stopped peer but looks idle: {snap}"
            assert snap.coll_op == op, f"{way}: the slot names {snap.coll_op!r}"
            if way == "dropped":  # a collected work is no longer in flight, though its peer never came
                tell_rank0()
                said(f"dropped {way}")
                assert not _until(seg, inside=False).in_collective, f"{way}: still in collective"
                os.kill(ranks[1].pid, signal.SIGCONT)
                tell_rank0()
            elif way == "swept":  # completed, never asked: the monitor sees it complete
                os.kill(ranks[1].pid, signal.SIGCONT)
                started = time.monotonic()
                assert not _until(seg, inside=False).in_collective, f"{way}: still in collective"
                assert time.monotonic() - started < 1.5, f"{way}: noticed only when the program dropped it"
            else:
                os.kill(ranks[1].pid, signal.SIGCONT)
            said(f"left {way}")
            snap = _until(seg, inside=False)
            assert not snap.in_collective, f"{way}: rank 0 is done waiting but looks in collective: {snap}"
            tell_rank0()
        said("done")
    finally:
        _kill(ranks)
        seg.close()
