"""Heartbeat channel: one shared-memory segment per run, one slot per rank.

Each slot has exactly one writing process (its rank, through
``supervisor.rank.runtime`` and ``slot_writer.SlotWriter``, from any of its
threads) and one reader (the supervisor).  The supervisor never
writes a claimed slot and takes no lock, so reading never waits on a rank,
hung, stopped or dead.

The segment is a plain file (``/dev/shm`` when present) mapped with ``mmap``
by both sides; no resource tracker, no lock shared between processes.

Layout (version 4, little endian)::

    +--------------------------- header (64 bytes) ---------------------------+
    | magic "TPSV" | version u32 | nslots u32 | slot_size u32 | hdr_size u32  |
    | created f64 (monotonic)    | run_id 36s (ascii, NUL padded)             |
    +-------------------------------------------------------------------------+
    | slot 0 (256 bytes) | slot 1 | ... | slot nslots-1                       |
    +-------------------------------------------------------------------------+
    | arrival rings of slot 0 (LANES x RING_SIZE = 16 KiB) | slot 1 | ...      |
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
                             collective through a lane (the reader reports the later
                             of it and the collective's begin as the heartbeat)
     48  ts_step_begin  f64
     56  ts_coll_begin  f64  when the latest collective outside the lanes began, or a
                             lane's wait on a work (a lane's collectives stamp their
                             arrival ring instead: the reader reports the latest of all)
     64  last_step_s    f64  duration of the last completed step
     72  ts_ready       f64
     80  phase          32s
    112  coll_op        32s  op of the collective in progress (the latest begun)
    144  coll_desc      64s  its shapes / dtype
    208  lanes       4 x u64 one per thread of the rank that enters collectives:
                             (collectives entered << 1) | inside
    240  local_slot     i32  (echo of the slot index, sanity check)
    244  step_tokens    u32  tokens the step in progress was given (0: not reported)
    248  last_tokens    u32  tokens of the last completed step (the shape of ``last_step_s``)
    252  role           u32  what the writing process is: 0 a rank, 1 the scheduler, 2 the
                             front end (the control slots, ``ROLES``)

    arrival ring of lane L of slot S, at HEADER_SIZE + nslots * SLOT_SIZE
    + (S * LANES + L) * RING_SIZE: ARRIVAL_DEPTH (256) entries of 16 bytes,
    entry n % ARRIVAL_DEPTH for the lane's n-th collective (n from 1):
      +0  reserved  f64  (0.0)
      +8  arrival   f64  monotonic time its thread entered collective n
    As f64 indexes: collective n's arrival is at (2n + 1) & ARRIVAL_INDEX, which
    is the lane's value while it is inside collective n, masked: the writer's
    only arithmetic for the stamp is one ``&`` (the reserved half buys that).

What a reader reports (``SlotSnapshot``): the rank is in a collective
(``IN_COLLECTIVE``) when the flag is set or any lane's low bit is; its
``coll_seq`` is the field plus every lane's count.

Lanes make a collective cost one aligned store on entry and one on exit, with
no lock, from any number of threads: each lane has exactly one writing thread
(the first four threads of the rank that enter collectives get one each), and
a single aligned u64 store is atomic, so a reader sees either value.  The
flag covers the rest: threads without a lane, work objects issued and not
completed (``works``); it counts holders and is written under the writer's
lock and the seqlock.  Entering a collective through a lane also stamps its
arrival in the lane's ring (a single f64 store, before the lane's store) and
nothing else: the heartbeat a reader reports is the later of ``ts_heartbeat``
and the latest collective begin (``ts_coll_begin`` and each lane's newest
ring entry); ``coll_op``/``coll_desc`` change only when the text changes
(under the lock and the seqlock), which in a model's steady state is almost
never.

**Arrival rings** (which rank arrives late at each collective: the
straggler detector, ``watchdogs/straggler.py``).  Each lane keeps the arrival
times of its last ``ARRIVAL_DEPTH`` collectives, entry ``n % ARRIVAL_DEPTH``
for its ``n``-th.  The supervisor reads at 10-50 Hz while collectives run at
thousands per second, so the latest collective of each rank at the moment of
a read (``ts_coll_begin`` and the count) is rarely the same collective on two
ranks, and it is the one not yet complete; a ring lets it compare the *same*
collective (every rank's ``n``-th) across ranks, over the last 256 of them
(a whole step of a model up to 128 layers at two collectives per layer), from
one read of each slot and with no message from the ranks.  The ranks' ``n``-th
collectives are the same collective when each rank's collective thread enters
the same collectives in the same order, as the ranks of a TP group do; ranks
whose sequences differ (pipeline stages on one node) are not comparable, and
the detector refuses to compare counts that drift apart.
Ordering rules, one writer per lane:

* the writer stores the ring entry of collective ``n`` *before* the lane's
  value that counts ``n``; so a reader that sees count ``n`` finds entry
  ``n`` written (x86-64 keeps stores in program order, ``seqlock.py``);
* entry ``n`` is overwritten by collective ``n + ARRIVAL_DEPTH``, whose
  store can begin once the count reached ``n + ARRIVAL_DEPTH - 1``.  The
  reader (``HeartbeatSegment.arrivals``) loads the count (``n1``), copies the
  ring, loads the count again (``n2``) and keeps the entries
  ``max(1, n2 - ARRIVAL_DEPTH + 2) .. n1``: each was written and not yet
  overwritten during the copy.  A count that went down (the slot was claimed
  by a new process, which zeroes the rings) discards the copy;
* on a weakly ordered CPU (aarch64) a reader may, rarely, see count ``n``
  before entry ``n``: it then reads the arrival of collective
  ``n - ARRIVAL_DEPTH``, far older, one outlier among the entries;
* waits on a work object (``Lane.wait``) are not collectives of their own
  and stamp ``ts_coll_begin`` instead; collectives entered outside the lanes
  (the holder count: a fifth thread) have no ring.

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
VERSION = 4  # 4: step_tokens, last_tokens and role in what were reserved bytes
HEADER_SIZE = 64
SLOT_SIZE = 256
ARRIVAL_DEPTH = 256  # collectives per lane whose arrival a reader can see (a power of two)
ARRIVAL_ENTRY = 16  # bytes per collective: reserved f64, arrival f64
RING_SIZE = ARRIVAL_DEPTH * ARRIVAL_ENTRY  # one lane's ring, bytes
ARRIVAL_INDEX = 2 * ARRIVAL_DEPTH - 1  # lane value (odd: inside collective n) & this = f64 index of n's arrival

_HEADER = struct.Struct("<4sIIIId36s")
_SLOT = struct.Struct("<QiiIiQQddddd32s32s64s4QiIII")
assert _HEADER.size <= HEADER_SIZE
assert _SLOT.size == SLOT_SIZE
assert ARRIVAL_DEPTH & (ARRIVAL_DEPTH - 1) == 0

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
OFF_STEP_TOKENS = 244
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
_I_STEP_TOKENS = OFF_STEP_TOKENS // 4
_I_LAST_TOKENS = _I_STEP_TOKENS + 1
_I_ROLE = _I_STEP_TOKENS + 2
_LANE_VALUES = struct.Struct(f"<{LANES}Q")
_PID_RANK = struct.Struct("<ii")
_F64 = struct.Struct("<d")


def segment_size(nslots: int) -> int:
    """Bytes of a segment of ``nslots`` slots: header, slots, then every slot's arrival rings."""
    return HEADER_SIZE + nslots * (SLOT_SIZE + LANES * RING_SIZE)


def arrival_offset(count: int) -> int:
    """Byte offset, in its lane's ring, of the arrival of the lane's collective ``count``."""
    return 8 * (((count << 1) | 1) & ARRIVAL_INDEX)


def rings_offset(nslots: int, slot: int) -> int:
    """Where the arrival rings of ``slot`` begin (lane 0's; lane L's is ``L * RING_SIZE`` further)."""
    return HEADER_SIZE + nslots * SLOT_SIZE + slot * LANES * RING_SIZE


CLAIMED = 1 << 0
READY = 1 << 1
IN_STEP = 1 << 2
IN_COLLECTIVE = 1 << 3
FINISHED = 1 << 4
INSTRUMENTED = 1 << 5  # the rank reports steps itself (not only collectives)

# What the process writing a slot is (``role`` field).  Rank slots are in the heartbeat segment; the
# control segment has one slot per control-plane role, at the index the role names (``control_slot``).
ROLE_RANK = 0
ROLE_SCHEDULER = 1
ROLE_FRONTEND = 2
ROLES = {ROLE_RANK: "rank", ROLE_SCHEDULER: "scheduler", ROLE_FRONTEND: "frontend"}
CONTROL_ROLES = (ROLE_SCHEDULER, ROLE_FRONTEND)
CONTROL_SLOTS = len(CONTROL_ROLES)
CONTROL_SLOT_BASE = 1 << 20  # a control slot's number where it stands beside rank slots (the watchdog's view)


def control_slot(role: int) -> int:
    """The control segment's slot of ``role`` (scheduler 0, front end 1)."""
    return CONTROL_ROLES.index(role)


# The phase text with a meaning to the watchdog: a rank inside init_process_group (the zero-code
# hook, the built-in engine) has started and must report ready within --startup-timeout.
RENDEZVOUS_PHASE = "rendezvous"
# The scheduler's phase inside its scheduling call (engines: vLLM's ``Scheduler.schedule``): part of every step,
# before its size is known (watchdogs.policy judges a stall there by the smallest step class)
SCHEDULE_PHASE = "schedule"


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
    step_tokens: int = 0  # tokens the step in progress was given (0: not reported)
    last_step_tokens: int = 0  # tokens of the last completed step
    role: int = ROLE_RANK

    @property
    def role_name(self) -> str:
        return ROLES.get(self.role, "rank")

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
            "step_tokens": self.step_tokens,
            "last_step_tokens": self.last_step_tokens,
            "role": self.role_name,
            "ts_heartbeat": self.ts_heartbeat,
            "torn": self.torn,
        }


@dataclass(frozen=True)
class ArrivalWindow:
    """When one lane of one rank entered its latest collectives (``HeartbeatSegment.arrivals``).

    ``arrivals[i]`` is the monotonic time at which the lane's thread entered
    its collective number ``first_seq + i`` (counted from 1 since the slot was
    claimed); ``count`` is the latest number the reader saw, at most
    ``ARRIVAL_DEPTH - 1`` entries back from it are kept.  Pure data.
    """

    slot: int
    pid: int
    rank: int
    lane: int
    count: int
    first_seq: int
    arrivals: tuple[float, ...]

    @property
    def last_seq(self) -> int:
        """The number of the newest arrival held (``first_seq - 1`` when none is)."""
        return self.first_seq + len(self.arrivals) - 1

    def get(self, seq: int) -> float | None:
        """The arrival of collective ``seq``, if this window holds it."""
        i = seq - self.first_seq
        return self.arrivals[i] if 0 <= i < len(self.arrivals) else None


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
        self._owner = True  # created it: close() may unlink it
        size = segment_size(nslots)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, MAGIC, VERSION, nslots, SLOT_SIZE, HEADER_SIZE, created, run_id.encode()[:36])
        for i in range(nslots):
            base = HEADER_SIZE + i * SLOT_SIZE
            _IDENT.pack_into(self._map, base + OFF_IDENT, 0, -1, 0, 0)

    @classmethod
    def attach(cls, path: str | os.PathLike) -> HeartbeatSegment:
        """A reader of an existing segment (a tool, a test; the supervisor creates its own).

        Maps it read-only; ``close`` never unlinks it.
        """
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise HeartbeatLayoutError(f"{path}: not a version-{VERSION} heartbeat segment")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, nslots, slot_size, header_size, _created, _run = _HEADER.unpack_from(mm, 0)
        if (magic, version, slot_size, header_size) != (MAGIC, VERSION, SLOT_SIZE, HEADER_SIZE) or size < segment_size(
            nslots
        ):
            mm.close()
            raise HeartbeatLayoutError(f"{path}: not a version-{VERSION} heartbeat segment")
        seg = cls.__new__(cls)
        seg.path = Path(path)
        seg.nslots = nslots
        seg._map = mm
        seg._owner = False
        return seg

    def read(self, slot: int) -> SlotSnapshot:
        base = HEADER_SIZE + slot * SLOT_SIZE
        mm = self._map
        raw, ok = read_consistent(mm, base, lambda: mm[base : base + SLOT_SIZE])
        if raw is None:
            raw = mm[base : base + SLOT_SIZE]
        return _decode(slot, raw, torn=not ok, latest_arrival=self._latest_arrival(slot, raw))

    def _latest_arrival(self, slot: int, raw: bytes) -> float:
        """The newest ring entry of the slot's lanes, for the counts ``raw`` holds (0.0: none).

        Entry ``n`` is stored before the count ``n`` is: seeing the count, the
        entry is there (or a later one, ``ARRIVAL_DEPTH`` collectives on).
        """
        latest = 0.0
        ring = rings_offset(self.nslots, slot)
        for lane, value in enumerate(_LANE_VALUES.unpack_from(raw, OFF_LANES)):
            count = value >> 1
            if count:
                (ts,) = _F64.unpack_from(self._map, ring + lane * RING_SIZE + arrival_offset(count))
                if ts > latest:
                    latest = ts
        return latest

    def arrivals(self, slot: int, lane: int | None = None, since: int = 0) -> ArrivalWindow | None:
        """The arrival times the slot's ``lane`` holds for its collectives after number ``since``.

        ``lane`` None: the lane that entered the most collectives (a rank's
        main collective thread; the same on every rank of a TP group).  None
        when the slot is unclaimed or its rings were reset during the read (a
        new process claimed it).  Never waits on the rank (see the module
        docstring for why every entry returned is whole).
        """
        mm = self._map
        base = HEADER_SIZE + slot * SLOT_SIZE
        values = _LANE_VALUES.unpack_from(mm, base + OFF_LANES)
        if lane is None:
            lane = max(range(LANES), key=lambda i: values[i] >> 1)
        pid, rank = _PID_RANK.unpack_from(mm, base + OFF_IDENT)
        if rank < 0:
            return None
        n1 = values[lane] >> 1
        ring = rings_offset(self.nslots, slot) + lane * RING_SIZE
        copy = mm[ring : ring + RING_SIZE]
        n2 = _LANE_VALUES.unpack_from(mm, base + OFF_LANES)[lane] >> 1
        if n2 < n1:
            return None
        first = max(1, n2 - ARRIVAL_DEPTH + 2, since + 1)
        if first > n1:
            return ArrivalWindow(slot, pid, rank, lane, n1, n1 + 1, ())
        stamps = memoryview(copy).cast("d")[1::2]  # entry i's arrival: collective n with n % ARRIVAL_DEPTH == i
        lo, hi = first % ARRIVAL_DEPTH, n1 % ARRIVAL_DEPTH
        arrivals = tuple(stamps[lo : hi + 1]) if lo <= hi else tuple(stamps[lo:]) + tuple(stamps[: hi + 1])
        return ArrivalWindow(slot, pid, rank, lane, n1, first, arrivals)

    def read_all(self) -> list[SlotSnapshot]:
        return [self.read(i) for i in range(self.nslots)]

    def close(self, unlink: bool = True) -> None:
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass
        if unlink and self._owner:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def _decode(slot: int, raw: bytes, torn: bool, latest_arrival: float = 0.0) -> SlotSnapshot:
    """A slot's bytes as a snapshot; ``latest_arrival``: the newest entry of its arrival rings."""
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
        step_tokens,
        last_tokens,
        role,
    ) = _SLOT.unpack(raw)
    for lane in lanes:
        coll_seq += lane >> 1
        if lane & 1:
            flags |= IN_COLLECTIVE
    if latest_arrival > ts_coll:
        ts_coll = latest_arrival  # a lane's collective began later than the field says
    return SlotSnapshot(
        slot=slot,
        pid=pid,
        rank=rank,
        flags=flags,
        stack_signal=stack_signal,
        step=step,
        coll_seq=coll_seq,
        ts_heartbeat=ts_hb if ts_hb >= ts_coll else ts_coll,  # entering a collective stamps only its begin
        ts_step_begin=ts_step,
        ts_coll_begin=ts_coll,
        last_step_s=last_step,
        ts_ready=ts_ready,
        phase=_text(phase),
        coll_op=_text(coll_op),
        coll_desc=_text(coll_desc),
        torn=torn,
        step_tokens=step_tokens,
        last_step_tokens=last_tokens,
        role=role,
    )
