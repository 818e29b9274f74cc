"""Bundles: layout, atomic publication, no overwrite (threads and processes), retention, permissions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tp_supervise.dumps.bundle import SUMMARY_JSON, SUMMARY_TXT, BundleWriter, amend_summary, bundle_name

AT = datetime(2026, 3, 4, 5, 6, 7, tzinfo=timezone.utc)
SUMMARY = {
    "run_id": "run-1",
    "culprit_ranks": [1],
    "verdict": "rank 1 is stopped",
    "ranks": {"0": {"pid": 10, "state": "S", "exit": None, "stack_signature": "a"}},
}


def test_layout_and_summary(tmp_path):
    w = BundleWriter(tmp_path, keep=10, max_bytes=0)
    path = w.write("hang", dict(SUMMARY), {"stacks/rank-0.txt": "main thread\n    f (a.py:1)\n", "fr/rank-0.json": b"{}"}, AT)
    assert path == tmp_path / "20260304T050607Z-hang"
    summary = json.loads((path / SUMMARY_JSON).read_text())
    assert summary["reason"] == "hang" and summary["detected_at"] == "2026-03-04T05:06:07Z"
    assert summary["culprit_ranks"] == [1] and summary["run_id"] == "run-1"
    assert (path / "stacks" / "rank-0.txt").read_text().startswith("main thread")
    assert (path / "fr" / "rank-0.json").read_bytes() == b"{}"
    text = (path / SUMMARY_TXT).read_text()
    assert "rank 1 is stopped" in text and "f (a.py:1)" in text
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp dir left


def test_rank_text_is_data_not_markup(tmp_path):
    """A collective description like '[/x] 64x256' used to make every bundle write fail (rich MarkupError)."""
    w = BundleWriter(tmp_path, keep=10, max_bytes=0)
    summary = dict(SUMMARY, verdict="rank 1 waits in all_reduce [/x] 64x256",
                   ranks={"0": {"pid": 10, "collective": "[/x] 64x256", "where": "[red]f\x1b[2J"}},
                   stack_groups=[{"label": "[/A]", "ranks": [0], "short": "[/b]"}])
    path = w.write("hang", summary, {"stacks/rank-0.txt": "Thread [/t]\n    f [/x] (a.py:1)\n"}, AT)
    text = (path / SUMMARY_TXT).read_text()
    for verbatim in ("[/x] 64x256", "[red]f", "group [/A]", "f [/x] (a.py:1)"):
        assert verbatim in text, verbatim
    assert "\x1b" not in text and "\\x1b[2J" in text


def test_name_is_utc_and_reason_sanitised():
    local = AT.astimezone(timezone(timedelta(hours=-7)))
    assert bundle_name(local, "Hang Suspected/x", 2) == "20260304T050607Z-hang_suspected_x-2"


def test_same_second_never_overwrites(tmp_path):
    w = BundleWriter(tmp_path, keep=10, max_bytes=0)
    paths = [w.write("hang", {**SUMMARY, "verdict": f"v{i}"}, {}, AT) for i in range(3)]
    assert [p.name for p in paths] == ["20260304T050607Z-hang", "20260304T050607Z-hang-1", "20260304T050607Z-hang-2"]
    assert [json.loads((p / SUMMARY_JSON).read_text())["verdict"] for p in paths] == ["v0", "v1", "v2"]


def test_concurrent_threads_get_distinct_bundles(tmp_path):
    w = BundleWriter(tmp_path, keep=100, max_bytes=0)
    out: list[Path] = []
    lock = threading.Lock()

    def write(i: int) -> None:
        p = w.write("hang", {**SUMMARY, "verdict": f"t{i}"}, {"x.txt": "x" * 1000}, AT)
        with lock:
            out.append(p)

    threads = [threading.Thread(target=write, args=(i,), name=f"writer-{i}") for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({p.name for p in out}) == 8
    verdicts = {json.loads((p / SUMMARY_JSON).read_text())["verdict"] for p in out}
    assert verdicts == {f"t{i}" for i in range(8)}


WRITER_SCRIPT = """
import sys, json
from datetime import datetime, timezone
from pathlib import Path
from tp_supervise.dumps.bundle import BundleWriter
w = BundleWriter(Path(sys.argv[1]), keep=100, max_bytes=0)
at = datetime(2026, 3, 4, 5, 6, 7, tzinfo=timezone.utc)
for i in range(5):
    w.write("hang", {"verdict": sys.argv[2] + "-" + str(i), "ranks": {}}, {"big.bin": b"y" * 20000}, at)
"""


def test_concurrent_processes_get_distinct_bundles(tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(tmp_path), f"p{i}"]) for i in range(4)
    ]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    bundles = sorted(p for p in tmp_path.iterdir())
    assert len(bundles) == 20
    verdicts = {json.loads((b / SUMMARY_JSON).read_text())["verdict"] for b in bundles}
    assert len(verdicts) == 20  # nobody overwrote anybody


def test_readers_never_see_a_partial_bundle(tmp_path):
    # No retention here: a reader that opened a bundle just before retention
    # renamed it away may list it mid-removal, which is not a partial write.
    w = BundleWriter(tmp_path, keep=100, max_bytes=0)
    stop = threading.Event()
    seen_partial: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            for entry in os.scandir(tmp_path):
                if entry.name.startswith("."):
                    continue
                names = set(os.listdir(entry.path))
                if names and not {SUMMARY_JSON, SUMMARY_TXT, "a.bin", "b.bin"} <= names:
                    seen_partial.append(f"{entry.name}: {sorted(names)}")

    t = threading.Thread(target=reader, name="bundle-reader")
    t.start()
    try:
        for i in range(30):
            w.write("hang", dict(SUMMARY), {"a.bin": b"a" * 50_000, "b.bin": b"b" * 50_000}, AT + timedelta(seconds=i))
    finally:
        stop.set()
        t.join()
    assert not seen_partial


def test_failed_write_leaves_nothing(tmp_path):
    w = BundleWriter(tmp_path, keep=3, max_bytes=0)
    with pytest.raises(TypeError):
        w.write("hang", dict(SUMMARY), {"ok.txt": "fine", "bad.txt": 12345}, AT)  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        w.write("hang", dict(SUMMARY), {"../escape.txt": "x"}, AT)
    with pytest.raises(ValueError):
        w.write("hang", dict(SUMMARY), {"summary.json": "{}"}, AT)
    assert list(tmp_path.iterdir()) == []
    assert not (tmp_path.parent / "escape.txt").exists()


def test_retention_by_count_keeps_newest(tmp_path):
    w = BundleWriter(tmp_path, keep=3, max_bytes=0)
    paths = [w.write("hang", dict(SUMMARY), {}, AT + timedelta(minutes=i)) for i in range(5)]
    assert w.bundles() == paths[2:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in paths[2:]]


def test_retention_orders_suffixes_numerically(tmp_path):
    w = BundleWriter(tmp_path, keep=100, max_bytes=0)
    paths = [w.write("hang", dict(SUMMARY), {}, AT) for _ in range(12)]
    assert w.bundles() == paths  # -2 before -10
    w.keep = 2
    w.enforce_retention()
    assert w.bundles() == paths[-2:]


def test_retention_by_bytes(tmp_path):
    blob = {"blob.bin": b"z" * 100_000}
    w = BundleWriter(tmp_path, keep=100, max_bytes=250_000)
    paths = [w.write("hang", dict(SUMMARY), blob, AT + timedelta(minutes=i)) for i in range(4)]
    assert w.bundles() == paths[2:]  # two bundles of ~100 kB fit in 250 kB, three do not


def test_just_written_bundle_survives_even_alone_over_limit(tmp_path):
    w = BundleWriter(tmp_path, keep=1, max_bytes=10)
    newer = w.write("hang", dict(SUMMARY), {}, AT + timedelta(hours=1))
    older_clock = w.write("rank_exit", dict(SUMMARY), {"x.bin": b"x" * 1000}, AT)  # clock went back
    assert older_clock.exists() and not newer.exists()
    assert w.bundles() == [older_clock]


def test_stale_temp_dir_of_dead_writer_is_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".tmp-{dead.pid}-abc"
    stale.mkdir()
    (stale / "half.txt").write_text("x")
    mine = tmp_path / f".tmp-{os.getpid()}-live"
    mine.mkdir()
    BundleWriter(tmp_path, keep=2, max_bytes=0).write("hang", dict(SUMMARY), {}, AT)
    assert not stale.exists() and mine.exists()


def test_invalid_limits(tmp_path):
    with pytest.raises(ValueError):
        BundleWriter(tmp_path, keep=0, max_bytes=0)
    with pytest.raises(ValueError):
        BundleWriter(tmp_path, keep=1, max_bytes=-1)


@pytest.fixture(params=[0o000, 0o077], ids=["umask000", "umask077"])
def any_umask(request):
    """Neither the usual 022 nor the code's own modes: 000 would leave files 0666 and 077 0600 unless the
    code sets the mode itself."""
    old = os.umask(request.param)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> str:
    return oct(os.lstat(path).st_mode & 0o7777)


def test_bundles_are_not_world_readable_whatever_the_umask(tmp_path, any_umask):
    """Umask 000 or 077 here: the modes seen are the writer's own.  Directories 0750, files 0640, an amended summary
    too, and a dump dir the writer makes (with its missing parent) 0750."""
    dump_dir = tmp_path / "made" / "dumps"
    w = BundleWriter(dump_dir, keep=10, max_bytes=0)
    path = w.write("rank_exit", dict(SUMMARY), {"logs/rank-1.txt": "a prompt, perhaps\n", "stacks/rank-0.txt": "x"}, AT)
    amend_summary(path, {"nodes": {"1": {"bundle": "elsewhere"}}})
    dirs = [dump_dir.parent, dump_dir, path, path / "logs", path / "stacks"]
    files = [p for p in path.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["rank-0.txt", "rank-1.txt", SUMMARY_JSON, SUMMARY_TXT]
    assert {str(d): _mode(d) for d in dirs} == {str(d): "0o750" for d in dirs}
    assert {str(f): _mode(f) for f in files} == {str(f): "0o640" for f in files}


def test_an_existing_dump_dir_keeps_its_mode(tmp_path, any_umask):
    dump_dir = tmp_path / "dumps"
    dump_dir.mkdir(mode=0o700)
    path = BundleWriter(dump_dir, keep=10, max_bytes=0).write("hang", dict(SUMMARY), {}, AT)
    assert _mode(dump_dir) == "0o700" and _mode(path) == "0o750"
