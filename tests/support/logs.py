"""Shared by the benchmarks and the tests: the supervisor's JSON log lines (``--log-format json``) out of a captured stream."""

from __future__ import annotations

import json
from pathlib import Path


def json_lines(text: str) -> list[dict]:
    """Every line of ``text`` that is a JSON object (a rank's or an engine's own lines are not), in order."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def json_lines_of(path: Path) -> list[dict]:
    """``json_lines`` of a log file; none while it cannot be read."""
    try:
        return json_lines(path.read_text(errors="replace"))
    except OSError:
        return []
