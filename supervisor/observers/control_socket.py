"""Local control socket (``supervise dump``) and the registry of running jobs.

Each supervisor writes ``<registry>/<run_id>.json`` (pid and its start
time, socket path, metrics address, dump dir) and listens on a Unix socket
with owner-only permissions inside an owner-only directory.  The registry is
ours alone: created 0700, checked for owner, type and mode before every use
(a directory another user planted is skipped with a warning), entries read
with O_NOFOLLOW and validated, written atomically without following links.  The wire format is one JSON
object per line, versioned::

    → {"v": 1, "cmd": "dump"}
    ← {"v": 1, "ok": true, "bundle": "/path/to/bundle"}

    → {"v": 1, "cmd": "status"}
    ← {"v": 1, "ok": true, "status": {...}}     (observers.status; docs/supervisor.md)

``dump`` is handed to the supervisor's main loop; ``status`` is answered on
the client's own thread from read-only sources (``observers.status``), so it
answers while the main loop is busy.  Every socket operation has a timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import stat
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import structlog

from ..processes.pidfds import named_thread
from ..processes.stale_runs import DeadRun, unlink_own

log = structlog.get_logger("supervise.control")

WIRE_VERSION = 1
CLIENT_IO_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 4096
LISTEN_BACKLOG = 8
ACCEPT_POLL_S = 0.5
THREAD_JOIN_S = 2.0


class RegistryError(RuntimeError):
    """The registry cannot be used safely (and no safe fallback exists)."""


RUN_ID_PATTERN = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{0,63}$")
MAX_ENTRY_BYTES = 64 * 1024
PRIVATE_MODE = 0o700
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
SOCKET_NAME_ROOM = 1 + 16 + len(".sock")  # "/<16 hex digits of the run id's hash>.sock"


def _candidates() -> list[tuple[Path, bool]]:
    """Registry locations, best first, with whether the user chose it explicitly."""
    base = os.environ.get("SUPERVISE_REGISTRY_DIR")
    if base:
        return [(Path(base), True)]
    out = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        out.append((Path(xdg) / "tp-supervise", False))
    out.append((Path(tempfile.gettempdir()) / f"tp-supervise-{os.geteuid()}", False))
    out.append((Path.home() / ".cache" / "tp-supervise" / "registry", False))
    return out


def private_dir_problem(path: Path) -> str | None:
    """Why ``path`` is not a directory that only we control, or None when it is (created 0700 if missing)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_MODE)
        os.mkdir(path, PRIVATE_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create it ({exc.strerror or exc})"
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot inspect it ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by us (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        os.chmod(path, PRIVATE_MODE)  # ours: close it
    if len(os.fsencode(path)) + SOCKET_NAME_ROOM > UNIX_PATH_MAX:
        return f"its path is too long for a unix socket in it ({UNIX_PATH_MAX} bytes at most)"
    return None


_chosen: dict[tuple, Path] = {}


def registry_dir() -> Path:
    """The job registry: a directory only this user controls (refused or skipped otherwise, with a reason).

    Another user can pre-create ``/tmp/tp-supervise-<uid>`` with crafted
    entries; such a directory is never used: the next candidate
    (``~/.cache/tp-supervise/registry``) is, with a warning that says why.
    An explicit ``SUPERVISE_REGISTRY_DIR`` that is not ours is an error.
    """
    candidates = _candidates()
    key = tuple(candidates)
    if key in _chosen:
        return _chosen[key]
    for path, explicit in candidates:
        problem = private_dir_problem(path)
        if problem is None:
            _chosen[key] = path
            return path
        if explicit:
            raise RegistryError(
                f"SUPERVISE_REGISTRY_DIR={path} cannot be used: {problem}; point it at a "
                "directory only this user can write"
            )
        log.warning(
            "job registry skipped: not ours alone",
            path=str(path),
            reason=problem,
            fix=f"remove {path} (another user may have planted it) or set SUPERVISE_REGISTRY_DIR",
        )
    raise RegistryError("no private directory for the job registry: set SUPERVISE_REGISTRY_DIR")


def socket_path(root: Path, run_id: str) -> Path:
    """The job's control socket: named by a hash of the run id, so any run id fits sun_path."""
    return root / f"{hashlib.sha256(run_id.encode()).hexdigest()[:16]}.sock"


def run_dir_candidates(run_id: str) -> list[Path]:
    """Where a run's shared-memory directory can be (supervisor.outcome.run_dir_for makes it)."""
    roots = [Path("/dev/shm"), Path(os.environ.get("TMPDIR", "/tmp"))]
    return [root / f"tp-supervise-{run_id}" for root in roots]


def process_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


@dataclass(frozen=True)
class JobEntry:
    run_id: str
    pid: int
    socket: str
    metrics: str | None
    dump_dir: str
    pid_start: float | None = None

    def alive(self) -> bool:
        """The supervisor that wrote the entry still runs (same pid and start time: not a reused pid)."""
        started = process_start(self.pid)
        if started is None:
            return False
        return self.pid_start is None or abs(started - self.pid_start) < 1.0


def _read_entry(root: Path, path: Path) -> JobEntry | None:
    """A registry entry, read without following links and checked field by field; None if not valid."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > MAX_ENTRY_BYTES:
            return None
        data = json.loads(os.read(fd, MAX_ENTRY_BYTES))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict):
        return None
    run_id, pid, start = data.get("run_id"), data.get("pid"), data.get("pid_start")
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id) or path.name != f"{run_id}.json":
        return None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        return None
    if start is not None and not isinstance(start, (int, float)):
        return None
    metrics, dump_dir = data.get("metrics"), data.get("dump_dir", "")
    return JobEntry(
        run_id,
        pid,
        str(socket_path(root, run_id)),
        metrics if isinstance(metrics, str) else None,
        dump_dir if isinstance(dump_dir, str) else "",
        start,
    )


def _own_dir(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def dead_runs() -> list[DeadRun]:
    """The registry's entries of supervisors that died without a teardown (SIGKILL, OOM), with what each
    provably owns: its entry and socket (our own files), its run directories (our own), all derived from the
    run id, never taken from the entry.  Killing what they left is the teardown's (processes/stale_runs.py)."""
    out = []
    root = registry_dir()
    for path in sorted(root.glob("*.json")):
        entry = _read_entry(root, path)
        if entry is None:
            log.warning("registry entry ignored: not a valid entry of ours", path=str(path))
            continue
        if entry.alive():
            continue
        out.append(
            DeadRun(
                run_id=entry.run_id,
                pid=entry.pid,
                run_dirs=tuple(d for d in run_dir_candidates(entry.run_id) if _own_dir(d)),
                files=(Path(entry.socket), path),
            )
        )
    return out


def list_jobs() -> list[JobEntry]:
    root = registry_dir()
    jobs = [entry for entry in (_read_entry(root, p) for p in sorted(root.glob("*.json"))) if entry is not None]
    return [job for job in jobs if job.alive()]


def write_private_file(path: Path, text: str) -> None:
    """Atomically replace ``path`` with ``text`` (0600), never following a planted link."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        unlink_own(tmp)
        raise


class ControlServer:
    """Unix-socket listener; ``handler(request) -> reply`` runs on the caller's side."""

    def __init__(self, run_id: str, handler: Callable[[dict], dict], info: dict):
        self.run_id = run_id
        self.dir = registry_dir()
        self.socket_path = socket_path(self.dir, run_id)
        self.entry_path = self.dir / f"{run_id}.json"
        self._handler = handler
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self._sock.bind(str(self.socket_path))
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        self._sock.listen(LISTEN_BACKLOG)
        # accept() wakes this often to notice close(); requests never wait on it.
        self._sock.settimeout(ACCEPT_POLL_S)
        self._stop = threading.Event()
        self._thread = named_thread(self._serve, "control-socket")
        entry = dict(
            info, run_id=run_id, pid=os.getpid(), pid_start=process_start(os.getpid()), socket=str(self.socket_path)
        )
        write_private_file(self.entry_path, json.dumps(entry))

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=THREAD_JOIN_S)
        self._sock.close()
        for path in (self.socket_path, self.entry_path):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            threading.Thread(target=self._client, args=(conn,), name="control-client", daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(CLIENT_IO_TIMEOUT_S)
            try:
                raw = _read_line(conn)
                request = json.loads(raw)
                if request.get("v") != WIRE_VERSION:
                    reply = {"ok": False, "error": f"unsupported wire version {request.get('v')!r}"}
                else:
                    reply = self._handler(request)
            except (OSError, ValueError) as exc:
                reply = {"ok": False, "error": f"bad request: {exc}"}
            except Exception as exc:  # the listener never dies of one request
                log.error("control request failed", error=repr(exc))
                reply = {"ok": False, "error": repr(exc)}
            try:
                conn.sendall((json.dumps(dict(reply, v=WIRE_VERSION)) + "\n").encode())
            except OSError:
                pass


def _read_line(conn: socket.socket) -> str:
    buf = b""
    while b"\n" not in buf:
        chunk = conn.recv(1024)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES:
            raise ValueError("request too large")
    return buf.split(b"\n", 1)[0].decode()


def request(socket_path: str, payload: dict, timeout_s: float) -> dict:
    """Client side: one request, one reply, bounded by ``timeout_s``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(socket_path)
        s.sendall((json.dumps(dict(payload, v=WIRE_VERSION)) + "\n").encode())
        return json.loads(_read_line(s))
