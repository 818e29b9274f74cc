"""Incident bundles on disk: atomic, never overwritten, bounded (docs/bundle.md).

A bundle is written completely into a hidden temp directory inside the
dump dir, then renamed to ``<UTC yyyymmddTHHMMSSZ>-<reason>[-N]``.
``rename(2)`` of a directory onto an existing non-empty directory fails, so
two writers (threads or processes) that pick the same name cannot clobber
each other: the loser takes the next ``-N``.  Readers never see a partial
bundle.  Retention deletes the oldest bundles (by name: time, then ``-N``)
until both the count and the byte limit hold, never the bundle just
written; a bundle is renamed to a hidden name before it is removed, so a
reader sees it whole or not at all.  Temp dirs left by a writer that died
are removed on the next write.

Bundles are private to the run's user and group (they hold stderr tails and
command lines, which may hold prompts): directories 0750, files 0640, set
explicitly so the umask neither widens nor narrows them; a dump dir the writer
creates is 0750 too (``make_dirs``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

import structlog

from tp_supervise.supervisor.rank.runtime import pid_alive

from .render import summary_text

log = structlog.get_logger()

SUMMARY_JSON = "summary.json"
SUMMARY_TXT = "summary.txt"
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"
TIME_FORMAT = "%Y%m%dT%H%M%SZ"
MAX_SUFFIX = 10_000
BUNDLE_NAME = re.compile(r"^(?P<ts>\d{8}T\d{6}Z)-(?P<reason>[a-z0-9_]+?)(?:-(?P<n>\d+))?$")
_REASON_CHARS = re.compile(r"[^a-z0-9_]+")
DIR_MODE = 0o750  # bundles, the dump dir the writer creates, --log-dir's directories
FILE_MODE = 0o640


def make_dirs(path: Path, mode: int = DIR_MODE) -> None:
    """``mkdir -p`` whose new directories get ``mode`` whatever the umask; existing ones keep theirs."""
    missing = []
    path = Path(path)
    while not path.is_dir() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            continue  # made meanwhile by another writer (theirs), or not a directory (the next step fails)
        os.chmod(directory, mode)


def _write_file(path: Path, data: bytes) -> None:
    """``path`` (in a directory of the writer's own, never through a symlink) holding ``data``, mode ``FILE_MODE``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def bundle_name(detected_at: datetime, reason: str, n: int = 0) -> str:
    ts = detected_at.astimezone(timezone.utc).strftime(TIME_FORMAT)
    clean = _REASON_CHARS.sub("_", reason.lower()).strip("_") or "incident"
    return f"{ts}-{clean}" + (f"-{n}" if n else "")


def iso_utc(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def stack_file(rank: int) -> str:
    return f"stacks/rank-{rank}.txt"


def process_stack_file(role: str, pid: int | None) -> str:
    """The stacks of a process of the run that is not a rank: ``stacks/scheduler-1234.txt``."""
    return f"stacks/{role.replace(' ', '-') or 'process'}-{pid}.txt"


def fr_file(rank: int) -> str:
    """Rank r's flight-recorder trace as the pickle ``torchfrtrace <bundle>/fr`` reads.

    Nothing else goes in ``fr/``: the analyzer walks the whole directory and
    infers one file-name prefix from every name in it.
    """
    return f"fr/rank-{rank}"


def fr_json_file(rank: int) -> str:
    """The same trace as the rank's worker server answered it (torch's JSON, no stack traces)."""
    return f"fr-json/rank-{rank}.json"


def torch_dump_file(rank: int) -> str:
    """The file torch wrote itself on a NCCL timeout (same pickle format, with stack traces)."""
    return f"fr-torch/rank-{rank}"


_STACK_FILE = re.compile(r"^stacks/rank-(-?\d+)\.txt$")


def stacks_from_files(files: Mapping[str, bytes | str]) -> dict[int, str]:
    """Rank -> stack text, from bundle file names (``stacks/rank-<r>.txt``)."""
    out = {}
    for name, content in files.items():
        m = _STACK_FILE.match(name)
        if m:
            out[int(m.group(1))] = content if isinstance(content, str) else bytes(content).decode("utf-8", "replace")
    return out


def _summary_text(summary: dict, files: Mapping[str, bytes | str]) -> str:
    """summary.txt; what a rank wrote can never fail the bundle (the JSON is then the text)."""
    try:
        return summary_text(summary, stacks_from_files(files))
    except Exception as exc:  # a rendering bug must not lose the evidence
        log.warning("dump.summary_text_failed", error=repr(exc))
        return json.dumps(summary, indent=2, default=str) + "\n"


def _replace_file(path: Path, text: str) -> None:
    """``path`` gets ``text`` whole or not at all: a temp file beside it, then ``rename(2)`` over it."""
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")
    tmp.unlink(missing_ok=True)  # left by an earlier amend of this process that failed half-way
    try:
        _write_file(tmp, text.encode("utf-8"))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def amend_summary(bundle: Path, fields: Mapping) -> dict:
    """Add ``fields`` to a written bundle's summary (what a node learnt after writing it: the other
    nodes' evidence of the same incident); returns the new summary.

    The bundle stays whole for any reader: ``summary.txt`` then ``summary.json`` are each replaced
    atomically (written beside, then renamed over), never rewritten in place; nothing else changes.
    Raises OSError (the bundle is gone, the disk is full) or ValueError (its summary is not ours)."""
    bundle = Path(bundle)
    summary = json.loads((bundle / SUMMARY_JSON).read_text(encoding="utf-8"))
    if not isinstance(summary, dict):
        raise ValueError(f"{bundle / SUMMARY_JSON} is not a JSON object")
    summary.update(fields)
    stacks_dir = bundle / "stacks"
    files = (
        {f"stacks/{p.name}": p.read_bytes() for p in sorted(stacks_dir.glob("rank-*.txt"))}
        if stacks_dir.is_dir()
        else {}
    )
    _replace_file(bundle / SUMMARY_TXT, _summary_text(summary, files))
    _replace_file(bundle / SUMMARY_JSON, json.dumps(summary, indent=2, default=str) + "\n")
    return summary


@dataclass(frozen=True)
class _Existing:
    path: Path
    key: tuple
    size: int


def _tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _safe_relpath(name: str) -> PurePosixPath:
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts or name in (SUMMARY_JSON, SUMMARY_TXT):
        raise ValueError(f"bad bundle file name {name!r}")
    return rel


class BundleWriter:
    """Writes bundles under ``dump_dir``; keeps at most ``keep`` and ``max_bytes`` (0: no byte limit)."""

    def __init__(self, dump_dir: Path, keep: int, max_bytes: int):
        if keep < 1:
            raise ValueError("keep must be at least 1 (the bundle just written is always kept)")
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0 (0: no byte limit)")
        self.dump_dir = Path(dump_dir)
        self.keep = keep
        self.max_bytes = max_bytes

    def write(
        self,
        reason: str,
        summary: dict,
        files: Mapping[str, bytes | str],
        detected_at: datetime,
    ) -> Path:
        """Write one bundle atomically and apply retention; returns its path.

        ``files`` maps relative paths (``stacks/rank-0.txt``) to contents.
        ``summary`` gets ``reason``, ``detected_at`` and ``format_version``
        filled in when absent; ``summary.txt`` is rendered from it.
        """
        make_dirs(self.dump_dir)
        full = {"format_version": FORMAT_VERSION, "reason": reason, "detected_at": iso_utc(detected_at)}
        full.update(summary)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=self.dump_dir))
        try:
            for name, content in files.items():
                target = tmp.joinpath(*_safe_relpath(name).parts)
                make_dirs(target.parent)
                if isinstance(content, str):
                    data = content.encode("utf-8")
                elif isinstance(content, (bytes, bytearray, memoryview)):
                    data = bytes(content)
                else:
                    raise TypeError(f"bundle file {name!r}: content must be str or bytes, not {type(content).__name__}")
                _write_file(target, data)
            _write_file(tmp / SUMMARY_TXT, _summary_text(full, files).encode("utf-8"))
            # summary.json last: a directory with it is complete.
            _write_file(tmp / SUMMARY_JSON, (json.dumps(full, indent=2, default=str) + "\n").encode("utf-8"))
            os.chmod(tmp, DIR_MODE)  # mkdtemp made it 0700
            final = self._publish(tmp, detected_at, reason)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            self.enforce_retention(protect=final)
        except OSError as exc:  # retention never fails a written bundle
            log.warning("dump.retention_failed", error=repr(exc))
        return final

    def _publish(self, tmp: Path, detected_at: datetime, reason: str) -> Path:
        for n in range(MAX_SUFFIX):
            final = self.dump_dir / bundle_name(detected_at, reason, n)
            try:
                os.rename(tmp, final)
                return final
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
        raise FileExistsError(f"no free bundle name for {reason} at {detected_at}")

    def bundles(self) -> list[Path]:
        """Published bundles, oldest first."""
        return [e.path for e in self._existing(with_size=False)]

    def _existing(self, with_size: bool) -> list[_Existing]:
        out = []
        try:
            entries = list(os.scandir(self.dump_dir))
        except FileNotFoundError:
            return []
        for entry in entries:
            m = BUNDLE_NAME.match(entry.name)
            if not m or not entry.is_dir(follow_symlinks=False):
                continue
            key = (m.group("ts"), int(m.group("n") or 0), entry.name)
            size = _tree_size(Path(entry.path)) if with_size else 0
            out.append(_Existing(Path(entry.path), key, size))
        out.sort(key=lambda e: e.key)
        return out

    def enforce_retention(self, protect: Path | None = None) -> list[Path]:
        """Delete oldest bundles beyond ``keep`` / ``max_bytes``; returns what was deleted."""
        self._sweep_temp()
        existing = self._existing(with_size=True)
        count = len(existing)
        total = sum(e.size for e in existing)
        deleted = []
        for e in existing:
            if count <= self.keep and (not self.max_bytes or total <= self.max_bytes):
                break
            if protect is not None and e.path == Path(protect):
                continue
            if self._remove(e.path):
                deleted.append(e.path)
                log.info("dump.bundle_deleted", path=str(e.path), bytes=e.size)
            count -= 1
            total -= e.size
        return deleted

    def _remove(self, path: Path) -> bool:
        hidden = path.with_name(f"{DEL_PREFIX}{os.getpid()}-{path.name}")
        try:
            os.rename(path, hidden)
        except FileNotFoundError:
            return False  # another writer's retention got there first
        shutil.rmtree(hidden, ignore_errors=True)
        return True

    def _sweep_temp(self) -> None:
        """Remove temp/delete dirs whose writer process is gone."""
        try:
            entries = list(os.scandir(self.dump_dir))
        except FileNotFoundError:
            return
        for entry in entries:
            for prefix in (TMP_PREFIX, DEL_PREFIX):
                if not entry.name.startswith(prefix):
                    continue
                pid_text = entry.name[len(prefix) :].split("-", 1)[0]
                if pid_text.isdigit() and not pid_alive(int(pid_text)):
                    shutil.rmtree(entry.path, ignore_errors=True)
