"""Arrival rings (issue 20): real rank processes stamp when they enter each collective; the supervisor's
reader sees, for the same collective, which rank arrived late.

The ranks are torch-free: they claim their heartbeat slot through the runtime (as under ``supervise
serve``, spawn mode) and run a real blocking exchange between them through pipes, entered the ways a
rank enters a collective: the runtime API, the zero-code hook's wrapper, the functional-collective path.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.rank import runtime
from tp_supervise.watchdogs.straggler import NAMED, StragglerConfig, StragglerDetector

ROOT = Path(__file__).resolve().parents[2]

RANK = textwrap.dedent(
    """
    import os, sys, time
    from tp_supervise.supervisor.rank import autohook, runtime as sv

    rank = int(os.environ["RANK"])
    w, r, way = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    seconds, slow_after, lag = float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
    sv.starting()
    sv.ready()

    def exchange():  # a blocking collective of two ranks: each waits for the other's arrival
        try:
            os.write(w, b"x")
        except BrokenPipeError:
            sys.exit(0)  # the peer's time was up first and it left
        if not os.read(r, 1):
            sys.exit(0)  # the peer is gone

    hooked = autohook._wrap_collective("all_reduce", exchange)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        time.sleep(0.004)  # the step's compute
        if rank == 1 and time.monotonic() - t0 >= slow_after:
            time.sleep(lag)
        if way == "api":
            with sv.collective("all_reduce", "8 float32"):
                exchange()
        elif way == "hook":
            hooked()
        else:  # the functional collectives' path (runtime.begin_collective / end_collective)
            sv.begin_collective("funcol.all_reduce")
            exchange()
            sv.end_collective()
    os.close(w)
    """
)


def env_for(seg: hb.HeartbeatSegment, rank: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISE_")}
    env.update({runtime.ENV_HEARTBEAT: str(seg.path), runtime.ENV_SLOT: str(rank), "RANK": str(rank)})
    return env


def start_pair(seg: hb.HeartbeatSegment, way: str, seconds: float, slow_after: float, lag: float) -> list:
    r01, w01 = os.pipe()
    r10, w10 = os.pipe()
    ends = {0: (w01, r10), 1: (w10, r01)}
    procs = []
    try:
        for rank in (0, 1):
            w, r = ends[rank]
            argv = [sys.executable, "-c", RANK, str(w), str(r), way, str(seconds), str(slow_after), str(lag)]
            procs.append(subprocess.Popen(argv, env=env_for(seg, rank), cwd=ROOT, pass_fds=(w, r),
                                          stderr=subprocess.PIPE, text=True))
    finally:
        for fd in (r01, w01, r10, w10):
            os.close(fd)
    return procs


def finish(procs: list, timeout: float = 60.0) -> None:
    for p in procs:
        try:
            _out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _out, err = p.communicate()
        assert p.returncode == 0, err[-3000:]


@pytest.mark.parametrize("way", ["api", "hook", "funcol"])
def test_the_reader_sees_which_rank_arrives_late_at_the_same_collective(tmp_path, way):
    seg = hb.HeartbeatSegment(tmp_path / "hb", 2, uuid.uuid4().hex, time.monotonic())
    try:
        finish(start_pair(seg, way, seconds=2.0, slow_after=0.0, lag=0.02))
        w0, w1 = seg.arrivals(0), seg.arrivals(1)
        s0, s1 = seg.read(0), seg.read(1)
    finally:
        seg.close()
    assert w0 is not None and w1 is not None
    assert (w0.rank, w1.rank) == (0, 1) and w0.pid == s0.pid and w1.pid == s1.pid
    assert abs(w0.count - w1.count) <= 1 and w0.count == s0.coll_seq, "one stamp per collective, the same numbering"
    assert len(w0.arrivals) == min(w0.count, hb.ARRIVAL_DEPTH - 1)
    common = range(max(w0.first_seq, w1.first_seq), min(w0.last_seq, w1.last_seq) + 1)
    assert len(common) > 30
    lags = [w1.get(n) - w0.get(n) for n in common]
    assert statistics.median(lags) > 0.015, "rank 1 arrives about 20 ms after rank 0 at the same collective"
    # rank 1 sleeps 20 ms before each exchange; on a loaded host rank 0 is sometimes descheduled longer than that
    assert sum(lag > 0.0 for lag in lags) >= 0.9 * len(lags), sorted(lags)[:5]
    assert all(b > a for a, b in zip(w0.arrivals, w0.arrivals[1:], strict=False)), "in order, one per collective"
    # The reader's heartbeat and collective begin are the newest stamp (the lane path stores no other time).
    assert s0.ts_coll_begin == w0.arrivals[-1] and s0.ts_heartbeat >= s0.ts_coll_begin


def test_the_detector_names_the_rank_that_turned_slow(tmp_path):
    """Real ranks, the supervisor's read loop, the pure detector on a short clock."""
    # A short clock, and a threshold well above what scheduling noise on a loaded host makes of a 4 ms loop.
    config = StragglerConfig(threshold=0.25, bucket_s=0.25, warmup_s=0.5, baseline_min_s=1.0, sustain_s=2.0,
                             clear_s=1.0, window_s=4.0)
    det = StragglerDetector(config)
    seg = hb.HeartbeatSegment(tmp_path / "hb", 2, uuid.uuid4().hex, time.monotonic())
    events, slowdown = [], None
    try:
        procs = start_pair(seg, "hook", seconds=10.0, slow_after=4.0, lag=0.01)
        started = time.monotonic()
        while any(p.poll() is None for p in procs) and time.monotonic() - started < 60:
            now = time.monotonic()
            windows = [seg.arrivals(slot, since=det.since(slot)) for slot in (0, 1)]
            events.extend(det.observe(windows, now).events)
            time.sleep(0.1)
        slowdown = started + 4.0
        finish(procs)
    finally:
        seg.close()
    assert [(e.kind, e.rank) for e in events][:1] == [(NAMED, 1)], [e.to_dict() for e in events]
    named = events[0]
    assert named.at > slowdown, "not before it turned slow (its normal pace was learned first)"
    assert named.lag.late_lag_s > 0.007 and "rank 1 arrives" in named.sentence()


STYLES = textwrap.dedent(
    """
    import json, os, time
    from tp_supervise.supervisor.rank import autohook, heartbeat as hb, runtime as sv

    sv.starting()
    sv.ready()
    seg = hb.HeartbeatSegment.attach(os.environ[sv.ENV_HEARTBEAT])

    class Manager:  # what torch's _coalescing_manager yields
        works = []
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return False

    def stamp(name, run):
        before = seg.arrivals(0)
        t0 = time.monotonic()
        run()
        t1 = time.monotonic()
        after = seg.arrivals(0)
        return {"way": name, "counted": after.count - before.count,
                "within": after.count > before.count and t0 <= after.arrivals[-1] <= t1}

    hooked = autohook._wrap_collective("barrier", lambda: None)
    issued = autohook._wrap_collective("isend", lambda tensor, dst: "work")  # p2p returning work

    def collective_api():
        with sv.collective("all_reduce", "8 float32"):
            pass

    def funcol():
        sv.begin_collective("funcol.all_reduce")
        sv.end_collective()

    def coalescing():
        with autohook._Coalescing(Manager()):
            pass

    def wait():  # blocking on work issued earlier: inside, not a collective of its own
        ln = sv.lane()
        ln.wait("all_reduce", "", None, time.monotonic())
        ln.leave()

    out = [stamp("runtime.collective", collective_api), stamp("hook blocking", hooked),
           stamp("hook p2p", lambda: issued(None, dst=1)), stamp("functional", funcol),
           stamp("coalescing", coalescing), stamp("work wait", wait)]
    print(json.dumps(out))
    """
)


def test_every_way_into_a_collective_stamps_one_arrival(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / "hb", 1, uuid.uuid4().hex, time.monotonic())
    try:
        proc = subprocess.run([sys.executable, "-c", STYLES], env=env_for(seg, 0), cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = {row["way"]: row for row in json.loads(proc.stdout.strip().splitlines()[-1])}
    finally:
        seg.close()
    for way in ("runtime.collective", "hook blocking", "hook p2p", "functional", "coalescing"):
        assert out[way]["counted"] == 1 and out[way]["within"], out[way]
    assert out["work wait"]["counted"] == 0, "a wait is not a collective: the issuing call was stamped"


def test_a_new_process_in_the_slot_starts_a_fresh_ring(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / "hb", 2, uuid.uuid4().hex, time.monotonic())
    try:
        finish(start_pair(seg, "api", seconds=0.5, slow_after=0.0, lag=0.0))
        first = seg.arrivals(0)
        finish(start_pair(seg, "api", seconds=0.2, slow_after=0.0, lag=0.0))
        second = seg.arrivals(0)
    finally:
        seg.close()
    assert second.pid != first.pid
    assert second.first_seq == 1 and len(second.arrivals) == second.count, "numbered from 1 again"
    assert min(second.arrivals) > max(first.arrivals), "nothing of the previous process's ring"
