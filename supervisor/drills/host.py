"""What ``supervise drill`` changes around a process or a run, and puts back: cgroup limits, a full /dev/shm, a
full dump disk, a supervisor without ptrace.  Root only (the drill says so before it starts).

Every change is an object with ``undo()``; the drill undoes each in a ``finally``, whatever the trial did.
"""

from __future__ import annotations

import os
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


class Cgroup:
    """A cgroup of its own for one process (``controller``: cpu or memory), removed by ``undo``."""

    def __init__(self, controller: str, pid: int, name: str):
        self.controller = controller
        self.pid = pid
        self.root = _controller_dir(controller)
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

    def enter(self) -> None:
        self.write("cgroup.procs", str(self.pid))

    def undo(self) -> None:
        try:
            for line in (self.path / "cgroup.procs").read_text().split():
                try:
                    (self.root / "cgroup.procs").write_text(line)
                except OSError:
                    pass
        except OSError:
            pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
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


def cpu_quota(pid: int, share: float, name: str) -> tuple[Cgroup, str]:
    """The process held to ``share`` of the CPU it used under load: (the cgroup, what was set)."""
    used = max(cpu_used(pid), 0.05)
    quota_us = max(1000, int(share * used * CPU_PERIOD_US))
    group = Cgroup("cpu", pid, name)
    try:
        if _v2():
            group.write("cpu.max", f"{quota_us} {CPU_PERIOD_US}")
        else:
            group.write("cpu.cfs_period_us", str(CPU_PERIOD_US))
            group.write("cpu.cfs_quota_us", str(quota_us))
        group.enter()
    except DrillEnvError:
        group.undo()
        raise
    return group, f"{quota_us / CPU_PERIOD_US:.2f} CPU ({share:.0%} of the {used:.2f} it used)"


def memory_limit(pid: int, name: str) -> tuple[Cgroup, str]:
    """The process in a memory cgroup with little room above what it holds now, no swap: (the cgroup, what)."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    limit = rss + MEMORY_HEADROOM
    group = Cgroup("memory", pid, name)
    try:
        if _v2():
            group.write("memory.max", str(limit))
            try:
                group.write("memory.swap.max", "0")
            except DrillEnvError:
                pass
        else:
            group.write("memory.limit_in_bytes", str(limit))
            if (group.path / "memory.memsw.limit_in_bytes").exists():
                group.write("memory.memsw.limit_in_bytes", str(limit))
        group.enter()
    except DrillEnvError:
        group.undo()
        raise
    return group, f"memory limit {limit >> 20} MiB ({rss >> 20} MiB held, no swap)"


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
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
            _run(["mount", "-o", f"remount,size={used + (4 << 20)}", str(path)])
        else:
            path.mkdir(parents=True, exist_ok=True)
            _run(["mount", "-t", "tmpfs", "-o", "size=1m", "tps-drill", str(path)])
        try:
            self._fill()
        except BaseException:
            self.undo()
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

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def undo(self) -> None:
        try:
            self.fill.unlink()
        except OSError:
            pass
        try:
            if self.remount:
                _run(["mount", "-o", f"remount,size={self.size}", str(self.path)])
            else:
                _run(["umount", "-l", str(self.path)])
        except (DrillEnvError, subprocess.TimeoutExpired):
            pass


def without_ptrace() -> list[str]:
    """The prefix that starts a program without CAP_SYS_PTRACE for it and everything it starts."""
    return ["setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace", "--"]


def host_problems() -> list[str]:
    """Why the drill's cgroup and environment kinds cannot run here ([] when they can)."""
    out = []
    if os.geteuid() != 0:
        out.append("not root: cgroup limits, a full /dev/shm or dump disk and dropping ptrace need root")
    return out
