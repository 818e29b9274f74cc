"""What holds the supervisor's I/O: a dump directory that blocks every write, a GPU driver that never answers.

``BlockingMount``  a tmpfs watched by a fanotify listener that, once armed,
                   never answers the kernel's permission requests, so every
                   open(2) in it sleeps in the kernel as on a hung NFS mount
                   (needs CAP_SYS_ADMIN: mount and fanotify).
``FifoStall``      the fallback that works on any host: ``arm()`` puts the FIFO
                   that the bundle writer of ``tests/fakes/stall_dumps.py``
                   first opens (and nobody reads) into the dump directory.
``wedged_pynvml``  a stand-in ``pynvml`` whose device calls never return (a
                   wedged GPU driver), for the supervisor's PYTHONPATH.

Arm a blocker once the supervisor registered: its start-up check writes into
the dump directory.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import subprocess
import textwrap
import threading
from pathlib import Path

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
LISTEN_POLL_S = 0.05  # how soon the listener sees close()
JOIN_S = 5.0


class BlockingMount:
    """A tmpfs whose file opens block once ``arm()`` was called, until ``close()``.

    The listener answers FAN_ALLOW to every permission request until armed
    (the supervisor's start-up check writes a file there); armed, it keeps
    the requests unanswered, so the openers sleep in the kernel.  ``close()``
    allows them all and unmounts.  Raises OSError or CalledProcessError where
    the mount or fanotify is not allowed.
    """

    kind = "a tmpfs whose opens wait for a fanotify permission answer that never comes"

    def __init__(self, path: Path):
        self.path = path
        path.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)], check=True, capture_output=True)
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
        self._thread = threading.Thread(target=self._listen, name="fanotify-gate", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        self.armed = True

    def _listen(self) -> None:
        while not self._stop.is_set():
            if not select.select([self.fd], [], [], LISTEN_POLL_S)[0]:
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
        self._thread.join(JOIN_S)
        for fd in self.held:
            self._allow(fd)
        os.close(self.fd)  # any request still pending is allowed
        self._unmount()

    def _unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


class FifoStall:
    """The fallback: ``arm()`` puts the FIFO the stall wrapper's bundle writer opens into the dump dir."""

    kind = "a FIFO nobody reads, opened by the bundle writer first (`tests/fakes/stall_dumps.py`)"

    def __init__(self, path: Path):
        self.path = path
        path.mkdir(parents=True)

    def arm(self) -> None:
        os.mkfifo(self.path / "stall.fifo")

    def close(self) -> None:
        fifo = self.path / "stall.fifo"
        if fifo.exists():
            fifo.unlink()


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


def wedged_pynvml(where: Path, pythonpath: str = "") -> str:
    """Write the stand-in ``pynvml`` into ``where`` (created); the PYTHONPATH that finds it first, then ``pythonpath``."""
    where.mkdir(parents=True)
    (where / "pynvml.py").write_text(WEDGED_PYNVML)
    return os.pathsep.join(p for p in (str(where), pythonpath) if p)
