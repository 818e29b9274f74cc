"""Shared by the benchmarks: rewrite one section of docs/benchmarks.md."""

from __future__ import annotations

import re
from pathlib import Path


def replace_section(path: Path, heading: str, section: str) -> None:
    """Replace (or append) the section that starts with ``heading``; leave the rest alone."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")
