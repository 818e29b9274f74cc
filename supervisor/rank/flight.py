"""Flight-recorder server start-up, inside a rank (stdlib; torch imported only when called).

torch's ``_WorkerServer`` answers ``fr_trace_json`` (and tracebacks) on a unix
socket from a C++ thread, also while the rank's main thread is blocked inside
a collective; torch itself starts it only from its elastic agent's
``worker_main()``.  ``serve_in_rank()`` starts it once the rank joined its
process group (the zero-code hook and the built-in engine call it).  The
socket path is computed the same way on both sides by ``socket_path``;
``rank_env`` is what the supervisor adds to each rank's environment,
including where torch writes its own flight-recorder dump when a NCCL
collective times out (``TORCH_FR_DUMP_TEMP_FILE``, see ``dump_prefix``).  The
supervisor-side collection is ``tp_supervise.dumps.flight_capture``.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

from . import runtime
from .runtime import ENV_RUN_DIR

ENV_FR_BUFFER = "TORCH_FR_BUFFER_SIZE"
ENV_WORKER_SOCKET = "TORCH_WORKER_SERVER_SOCKET"
# Where torch writes its own trace (``<prefix><global rank>``, the pickle torchfrtrace reads) when
# ProcessGroupNCCL's watchdog times out.  TORCH_NCCL_DEBUG_INFO_TEMP_FILE is the older name, which
# torch still reads after the new one (and warns about); a user who set either keeps it.
ENV_FR_DUMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
ENV_FR_DUMP_FILE_LEGACY = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
FR_DUMP_DIR = "fr-dump"
FR_DUMP_PREFIX = "rank-"
# Entries kept per process (a ring buffer): ~12 decode steps of an 80-layer model.
DEFAULT_FR_BUFFER = 2000
# sun_path holds 108 bytes including the terminating NUL.
UNIX_PATH_MAX = 107
HANDLER_FR = "fr_trace_json"


# -- paths and environment ------------------------------------------------------


def socket_path(run_dir: str | os.PathLike, slot: int) -> str:
    """Unix socket of a rank's worker server; both sides compute it the same way.

    ``<run_dir>/fr/slot-<slot>.sock``, or, when that exceeds the 107-byte
    limit of a unix socket path, a name in the temp dir derived from a hash
    of the run dir.
    """
    run = os.path.abspath(os.fspath(run_dir))
    path = os.path.join(run, "fr", f"slot-{slot}.sock")
    if len(path.encode()) <= UNIX_PATH_MAX:
        return path
    digest = hashlib.sha1(run.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"tpsv-fr-{digest}-{slot}.sock")


def dump_dir(run_dir: str | os.PathLike) -> str:
    """The directory torch's own dump-on-timeout files go to (``dump_prefix`` + rank)."""
    return os.path.join(os.path.abspath(os.fspath(run_dir)), FR_DUMP_DIR)


def dump_prefix(run_dir: str | os.PathLike) -> str:
    """``TORCH_FR_DUMP_TEMP_FILE`` for the ranks: torch appends the global rank."""
    return os.path.join(dump_dir(run_dir), FR_DUMP_PREFIX)


def rank_env(run_dir: Path, slot: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables the supervisor adds for one rank; keys already in ``environ`` are left out.

    The user's values win: a ``TORCH_FR_BUFFER_SIZE=0`` in the user's
    environment turns the recorder off, a user-chosen worker socket is kept
    (``collect`` then cannot find it, which it reports), and so is a dump
    location set under either of torch's names (the files then stay where
    the user put them).  Creates the dump directory (torch does not).
    """
    env = os.environ if environ is None else environ
    ours = {
        ENV_FR_BUFFER: str(DEFAULT_FR_BUFFER),
        ENV_WORKER_SOCKET: socket_path(run_dir, slot),
    }
    if ENV_FR_DUMP_FILE not in env and ENV_FR_DUMP_FILE_LEGACY not in env:
        try:
            os.makedirs(dump_dir(run_dir), mode=0o700, exist_ok=True)
            ours[ENV_FR_DUMP_FILE] = dump_prefix(run_dir)
        except OSError:
            pass  # torch then writes to its default place
    return {k: v for k, v in ours.items() if k not in env}


_server = None
_server_lock = threading.Lock()


def _listening(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def serve_in_rank(slot: int | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Start torch's worker server for this rank (idempotent, never raises).

    Call it once the rank joined its process group.  The path is
    ``socket_path($SUPERVISE_RUN_DIR, slot)`` for ``slot`` (default: the
    heartbeat slot this process claimed through ``runtime``), so
    the supervisor finds it in spawn and tree mode alike; without a slot or
    run dir, ``$TORCH_WORKER_SERVER_SOCKET``.  A stale socket file of a dead
    process is replaced; a live server there (the program runs torch's
    ``worker_main`` itself) is left serving.
    """
    global _server
    env = os.environ if environ is None else environ
    run_dir = env.get(ENV_RUN_DIR)
    if slot is None:
        writer = runtime.slot_writer()
        slot = writer.slot if writer is not None else None
    path = socket_path(run_dir, slot) if (slot is not None and run_dir) else env.get(ENV_WORKER_SOCKET)
    if not path:
        return False
    with _server_lock:
        if _server is not None:
            return True
        try:
            if os.path.exists(path):
                if _listening(path):
                    return True
                os.unlink(path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            from torch._C._distributed_c10d import _WorkerServer

            _server = _WorkerServer(path)
        except Exception as exc:  # never break the rank
            print(f"supervise: flight-recorder server not started at {path}: {exc!r}", file=sys.stderr)
            return False
        atexit.register(_stop_server, path)
    return True


def _stop_server(path: str) -> None:
    global _server
    with _server_lock:
        server, _server = _server, None
    if server is not None:
        try:
            server.shutdown()
        except Exception:
            pass
    try:
        os.unlink(path)
    except OSError:
        pass
