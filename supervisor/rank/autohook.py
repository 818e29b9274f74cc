"""Zero-code instrumentation: heartbeats from any torch.distributed program.

Installed by the ``sitecustomize`` the supervisor puts on the ranks'
PYTHONPATH.  Importing torch costs seconds, so nothing is imported here: a
meta-path finder waits until the program itself imports ``torch.distributed``
and then wraps every way a rank waits on its peers:

* ``init_process_group``: when the process joins the default group it claims
  the heartbeat slot of its global rank (this is how tree mode finds ranks
  that a launcher such as torchrun, vLLM or SGLang spawned);
* the collectives (``collectives.COLLECTIVES``: tensor and object
  collectives, ``barrier``/``monitored_barrier``, ``send``/``recv``/
  ``isend``/``irecv``, ``batch_isend_irecv``): each call marks the rank "in
  collective <op>" in the slot while it runs, bumps the collective count and
  stamps its arrival (the thread's lane's ring: ``heartbeat``);
* work objects (``works``): a call that returns work (``async_op=True``,
  ``isend``/``irecv``, ``batch_isend_irecv``) leaves it in flight until it is
  waited on, observed complete or collected, and a thread blocked in
  ``Work.wait()`` or ``Work.get_future().wait()`` is "in collective";
* ``_coalescing_manager``: the block's exit is the collective (it issues the
  coalesced work; with ``async_ops=True`` its works are tracked as above);
* the functional collectives (DTensor, transformers' ``tp_plan``): issuing
  counts as a collective, blocking in ``wait_tensor`` is "in collective".

Several threads may be in collectives at once: each thread enters through
its own lane of the slot (``slot_writer.Lane``), so one thread leaving never
hides another still inside.  Calls made inside a wrapped call (``send`` runs
``isend``, object collectives run tensor ones) are part of it, not counted
again.

Every call that counts a collective through a lane stamps its arrival: the
wrapper below, ``_Coalescing``'s exit and the functional collectives (through
``runtime.begin_collective``); a wait on a work is not a collective of its
own (the issuing call was stamped).

The per-call path is a few stores and takes no lock: it records the call's
arguments (until it returns) rather than their description, and the rank's
monitor thread (``works.Monitor``) writes the shapes into the slot only for
a call that lasts (``SlotWriter.describe_late``); bench/bench_heartbeat.py
measures it.

In spawn mode the slot is claimed at startup already (its index is in the
environment), so ranks that never join a group still report liveness.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from typing import Any

from . import compiled, drill_lane, engines, runtime, works
from .collectives import COALESCING_MANAGER, COLLECTIVES, cached_describe
from .heartbeat import ARRIVAL_INDEX as _ARRIVAL_INDEX

_installed = False
_monotonic = time.monotonic
_rt = runtime.state  # the slot writer is _rt.writer (None until claimed, and in a forked child)
_thread = runtime.thread_state  # per thread: its lane into the slot (runtime.lane)
_monitor = works.monitor  # describes long calls, publishes works in flight; the hot path only wakes it
_funcol = threading.local()  # per thread: (op, desc) of the last functional collective issued


def _call_counted(name: str, cache: dict, fn, args: tuple, kwargs: dict):
    """A collective call on a thread without a lane (all taken): through the holder count."""
    t = _thread
    w = _rt.writer
    if w is None or t.depth:
        return fn(*args, **kwargs)
    t.depth = 1
    w.collective_begin(name, cached_describe(cache, args, kwargs), _monotonic())
    try:
        result = fn(*args, **kwargs)
    finally:
        t.depth = 0
        w.collective_end(_monotonic())
    if result is not None:
        works.issued(result, name, args, kwargs, cache)
    return result


def _wrap_collective(name: str, fn):
    cache: dict[tuple, str] = {}  # descriptions, by shape and dtype (for the paths that need one at once)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if compiled.is_compiling():  # traced by torch.compile: the engine's call alone (compiled)
            return fn(*args, **kwargs)
        ln = _thread.lane  # always the current writer's (runtime drops it in a forked child)
        if ln is None:
            ln = runtime.lane()
            if ln is None:
                return _call_counted(name, cache, fn, args, kwargs)
        if ln.depth:  # inside another collective call of this thread: part of it
            return fn(*args, **kwargs)
        if not _monitor.awake:
            _monitor.wake()
        # ``ln.call(name, fn, args, kwargs, now)`` inlined: the same stores in
        # the same order, one Python frame less per collective (slot_writer.Lane).
        now = _monotonic()
        w = ln.writer
        ln.depth = 1
        ln.op = name
        ln.args = args  # described late from them (slot_writer.Lane)
        ln.kwargs = kwargs
        w.text_lane = ln
        if name is not w.op or w.desc:
            w.show(ln, now, now)
        word = ln.word
        ln.value = value = ln.value + 3  # one more collective, and inside
        ln.ring[value & _ARRIVAL_INDEX] = now  # its arrival, before the count that publishes it
        word[0] = value
        try:
            result = fn(*args, **kwargs) if kwargs else fn(*args)
        finally:
            ln.value = value = value - 1  # outside again
            word[0] = value
            ln.depth = 0
            ln.args = ln.kwargs = None
            if w.several and w.text_lane is ln:
                w.lane_left(ln, now)
        if result is not None:  # work to wait for later: in flight until then (works)
            works.issued(result, name, args, kwargs, cache)
        return result

    _mark_wrapped(wrapper)
    return wrapper


class _Coalescing:
    """A ``_coalescing_manager`` block: its exit issues (and, unless async, waits for) the coalesced work."""

    __slots__ = ("inner", "manager")

    def __init__(self, inner) -> None:
        self.inner = inner
        self.manager = None

    def __enter__(self):
        self.manager = self.inner.__enter__()
        return self.manager

    def __exit__(self, *exc):
        ln = _thread.lane
        if ln is None:
            ln = runtime.lane()
            if ln is None:
                return _call_counted(COALESCING_MANAGER, {}, self._exit, exc, {})
        if ln.depth:
            return self.inner.__exit__(*exc)
        ln.enter(COALESCING_MANAGER, "", _monotonic())
        try:
            return self._exit(*exc)
        finally:
            ln.leave()

    def _exit(self, *exc):
        suppress = self.inner.__exit__(*exc)
        works.issued(list(getattr(self.manager, "works", None) or ()), COALESCING_MANAGER, (), {}, {})
        return suppress


def _wrap_coalescing(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        inner = fn(*args, **kwargs)
        if compiled.is_compiling():
            return inner
        ln = _thread.lane
        nested = (ln is not None and ln.depth) or _thread.depth  # batch_isend_irecv uses one itself
        return inner if nested else _Coalescing(inner)

    _mark_wrapped(wrapper)
    return wrapper


def _wrap_init(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        runtime.enter_rendezvous(_rank_argument(args, kwargs))
        result = fn(*args, **kwargs)
        try:
            import torch.distributed as dist

            runtime.joined_group(dist.get_rank())
        except Exception as exc:  # never break the user's program
            print(f"supervise: could not claim a heartbeat slot: {exc!r}", file=sys.stderr)
        if not os.environ.get(runtime.ENV_SLOT):
            _die_with_parent()
        try:
            # Per-rank debug server (flight-recorder trace, tracebacks) that
            # answers while the main thread is blocked inside a collective.
            from . import flight

            flight.serve_in_rank()
        except Exception as exc:
            print(f"supervise: flight-recorder server not started: {exc!r}", file=sys.stderr)
        return result

    _mark_wrapped(wrapper)
    return wrapper


def _rank_argument(args, kwargs) -> int:
    """The global rank ``init_process_group`` was asked to join as (its ``rank`` argument, else ``RANK`` as
    its env:// rendezvous reads it), -1 when not known before the join."""
    try:
        rank = kwargs.get("rank", args[4] if len(args) > 4 else -1)
        if rank is None or int(rank) < 0:
            rank = os.environ.get("RANK", -1)
        return int(rank)
    except (TypeError, ValueError):
        return -1


def _wrap_destroy(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = args[0] if args else kwargs.get("group")
        result = fn(*args, **kwargs)
        if group is None:
            # Leaving the default group on purpose: the rank is finishing.
            runtime.finished()
        return result

    _mark_wrapped(wrapper)
    return wrapper


_crashed = False


def _note_crash(previous):
    def hook(*args, **kwargs):
        global _crashed
        _crashed = True
        return previous(*args, **kwargs)

    return hook


def _at_exit() -> None:
    """Interpreter shutdown without an uncaught exception: a planned exit.

    In tree mode the supervisor cannot read a grandchild's exit status; this
    flag is how it tells a finishing rank from a vanished one.  (os._exit and
    fatal signals skip atexit, so they still count as vanished.)  A process
    still inside ``init_process_group`` did not finish: multiprocessing's
    worker bootstrap catches the target's exception and leaves through
    ``sys.exit(1)``, which runs atexit with no excepthook called.
    """
    if not _crashed and not runtime.joining():
        runtime.finished()


def _die_with_parent() -> None:
    """Tree mode: a rank is the launcher's child, not ours, so it has no
    parent-death signal from us.  Ask for SIGKILL when the launcher dies (the
    launcher itself dies with the supervisor): SIGKILL also ends a rank that
    is stopped and could never run its death-watch thread."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def _mark_wrapped(fn: Any) -> None:
    """Ours: never wrapped twice (a function object takes attributes; typed Any for that)."""
    fn.__tp_supervise_wrapped__ = True


def patch(dist_module) -> None:
    """Wrap init, the collectives and the work objects of ``torch.distributed`` (idempotent)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    targets: list[Any] = [m for m in (dist_module, c10d) if m is not None]
    for module in targets:
        init = getattr(module, "init_process_group", None)
        if init is not None and not getattr(init, "__tp_supervise_wrapped__", False):
            module.init_process_group = _wrap_init(init)
        destroy = getattr(module, "destroy_process_group", None)
        if destroy is not None and not getattr(destroy, "__tp_supervise_wrapped__", False):
            module.destroy_process_group = _wrap_destroy(destroy)
    # One wrapper per function, set in both modules: torch compares them by
    # identity (``P2POp`` checks ``op in (isend, irecv)``, the coalescing
    # manager ``op is all_reduce``).
    wrapped: dict[int, object] = {}
    names = [(name, _wrap_collective) for name in COLLECTIVES] + [(COALESCING_MANAGER, None)]
    for name, _ in names:
        for module in targets:
            fn = getattr(module, name, None)
            if fn is None or getattr(fn, "__tp_supervise_wrapped__", False):
                continue
            new = wrapped.get(id(fn))
            if new is None:
                new = _wrap_coalescing(fn) if name == COALESCING_MANAGER else _wrap_collective(name, fn)
                wrapped[id(fn)] = new
            setattr(module, name, new)
    torch_c = sys.modules.get("torch._C")
    if c10d is not None and torch_c is not None:
        works.install(c10d, torch_c)


# Functional collectives (DTensor, transformers' tp_plan, torch.compile'd
# code): issuing is asynchronous and the rank blocks in ``wait_tensor``.  Each
# issue counts as a collective (progress); the wait is marked "in collective"
# under the name and shapes of the last collective the thread issued.
FUNCOL_ISSUE = (
    "all_reduce",
    "all_gather_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "all_reduce_coalesced",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
    "permute_tensor",
)


def _wrap_funcol_issue(name: str, fn):
    op = f"funcol.{name}"
    cache: dict[tuple, str] = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if compiled.is_compiling() or _rt.writer is None:
            return fn(*args, **kwargs)
        _funcol.last = text = (op, cached_describe(cache, args, kwargs))
        runtime.begin_collective(*text)
        try:
            return fn(*args, **kwargs)
        finally:
            runtime.end_collective()

    _mark_wrapped(wrapper)
    return wrapper


def _wrap_funcol_wait(fn):
    wait_names: dict[str, str] = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if compiled.is_compiling() or _rt.writer is None:
            return fn(*args, **kwargs)
        op, desc = getattr(_funcol, "last", ("funcol.wait_tensor", ""))
        name = wait_names.get(op)
        if name is None:
            name = wait_names[op] = op + ".wait"
        runtime.begin_collective(name, desc)
        try:
            return fn(*args, **kwargs)
        finally:
            runtime.end_collective()

    _mark_wrapped(wrapper)
    return wrapper


def patch_functional(module) -> None:
    """Wrap ``torch.distributed._functional_collectives`` (idempotent)."""
    for name in FUNCOL_ISSUE:
        fn = getattr(module, name, None)
        if fn is not None and not getattr(fn, "__tp_supervise_wrapped__", False):
            setattr(module, name, _wrap_funcol_issue(name, fn))
    wait = getattr(module, "wait_tensor", None)
    if wait is not None and not getattr(wait, "__tp_supervise_wrapped__", False):
        module.wait_tensor = _wrap_funcol_wait(wait)


def collective_wrapper(name: str, fn):
    """The lane wrapper of a collective function or method (``engines`` wraps vLLM's and SGLang's with it)."""
    return _wrap_collective(name, fn)


def _note_registered(path: str, name: Any, rtype: Any) -> None:
    """One line ``<rtype> <name>`` appended (one write, O_APPEND: lines of several processes never interleave)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{rtype} {name}\n".encode())
        finally:
            os.close(fd)
    except (OSError, TypeError, ValueError):
        pass


def patch_resource_tracker(module) -> None:
    """Note every name the process registers with multiprocessing's resource tracker (named semaphores, shared
    memory) in the run's folder: the tracker unlinks them at exit, but a teardown's SIGKILL kills it first, and the
    supervisor removes what is left (``supervisor.processes.shm.registered``).  A registration is rare (a lock, a
    segment created), never on a step's path."""
    run_dir = os.environ.get(runtime.ENV_RUN_DIR)
    register = getattr(module, "register", None)
    if not run_dir or register is None or getattr(register, "__tp_supervise_wrapped__", False):
        return
    path = os.path.join(run_dir, runtime.REGISTERED_SHM_FILE)

    @functools.wraps(register)
    def wrapper(name, rtype):
        _note_registered(path, name, rtype)
        return register(name, rtype)

    _mark_wrapped(wrapper)
    module.register = wrapper


FUNCOL_MODULE = "torch.distributed._functional_collectives"
_PATCHERS = {
    "torch.compiler": compiled.bind,  # first: the gate every wrapper passes (compiled)
    "torch.distributed": patch,
    FUNCOL_MODULE: patch_functional,
    "multiprocessing.resource_tracker": patch_resource_tracker,
}
# vLLM's and SGLang's seams (``engines``): the same finder patches them right after their modules run.
_PATCHERS.update(dict.fromkeys(engines.SEAMS, engines.patcher(collective_wrapper)))


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patcher):
        self.inner = inner
        self.patcher = patcher

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            self.patcher(module)
        except Exception as exc:
            print(f"supervise: {module.__name__} not instrumented: {exc!r}", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loaders of ``torch.distributed``, its functional collectives
    and the engines' modules so we patch each module right after it runs.

    It asks the finders after it for the spec; another finder that does the
    same (an import hook of the program's that asks every finder but itself,
    us included) asks us back for the same name: we answer None to that inner
    call, so the two never recurse, and each wraps the loader once."""

    def __init__(self):
        self._asking = threading.local()

    def find_spec(self, fullname, path, target=None):
        patcher = _PATCHERS.get(fullname)
        if patcher is None:
            return None
        asking = self._asking.__dict__.setdefault("names", set())
        if fullname in asking:
            return None
        asking.add(fullname)
        try:
            finders = list(sys.meta_path)
            # Only those after us: the import system asked the ones before us already (one of them may be
            # asking us now), and asking them again would wrap what they return twice.
            after = finders[finders.index(self) + 1 :] if self in finders else finders
            for finder in after:
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    if not isinstance(spec.loader, _Loader):
                        spec.loader = _Loader(spec.loader, patcher)
                    return spec
            return None
        finally:
            asking.discard(fullname)


def install() -> None:
    """Install the hook (called from sitecustomize; idempotent)."""
    global _installed
    if _installed or not runtime.enabled():
        return
    _installed = True
    import atexit

    if not os.environ.get(runtime.ENV_SLOT):
        # Tree mode only: in spawn mode the supervisor reads the real exit
        # status, and a rank leaving with code 0 while its peers run is a fault.
        sys.excepthook = _note_crash(sys.excepthook)
        atexit.register(_at_exit)
        # Every process of a launcher's tree ends with the supervisor, rank or not (vLLM's engine core): only
        # the launcher has the parent-death signal, and a launcher's spawned children inherit no death pipe.
        runtime.state.start_death_watch()
    if os.environ.get(runtime.ENV_SLOT):
        # Spawn mode: the rank's slot is known; claim it now so liveness and
        # the stack signal work even before (or without) a process group.
        runtime.claim(int(os.environ.get("RANK", "0")), instrumented=False)
    for name, patcher in _PATCHERS.items():
        if name in sys.modules:
            patcher(sys.modules[name])
    sys.meta_path.insert(0, _Finder())
    drill_lane.install()  # a run started by ``supervise drill`` only: nothing otherwise
