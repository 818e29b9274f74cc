"""Flight recorder: which collective each rank last entered, taken from the ranks.

What works in torch 2.13 on CPU/gloo (checked against the installed source
and by experiment; see docs/bundle.md):

* ``TORCH_FR_BUFFER_SIZE=N`` (read when a process group is created) turns
  the recorder on for gloo too: every collective is an entry with
  ``collective_seq_id`` per process group, ``profiling_name``
  (``gloo:all_reduce``), input/output sizes and dtypes, and ``retired``
  (false while the work is in flight).  gloo leaves ``state`` at
  ``scheduled`` and the start/complete timestamps at 0.
* ``torch._C._distributed_c10d._dump_fr_trace_json()`` returns that buffer
  as JSON, in-process only.
* ``torch._C._distributed_c10d._WorkerServer(path)`` serves HTTP on a unix
  socket from a C++ thread with handlers ``fr_trace_json``,
  ``dump_traceback``, ``pyspy_dump`` and ``ping`` (``POST
  /handler/<name>``).  The handlers answer while the rank's main thread is
  blocked inside a collective.  torch starts it only from
  ``torch.distributed.elastic.control_plane.worker_main()``: setting
  ``TORCH_WORKER_SERVER_SOCKET`` alone starts nothing.  Hence
  ``serve_in_rank()`` below, which the rank side (zero-code hook, built-in
  engine) calls once it joined its process group.

The rank side (``serve_in_rank``, ``socket_path``, ``rank_env``) lives in
``tp_supervise.supervisor.rank.flight``.  Here, on the supervisor side,
``collect`` queries every rank's socket in parallel under one timeout, and
the pure ``analyze`` compares the traces across ranks.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from .procinfo import proc_state
from .fr_analysis import FrEntry, FrFindings, Mismatch, MissingCollective, analyze
from tp_supervise.supervisor.rank.flight import HANDLER_FR, socket_path

log = structlog.get_logger()

# -- supervisor side: collection --------------------------------------------------


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def fetch(path: str, handler: str, timeout_s: float) -> bytes:
    """POST /handler/<handler> on a worker server's unix socket."""
    conn = _UnixHTTPConnection(path, timeout_s)
    try:
        conn.request("POST", f"/handler/{handler}")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status}: {body[:200]!r}")
        return body
    finally:
        conn.close()



def collect_detailed(targets: Sequence, run_dir: Path, timeout_s: float) -> tuple[dict[int, dict], dict[int, str]]:
    """(traces by rank, why each other rank has none); returns within ``timeout_s``."""
    end = time.monotonic() + max(0.0, timeout_s)
    traces: dict[int, dict] = {}
    errors: dict[int, str] = {}
    lock = threading.Lock()

    def one(target) -> None:
        path = socket_path(run_dir, target.slot)
        try:
            body = fetch(path, HANDLER_FR, max(0.001, end - time.monotonic()))
            trace = json.loads(body)
            if not isinstance(trace, dict):
                raise ValueError("trace is not a JSON object")
            result, error = trace, None
        except FileNotFoundError:
            result, error = None, "no worker server socket (flight recorder not served by this rank)"
        except (TimeoutError, socket.timeout):
            result, error = None, f"timeout after {timeout_s:.2f} s"
        except (OSError, ValueError, http.client.HTTPException) as exc:
            result, error = None, f"{type(exc).__name__}: {exc}"
        with lock:
            if result is not None:
                traces[target.rank] = result
            else:
                errors[target.rank] = error

    workers = []
    for t in targets:
        if not t.alive or not t.pid:
            errors[t.rank] = "rank is not running"
            continue
        state = proc_state(t.pid)
        if state in ("T", "t"):
            errors[t.rank] = f"rank is stopped (state {state}): its worker server cannot answer"
            continue
        w = threading.Thread(target=one, args=(t,), name=f"fr-rank-{t.rank}", daemon=True)
        w.start()
        workers.append((t.rank, w))
    for rank, w in workers:
        w.join(max(0.0, end - time.monotonic()))
    with lock:
        for rank, w in workers:
            if rank not in traces and rank not in errors:
                errors[rank] = f"timeout after {timeout_s:.2f} s"
        return dict(traces), dict(errors)


__all__ = [
    "FrEntry",
    "FrFindings",
    "Mismatch",
    "MissingCollective",
    "analyze",
    "collect_detailed",
    "socket_path",
]
