"""Stack capture for every rank at once, each bounded by its own timeout.

Methods (``capture_all(method=…)``):

``auto``          py-spy when it can be found, else (or when it fails for a
                  rank) the faulthandler fallback;
``py-spy``        py-spy only;
``faulthandler``  the fallback only: the rank-side runtime registered
                  ``faulthandler`` on the signal recorded in its heartbeat
                  slot, writing to ``supervisor.rank.runtime.stack_file_path``;
                  we send that signal and read the bytes it appends;
``none``          no stacks: /proc and heartbeat evidence only.

A rank that is dead (or dies during the capture) may still have written its
stacks as it died: where the rank side enables ``faulthandler`` for fatal
signals on its stack file, a C++ abort (gloo's ``std::terminate`` on a
collective mismatch), a segfault or a bus error leaves a "Fatal Python
error" dump there, which is read back as that rank's stacks.

py-spy is looked up as ``$SUPERVISE_PYSPY`` when set (a path; a path that
does not exist, or ``off``, makes py-spy unavailable, which is how tests
and containers without ptrace force the fallback), else ``py-spy`` on
``PATH``, else next to the running interpreter (a venv's ``bin/``).

Per rank, in its own named thread: read ``/proc`` first (state before any
ptrace), then try py-spy in blocking mode (it pauses the rank for a few
milliseconds, giving a consistent stack), then ``--nonblocking`` (needed
for a SIGSTOPped rank, which plain py-spy cannot attach to, and as a retry
after a timeout), then the signal fallback.  A stopped rank cannot run its
signal handler, so the fallback says so instead of waiting.  Nothing here
raises for one rank: every failure becomes that rank's ``error`` text.

Frozen ranks (``frozen=``, see ``dumps.freeze``): the ``/proc`` reads taken
before the freeze are the evidence; a rank stopped by the freeze is read
with ``--nonblocking`` only, and resumed for its own faulthandler capture
only when py-spy cannot read it (no py-spy, ptrace denied); a rank the
fault itself stopped is never resumed.  CPU use then comes from the
``previous`` sample alone (a frozen rank uses none).

What comes back (``Evidence`` of ``RankEvidence``) is plain data defined in
``dumps.evidence``, so ``dumps.diagnose`` judges it without importing this
module's subprocess, signal and thread machinery.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from tp_supervise.supervisor.rank.heartbeat import SlotSnapshot
from tp_supervise.supervisor.rank.runtime import stack_file_path

from . import stacks as st
from .evidence import CpuSamples, Evidence, ProcInfo, RankEvidence
from .freeze import Frozen, Held, held_by, resumed
from .procinfo import cpu_delta, read_proc

log = structlog.get_logger()

ENV_PYSPY = "SUPERVISE_PYSPY"
PYSPY_OFF_VALUES = frozenset({"off", "none", "false", "0"})
METHODS = ("auto", "py-spy", "faulthandler", "none")
# Share of a rank's remaining budget the blocking py-spy attempt may use,
# so a hung attach still leaves time for --nonblocking and the fallback.
PYSPY_BLOCKING_SHARE = 0.5
PYSPY_NONBLOCKING_SHARE = 0.5
# faulthandler writes from a C signal handler in a few write() calls; the
# dump is complete once the file stops growing for this long and ends a line.
FAULTHANDLER_QUIET_S = 0.03
FAULTHANDLER_POLL_S = 0.005
# Without a previous sample, CPU use is measured across the capture itself,
# over at least this window (bounded by the deadline).
MIN_CPU_WINDOW_S = 0.1
# Wait for a rank's capture thread this much past its own end time (kill + reap).
JOIN_GRACE_S = 0.05
# faulthandler's header of a dump written by a fatal signal handler (not by our stack signal).
FATAL_DUMP_MARK = "Fatal Python error:"
# Only the end of a stack file is read for a death dump (on-demand dumps come before it).
DEATH_DUMP_TAIL_BYTES = 1 << 20


@dataclass(frozen=True)
class RankTarget:
    """A rank to capture, as the supervisor knows it at decision time."""

    rank: int
    slot: int
    pid: int | None
    alive: bool
    exit: dict | None = None  # {"code", "signal", "core_dumped", "description"}
    heartbeat: SlotSnapshot | None = None
    title: str = ""  # its process title when last seen (docs/bundle.md)
    # A process of the run that is not a rank (``rank`` is then a negative key of the capture): its role,
    # ``frontend``, ``scheduler``, ``helper``, ``launcher`` or ``engine process`` ("" for a rank).
    role: str = ""
    words: str = ""  # what the role is called in its engine ("vLLM's engine core"); "" for a rank

    @property
    def is_rank(self) -> bool:
        return self.rank >= 0

    def evidence(self, **captured: Any) -> RankEvidence:
        """Its evidence: what the supervisor knew of it, plus what the capture found (``captured``)."""
        captured.setdefault("title", self.title)
        captured.setdefault("role", self.role)
        captured.setdefault("words", self.words)
        return RankEvidence(
            rank=self.rank,
            slot=self.slot,
            pid=self.pid,
            alive=self.alive,
            exit=self.exit,
            heartbeat=self.heartbeat,
            **captured,
        )


def find_pyspy(environ: Mapping[str, str] | None = None) -> str | None:
    """Path of the py-spy executable, or None when unavailable (see module doc)."""
    env = os.environ if environ is None else environ
    configured = env.get(ENV_PYSPY, "")
    if configured:
        if configured.lower() in PYSPY_OFF_VALUES:
            return None
        return configured if os.access(configured, os.X_OK) else None
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if os.access(beside, os.X_OK) else None


# -- py-spy ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Attempt:
    threads: list[st.ThreadStack] | None
    note: str


def _pyspy(pyspy: str, pid: int, *, native: bool, nonblocking: bool, timeout_s: float) -> _Attempt:
    label = "py-spy --nonblocking" if nonblocking else "py-spy"
    if timeout_s <= 0:
        return _Attempt(None, f"{label}: no time left")
    cmd = [pyspy, "dump", "--pid", str(pid), "--json"]
    if nonblocking:
        cmd.append("--nonblocking")  # py-spy refuses --native with --nonblocking
    elif native:
        cmd.append("--native")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return _Attempt(None, f"{label}: timeout after {timeout_s:.2f} s")
    except OSError as exc:
        return _Attempt(None, f"{label}: cannot run ({exc.strerror or exc})")
    if proc.returncode != 0:
        first = next((ln for ln in proc.stderr.splitlines() if ln.strip()), f"exit {proc.returncode}")
        return _Attempt(None, f"{label}: {first.strip()}")
    try:
        threads = st.parse_pyspy_json(proc.stdout, pid=pid)
    except ValueError as exc:
        return _Attempt(None, f"{label}: {exc}")
    return _Attempt(threads, label)


# -- faulthandler fallback ------------------------------------------------------

_file_locks: dict[str, threading.Lock] = {}
_file_locks_guard = threading.Lock()


def _lock_for(path: str) -> threading.Lock:
    with _file_locks_guard:
        return _file_locks.setdefault(path, threading.Lock())


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _faulthandler(run_dir: Path, slot: int, proc: Held | None, signum: int, end: float) -> _Attempt:
    """Make the rank write its stacks (the signal through its pidfd) and read what it appended."""
    if proc is None:
        return _Attempt(None, "faulthandler: process gone")
    path = stack_file_path(run_dir, slot, proc.pid)
    with _lock_for(path):
        before = _size(path)
        if before is None:
            return _Attempt(None, f"faulthandler: no stack file {path}")
        if not proc.send(signum):
            return _Attempt(None, "faulthandler: process gone (or not ours to signal)")
        sent = last_change = time.monotonic()
        last = before
        while True:
            now = time.monotonic()
            size = _size(path) or 0
            if size != last:
                last, last_change = size, now
            elif size > before and now - last_change >= FAULTHANDLER_QUIET_S and _ends_line(path, size):
                break
            if now >= end:
                if size > before:
                    break  # keep what was written; the parse says what it got
                return _Attempt(None, f"faulthandler: timeout after {now - sent:.2f} s with no output")
            time.sleep(FAULTHANDLER_POLL_S)
        with open(path, "rb") as f:
            f.seek(before)
            text = f.read(last - before).decode("utf-8", "replace")
    threads = st.parse_faulthandler(text)
    if not threads:
        return _Attempt(None, "faulthandler: output had no thread")
    return _Attempt(threads, "faulthandler")


def _ends_line(path: str, size: int) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(size - 1)
            return f.read(1) == b"\n"
    except OSError:
        return False


def _death_stacks(run_dir: Path, target: RankTarget) -> _Attempt:
    """The stacks a dead rank wrote itself as it died, if it did (see the module doc)."""
    if target.pid is None:
        return _Attempt(None, "stacks at death: no pid")
    path = stack_file_path(run_dir, target.slot, target.pid)
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - DEATH_DUMP_TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return _Attempt(None, "stacks at death: no stack file")
    at = text.rfind(FATAL_DUMP_MARK)
    if at < 0:
        return _Attempt(None, "stacks at death: none written")
    dump = text[at:]
    what = dump.splitlines()[0][len(FATAL_DUMP_MARK) :].strip()
    threads = st.parse_faulthandler(dump)
    if not threads:
        return _Attempt(None, "stacks at death: the dump had no thread")
    return _Attempt(threads, f"faulthandler at death ({what})" if what else "faulthandler at death")


def _gone(pid: int | None) -> bool:
    proc = read_proc(pid) if pid else None
    return proc is None or proc.state in ("Z", "X")


# -- one rank -------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    run_dir: Path
    method: str
    pyspy: str | None
    native: bool
    frozen: Frozen | None = None


def _stack_signal(target: RankTarget) -> int:
    """The rank's faulthandler signal, only when the slot is this very process."""
    hb = target.heartbeat
    if hb is None or not hb.stack_signal or hb.pid != target.pid:
        return 0
    return hb.stack_signal


# (threads, method, error, attempts) of one rank's capture.
_Captured = tuple[list[st.ThreadStack], str, str | None, tuple[str, ...]]


def _capture_dead(target: RankTarget, plan: _Plan, dead: str) -> _Captured:
    """A rank that is not running: only the stacks it wrote as it died, if any."""
    if plan.method == "none":
        return [], "none", dead, ()
    got = _death_stacks(plan.run_dir, target)
    if got.threads is not None:
        return got.threads, got.note, None, (got.note,)
    return [], "none", dead, ()


def _capture_stacks(
    target: RankTarget, proc: ProcInfo | None, plan: _Plan, start: float, end: float, held: Held | None = None
) -> _Captured:
    """(threads, method, error, attempts) for one rank (``held``: its pidfd, for the signal); never raises."""
    pid = target.pid
    if not target.alive or pid is None:
        return _capture_dead(target, plan, "rank is not running")
    if proc is None:
        return _capture_dead(target, plan, "process gone")
    if proc.state in ("Z", "X"):
        return _capture_dead(target, plan, f"process is a zombie (state {proc.state}): no stacks")
    if plan.method == "none":
        return [], "none", "stack capture off (method none)", ()
    frozen_here = plan.frozen is not None and target.rank in plan.frozen.stopped
    stopped_by_fault = proc.state in ("T", "t")
    stopped = stopped_by_fault or frozen_here
    notes: list[str] = []
    if plan.method in ("auto", "py-spy"):
        if plan.pyspy is None:
            notes.append(f"py-spy unavailable (not found, or ${ENV_PYSPY} points nowhere)")
        else:
            if not stopped:
                share = (end - time.monotonic()) * PYSPY_BLOCKING_SHARE
                got = _pyspy(plan.pyspy, pid, native=plan.native, nonblocking=False, timeout_s=share)
                notes.append(got.note)
                if got.threads is not None:
                    return got.threads, got.note, None, tuple(notes)
            share = (end - time.monotonic()) * (PYSPY_NONBLOCKING_SHARE if plan.method == "auto" else 1.0)
            got = _pyspy(plan.pyspy, pid, native=False, nonblocking=True, timeout_s=share)
            notes.append(got.note)
            if got.threads is not None:
                return got.threads, got.note, None, tuple(notes)
    if plan.method in ("auto", "faulthandler"):
        signum = _stack_signal(target)
        if stopped_by_fault:
            notes.append(f"faulthandler: rank is stopped (state {proc.state}) and cannot run its signal handler")
        elif not signum:
            notes.append("faulthandler: the rank registered no stack signal")
        else:
            # A rank the freeze stopped runs again only for its own capture.
            with resumed(plan.frozen, target.rank) if frozen_here else nullcontext():
                got = _faulthandler(plan.run_dir, target.slot, held, signum, end)
            if frozen_here:
                got = _Attempt(got.threads, f"{got.note} (resumed for the capture)")
            notes.append(got.note)
            if got.threads is not None:
                return got.threads, got.note, None, tuple(notes)
    if _gone(pid):  # it died during the capture: it may have written its stacks as it did
        got = _death_stacks(plan.run_dir, target)
        notes.append(got.note)
        if got.threads is not None:
            return got.threads, got.note, None, tuple(notes)
    waited = time.monotonic() - start
    timed_out = any("timeout" in n for n in notes)
    reason = f"no stacks (timeout after {waited:.2f} s)" if timed_out else "no stacks"
    return [], "none", f"{reason}: " + "; ".join(notes), tuple(notes)


# -- all ranks ------------------------------------------------------------------


def capture_all(
    targets: Sequence[RankTarget],
    *,
    run_dir: Path,
    method: str = "auto",
    native: bool = False,
    per_rank_timeout_s: float,
    deadline_s: float,
    previous: CpuSamples | None = None,
    frozen: Frozen | None = None,
) -> Evidence:
    """Capture every rank in parallel; return within ``deadline_s`` seconds from now.

    ``deadline_s`` is a duration (the whole call's budget), ``per_rank_timeout_s``
    bounds each rank's attempts.  ``previous`` is the sample a former call
    returned in ``Evidence.samples``; without it CPU use is measured across
    this capture (at least ``MIN_CPU_WINDOW_S``), except for ``frozen``
    ranks, whose ``/proc`` reads are the ones taken before the freeze.
    """
    if method not in METHODS:
        raise ValueError(f"unknown capture method {method!r} (one of {', '.join(METHODS)})")
    start = time.monotonic()
    deadline = start + max(0.0, deadline_s)
    pyspy = find_pyspy() if method in ("auto", "py-spy") else None
    plan = _Plan(Path(run_dir), method, pyspy, native, frozen)
    first: dict[int, ProcInfo | None] = {}
    if frozen is not None:
        first = {t.rank: frozen.before.get(t.rank) for t in targets}
        first_at = frozen.read_at
    else:
        for t in targets:
            first[t.rank] = read_proc(t.pid) if (t.alive and t.pid) else None
        first_at = time.monotonic()

    results: dict[int, tuple[list[st.ThreadStack], str, str | None, tuple[str, ...], float]] = {}
    lock = threading.Lock()
    rank_end = min(deadline, start + max(0.0, per_rank_timeout_s))

    def work(target: RankTarget) -> None:
        t0 = time.monotonic()
        # Signals go through a pidfd: the one the freeze holds, or one held for this capture only.
        held = held_by(frozen, target.rank)
        mine = Held.open(target.pid) if held is None and target.alive else None
        try:
            out = _capture_stacks(target, first[target.rank], plan, t0, rank_end, held or mine)
        except Exception as exc:  # one bad rank never spoils the dump
            log.warning("dump capture failed", rank=target.rank, error=repr(exc))
            out = [], "none", f"capture failed: {exc!r}", ()
        finally:
            if mine is not None:
                mine.close()
        with lock:
            results[target.rank] = (*out, time.monotonic() - t0)

    workers = [threading.Thread(target=work, args=(t,), name=f"dump-rank-{t.rank}", daemon=True) for t in targets]
    for w in workers:
        w.start()
    for w in workers:
        w.join(max(0.0, rank_end + JOIN_GRACE_S - time.monotonic()))
    with lock:
        done = dict(results)

    samples_at, second = first_at, first
    if previous is None and frozen is None:
        wait = min(first_at + MIN_CPU_WINDOW_S, deadline) - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        second = {t.rank: read_proc(t.pid) if (t.alive and t.pid) else None for t in targets}
        samples_at = time.monotonic()

    ranks: dict[int, RankEvidence] = {}
    cpu: dict[int, float] = {}
    for t in targets:
        proc, later = first[t.rank], second[t.rank]
        used = window = None
        if proc is not None:
            if previous is not None:
                used, window = cpu_delta(proc.pid, proc.cpu_s, first_at, previous)
            elif later is not None:
                used, window = max(0.0, later.cpu_s - proc.cpu_s), samples_at - first_at
            cpu[proc.pid] = (later or proc).cpu_s
        if t.rank in done:
            threads, how, error, attempts, took = done[t.rank]
        else:
            took = time.monotonic() - start
            threads, how, error, attempts = [], "none", f"no stacks (timeout after {took:.2f} s)", ()
        prev_progress = previous.progress.get(t.rank) if previous is not None else None
        ranks[t.rank] = t.evidence(
            proc=proc,
            cpu_used_s=used,
            cpu_window_s=window,
            prev_progress=prev_progress,
            threads=tuple(threads),
            stack_text=st.render_threads(threads),
            method=how,
            error=error,
            attempts=tuple(attempts),
            capture_s=took,
            title=proc.title if proc is not None and proc.title else t.title,
        )
    progress = {t.rank: (t.heartbeat.step, t.heartbeat.coll_seq) for t in targets if t.heartbeat is not None}
    samples = CpuSamples(at=samples_at, cpu_s=cpu, progress=progress)
    duration = time.monotonic() - start
    log.info("dump captured", ranks=len(targets), method=method, duration_s=round(duration, 3))
    return Evidence(
        ranks=ranks, started_at=start, duration_s=duration, method=method, pyspy=plan.pyspy, samples=samples
    )
