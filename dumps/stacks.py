"""Stack data model, parsers and the normalised stack signature.

Two capture paths produce stacks in different text forms:

* ``py-spy dump --json``: a list of threads, frames most recent first, with
  qualified names (``Thread.run``) and, with ``--native``, C frames whose
  ``module`` is a shared object;
* ``faulthandler`` (the rank writes it on a signal): ``Thread 0x… (most
  recent call first):`` blocks of ``File "…", line N in func`` lines.

Both become ``ThreadStack`` values here, so grouping never depends on the
path that captured a rank.  The *signature* keeps only what is stable
across ranks that are at the same place: Python function names (without
class qualifier, which faulthandler does not print) and file base names.
Line numbers, addresses, thread ids and native frames are dropped, so a
rank spinning through a loop body or captured by a different path still
groups with its peers.  Everything here is pure.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Threads of our own rank-side runtime: identical on every rank, never evidence.
INFRA_FUNCTIONS = frozenset({"_watch_death"})
# Outermost frames of a thread started by the ``threading`` module.
THREAD_BOOTSTRAP = frozenset({"_bootstrap", "_bootstrap_inner"})
SIGNATURE_SEPARATOR = " < "
SIGNATURE_THREAD_SEPARATOR = " | "
# How many innermost frames a short (display) signature keeps.
SHORT_SIGNATURE_FRAMES = 3

_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[([^\]]*)\])? \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<func>.*)$')
_HEX_NAME = re.compile(r"^0x[0-9a-fA-F]+$")


@dataclass(frozen=True)
class Frame:
    """One frame; ``native`` frames come only from ``py-spy --native``."""

    function: str
    filename: str
    line: int
    native: bool = False

    @property
    def base_function(self) -> str:
        """Function name without class qualifier (faulthandler prints none)."""
        return self.function.rsplit(".", 1)[-1]

    @property
    def base_file(self) -> str:
        return os.path.basename(self.filename)


@dataclass(frozen=True)
class ThreadStack:
    """One thread; ``frames`` are most recent call first."""

    thread_id: str
    name: str
    frames: tuple[Frame, ...]
    is_main: bool | None = None  # None: the capture path could not tell
    current: bool = False  # faulthandler: the thread that ran the handler

    @property
    def python_frames(self) -> tuple[Frame, ...]:
        return tuple(f for f in self.frames if not f.native)

    @property
    def is_infra(self) -> bool:
        return any(f.function in INFRA_FUNCTIONS for f in self.python_frames)

    @property
    def started_by_threading(self) -> bool:
        frames = self.python_frames
        return bool(frames) and frames[-1].base_function in THREAD_BOOTSTRAP


# -- parsers -------------------------------------------------------------------


def parse_pyspy_json(text: str, pid: int | None = None) -> list[ThreadStack]:
    """Threads of ``py-spy dump --json`` output (raises ValueError when malformed)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"py-spy output is not JSON: {exc}") from exc
    if not isinstance(data, list):
        raise ValueError("py-spy JSON output is not a list of threads")
    threads = []
    for entry in data:
        frames = []
        for f in entry.get("frames") or []:
            module = f.get("module")
            native = bool(module) and not str(f.get("filename", "")).endswith(".py")
            frames.append(
                Frame(
                    function=str(f.get("name", "?")),
                    filename=str(f.get("filename") or f.get("short_filename") or "?"),
                    line=int(f.get("line") or 0),
                    native=native,
                )
            )
        os_tid = entry.get("os_thread_id")
        name = entry.get("thread_name") or ""
        is_main = (os_tid == pid) if (pid is not None and os_tid is not None) else None
        tid = os_tid if os_tid is not None else entry.get("thread_id", "?")
        threads.append(ThreadStack(thread_id=str(tid), name=str(name), frames=tuple(frames), is_main=is_main))
    return threads


def parse_faulthandler(text: str) -> list[ThreadStack]:
    """Threads of one faulthandler ``dump_traceback(all_threads=True)`` output.

    faulthandler cannot say which thread is the main one; threads started by
    ``threading`` end in its bootstrap frames, so the one thread that does not
    is taken as main when there is exactly one such thread.
    """
    threads: list[ThreadStack] = []
    current: tuple[str, str, bool] | None = None
    frames: list[Frame] = []

    def flush() -> None:
        if current is not None:
            tid, name, is_current = current
            threads.append(ThreadStack(tid, name, tuple(frames), None, is_current))

    for raw in text.splitlines():
        head = _FH_THREAD.match(raw)
        if head:
            flush()
            current = (head.group(2), head.group(3) or "", head.group(1) == "Current thread")
            frames = []
            continue
        frame = _FH_FRAME.match(raw)
        if frame and current is not None:
            line = frame.group("line")
            frames.append(Frame(frame.group("func"), frame.group("file"), int(line) if line.isdigit() else 0))
    flush()
    candidates = [i for i, t in enumerate(threads) if not t.started_by_threading]
    if len(candidates) == 1:
        i = candidates[0]
        t = threads[i]
        threads[i] = ThreadStack(t.thread_id, t.name or "MainThread", t.frames, True, t.current)
    return threads


# -- signatures -----------------------------------------------------------------


def main_thread(threads: Sequence[ThreadStack]) -> ThreadStack | None:
    """The main thread when the capture path (or the bootstrap rule) identified it."""
    for t in threads:
        if t.is_main:
            return t
    return None


def thread_signature(thread: ThreadStack) -> str:
    """``func (file) < caller (file) < …``: no line numbers, no addresses, no ids."""
    parts = []
    for f in thread.python_frames:
        if _HEX_NAME.match(f.function):
            continue
        parts.append(f"{f.base_function} ({f.base_file})")
    return SIGNATURE_SEPARATOR.join(parts)


def stack_signature(threads: Sequence[ThreadStack]) -> str:
    """Normalised signature of a rank: its main thread, else all its threads.

    The main thread is where a rank's step loop (and so its collectives)
    runs; helper threads differ between ranks (rank 0 often serves HTTP) and
    would split identical ranks into groups.  Without a known main thread,
    the sorted signatures of all non-infrastructure threads are used.
    """
    if not threads:
        return ""
    main = main_thread(threads)
    if main is not None:
        return thread_signature(main)
    sigs = sorted({thread_signature(t) for t in threads if not t.is_infra} - {""})
    return SIGNATURE_THREAD_SEPARATOR.join(sigs)


def short_signature(signature: str, frames: int = SHORT_SIGNATURE_FRAMES) -> str:
    """The innermost ``frames`` frames of each thread of a signature, for tables."""
    out = []
    for thread_sig in signature.split(SIGNATURE_THREAD_SEPARATOR):
        parts = thread_sig.split(SIGNATURE_SEPARATOR)
        head = SIGNATURE_SEPARATOR.join(parts[:frames])
        out.append(head + (" < …" if len(parts) > frames else ""))
    return SIGNATURE_THREAD_SEPARATOR.join(out)


# Frames that only pass a call on (dispatch, decorators, wrappers): never "where" a rank is.  By file, every
# function in it (``*``), or the named ones: torch's op dispatch (``torch.ops.vllm.all_reduce`` runs through
# ``_ops.py __call__``), its decorators and ``nn.Module`` call plumbing, the standard library's decorator and
# context-manager helpers, and our own wrappers (the hook's and the engine adapters').
DISPATCH_FRAMES: dict[str, frozenset[str]] = {
    "_ops.py": frozenset({"__call__", "_call_overload", "_op_call"}),
    "_contextlib.py": frozenset({"*"}),
    "contextlib.py": frozenset({"*"}),
    "functools.py": frozenset({"*"}),
    "module.py": frozenset({"_call_impl", "_wrapped_call_impl"}),
    "eval_frame.py": frozenset({"*"}),
    "autohook.py": frozenset({"wrapper", "_call_counted"}),
}
# Our wrappers elsewhere in the rank package (the engine adapters' in ``engines/__init__.py``): by path.
_RANK_PACKAGE_PART = os.sep.join(("", "supervisor", "rank", ""))
_OUR_WRAPPERS = frozenset({"wrapper", "wait", "drilled"})


def is_dispatch(frame: Frame) -> bool:
    """A frame that only passes the call on (``DISPATCH_FRAMES``, and our wrappers in the rank package)."""
    names = DISPATCH_FRAMES.get(frame.base_file)
    if names is not None and ("*" in names or frame.base_function in names):
        return True
    return frame.base_function in _OUR_WRAPPERS and _RANK_PACKAGE_PART in frame.filename


# Code torch.compile made: Inductor's generated modules (its cache, ``torchinductor_<user>``; vLLM's own,
# ``torch_compile_cache``) and Dynamo's compiled frames and resume functions.
_COMPILED_PATHS = ("torchinductor", "torch_compile_cache")
_COMPILED_FUNCTIONS = ("__compiled_fn", "torch_dynamo_resume_in", "__resume_at")


def compiled_code(frame: Frame) -> bool:
    """The frame runs code torch.compile generated (a compiled model's forward), not the engine's source."""
    return any(p in frame.filename for p in _COMPILED_PATHS) or frame.base_function.startswith(_COMPILED_FUNCTIONS)


def where_text(frame: Frame | None) -> str:
    """Where a process is, in words: "load_batch (data.py)", or "the compiled model (call in c3x.py)" when it is
    inside code torch.compile generated (its file is a hash, not the engine's)."""
    if frame is None:
        return ""
    if compiled_code(frame):
        return f"the compiled model (torch.compile: {frame.base_function} in {frame.base_file})"
    return f"{frame.base_function} ({frame.base_file})"


_TORCH_PART = os.sep.join(("", "torch", ""))


def compiled_from(threads: Sequence[ThreadStack], compiled: Frame) -> Frame | None:
    """The model's own function a compiled frame runs the graph of: the first frame outward of ``compiled``
    that is neither generated code nor torch's machinery around it (vLLM's ``LlamaModel.forward``)."""
    main = main_thread(threads)
    if main is None:
        return None
    frames = main.python_frames
    try:
        at = frames.index(compiled)
    except ValueError:
        return None
    for f in frames[at + 1 :]:
        if not compiled_code(f) and _TORCH_PART not in f.filename and not is_dispatch(f):
            return f
    return None


def where(threads: Sequence[ThreadStack], skip: Iterable[str] = ()) -> str:
    """Where a process is, in words (``where_text`` of ``innermost_function``); inside a compiled model, also
    whose graph it runs: "the compiled model (torch.compile: call in c3x.py) of LlamaModel.forward (llama.py)"."""
    frame = innermost_function(threads, skip)
    text = where_text(frame)
    if frame is not None and compiled_code(frame):
        origin = compiled_from(threads, frame)
        if origin is not None:
            text += f" of {origin.function} ({origin.base_file})"
    return text


def innermost_function(threads: Sequence[ThreadStack], skip: Iterable[str] = ()) -> Frame | None:
    """The innermost Python frame of the main thread, skipping library names in ``skip``.

    Used to name *where* a culprit is ("stuck in load_batch (data.py)"):
    frames of the standard library's sleeping/waiting helpers are skipped, and
    so are dispatch and wrapper frames (``is_dispatch``): the engine's own
    function is named, not torch's ``__call__ (_ops.py)``.
    """
    skip_set = frozenset(skip)
    main = main_thread(threads)
    candidates = [main] if main is not None else [t for t in threads if not t.is_infra]
    for t in candidates:
        for f in t.python_frames:
            if f.base_function not in skip_set and not _HEX_NAME.match(f.function) and not is_dispatch(f):
                return f
    return None


def render_threads(threads: Sequence[ThreadStack]) -> str:
    """Readable text of threads, main thread first (what ``stacks/rank-<r>.txt`` holds)."""
    blocks = []
    for t in sorted(threads, key=lambda t: not t.is_main):
        label = "main thread" if t.is_main else "thread"
        name = f" {t.name!r}" if t.name else ""
        lines = [f"{label} {t.thread_id}{name} (most recent call first):"]
        for f in t.frames:
            if f.native:
                lines.append(f"    [native] {f.function} ({f.base_file})")
            else:
                lines.append(f"    {f.function} ({f.filename}:{f.line})")
        if not t.frames:
            lines.append("    <no Python frame>")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + ("\n" if blocks else "")
