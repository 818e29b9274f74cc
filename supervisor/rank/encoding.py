"""Canonical event encoding and the per-step digest.

Equal decisions must hash equal in different processes, so an event is
encoded as one line of canonical JSON, ``[kind, payload]``:

* keys of dicts are sorted, separators carry no spaces, output is ASCII;
* ints, strs, bools and ``None`` map to themselves; tuples and lists both
  become JSON arrays (a decision does not depend on the container type);
* floats use Python's shortest round-trip repr (``NaN``/``Infinity`` allowed),
  so bit-equal floats encode equal and ``-0.0`` differs from ``0.0``;
* ``bytes`` become ``{"$bytes": "<hex>"}``; sets become sorted arrays;
  objects with ``tolist()`` (numpy arrays and scalars, CPU tensors) become
  their lists.

JSON text never contains a raw newline, so a step's event log is simply its
lines, each ended by ``\\n``; the digest of a step is BLAKE2b-128 of that
log, folded event by event into a running hash as the events are recorded.
The C-accelerated ``json`` encoder costs about what ``repr`` does and, unlike
``repr`` or ``pickle``, is canonical (bench/bench_consensus.py measures all three).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

DIGEST_SIZE = 16
LINE_END = b"\n"


def _default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(obj).hex()}
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"{type(obj).__name__} has no canonical encoding")


_ENCODER = json.JSONEncoder(
    sort_keys=True,
    separators=(",", ":"),
    ensure_ascii=True,
    check_circular=False,
    allow_nan=True,
    default=_default,
)
_encode = _ENCODER.encode


def encode_event(kind: str, payload: Any) -> str:
    """One event as a canonical JSON line (no trailing newline).

    A payload without a canonical encoding (mixed-type dict keys, unknown
    objects) is encoded by its ``repr`` under ``{"$repr": ...}`` rather than
    raising inside the engine; such events are only as canonical as the repr.
    """
    try:
        return _encode((kind, payload))
    except (TypeError, ValueError, RecursionError):
        return _encode((kind, {"$repr": repr(payload)}))


def decode_event(line: str | bytes) -> tuple[str, Any]:
    """Inverse of :func:`encode_event` up to container types (arrays are lists)."""
    kind, payload = json.loads(line)
    return str(kind), payload


def event_bytes(kind: str, payload: Any) -> bytes:
    """One event as it is hashed and stored: its line plus the line end."""
    return (encode_event(kind, payload) + "\n").encode("ascii")


def split_log(blob: bytes) -> list[bytes]:
    """The encoded event lines of one step's log (line ends removed)."""
    lines = blob.split(LINE_END)
    if lines and not lines[-1]:
        lines.pop()
    return lines


def join_log(lines: list[bytes]) -> bytes:
    """Inverse of :func:`split_log`."""
    return b"".join(line + LINE_END for line in lines)


def digest(blob: bytes) -> bytes:
    """Digest of one step's complete event log."""
    return hashlib.blake2b(blob, digest_size=DIGEST_SIZE).digest()


def new_hasher():
    """A hasher that yields the same digest as :func:`digest` when fed the log in pieces."""
    return hashlib.blake2b(digest_size=DIGEST_SIZE)
