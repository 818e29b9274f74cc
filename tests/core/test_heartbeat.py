"""The heartbeat segment: layout, single writer, torn reads, cross-process."""

import subprocess
import sys
import textwrap
import time

from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.rank.slot_writer import SlotWriter


def test_writer_updates_are_seen_by_reader(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / "hb", 4, "run-x", time.monotonic())
    w = SlotWriter(seg.path, 2)
    w.claim(1234, 10, 35, 0, time.monotonic())
    w.change_flags(time.monotonic(), add=hb.READY)
    w.step_begin(time.monotonic())
    w.collective_begin("all_reduce", "64x256 float32", time.monotonic())
    s = seg.read(2)
    assert (s.pid, s.rank, s.stack_signal) == (1234, 10, 35)
    assert s.claimed and s.ready and s.in_step and s.in_collective and s.busy
    assert (s.coll_seq, s.coll_op, s.coll_desc) == (1, "all_reduce", "64x256 float32")
    w.collective_end(time.monotonic())
    w.step_end(time.monotonic())
    s = seg.read(2)
    assert not s.busy and s.step == 1 and s.last_step_s >= 0
    assert not seg.read(0).claimed and seg.read(0).rank == -1
    seg.close()
    assert not (tmp_path / "hb").exists()


def test_torn_slot_is_reported_not_waited_on(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / "hb", 1, "run-x", time.monotonic())
    w = SlotWriter(seg.path, 0)
    w.claim(1, 0, 0, 0, time.monotonic())
    w._open()  # a writer stopped mid-update (e.g. SIGSTOP)
    t0 = time.monotonic()
    s = seg.read(0)
    assert s.torn
    assert time.monotonic() - t0 < 0.5


def test_bad_slot_and_layout_are_rejected(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / "hb", 1, "run-x", time.monotonic())
    try:
        SlotWriter(seg.path, 5)
    except hb.HeartbeatLayoutError as exc:
        assert "slot 5" in str(exc)
    else:
        raise AssertionError("slot outside the segment accepted")
    (tmp_path / "junk").write_bytes(b"\0" * 512)
    try:
        SlotWriter(tmp_path / "junk", 0)
    except hb.HeartbeatLayoutError:
        pass
    else:
        raise AssertionError("junk accepted as a heartbeat segment")


def test_runtime_in_another_process(tmp_path):
    seg = hb.HeartbeatSegment(tmp_path / "hb", 2, "run-x", time.monotonic())
    code = textwrap.dedent(
        """
        from tp_supervise.supervisor.rank import runtime as sv
        sv.starting(); sv.ready()
        for _ in range(5):
            with sv.step():
                with sv.collective("broadcast", "8 int64"):
                    pass
        sv.phase("idle")
        """
    )
    env = {"SUPERVISE_HEARTBEAT": str(seg.path), "SUPERVISE_SLOT": "1", "RANK": "1", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    s = seg.read(1)
    assert s.claimed and s.ready and s.instrumented
    assert (s.step, s.coll_seq, s.phase, s.rank) == (5, 5, "idle", 1)


def test_a_python_child_of_the_rank_does_not_take_its_slot(tmp_path):
    """A rank's subprocess (a compile worker, a helper script) inherits the rank's environment and the hook."""
    seg = hb.HeartbeatSegment(tmp_path / "hb", 1, "run-x", time.monotonic())
    child = "from tp_supervise.supervisor.rank import runtime as sv; sv.starting(); print(sv.claim(0))"
    code = textwrap.dedent(
        f"""
        import os, subprocess, sys
        from tp_supervise.supervisor.rank import runtime as sv
        sv.starting(); sv.ready()
        out = subprocess.run([sys.executable, "-c", {child!r}], capture_output=True, text=True, check=True)
        print(os.getpid(), out.stdout.strip())
        """
    )
    env = {"SUPERVISE_HEARTBEAT": str(seg.path), "SUPERVISE_SLOT": "0", "RANK": "0", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    rank_pid, child_claimed = done.stdout.split()
    s = seg.read(0)
    assert child_claimed == "False"
    assert s.pid == int(rank_pid) and s.ready, "the rank's slot was taken over by its child"
