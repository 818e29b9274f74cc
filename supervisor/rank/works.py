"""Work objects: waits on them, and issued collectives still in flight.

A torch.distributed call with ``async_op=True`` (and ``isend``/``irecv``,
``batch_isend_irecv``, an async ``_coalescing_manager``) returns work objects;
the rank blocks later, in ``Work.wait()`` or ``Work.get_future().wait()``, or
never blocks and polls ``is_completed()``.  The zero-code hook shows the rank
"in collective"

* while a thread is blocked in ``wait``/``synchronize`` of any work, or in
  ``wait`` of the future of a work the hook saw issued (the thread's lane,
  as for a blocking collective, described as the op that issued the work;
  not counted as a collective, and not stamped in the arrival ring: the
  issuing call was, and that is when the rank arrived);
* while a work it saw issued is in flight: from issue until the work is
  waited on, observed complete (by the program's ``is_completed()`` or by
  the monitor thread below), or garbage collected.

What torch 2.13 allows, and why it is done this way:

* ``torch.distributed.Work`` (``torch._C._distributed_c10d.Work``) is a
  pybind11 class whose methods can be replaced on the class; its instances
  take weak references but no attributes.  So ``wait``, ``synchronize``,
  ``is_completed`` and ``get_future`` are patched on the class (and on each
  subclass that defines its own, such as ``FakeWork`` and
  ``PythonCallbackWork``, as soon as one is seen), and an issued work is
  remembered by ``id`` with a weak reference.  The program gets torch's own
  object back (type checks unchanged, no proxy), and a dropped work does not
  keep its tensors alive.
* ``get_future()`` returns a new ``torch.Future`` wrapper at each call: the
  futures of tracked works are remembered the same way and
  ``torch._C.Future.wait`` is patched (one dict lookup for any other future).
* A wait ends the work's flight when it returns, whether or not the backend
  says it completed: on NCCL ``wait()`` returns once the current stream waits
  for the collective (as a blocking NCCL collective returns at enqueue), and
  some works never report completion (``FakeWork``).
* ``_IllegalWork`` (what a collective returns inside a coalescing block)
  answers nothing; it is never tracked.

Works in flight are published by the monitor thread (``Monitor`` below) as
one holder of the slot's ``IN_COLLECTIVE`` count
(``SlotWriter.collective_hold``): every ``SWEEP_INTERVAL_S`` while
works are tracked it drops the completed and collected ones and sets or
clears that holder.  So the hot path never takes a lock: a work shows as in
flight at most one interval after its issuing call returned (the call itself
shows as a collective) and stops at most one interval after it completed,
both well under any watchdog threshold.  No weakref callbacks: the cyclic GC
can run one inside any allocation of any thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import compiled, runtime
from .collectives import cached_describe, describe

if TYPE_CHECKING:
    from .slot_writer import SlotWriter

SWEEP_INTERVAL_S = 0.1
PARK_AFTER_IDLE = 10  # idle passes before the monitor parks (1 s)
WAIT_OP = "wait"  # the slot's op for a wait on a work the hook did not see issued
_WORK_METHODS = ("wait", "synchronize", "is_completed", "get_future")
_WRAPPED = "__tp_supervise_wrapped__"
_ORIGINAL = "__tp_supervise_original__"

_monotonic = time.monotonic
_rt = runtime.state
_thread = runtime.thread_state
# id(work) -> (weak reference to it, op of the call that issued it, its
# description or None, weak reference to its tensor argument or None: the
# description is written late from it):
# issued, not yet waited on, completed or collected.  Plain dict operations
# only (each one atomic).
_pending: dict[int, tuple] = {}
# id(future) -> (weak ref to the future, the work's entry in _pending).
_futures: dict[int, tuple[weakref.ref, tuple]] = {}


class _Types:
    """What ``install`` found in torch (empty until torch.distributed is imported)."""

    def __init__(self) -> None:
        self.work: type | None = None
        self.illegal: type | None = None
        self.tensor: type | None = None
        self.patched: set[type] = set()
        self.is_completed: dict[type, Callable[[object], object]] = {}  # work type -> torch's own is_completed for it


_types = _Types()


def _is_done(work) -> bool:
    """torch's own ``is_completed`` (not ours: it would drop the entry); one that fails counts as done."""
    fn = _types.is_completed.get(type(work))
    try:
        return bool(fn(work)) if fn is not None else True
    except Exception:
        return True


_NO_TIMEOUT = object()  # wait() called without a timeout (torch's default applies)


def _call(orig, self, timeout):
    return orig(self) if timeout is _NO_TIMEOUT else orig(self, timeout)


def _wait_without_lane(orig, self, entry, timeout):
    """A wait on a thread whose lane is not open yet, or that has none (all taken)."""
    ln = runtime.lane()
    if ln is not None:
        if ln.depth:  # inside a collective call of this thread: part of it
            return _call(orig, self, timeout)
        return _wait_in_lane(ln, orig, self, entry, timeout)
    w = _rt.writer
    if w is None or _thread.depth:
        return _call(orig, self, timeout)
    _thread.depth += 1
    w.collective_hold(1, _monotonic())
    try:
        return _call(orig, self, timeout)
    finally:
        _thread.depth -= 1
        w.collective_end(_monotonic())


def _wait_in_lane(ln, orig, self, entry, timeout):
    if entry is None:
        ln.wait(WAIT_OP, "", None, _monotonic())
    else:
        ln.wait(entry[1], entry[2], entry[3], _monotonic())
    try:
        return orig(self) if timeout is _NO_TIMEOUT else orig(self, timeout)
    finally:
        ln.leave()


# -- patched methods ----------------------------------------------------------


def _waiter(orig):
    # The lane case of _wait_in_lane inlined: every blocking collective runs this wait.
    def wait(self, timeout=_NO_TIMEOUT):
        if compiled.is_compiling():
            return orig(self) if timeout is _NO_TIMEOUT else orig(self, timeout)
        ln = _thread.lane
        if ln is not None and ln.depth:  # torch's own wait inside a collective call (every blocking one)
            return orig(self) if timeout is _NO_TIMEOUT else orig(self, timeout)
        entry = _pending.pop(id(self), None) if _pending else None
        if entry is not None and entry[0]() is not self:
            entry = None  # a dead work's entry under a reused id
        if ln is None:
            return _wait_without_lane(orig, self, entry, timeout)
        if entry is None:
            ln.wait(WAIT_OP, "", None, _monotonic())
        else:
            ln.wait(entry[1], entry[2], entry[3], _monotonic())
        try:
            return orig(self) if timeout is _NO_TIMEOUT else orig(self, timeout)
        finally:
            ln.leave()

    return wait


def _observer(orig):
    def is_completed(self, *args, **kwargs):
        done = orig(self, *args, **kwargs)
        if done and not compiled.is_compiling() and _pending:
            _pending.pop(id(self), None)
        return done

    return is_completed


def _future_linker(orig):
    def get_future(self, *args, **kwargs):
        fut = orig(self, *args, **kwargs)
        if compiled.is_compiling():
            return fut
        entry = _pending.get(id(self))
        if entry is not None and entry[0]() is self:
            try:
                _futures[id(fut)] = (weakref.ref(fut), entry)
            except TypeError:
                pass
        return fut

    return get_future


def _future_waiter(orig):
    def wait(self):
        if compiled.is_compiling():
            return orig(self)
        link = _futures.pop(id(self), None) if _futures else None
        if link is None or link[0]() is not self:
            return orig(self)
        entry = link[1]
        try:
            return _wait_without_lane(orig, self, entry, _NO_TIMEOUT)
        finally:
            work = entry[0]()
            if work is not None:
                _drop(id(work), entry)

    return wait


_FACTORIES = {"wait": _waiter, "synchronize": _waiter, "is_completed": _observer, "get_future": _future_linker}


def _mark(new, orig, name: str, owner: str):
    new.__name__ = name
    new.__qualname__ = f"{owner}.{name}"
    new.__doc__ = getattr(orig, "__doc__", None)
    setattr(new, _WRAPPED, True)
    setattr(new, _ORIGINAL, orig)
    return new


def _patch_type(cls: type) -> None:
    """Patch the methods ``cls`` defines itself (inherited ones are patched where they are defined)."""
    for name in _WORK_METHODS:
        fn = cls.__dict__.get(name)
        if fn is None or getattr(fn, _WRAPPED, False):
            continue
        orig = getattr(cls, name)
        try:
            setattr(cls, name, _mark(_FACTORIES[name](orig), orig, name, cls.__name__))
        except (TypeError, AttributeError):
            continue
    fn = getattr(cls, "is_completed", None)
    original = getattr(fn, _ORIGINAL, fn)
    if original is not None:
        _types.is_completed[cls] = original
    _types.patched.add(cls)


def install(c10d, torch_c) -> None:
    """Patch ``Work`` (and its known subclasses) and ``torch._C.Future`` (idempotent)."""
    work = getattr(c10d, "Work", None)
    if work is None:
        return
    _types.work = work
    _types.illegal = getattr(c10d, "_IllegalWork", None)
    _types.tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    todo = [work]
    while todo:
        cls = todo.pop()
        if cls is not _types.illegal and cls not in _types.patched:
            _patch_type(cls)
        todo.extend(cls.__subclasses__())
    future = getattr(torch_c, "Future", None)
    wait = getattr(future, "wait", None) if future is not None else None
    if future is not None and wait is not None and not getattr(wait, _WRAPPED, False):
        future.wait = _mark(_future_waiter(wait), wait, "wait", "Future")


# -- issue --------------------------------------------------------------------


def _track(work, op: str, desc: str | None, arg) -> None:
    cls = type(work)
    if cls is _types.illegal:
        return
    if cls not in _types.patched:
        _patch_type(cls)
    try:
        _pending[id(work)] = (weakref.ref(work), op, desc, arg)
    except TypeError:  # no weak references: not tracked (the hook shows only its waits)
        pass


def issued(result, op: str, args: tuple, kwargs: dict, cache: dict) -> None:
    """Track the work objects a collective call returned (``op``, its arguments, its description cache).

    ``result`` is what the call returned: a work, a list of works
    (``batch_isend_irecv``, a coalescing manager's ``works``), or anything else
    (``recv``'s source rank), which is not tracked.  A plain tensor first
    argument is kept by weak reference (the description is written late, as a
    call's, if a wait on the work lasts); other arguments are described now.
    """
    work = _types.work
    if work is None or not (isinstance(result, work) or type(result) is list):
        return
    first = args[0] if args else None
    arg = desc = None
    if type(first) is _types.tensor:
        arg = weakref.ref(first)
    else:
        desc = cached_describe(cache, args, kwargs)
    if type(result) is work:  # what gloo and NCCL return: the common case, made short
        _pending[id(result)] = (weakref.ref(result), op, desc, arg)
    elif type(result) is list:
        for w in result:
            if isinstance(w, work):
                _track(w, op, desc, arg)
    else:
        _track(result, op, desc, arg)
    if not monitor.awake:
        monitor.wake()


# -- the monitor thread ---------------------------------------------------------


def _drop(key: int, entry: tuple) -> None:
    """Remove ``entry`` if it is still the one under ``key`` (no lock: put back whatever else we took)."""
    taken = _pending.pop(key, None)
    if taken is not None and taken is not entry:
        _pending.setdefault(key, taken)


def sweep() -> int:
    """Drop the tracked works that completed or were collected; returns how many are left."""
    for key, entry in list(_pending.items()):
        work = entry[0]()
        if work is None or _is_done(work):
            _drop(key, entry)
        del work
    for fkey, link in list(_futures.items()):
        if link[0]() is None or link[1][0]() is None:
            _futures.pop(fkey, None)
    return len(_pending)


class Monitor:
    """The rank's background thread ``supervise-rank-monitor``: the slow half of the hook.

    Every ``SWEEP_INTERVAL_S`` while the rank is active it

    * drops tracked works that completed or were collected, and holds (or
      releases) one ``IN_COLLECTIVE`` holder while any is left in flight;
    * writes the description of a collective call that has lasted that long
      (``SlotWriter.describe_late``: the hot path records arguments only).

    It starts at the first collective and parks on an event after
    ``PARK_AFTER_IDLE`` passes with nothing in flight and no collective
    entered; the hot path reads ``awake`` (a bool) and calls ``wake`` only
    then.  A lost wake-up could only delay a description or the
    in-flight holder, never hold the rank in a collective it has left.
    """

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.awake = False
        self.event = threading.Event()
        self.holding: SlotWriter | None = None  # the slot writer we hold IN_COLLECTIVE on for works in flight
        self.seen = -1  # the lanes' activity at the previous pass

    def wake(self) -> None:
        self.awake = True
        if self.thread is None:
            t = threading.Thread(target=self._run, name="supervise-rank-monitor", daemon=True)
            self.thread = t
            t.start()
        else:
            self.event.set()

    def _publish(self, in_flight_now: bool) -> None:
        w = _rt.writer
        held = self.holding
        if held is not None and (held is not w or not in_flight_now):
            self.holding = None
            if held is w:
                held.collective_end(_monotonic())
        if in_flight_now and w is not None and self.holding is None:
            w.collective_hold(1, _monotonic())
            self.holding = w

    def tick(self) -> bool:
        """One pass; whether the rank was active since the previous one."""
        left = sweep()
        self._publish(left > 0)
        w = _rt.writer
        if w is not None:
            w.describe_late(describe)
        activity = self._activity()
        active = bool(left) or bool(activity & 1) or activity != self.seen
        self.seen = activity
        return active

    @staticmethod
    def _activity() -> int:
        """The lanes' values summed (changes when a collective is entered or left; odd while one runs)."""
        w = _rt.writer
        return sum(lane.value for lane in list(w.lanes)) if w is not None else 0

    def _run(self) -> None:
        idle = 0
        while True:
            try:
                active = self.tick()
            except Exception:  # a guest never dies of one bad pass, nor breaks the program
                active = True
            idle = 0 if active else idle + 1
            if idle >= PARK_AFTER_IDLE:
                self.event.clear()
                self.awake = False
                # A call or a work that raced the decision read ``awake`` as True: look once more.
                if not _pending and self._activity() == self.seen:
                    self.event.wait()
                self.awake = True
                idle = 0
                continue  # a pass at once after a wake-up
            time.sleep(SWEEP_INTERVAL_S)


monitor = Monitor()


def _after_fork_in_child() -> None:
    """The child has a slot writer of its own (or none) and no monitor thread."""
    _pending.clear()
    _futures.clear()
    monitor.__init__()  # type: ignore[misc]  # the same class: a fresh monitor in place (others hold it)


os.register_at_fork(after_in_child=_after_fork_in_child)
