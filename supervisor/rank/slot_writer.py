"""The rank side of a heartbeat slot: ``SlotWriter`` and its per-thread ``Lane``.

The layout, the reader and the ordering rules of the slot are in
``heartbeat`` (the one definition of the wire format); this is how a rank
writes it from any number of threads:

* entering or leaving a collective through a **lane** is one aligned u64
  store into the thread's own lane (entering first stamps the collective's
  arrival in the lane's ring, one f64 store), with no lock: a lane has
  exactly one writing thread, and the reader sees either value of each store;
* everything else (identity, flags, steps, phase, the collective text, the
  holder count of ``IN_COLLECTIVE``) takes the writer's lock and the slot's
  seqlock, so the seqlock has one writer at a time whichever thread updates.

Fields are stored through typed views of the slot (one aligned store each,
in program order; the layout is little endian, and so must be the host),
not ``struct.pack_into``: a lane transition costs about 0.1 us, a locked
update a few tenths of a microsecond (bench/bench_heartbeat.py).
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable

from .heartbeat import (
    _D_LAST_STEP,
    _D_TS_COLL_BEGIN,
    _D_TS_HEARTBEAT,
    _D_TS_READY,
    _D_TS_STEP_BEGIN,
    _HEADER,
    _HOT,
    _I_FLAGS,
    _I_LAST_TOKENS,
    _I_ROLE,
    _I_STEP_TOKENS,
    _IDENT,
    _LOCAL,
    _PID_RANK,
    _Q_COLL_SEQ,
    _Q_LANE0,
    _Q_SEQ,
    _Q_STEP,
    _TEXT32,
    _TEXT64,
    ARRIVAL_INDEX,
    CLAIMED,
    DESC_SIZE,
    HEADER_SIZE,
    IN_COLLECTIVE,
    IN_STEP,
    INSTRUMENTED,
    LANES,
    MAGIC,
    OFF_COLL_DESC,
    OFF_COLL_OP,
    OFF_FLAGS,
    OFF_IDENT,
    OFF_LOCAL,
    OFF_PHASE,
    READY,
    RING_SIZE,
    SLOT_SIZE,
    VERSION,
    HeartbeatLayoutError,
    _encode,
    rings_offset,
    segment_size,
)

PHASE_CACHE = 32  # phase texts kept encoded per writer (an engine's labels; a program naming every step: the rest)


class SlotWriter:
    """Rank side: the writer of one slot, shared by every thread of the rank.

    Two ways into a collective:

    * a **lane** (``lane()``, one per thread, the hot path): entering and
      leaving are single stores into the thread's own lane, no lock;
    * the **holder count** (``collective_begin``/``collective_end``/
      ``collective_hold``): for threads without a lane and for work objects
      still in flight; ``IN_COLLECTIVE`` is set while any holder remains, so
      one thread leaving cannot hide another still inside.

    Every other update takes the writer's lock, so the slot's seqlock has one
    writer at a time whichever thread calls (two interleaved updates would
    break its parity), and a read-modify-write of the flags never loses a
    concurrent bit.  Fields are stored through typed views of the slot (one
    aligned store each, in program order; the layout is little endian, so is
    the host), not ``struct.pack_into``.  Not for use in a forked child
    (``runtime`` drops it there).
    """

    __slots__ = (
        "slot",
        "nslots",
        "flags",
        "stack_signal",
        "step",
        "coll_seq",
        "ts_step_begin",
        "last_step_s",
        "step_tokens",
        "phase",
        "_phases",
        "holders",
        "lanes",
        "several",
        "op",
        "desc",
        "text_lane",
        "described",
        "_map",
        "_base",
        "_lock",
        "_seq",
        "_u64",
        "_u32",
        "_f64",
        "_rings",
        "_rings_at",
        "_free_lanes",
        "_pid",
    )

    def __init__(self, path: str | os.PathLike, slot: int):
        if sys.byteorder != "little":
            raise HeartbeatLayoutError("the heartbeat layout is little endian; this host is not")
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if size < HEADER_SIZE:
            raise HeartbeatLayoutError(f"{path}: not a version-{VERSION} heartbeat segment")
        magic, version, nslots, slot_size, header_size, _created, _run = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or version != VERSION or slot_size != SLOT_SIZE or header_size != HEADER_SIZE:
            raise HeartbeatLayoutError(f"{path}: not a version-{VERSION} heartbeat segment")
        if not 0 <= slot < nslots or size < segment_size(nslots):
            raise HeartbeatLayoutError(f"slot {slot} outside the segment's {nslots} slots")
        self.slot = slot
        self.nslots = nslots
        self._pid = os.getpid()
        self._base = HEADER_SIZE + slot * SLOT_SIZE
        view = memoryview(self._map)[self._base : self._base + SLOT_SIZE]
        self._u64, self._u32, self._f64 = view.cast("Q"), view.cast("I"), view.cast("d")
        self._rings_at = rings_offset(nslots, slot)
        self._rings = memoryview(self._map)[self._rings_at : self._rings_at + LANES * RING_SIZE].cast("d")
        seq = self._u64[_Q_SEQ]
        self._seq = seq + (seq & 1)  # a predecessor that died inside an update left it odd
        self._lock = threading.Lock()
        self.flags = 0
        self.stack_signal = 0
        self.step = 0
        self.coll_seq = 0
        self.ts_step_begin = 0.0
        self.last_step_s = 0.0
        self.step_tokens = 0
        self.phase = ""  # what the slot's phase field holds
        self._phases: dict[str, bytes] = {}  # phase text -> its 32 bytes, as written
        self.holders = 0  # holders of IN_COLLECTIVE: threads without a lane in a collective, works in flight
        self.lanes: list[Lane] = []  # lanes handed out (their threads may have ended)
        self.several = False  # more than one lane handed out: leaving may have to show another lane's collective
        self._free_lanes = list(range(LANES - 1, -1, -1))
        self.op = ""  # what coll_op / coll_desc hold
        self.desc = ""
        self.text_lane: Lane | None = None  # the lane whose collective they describe
        self.described = -1  # the value of text_lane when a late description was written

    # Every locked update: store seq+1 (odd), the fields, seq+2 (even).  The
    # closing store is in a ``finally`` so that an exception raised into the
    # thread mid-update (KeyboardInterrupt) cannot leave the parity odd.

    def _open(self) -> int:
        """Start an update (caller holds the lock); returns the odd counter."""
        seq = self._seq + 1
        self._u64[_Q_SEQ] = seq
        return seq

    def _close(self, seq: int) -> None:
        self._u64[_Q_SEQ] = self._seq = seq + 1

    # -- identity and flags (rare) --------------------------------------------
    def claim(self, pid: int, rank: int, stack_signal: int, flags: int, now: float, role: int = 0) -> None:
        with self._lock:
            self.flags = flags | CLAIMED
            self.stack_signal = stack_signal
            seq = self._open()
            try:
                # A new process in the slot starts from zero (the supervisor sees the pid change).
                _IDENT.pack_into(self._map, self._base + OFF_IDENT, pid, rank, self.flags, stack_signal)
                _HOT.pack_into(self._map, self._base + OFF_FLAGS, self.flags, stack_signal, 0, 0, now, 0.0, 0.0, 0.0)
                _LOCAL.pack_into(self._map, self._base + OFF_LOCAL, self.slot)
                u32 = self._u32
                u32[_I_STEP_TOKENS] = u32[_I_LAST_TOKENS] = 0
                u32[_I_ROLE] = role
                for lane in self.lanes:
                    lane.value = 0
                for i in range(LANES):
                    self._u64[_Q_LANE0 + i] = 0
                # After the counts: a reader that saw a count of the previous process sees it drop.
                self._map[self._rings_at : self._rings_at + LANES * RING_SIZE] = bytes(LANES * RING_SIZE)
            finally:
                self._close(seq)
            self.step = self.coll_seq = self.step_tokens = 0

    def holder(self) -> int:
        """The pid the slot names now (0: never claimed); a read, for a claim that must not take a live
        process's slot."""
        return int(_PID_RANK.unpack_from(self._map, self._base + OFF_IDENT)[0])

    def change_flags(self, now: float, add: int = 0, clear: int = 0) -> None:
        """Set the ``add`` bits and clear the ``clear`` bits (no concurrent bit is lost).

        Clearing ``IN_COLLECTIVE`` drops every holder (a finishing rank); lanes are their threads' own.
        """
        with self._lock:
            flags = (self.flags | add) & ~clear
            if clear & IN_COLLECTIVE:
                self.holders = 0
            self._write_flags(flags, now, ready_now=bool(flags & READY and not self.flags & READY))

    def _write_flags(self, flags: int, now: float, ready_now: bool = False) -> None:
        """Caller holds the lock."""
        self.flags = flags
        seq = self._open()
        try:
            self._u32[_I_FLAGS] = flags
            f64 = self._f64
            f64[_D_TS_HEARTBEAT] = now
            if ready_now:
                f64[_D_TS_READY] = now
        finally:
            self._close(seq)

    def set_phase(self, name: str, now: float) -> None:
        """The phase text (encoded only when it changes: a per-step label costs one comparison)."""
        with self._lock:
            seq = self._open()
            try:
                if name != self.phase:
                    self._write_phase(name)
                self._f64[_D_TS_HEARTBEAT] = now
            finally:
                self._close(seq)

    def _write_phase(self, name: str) -> None:
        """The phase field (caller holds the lock, inside an update).  An engine's phases are a few labels
        that come back every step: each is encoded once (up to ``PHASE_CACHE`` of them), not per write."""
        data = self._phases.get(name)
        if data is None:
            data = _TEXT32.pack(_encode(name, 32))
            if len(self._phases) < PHASE_CACHE:
                self._phases[name] = data
        self._map[self._base + OFF_PHASE : self._base + OFF_PHASE + 32] = data
        self.phase = name

    def step_shape(self, tokens: int, phase: str, now: float) -> None:
        """The step in progress learned its shape (``tokens`` scheduled; the scheduler knows it only once it
        has scheduled) and is now in ``phase``."""
        with self._lock:
            self.step_tokens = tokens
            seq = self._open()
            try:
                self._u32[_I_STEP_TOKENS] = tokens
                if phase != self.phase:
                    self._write_phase(phase)
                self._f64[_D_TS_HEARTBEAT] = now
            finally:
                self._close(seq)

    # -- steps ----------------------------------------------------------------
    def step_begin(self, now: float, tokens: int = 0) -> None:
        """A step begins; ``tokens``: what it was given to compute (its shape; 0 when unknown)."""
        with self._lock:
            self.flags = flags = self.flags | IN_STEP | INSTRUMENTED
            self.ts_step_begin = now
            self.step_tokens = tokens
            seq = self._open()
            try:
                u32 = self._u32
                u32[_I_FLAGS] = flags
                u32[_I_STEP_TOKENS] = tokens
                f64 = self._f64
                f64[_D_TS_HEARTBEAT] = now
                f64[_D_TS_STEP_BEGIN] = now
            finally:
                self._close(seq)

    def step_end(self, now: float) -> None:
        with self._lock:
            self.flags = flags = self.flags & ~IN_STEP
            self.step = step = self.step + 1
            self.last_step_s = last = now - self.ts_step_begin
            seq = self._open()
            try:
                u32 = self._u32
                u32[_I_FLAGS] = flags
                u32[_I_LAST_TOKENS] = self.step_tokens
                self._u64[_Q_STEP] = step
                f64 = self._f64
                f64[_D_TS_HEARTBEAT] = now
                f64[_D_LAST_STEP] = last
            finally:
                self._close(seq)

    def step_cancel(self, now: float) -> None:
        """Leave the step without completing it: nothing came of it (a front end whose requests were all
        aborted), so it is not progress."""
        with self._lock:
            self.flags = flags = self.flags & ~IN_STEP
            seq = self._open()
            try:
                self._u32[_I_FLAGS] = flags
                self._f64[_D_TS_HEARTBEAT] = now
            finally:
                self._close(seq)

    # -- collectives: the holder count ----------------------------------------
    def collective_begin(self, op: str, desc: str, now: float) -> None:
        """Enter a collective without a lane: one more holder, one more collective counted."""
        with self._lock:
            self.holders += 1
            self.flags = flags = self.flags | IN_COLLECTIVE
            self.coll_seq = coll_seq = self.coll_seq + 1
            self.text_lane = None
            seq = self._open()
            try:
                self._write_text(op, desc)
                self._u32[_I_FLAGS] = flags
                self._u64[_Q_COLL_SEQ] = coll_seq
                f64 = self._f64
                f64[_D_TS_HEARTBEAT] = now
                f64[_D_TS_COLL_BEGIN] = now
            finally:
                self._close(seq)

    def collective_hold(self, n: int, now: float) -> None:
        """``n`` more holders without entering a collective (work objects in flight)."""
        with self._lock:
            self.holders += n
            if self.holders > 0 and not self.flags & IN_COLLECTIVE:
                self._write_flags(self.flags | IN_COLLECTIVE, now)

    def collective_end(self, now: float, n: int = 1) -> None:
        """``n`` holders leave; the flag clears when none is left, and the text then describes a lane
        still inside (a thread blocked in its own collective), not the collective that just ended."""
        with self._lock:
            held = self.holders - n
            self.holders = held if held > 0 else 0
            if held <= 0:
                self._write_flags(self.flags & ~IN_COLLECTIVE, now)
        if held <= 0:
            self.lane_left(None, now)

    # -- collectives: lanes ---------------------------------------------------
    def lane(self) -> Lane | None:
        """A lane for the calling thread (keep it in a thread-local), or None when all are taken."""
        with self._lock:
            if not self._free_lanes:
                return None
            index = self._free_lanes.pop()
            lane = Lane(self, index, int(self._u64[_Q_LANE0 + index]) & ~1)  # a freed lane keeps counting
            self.lanes.append(lane)
            self.several = len(self.lanes) > 1
            return lane

    def release_lane(self, lane: Lane) -> None:
        """The lane's thread ended: the lane goes back (outside any collective) for another thread."""
        if os.getpid() != self._pid:
            return  # a forked child dropping its copy of the parent's lanes: the slot is not ours
        with self._lock:
            if lane.writer is not self or lane not in self.lanes:
                return
            self.lanes.remove(lane)
            self.several = len(self.lanes) > 1
            lane.value &= ~1
            self._u64[_Q_LANE0 + lane.index] = lane.value
            if self.text_lane is lane:
                self.text_lane = None
            self._free_lanes.append(lane.index)

    def show(self, lane: Lane, now: float, begin: float | None = None) -> None:
        """Make coll_op/coll_desc/ts_coll_begin describe ``lane``'s collective, which began at
        ``begin`` (None: ``lane.begin()``); a call's description stays empty until
        ``describe_late`` writes it."""
        if begin is None:
            begin = lane.begin()
        with self._lock:
            self.text_lane = lane
            self.described = -1
            seq = self._open()
            try:
                self._write_text(lane.op, "" if lane.args is not None or lane.desc is None else lane.desc)
                f64 = self._f64
                f64[_D_TS_COLL_BEGIN] = begin
                f64[_D_TS_HEARTBEAT] = now
            finally:
                self._close(seq)

    def lane_left(self, lane: Lane | None, now: float) -> None:
        """``lane`` (or the last holder) left and the text describes it: describe another lane still inside, if any."""
        for other in list(self.lanes):
            if other is not lane and other.value & 1:
                self.show(other, now)
                return

    def describe_late(self, describe: Callable[[tuple, dict], str]) -> bool:
        """Write the description of the collective the text shows, if it still runs and has none yet.

        Called from another thread than the lane's (``works``' monitor): the
        hot path records a call's arguments, not their description (and a
        wait's description only if the slot shows none).  The
        lane's thread takes no lock, so a call that ended meanwhile is
        detected afterwards and its description cleared (the next pass
        describes the next call).  Returns whether it wrote one.
        """
        lane = self.text_lane
        if lane is None or lane.writer is not self:
            return False
        value, desc, args, kwargs = lane.value, lane.desc, lane.args, lane.kwargs
        if args is not None:  # described from a call's arguments or a wait's tensor, not from desc
            desc = None
            if type(args) is weakref.ref:  # a wait's tensor, by weak reference
                tensor = args()
                args = (tensor,) if tensor is not None else None
        if not value & 1 or value == self.described or (desc is None and args is None):
            return False
        if desc is None:
            try:
                desc = describe(args if isinstance(args, tuple) else (), kwargs or {})
            except Exception:
                desc = ""
        with self._lock:
            if self.text_lane is not lane or lane.value != value:
                return False
            self.described = value
            self._text_update(self.op, desc)
        if lane.value != value:  # it ended while we wrote: the text is not its successor's
            with self._lock:
                if self.described == value:
                    self._text_update(self.op, "")
        return True

    def _text_update(self, op: str, desc: str) -> None:
        """Caller holds the lock."""
        seq = self._open()
        try:
            self._write_text(op, desc)
        finally:
            self._close(seq)

    def _write_text(self, op: str, desc: str) -> None:
        """Caller holds the lock and is inside an update."""
        if op != self.op:
            _TEXT32.pack_into(self._map, self._base + OFF_COLL_OP, _encode(op, 32))
            self.op = op
        if desc != self.desc:
            _TEXT64.pack_into(self._map, self._base + OFF_COLL_DESC, _encode(desc, DESC_SIZE))
            self.desc = desc


class Lane:
    """One thread's way into collectives: its own u64 in the slot, written by that thread only.

    ``call`` runs a collective call inside (counted; described late, if it
    lasts); ``enter`` (a collective described by the caller) or ``wait``
    (blocking on work issued earlier, not counted again), then ``leave``.  The value is
    ``(collectives entered << 1) | inside``.  ``depth`` is for callers: calls
    made inside a collective call (``send`` runs ``isend``) are part of it and
    must not enter again.  The slot's text is rewritten (under the writer's
    lock) only when it changes, which in a model's steady state is never.

    Entering stamps the collective's arrival in the lane's ring (at
    ``value & ARRIVAL_INDEX``, the new value masked, before the value is
    stored: ``heartbeat``'s layout and ordering rules) and stores the lane;
    leaving stores the lane: two u64 stores and one f64 store per
    collective, no lock.  Neither ``ts_heartbeat`` nor ``ts_coll_begin`` is
    stored on this path: the reader takes the latest of them and the rings'
    newest entries.  A wait (not a collective of its own) stores
    ``ts_coll_begin`` and ``ts``; ``begin()`` is when the lane's current
    collective or wait began.  The zero-code hook's wrapper
    (``autohook._wrap_collective``) does what ``call`` does inline, one Python
    frame less per collective: change both together
    (tests/core/test_hook_fast_path.py compares them).
    """

    __slots__ = ("writer", "index", "value", "depth", "op", "desc", "args", "kwargs", "ts", "f64", "word", "ring")

    def __init__(self, writer: SlotWriter, index: int, value: int):
        self.writer = writer
        self.index = index
        self.value = value
        self.depth = 0
        self.op = ""
        self.desc: str | None = ""  # the caller's description (enter, wait); ignored while args is set
        self.args: tuple | weakref.ref | None = None  # a call's arguments (a wait's tensor): described late from
        # them, and only until leave()
        self.kwargs: dict | None = None
        self.ts = 0.0  # when its latest wait began (calls stamp the ring instead)
        self.f64 = writer._f64  # the slot as f64s
        at = _Q_LANE0 + index
        self.word = writer._u64[at : at + 1]  # the lane's u64 alone: word[0]
        self.ring = writer._rings[index * (RING_SIZE // 8) : (index + 1) * (RING_SIZE // 8)]  # its arrival stamps

    def begin(self) -> float:
        """When its current (or latest) collective or wait began."""
        count = self.value >> 1
        ts = self.ring[((count << 1) | 1) & ARRIVAL_INDEX] if count else 0.0
        return ts if ts > self.ts else self.ts

    def call(self, op: str, fn: Callable, args: tuple, kwargs: dict, now: float):
        """Run the collective call ``fn(*args, **kwargs)`` inside; returns what it returns.

        The arguments are kept (for a late description) only while it runs.
        """
        self.depth = 1
        self.op = op
        self.args = args
        self.kwargs = kwargs
        w = self.writer
        w.text_lane = self
        if op is not w.op or w.desc:
            w.show(self, now, now)
        word = self.word
        self.value = value = self.value + 3  # one more collective, and inside
        self.ring[value & ARRIVAL_INDEX] = now  # its arrival, before the count that publishes it
        word[0] = value
        try:
            return fn(*args, **kwargs) if kwargs else fn(*args)
        finally:
            self.value = value = value - 1  # outside again
            word[0] = value
            self.depth = 0
            self.args = self.kwargs = None
            if w.several and w.text_lane is self:
                w.lane_left(self, now)

    def enter(self, op: str, desc: str, now: float) -> None:
        """A collective described by the caller (the runtime API)."""
        self.depth = 1
        self.op = op
        self.desc = desc
        w = self.writer
        w.text_lane = self
        if op != w.op or desc != w.desc:
            w.show(self, now, now)
        self.value = value = self.value + 3
        self.ring[value & ARRIVAL_INDEX] = now  # its arrival, before the count that publishes it
        self.word[0] = value

    def wait(self, op: str, desc: str | None, arg: weakref.ref | None, now: float) -> None:
        """Blocking on work issued earlier by ``op``: inside, not counted again.

        Its issuing call left the op in the slot with an empty description:
        the description (``desc``, or formatted from the tensor ``arg``
        refers to) is written late, as a call's, if the wait lasts.
        """
        self.depth = 1
        self.op = op
        self.desc = desc
        self.args = arg
        self.kwargs = None
        self.ts = now
        w = self.writer
        w.text_lane = self
        if op is not w.op or w.desc:
            w.show(self, now, now)
        else:
            self.f64[_D_TS_COLL_BEGIN] = now
        self.value = value = self.value + 1
        self.word[0] = value

    def leave(self) -> None:
        self.value = value = self.value - 1
        self.word[0] = value
        self.depth = 0
        self.args = self.kwargs = None
        w = self.writer
        if w.several and w.text_lane is self:
            w.lane_left(self, self.begin())
