"""A cgroup per run, where the host allows it: find every descendant whatever it did.

A rank's escapee can call setsid, double-fork and scrub its environment
(``env -i``): then neither its process group, nor the parent chain, nor the
``SUPERVISE_RUN_ID`` marker finds it.  Its cgroup still does: every child
of a process is born in its parent's cgroup, and only root can move it out.

Mechanisms, best first (the log says which one a run uses):

* cgroup v2 (``cgroup2`` mount, e.g. ``/sys/fs/cgroup`` or the hybrid
  ``/sys/fs/cgroup/unified``): ``tp-supervise-<run id>`` below the
  supervisor's own cgroup; teardown reads ``cgroup.procs`` and writes
  ``cgroup.kill`` (Linux 5.14+); ``cgroup.freeze`` freezes the whole run;
* cgroup v1 ``pids`` hierarchy: the same directory there; ``cgroup.procs``
  lists the run's processes, which are then killed one by one;
* none writable (an unprivileged container, a systemd slice that was not
  delegated): the run-marker scan of /proc remains the only net.

Each rank joins the run's cgroup in its pre-exec hook (after fork, before
exec), so everything it starts is inside from its first instruction.  The
next ``supervise serve`` on the host removes the cgroup of a run whose
supervisor was SIGKILLed (``supervisor.processes.stale_runs.sweep``).  Every call
here is a small write or read of a kernel file: none of them blocks on a rank.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("supervise.cgroup")

PREFIX = "tp-supervise-"
RMDIR_WAIT_S = 2.0
_POLL_S = 0.02


def _mounts() -> list[tuple[str, Path, str]]:
    """(fstype, mount point, super options) of the cgroup mounts, from /proc/self/mountinfo."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
                    out.append((rest[0], Path(fields[4]), rest[2]))
    except OSError:
        pass
    return out


def _own_path(version: str, controller: str = "") -> str | None:
    """This process's cgroup path in the v2 hierarchy, or in the v1 hierarchy of ``controller``."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                if version == "cgroup2" and names == "":
                    return path
                if version == "cgroup" and controller in names.split(","):
                    return path
    except (OSError, ValueError):
        pass
    return None


@dataclass
class RunCgroup:
    """One run's cgroup directory; ``kind`` is "v2" or "v1-pids"."""

    path: Path
    kind: str

    @property
    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs")

    def describe(self) -> str:
        return f"cgroup {self.kind} {self.path}"

    # -- create / find ----------------------------------------------------------
    @classmethod
    def bases(cls) -> list[tuple[Path, str]]:
        """Where run cgroups of this supervisor go: below its own cgroup, per usable hierarchy."""
        found = []
        for fstype, mount, options in _mounts():
            if fstype == "cgroup2":
                own = _own_path("cgroup2")
                kind = "v2"
            elif "pids" in options.split(","):
                own = _own_path("cgroup", "pids")
                kind = "v1-pids"
            else:
                continue
            if own is None:
                continue
            found.append((mount / own.lstrip("/"), kind))
        found.sort(key=lambda item: item[1] != "v2")
        return found

    @classmethod
    def create(cls, run_id: str) -> tuple[RunCgroup | None, str]:
        """The run's cgroup, or None and why not (the caller logs the mechanism in use)."""
        reasons = []
        for base, kind in cls.bases():
            path = base / f"{PREFIX}{run_id}"
            try:
                os.mkdir(path, 0o755)
                os.stat(path / "cgroup.procs")
            except OSError as exc:
                reasons.append(f"{kind} at {base}: {exc.strerror or exc}")
                continue
            return cls(path, kind), ""
        return None, "; ".join(reasons) or "no cgroup hierarchy mounted"

    @classmethod
    def existing(cls, run_id: str) -> list[RunCgroup]:
        """The cgroups a (possibly dead) run with this id left, in every usable hierarchy."""
        out = []
        for base, kind in cls.bases():
            path = base / f"{PREFIX}{run_id}"
            if path.is_dir() and not path.is_symlink():
                out.append(cls(path, kind))
        return out

    # -- use ----------------------------------------------------------------------
    def pids(self) -> set[int]:
        try:
            with open(self.procs_file) as f:
                return {int(line) for line in f if line.strip()}
        except (OSError, ValueError):
            return set()

    def holds(self, pid: int) -> bool:
        """``pid`` is in the run's cgroup (or below it) now, from /proc/<pid>/cgroup."""
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                lines = f.read().splitlines()
        except OSError:
            return False
        for line in lines:
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            hier, controllers, path = parts
            ours = (hier == "0" and controllers == "") if self.kind == "v2" else "pids" in controllers.split(",")
            if ours and self.path.name in path.strip("/").split("/"):
                return True
        return False

    def kill(self) -> None:
        """SIGKILL every process in the run's cgroup (cgroup.kill on v2, else one by one)."""
        if self.kind == "v2":
            try:
                with open(self.path / "cgroup.kill", "w") as f:
                    f.write("1")
                return
            except OSError:
                pass  # kernel before 5.14
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def freeze(self, frozen: bool = True) -> bool:
        """Freeze (or thaw) the whole run at once (v2 only); False when not possible."""
        if self.kind != "v2":
            return False
        try:
            with open(self.path / "cgroup.freeze", "w") as f:
                f.write("1" if frozen else "0")
            return True
        except OSError:
            return False

    def remove(self, wait_s: float = RMDIR_WAIT_S) -> bool:
        """rmdir once the cgroup is empty (killed processes leave it as they exit)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                os.rmdir(self.path)
                return True
            except FileNotFoundError:
                return True
            except OSError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(_POLL_S)


def join_in_child(procs_file: str) -> None:
    """Pre-exec (after fork, in the child): move this process into the run's cgroup.  Never raises."""
    try:
        fd = os.open(procs_file, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    except OSError:
        pass
