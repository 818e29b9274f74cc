"""Engine adapters: vLLM's and SGLang's own seams, wrapped once their modules load (zero code).

What the product knows of each external engine lives in one module here
(``vllm.py``, ``sglang.py``: seams, launcher and flag words, default port,
metric names, process titles and roles, the relay's adapter); this package's
``__init__`` holds the machinery that applies any engine's seams, and
``ENGINES`` names the modules.  Adding an engine (TensorRT-LLM, LMDeploy) is
copying one of those modules and naming it in ``ENGINES``.

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
* **the control plane** (vLLM's engine core and front end, which are not
  ranks): each writes a slot of the run's control segment
  (``runtime.claim_control``), claimed the first time its seam runs.  The
  engine core (role ``scheduler``): a step is ``EngineCoreProc.
  _process_engine_step`` (schedule, wait for the workers, update), its
  phase ``schedule`` inside ``Scheduler.schedule`` and ``execute`` after it,
  with the step's scheduled tokens as its shape; ``idle`` in
  ``_process_input_queue``, its wait for requests.  The front end (role
  ``frontend``, vLLM's API server): ``OutputProcessor.add_request``,
  ``process_outputs`` and ``abort_requests``; while requests are in flight
  it is inside a "step" that ends at each batch of outputs from the engine
  core, so requests waiting with no output make the group busy without
  progress, whoever holds them.

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
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from .. import compiled, runtime
from .. import heartbeat as hb
from . import sglang, vllm
from .seams import Seam

UNAVAILABLE = "engine_adapter_unavailable"
UNCHECKED = "engine_adapter_unchecked"
IDLE_PHASE = "idle"

# What a run loses when a seam of this kind is not wrapped (said in the lines above).
LOSES: dict[str, str] = {
    "collective": "per-collective progress and straggler arrivals (steps, stacks and process states still name "
    "a culprit)",
    "step": "step-aware verdicts (the engine's /metrics become the progress source)",
    "idle": "idle told from busy by the rank (the engine's /metrics tell it)",
    "control_step": "the engine core's own slot (its title and process state still name it)",
    "control_idle": "the engine core's own slot (its title and process state still name it)",
    "control_schedule": "the engine core's scheduling phase",
    "control_phase": "the engine core's request phase",
    "frontend": "the API server's requests in flight (the engine's /metrics are read instead)",
    "frontend_output": "the API server's requests in flight (the engine's /metrics are read instead)",
}

_monotonic = time.monotonic
_rt = runtime.state


# One module per external engine: everything the product knows about it (seams and the versions they were
# checked against, launcher and flag words, default port, metric names, process titles and roles, the relay's
# adapter).  Adding an engine is adding a module like ``vllm`` and naming it here.
ENGINES: tuple[ModuleType, ...] = (vllm, sglang)
BY_NAME: dict[str, ModuleType] = {e.NAME: e for e in ENGINES}

# module -> (engine, its seams): what the hook's finder patches
SEAMS: dict[str, tuple[str, tuple[Seam, ...]]] = {
    module: (e.NAME, seams) for e in ENGINES for module, seams in e.SEAMS.items()
}

# What the engines call their processes (``setproctitle``), first match wins: the title is the second signal of
# a process's role, after the adapter's claim of a control slot (``supervisor.processes.attempt.role_of``).
TITLE_ROLES: tuple[tuple[str, str], ...] = tuple(pair for e in ENGINES for pair in e.TITLE_ROLES)


def role_words(role: str, title: str) -> str:
    """What a process of ``role`` is called in a verdict, in its engine's words when its title (an engine's
    process title, or its launcher's command line) says which engine it belongs to ("" when none does)."""
    for engine in ENGINES:
        mine = any(title.startswith(prefix) for prefix, _role in engine.TITLE_ROLES) or any(
            word in title for word in engine.LAUNCHER_WORDS
        )
        if mine:
            return engine.ROLE_WORDS.get(role, "")
    return ""


def serves_api(command: str) -> bool:
    """The command line is an engine's server launcher that runs its API server in that process (vLLM's
    ``api_server`` or ``vllm serve`` without ``--headless``; SGLang's ``launch_server``: its tokenizer manager),
    on node 0 of its own multi-node launch (a node > 0 serves no API)."""
    words = command.split()
    for engine in ENGINES:
        cli = engine.CLI
        named = any(word in command for word in engine.LAUNCHER_WORDS) or (
            bool(cli)
            and any(w.endswith(cli[0]) and words[i + 1 : i + len(cli)] == list(cli[1:]) for i, w in enumerate(words))
        )
        if named:
            headless = any(flag in words for flag in engine.NO_API_FLAGS)
            return not headless and flag_value(words, engine.NODE_RANK_FLAGS) in (None, "0")
    return False


def flag_value(command: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value of the first of ``flags`` in a launcher's command (``--flag V`` or ``--flag=V``), else None."""
    for i, arg in enumerate(command):
        flag, eq, value = arg.partition("=")
        if flag in flags:
            if eq:
                return value
            if i + 1 < len(command):
                return command[i + 1]
    return None


def several_control(command: list[str] | tuple[str, ...]) -> bool:
    """The launcher starts more than one API server or engine core (``--api-server-count 2``, data parallel):
    only the first of each role claims its control slot."""
    for i, word in enumerate(command):
        flag, eq, value = word.partition("=")
        if not eq and i + 1 < len(command):
            value = command[i + 1]
        if any(flag in engine.MULTI_CONTROL_FLAGS for engine in ENGINES) and value.isdigit() and int(value) > 1:
            return True
    return False


def role_from_title(title: str) -> str:
    """The role an engine's own process title names ("" when it names none)."""
    for prefix, role in TITLE_ROLES:
        if title.startswith(prefix):
            return role
    return ""


_originals: list[tuple[type, str, Any]] = []  # (class, name, what its __dict__ held): uninstrument() restores
_reported: set[str] = set()
_lock = threading.Lock()
_installed: list[tuple[Seam, type]] = []  # every seam wrapped in this process (the drill lane looks them up)
_collective_wrapper: list[Callable[[str, Any], Any]] = []  # the hook's, for instrumented() (set by patcher)


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


def release(text: str) -> tuple[int, ...]:
    """A release as numbers: "0.32.0+cpu" -> (0, 32, 0), "0.10.1.1.post2" -> (0, 10, 1, 1); () when none."""
    out: list[int] = []
    for part in text.split("+", 1)[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(out)


def checked_on(version: str, releases: tuple[str, str]) -> bool:
    """``version`` lies in the inclusive range ``releases`` (an unknown version does not)."""
    have = release(version)
    return bool(have) and release(releases[0]) <= have <= release(releases[1])


def _unchecked(engine: str, found: list[tuple[Seam, Any, Any]]) -> list[tuple[Seam, tuple[str, str]]]:
    """The seams about to be wrapped whose checked releases do not hold the installed version, with those."""
    default = getattr(BY_NAME.get(engine), "CHECKED_RELEASES", None)
    version = engine_version(engine)
    out = []
    for seam, _owner, _fn in found:
        releases = seam.releases or default
        if releases is not None and not checked_on(version, releases):
            out.append((seam, releases))
    return out


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
                problems.append(f"{why} (lost: {LOSES.get(seam.kind, seam.kind)})")
            continue
        found.append((seam, owner, fn))
    return found, problems


def _report(engine: str, module_name: str, problems: list[str], what: str = UNAVAILABLE, then: str = "") -> None:
    """One line per engine, module and kind of line in this process (the supervisor logs it once per run)."""
    key = f"{what}:{engine}:{module_name}"
    if key in _reported:
        return
    _reported.add(key)
    then = then or "falling back to the torch.distributed hook and the engine's metrics"
    print(
        f"supervise: {what} {engine} {engine_version(engine)} {module_name}: {'; '.join(problems)}; {then}",
        file=sys.stderr,
        flush=True,
    )


def _report_unchecked(engine: str, module_name: str, seams: list[tuple[Seam, tuple[str, str]]]) -> None:
    """The installed release is outside what these seams were checked on: they are wrapped all the same (their
    signatures matched), and the line says what a user loses with ``--no-hook`` if one misbehaves."""
    parts = [f"{seam.owner}.{seam.method} checked on {low}..{high}" for seam, (low, high) in seams]
    lost = sorted({LOSES.get(seam.kind, seam.kind) for seam, _releases in seams})
    _report(
        engine,
        module_name,
        parts,
        UNCHECKED,
        "wrapped all the same (their signatures match); the supervisor's docs/watchdogs.md lists the releases; "
        f"without them (--no-hook) a run loses: {'; '.join(lost)}",
    )


def patcher(collective_wrapper: Callable[[str, Any], Any]) -> Callable[[Any], None]:
    """The finder's patcher for every module in ``SEAMS`` (``collective_wrapper``: the hook's lane wrapper)."""

    _collective_wrapper[:] = [collective_wrapper]

    def patch(module: Any) -> None:
        entry = SEAMS.get(module.__name__)
        if entry is None:
            return
        engine, seams = entry
        found, problems = check(module, seams)
        if problems:
            _report(engine, module.__name__, problems)
            return
        unchecked = _unchecked(engine, found)
        if unchecked:
            _report_unchecked(engine, module.__name__, unchecked)
        with _lock:
            for seam, owner, fn in found:
                if getattr(fn, "__tp_supervise_wrapped__", False):
                    continue
                new = (
                    _WRAPPERS[seam.kind](seam, fn) if seam.kind != "collective" else collective_wrapper(seam.label, fn)
                )
                _originals.append((owner, seam.method, owner.__dict__.get(seam.method)))
                _installed.append((seam, owner))
                setattr(owner, seam.method, new)

    return patch


def installed(match: Callable[[Seam], bool]) -> tuple[Seam, type] | None:
    """The first seam wrapped in this process that ``match`` accepts, and its class (the drill lane's targets)."""
    with _lock:
        return next(((seam, owner) for seam, owner in _installed if match(seam)), None)


def instrumented(seam: Seam, fn: Any) -> Any:
    """``fn`` wrapped as ``seam``'s method is (the drill lane runs a fault inside the step it replaces)."""
    if seam.kind == "collective":
        return _collective_wrapper[0](seam.label, fn)
    return _WRAPPERS[seam.kind](seam, fn)


def uninstrument() -> None:
    """Put back every method this module wrapped (the engine as it was)."""
    with _lock:
        while _originals:
            owner, name, original = _originals.pop()
            _installed[:] = [(s, o) for s, o in _installed if not (o is owner and s.method == name)]
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


class _StepDepth(threading.local):
    depth = 0


_step = _StepDepth()
_idle_shown: list[Any] = [None]  # the writer whose phase says idle now (a step's phase replaces it)


def _scheduled_tokens(args: tuple, kwargs: dict) -> int:
    """vLLM's ``SchedulerOutput.total_num_scheduled_tokens``; SGLang's batch ``extend_num_tokens``; 0 unknown."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    for name in ("total_num_scheduled_tokens", "extend_num_tokens"):
        value = getattr(first, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _wrap_step(seam: Seam, fn: Any) -> Any:
    label = seam.label

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if compiled.is_compiling():
            return fn(self, *args, **kwargs)
        w = _rt.writer
        if w is None or _step.depth or _rt.pid != os.getpid():
            return fn(self, *args, **kwargs)
        _step.depth = 1
        try:
            now = _monotonic()
            w.set_phase(label, now)
            _idle_shown[0] = None
            w.step_begin(now, _scheduled_tokens(args, kwargs))
        except Exception:
            _step.depth = 0
            return fn(self, *args, **kwargs)
        try:
            result = fn(self, *args, **kwargs)
        except BaseException:
            _step.depth = 0
            _end_step(w)
            raise
        _step.depth = 0
        _end_step(w)
        return result

    wrapper.__tp_supervise_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _end_step(w: Any) -> None:
    """End the step in the slot; never raises (the engine's own result or exception goes on unchanged)."""
    try:
        w.step_end(_monotonic())
    except Exception:
        pass


def _wrap_idle(seam: Seam, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if compiled.is_compiling():
            return fn(self, *args, **kwargs)
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


# -- the control plane: vLLM's engine core (scheduler) and front end, each in its control slot -------------
SCHEDULE_PHASE = hb.SCHEDULE_PHASE
EXECUTE_PHASE = "execute"
_MISSING = object()


def _control(role: int) -> Any:
    """This process's writer of ``role``'s control slot (claimed on first use), or None."""
    w = _rt.control.get(role, _MISSING)
    if w is _MISSING or _rt.pid != os.getpid():
        try:
            return _rt.claim_control(role)
        except Exception:
            return None
    return w


def _control_around(seam: Seam, fn: Any, before: Callable[[Any], None], after: Callable[[Any, Any], None]) -> Any:
    """``fn`` wrapped in ``before(writer)`` and ``after(writer, its result or None)`` on the control slot of the
    seam's role.  Neither raises into the engine nor replaces its exception; without a slot, ``fn`` alone."""
    role = seam.role

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if compiled.is_compiling():
            return fn(self, *args, **kwargs)
        w = _control(role)
        if w is None:
            return fn(self, *args, **kwargs)
        try:
            before(w)
        except Exception:
            return fn(self, *args, **kwargs)
        try:
            result = fn(self, *args, **kwargs)
        except BaseException:
            _quietly(after, w, None)
            raise
        _quietly(after, w, result)
        return result

    wrapper.__tp_supervise_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _quietly(after: Callable[[Any, Any], None], w: Any, result: Any) -> None:
    try:
        after(w, result)
    except Exception:
        pass


def _wrap_control_step(seam: Seam, fn: Any) -> Any:
    """The engine core's step: begin, and end however it ends."""
    return _control_around(seam, fn, lambda w: w.step_begin(_monotonic()), lambda w, _r: w.step_end(_monotonic()))


def _shape_of(w: Any, scheduled: Any) -> None:
    tokens = getattr(scheduled, "total_num_scheduled_tokens", 0)
    w.step_shape(tokens if isinstance(tokens, int) and tokens > 0 else 0, EXECUTE_PHASE, _monotonic())


def _wrap_control_schedule(seam: Seam, fn: Any) -> Any:
    """The scheduling call inside a step: phase ``schedule``, then the step's shape and ``execute``."""
    return _control_around(seam, fn, lambda w: w.set_phase(SCHEDULE_PHASE, _monotonic()), _shape_of)


def _wrap_control_phase(seam: Seam, fn: Any) -> Any:
    """Work the engine core does between steps (a client's request): its phase while it runs, idle after."""
    label = seam.label
    return _control_around(
        seam, fn, lambda w: w.set_phase(label, _monotonic()), lambda w, _r: w.set_phase(IDLE_PHASE, _monotonic())
    )


def _wrap_control_idle(seam: Seam, fn: Any) -> Any:
    role = seam.role

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if compiled.is_compiling():
            return fn(self, *args, **kwargs)
        w = _control(role)
        if w is not None:
            try:
                w.set_phase(IDLE_PHASE, _monotonic())
            except Exception:
                pass
        return fn(self, *args, **kwargs)

    wrapper.__tp_supervise_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _frontend_in_flight(w: Any, processor: Any, output: bool) -> None:
    """The front end's slot after a change of its requests: inside a "step" while any is in flight, a step
    that ends with each batch of outputs (its progress).  Requests that all went away without output (the
    clients gave up) end it without progress: a client's timeout never hides a scheduler that stopped."""
    try:
        n = len(processor.request_states)
    except Exception:
        return
    now = _monotonic()
    inside = w.flags & hb.IN_STEP
    if inside and output:
        w.step_end(now)
        inside = 0
    elif inside and not n:
        w.step_cancel(now)
        inside = 0
    if n and not inside:
        w.step_begin(now, 0)


def _wrap_frontend(seam: Seam, fn: Any, output: bool = False) -> Any:
    role = seam.role

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        result = fn(self, *args, **kwargs)
        if compiled.is_compiling():
            return result
        w = _control(role)
        if w is not None:
            try:
                _frontend_in_flight(w, self, output)
            except Exception:
                pass
        return result

    wrapper.__tp_supervise_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


_WRAPPERS: dict[str, Callable[[Seam, Any], Any]] = {
    "step": _wrap_step,
    "idle": _wrap_idle,
    "control_step": _wrap_control_step,
    "control_idle": _wrap_control_idle,
    "control_schedule": _wrap_control_schedule,
    "control_phase": _wrap_control_phase,
    "frontend": _wrap_frontend,
    "frontend_output": lambda seam, fn: _wrap_frontend(seam, fn, output=True),
}
