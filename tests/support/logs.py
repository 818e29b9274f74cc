"""Shared by the benchmarks and the tests: the supervisor's JSON log lines (``--log-format json``) out of a captured
stream or a log file, read as the drill reads them (supervisor/drills/builtin.py)."""

from __future__ import annotations

from tp_supervise.supervisor.drills.builtin import json_lines
from tp_supervise.supervisor.drills.builtin import log_records as json_lines_of

__all__ = ["json_lines", "json_lines_of"]
