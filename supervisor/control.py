"""Local control socket (``supervise dump``) and the registry of running jobs.

Each supervisor writes ``<registry>/<run_id>.json`` (pid, socket path,
metrics address, dump dir) and listens on a Unix socket with owner-only
permissions inside an owner-only directory.  The wire format is one JSON
object per line, versioned::

    → {"v": 1, "cmd": "dump"}
    ← {"v": 1, "ok": true, "bundle": "/path/to/bundle"}

Requests are handed to the supervisor's main loop; the listener thread never
does the work itself and every socket operation has a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import structlog

log = structlog.get_logger("supervise.control")

WIRE_VERSION = 1
CLIENT_IO_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 4096
LISTEN_BACKLOG = 8
ACCEPT_POLL_S = 0.5
THREAD_JOIN_S = 2.0


def registry_dir() -> Path:
    base = os.environ.get("SUPERVISE_REGISTRY_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "tp-supervise"
    return Path(tempfile.gettempdir()) / f"tp-supervise-{os.getuid()}"


@dataclass(frozen=True)
class JobEntry:
    run_id: str
    pid: int
    socket: str
    metrics: str | None
    dump_dir: str

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def sweep_stale() -> list[str]:
    """Clean up after supervisors that died without a teardown (SIGKILL, OOM).

    Their ranks died with them (parent-death signal), but a stopped rank of a
    launcher's tree or a setsid escapee can remain, and so do the run's shared
    memory directory and registry entry.  Returns the run ids swept.
    """
    from . import procs

    swept = []
    root = registry_dir()
    if not root.is_dir():
        return swept
    for path in sorted(root.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            run_id, pid = data["run_id"], int(data["pid"])
        except (OSError, ValueError, KeyError):
            continue
        entry = JobEntry(run_id, pid, data.get("socket", ""), data.get("metrics"), data.get("dump_dir", ""))
        if entry.alive():
            continue
        orphans = procs.run_processes(run_id, root_pid=os.getpid())
        orphans -= set(procs.descendants())
        for orphan in orphans:
            try:
                os.kill(orphan, 9)
            except (ProcessLookupError, PermissionError):
                pass
        run_dir = data.get("run_dir")
        if run_dir and os.path.basename(run_dir).startswith("tp-supervise-"):
            shutil.rmtree(run_dir, ignore_errors=True)
        for stale in (path, Path(entry.socket) if entry.socket else None):
            if stale is not None:
                try:
                    stale.unlink()
                except FileNotFoundError:
                    pass
        log.warning("swept a run whose supervisor died", stale_run_id=run_id, pid=pid, killed=sorted(orphans))
        swept.append(run_id)
    return swept


def list_jobs() -> list[JobEntry]:
    jobs = []
    root = registry_dir()
    if not root.is_dir():
        return jobs
    for path in sorted(root.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            entry = JobEntry(data["run_id"], int(data["pid"]), data["socket"], data.get("metrics"), data["dump_dir"])
        except (OSError, ValueError, KeyError):
            continue
        if entry.alive():
            jobs.append(entry)
    return jobs


class ControlServer:
    """Unix-socket listener; ``handler(request) -> reply`` runs on the caller's side."""

    def __init__(self, run_id: str, handler: Callable[[dict], dict], info: dict):
        self.run_id = run_id
        self.dir = registry_dir()
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        self.socket_path = self.dir / f"{run_id}.sock"
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
        self._thread = threading.Thread(target=self._serve, name="control-socket", daemon=True)
        entry = dict(info, run_id=run_id, pid=os.getpid(), socket=str(self.socket_path))
        tmp = self.entry_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry))
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.entry_path)

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
            except (socket.timeout, TimeoutError):
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
