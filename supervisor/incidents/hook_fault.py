"""A process that died of our own code: its traceback ends in the hook, not in the engine (issue 43).

The hook's wrappers sit on the engine's seams, so they appear in most of the
engine's tracebacks: an exception the engine raised inside a wrapped step
passes through our ``wrapper`` frame on its way out.  That is the engine's
fault.  Ours is a traceback whose *innermost* frame (past the standard
library's) is in the rank package: the exception was raised by our code.
Two shapes reach a process's stderr:

* a Python traceback (``Traceback (most recent call last):`` ... frames ...
  the exception line);
* torch.compile's account of the code it was tracing when it gave up
  (``from user code:`` ... frames), printed inside the message of the
  exception above it: the traced frames, innermost last.

Prefixes engines put on their processes' lines (torchrun's ``[rank1]:``,
vLLM's ``(Worker_TP1 pid=123)``) are read past.  The drill lane's frames are
not counted as ours: a drill injects its fault from there on purpose.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

TRACEBACK_HEAD = "Traceback (most recent call last):"
USER_CODE_HEAD = "from user code:"
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')
_PREFIX = re.compile(r"^(\[rank\d+\]:|\([\w.\-]+ pid=\d+\)) ?")
_NOT_OURS = ("drill_lane.py",)  # a drill's fault is raised from here on purpose
TRACEBACK_CHARS = 16 * 1024


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str

    def words(self) -> str:
        return f"{os.path.basename(self.path)}:{self.line} in {self.function}"


@dataclass(frozen=True)
class HookFault:
    """Our frame where the exception was raised, our outermost frame, and the engine's frame that called it."""

    exception: str
    raised_in: Frame
    wrapper: Frame
    entered_from: Frame | None
    traceback: str

    def words(self) -> str:
        via = "" if self.wrapper == self.raised_in else f", from {self.wrapper.words()}"
        entered = f", entered from {self.entered_from.words()}" if self.entered_from is not None else ""
        return (
            f"the process died of tp-supervise's own hook, not of the engine: {self.exception} raised in "
            f"{self.raised_in.words()}{via}{entered}"
        )

    def to_dict(self) -> dict:
        return {
            "exception": self.exception,
            "raised_in": self.raised_in.words(),
            "wrapper": self.wrapper.words(),
            "entered_from": self.entered_from.words() if self.entered_from is not None else None,
            "seam": self.entered_from.function if self.entered_from is not None else None,
            "traceback": self.traceback,
        }


def _stdlib(path: str) -> bool:
    return "/lib/python3" in path and "-packages/" not in path


def _ours(path: str, rank_dir: str) -> bool:
    return path.startswith(rank_dir) and os.path.basename(path) not in _NOT_OURS


def _blocks(lines: list[str]) -> list[tuple[str, list[Frame], str]]:
    """(exception line, frames outermost first, text) of every traceback and ``from user code`` block."""
    out: list[tuple[str, list[Frame], str]] = []
    exception = ""
    i = 0
    while i < len(lines):
        head = lines[i].strip()
        if head not in (TRACEBACK_HEAD, USER_CODE_HEAD):
            i += 1
            continue
        start, frames = i, []
        i += 1
        while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
            match = _FRAME.match(lines[i])
            if match:
                frames.append(Frame(match["path"], int(match["line"]), match["function"]))
            i += 1
        if head == TRACEBACK_HEAD and i < len(lines):
            exception = lines[i].strip()[:500]
        if frames:
            out.append((exception, frames, "\n".join(lines[start : i + 1])[-TRACEBACK_CHARS:]))
    return out


def find(text: str, rank_dir: Path | str) -> HookFault | None:
    """The last traceback in ``text`` whose innermost frame (past the standard library's) is ours, else None."""
    root = str(rank_dir).rstrip(os.sep) + os.sep
    lines = [_PREFIX.sub("", line) for line in text.splitlines()]
    for exception, frames, block in reversed(_blocks(lines)):
        inner = [f for f in frames if not _stdlib(f.path)]
        if not inner or not _ours(inner[-1].path, root):
            continue
        k = len(inner) - 1
        while k > 0 and _ours(inner[k - 1].path, root):
            k -= 1
        return HookFault(
            exception=exception or "an exception",
            raised_in=inner[-1],
            wrapper=inner[k],
            entered_from=inner[k - 1] if k > 0 else None,
            traceback=block,
        )
    return None
