"""Digest ring: one file per rank, written by the rank, read by the supervisor.

The rank stores every consensus event in the ring as it records it, and at
the end of every engine step publishes the step's digest and where its events
are.  The supervisor reads the ring whenever it likes: nothing goes through a
collective, a socket or the rank's threads, so the events of a rank that is
hung, busy, SIGSTOPped or dead stay readable, including those of the step it
is still in (the *open* step).  That is how a divergence that makes the very
next collective hang or abort (a different batch shape) is still caught.

The rank creates its ring (temp file, then ``rename``), so the supervisor may
open it at any time after; a restarted rank renames a fresh ring over the old
one and the reader notices the new inode.

Layout (version 1, little endian)::

    +------------------------------ header (128 bytes) -----------------------------+
    | magic "TPCR" | version u32 | depth u32 | entry_size u32 | log_bytes u32        |
    | slot i32 | rank i32 | pid i32 | created f64 | log_head u64                     |
    | state_seq u64 | head u64 | last_step i64 | open_pos u64 | open_len u32         |
    | open_count u32 | open_step i64 | (reserved)                                    |
    +--------------------------------------------------------------------------------+
    | entry 0 (80 bytes) | entry 1 | ... | entry depth-1                             |
    +--------------------------------------------------------------------------------+
    | event-log area (log_bytes, circular)                                           |
    +--------------------------------------------------------------------------------+

    header:  0 magic 4s   4 version   8 depth   12 entry_size   16 log_bytes
            20 slot      24 rank     28 pid     32 created (monotonic)
            40 log_head   u64  log bytes reserved so far (absolute position)
            48 state_seq  u64  seqlock over the five fields below
            56 head       u64  entries published so far
            64 last_step  i64  step index of entry head-1 (-1: none yet)
            72 open_pos   u64  where the open step's events start in the log area
            80 open_len   u32  bytes of the open step's events stored so far
            84 open_count u32  events recorded in the open step (stored or not)
            88 open_step  i64  index of the open step if the rank announced it, else -1

    entry n lives at HEADER_SIZE + (n % depth) * ENTRY_SIZE:
      0  seq      u64  seqlock: odd while the writer is inside the entry
      8  index    u64  n (absolute), so a reader detects that the ring lapped it
     16  step     u64  the engine's step index
     24  digest   16s  BLAKE2b-128 of the step's complete event log
     40  count    u32  events recorded in the step
     44  flags    u32  TRUNCATED: the log area holds only the first events
     48  log_pos  u64  absolute position of the step's events in the log area
     56  log_len  u32
     64  ts       f64  monotonic time of publication

    log area: the events of each step, one canonical JSON line each ("\\n"
    ended), contiguous per step modulo log_bytes.

Ordering rules (one writer):
  1. an event's bytes: ``log_head += len`` is stored BEFORE the bytes are
     written at ``pos % log_bytes`` (wrapping); then the state is updated;
  2. a step: its entry under the entry seqlock, then the state (head,
     last_step, a new empty open step) under the state seqlock.
A reader copies state and entries under their seqlocks (``index`` must match
too); it copies log bytes and then re-reads ``log_head``: the copy is intact
iff ``log_head <= pos + log_bytes`` (none of its bytes was reserved again).
The seqlocks are ``seqlock.py``'s, with its memory-ordering assumption
(stores visible in program order: x86-TSO), as in the heartbeat segment.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .seqlock import SeqWriter, read_consistent

MAGIC = b"TPCR"
VERSION = 1
HEADER_SIZE = 128
ENTRY_SIZE = 80
TRUNCATED = 1 << 0
NO_STEP = -1

_IDENT = struct.Struct("<4sIIIIiiid")  # magic .. created, at 0
_U64 = struct.Struct("<Q")
_STATE = struct.Struct("<QqQIIq")  # head, last_step, open_pos, open_len, open_count, open_step
_OPEN = struct.Struct("<II")  # open_len, open_count
_OPEN_STEP = struct.Struct("<q")
_ENTRY = struct.Struct("<QQQ16sIIQI4xd8x")
_ENTRY_BODY = struct.Struct("<QQ16sIIQI4xd8x")  # the entry after its seqlock counter
OFF_LOG_HEAD = 40
OFF_STATE_SEQ = 48
OFF_STATE = 56
OFF_OPEN = 80
OFF_OPEN_STEP = 88
assert _IDENT.size == OFF_LOG_HEAD
assert OFF_STATE + _STATE.size <= HEADER_SIZE
assert _ENTRY.size == ENTRY_SIZE == _U64.size + _ENTRY_BODY.size


class RingLayoutError(RuntimeError):
    """The file is not a digest ring of a version we understand."""


@dataclass(frozen=True)
class RingHeader:
    depth: int
    log_bytes: int
    slot: int
    rank: int
    pid: int
    created: float


@dataclass(frozen=True)
class RingState:
    """Published steps and the open step, as one consistent read saw them."""

    head: int
    last_step: int  # NO_STEP before the first published step
    open_pos: int
    open_len: int
    open_count: int
    open_step: int  # NO_STEP unless the rank announced it


@dataclass(frozen=True)
class RingEntry:
    """One published step, as a reader saw it."""

    index: int
    step: int
    digest: bytes
    count: int
    truncated: bool
    log_pos: int
    log_len: int
    ts: float


def ring_size(depth: int, log_bytes: int) -> int:
    return HEADER_SIZE + depth * ENTRY_SIZE + log_bytes


def create_shared_map(path: Path, size: int) -> tuple[mmap.mmap, Callable[[], None]]:
    """A new ``size``-byte file mapped shared and writable, made under a temporary name beside ``path``; the
    caller fills its header, then calls the returned ``publish`` (an atomic rename onto ``path``), so a reader
    never opens a file whose header is not written yet."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mapped, lambda: os.replace(tmp, path)


class RingWriter:
    """Rank side: the single writer of its ring.  Call from one thread."""

    def __init__(self, path: Path, *, slot: int, rank: int, depth: int, log_bytes: int):
        self.path = Path(path)
        self.depth = depth
        self.log_bytes = log_bytes
        self._log = HEADER_SIZE + depth * ENTRY_SIZE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._map, publish = create_shared_map(self.path, ring_size(depth, log_bytes))
        _IDENT.pack_into(
            self._map, 0, MAGIC, VERSION, depth, ENTRY_SIZE, log_bytes, slot, rank, os.getpid(), time.monotonic()
        )
        _STATE.pack_into(self._map, OFF_STATE, 0, NO_STEP, 0, 0, 0, NO_STEP)
        publish()
        state = SeqWriter(self._map, OFF_STATE_SEQ)
        self._state_open, self._state_close = state.begin, state.end
        self.head = 0
        self.log_head = 0
        self.open_pos = 0
        self.open_len = 0
        self.open_count = 0

    def append(self, data: bytes) -> None:
        """Store one event of the open step (``data`` must fit the log area)."""
        size = len(data)
        if size > self.log_bytes:
            raise ValueError(f"{size} bytes do not fit the ring's {self.log_bytes}-byte log area")
        mm = self._map
        pos = self.log_head
        self.log_head = pos + size
        _U64.pack_into(mm, OFF_LOG_HEAD, self.log_head)  # reserve first
        start = pos % self.log_bytes
        first = min(size, self.log_bytes - start)
        base = self._log
        mm[base + start : base + start + first] = data[:first]
        if first < size:
            mm[base : base + size - first] = data[first:]
        self.open_len += size
        self.open_count += 1
        self._state_open()
        _OPEN.pack_into(mm, OFF_OPEN, self.open_len, self.open_count)
        self._state_close()

    def count_only(self) -> None:
        """An event of the open step that is hashed but not stored (step log full)."""
        self.open_count += 1
        self._state_open()
        _OPEN.pack_into(self._map, OFF_OPEN, self.open_len, self.open_count)
        self._state_close()

    def announce(self, step: int) -> None:
        """The index of the open step, when the rank knows it before the step ends."""
        self._state_open()
        _OPEN_STEP.pack_into(self._map, OFF_OPEN_STEP, step)
        self._state_close()

    def publish(self, step: int, digest: bytes, truncated: bool, now: float) -> None:
        """Close the open step: its digest, event count and stored events become an entry."""
        mm = self._map
        n = self.head
        off = HEADER_SIZE + (n % self.depth) * ENTRY_SIZE
        entry = SeqWriter(mm, off)
        entry.begin()
        flags = TRUNCATED if truncated else 0
        _ENTRY_BODY.pack_into(
            mm, off + _U64.size, n, step, digest, self.open_count, flags, self.open_pos, self.open_len, now
        )
        entry.end()
        self.head = n + 1
        self.open_pos = self.log_head
        self.open_len = 0
        self.open_count = 0
        self._state_open()
        _STATE.pack_into(mm, OFF_STATE, self.head, step, self.open_pos, 0, 0, NO_STEP)
        self._state_close()

    def close(self) -> None:
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass


class RingReader:
    """Supervisor side: reads one rank's ring; never writes, never waits."""

    def __init__(self, path: Path):
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if st.st_size < HEADER_SIZE:
                raise RingLayoutError(f"{path}: too short for a digest ring")
            self.inode = (st.st_dev, st.st_ino)
            self._map = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            magic, version, depth, entry_size, log_bytes, slot, rank, pid, created = _IDENT.unpack_from(self._map, 0)
            if magic != MAGIC or version != VERSION or entry_size != ENTRY_SIZE or depth < 1 or log_bytes < 1:
                raise RingLayoutError(f"{path}: not a version-{VERSION} digest ring")
            if st.st_size < ring_size(depth, log_bytes):
                raise RingLayoutError(f"{path}: shorter than its header says")
        except Exception:
            self._map.close()
            raise
        self.header = RingHeader(depth, log_bytes, slot, rank, pid, created)
        self._log = HEADER_SIZE + depth * ENTRY_SIZE

    def head(self) -> int:
        """Entries the rank has published so far."""
        return _U64.unpack_from(self._map, OFF_STATE)[0]

    def read_state(self) -> RingState | None:
        """Published count and the open step, consistently; None if it stayed torn."""
        mm = self._map
        fields, ok = read_consistent(mm, OFF_STATE_SEQ, lambda: _STATE.unpack_from(mm, OFF_STATE))
        return RingState(*fields) if ok and fields is not None else None

    def lapped(self, index: int) -> bool:
        """True when entry ``index`` was overwritten by a newer one (lost for good)."""
        return self.head() - index > self.header.depth

    def read_entry(self, index: int) -> RingEntry | None:
        """Entry ``index``, or None when the ring lapped it or it stayed torn.

        A torn read (the writer was preempted inside the entry) is worth
        retrying later; :meth:`lapped` tells the two apart.
        """
        depth = self.header.depth
        head = self.head()
        if index < 0 or index >= head or head - index > depth:
            return None
        off = HEADER_SIZE + (index % depth) * ENTRY_SIZE
        mm = self._map
        fields, ok = read_consistent(mm, off, lambda: _ENTRY.unpack_from(mm, off))
        if not ok or fields is None:
            return None
        _seq, idx, step, dig, count, flags, pos, size, ts = fields
        if idx != index:
            return None
        return RingEntry(idx, step, dig, count, bool(flags & TRUNCATED), pos, size, ts)

    def read_range(self, pos: int, size: int) -> bytes | None:
        """Log bytes ``[pos, pos + size)``, or None when they were overwritten since."""
        log_bytes = self.header.log_bytes
        if size > log_bytes or size < 0:
            return None
        start = pos % log_bytes
        first = min(size, log_bytes - start)
        base = self._log
        mm = self._map
        data = mm[base + start : base + start + first]
        if first < size:
            data += mm[base : base + size - first]
        (log_head,) = _U64.unpack_from(mm, OFF_LOG_HEAD)
        if log_head > pos + log_bytes:
            return None
        return data

    def read_log(self, entry: RingEntry) -> bytes | None:
        """The stored events of a published step, or None when they were overwritten."""
        return self.read_range(entry.log_pos, entry.log_len)

    def close(self) -> None:
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass
