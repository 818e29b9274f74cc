"""The drill's injection lane: a fault armed from outside for one process of the run, at one seam.

Off unless the run was started by ``supervise drill``: the drill puts
``SUPERVISE_DRILL=<token>:<folder>`` in the environment of the run it
starts (a fresh token each run), and only then does ``install`` start a
thread in each process of the run.  Production runs have no such variable:
no thread, no check on any call, nothing wrapped.

The thread looks every ``POLL_S`` for ``<folder>/<its pid>.json`` (written
atomically by the drill: ``{"token": ..., "kind": ..., "seam": ...}``).  A
file whose token is not this run's is ignored.  Once armed, the fault fires
at the next call of its seam, in the engine's own thread (a rank stuck
*inside its step*, a collective skipped), by replacing that seam's method
on its class for one call; a fault with no seam (``now``) fires on the lane's
own thread.  Seams: ``step`` (a TP worker's step), ``collective`` (an
all-reduce: the engine's own collective seam where it has one, else
``torch.distributed.all_reduce``), ``schedule`` (the scheduler's scheduling
call), ``now``.

Kinds (docs/drills.md says what each models and what a supervisor should
rule): ``python_loop``, ``native_gil``, ``native_nogil``, ``deadlock``,
``skip_collective``, ``misshaped_collective``, ``raise``, ``exit0``,
``grow_memory``, ``not_dumpable``.

Guest code (stdlib; torch only where the engine already imported it): the
lane never raises into the engine, and nothing runs per call before a fault
is armed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from . import compiled

ENV_DRILL = "SUPERVISE_DRILL"
POLL_S = 0.2
GROW_CHUNK = 64 << 20  # grow_memory: bytes a step, every GROW_EVERY_S, each page touched
GROW_EVERY_S = 0.05
PR_SET_DUMPABLE = 4

SEAM_KINDS = {
    "python_loop": ("step", "schedule"),
    "native_gil": ("step",),
    "native_nogil": ("step",),
    "deadlock": ("step",),
    "skip_collective": ("collective",),
    "misshaped_collective": ("collective",),
    "raise": ("step",),
    "exit0": ("step",),
    "grow_memory": ("now",),
    "not_dumpable": ("now",),
}

_state: dict[str, Any] = {"token": None, "folder": None, "thread": None}


class DrillFault(RuntimeError):
    """The exception ``raise`` throws inside the step (its message says it came from a drill)."""


# -- the faults: each named so a stack says what it is ------------------------------------------------------
def drill_stuck_in_python() -> None:
    n = 0
    while True:
        n = (n + 1) % 1_000_003


def drill_stuck_in_native_holding_the_gil() -> None:
    import ctypes  # only where a fault needs it: the lane is imported by every process of every run

    libc = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL: no other thread of the process runs Python
    while True:
        libc.pause()


def drill_stuck_in_native_without_the_gil() -> None:
    import ctypes

    libc = ctypes.CDLL(None)  # a CDLL call releases the GIL: the process's other threads go on
    while True:
        libc.pause()


def drill_deadlock() -> None:
    """Two threads, two locks taken in opposite orders: this thread and its helper wait for ever."""
    first, second = threading.Lock(), threading.Lock()
    helper_holds = threading.Event()

    def drill_deadlock_helper() -> None:
        with second:
            helper_holds.set()
            first.acquire()

    with first:
        threading.Thread(target=drill_deadlock_helper, name="drill-deadlock", daemon=True).start()
        helper_holds.wait()
        second.acquire()


def drill_raise() -> None:
    raise DrillFault("supervise drill: an exception raised inside the step")


def drill_exit0() -> None:
    os._exit(0)


def drill_grow_memory() -> None:
    held = []
    while True:
        chunk = bytearray(GROW_CHUNK)  # zero-filled: every page is touched
        held.append(chunk)
        time.sleep(GROW_EVERY_S)


def drill_not_dumpable() -> str:
    """'' once the process is not dumpable (ptrace and /proc's private files need CAP_SYS_PTRACE), else why not."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return f"prctl(PR_SET_DUMPABLE, 0) failed: errno {ctypes.get_errno()}"
    return ""


_STUCK = {
    "python_loop": drill_stuck_in_python,
    "native_gil": drill_stuck_in_native_holding_the_gil,
    "native_nogil": drill_stuck_in_native_without_the_gil,
    "deadlock": drill_deadlock,
    "raise": drill_raise,
    "exit0": drill_exit0,
}
# Faults with no seam, run by the lane's thread: those that return do so before the drill is answered (it acts on
# the answer: a SIGSTOP once the process is not dumpable); one that never returns is answered first.
_NOW_RETURNING = {"not_dumpable": drill_not_dumpable}
_NOW_FOREVER = {"grow_memory": drill_grow_memory}


# -- where a fault fires -------------------------------------------------------------------------------------
def _seam_target(seam: str) -> tuple[Any, str, Any, bool] | None:
    """``(owner, method name, Seam or None, is a method)``: whose next call fires the fault, among what the hook
    wrapped in this process."""
    from . import engines

    if seam == "collective":
        found = engines.installed(lambda s: s.kind == "collective" and s.label.endswith("all_reduce"))
        if found is not None:
            return found[1], found[0].method, found[0], True
        dist = sys.modules.get("torch.distributed")
        return (dist, "all_reduce", None, False) if dist is not None and hasattr(dist, "all_reduce") else None
    kind = {"step": "step", "schedule": "control_schedule"}.get(seam)
    found = None if kind is None else engines.installed(lambda s: s.kind == kind)
    return None if found is None else (found[1], found[0].method, found[0], True)


def _once(owner: Any, name: str, fire) -> None:
    """Replace ``owner.name`` for one call: the first caller runs ``fire(original, args, kwargs)``; the method
    is put back first (a fault that returns leaves the engine as it was)."""
    original = getattr(owner, name)
    taken = threading.Lock()

    def drilled(*args, **kwargs):
        if compiled.is_compiling() or not taken.acquire(blocking=False):
            return original(*args, **kwargs)
        setattr(owner, name, original)
        return fire(original, args, kwargs)

    drilled.__tp_supervise_wrapped__ = True  # type: ignore[attr-defined]
    setattr(owner, name, drilled)


def arm(kind: str, seam: str) -> str:
    """Arm ``kind`` at ``seam`` in this process; '' when armed (a ``now`` kind that returns: done), else why not.
    A ``now`` kind that never returns is run by the lane's thread once it has answered."""
    if kind not in SEAM_KINDS or seam not in SEAM_KINDS[kind]:
        return f"kind {kind!r} does not fire at seam {seam!r}"
    if seam == "now":
        return _NOW_RETURNING[kind]() if kind in _NOW_RETURNING else ""
    target = _seam_target(seam)
    if target is None:
        return f"no {seam} seam is wrapped in this process"
    owner, name, wrapped_as, method = target
    at = 1 if method else 0  # the tensor: after ``self`` in a method
    if kind == "skip_collective":

        def fire(original, args, kwargs):
            if kwargs.get("async_op") or len(args) <= at:
                return original(*args, **kwargs)  # a call the lane cannot fake (async): the fault is spent
            return args[at] if method else None  # as if reduced; torch's all_reduce returns None

    elif kind == "misshaped_collective":

        def fire(original, args, kwargs):
            if len(args) <= at:
                return original(*args, **kwargs)
            args = list(args)
            args[at] = args[at].reshape(-1)[:-1].clone()  # one element fewer than the peers send
            return original(*args, **kwargs)

    else:
        stuck = _STUCK[kind]
        # inside the step as the engine's own would be: the seam's instrumentation around the fault
        inner = (lambda _self, *_a, **_k: stuck()) if method else (lambda *_a, **_k: stuck())
        from . import engines

        in_step = engines.instrumented(wrapped_as, inner) if wrapped_as is not None else inner

        def fire(_original, args, kwargs):
            return in_step(*args, **kwargs)

    _once(owner, name, fire)
    return ""


# -- the lane's thread ---------------------------------------------------------------------------------------
def _poll() -> None:
    token, folder = _state["token"], _state["folder"]
    pid = os.getpid()
    path = os.path.join(folder, f"{pid}.json")
    while True:
        time.sleep(POLL_S)
        try:
            with open(path) as f:
                order = json.load(f)
            os.unlink(path)
        except (OSError, ValueError):
            continue
        if not isinstance(order, dict) or order.get("token") != token:
            continue  # not this run's drill
        kind, seam = str(order.get("kind")), str(order.get("seam"))
        try:
            problem = arm(kind, seam)
        except Exception as exc:  # the lane never raises into the engine
            problem = repr(exc)[:300]
        _answer(folder, pid, token, problem)
        if seam == "now" and kind in _NOW_FOREVER and not problem:
            try:
                _NOW_FOREVER[kind]()
            except Exception:
                pass


def _answer(folder: str, pid: int, token: str, problem: str) -> None:
    """``<pid>.armed`` (atomically, carrying the run's token): the drill reads whether the fault is armed."""
    try:
        tmp = os.path.join(folder, f".{pid}.armed.tmp")
        with open(tmp, "w") as f:
            json.dump({"token": token, "pid": pid, "problem": problem, "at": time.time()}, f)
        os.replace(tmp, os.path.join(folder, f"{pid}.armed"))
    except OSError:
        pass


def _start() -> None:
    t = threading.Thread(target=_poll, name="tp-supervise-drill", daemon=True)
    _state["thread"] = t
    t.start()


def install() -> None:
    """Start the lane where the run was started by ``supervise drill`` (``SUPERVISE_DRILL``); else nothing."""
    value = os.environ.get(ENV_DRILL, "")
    token, sep, folder = value.partition(":")
    if not (sep and len(token) >= 16 and os.path.isdir(folder)) or _state["thread"] is not None:
        return
    _state["token"], _state["folder"] = token, folder
    try:
        os.register_at_fork(after_in_child=_start)  # a forked child (a worker, an engine core) polls for itself
        _start()
    except Exception:
        pass
