"""Heartbeat channel: one shared-memory segment per run, one slot per rank.

Each slot has exactly one writer (its rank, through ``supervisor.rank.runtime``)
and one reader (the supervisor).  The supervisor never writes a claimed slot,
so reading never waits on a rank, hung, stopped or dead.

The segment is a plain file (``/dev/shm`` when present) mapped with ``mmap``
by both sides; no resource tracker, no locks.

Layout (version 1, little endian)::

    +--------------------------- header (64 bytes) ---------------------------+
    | magic "TPSV" | version u32 | nslots u32 | slot_size u32 | hdr_size u32  |
    | created f64 (monotonic)    | run_id 36s (ascii, NUL padded)             |
    +-------------------------------------------------------------------------+
    | slot 0 (256 bytes) | slot 1 | ... | slot nslots-1                       |
    +-------------------------------------------------------------------------+

    slot:
      0  seq            u64  seqlock: odd while the writer is inside an update
      8  pid            i32
     12  rank           i32  global rank (-1 until claimed)
     16  flags          u32  CLAIMED | READY | IN_STEP | IN_COLLECTIVE | ...
     20  stack_signal   i32  signal that makes the rank write its stacks (0: none)
     24  step           u64  steps completed
     32  coll_seq       u64  collectives entered
     40  ts_heartbeat   f64  monotonic time of the last update
     48  ts_step_begin  f64
     56  ts_coll_begin  f64
     64  last_step_s    f64  duration of the last completed step
     72  ts_ready       f64
     80  phase          32s
    112  coll_op        32s
    144  coll_desc      96s  shapes / dtype of the collective in progress
    240  local_slot     i32  (echo of the slot index, sanity check)
    244  reserved       12 bytes

Each slot is guarded by the seqlock at its offset 0 (``seqlock.py``: the
protocol and its memory-ordering assumption); a read that stays torn after
the bounded retries is reported with ``torn=True`` rather than spinning on a
rank that was stopped in the middle of an update.

Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC is system wide on Linux,
so rank and supervisor clocks agree).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .seqlock import SeqWriter, read_consistent

MAGIC = b"TPSV"
VERSION = 1
HEADER_SIZE = 64
SLOT_SIZE = 256

_HEADER = struct.Struct("<4sIIIId36s")
_SLOT = struct.Struct("<QiiIiQQddddd32s32s96si12x")
assert _HEADER.size <= HEADER_SIZE
assert _SLOT.size == SLOT_SIZE

# Field groups the writer updates on hot paths (offsets into the slot).
_IDENT = struct.Struct("<iiIi")  # pid, rank, flags, stack_signal at offset 8
# flags, stack_signal, step, coll_seq, ts_hb, ts_step, ts_coll, last_step: the
# hot fields are contiguous, so one update is one pack (plus the two seq stores).
_HOT = struct.Struct("<IiQQdddd")
_TEXT32 = struct.Struct("<32s")
_TEXT96 = struct.Struct("<96s")
_LOCAL = struct.Struct("<i")

OFF_IDENT = 8
OFF_FLAGS = 16
OFF_TS_READY = 72
OFF_PHASE = 80
OFF_COLL_OP = 112
OFF_COLL_DESC = 144
OFF_LOCAL = 240

CLAIMED = 1 << 0
READY = 1 << 1
IN_STEP = 1 << 2
IN_COLLECTIVE = 1 << 3
FINISHED = 1 << 4
INSTRUMENTED = 1 << 5  # the rank reports steps itself (not only collectives)



class HeartbeatLayoutError(RuntimeError):
    """The segment is not a heartbeat segment of a version we understand."""


@dataclass(frozen=True)
class SlotSnapshot:
    """What one read of one slot saw.  Pure data; compare across ticks."""

    slot: int
    pid: int
    rank: int
    flags: int
    stack_signal: int
    step: int
    coll_seq: int
    ts_heartbeat: float
    ts_step_begin: float
    ts_coll_begin: float
    last_step_s: float
    ts_ready: float
    phase: str
    coll_op: str
    coll_desc: str
    torn: bool = False

    @property
    def claimed(self) -> bool:
        return bool(self.flags & CLAIMED)

    @property
    def ready(self) -> bool:
        return bool(self.flags & READY)

    @property
    def in_step(self) -> bool:
        return bool(self.flags & IN_STEP)

    @property
    def in_collective(self) -> bool:
        return bool(self.flags & IN_COLLECTIVE)

    @property
    def finished(self) -> bool:
        return bool(self.flags & FINISHED)

    @property
    def instrumented(self) -> bool:
        return bool(self.flags & INSTRUMENTED)

    @property
    def busy(self) -> bool:
        return self.in_step or self.in_collective

    def to_dict(self) -> dict:
        return {
            "slot": self.slot,
            "pid": self.pid,
            "rank": self.rank,
            "ready": self.ready,
            "in_step": self.in_step,
            "in_collective": self.in_collective,
            "finished": self.finished,
            "step": self.step,
            "collective_seq": self.coll_seq,
            "phase": self.phase,
            "collective_op": self.coll_op if self.in_collective else "",
            "collective_desc": self.coll_desc if self.in_collective else "",
            "last_step_seconds": self.last_step_s,
            "ts_heartbeat": self.ts_heartbeat,
            "torn": self.torn,
        }


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _encode(text: str, size: int) -> bytes:
    data = text.encode("utf-8", "replace")[:size]
    return data


def empty_slot(slot: int) -> SlotSnapshot:
    return SlotSnapshot(slot, 0, -1, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, "", "", "")


class HeartbeatSegment:
    """Supervisor side: creates the segment and reads slots (never writes them)."""

    def __init__(self, path: Path, nslots: int, run_id: str, created: float):
        if nslots < 1:
            raise ValueError("a heartbeat segment needs at least one slot")
        self.path = Path(path)
        self.nslots = nslots
        size = HEADER_SIZE + nslots * SLOT_SIZE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _HEADER.pack_into(
            self._map, 0, MAGIC, VERSION, nslots, SLOT_SIZE, HEADER_SIZE, created, run_id.encode()[:36]
        )
        for i in range(nslots):
            base = HEADER_SIZE + i * SLOT_SIZE
            _IDENT.pack_into(self._map, base + OFF_IDENT, 0, -1, 0, 0)

    def read(self, slot: int) -> SlotSnapshot:
        base = HEADER_SIZE + slot * SLOT_SIZE
        mm = self._map
        raw, ok = read_consistent(mm, base, lambda: mm[base : base + SLOT_SIZE])
        if raw is None:
            raw = mm[base : base + SLOT_SIZE]
        return _decode(slot, raw, torn=not ok)

    def read_all(self) -> list[SlotSnapshot]:
        return [self.read(i) for i in range(self.nslots)]

    def close(self, unlink: bool = True) -> None:
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass
        if unlink:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def _decode(slot: int, raw: bytes, torn: bool) -> SlotSnapshot:
    (
        _seq,
        pid,
        rank,
        flags,
        stack_signal,
        step,
        coll_seq,
        ts_hb,
        ts_step,
        ts_coll,
        last_step,
        ts_ready,
        phase,
        coll_op,
        coll_desc,
        _local,
    ) = _SLOT.unpack(raw)
    return SlotSnapshot(
        slot=slot,
        pid=pid,
        rank=rank,
        flags=flags,
        stack_signal=stack_signal,
        step=step,
        coll_seq=coll_seq,
        ts_heartbeat=ts_hb,
        ts_step_begin=ts_step,
        ts_coll_begin=ts_coll,
        last_step_s=last_step,
        ts_ready=ts_ready,
        phase=_text(phase),
        coll_op=_text(coll_op),
        coll_desc=_text(coll_desc),
        torn=torn,
    )


class SlotWriter:
    """Rank side: the single writer of one slot.

    Not thread safe by design: a rank updates its slot from the thread that
    runs steps and collectives.  Calls from other threads must be serialised
    by the caller (``supervisor.rank.runtime`` holds a lock only on the rare paths).
    """

    def __init__(self, path: str | os.PathLike, slot: int):
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version, nslots, slot_size, header_size, _created, _run = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or version != VERSION or slot_size != SLOT_SIZE or header_size != HEADER_SIZE:
            raise HeartbeatLayoutError(f"{path}: not a version-{VERSION} heartbeat segment")
        if not 0 <= slot < nslots:
            raise HeartbeatLayoutError(f"slot {slot} outside the segment's {nslots} slots")
        self.slot = slot
        self.nslots = nslots
        self._base = HEADER_SIZE + slot * SLOT_SIZE
        lock = SeqWriter(self._map, self._base)
        self._open, self._close = lock.begin, lock.end
        self.flags = 0
        self.stack_signal = 0
        self.step = 0
        self.coll_seq = 0
        self.ts_step_begin = 0.0
        self.ts_coll_begin = 0.0
        self.last_step_s = 0.0
        self._coll_text = ("", "")

    def _pack_hot(self, now: float) -> None:
        _HOT.pack_into(
            self._map,
            self._base + OFF_FLAGS,
            self.flags,
            self.stack_signal,
            self.step,
            self.coll_seq,
            now,
            self.ts_step_begin,
            self.ts_coll_begin,
            self.last_step_s,
        )

    def _update(self, now: float) -> None:
        self._open()
        self._pack_hot(now)
        self._close()

    # -- updates --------------------------------------------------------------
    def claim(self, pid: int, rank: int, stack_signal: int, flags: int, now: float) -> None:
        self.flags = flags | CLAIMED
        self.stack_signal = stack_signal
        self._open()
        _IDENT.pack_into(self._map, self._base + OFF_IDENT, pid, rank, self.flags, stack_signal)
        _LOCAL.pack_into(self._map, self._base + OFF_LOCAL, self.slot)
        self._pack_hot(now)
        self._close()

    def set_flags(self, flags: int, now: float) -> None:
        self.flags = flags
        self._open()
        self._pack_hot(now)
        if flags & READY:
            struct.pack_into("<d", self._map, self._base + OFF_TS_READY, now)
        self._close()

    def step_begin(self, now: float) -> None:
        self.flags |= IN_STEP | INSTRUMENTED
        self.ts_step_begin = now
        self._update(now)

    def step_end(self, now: float) -> None:
        self.flags &= ~IN_STEP
        self.step += 1
        self.last_step_s = now - self.ts_step_begin
        self._update(now)

    def collective_begin(self, op: str, desc: str, now: float) -> None:
        self.flags |= IN_COLLECTIVE
        self.coll_seq += 1
        self.ts_coll_begin = now
        self._open()
        if self._coll_text != (op, desc):  # the same op and shapes repeat every layer
            self._coll_text = (op, desc)
            _TEXT32.pack_into(self._map, self._base + OFF_COLL_OP, _encode(op, 32))
            _TEXT96.pack_into(self._map, self._base + OFF_COLL_DESC, _encode(desc, 96))
        self._pack_hot(now)
        self._close()

    def collective_end(self, now: float) -> None:
        self.flags &= ~IN_COLLECTIVE
        self._update(now)

    def set_phase(self, name: str, now: float) -> None:
        self._open()
        _TEXT32.pack_into(self._map, self._base + OFF_PHASE, _encode(name, 32))
        self._pack_hot(now)
        self._close()
