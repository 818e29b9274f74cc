"""Heartbeat channel: one shared-memory segment per run, one slot per rank.

Each slot has exactly one writing process (its rank, through
``supervisor.rank.runtime`` and ``slot_writer.SlotWriter``, from any of its
threads) and one reader (the supervisor).  The supervisor never
writes a claimed slot and takes no lock, so reading never waits on a rank,
hung, stopped or dead.

The segment is a plain file (``/dev/shm`` when present) mapped with ``mmap``
by both sides; no resource tracker, no lock shared between processes.

Layout (version 2, little endian)::

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
     32  coll_seq       u64  collectives entered outside the lanes (see below)
     40  ts_heartbeat   f64  monotonic time of the last update other than entering a
                             collective (that one is ts_coll_begin: the reader reports
                             the later of the two as the heartbeat)
     48  ts_step_begin  f64
     56  ts_coll_begin  f64  when the latest collective began
     64  last_step_s    f64  duration of the last completed step
     72  ts_ready       f64
     80  phase          32s
    112  coll_op        32s  op of the collective in progress (the latest begun)
    144  coll_desc      64s  its shapes / dtype
    208  lanes       4 x u64 one per thread of the rank that enters collectives:
                             (collectives entered << 1) | inside
    240  local_slot     i32  (echo of the slot index, sanity check)
    244  reserved       12 bytes

What a reader reports (``SlotSnapshot``): the rank is in a collective
(``IN_COLLECTIVE``) when the flag is set or any lane's low bit is; its
``coll_seq`` is the field plus every lane's count.

Lanes make a collective cost one aligned store on entry and one on exit, with
no lock, from any number of threads: each lane has exactly one writing thread
(the first four threads of the rank that enter collectives get one each), and
a single aligned u64 store is atomic, so a reader sees either value.  The
flag covers the rest: threads without a lane, work objects issued and not
completed (``works``); it counts holders and is written under the writer's
lock and the seqlock.  Entering through a lane also stores
``ts_coll_begin`` (a single f64 store) and nothing else: the heartbeat a
reader reports is the later of ``ts_heartbeat`` and ``ts_coll_begin``; ``coll_op``/``coll_desc`` change only when the text
changes (under the lock and the seqlock), which in a model's steady state is
almost never.

The other fields are guarded by the seqlock at the slot's offset 0
(``seqlock.py``: the protocol and its memory-ordering assumption); a read that
stays torn after the bounded retries is reported with ``torn=True`` rather
than spinning on a rank that was stopped in the middle of an update.

Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC is system wide on Linux,
so rank and supervisor clocks agree).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .seqlock import read_consistent

MAGIC = b"TPSV"
VERSION = 2
HEADER_SIZE = 64
SLOT_SIZE = 256

_HEADER = struct.Struct("<4sIIIId36s")
_SLOT = struct.Struct("<QiiIiQQddddd32s32s64s4Qi12x")
assert _HEADER.size <= HEADER_SIZE
assert _SLOT.size == SLOT_SIZE

# Field groups the writer packs at once (offsets into the slot).
_IDENT = struct.Struct("<iiIi")  # pid, rank, flags, stack_signal at offset 8
_HOT = struct.Struct("<IiQQdddd")  # flags .. last_step_s at offset 16 (claim resets them)
_TEXT32 = struct.Struct("<32s")
_TEXT64 = struct.Struct("<64s")
_LOCAL = struct.Struct("<i")

OFF_IDENT = 8
OFF_FLAGS = 16
OFF_TS_READY = 72
OFF_PHASE = 80
OFF_COLL_OP = 112
OFF_COLL_DESC = 144
OFF_LANES = 208
LANES = 4
DESC_SIZE = 64
OFF_LOCAL = 240
# The same offsets as indexes of the writer's typed views of a slot (u64, u32, f64).
_Q_SEQ = 0
_Q_STEP = 24 // 8
_Q_COLL_SEQ = 32 // 8
_I_FLAGS = OFF_FLAGS // 4
_D_TS_HEARTBEAT = 40 // 8
_D_TS_STEP_BEGIN = 48 // 8
_D_TS_COLL_BEGIN = 56 // 8
_D_LAST_STEP = 64 // 8
_D_TS_READY = OFF_TS_READY // 8
_Q_LANE0 = OFF_LANES // 8

CLAIMED = 1 << 0
READY = 1 << 1
IN_STEP = 1 << 2
IN_COLLECTIVE = 1 << 3
FINISHED = 1 << 4
INSTRUMENTED = 1 << 5  # the rank reports steps itself (not only collectives)

# The phase text with a meaning to the watchdog: a rank inside init_process_group (the zero-code
# hook, the built-in engine) has started and must report ready within --startup-timeout.
RENDEZVOUS_PHASE = "rendezvous"



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
        *lanes,
        _local,
    ) = _SLOT.unpack(raw)
    for lane in lanes:
        coll_seq += lane >> 1
        if lane & 1:
            flags |= IN_COLLECTIVE
    return SlotSnapshot(
        slot=slot,
        pid=pid,
        rank=rank,
        flags=flags,
        stack_signal=stack_signal,
        step=step,
        coll_seq=coll_seq,
        ts_heartbeat=ts_hb if ts_hb >= ts_coll else ts_coll,  # entering a collective stores only ts_coll_begin
        ts_step_begin=ts_step,
        ts_coll_begin=ts_coll,
        last_step_s=last_step,
        ts_ready=ts_ready,
        phase=_text(phase),
        coll_op=_text(coll_op),
        coll_desc=_text(coll_desc),
        torn=torn,
    )
