"""``--log-dir`` files on the host (supervisor/processes/rank_logs.py, issue 19).

Real rank processes print through the real output pump into real files.  This process's umask is 000,
then 077, while files are made (``any_umask``), so the modes seen are the ones the code sets itself.  A symlink
planted at a log path (the file, or a directory on the way) is refused with one warning and never
followed; a run id that would leave the directory is refused the same way; files are capped and
rotated (``--log-max-bytes``), keeping the newest bytes in ``stdout.log`` then ``.1`` .. ``.3``; a
negative cap is a usage error.
"""

from __future__ import annotations

import io
import json
import logging
import os
import stat
import sys
import threading
from pathlib import Path

import pytest
import structlog

from tests.conftest import ROOT
from tp_supervise.supervisor import cli, logs
from tp_supervise.supervisor.processes.output_pump import RankOutput
from tp_supervise.supervisor.processes.rank_logs import ROTATED_KEEP, Closer, LogFile, LogPath
from tp_supervise.supervisor.processes.spawn import RankSpec, RunContext, spawn
from tp_supervise.supervisor.spec import OutputOptions, UsageError

CHATTY = ROOT / "tests" / "fakes" / "chatty_rank.py"
EXIT_S = 60


@pytest.fixture(params=[0o000, 0o077], ids=["umask000", "umask077"])
def any_umask(request):
    """Neither the usual 022 nor the code's own modes: 000 would leave files 0666 and 077 0600 unless the
    code sets the mode itself."""
    old = os.umask(request.param)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def log_lines():
    """This process's log lines as JSON records (what the pump logs); the logging set-up is restored after."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, structlog.get_config(), sys.excepthook, threading.excepthook)
    buf = io.StringIO()
    logs.configure("json", stream=buf)
    try:
        yield lambda: [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]
    finally:
        handlers, level, config, sys.excepthook, threading.excepthook = saved
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)
        structlog.configure(**config)


def _print_twice(attempt: int = 0) -> tuple[str, ...]:
    code = (f"import sys; print('hello', {attempt}, flush=True); "
            f"print('oops', {attempt}, file=sys.stderr, flush=True)")
    return (sys.executable, "-c", code)


def run_ranks(tmp_path: Path, options: OutputOptions, run_id: str = "t", ranks: int = 2) -> str:
    """Two real ranks through a pump in this process; returns what reached the console's stdout."""
    death_r, death_w = os.pipe()
    ctx = RunContext(run_id=run_id, run_dir=tmp_path, heartbeat_path=tmp_path / "hb", death_fd=death_r,
                     supervisor_pid=os.getpid(), world_size=ranks, nproc_per_node=ranks, node_rank=0,
                     master_addr="127.0.0.1", master_port=1, zero_code_hook=False)
    out, err = io.StringIO(), io.StringIO()
    pump = RankOutput(options, "console", console_out=out, console_err=err)
    try:
        handles = [spawn(RankSpec(slot, slot, _print_twice(), {}), ctx, pump=pump) for slot in range(ranks)]
        for handle in handles:
            handle.popen.wait(30)
        for slot in range(ranks):
            assert pump.stderr_tail(slot).wait_drained(5.0)
    finally:
        pump.close()
        os.close(death_r), os.close(death_w)
    return out.getvalue()


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_files_and_directories_get_their_modes_whatever_the_umask(tmp_path, any_umask):
    log_dir = tmp_path / "made" / "logs"  # missing: the pump makes it, and its parent
    shown = run_ranks(tmp_path, OutputOptions(log_dir=log_dir))
    assert sorted(shown.splitlines()) == ["[rank0]:hello 0", "[rank1]:hello 0"]
    dirs = [log_dir.parent, log_dir, log_dir / "t", log_dir / "t" / "attempt_0", log_dir / "t" / "attempt_0" / "0"]
    files = [log_dir / "t" / "attempt_0" / str(rank) / f"{name}.log" for rank in (0, 1) for name in ("stdout", "stderr")]
    assert {str(d): oct(_mode(d)) for d in dirs} == {str(d): "0o750" for d in dirs}
    assert {str(f): oct(_mode(f)) for f in files} == {str(f): "0o640" for f in files}
    assert (log_dir / "t" / "attempt_0" / "1" / "stderr.log").read_text() == "oops 0\n"


def test_an_existing_file_keeps_its_mode_and_is_appended_to(tmp_path, any_umask):
    rank_dir = tmp_path / "logs" / "t" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    kept = rank_dir / "stdout.log"
    kept.write_text("from before\n")
    kept.chmod(0o600)
    run_ranks(tmp_path, OutputOptions(log_dir=tmp_path / "logs"), ranks=1)
    assert kept.read_text() == "from before\nhello 0\n"
    assert _mode(kept) == 0o600


def test_a_symlink_planted_at_a_log_path_is_not_followed(tmp_path, log_lines):
    log_dir = tmp_path / "logs"
    attempt = log_dir / "t" / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (attempt / "0" / "stdout.log").symlink_to(victim)  # the file itself
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (attempt / "1").symlink_to(elsewhere, target_is_directory=True)  # a directory on the way
    shown = run_ranks(tmp_path, OutputOptions(log_dir=log_dir))
    assert victim.read_text() == "precious\n", "the symlink's target is untouched"
    assert list(elsewhere.iterdir()) == [], "nothing is written through a symlinked directory"
    assert sorted(shown.splitlines()) == ["[rank0]:hello 0", "[rank1]:hello 0"], "the console is unaffected"
    assert (attempt / "0" / "stderr.log").read_text() == "oops 0\n", "the other stream of the rank is logged"
    refused = [r for r in log_lines() if r["event"] == "rank_log_file_refused"]
    assert all(r["level"] == "warning" for r in refused)
    assert sorted(r["path"] for r in refused) == sorted(
        [str(attempt / "0" / "stdout.log"), str(attempt / "1" / "stdout.log"), str(attempt / "1" / "stderr.log")]
    ), "one warning per refused file"
    assert [r for r in log_lines() if r["level"] == "error"] == []


@pytest.mark.parametrize("run_id", ["..", "../../outside", "/abs", "a/b", "", "a..b"])
def test_a_run_id_that_would_leave_the_directory_is_refused(tmp_path, log_lines, run_id):
    base = tmp_path / "base"
    log_dir = base / "logs"
    shown = run_ranks(tmp_path, OutputOptions(log_dir=log_dir), run_id=run_id, ranks=1)
    assert shown == "[rank0]:hello 0\n"
    assert [p for p in base.rglob("*") if p != log_dir] == [], "nothing beside or inside --log-dir"
    assert [p for p in tmp_path.rglob("*.log")] == [] and not (tmp_path / "attempt_0").exists()
    refused = [r for r in log_lines() if r["event"] == "rank_log_file_refused"]
    assert len(refused) == 2 and all("run id" in r["reason"] for r in refused)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_rotation_keeps_the_newest_bytes_and_cuts_after_a_newline(tmp_path, any_umask):
    """LogFile itself: cut at the last newline that fits, a line longer than the cap cut at the cap,
    three rotated files kept, the oldest dropped, no descriptor left open."""
    fds_before = set(os.listdir("/proc/self/fd"))
    closer = Closer()
    path = LogPath(tmp_path / "logs", "t", 0, "0", "stdout")
    log = LogFile(path, max_bytes=10, closer=closer)
    directory = tmp_path / "logs" / "t" / "attempt_0" / "0"
    log.write(b"x" * 25 + b"\nab\n")  # one line longer than the cap: cut at 10 and 20
    assert _files(directory) == {"stdout.log": b"xxxxx\nab\n", "stdout.log.1": b"x" * 10, "stdout.log.2": b"x" * 10}
    log.write(b"cd\n")  # does not fit after "ab\n": a new file, the line whole
    log.write(b"ef\n")
    assert _files(directory)["stdout.log"] == b"cd\nef\n" and _files(directory)["stdout.log.1"] == b"xxxxx\nab\n"
    log.write(b"g" * 9 + b"\n")
    assert _files(directory) == {"stdout.log": b"g" * 9 + b"\n", "stdout.log.1": b"cd\nef\n",
                                 "stdout.log.2": b"xxxxx\nab\n", "stdout.log.3": b"x" * 10}
    log.write(b"hi\n" * 4)  # 12 bytes: three lines fit, the fourth starts the next file
    assert _files(directory) == {"stdout.log": b"hi\n", "stdout.log.1": b"hi\n" * 3,
                                 "stdout.log.2": b"g" * 9 + b"\n", "stdout.log.3": b"cd\nef\n"}
    assert ROTATED_KEEP == 3
    assert {oct(_mode(p)) for p in directory.iterdir()} == {"0o640"}
    log.close()
    assert closer.stop(5.0), "the closer thread closed the rotated files and ended"
    assert set(os.listdir("/proc/self/fd")) <= fds_before, "every file and directory descriptor is closed"


def test_rotation_moves_planted_links_and_never_writes_through_them(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    directory = tmp_path / "logs" / "t" / "attempt_0" / "0"
    directory.mkdir(parents=True)
    for n in (1, ROTATED_KEEP):
        (directory / f"stdout.log.{n}").symlink_to(victim)
    closer = Closer()
    log = LogFile(LogPath(tmp_path / "logs", "t", 0, "0", "stdout"), max_bytes=4, closer=closer)
    for _ in range(6):
        log.write(b"abc\n")
    log.close()
    assert closer.stop(5.0)
    assert victim.read_text() == "precious\n"
    assert _files(directory) == {f"stdout.log{s}": b"abc\n" for s in ("", ".1", ".2", ".3")}


def test_log_max_bytes_rotates_a_real_runs_files(supervise, tmp_path, any_umask):
    """The flag end to end: 500 lines of a real rank into 1000-byte files; the newest bytes are kept, every
    file ends at a newline, and the console still gets every line."""
    log_dir = tmp_path / "logs"
    run = supervise(["--nproc-per-node", "1", "--run-id", "rot", "--log-dir", str(log_dir), "--log-max-bytes", "1000"],
                    [sys.executable, str(CHATTY), "--lines", "500"])
    assert run.wait(EXIT_S) == 0, run.stderr[-3000:]
    directory = log_dir / "rot" / "attempt_0" / "0"
    files = _files(directory)
    assert sorted(files) == sorted(f"{s}.log{n}" for s in ("stdout", "stderr") for n in ("", ".1", ".2", ".3"))
    assert all(0 < len(data) <= 1000 and data.endswith(b"\n") for data in files.values())
    everything = "".join(f"out 0 {i}\n" for i in range(500)).encode()
    kept = b"".join(files[f"stdout.log{n}"] for n in (".3", ".2", ".1", ""))
    assert len(everything) > len(kept) > 3000 and everything.endswith(kept), "the newest bytes, in order"
    assert {oct(_mode(directory / name)) for name in files} == {"0o640"}
    said = [r["message"] for r in run.lines if r.get("event") == "rank_output" and r["stream"] == "stdout"]
    assert said == [f"out 0 {i}" for i in range(500)], "the console is not capped"


def test_a_negative_log_max_bytes_is_a_usage_error(tmp_path, capsys, log_lines):
    marker = tmp_path / "started"
    code = cli.main(["serve", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"), "--log-max-bytes", "-1", "--metrics-addr", "none",
                     "--dump-dir", str(tmp_path / "dumps"), "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert code == 64
    assert "--log-max-bytes -1: must be >= 0" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "logs").exists()
    with pytest.raises(UsageError):
        OutputOptions(log_dir=tmp_path, log_max_bytes=-1)
    assert OutputOptions(log_dir=tmp_path, log_max_bytes=0).log_max_bytes == 0  # 0: no cap
