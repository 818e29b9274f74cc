"""Several threads of one rank writing its heartbeat slot (issue 11).

The rank is "in collective" while any thread is inside one (or any issued
work is in flight): one thread leaving must not hide another still inside,
and concurrent writers must never break the slot's seqlock parity.  The
threads switch as often as the interpreter allows, to interleave updates.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.rank.slot_writer import SlotWriter

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 1500


@contextmanager
def switching_often():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def seq_of(seg: hb.HeartbeatSegment, slot: int) -> int:
    data = seg.path.read_bytes()
    return struct.unpack_from("<Q", data, hb.HEADER_SIZE + slot * hb.SLOT_SIZE)[0]


def claimed_writer(seg: hb.HeartbeatSegment) -> SlotWriter:
    w = SlotWriter(seg.path, 0)
    w.claim(1234, 0, 0, 0, time.monotonic())
    return w


def sample_while(seg: hb.HeartbeatSegment, running: threading.Event, seen: list) -> None:
    while running.is_set():
        seen.append(seg.read(0))


def run_threads(targets, seg) -> list:
    """Run ``targets`` in threads while another reads the slot; the reads."""
    seen: list[hb.SlotSnapshot] = []
    running = threading.Event()
    running.set()
    reader = threading.Thread(target=sample_while, args=(seg, running, seen))
    workers = [threading.Thread(target=t) for t in targets]
    with switching_often():
        reader.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        running.clear()
        reader.join()
    return seen


def test_holders_on_many_threads_keep_the_flag_and_the_parity(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / "hb", 1, "run-x", time.monotonic())
    w = claimed_writer(seg)
    w.collective_begin("all_reduce", "64x256 float32", time.monotonic())  # blocked for the whole test

    def barriers():
        for _ in range(ITERATIONS):
            w.collective_begin("barrier", "", time.monotonic())
            w.collective_end(time.monotonic())

    seen = run_threads([barriers] * 4, seg)
    outside = [s for s in seen if not s.torn and not s.in_collective]
    assert not outside, f"{len(outside)} of {len(seen)} reads saw the rank outside collectives"
    assert seq_of(seg, 0) % 2 == 0, "an update left the seqlock odd"
    s = seg.read(0)
    assert not s.torn and s.in_collective and s.coll_seq == 1 + 4 * ITERATIONS
    w.collective_end(time.monotonic())
    assert not seg.read(0).in_collective
    seg.close()


def test_lanes_and_holders_together(tmp_path):
    """Six threads for four lanes: four enter through lanes, two through the holder count."""
    seg = hb.HeartbeatSegment(tmp_path / "hb", 1, "run-x", time.monotonic())
    w = claimed_writer(seg)
    blocked = w.lane()
    blocked.enter("all_reduce", "", time.monotonic())  # blocked for the whole test
    lanes = [w.lane() for _ in range(hb.LANES - 1)]
    assert all(lanes) and w.lane() is None, "expected exactly LANES lanes"

    def through_lane(ln):
        def run():
            for i in range(ITERATIONS):
                if i % 2:
                    ln.enter("barrier", "", time.monotonic())
                    ln.leave()
                else:
                    ln.call("broadcast", lambda n: None, (i,), {}, time.monotonic())
        return run

    def through_holders():
        for _ in range(ITERATIONS):
            w.collective_begin("all_gather", "8 int64", time.monotonic())
            w.collective_end(time.monotonic())

    seen = run_threads([through_lane(ln) for ln in lanes] + [through_holders] * 2, seg)
    outside = [s for s in seen if not s.torn and not s.in_collective]
    assert not outside, f"{len(outside)} of {len(seen)} reads saw the rank outside collectives"
    assert seq_of(seg, 0) % 2 == 0
    s = seg.read(0)
    assert s.in_collective and s.coll_seq == 1 + (hb.LANES - 1 + 2) * ITERATIONS
    assert (s.coll_op, s.coll_desc) == ("all_reduce", ""), "the text describes the lane still inside"
    blocked.leave()
    s = seg.read(0)
    assert not s.in_collective and s.coll_seq == 1 + (hb.LANES - 1 + 2) * ITERATIONS
    seg.close()


def test_a_lane_freed_by_its_thread_keeps_counting(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / "hb", 1, "run-x", time.monotonic())
    w = claimed_writer(seg)
    ln = w.lane()
    for _ in range(3):
        ln.call("all_reduce", lambda: None, (), {}, time.monotonic())
    ln.enter("all_reduce", "", time.monotonic())  # its thread ends inside (cannot happen in Python; be safe)
    w.release_lane(ln)
    s = seg.read(0)
    assert s.coll_seq == 4 and not s.in_collective
    again = w.lane()
    again.call("all_reduce", lambda: None, (), {}, time.monotonic())
    assert seg.read(0).coll_seq == 5
    seg.close()


def test_late_description_of_a_long_call(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / "hb", 1, "run-x", time.monotonic())
    w = claimed_writer(seg)
    ln = w.lane()

    def long_call(tensor):
        assert (seg.read(0).coll_op, seg.read(0).coll_desc) == ("all_reduce", "")
        assert w.describe_late(lambda args, kwargs: f"{len(args)} arg {args[0]}")
        assert seg.read(0).coll_desc == "1 arg x"

    def next_call(tensor):
        assert seg.read(0).coll_desc == "", "a description never outlives its call"

    ln.call("all_reduce", long_call, ("x",), {}, time.monotonic())
    ln.call("all_reduce", next_call, ("y",), {}, time.monotonic())
    assert not w.describe_late(lambda args, kwargs: "late"), "nothing runs: nothing to describe"
    seg.close()


def test_runtime_threads_in_a_rank(tmp_path):
    """The runtime API from several threads of a real process, read from outside."""
    seg = hb.HeartbeatSegment(tmp_path / "hb", 1, "run-x", time.monotonic())
    code = textwrap.dedent(
        f"""
        import sys, threading
        sys.setswitchinterval(1e-6)
        from tp_supervise.supervisor.rank import runtime as sv
        sv.starting(); sv.ready()
        inside, leave = threading.Event(), threading.Event()
        def blocked():
            with sv.collective("all_reduce", "64x256 float32"):
                inside.set()
                leave.wait()
        def barriers():
            for _ in range({ITERATIONS}):
                with sv.collective("barrier", ""):
                    pass
        a = threading.Thread(target=blocked); a.start(); inside.wait()
        others = [threading.Thread(target=barriers) for _ in range(5)]
        for t in others: t.start()
        print("running", flush=True)
        for t in others: t.join()
        print("done", flush=True)
        sys.stdin.readline()
        leave.set(); a.join()
        """
    )
    env = {"SUPERVISE_HEARTBEAT": str(seg.path), "SUPERVISE_SLOT": "0", "RANK": "0", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "running"
        seen = []
        while proc.poll() is None and len(seen) < 20000:
            seen.append(seg.read(0))
            if seen[-1].coll_seq >= 1 + 5 * ITERATIONS:
                break
        assert proc.stdout.readline().strip() == "done"
        seen.append(seg.read(0))
        outside = [s for s in seen if not s.torn and not s.in_collective]
        assert not outside, f"{len(outside)} of {len(seen)} reads saw the rank outside collectives"
        assert seen[-1].coll_seq == 1 + 5 * ITERATIONS
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    s = seg.read(0)
    assert not s.in_collective and seq_of(seg, 0) % 2 == 0
    seg.close()
