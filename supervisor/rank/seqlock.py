"""The one seqlock of the shared-memory layouts (heartbeat slots, digest rings).

A sequence counter (u64, little endian) guards a group of fields that one
writer updates and another process reads, with no lock either side can hold:

* writer: store ``seq + 1`` (odd: inside an update), store the fields,
  store ``seq + 2`` (even);
* reader: load ``seq``; if odd, try again; copy the fields; load ``seq``
  again; the copy is consistent iff both loads are equal.  After a bounded
  number of tries the reader gives up and reports the last copy as torn,
  rather than spin on a writer that was stopped inside an update.

Memory ordering: CPython's stores into an ``mmap`` are plain memory copies in
program order, with no fences.  The protocol relies on the stores of one
writer becoming visible to the reader in program order and the reader's
loads not being reordered, which x86-64 (TSO) guarantees.  On weakly ordered
CPUs (aarch64) a reader can, rarely, accept a copy that mixes two
consecutive updates; every field the supervisor reads is a counter or a
timestamp that only grows, so such a copy is still a state the rank was in
at most one update earlier.

Only the owner of a region writes it, one update at a time: the heartbeat
slot's writer serialises its threads' updates with one lock (per-thread
collective "lanes" live outside the seqlock, one word each, written by their
own thread only: supervisor/rank/slot_writer.py).  A writer that finds the
counter odd (its predecessor died inside an update) makes it even before its
first update.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TypeVar

SEQ = struct.Struct("<Q")
READ_RETRIES = 64

T = TypeVar("T")


class SeqWriter:
    """The writer's side of one seqlock at ``offset`` in ``buf`` (the counter is cached)."""

    __slots__ = ("_buf", "_off", "_seq")

    def __init__(self, buf, offset: int):
        self._buf = buf
        self._off = offset
        (seq,) = SEQ.unpack_from(buf, offset)
        self._seq = seq + (seq & 1)

    def begin(self) -> None:
        self._seq += 1
        SEQ.pack_into(self._buf, self._off, self._seq)

    def end(self) -> None:
        self._seq += 1
        SEQ.pack_into(self._buf, self._off, self._seq)


def read_consistent(buf, offset: int, copy: Callable[[], T], retries: int = READ_RETRIES) -> tuple[T | None, bool]:
    """``(copy(), True)`` taken between two equal even counters, or ``(last copy or None, False)``."""
    last = None
    unpack = SEQ.unpack_from
    for _ in range(retries):
        (seq1,) = unpack(buf, offset)
        if seq1 & 1:
            continue
        value = copy()
        (seq2,) = unpack(buf, offset)
        if seq1 == seq2:
            return value, True
        last = value
    return last, False
