"""The main loop's one wait: the events other threads post, and the loop's own timers.

Every timer of the decider (a window to see whether a rank's peers finish too,
the wait for another node's answer, the hold of a failure for the other nodes'
news, the relay's restart pause, the once-a-second tick that beats /livez) is
an entry in one deadline heap, kept here and fired on the main thread: no
``threading.Timer``, no helper thread that posts later.  The loop waits on its
queue until the next deadline (``get(timeout=next - now)``), as trio's
``Deadlines`` and kubelet's ``syncLoopIteration`` tickers do.  The clock is
passed in, so a window is tested by moving a fake clock, not by sleeping.

A timer fires once, as the event it was given, in the handler table of the phase
the loop is in then; an attempt's timers carry its number, so one that comes
after that attempt ended is dropped as stale like any late event.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TICK_S = 1.0  # the loop's own tick (LoopTick): /livez beats when the main loop takes it


@dataclass(order=True)
class Timer:
    """One entry of the heap (``cancel`` it to drop it)."""

    when: float
    seq: int
    event: object = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class Loop:
    """``post`` from any thread; ``at``/``after``/``next`` from the main thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._heap: list[Timer] = []
        self._seq = itertools.count()

    def post(self, event: object) -> None:
        self._queue.put(event)

    def at(self, when: float, event: object) -> Timer:
        """``event`` comes out of ``next`` once the clock reads ``when``."""
        timer = Timer(when, next(self._seq), event)
        heapq.heappush(self._heap, timer)
        return timer

    def after(self, seconds: float, event: object) -> Timer:
        return self.at(self.clock() + max(0.0, seconds), event)

    def next_deadline(self) -> float | None:
        while self._heap and self._heap[0].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0].when if self._heap else None

    def due(self) -> object | None:
        """The earliest timer whose time has come (removed), or None."""
        when = self.next_deadline()
        if when is None or when > self.clock():
            return None
        return heapq.heappop(self._heap).event

    def next(self, until: float | None = None) -> object | None:
        """The next thing to handle: a due timer first (so a busy queue never starves them), else a posted event,
        waiting at most until the next deadline or ``until``.  None: nothing came by then (the caller looks at
        its clock and asks again)."""
        event = self.due()
        if event is not None:
            return event
        limits = [t for t in (self.next_deadline(), until) if t is not None]
        timeout = max(0.0, min(limits) - self.clock()) if limits else None
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return self.due()
