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

PyTorch's analyzer (``torchfrtrace DIR``,
``torch/distributed/flight_recorder``) reads one pickle per rank, named
``<prefix><rank>`` with one prefix for the whole directory, each the dict
``_dump_fr_trace()`` pickles: ``version``, ``pg_config``, ``entries`` (it
also reads ``pg_status`` and ``comm_lib_version`` where present).  The worker
server has no pickle handler, only ``fr_trace_json``, which serialises the
same recorder with three differences (checked on torch 2.13): no ``frames``
(stack traces are left out of the JSON on purpose; the analyzer treats them
as optional), ``process_group`` a list instead of a tuple, the
``time_discovered_*`` of an entry not yet seen started/completed 0 instead of
None, and ``pg_status`` numbers as strings.  ``fr_dump`` undoes those, so
the bundle's ``fr/`` holds what torch itself would have written, minus the
stack traces (the bundle's ``stacks/`` has them), plus the group table gloo
leaves out (see ``fr_dump``).

``collect_torch_dumps`` copies the files torch wrote itself when a NCCL
collective timed out (``TORCH_FR_DUMP_TEMP_FILE``, set by ``rank_env`` to the
run dir): regular files only, never through a link, bounded in size and time.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import pickle
import re
import socket
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from tp_supervise.supervisor.rank.flight import FR_DUMP_PREFIX, HANDLER_FR, dump_dir, socket_path

from .capture import RankTarget
from .fr_analysis import FrEntry, FrFindings, Mismatch, MissingCollective, analyze
from .procinfo import proc_state

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


def collect_detailed(
    targets: Sequence[RankTarget], run_dir: Path, timeout_s: float
) -> tuple[dict[int, dict], dict[int, str]]:
    """(traces by rank, why each other rank has none); returns within ``timeout_s``."""
    end = time.monotonic() + max(0.0, timeout_s)
    traces: dict[int, dict] = {}
    errors: dict[int, str] = {}
    lock = threading.Lock()

    def one(target: RankTarget) -> None:
        path = socket_path(run_dir, target.slot)
        result: dict | None = None
        error = ""  # why there is no result
        try:
            body = fetch(path, HANDLER_FR, max(0.001, end - time.monotonic()))
            trace = json.loads(body)
            if not isinstance(trace, dict):
                raise ValueError("trace is not a JSON object")
            result = trace
        except FileNotFoundError:
            error = "no worker server socket (flight recorder not served by this rank)"
        except TimeoutError:
            error = f"timeout after {timeout_s:.2f} s"
        except (OSError, ValueError, http.client.HTTPException) as exc:
            error = f"{type(exc).__name__}: {exc}"
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
    for _, w in workers:
        w.join(max(0.0, end - time.monotonic()))
    with lock:
        for rank, _ in workers:
            if rank not in traces and rank not in errors:
                errors[rank] = f"timeout after {timeout_s:.2f} s"
        return dict(traces), dict(errors)


# -- torchfrtrace's format ---------------------------------------------------------

_DISCOVERED = ("time_discovered_started_ns", "time_discovered_completed_ns")


def _int_or_text(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return value


DEFAULT_PG_DESC = "default_pg"


def fr_dump(trace: Mapping, members: Mapping[str, Sequence[int]] | None = None) -> dict:
    """The dict torch pickles for its own dump (what torchfrtrace reads), from a ``fr_trace_json`` answer (pure).

    ``members``: process group name -> global ranks, for groups the entries
    name but ``pg_config`` lacks.  torch 2.13's gloo backend registers its
    groups before they are named: ``pg_config`` then holds one entry under
    the empty name (the last group created) and none of the real names, in
    torch's own pickle too, and torchfrtrace stops with a ``KeyError``.  Such
    groups are added here (``"source": "tp-supervise"`` marks them) and the
    empty-named entry is dropped when no entry uses that name.
    """
    out = dict(trace)
    entries = []
    for raw in trace.get("entries") or []:
        entry = dict(raw)
        if isinstance(entry.get("process_group"), list):
            entry["process_group"] = tuple(entry["process_group"])
        for key in _DISCOVERED:
            if entry.get(key) == 0:
                entry[key] = None
        entries.append(entry)
    out["entries"] = entries
    config = {k: dict(v) for k, v in (trace.get("pg_config") or {}).items() if isinstance(v, Mapping)}
    used: dict[str, str] = {}  # process group name -> its description
    for entry in entries:
        pg = entry.get("process_group")
        if isinstance(pg, tuple) and len(pg) >= 2:
            used.setdefault(str(pg[0]), str(pg[1]))
    if "" in config and not config[""].get("name") and "" not in used:
        del config[""]
    for name, desc in used.items():
        if name not in config and members and name in members:
            config[name] = {"name": name, "desc": desc, "ranks": str(sorted(members[name])), "source": "tp-supervise"}
    out["pg_config"] = config
    status = trace.get("pg_status")
    if isinstance(status, Mapping):
        out["pg_status"] = {
            pg: {k: _int_or_text(v) for k, v in fields.items()} if isinstance(fields, Mapping) else fields
            for pg, fields in status.items()
        }
    if not out.get("nccl_comm_state"):
        out.pop("nccl_comm_state", None)  # the JSON always has it; torch's pickle only when there is one
    return out


def group_members(traces: Mapping[int, Mapping], world: Sequence[int]) -> dict[str, list[int]]:
    """Process group name -> global ranks, as far as the bundle knows (pure).

    The default group is ``world``; another group is every rank whose trace
    has entries in it (a member that never entered one is not known here).
    """
    out: dict[str, set[int]] = {}
    for rank, trace in traces.items():
        for entry in trace.get("entries") or []:
            pg = entry.get("process_group")
            if not isinstance(pg, (list, tuple)) or len(pg) < 2:
                continue
            name = str(pg[0])
            if pg[1] == DEFAULT_PG_DESC:
                out.setdefault(name, set()).update(world)
            out.setdefault(name, set()).add(rank)
    return {name: sorted(ranks) for name, ranks in out.items()}


def fr_pickles(traces: Mapping[int, Mapping], world: Sequence[int]) -> dict[int, bytes]:
    """Each rank's file for ``torchfrtrace`` (pickles of plain dicts, lists and scalars)."""
    members = group_members(traces, world)
    return {
        rank: pickle.dumps(fr_dump(trace, members), protocol=pickle.DEFAULT_PROTOCOL) for rank, trace in traces.items()
    }


# -- torch's own dump-on-timeout files -----------------------------------------------

# A trace of TORCH_FR_BUFFER_SIZE=2000 entries with stack traces is a few MiB; a file over the
# limit is left out (a cut pickle is unreadable) and named in the summary.
TORCH_DUMP_MAX_BYTES = 64 << 20
_READ_CHUNK = 1 << 20
_DUMP_NAME = re.compile(re.escape(FR_DUMP_PREFIX) + r"(\d+)$")


@dataclass(frozen=True)
class TorchDump:
    """One file torch wrote (``<run_dir>/fr-dump/rank-<r>``), or why it was not copied."""

    rank: int
    size: int
    mtime: float  # time.time() of its last write
    data: bytes | None  # None: not copied, see ``error``
    error: str | None = None

    def to_dict(self) -> dict:
        return {"size": self.size, "mtime": round(self.mtime, 3), "copied": self.data is not None, "error": self.error}


def _read_bounded(path: str, limit: int, end: float) -> tuple[bytes | None, int, float, str | None]:
    """(data, size, mtime, error): a regular file, not through a link, at most ``limit`` bytes, before ``end``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return None, 0, 0.0, ("a symbolic link" if exc.errno == errno.ELOOP else f"{type(exc).__name__}: {exc}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, 0, st.st_mtime, "not a regular file"
        if st.st_size > limit:
            return None, st.st_size, st.st_mtime, f"larger than {limit} bytes"
        chunks, total = [], 0
        while True:
            if time.monotonic() > end:
                return None, st.st_size, st.st_mtime, "deadline reached while reading"
            chunk = os.read(fd, _READ_CHUNK)
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                return None, total, st.st_mtime, f"larger than {limit} bytes"
            chunks.append(chunk)
        return b"".join(chunks), total, st.st_mtime, None
    except OSError as exc:
        return None, 0, 0.0, f"{type(exc).__name__}: {exc}"
    finally:
        os.close(fd)


def collect_torch_dumps(run_dir: Path, timeout_s: float, limit: int = TORCH_DUMP_MAX_BYTES) -> list[TorchDump]:
    """Copies of the dump-on-timeout files torch wrote into the run dir, by rank; returns within ``timeout_s``.

    Reads only names ``rank-<r>`` directly in ``<run_dir>/fr-dump`` (what
    ``TORCH_FR_DUMP_TEMP_FILE`` set by ``rank_env`` gives).
    """
    end = time.monotonic() + max(0.0, timeout_s)
    where = dump_dir(run_dir)
    try:
        names = sorted(os.listdir(where))
    except OSError:
        return []
    out = []
    for name in names:
        m = _DUMP_NAME.match(name)
        if not m:
            continue
        if time.monotonic() > end:
            out.append(TorchDump(int(m.group(1)), 0, 0.0, None, "deadline reached before reading"))
            continue
        data, size, mtime, error = _read_bounded(os.path.join(where, name), limit, end)
        out.append(TorchDump(int(m.group(1)), size, mtime, data, error))
    return out


__all__ = [
    "FrEntry",
    "FrFindings",
    "Mismatch",
    "MissingCollective",
    "TorchDump",
    "analyze",
    "collect_detailed",
    "collect_torch_dumps",
    "fr_dump",
    "fr_pickles",
    "group_members",
    "socket_path",
]
