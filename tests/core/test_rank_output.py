"""The ranks' stdout and stderr (supervisor/processes/output_pump.py, issue 13): pipes read by one pump thread.

Real supervisors, real rank processes printing through real pipes: JSON logs stay one JSON object per
line while ranks print, console lines carry ``[rank<N>]:``, ``--log-dir`` files have torchrun's layout,
``--redirects``/``--tee``/``--local-ranks-filter`` route as torchrun does, a rank that raises leaves its
traceback in the ``rank_exit`` bundle, a flood of output does not delay fault detection, and restarts
leak no pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tp_supervise.supervisor.processes.spawn import RankSpec, RunContext, spawn
from tp_supervise.supervisor.processes.output_pump import RankOutput
from tp_supervise.supervisor.spec import OutputOptions

CHATTY = ROOT / "tests" / "fakes" / "chatty_rank.py"
EXIT_S = 60


def chatty(*args: str) -> list[str]:
    return [sys.executable, str(CHATTY), *args]


def console(args: list[str]) -> list[str]:
    return ["--log-format", "console", *args]  # the fixture's --log-format json comes first: this one wins


def run_dir_of(log_dir: Path) -> Path:
    [run] = list(log_dir.iterdir())
    return run


def test_json_logs_parse_line_by_line_while_ranks_print(supervise):
    run = supervise(["--nproc-per-node", "2"], chatty("--lines", "500", "--partial", "--bad-bytes", "--progress"))
    assert run.wait(EXIT_S) == 0, run.stderr[-3000:]
    assert run.stdout == "", "nothing raw reaches stdout in JSON mode"
    records = []
    for line in run.stderr.splitlines():
        record = json.loads(line)  # every line of the log stream is JSON
        assert record["level"] and record["message"] is not None, line
        records.append(record)
    out = [r for r in records if r.get("event") == "rank_output"]
    for rank in (0, 1):
        mine = [r for r in out if r["rank"] == rank and r["local_rank"] == rank]
        stdout = [r["message"] for r in mine if r["stream"] == "stdout"]
        stderr = [r["message"] for r in mine if r["stream"] == "stderr"]
        assert stdout[:500] == [f"out {rank} {i}" for i in range(500)]
        assert stderr[:500] == [f"err {rank} {i}" for i in range(500)]
        assert f"bad \ufffd\ufffd bytes {rank}" in stdout  # undecodable bytes replaced, never fatal
        assert f"progress {rank} 100%" in stderr  # what a terminal shows of a line redrawn with \r
        assert f"prompt {rank}> " in stdout  # a partial line, forwarded after its idle time
        assert "" not in stdout[500:], "the newline after a forwarded partial line is not a line of its own"


def test_console_lines_carry_the_rank_and_never_mix_with_log_lines(supervise):
    run = supervise(console(["--nproc-per-node", "2"]), chatty("--lines", "300"))
    assert run.wait(EXIT_S) == 0, run.stderr[-3000:]
    out, err = run.stdout.splitlines(), run.stderr.splitlines()
    for rank in (0, 1):
        assert [l for l in out if l.startswith(f"[rank{rank}]:")] == [f"[rank{rank}]:out {rank} {i}" for i in range(300)]
        assert [l for l in err if l.startswith(f"[rank{rank}]:")] == [f"[rank{rank}]:err {rank} {i}" for i in range(300)]
    assert all(l.startswith("[rank") for l in out), "rank stdout only on stdout"
    mixed = [l for l in err if "[rank" in l and not l.startswith("[rank")]
    assert not mixed, mixed[:5]
    assert any("rank started" in l for l in err), "the supervisor's own log lines are on stderr"


def test_log_dir_has_one_file_per_rank_and_stream_per_attempt(supervise, tmp_path):
    log_dir = tmp_path / "logs"
    run = supervise(["--nproc-per-node", "2", "--log-dir", str(log_dir), "--max-restarts", "1"],
                    chatty("--lines", "20", "--linger", "0.5", "--exit", "3"))
    assert run.wait(EXIT_S) == 80, run.stderr[-3000:]
    run_dir = run_dir_of(log_dir)
    assert run_dir.name == run.run_id()
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempt_0", "attempt_1"]
    for attempt in ("attempt_0", "attempt_1"):
        for rank in (0, 1):
            files = run_dir / attempt / str(rank)
            assert (files / "stdout.log").read_text() == "".join(f"out {rank} {i}\n" for i in range(20))
            assert (files / "stderr.log").read_text() == "".join(f"err {rank} {i}\n" for i in range(20))
    teed = [r for r in run.lines if r.get("event") == "rank_output"]
    assert len(teed) == 2 * 2 * 2 * 20, "with --log-dir alone both streams are teed to the console too"


def test_redirects_keep_streams_off_the_console_and_tee_shows_them(supervise, tmp_path):
    log_dir = tmp_path / "logs"
    run = supervise(console(["--nproc-per-node", "2", "--log-dir", str(log_dir), "--redirects", "1", "--tee", "0:2"]),
                    chatty("--lines", "10"))
    assert run.wait(EXIT_S) == 0, run.stderr[-3000:]
    assert "out " not in run.stdout, "stdout is redirected: files only"
    shown = [l for l in run.stderr.splitlines() if l.startswith("[rank")]
    assert [l for l in shown if l.startswith("[rank0]:")] == [f"[rank0]:err 0 {i}" for i in range(10)]
    assert [l for l in shown if l.startswith("[rank1]:")] == [f"[rank1]:err 1 {i}" for i in range(10)]
    attempt = run_dir_of(log_dir) / "attempt_0"
    assert (attempt / "0" / "stdout.log").read_text().splitlines()[-1] == "out 0 9"
    assert (attempt / "1" / "stdout.log").read_text().splitlines()[-1] == "out 1 9"
    assert (attempt / "0" / "stderr.log").read_text().splitlines()[-1] == "err 0 9"  # teed: file and console
    assert not (attempt / "1" / "stderr.log").exists(), "rank 1's stderr is neither redirected nor teed"


def test_local_ranks_filter_limits_the_console_not_the_files(supervise, tmp_path):
    log_dir = tmp_path / "logs"
    run = supervise(console(["--nproc-per-node", "2", "--local-ranks-filter", "1", "--log-dir", str(log_dir)]),
                    chatty("--lines", "10"))
    assert run.wait(EXIT_S) == 0, run.stderr[-3000:]
    assert "[rank0]" not in run.stdout + run.stderr
    assert run.stdout.splitlines() == [f"[rank1]:out 1 {i}" for i in range(10)]
    attempt = run_dir_of(log_dir) / "attempt_0"
    assert (attempt / "0" / "stdout.log").read_text().count("\n") == 10


@pytest.mark.parametrize("args, needle", [
    (["--redirects", "3"], "give --log-dir"),
    (["--tee", "1"], "give --log-dir"),
    (["--log-dir", "{tmp}", "--redirects", "4"], "0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
    (["--log-dir", "{tmp}", "--tee", "0:1,x:2"], "LOCAL_RANK:VALUE"),
    (["--log-dir", "{tmp}", "--tee", "2:1"], "local rank(s) [2]"),
    (["--local-ranks-filter", "0,a"], "comma-separated local ranks"),
    (["--local-ranks-filter", "5"], "local rank(s) [5]"),
    (["--tree", "--local-ranks-filter", "0"], "cannot be split by local rank"),
    (["--log-dir", "/proc/no-such-dir/logs"], "--log-dir"),
])
def test_bad_output_flags_exit_64_before_anything_starts(supervise, tmp_path, args, needle):
    marker = tmp_path / "started"
    args = [a.replace("{tmp}", str(tmp_path / "logs")) for a in args]
    run = supervise(["--nproc-per-node", "2", *args], [sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert run.wait(EXIT_S) == 64, run.stderr[-2000:]
    assert needle in run.stderr, run.stderr[-2000:]
    assert not marker.exists()


def test_a_rank_that_raises_leaves_its_traceback_in_the_bundle(supervise, tmp_path):
    run = supervise(["--nproc-per-node", "2"], chatty("--lines", "5", "--die-after", "0.5", "--raise-on", "1"),
                    env={"CHATTY_DEATH_FILE": str(tmp_path / "death")})
    assert run.wait(EXIT_S) == 80, run.stderr[-3000:]
    [bundle] = [b for b in run.bundles() if "rank_exit" in b.name]
    tail = (bundle / "logs" / "rank-1.txt").read_text()
    assert "Traceback (most recent call last):" in tail and "RuntimeError: boom 42" in tail
    assert tail.startswith("err 1 0\n"), "the tail is the rank's raw stderr"
    summary = json.loads((bundle / "summary.json").read_text())
    assert summary["error"]["message"] == "RuntimeError: boom 42"
    assert summary["error"]["source"] == "stderr"
    assert "Traceback" in summary["error"]["traceback"] and "main()" in summary["error"]["traceback"]
    assert summary["verdict"].startswith("rank 1 ") and summary["verdict"].endswith(": RuntimeError: boom 42")
    assert not (bundle / "logs" / "rank-0.txt").exists(), "only the failing rank's tail"
    shown = subprocess.run([sys.executable, "-m", "tp_supervise.supervisor.cli", "analyze", str(bundle)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "RuntimeError: boom 42" in shown.stdout and "exception of rank 1 (from its stderr)" in shown.stdout
    assert 'raise RuntimeError("boom 42")' in shown.stdout


def test_tree_mode_labels_the_launcher_and_keeps_its_stderr(supervise):
    code = "import sys; print('launching'); raise SystemExit('launcher gave up: no GPU')"
    run = supervise(console(["--tree", "--nproc-per-node", "1"]), [sys.executable, "-c", code])
    assert run.wait(EXIT_S) == 80, run.stderr[-3000:]
    assert "[launcher]:launching" in run.stdout.splitlines()
    assert "[launcher]:launcher gave up: no GPU" in run.stderr.splitlines()
    [bundle] = [b for b in run.bundles() if "rank_exit" in b.name]
    assert (bundle / "logs" / "launcher.txt").read_text() == "launcher gave up: no GPU\n"


def _log_time(line: str) -> float:
    return datetime.fromisoformat(line.split(" ", 1)[0].replace("Z", "+00:00")).timestamp()


def test_a_flood_of_output_does_not_delay_fault_detection(supervise, tmp_path):
    """Rank 0 writes 50 MiB to stdout as fast as it can while rank 1 dies: the death is seen at once,
    the flood reaches the console whole, and the supervisor exits within the usual bounds."""
    death = tmp_path / "death"
    run = supervise(console(["--nproc-per-node", "2", "--kill-grace", "2"]),
                    chatty("--flood-mb", "50", "--die-after", "0.5", "--raise-on", "1"),
                    env={"CHATTY_DEATH_FILE": str(death)})
    assert run.wait(EXIT_S) == 80, run.stderr[-3000:]
    died_at = float(death.read_text())
    [exited] = [line for line in run.stderr.splitlines() if "rank 1 (pid" in line and "exited" in line][:1]
    latency = _log_time(exited) - died_at
    assert latency < 2.0, f"the death was logged {latency:.2f} s after it happened"
    flood = run.stdout.splitlines()
    odd = [line for line in flood if line != flood[0]]
    assert len(flood) > 1000 and not odd, f"flood lines arrive whole: {len(odd)} do not, e.g. {odd[:2]}"
    assert flood[0] == "[rank0]:flood 0 " + "x" * 191


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_pipes_are_closed_across_restarts_and_at_close(tmp_path):
    """The pump in this process, real rank processes: twenty starts of the same two ranks leave no pipe
    open, the stderr tail follows the newest start, and close() returns in bounded time."""
    baseline = _open_fds()
    death_r, death_w = os.pipe()
    ctx = RunContext(run_id="t", run_dir=tmp_path, heartbeat_path=tmp_path / "hb", death_fd=death_r,
                     supervisor_pid=os.getpid(), world_size=2, nproc_per_node=2, node_rank=0,
                     master_addr="127.0.0.1", master_port=1, zero_code_hook=False)
    out, err = open(tmp_path / "out", "w"), open(tmp_path / "err", "w")
    pump = RankOutput(OutputOptions(log_dir=tmp_path / "logs"), "console", console_out=out, console_err=err)
    before = _open_fds()
    try:
        for attempt in range(20):
            handles = []
            for slot in (0, 1):
                code = f"import sys; print('hello {attempt}'); print('bye {attempt}', file=sys.stderr)"
                handles.append(spawn(RankSpec(slot, slot, (sys.executable, "-c", code), {}), ctx, pump=pump))
            for h in handles:
                h.popen.wait(30)
            tail = pump.stderr_tail(1)
            assert tail.wait_drained(5.0)
            assert tail.data() == f"bye {attempt}\n".encode()
        assert _open_fds() <= before + 2, "at most the newest attempt's log files are still open"
    finally:
        started = time.monotonic()
        pump.close()
        closed_in = time.monotonic() - started
        os.close(death_r), os.close(death_w)
    assert closed_in < 1.0
    out.close(), err.close()
    assert _open_fds() <= baseline, "close() closed every pipe, file and the pump's own descriptors"
    assert (tmp_path / "out").read_text().count("[rank0]:hello") == 20
    assert (tmp_path / "logs" / "t" / "attempt_19" / "1" / "stderr.log").read_text() == "bye 19\n"


def test_json_rank_output_is_not_filtered_by_the_supervisors_log_level(supervise):
    """--log-level sets the supervisor's verbosity; the ranks' lines reach the stream whatever it is."""
    run = supervise(["--nproc-per-node", "1", "--log-level", "warning"],
                    [sys.executable, "-c", "print('hello from the rank', flush=True)"])
    assert run.wait(60) == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in (run.stdout + run.stderr).splitlines() if line.startswith("{")]
    said = [line for line in lines if line.get("event") == "rank_output"]
    assert [line["message"] for line in said] == ["hello from the rank"], lines
    assert all(line["level"] != "info" for line in lines if line.get("event") != "rank_output")
