"""The supervisor's own stdout/stderr writer (supervisor/logs.py, ``Sink``; docs/logs.md, "A reader that
stops"): real pipes, real threads.  The supervisor's lines never wait for a reader that stopped (past the
queue they are dropped, and counted when the reader is back); the ranks' lines wait for room and are never
dropped; a reader that went away costs nothing."""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import sys
import textwrap
import threading
import time

from tests.conftest import ROOT
from tp_supervise.supervisor import logs

LINES = 2000
PAD = "x" * 200

CHILD = textwrap.dedent(
    f"""
    import sys, time
    import structlog
    from tp_supervise.supervisor import logs

    logs.SINK_MAX_BYTES = 64 << 10
    logs.configure("json")  # stderr: a pipe the test does not read yet
    log = structlog.get_logger("t")
    started = time.monotonic()
    for i in range({LINES}):
        log.info("filler line", i=i, pad="{PAD}")
    print(f"logged {{time.monotonic() - started:.3f}}", flush=True)
    sys.stdin.read()  # until the test reads stderr
    logs.drain(30)
    log.info("last line")
    """
)


def logged_against_an_unread_stderr(script: str, within_s: float) -> str:
    """Run ``script``, which logs to a stderr pipe nobody reads yet and then prints ``logged <seconds>``: that
    must come within ``within_s`` (generous: nothing waited for the pipe); then its stderr, read to the end."""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert select.select([proc.stdout], [], [], 30)[0], "logging waited for the unread stderr"
        said = proc.stdout.readline()
        assert said.startswith("logged ") and float(said.split()[1]) < within_s, said
        _, err = proc.communicate("", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    return err


def test_own_lines_never_wait_for_a_stopped_reader_and_the_dropped_ones_are_counted():
    err = logged_against_an_unread_stderr(CHILD, within_s=10.0)  # ~600 KB against a 64 KiB pipe and queue
    lines = [json.loads(line) for line in err.splitlines()]
    filler = [line["i"] for line in lines if line["event"] == "filler_line"]
    dropped = [line for line in lines if line["event"] == "log_lines_dropped"]
    lost = sum(line["lines"] for line in dropped)  # said each time the writer had room again
    assert dropped and all(line["fd"] == 2 for line in dropped), dropped
    assert 0 < lost < LINES and len(filler) + lost == LINES, (len(filler), dropped)
    assert filler == sorted(filler) and filler[0] == 0, "what was kept is in order, the first lines first"
    assert lines[-1]["event"] in ("last_line", "log_lines_dropped"), lines[-1]  # said once the queue emptied
    assert [line["event"] for line in lines].count("last_line") == 1


def test_rank_lines_wait_for_room_and_the_supervisors_own_still_get_through(monkeypatch):
    monkeypatch.setattr(logs, "SINK_MAX_BYTES", 64 << 10)
    r, w = os.pipe()
    sink = logs.Sink(io.StringIO(), w)
    kept: list[bool] = []
    ranks = threading.Thread(
        target=lambda: kept.extend(sink.put(f"rank line {i} {PAD}\n", wait=True) for i in range(LINES)), daemon=True
    )
    got = bytearray()
    try:
        ranks.start()
        time.sleep(1.0)
        assert ranks.is_alive(), "400 KB of rank lines went into a 64 KiB pipe and a 64 KiB queue without waiting"
        started = time.monotonic()
        assert sink.put("own line\n"), "the supervisor's line found no room beside the waiting rank lines"
        assert time.monotonic() - started < 0.5
        reader = threading.Thread(target=lambda: [got.extend(c) for c in iter(lambda: os.read(r, 1 << 16), b"")],
                                  daemon=True)
        reader.start()
        ranks.join(30)
        assert not ranks.is_alive() and all(kept) and len(kept) == LINES
        assert sink.drain(10.0)
    finally:
        os.close(w)
    reader.join(10)
    os.close(r)
    text = got.decode().splitlines()
    assert "own line" in text
    numbers = [int(line.split()[2]) for line in text if line.startswith("rank line ")]
    assert numbers == list(range(LINES)), "every rank line, once, in order"


def test_a_reader_that_went_away_costs_nothing():
    r, w = os.pipe()
    os.close(r)
    sink = logs.Sink(io.StringIO(), w)
    try:
        sink.put("into a closed pipe\n")
        assert sink.drain(5.0)
        started = time.monotonic()
        assert not sink.put("again\n") and not sink.put("a rank line\n", wait=True)
        assert time.monotonic() - started < 0.5
    finally:
        os.close(w)


SAME_PIPE = textwrap.dedent(
    f"""
    import sys, threading
    import structlog
    from tp_supervise.supervisor import logs

    logs.configure("json")  # stderr and stdout: one pipe (2>&1), read late
    out = logs.sink_for(sys.stdout)
    assert out is logs.sink_for(sys.stderr)

    def ranks():
        for i in range({LINES}):
            out.put(f"[rank0]:rank line {{i}} {PAD}\\n", wait=True)

    thread = threading.Thread(target=ranks)
    thread.start()
    log = structlog.get_logger("t")
    for i in range({LINES}):
        log.info("own line", i=i, pad="{PAD}")
    thread.join()
    """
)


def test_stdout_and_stderr_on_one_pipe_never_cut_a_line():
    """``2>&1`` or one pipe to a log agent: the supervisor's JSON lines and the ranks' lines share one writer,
    so a reader that comes late still gets every line whole."""
    proc = subprocess.Popen([sys.executable, "-c", SAME_PIPE], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.0)  # both streams' lines pile up behind a full pipe
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-2000:]
    own, ranks = [], []
    for line in out.splitlines():
        if line.startswith("[rank0]:"):
            _, _, number, pad = line.split(" ")
            assert pad == PAD, line[:120]
            ranks.append(int(number))
        else:
            record = json.loads(line)  # a cut line is no JSON
            assert record["pad"] == PAD
            own.append(record["i"])
    assert own == list(range(LINES)) and ranks == list(range(LINES))


def test_text_the_stream_cannot_encode_is_escaped_and_the_writer_goes_on():
    r, w = os.pipe()
    sink = logs.Sink(io.TextIOWrapper(io.BytesIO(), encoding="ascii"), w)
    try:
        assert sink.put("caf\u00e9 \ufffd\n") and sink.put("next\n")
        assert sink.drain(5.0)
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as reader:
        assert reader.read() == b"caf\\xe9 \\ufffd\nnext\n"


UNFORMATTABLE = textwrap.dedent(
    """
    import logging, os, sys, time
    from tp_supervise.supervisor import logs

    logs.configure("json")  # stderr: a pipe the test does not read yet, filled first
    os.set_blocking(2, False)
    try:
        while True:
            os.write(2, b"\\n" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(2, True)
    started = time.monotonic()
    logging.getLogger("some.library").warning("%d requests", "many")  # cannot be formatted
    print(f"logged {time.monotonic() - started:.3f}", flush=True)
    sys.stdin.read()
    """
)


def test_a_record_that_cannot_be_formatted_is_one_line_of_ours_and_waits_for_no_reader():
    """logging's own handleError writes a traceback straight to stderr, where a reader that stopped would hold
    the thread that logged: the supervisor's handler says it in one line, queued like every other."""
    err = logged_against_an_unread_stderr(UNFORMATTABLE, within_s=5.0)
    records = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    [record] = records
    assert record["event"] == logs.UNFORMATTABLE_EVENT and record["level"] == "error", record
    assert "some.library" in record["message"] and "'%d requests'" in record["message"], record
