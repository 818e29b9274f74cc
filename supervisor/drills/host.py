"""What ``supervise drill`` changes around a process or a run, and puts back: cgroup limits, a full /dev/shm, a
full dump disk, a supervisor without ptrace.  Root only (the drill says so before it starts).

Every change is an object with ``undo()``; the drill undoes each in a ``finally``, whatever the trial did.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000
MEASURE_S = 3.0
MEMORY_HEADROOM = 256 << 20  # grow_memory reaches the limit in a few seconds
SHM = Path("/dev/shm")
COMMAND_TIMEOUT_S = 10.0


class DrillEnvError(RuntimeError):
    """The host does not let the drill make this change (not root, no cgroup controller, no mount)."""


def _v2() -> bool:
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def _controller_dir(controller: str) -> Path:
    if _v2():
        enabled = (CGROUP_ROOT / "cgroup.subtree_control").read_text().split()
        if controller not in enabled:
            raise DrillEnvError(f"cgroup v2: the {controller} controller is not enabled at {CGROUP_ROOT}")
        return CGROUP_ROOT
    path = CGROUP_ROOT / controller
    if not path.is_dir():
        raise DrillEnvError(f"no cgroup v1 {controller} hierarchy at {path}")
    return path


def _cgroup_of(pid: int, controller: str) -> str:
    """The process's cgroup (relative path) in ``controller``'s hierarchy (v2: the unified one)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hier, controllers, rel = line.split(":", 2)
        if (_v2() and hier == "0") or (not _v2() and controller in controllers.split(",")):
            return rel
    return "/"


class Cgroup:
    """A cgroup of its own for one process (``controller``: cpu or memory); ``undo`` puts the process back where
    it was (its pod's, its slice's cgroup) and removes this one."""

    def __init__(self, controller: str, pid: int, name: str):
        self.controller = controller
        self.pid = pid
        self.root = _controller_dir(controller)
        self.home = self.root / _cgroup_of(pid, controller).lstrip("/")
        self.path = self.root / name
        try:
            self.path.mkdir(exist_ok=True)
        except OSError as exc:
            raise DrillEnvError(f"cannot make {self.path}: {exc}") from None

    def write(self, name: str, value: str) -> None:
        try:
            (self.path / name).write_text(value)
        except OSError as exc:
            raise DrillEnvError(f"cannot write {value!r} to {self.path / name}: {exc}") from None

    def read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def enter(self) -> None:
        self.write("cgroup.procs", str(self.pid))

    def cpu_quota(self, share: float, used: float) -> str:
        """The process held to ``share`` of ``used`` CPUs (what it used under load); what was set."""
        quota_us = max(1000, int(share * max(used, 0.05) * CPU_PERIOD_US))
        if _v2():
            self.write("cpu.max", f"{quota_us} {CPU_PERIOD_US}")
        else:
            self.write("cpu.cfs_period_us", str(CPU_PERIOD_US))
            self.write("cpu.cfs_quota_us", str(quota_us))
        self.enter()
        return f"CPU quota {quota_us / CPU_PERIOD_US:.2f} CPU ({share:.0%} of the {used:.2f} it used)"

    def memory_headroom(self) -> str:
        """The process in this memory cgroup with ``MEMORY_HEADROOM`` above what the cgroup holds once it is in
        (what it held stays charged where it was), no swap; what was set."""
        self.enter()
        usage = self.read("memory.current" if _v2() else "memory.usage_in_bytes")
        limit = usage + MEMORY_HEADROOM
        if _v2():
            self.write("memory.max", str(limit))
            try:
                self.write("memory.swap.max", "0")
            except DrillEnvError:
                pass
        else:
            self.write("memory.limit_in_bytes", str(limit))
            if (self.path / "memory.memsw.limit_in_bytes").exists():
                self.write("memory.memsw.limit_in_bytes", str(limit))
        return f"memory limit {limit >> 20} MiB in {self.path.name}, no swap ({MEMORY_HEADROOM >> 20} MiB to grow)"

    def undo(self) -> None:
        """Its processes back home, then the cgroup removed; raises DrillEnvError when that could not be."""
        back = self.home if (self.home / "cgroup.procs").exists() else self.root
        try:
            pids = (self.path / "cgroup.procs").read_text().split()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise DrillEnvError(f"cannot read {self.path / 'cgroup.procs'}: {exc}") from None
        for pid in pids:
            try:
                (back / "cgroup.procs").write_text(pid)
            except ProcessLookupError:
                pass
            except OSError as exc:
                raise DrillEnvError(f"cannot move pid {pid} back to {back}: {exc}") from None
        deadline = time.monotonic() + 2.0
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise DrillEnvError(f"cannot remove {self.path}: {exc}") from None
                time.sleep(0.05)


def cpu_used(pid: int, over_s: float = MEASURE_S) -> float:
    """CPUs the process used over ``over_s`` (all its threads), from /proc/PID/stat."""
    tick = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    start, t0 = read(), time.monotonic()
    time.sleep(over_s)
    return (read() - start) / (time.monotonic() - t0)


def _run(argv: list[str]) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DrillEnvError(f"{' '.join(argv)}: {exc}") from None
    if done.returncode != 0:
        raise DrillEnvError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


class FullFilesystem:
    """A tmpfs filesystem made full: /dev/shm shrunk to what it holds and filled (``remount``), or a small
    tmpfs mounted at ``path`` and filled (``mount``).  ``undo`` gives /dev/shm its size back, or unmounts."""

    def __init__(self, path: Path, remount: bool):
        self.path = path
        self.remount = remount
        self.fill = path / f".tps-drill-fill-{os.getpid()}"
        if remount:
            st = os.statvfs(path)
            self.size = st.f_blocks * st.f_frsize
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
        else:
            path.mkdir(parents=True, exist_ok=True)
        try:
            if remount:
                _run(["mount", "-o", f"remount,size={used + (4 << 20)}", str(path)])
            else:
                _run(["mount", "-t", "tmpfs", "-o", "size=1m", "tps-drill", str(path)])
            self._fill()
        except BaseException:
            try:  # a mount that timed out may still have been made: put it back whatever happened
                self.undo()
            except DrillEnvError:
                pass
            raise

    def _fill(self) -> None:
        with open(self.fill, "wb") as f:
            chunk = b"\0" * (1 << 16)
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError:
                pass  # ENOSPC: full

    def undo(self) -> None:
        """The filling file removed, the size given back (or the tmpfs unmounted); DrillEnvError when not."""
        try:
            self.fill.unlink()
        except FileNotFoundError:
            pass
        if self.remount:
            _run(["mount", "-o", f"remount,size={self.size}", str(self.path)])
        else:
            _run(["umount", "-l", str(self.path)])


def without_ptrace() -> list[str]:
    """The prefix that starts a program without CAP_SYS_PTRACE for it and everything it starts."""
    return ["setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace", "--"]


def host_problems() -> list[str]:
    """Why the drill's cgroup and environment kinds cannot run here ([] when they can)."""
    out = []
    if os.geteuid() != 0:
        out.append("not root: cgroup limits, a full /dev/shm or dump disk and dropping ptrace need root")
    for tool in ("setpriv", "mount", "umount"):
        if shutil.which(tool) is None:
            out.append(f"no {tool} on PATH (util-linux): the environment kinds need it")
    return out
