"""The files the engine shares with its supervisor in ``$SUPERVISE_RUN_DIR`` (torch-free, stdlib only).

``$SUPERVISE_RUN_DIR`` is the run's scratch directory on tmpfs (the
supervisor sets it; it outlives every attempt of the run).  Without it the
engine writes and reads none of these files.

=====================  ========  ==============================================
file                   writer    what
=====================  ========  ==============================================
``inflight-rank<r>``   engine    fingerprints of the requests rank ``r`` has in
                                 flight (today only the rank that serves HTTP,
                                 rank 0, writes one); survives the rank's death
``quarantine.json``    supervisor  fingerprints the frontend refuses (400),
                                 and the suspects it prefills alone
``incident``           supervisor  the id of the incident that ended the
                                 attempt; named in the 503s of the requests
                                 that were in flight
=====================  ========  ==============================================

Fingerprint (:func:`fingerprint`): BLAKE2b, 16 bytes, personalised
``tps-request-v1``, over the canonical JSON of ``[model id, prompt token ids,
max_tokens, temperature, top_p, seed, stop strings, ignore_eos]``: the
prompt as the model sees it (a chat request's rendered prompt; text and token
ids that encode the same are the same request), the sampling parameters as
the client sent them (``seed`` null when the server draws one, so a retry of
the same request has the same fingerprint), never the text.  ``stream`` and
``return_token_ids`` do not count.  Written as 32 lowercase hex digits.

``inflight-rank<r>`` layout (little-endian, fixed size, mmap'd ``MAP_SHARED``)::

    offset  size  field
    0       8     magic b"TPSINFLT"
    8       4     version (1)
    12      4     nslots (the engine's --max-batch)
    16      4     pid of the writer
    20      4     attempt (TORCHELASTIC_RESTART_COUNT, 0 when unset)
    24      8     generation: +1 before and +1 after every change (odd: a change is being written)
    32      32    reserved (zero)
    64 + 32*i     slot i:
            1     state: 0 free, 1 in flight
            3     reserved
            4     step: index of the engine step that first scheduled it (1-based; 0: not recorded)
            8     since: CLOCK_MONOTONIC ns when the request was first scheduled
            16    fingerprint (raw bytes)

``step`` sits in bytes that version 1 first left reserved (zero): a reader
that finds 0 there (an engine that does not record it) falls back to
``since``; a reader that ignores it still reads the rest.

Ordering rules (one writer thread, the engine loop): adding a request writes
``step``, ``since`` and the fingerprint first and the state byte last; removing
clears the state byte first.  A slot whose state byte is 1 therefore holds a
complete fingerprint, even when the process died in the middle of a change:
a reader after the rank's death reads a consistent set (the requests added
and not removed, plus at most the one change in progress, whole or not at
all).  A reader of a live file retries while the generation is odd or moved
during its read.  The file is created under a temporary name and renamed
into place (a reader never sees a partial header); each attempt replaces it,
so the supervisor reads it after a failure and before the next attempt.

A request is in flight from the engine step that first schedules it (its
prefill) until it finished, was aborted (stop string, client gone) or the
engine shut down cleanly (the file is then emptied); a request still waiting
for a batch slot has not run and is not listed.

``quarantine.json``: ``{"version": 1, "fingerprints": {"<32 hex>":
["<incident id>", ...]}, "suspects": ["<32 hex>", ...]}``, written by the
supervisor atomically (temporary file + rename).  The frontend reads it at
start and again whenever its inode, size or mtime changed (one ``stat`` per
request); a file that does not parse keeps the previous list (logged once).
A request whose fingerprint is listed under ``fingerprints`` is answered 400
(code ``request_quarantined``, engine/openai_api.py's ``quarantined``)
naming the incident ids, before it is scheduled.  A request listed under ``suspects`` (the supervisor suspects it
after one failure, not yet quarantined) is marked ``isolate``: the scheduler
prefills it alone in its step (engine/scheduler.py), so if it fails the group
again the failing step started nothing else.  Readers ignore keys they do
not know; ``suspects`` is optional (absent: none), and one that is not a list
of fingerprints is ignored (the quarantine still applies).

``incident``: UTF-8 text, the incident id on its first line (at most
``MAX_INCIDENT_CHARS`` printable characters).  The supervisor writes it
(temporary file + rename) when it rules a fault, before it signals any rank,
and removes it before it starts the next attempt.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from tp_supervise.supervisor.rank.ring import create_shared_map

from .log import get_logger

RUN_DIR_ENV = "SUPERVISE_RUN_DIR"
ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"
QUARANTINE_FILE = "quarantine.json"
INCIDENT_FILE = "incident"
INFLIGHT_PREFIX = "inflight-rank"
FINGERPRINT_BYTES = 16
FINGERPRINT_PERSON = b"tps-request-v1"
QUARANTINE_VERSION = 1
MAX_INCIDENT_CHARS = 128

MAGIC = b"TPSINFLT"
LAYOUT_VERSION = 1
HEADER = struct.Struct("<8sIIIIQ32x")  # magic, version, nslots, pid, attempt, generation
SLOT = struct.Struct("<B3xIQ16s")  # state, step, since_ns, fingerprint
SLOT_STEP_OFFSET = 4  # step, since and fingerprint: written before the state byte
GENERATION_OFFSET = 24
SLOT_FREE, SLOT_IN_FLIGHT = 0, 1
READ_RETRIES = 100

log = get_logger()


def fingerprint(
    model: str,
    prompt_ids,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    stop: tuple[str, ...],
    ignore_eos: bool,
) -> str:
    """The request's fingerprint: 32 hex digits (see the module docstring for what counts)."""
    canonical = json.dumps(
        [model, list(prompt_ids), max_tokens, temperature, top_p, seed, list(stop), ignore_eos],
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.blake2b(
        canonical.encode("ascii"), digest_size=FINGERPRINT_BYTES, person=FINGERPRINT_PERSON
    ).hexdigest()


def inflight_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / f"{INFLIGHT_PREFIX}{rank}"


def attempt_from(environ) -> int:
    try:
        return max(0, int(environ.get(ATTEMPT_ENV, "0") or 0))
    except ValueError:
        return 0


# -- inflight-rank<r>: writer -----------------------------------------------------------------
class InflightFile:
    """This rank's in-flight fingerprints, one slot per running request (engine loop thread only)."""

    def __init__(self, path: str | os.PathLike, nslots: int, attempt: int):
        self.path = Path(path)
        self.nslots = nslots
        size = HEADER.size + SLOT.size * nslots
        self._map, publish = create_shared_map(self.path, size)
        self._generation = 0
        HEADER.pack_into(self._map, 0, MAGIC, LAYOUT_VERSION, nslots, os.getpid(), attempt, 0)
        publish()
        self._slots: dict[str, int] = {}  # request id -> slot
        self._free = list(range(nslots - 1, -1, -1))
        self.dropped = 0  # requests not recorded because every slot was taken (never expected)

    def _bump(self) -> None:
        self._generation += 1
        struct.pack_into("<Q", self._map, GENERATION_OFFSET, self._generation)

    def add(self, request_id: str, fp_hex: str, step: int = 0) -> None:
        """Record a request the engine step ``step`` (its plan's index) first schedules."""
        if request_id in self._slots:
            return
        if not self._free:
            self.dropped += 1
            log.warning("in-flight record full", request_id=request_id, slots=self.nslots)
            return
        slot = self._free.pop()
        offset = HEADER.size + SLOT.size * slot
        self._bump()
        struct.pack_into(
            "<IQ16s",
            self._map,
            offset + SLOT_STEP_OFFSET,
            step & 0xFFFFFFFF,
            time.monotonic_ns(),
            bytes.fromhex(fp_hex),
        )
        self._map[offset] = SLOT_IN_FLIGHT  # last: the slot is complete
        self._bump()
        self._slots[request_id] = slot

    def remove(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is None:
            return
        self._bump()
        self._map[HEADER.size + SLOT.size * slot] = SLOT_FREE  # first: the slot is gone
        self._bump()
        self._free.append(slot)

    def clear(self) -> None:
        for request_id in list(self._slots):
            self.remove(request_id)

    def close(self) -> None:
        self._map.close()


class InflightRequests:
    """Rank 0's engine-loop view: fingerprints of requests received, recorded once scheduled.

    ``file`` None (no run dir, or a rank that does not serve HTTP): every call is a no-op.
    """

    def __init__(self, file: InflightFile | None):
        self._file = file
        self._pending: dict[str, str] = {}  # received, not yet scheduled: request id -> fingerprint

    def arrived(self, requests) -> None:
        if self._file is None:
            return
        for req in requests:
            if req.fingerprint:
                self._pending[req.request_id] = req.fingerprint

    def running(self, plan) -> None:
        """The plan is about to run: its prefills are in flight from now on."""
        if self._file is None:
            return
        for item in plan.items:
            if item.is_prefill:
                fp = self._pending.pop(item.seq_id, None)
                if fp is not None:
                    self._file.add(item.seq_id, fp, plan.index)

    def done(self, request_ids) -> None:
        if self._file is None:
            return
        for request_id in request_ids:
            self._pending.pop(request_id, None)
            self._file.remove(request_id)

    def finished(self, outputs) -> None:
        if self._file is not None:
            self.done([out.seq_id for out in outputs if out.finished])

    def clear(self) -> None:
        """A clean shutdown: nothing is in flight any more."""
        if self._file is not None:
            self._pending.clear()
            self._file.clear()


@dataclass(frozen=True)
class InflightSnapshot:
    """One read of an in-flight file, the one parser of its layout (the supervisor's quarantine reads it too)."""

    pid: int
    attempt: int
    generation: int
    started_ns: dict[str, int]  # fingerprint (hex) -> first scheduled (monotonic ns)
    step: dict[str, int]  # fingerprint (hex) -> the engine step that first scheduled it (0: not recorded)
    settled: bool  # False: the writer died (or was read) in the middle of one change

    @property
    def fingerprints(self) -> tuple[str, ...]:
        """In flight, oldest first."""
        return tuple(sorted(self.started_ns, key=lambda fp: (self.started_ns[fp], fp)))


class InflightFormatError(ValueError):
    pass


def _parse_inflight(data: bytes) -> InflightSnapshot:
    if len(data) < HEADER.size:
        raise InflightFormatError(f"{len(data)} bytes is shorter than the header")
    magic, version, nslots, pid, attempt, generation = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != LAYOUT_VERSION:
        raise InflightFormatError(
            f"not an in-flight file of version {LAYOUT_VERSION} (magic {magic!r}, version {version})"
        )
    if len(data) != HEADER.size + SLOT.size * nslots:
        raise InflightFormatError(f"{len(data)} bytes for {nslots} slots")
    started: dict[str, int] = {}
    steps: dict[str, int] = {}
    for i in range(nslots):
        state, step, since, fp = SLOT.unpack_from(data, HEADER.size + SLOT.size * i)
        if state == SLOT_IN_FLIGHT:
            started[fp.hex()] = since
            steps[fp.hex()] = step
    return InflightSnapshot(pid, attempt, generation, started, steps, generation % 2 == 0)


def read_inflight(path: str | os.PathLike) -> InflightSnapshot:
    """Read an in-flight file (the writer alive or dead).  Raises OSError or :class:`InflightFormatError`."""
    for _ in range(READ_RETRIES):
        with open(path, "rb") as f:
            snapshot = _parse_inflight(f.read())
            f.seek(GENERATION_OFFSET)
            (after,) = struct.unpack("<Q", f.read(8))
        if snapshot.settled and after == snapshot.generation:
            break
    return snapshot  # unsettled: a dead writer stopped mid-change; the state bytes still make the set consistent


# -- quarantine.json: reader --------------------------------------------------------------------
class Quarantine:
    """The supervisor's quarantine list, re-read when the file changes (HTTP thread)."""

    def __init__(self, run_dir: str | os.PathLike | None):
        self.path = Path(run_dir) / QUARANTINE_FILE if run_dir else None
        self._stamp: tuple[int, int, int] | None = None
        self._entries: dict[str, tuple[str, ...]] = {}
        self._suspects: frozenset[str] = frozenset()

    def lookup(self, fp_hex: str) -> tuple[str, ...] | None:
        """The incident ids that quarantined this fingerprint, or None."""
        if self.path is None:
            return None
        self.refresh()
        return self._entries.get(fp_hex)

    def suspected(self, fp_hex: str) -> bool:
        """Whether the supervisor suspects this fingerprint (prefill it alone), as of the last ``lookup``."""
        return fp_hex in self._suspects

    def suspects_listed(self) -> bool:
        """Whether the supervisor lists any suspect (a crash loop is being sorted out), as of the last ``lookup``."""
        return bool(self._suspects)

    def refresh(self) -> None:
        """Re-read the file if it changed (inode, size, mtime); cheap when it did not."""
        path = self.path
        if path is None:
            return
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if self._stamp is not None:
                self._stamp, self._entries, self._suspects = None, {}, frozenset()
            return
        except OSError:
            return
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._entries, self._suspects = parse_quarantine_file(path.read_bytes())
        except (OSError, ValueError) as exc:
            log.warning("quarantine list unreadable", path=str(path), error=str(exc)[:200], kept=len(self._entries))
            return
        log.info(
            "quarantine list loaded", path=str(path), fingerprints=len(self._entries), suspects=len(self._suspects)
        )


def parse_quarantine_file(raw: bytes) -> tuple[dict[str, tuple[str, ...]], frozenset[str]]:
    """``quarantine.json``: the quarantined fingerprints and the suspects (raises ValueError for a bad file)."""
    data = json.loads(raw.decode("utf-8"))
    if not isinstance(data, dict) or data.get("version") != QUARANTINE_VERSION:
        raise ValueError(f'expected a JSON object with "version": {QUARANTINE_VERSION}')
    fps = data.get("fingerprints")
    if not isinstance(fps, dict):
        raise ValueError('"fingerprints" must be an object')
    entries = {}
    for fp, incidents in fps.items():
        if not isinstance(incidents, list) or not all(isinstance(i, str) for i in incidents):
            raise ValueError(f"fingerprint {fp[:40]!r}: the value must be a list of incident ids")
        entries[fp.lower()] = tuple(incidents)
    listed = data.get("suspects", [])
    suspects: frozenset[str] = frozenset()
    if isinstance(listed, list) and all(isinstance(fp, str) for fp in listed):
        suspects = frozenset(fp.lower() for fp in listed) - entries.keys()
    return entries, suspects


def write_quarantine(run_dir: str | os.PathLike, entries: dict[str, list[str]], suspects=()) -> Path:
    """Write ``quarantine.json`` atomically (the supervisor's side of the contract; tests use it too)."""
    path = Path(run_dir) / QUARANTINE_FILE
    tmp = path.with_name(f".{QUARANTINE_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": QUARANTINE_VERSION, "fingerprints": entries, "suspects": sorted(suspects)}))
    os.replace(tmp, path)
    return path


# -- incident: reader ---------------------------------------------------------------------------
def read_incident(run_dir: str | os.PathLike | None) -> str | None:
    """The incident id the supervisor wrote, or None (no run dir, no file, or not a plausible id)."""
    if not run_dir:
        return None
    try:
        with open(Path(run_dir) / INCIDENT_FILE, "rb") as f:
            raw = f.read(MAX_INCIDENT_CHARS * 4 + 1)
    except OSError:
        return None
    first = raw.decode("utf-8", errors="replace").split("\n", 1)[0].strip()
    if not first or len(first) > MAX_INCIDENT_CHARS or not first.isprintable():
        return None
    return first
