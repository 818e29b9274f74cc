"""The relay's messages (supervisor/relay/protocol.py): a notice and a counts line read back as written, and a
line that is not one is refused, never taken for one."""

from __future__ import annotations

import json
import select

import pytest

from tp_supervise.supervisor import spec
from tp_supervise.supervisor.relay.engines import ADAPTERS
from tp_supervise.supervisor.relay.protocol import COUNT_KEYS, GAUGE_KEYS, Counts, Notice, parse_counts

FP, FP2 = "ab" * 16, "cd" * 16


def test_a_notice_reads_back_as_written():
    notice = Notice("20261201T000000Z-rank_exit", {FP: ("inc-1", "inc-2")}, frozenset({FP2}))
    line = notice.line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert Notice.parse(line) == notice
    assert Notice.parse(Notice().line()) == Notice()


def test_a_suspect_that_is_quarantined_is_not_a_suspect():
    assert Notice.parse(Notice(None, {FP: ("inc-1",)}, frozenset({FP, FP2})).line()).suspects == {FP2}


@pytest.mark.parametrize("record", [
    {"version": 2, "incident": None, "fingerprints": {}},
    {"version": 1, "incident": 7, "fingerprints": {}},
    {"version": 1, "incident": "x" * 500, "fingerprints": {}},
    {"version": 1, "incident": "two\nlines", "fingerprints": {}},
    {"version": 1, "incident": None, "fingerprints": {FP: "inc-1"}},
    {"version": 1, "incident": None},
    [1, 2],
])
def test_a_line_that_is_not_a_notice_is_refused(record):
    with pytest.raises(ValueError):
        Notice.parse(json.dumps(record).encode())
    with pytest.raises(ValueError):
        Notice.parse(b"\xff{")


def test_a_counts_line_reads_back_and_fits_one_pipe_write():
    counts = Counts()
    changes: list[int] = []
    counts.on_change = lambda: changes.append(1)
    counts.add("requests", 3)
    counts.set("held", 2)
    assert len(changes) == 2
    line = counts.line(pid=1234)
    assert len(line) < select.PIPE_BUF
    pid, values, gauges = parse_counts(line)
    assert (pid, values["requests"], gauges) == (1234, 3, {"held": 2})
    assert set(values) == set(COUNT_KEYS) and set(gauges) == set(GAUGE_KEYS)
    for bad in (b"", b"{}", b'{"version": 1}', b'{"version": 2, "pid": 1}', b"[1]", b'{"version": 1, "pid": "x"}'):
        with pytest.raises(ValueError):
            parse_counts(bad)


def test_the_adapters_are_the_engines_relay_accepts():
    assert set(ADAPTERS) == set(spec.RELAY_ENGINES)
