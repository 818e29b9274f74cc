"""Digest ring: layout, open step, wrap-around, lapping and overwrite detection."""

from __future__ import annotations

import os

import pytest

from tp_supervise.supervisor.rank import encoding
from tp_supervise.supervisor.rank.ring import ENTRY_SIZE, HEADER_SIZE, NO_STEP, RingLayoutError, RingReader, RingWriter, ring_size


def events(step: int, n: int = 1) -> list[bytes]:
    return [encoding.event_bytes("e", [step, i]) for i in range(n)]


def write_step(w: RingWriter, step: int, n: int = 1, truncated: bool = False, now: float = 0.0) -> bytes:
    data = events(step, n)
    for line in data:
        w.append(line)
    log = b"".join(data)
    w.publish(step, encoding.digest(log), truncated, now)
    return log


def test_header_state_and_entries(tmp_path):
    path = tmp_path / "r" / "slot-0.ring"
    w = RingWriter(path, slot=3, rank=7, depth=4, log_bytes=4096)
    assert os.path.getsize(path) == ring_size(4, 4096) == HEADER_SIZE + 4 * ENTRY_SIZE + 4096
    assert not list(path.parent.glob("*.tmp"))
    r = RingReader(path)
    assert (r.header.slot, r.header.rank, r.header.pid, r.header.depth) == (3, 7, os.getpid(), 4)
    assert r.head() == 0 and r.read_entry(0) is None
    s = r.read_state()
    assert (s.head, s.last_step, s.open_len, s.open_count, s.open_step) == (0, NO_STEP, 0, 0, NO_STEP)
    log = write_step(w, 10, 3, now=1.5)
    e = r.read_entry(0)
    assert (e.index, e.step, e.digest, e.count, e.truncated, e.ts) == (0, 10, encoding.digest(log), 3, False, 1.5)
    assert r.read_log(e) == log
    s = r.read_state()
    assert (s.head, s.last_step, s.open_pos, s.open_len, s.open_count) == (1, 10, len(log), 0, 0)
    w.close()
    r.close()


def test_open_step_is_readable_before_it_ends(tmp_path):
    path = tmp_path / "slot-0.ring"
    w = RingWriter(path, slot=0, rank=0, depth=4, log_bytes=4096)
    r = RingReader(path)
    write_step(w, 0, 2)
    first, second = events(1, 2)
    w.append(first)
    w.announce(1)
    s = r.read_state()
    assert (s.last_step, s.open_count, s.open_step) == (0, 1, 1)
    assert r.read_range(s.open_pos, s.open_len) == first
    w.append(second)
    w.count_only()  # an event hashed but not stored
    s = r.read_state()
    assert s.open_count == 3 and r.read_range(s.open_pos, s.open_len) == first + second
    w.publish(1, b"d" * 16, True, 0.0)
    e = r.read_entry(1)
    assert (e.count, e.truncated, r.read_log(e)) == (3, True, first + second)
    assert r.read_state().open_step == NO_STEP


def test_wraps_and_detects_lapped_entries(tmp_path):
    path = tmp_path / "slot-0.ring"
    w = RingWriter(path, slot=0, rank=0, depth=4, log_bytes=4096)
    r = RingReader(path)
    logs = {step: write_step(w, step) for step in range(11)}
    assert r.head() == 11
    assert r.read_entry(6) is None  # lapped: only the last 4 are kept
    for index in range(7, 11):
        e = r.read_entry(index)
        assert e.step == index and r.read_log(e) == logs[index]


def test_log_area_wraps_and_overwritten_logs_read_as_none(tmp_path):
    path = tmp_path / "slot-0.ring"
    w = RingWriter(path, slot=0, rank=0, depth=64, log_bytes=4096)
    r = RingReader(path)
    logs = {step: write_step(w, step, 12, truncated=step % 2 == 1) for step in range(40)}  # area wraps twice
    intact = 0
    for index in range(40):
        e = r.read_entry(index)
        assert e.truncated == (index % 2 == 1)
        data = r.read_log(e)
        if data is not None:
            assert data == logs[index]
            intact += 1
    assert 0 < intact < 40 and r.read_log(r.read_entry(39)) == logs[39]


def test_too_large_event_is_refused(tmp_path):
    w = RingWriter(tmp_path / "slot-0.ring", slot=0, rank=0, depth=2, log_bytes=4096)
    with pytest.raises(ValueError):
        w.append(b"x" * 5000)


def test_reader_rejects_foreign_files(tmp_path):
    bad = tmp_path / "bad.ring"
    bad.write_bytes(b"XXXX" + bytes(200))
    with pytest.raises(RingLayoutError):
        RingReader(bad)
    short = tmp_path / "short.ring"
    short.write_bytes(b"TP")
    with pytest.raises(RingLayoutError):
        RingReader(short)


def test_replacement_gets_a_new_inode(tmp_path):
    path = tmp_path / "slot-0.ring"
    write_step(RingWriter(path, slot=0, rank=0, depth=2, log_bytes=4096), 5)
    old = RingReader(path)
    RingWriter(path, slot=0, rank=0, depth=2, log_bytes=4096)
    new = RingReader(path)
    assert old.inode != new.inode and old.head() == 1 and new.head() == 0


def test_torn_entry_is_retried_not_lost(tmp_path):
    """A writer stopped inside an entry (seq odd) makes the reader wait, not skip it."""
    from tp_supervise.consensus.monitor import ConsensusMonitor
    from tp_supervise.supervisor.rank.ring import _U64

    path = tmp_path / "consensus" / "slot-0.ring"
    w = RingWriter(path, slot=0, rank=0, depth=4, log_bytes=4096)
    write_step(w, 0)
    monitor = ConsensusMonitor(tmp_path, 1)
    monitor.poll(0.0)
    assert monitor.counters().entries_read == 1
    write_step(w, 1)
    off = HEADER_SIZE + 1 * ENTRY_SIZE
    (seq,) = _U64.unpack_from(w._map, off)
    _U64.pack_into(w._map, off, seq + 1)  # as if the writer froze mid-entry
    r = RingReader(path)
    assert r.read_entry(1) is None and not r.lapped(1)
    monitor.poll(0.1)
    assert (monitor.counters().entries_read, monitor.counters().entries_lost) == (1, 0)
    _U64.pack_into(w._map, off, seq)  # the writer resumes
    monitor.poll(0.2)
    assert (monitor.counters().entries_read, monitor.counters().entries_lost) == (2, 0)
    monitor.close()
