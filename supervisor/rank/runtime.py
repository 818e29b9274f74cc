"""Rank-side runtime: what a supervised rank imports (no torch needed).

Public API (all calls are no-ops when the process is not supervised)::

    from tp_supervise.supervisor.rank import runtime as sv

    sv.starting()                   # first thing: "I will report ready"
    sv.ready()                      # model loaded, serving
    with sv.step():                 # one engine step (progress = steps completed)
        with sv.collective("all_reduce", "64x256 float32"):
            ...
    sv.phase("schedule")            # free-form label of where the rank is

Environment it reads (set by ``supervise serve``; see docs/supervisor.md):

    SUPERVISE_RUN_ID          run id (also marks every process of the run)
    SUPERVISE_HEARTBEAT       path of the heartbeat segment
    SUPERVISE_CONTROL         path of the control segment: one slot per control-plane role (an
                              engine's scheduler, its front end), claimed by the engine adapter
    SUPERVISE_SLOT            slot index of this rank (spawn mode)
    SUPERVISE_SLOT_BASE       first global rank of this node (tree mode: slot = rank - base)
    SUPERVISE_DEATH_FD        <fd>:<inode> of the death pipe's read end (EOF = supervisor gone)
    SUPERVISE_SUPERVISOR_PID  pid of the supervisor (fallback for the death watch; the rank lets
                              it and its children ptrace it, see ``ptrace``)
    SUPERVISE_STACK_SIGNAL    signal on which the rank writes all threads' stacks
    SUPERVISE_RUN_DIR         per-run scratch directory (stack files live here)

Threads: every call may come from any thread.  A thread enters collectives
through its own lane of the slot (``slot_writer.Lane``: three stores, no
lock; the first four threads get one, others go through the writer's holder
count), so one thread leaving its collective never hides another that is
still blocked; every other update takes the slot writer's lock.  Entering
through a lane stamps the collective's arrival in the lane's ring
(``heartbeat``: the supervisor compares the ranks' arrivals at the same
collective to find a straggler).

Costs: a collective's enter + exit is a few aligned stores into an mmap
(well under a microsecond; bench/bench_heartbeat.py measures it).
"""

from __future__ import annotations

import faulthandler
import os
import select
import sys
import threading
import time
from typing import TextIO

from . import heartbeat as hb
from .slot_writer import Lane, SlotWriter

_monotonic = time.monotonic

ENV_RUN_ID = "SUPERVISE_RUN_ID"
ENV_HEARTBEAT = "SUPERVISE_HEARTBEAT"
ENV_CONTROL = "SUPERVISE_CONTROL"
ENV_SLOT = "SUPERVISE_SLOT"
ENV_SLOT_BASE = "SUPERVISE_SLOT_BASE"
ENV_DEATH_FD = "SUPERVISE_DEATH_FD"
ENV_SUPERVISOR_PID = "SUPERVISE_SUPERVISOR_PID"
ENV_STACK_SIGNAL = "SUPERVISE_STACK_SIGNAL"
ENV_RUN_DIR = "SUPERVISE_RUN_DIR"
# In the run's folder: the names its processes gave multiprocessing's resource tracker (autohook, processes.shm)
REGISTERED_SHM_FILE = "registered-shm"
ENV_SLOT_OWNER = "SUPERVISE_SLOT_OWNER"  # set by the rank that claimed its slot, inherited by its children
# Exit code of a rank that leaves because its supervisor is gone (EX_SOFTWARE).
EXIT_SUPERVISOR_GONE = 70


def stack_file_path(run_dir: str | os.PathLike, slot: int, pid: int) -> str:
    """Where a rank's faulthandler writes its stacks (one file per process)."""
    return os.path.join(os.fspath(run_dir), "stacks", f"slot-{slot}.pid-{pid}.txt")


class _Runtime:
    """Process-wide state of the rank side.  One instance, created lazily."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writer: SlotWriter | None = None
        self.pid = os.getpid()
        self.stack_file: TextIO | None = None
        self.death_watch_started = False
        self.forked = False
        # Control-plane slots this process writes (role -> writer; None: asked once, not to be had).
        self.control: dict[int, SlotWriter | None] = {}

    def claim(self, slot: int, rank: int, instrumented: bool) -> bool:
        path = os.environ.get(ENV_HEARTBEAT)
        if not path:
            return False
        if _held_by_a_live_ancestor():
            # A Python process the rank started (a compile worker, a helper script) inherits the rank's
            # environment and the hook; the slot stays the rank's.
            return False
        with self.lock:
            if self.writer is not None and self.pid == os.getpid():
                if instrumented and not self.writer.flags & hb.INSTRUMENTED:
                    self.writer.change_flags(time.monotonic(), add=hb.INSTRUMENTED)
                return True
            self.pid = os.getpid()
            try:
                writer = SlotWriter(path, slot)
            except (OSError, hb.HeartbeatLayoutError) as exc:
                print(f"supervise: heartbeat disabled for rank {rank}: {exc}", file=sys.stderr)
                return False
            stack_signal = self._register_stack_signal(slot)
            flags = hb.INSTRUMENTED if instrumented else 0
            writer.claim(self.pid, rank, stack_signal, flags, time.monotonic())
            self.writer = writer
            os.environ[ENV_SLOT_OWNER] = str(self.pid)  # what this rank's own children inherit
        _allow_supervisor_to_trace()
        self.start_death_watch()
        return True

    def claim_control(self, role: int) -> SlotWriter | None:
        """This process's slot of control-plane ``role`` (``heartbeat.CONTROL_ROLES``), claimed on the first
        call; None when the run has no control segment or another live process holds that role's slot (a
        second engine core of a data-parallel engine: the first keeps it).  Only the first call per role
        does any work; it never raises."""
        with self.lock:
            if self.pid != os.getpid():
                self.control = {}
            if role in self.control:
                return self.control[role]
            self.control[role] = None
            path = os.environ.get(ENV_CONTROL)
            if not path:
                return None
            try:
                writer = SlotWriter(path, hb.control_slot(role))
                holder = writer.holder()
                if holder and holder != os.getpid() and pid_alive(holder):
                    return None
                writer.claim(os.getpid(), -1, 0, hb.READY | hb.INSTRUMENTED, time.monotonic(), role=role)
            except (OSError, ValueError, hb.HeartbeatLayoutError) as exc:
                print(f"supervise: control-plane heartbeat disabled: {exc}", file=sys.stderr)
                return None
            self.control[role] = writer
        _allow_supervisor_to_trace()
        self.start_death_watch()
        return writer

    def _register_stack_signal(self, slot: int) -> int:
        signum = int(os.environ.get(ENV_STACK_SIGNAL, "0") or 0)
        run_dir = os.environ.get(ENV_RUN_DIR)
        if not signum or not run_dir:
            return 0
        try:
            path = stack_file_path(run_dir, slot, os.getpid())
            os.makedirs(os.path.dirname(path), exist_ok=True)
            stack_file = self.stack_file = open(path, "w", buffering=1)
            faulthandler.register(signum, file=stack_file, all_threads=True, chain=False)
            if not faulthandler.is_enabled():
                # Stacks at death too (SIGSEGV, SIGABRT from a C++ abort such as gloo's std::terminate):
                # a rank that dies before any dump can read it leaves its last stacks here.  A program that
                # enabled faulthandler itself keeps its own choice.
                faulthandler.enable(file=stack_file, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            return 0
        return signum

    def start_death_watch(self) -> None:
        if self.death_watch_started:
            return
        fds: list[int] = []
        fd = _death_pipe_fd(os.environ.get(ENV_DEATH_FD, ""))
        if fd is not None:
            fds.append(fd)
        sup = os.environ.get(ENV_SUPERVISOR_PID)
        if sup and sup.isdigit() and hasattr(os, "pidfd_open"):
            try:
                fds.append(os.pidfd_open(int(sup)))
            except ProcessLookupError:
                # The supervisor is already gone: nothing to watch, leave now.
                _supervisor_gone()
            except OSError:
                pass  # no pidfds here (old kernel, seccomp, another pid namespace): the death pipe still works
        if not fds:
            return
        self.death_watch_started = True
        t = threading.Thread(target=_watch_death, args=(fds,), name="supervise-death-watch", daemon=True)
        t.start()


def _allow_supervisor_to_trace() -> None:
    """The supervisor and its children (py-spy) may ptrace this rank under Yama scope 1 (``ptrace``).

    In spawn mode the supervisor already set it between fork and exec; a rank
    that a launcher started (tree mode) or a wrapper forked sets it here.
    """
    sup = os.environ.get(ENV_SUPERVISOR_PID, "")
    if sup.isdigit():
        from .ptrace import allow_tracer  # ctypes: imported by the rank that claims a slot only

        allow_tracer(int(sup))


def pid_alive(pid: int) -> bool:
    """A process ``pid`` exists (one we may not signal counts: it is somebody's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _held_by_a_live_ancestor() -> bool:
    """The slot was claimed by a process that is still alive and is not this one: our parent rank."""
    owner = os.environ.get(ENV_SLOT_OWNER, "")
    if not owner.isdigit() or int(owner) == os.getpid():
        return False
    return pid_alive(int(owner))


def _death_pipe_fd(value: str) -> int | None:
    """The inherited death-pipe fd, only if it really is that pipe.

    ``SUPERVISE_DEATH_FD`` is ``<fd>:<inode>``.  A grandchild started by a
    launcher (multiprocessing spawn, torchrun) inherits the variable but not
    the fd; the same number may then name an unrelated pipe, whose EOF must
    not be taken for the supervisor's death.
    """
    import stat

    fd_text, _, ino_text = value.partition(":")
    if not fd_text.isdigit() or not ino_text.isdigit():
        return None
    try:
        st = os.fstat(int(fd_text))
    except OSError:
        return None
    if not stat.S_ISFIFO(st.st_mode) or st.st_ino != int(ino_text):
        return None
    return int(fd_text)


def _supervisor_gone() -> None:
    try:
        # Best effort: this process's stderr is often a pipe the dead supervisor read (BrokenPipeError).
        print("supervise: supervisor is gone, rank exiting", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    os._exit(EXIT_SUPERVISOR_GONE)


def _watch_death(fds: list[int]) -> None:
    """Exit the rank when the supervisor dies (pipe EOF or its pidfd fires)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        try:
            events = poller.poll()
        except InterruptedError:
            continue
        for _fd, _ev in events:
            # The supervisor never writes the death pipe: readable means EOF.
            # A pidfd becomes readable when the supervisor exits.
            _supervisor_gone()


_rt = _Runtime()
# The process-wide state, for the zero-code hook's hot path (``state.writer``:
# the slot writer, None until claimed and in a forked child).
state = _rt


def _after_fork_in_child() -> None:
    """A forked child must not write its parent's slot (one writer per slot);
    it claims its own if it joins a group (zero-code hook) or calls the API.

    The forking thread is the child's only thread: dropping its lane here
    keeps the invariant the hot paths rely on (a thread's lane belongs to
    the current writer) without checking it on every call.
    """
    _rt.writer = None
    _rt.control = {}
    _rt.pid = os.getpid()
    _rt.death_watch_started = False
    _rt.forked = True  # SUPERVISE_SLOT names the parent's slot, not ours
    thread_state.lane = thread_state.asked = thread_state.guard = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _ensure_spawn_slot() -> SlotWriter | None:
    """Spawn mode: the slot is known from the environment; claim on first use."""
    w = _rt.writer
    if w is not None and _rt.pid == os.getpid():
        return w
    slot_text = os.environ.get(ENV_SLOT)
    if not slot_text or _rt.forked:
        return None
    rank = int(os.environ.get("RANK", slot_text))
    _rt.claim(int(slot_text), rank, instrumented=True)
    return _rt.writer


def enabled() -> bool:
    """True when this process runs under ``supervise serve``."""
    return bool(os.environ.get(ENV_HEARTBEAT))


def claim(rank: int, instrumented: bool = False) -> bool:
    """Claim the slot of global ``rank`` (the zero-code hook calls this at group join)."""
    base = int(os.environ.get(ENV_SLOT_BASE, "0") or 0)
    slot_text = os.environ.get(ENV_SLOT)
    slot = int(slot_text) if slot_text and not _rt.forked else rank - base
    if slot < 0:
        return False
    return _rt.claim(slot, rank, instrumented)


def starting() -> None:
    """Declare that this rank will call ``ready()``: the startup watchdog waits for it.

    Call it first thing (before importing torch or loading weights).
    """
    w = _ensure_spawn_slot()
    if w is not None:
        w.change_flags(time.monotonic(), add=hb.INSTRUMENTED)


def ready() -> None:
    """The rank finished loading and can serve."""
    w = _ensure_spawn_slot()
    if w is not None:
        w.change_flags(time.monotonic(), add=hb.READY)


RENDEZVOUS_PHASE = hb.RENDEZVOUS_PHASE


def enter_rendezvous(rank: int = -1) -> None:
    """The rank is joining the process group (the startup watchdog waits for it).

    ``rank``: its global rank when the caller knows it before the join (tree mode then claims the slot now,
    so a rank that dies inside the rendezvous, say on a taken port, is a rank the supervisor names, not a
    process it never heard of).
    """
    if rank >= 0:
        claim(rank)
    w = _rt.writer if _rt.pid == os.getpid() else None
    if w is not None:
        w.set_phase(RENDEZVOUS_PHASE, time.monotonic())


def joining() -> bool:
    """This process holds a slot and is inside ``init_process_group``: its slot's phase says so (what the
    supervisor reads too), set by ``enter_rendezvous`` and cleared by ``joined_group``."""
    w = _rt.writer
    return w is not None and _rt.pid == os.getpid() and w.phase == RENDEZVOUS_PHASE


def joined_group(rank: int) -> None:
    """The rank joined the default process group (called by the zero-code hook).

    Claims the slot of ``rank`` (tree mode finds ranks this way).  A rank that
    does not report readiness itself counts as ready once it joined.
    """
    if not claim(rank):
        return
    w = _rt.writer
    if w is None:  # claim() succeeded: it holds a writer
        return
    now = time.monotonic()
    w.set_phase("", now)
    if not w.flags & hb.INSTRUMENTED:
        w.change_flags(now, add=hb.READY)


def finished() -> None:
    """The rank is about to exit cleanly (the supervisor treats its exit as planned)."""
    w = _rt.writer
    if w is not None and _rt.pid == os.getpid():
        w.change_flags(time.monotonic(), add=hb.FINISHED, clear=hb.IN_STEP | hb.IN_COLLECTIVE)


def begin_step() -> None:
    w = _ensure_spawn_slot()
    if w is not None:
        w.step_begin(_monotonic())


def end_step() -> None:
    w = _rt.writer
    if w is not None:
        w.step_end(_monotonic())


class _Step:
    """``with step():`` -- a class, not @contextmanager: this runs every step."""

    __slots__ = ()

    def __enter__(self) -> None:
        begin_step()

    def __exit__(self, *_exc) -> None:
        end_step()


_STEP = _Step()


def step() -> _Step:
    """One engine step: progress is counted when it completes."""
    return _STEP


class _ThreadState(threading.local):
    """Per thread: its lane into the slot, and the depth of its collectives without one."""

    def __init__(self) -> None:
        self.lane: Lane | None = None
        self.asked: SlotWriter | None = None  # the writer ``lane`` was asked of (a fork or re-claim changes it)
        self.guard: _LaneGuard | None = None
        self.depth = 0  # nesting of collectives entered through the holder count


class _LaneGuard:
    """Lives in the thread's locals: when the thread ends, its lane goes back to the writer."""

    __slots__ = ("lane",)

    def __init__(self, lane: Lane) -> None:
        self.lane = lane

    def __del__(self) -> None:
        try:
            self.lane.writer.release_lane(self.lane)
        except Exception:  # interpreter shutdown: nothing left to tell
            pass


thread_state = _ThreadState()


def lane() -> Lane | None:
    """This thread's lane into the slot (opened at first use); None without a slot or when all are taken."""
    t = thread_state
    w = _rt.writer
    if t.asked is w:
        return t.lane
    t.asked = w
    t.lane = ln = w.lane() if w is not None else None
    t.guard = _LaneGuard(ln) if ln is not None else None
    return ln


def begin_collective(op: str, desc: str = "") -> None:
    """This thread enters a collective (pair it with ``end_collective`` on the same thread).

    Any number of threads may be inside collectives at once; a collective
    entered inside another on the same thread is part of it.
    """
    w = _rt.writer if _rt.writer is not None else _ensure_spawn_slot()
    if w is None:
        return
    ln = lane()
    if ln is not None:
        if ln.depth:
            ln.depth += 1
        else:
            ln.enter(op, desc, _monotonic())
        return
    t = thread_state
    t.depth += 1
    if t.depth == 1:
        w.collective_begin(op, desc, _monotonic())


def end_collective() -> None:
    w = _rt.writer
    if w is None:
        return
    t = thread_state
    ln = t.lane if t.asked is w else None
    if ln is not None:
        if ln.depth > 1:
            ln.depth -= 1
        elif ln.depth == 1:
            ln.leave()
        return
    if t.depth > 0:
        t.depth -= 1
        if t.depth == 0:
            w.collective_end(_monotonic())


class _Collective:
    """``begin_collective``/``end_collective`` around a block; the common case (this
    thread's lane open, not nested) goes straight to the lane, two calls fewer."""

    __slots__ = ("op", "desc")

    def __init__(self, op: str, desc: str):
        self.op = op
        self.desc = desc

    def __enter__(self) -> None:
        t = thread_state
        ln = t.lane
        if ln is not None and not ln.depth and t.asked is _rt.writer:
            ln.enter(self.op, self.desc, _monotonic())
        else:
            begin_collective(self.op, self.desc)

    def __exit__(self, *_exc) -> None:
        t = thread_state
        ln = t.lane
        if ln is not None and ln.depth == 1 and t.asked is _rt.writer:
            ln.leave()
        else:
            end_collective()


def collective(op: str, desc: str = "") -> _Collective:
    """A collective in progress: the supervisor sees the op and its shapes."""
    return _Collective(op, desc)


def phase(name: str) -> None:
    """Label where the rank is (``schedule``, ``prefill``, ``decode`` …)."""
    w = _ensure_spawn_slot()
    if w is not None:
        w.set_phase(name, time.monotonic())


def slot_writer() -> SlotWriter | None:
    """The slot writer of this process, if it claimed one (consensus uses it)."""
    return _rt.writer if _rt.pid == os.getpid() else None
