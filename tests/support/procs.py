"""A look at a process in /proc."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that still runs (neither gone nor a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
