"""Issue 11: nothing the supervisor does before a teardown can block it (real processes).

The dump directory blocks every write, for real: it is a tmpfs mounted for
the test and watched by a fanotify listener that never answers the kernel's
permission request, so every open(2) of a file in it sleeps in the kernel,
as on a hung NFS mount (needs CAP_SYS_ADMIN; skipped without it).  The same
tests also run through tests/fakes/stall_dumps.py, whose bundle writer first
opens a FIFO that nobody reads: that works on any host.  A hang and a rank exit must still be torn down
within --kill-grace + --dump-timeout + a few seconds of the fault being
noticed, exit with the fault's code (81, 80) and leave no process.

A GPU driver whose NVML calls never return (a stand-in ``pynvml`` on the
supervisor's path) must not stop the watchdog or the teardown either.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import MARK_VAR, ROOT, Run, fake_rank
from tests.live import wait_registry

pytestmark = pytest.mark.e2e

GLOO = str(ROOT / "tests" / "fakes" / "gloo_loop.py")
STALL_WRAPPER = ROOT / "tests" / "fakes" / "stall_dumps.py"
KILL_GRACE_S = 2.0
DUMP_TIMEOUT_S = 3.0
SLACK_S = 3.0  # thread wake-ups and the 2 s kill confirmation on a loaded 2-core machine
RUN_TIMEOUT_S = 120.0

# fanotify(7)
FAN_CLOEXEC = 0x01
FAN_CLASS_CONTENT = 0x04
FAN_MARK_ADD = 0x01
FAN_MARK_MOUNT = 0x10
FAN_OPEN_PERM = 0x00010000
FAN_ALLOW = 0x01
AT_FDCWD = -100
_EVENT = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
_RESPONSE = struct.Struct("=iI")  # fd, response


class BlockingMount:
    """A tmpfs whose file opens block once ``arm()`` was called, until ``close()``.

    The listener answers FAN_ALLOW to every permission request until armed
    (the supervisor's start-up check writes a file there); armed, it keeps
    the requests unanswered, so the openers sleep in the kernel.  ``close()``
    allows them all and unmounts.
    """

    def __init__(self, path: Path):
        self.path = path
        path.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)], check=True,
                       capture_output=True)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
        libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
        self.fd = libc.fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC, os.O_RDONLY | os.O_LARGEFILE)
        if self.fd < 0:
            err = ctypes.get_errno()
            self._unmount()
            raise OSError(err, f"fanotify_init: {os.strerror(err)}")
        if libc.fanotify_mark(self.fd, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_OPEN_PERM, AT_FDCWD, os.fsencode(path)) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            self._unmount()
            raise OSError(err, f"fanotify_mark: {os.strerror(err)}")
        self.armed = False
        self.held: list[int] = []  # event fds of the opens kept waiting
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="test-fanotify", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        self.armed = True

    def _listen(self) -> None:
        while not self._stop.is_set():
            if not select.select([self.fd], [], [], 0.05)[0]:
                continue
            try:
                buf = os.read(self.fd, 4096)
            except OSError:
                return
            pos = 0
            while pos + _EVENT.size <= len(buf):
                length, _v, _r, _m, _mask, fd, _pid = _EVENT.unpack_from(buf, pos)
                pos += length
                if self.armed:
                    self.held.append(fd)
                else:
                    self._allow(fd)

    def _allow(self, fd: int) -> None:
        try:
            os.write(self.fd, _RESPONSE.pack(fd, FAN_ALLOW))
        except OSError:
            pass
        os.close(fd)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for fd in self.held:
            self._allow(fd)
        os.close(self.fd)  # any request still pending is allowed
        self._unmount()

    def _unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


class FifoStall:
    """The fallback: arm() puts the FIFO the stall wrapper's writer opens into the dump dir."""

    def __init__(self, path: Path):
        self.path = path

    def arm(self) -> None:
        os.mkfifo(self.path / "stall.fifo")

    def close(self) -> None:
        fifo = self.path / "stall.fifo"
        if fifo.exists():
            fifo.unlink()


@pytest.fixture(params=["mount", "fifo"])
def blocked_dumps(request, tmp_path):
    """(dump dir, blocker, entry point): the really blocking mount (skipped where the test may
    not mount or use fanotify), then the FIFO stall through the wrapper, which works anywhere."""
    dump_dir = tmp_path / "dumps"
    if request.param == "mount":
        try:
            blocker = BlockingMount(dump_dir)
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"cannot mount a blocking filesystem here ({exc}); the fifo variant covers this host")
        entry = None
    else:
        dump_dir.mkdir()
        blocker = FifoStall(dump_dir)
        entry = STALL_WRAPPER
    yield dump_dir, blocker, entry
    blocker.close()


def start(supervise, tmp_path: Path, dump_dir: Path, entry: Path | None, args: list[str], command: list[str],
          env: dict | None = None) -> Run:
    """Like the ``supervise`` fixture, through ``entry`` (a wrapper of the CLI) when given."""
    if entry is None:
        return supervise(args, command, env=env, dump_dir=dump_dir)
    full_env = dict(os.environ, **(env or {}))
    full_env[MARK_VAR] = supervise.mark  # the fixture's leak check finds these processes too
    full_env["SUPERVISE_REGISTRY_DIR"] = str(tmp_path / "registry")
    argv = [sys.executable, str(entry), "serve", "--log-format", "json", "--metrics-addr", "127.0.0.1:0",
            "--metrics-linger", "0", "--dump-dir", str(dump_dir), *args, "--", *command]
    proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Run(proc=proc, dump_dir=dump_dir, mark=supervise.mark, started=time.monotonic())


def ts(line: dict) -> datetime:
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00"))


def seconds_from(run: Run, first: dict) -> float:
    exited = run.events("supervise exiting")
    assert exited, run.stderr[-3000:]
    return (ts(exited[-1]) - ts(first)).total_seconds()


def finish(run: Run) -> int:
    try:
        return run.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate()


def gloo(*args: str) -> list[str]:
    return [sys.executable, GLOO, *args]


DEADLINE_ARGS = ["--kill-grace", str(KILL_GRACE_S), "--dump-timeout", str(DUMP_TIMEOUT_S)]


def test_a_hang_is_torn_down_although_the_dump_directory_blocks(supervise, tmp_path, blocked_dumps):
    dump_dir, blocker, entry = blocked_dumps
    run = start(supervise, tmp_path, dump_dir, entry,
                ["--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", *DEADLINE_ARGS],
                gloo("--iters", "100000", "--fault", "stop", "--fault-at", "30"))
    wait_registry(tmp_path / "registry")  # past the start-up check, which writes into the dump dir
    blocker.arm()
    code = finish(run)
    assert code == 81, run.stderr[-4000:]
    hang = [line for line in run.lines if line.get("event") == "hang"]
    assert hang, run.stderr[-3000:]
    took = seconds_from(run, hang[0])
    assert took < KILL_GRACE_S + DUMP_TIMEOUT_S + SLACK_S, took
    assert run.events("teardown complete"), run.stderr[-3000:]
    # The bundles could not be written; the supervisor said so and exited anyway.
    assert run.events("not written within --dump-timeout"), run.stderr[-3000:]
    assert not run.events("incident bundle written")


def test_a_rank_exit_is_torn_down_although_the_dump_directory_blocks(supervise, tmp_path, blocked_dumps):
    dump_dir, blocker, entry = blocked_dumps
    run = start(supervise, tmp_path, dump_dir, entry, ["--nproc-per-node", "3", *DEADLINE_ARGS],
                fake_rank("--all", "sleep", "--on", "1=sigkill", "--delay", "2"))
    wait_registry(tmp_path / "registry")
    blocker.arm()
    code = finish(run)
    assert code == 80, run.stderr[-4000:]
    death = [line for line in run.lines if line.get("level") == "error" and line.get("rank") == 1]
    assert death, run.stderr[-3000:]
    assert seconds_from(run, death[0]) < KILL_GRACE_S + DUMP_TIMEOUT_S + SLACK_S
    assert run.events("not written within --dump-timeout"), run.stderr[-3000:]


WEDGED_PYNVML = textwrap.dedent(
    '''
    """A stand-in for nvidia-ml-py whose device calls never return, as with a wedged GPU driver."""
    import time

    def nvmlInit():
        pass

    def nvmlShutdown():
        pass

    def nvmlDeviceGetCount():
        return 1

    def nvmlDeviceGetHandleByIndex(index):
        time.sleep(3600)
    '''
)


def test_a_wedged_gpu_driver_stops_neither_the_watchdog_nor_the_teardown(supervise, tmp_path):
    fake = tmp_path / "wedged-nvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(WEDGED_PYNVML)
    path = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH", "")) if p)
    run = supervise(["--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", *DEADLINE_ARGS],
                    gloo("--iters", "100000", "--fault", "stop", "--fault-at", "30"), env={"PYTHONPATH": path})
    code = finish(run)
    assert code == 81, run.stderr[-4000:]
    assert run.events("gpu telemetry enabled"), "the stand-in NVML was not used"
    hang = [line for line in run.lines if line.get("event") == "hang"]
    assert hang and seconds_from(run, hang[0]) < KILL_GRACE_S + DUMP_TIMEOUT_S + SLACK_S
    summary = run.summary("-hang")
    assert summary["culprit_ranks"] == [1], summary["verdict"]
    assert "gpu" not in summary, "no NVML reading ever completed, so there is none to report"
    done = run.events("teardown complete")
    assert done and done[-1]["gpu_memory_verified"] is False  # not waited for: the sampler is stuck
