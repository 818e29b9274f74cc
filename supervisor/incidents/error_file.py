"""A rank's own account of its death: torch's ``@record`` error file, else the last traceback on its stderr."""

from __future__ import annotations

import json
import os
from pathlib import Path

ERROR_FILE_MAX_BYTES = 256 * 1024


ERROR_TRACEBACK_CHARS = 16 * 1024


TRACEBACK_HEAD = "Traceback (most recent call last):"


TRACEBACK_MAX_LINES = 400


EXCEPTION_NOTE_LINES = 20


def read_error_file(path: Path) -> tuple[bytes, str, str] | None:
    """The structured error torch's ``@record`` wrote to ``TORCHELASTIC_ERROR_FILE``: (raw, exception line,
    traceback), or None.  A small file in the run's tmpfs directory, read non-blocking and capped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        raw = os.read(fd, ERROR_FILE_MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
    except ValueError:
        return raw, "", ""
    message = data.get("message") if isinstance(data, dict) else None
    extra: dict[str, object] = {}
    if isinstance(message, dict):  # torch: {"message": {"message": "Err: ...", "extraInfo": {"py_callstack": ...}}}
        info = message.get("extraInfo")
        if isinstance(info, dict):
            extra = info
        message = message.get("message")
    text = str(message or "").strip().splitlines()
    return raw, (text[-1][:500] if text else ""), str(extra.get("py_callstack", ""))[-ERROR_TRACEBACK_CHARS:]


def last_traceback(text: str) -> tuple[str, str] | None:
    """The last Python traceback in a rank's stderr: (exception line, traceback text), or None.

    From the last ``Traceback (most recent call last):`` (so a chained exception yields the final one),
    through its indented frame lines, to the exception line and what follows it up to a blank line
    (a multi-line message, notes).  A ``[rankN]:`` prefix (torchrun's) is ignored."""
    lines = [_strip_rank_prefix(line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.strip() == TRACEBACK_HEAD]
    for start in reversed(starts):
        i = start + 1
        while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
            i += 1
        if i >= len(lines) or i == start + 1:
            continue  # cut off before its exception line, or not a traceback after all
        end = i + 1
        while (
            end < len(lines)
            and end - i < EXCEPTION_NOTE_LINES
            and lines[end].strip()
            and lines[end].strip() != TRACEBACK_HEAD
        ):
            end += 1
        block = lines[start:end][-TRACEBACK_MAX_LINES:]
        return lines[i].strip()[:500], "\n".join(block)[-ERROR_TRACEBACK_CHARS:]
    return None


def _strip_rank_prefix(line: str) -> str:
    if line.startswith("[rank") and "]:" in line[:16]:
        return line.split("]:", 1)[1]
    return line
