"""Zero-code instrumentation: heartbeats from any torch.distributed program.

Installed by the ``sitecustomize`` the supervisor puts on the ranks'
PYTHONPATH.  Importing torch costs seconds, so nothing is imported here: a
meta-path finder waits until the program itself imports ``torch.distributed``
and then wraps

* ``init_process_group``: when the process joins the default group it claims
  the heartbeat slot of its global rank (this is how tree mode finds ranks
  that a launcher such as torchrun, vLLM or SGLang spawned);
* the collectives: each call marks "in collective <op> <shapes>" in the slot
  and bumps the collective sequence number;
* the functional collectives (DTensor, transformers' ``tp_plan``): issuing
  counts as a collective, blocking in ``wait_tensor`` is "in collective".

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

from . import runtime
from .collectives import COLLECTIVES

_installed = False
_depth = threading.local()


def describe(args: tuple, kwargs: dict) -> str:
    """Shapes and dtype of the first tensor (or tensor list) argument."""
    for value in list(args) + list(kwargs.values()):
        shape = getattr(value, "shape", None)
        if shape is not None:
            dims = "x".join(str(d) for d in shape) or "scalar"
            return f"{dims} {str(getattr(value, 'dtype', '')).replace('torch.', '')}"
        if isinstance(value, (list, tuple)) and value:
            first = value[0]
            shape = getattr(first, "shape", None)
            if shape is not None:
                dims = "x".join(str(d) for d in shape) or "scalar"
                dtype = str(getattr(first, "dtype", "")).replace("torch.", "")
                return f"{len(value)}*[{dims} {dtype}]"
            return f"{len(value)} objects"
    return ""


def _wrap_collective(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_depth, "n", 0)
        if depth:
            return fn(*args, **kwargs)
        _depth.n = 1
        runtime.begin_collective(name, describe(args, kwargs))
        try:
            return fn(*args, **kwargs)
        finally:
            runtime.end_collective()
            _depth.n = 0

    wrapper.__tp_supervise_wrapped__ = True
    return wrapper


def _wrap_init(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        runtime.enter_rendezvous()
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

    wrapper.__tp_supervise_wrapped__ = True
    return wrapper


def _wrap_destroy(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = args[0] if args else kwargs.get("group")
        result = fn(*args, **kwargs)
        if group is None:
            # Leaving the default group on purpose: the rank is finishing.
            runtime.finished()
        return result

    wrapper.__tp_supervise_wrapped__ = True
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
    fatal signals skip atexit, so they still count as vanished.)
    """
    if not _crashed:
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


def patch(dist_module) -> None:
    """Wrap init and the collectives of ``torch.distributed`` (idempotent)."""
    try:
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
    except Exception:
        c10d = None
    targets = [m for m in (dist_module, c10d) if m is not None]
    for module in targets:
        init = getattr(module, "init_process_group", None)
        if init is not None and not getattr(init, "__tp_supervise_wrapped__", False):
            setattr(module, "init_process_group", _wrap_init(init))
        destroy = getattr(module, "destroy_process_group", None)
        if destroy is not None and not getattr(destroy, "__tp_supervise_wrapped__", False):
            setattr(module, "destroy_process_group", _wrap_destroy(destroy))
    wrapped: dict[int, object] = {}
    for name in COLLECTIVES:
        for module in targets:
            fn = getattr(module, name, None)
            if fn is None or getattr(fn, "__tp_supervise_wrapped__", False):
                continue
            new = wrapped.get(id(fn))
            if new is None:
                new = _wrap_collective(name, fn)
                wrapped[id(fn)] = new
            setattr(module, name, new)


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
_last_issued = threading.local()


def _wrap_funcol_issue(name: str, fn):
    op = f"funcol.{name}"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        desc = describe(args, kwargs)
        _last_issued.value = (op, desc)
        runtime.begin_collective(op, desc)
        try:
            return fn(*args, **kwargs)
        finally:
            runtime.end_collective()

    wrapper.__tp_supervise_wrapped__ = True
    return wrapper


def _wrap_funcol_wait(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        op, desc = getattr(_last_issued, "value", ("funcol.wait_tensor", ""))
        runtime.begin_collective(op + ".wait", desc)
        try:
            return fn(*args, **kwargs)
        finally:
            runtime.end_collective()

    wrapper.__tp_supervise_wrapped__ = True
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


FUNCOL_MODULE = "torch.distributed._functional_collectives"
_PATCHERS = {"torch.distributed": patch, FUNCOL_MODULE: patch_functional}


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
    """Wraps the loaders of ``torch.distributed`` and its functional
    collectives so we patch each module right after it runs."""

    def find_spec(self, fullname, path, target=None):
        patcher = _PATCHERS.get(fullname)
        if patcher is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, patcher)
                return spec
        return None


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
    if os.environ.get(runtime.ENV_SLOT):
        # Spawn mode: the rank's slot is known; claim it now so liveness and
        # the stack signal work even before (or without) a process group.
        runtime.claim(int(os.environ.get("RANK", "0")), instrumented=False)
    for name, patcher in _PATCHERS.items():
        if name in sys.modules:
            patcher(sys.modules[name])
    sys.meta_path.insert(0, _Finder())
