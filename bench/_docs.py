"""Shared by the benchmarks: the common flags, the stamp of a run, and rewriting one section of docs/benchmarks.md.

Every benchmark takes ``--quick`` (a few seconds, the same code paths with
fewer rounds, ranks or iterations: what tests/test_bench_quick.py runs) and
``--update-docs [FILE]`` (rewrite its own section(s) of FILE, default
docs/benchmarks.md, from the figures it just measured).  Each section it writes
starts with a stamp: when (UTC), at which commit, the load average, the
machine, and the exact command, so a figure can always be traced to a run.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"


def replace_section(path: Path, heading: str, section: str) -> None:
    """Replace (or append) the section that starts with ``heading``; leave the rest alone."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section.rstrip("\n") + "\n\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")


def add_common_args(parser: argparse.ArgumentParser, quick: str) -> None:
    """``--quick`` (what it reduces: ``quick``), ``--update-docs [FILE]`` and ``--allow-dirty``.

    ``--update-docs`` from a tree whose tracked files differ from the commit is refused when the arguments
    are parsed, before anything runs: a stamp must name the code that was measured."""
    parser.add_argument("--quick", action="store_true", help=f"a smoke run of a few seconds: {quick}")
    parser.add_argument("--update-docs", type=Path, nargs="?", const=DOCS, default=None, metavar="FILE",
                        help=f"rewrite this benchmark's section(s) of FILE (default {DOCS.relative_to(ROOT)})")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="with --update-docs: measure a tree with uncommitted changes (the stamp says so)")
    parse = parser.parse_args

    def parse_checked(*args, **kwargs):
        ns = parse(*args, **kwargs)
        if getattr(ns, "update_docs", None) and not ns.allow_dirty and dirty():
            parser.error("--update-docs: tracked files have uncommitted changes (commit them, or pass --allow-dirty)")
        return ns

    parser.parse_args = parse_checked  # type: ignore[method-assign]


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def dirty() -> bool:
    """Tracked files differ from the commit."""
    return bool(_git("status", "--porcelain", "--untracked-files=no"))


def commit() -> str:
    """The short commit, with a note when tracked files differ from it (the figures are of the working tree)."""
    short = _git("rev-parse", "--short", "HEAD") or "unknown"
    return f"{short} (with uncommitted changes)" if dirty() else short


def _meminfo_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    return (f"{os.cpu_count()} CPUs ({_cpu_model()}), {_meminfo_gib():.1f} GiB memory, "
            f"Linux {platform.release()}, Python {platform.python_version()}")


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The exact command of this run, as typed from the repository root."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join([".venv/bin/python", "-m", module, *map(shlex.quote, args)])


@dataclass
class Stamp:
    """Taken when the benchmark starts; ``text()`` when it writes its figures."""

    command: str
    started: float = field(default_factory=time.time)
    load_start: str = field(default_factory=_load)
    commit: str = field(default_factory=commit)  # the code measured: HEAD when it started

    @classmethod
    def begin(cls, module: str, argv: list[str] | None = None) -> Stamp:
        return cls(command_line(module, argv))

    def text(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.started))
        minutes = (time.time() - self.started) / 60
        return (f"Measured {when} ({minutes:.1f} min) at commit {self.commit}; load average (1/5/15 min) "
                f"{self.load_start} at the start, {_load()} at the end; machine: {machine()}.\n"
                f"Command: `{self.command}`")
