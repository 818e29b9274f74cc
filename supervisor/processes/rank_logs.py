"""The ranks' ``--log-dir`` files: private, never through a link, never outside DIR, capped and rotated.

A file is ``DIR/<run_id>/attempt_<n>/<global rank>/<stream>.log`` (``launcher`` for the tree-mode
launcher; docs/supervisor.md, "Rank output"), written by the output pump's thread
(``output_pump.py``) only.

* **Inside DIR.**  Every name below DIR is checked before use (the run id as ``--run-id`` allows it,
  ``attempt_<n>``, a rank number or ``launcher``, ``stdout``/``stderr``): none is ``..`` or holds a
  ``/``.  Each directory is entered by name from its parent's descriptor with ``O_NOFOLLOW``, and the
  file is opened the same way, so a symlink planted anywhere below DIR is refused (``LogRefused``),
  never followed, and nothing is written outside DIR.  DIR itself is the operator's and is followed.
* **Not a planted file.**  The file is opened ``O_NOFOLLOW`` and ``O_NONBLOCK`` (a FIFO planted there
  cannot block the pump), and refused unless it is a regular file; an existing one must have a single
  link (a hard link to another file is not appended to).
* **Private.**  What is created gets its mode whatever the umask: files 0640, directories 0750
  (``fchmod`` after creation).  A file or directory that exists already (a supervisor started again
  with the same run id) keeps its mode and is appended to.
* **Capped.**  With ``--log-max-bytes N`` (0: no cap) no file grows past N bytes.  When a write would
  pass N, the whole lines of it that still fit are written, then the file is rotated and the rest goes
  to the new one: ``stdout.log.2`` becomes ``.3`` (the old ``.3`` is dropped), ``.1`` becomes ``.2``,
  ``stdout.log`` becomes ``.1``, and a new ``stdout.log`` is created.  So ``stdout.log`` is the newest,
  then ``.1``, ``.2``, ``.3`` (``ROTATED_KEEP``).  A file is cut after a newline whenever the bytes
  allow it: a line is split between two files only when it is longer than N, or when the rank wrote
  it in pieces (a prompt) and the cap fell between them.  Bytes are written as the rank wrote them,
  one ``write`` per chunk read (two across a rotation).
* **No wait on a slow disk.**  A rotation on the pump thread is renames and one create in the same
  directory, the cost of a write; closing the old file (a flush on a network file system) and freeing
  the dropped one's blocks (its last descriptor is held until then) happen on the ``rank-log-closer``
  thread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from tp_supervise.dumps.bundle import DIR_MODE, FILE_MODE, make_dirs

ROTATED_KEEP = 3  # stdout.log.1 (newest) .. stdout.log.3 (oldest)
RUN_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]{0,47}")  # what --run-id accepts (supervisor/spec.py), no ".."
OWNER = re.compile(r"launcher|0|[1-9][0-9]{0,8}")
STREAM_NAMES = ("stdout", "stderr")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_REFUSED = (errno.ELOOP, errno.ENOTDIR, errno.ENXIO)  # a symlink; not a directory; a FIFO nobody reads


class LogRefused(Exception):
    """A log path that is not used: a symlink or another planted file below DIR, or a name that could leave DIR."""


@dataclass(frozen=True)
class LogPath:
    """Where one stream of one process is logged; ``owner`` is the global rank or ``launcher``."""

    root: Path
    run_id: str
    attempt: int
    owner: str
    stream: str

    @property
    def dirs(self) -> tuple[str, ...]:
        return (self.run_id, f"attempt_{self.attempt}", self.owner)

    @property
    def name(self) -> str:
        return f"{self.stream}.log"

    def __str__(self) -> str:
        return str(self.root.joinpath(*self.dirs, self.name))

    def check(self) -> None:
        """Raise ``LogRefused`` unless every name below DIR is one this layout makes."""
        if not RUN_ID.fullmatch(self.run_id) or ".." in self.run_id:
            raise LogRefused(f"run id {self.run_id!r} is not a plain name")
        if not (isinstance(self.attempt, int) and self.attempt >= 0):
            raise LogRefused(f"attempt {self.attempt!r} is not a number")
        if not OWNER.fullmatch(self.owner) or self.stream not in STREAM_NAMES:
            raise LogRefused(f"{self.owner!r}/{self.stream!r} is not a rank's stream")


def _enter(parent: int, name: str) -> int:
    """The directory ``name`` in ``parent`` (created 0750 if missing), never through a symlink.

    Consumes ``parent`` (closed whatever happens)."""
    try:
        if name in ("", ".", "..") or "/" in name:  # LogPath.check() keeps them out; never up or across
            raise LogRefused(f"{name!r} is not a plain name")
        try:
            os.mkdir(name, DIR_MODE, dir_fd=parent)
            created = True
        except FileExistsError:
            created = False
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in _REFUSED:
                raise LogRefused(f"{name} is a symlink or not a directory") from None
            raise
    finally:
        os.close(parent)
    if created:
        try:
            os.fchmod(fd, DIR_MODE)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _walk(path: LogPath) -> int:
    """A descriptor of the file's directory, every level below DIR entered without following a link."""
    path.check()
    make_dirs(path.root)
    fd = os.open(path.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for name in path.dirs:
        fd = _enter(fd, name)
    return fd


def _open_file(directory: int, name: str) -> int:
    """``name`` in ``directory`` for appending: created 0640, or an existing regular file with one link."""
    try:
        fd = os.open(name, _FILE_FLAGS | os.O_CREAT | os.O_EXCL, FILE_MODE, dir_fd=directory)
        created = True
    except FileExistsError:
        created = False
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=directory)
        except OSError as exc:
            if exc.errno in _REFUSED:
                raise LogRefused(f"{name} is a symlink or not a regular file") from None
            raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LogRefused(f"{name} is not a regular file")
        if not created and st.st_nlink != 1:
            raise LogRefused(f"{name} has {st.st_nlink} hard links")
        if created:
            os.fchmod(fd, FILE_MODE)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Closer:
    """Closes rotated files off the pump thread: a close may flush (NFS), a last close frees blocks."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def close(self, *fds: int) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rank-log-closer", daemon=True)
            self._thread.start()
        for fd in fds:
            self._jobs.put(fd)

    def stop(self, join_s: float) -> bool:
        """Close what is queued and end the thread; waits at most ``join_s``.  False if it is still busy."""
        if self._thread is None:
            return True
        self._jobs.put(None)
        self._thread.join(max(0.0, join_s))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (fd := self._jobs.get()) is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class LogFile:
    """One stream's open log file; used by the pump thread only.  ``write`` raises ``OSError`` or ``LogRefused``."""

    def __init__(self, path: LogPath, max_bytes: int, closer: Closer):
        self.path = path
        self.max_bytes = max_bytes
        self._closer = closer
        directory = _walk(path)
        try:
            self._fd = _open_file(directory, path.name)
        finally:
            os.close(directory)
        self.size = os.fstat(self._fd).st_size

    def write(self, data: bytes) -> None:
        """Append ``data`` as one write (one more per rotation it causes)."""
        view, start, end = memoryview(data), 0, len(data)
        while start < end:
            room = max(0, self.max_bytes - self.size) if self.max_bytes else end - start
            if end - start <= room:
                self._append(view[start:end])
                return
            cut = data.rfind(b"\n", start, start + room) + 1  # after the last whole line that fits
            if cut == 0 and self.size == 0:
                cut = start + room  # one line longer than the cap
            if cut > start:
                self._append(view[start:cut])
                start = cut
            self._rotate()

    def _append(self, view: memoryview) -> None:
        while len(view):
            written = os.write(self._fd, view)
            self.size += written
            view = view[written:]

    def _rotate(self) -> None:
        name = self.path.name
        directory = _walk(self.path)
        try:
            dropped = None
            with contextlib.suppress(OSError):  # held so that removing it does not free its blocks here
                dropped = os.open(
                    f"{name}.{ROTATED_KEEP}",
                    os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                    dir_fd=directory,
                )
            try:
                # No rename replaces a file: ext4 flushes the renamed file's data when it does (auto_da_alloc).
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{name}.{ROTATED_KEEP}", dir_fd=directory)
                for i in range(ROTATED_KEEP, 0, -1):
                    older = f"{name}.{i - 1}" if i > 1 else name
                    with contextlib.suppress(FileNotFoundError):
                        os.replace(older, f"{name}.{i}", src_dir_fd=directory, dst_dir_fd=directory)
            finally:
                old, self._fd = self._fd, -1
                self._closer.close(old, *(() if dropped is None else (dropped,)))
            self._fd = _open_file(directory, name)
            self.size = os.fstat(self._fd).st_size
        finally:
            os.close(directory)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
