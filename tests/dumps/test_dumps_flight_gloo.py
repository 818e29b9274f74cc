"""Real gloo, two ranks: the flight recorder shows rank 1 missing from the collective rank 0 entered.

One process pair serves both phases (torch import costs seconds per process):
1. rank 1 skips the fourth all_reduce: collected traces name it missing;
2. rank 1 is then SIGSTOPped: the hang bundle names it stopped, rank 0's
   stacks show the collective, rank 1's stacks are present.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tp_supervise.dumps import flight_capture as flight
from tp_supervise.dumps.bundle import SUMMARY_JSON, BundleWriter
from tp_supervise.dumps.capture import find_pyspy
from tp_supervise.dumps.incident import write_incident
from tp_supervise.supervisor.processes.spawn import HOOK_DIR
from tp_supervise.supervisor.rank import flight as rank_flight
from tp_supervise.supervisor.rank.net import free_port

pytestmark = pytest.mark.e2e

GLOO_RANK = Path(__file__).resolve().parents[1] / "fakes" / "gloo_rank.py"  # shared with bench/bench_dumps.py
START_TIMEOUT_S = 90.0
FR_WAIT_S = 20.0


def stale_socket(path: str) -> None:
    """A socket file nobody listens on (what a crashed rank leaves behind)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()


def test_flight_recorder_names_rank_missing_from_collective(fake_ranks, tmp_path):
    ranks = fake_ranks(2)
    port = free_port()
    stale_socket(rank_flight.socket_path(ranks.run_dir, 0))
    for r in range(2):
        env = ranks.env(r)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HOOK_DIR), env.get("PYTHONPATH", "")) if p)
        env.update(rank_flight.rank_env(ranks.run_dir, r, environ=env))
        ranks.procs[r] = subprocess.Popen(
            [sys.executable, str(GLOO_RANK), str(r), "2", str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
    ranks.wait_parked(START_TIMEOUT_S)

    # Phase 1: rank 0 blocks in all_reduce #4 (gloo), rank 1 never enters it.  torch's recorder retires an entry
    # a moment after its collective returned: until rank 0's #3 is retired, #3 reads as the one it waits in.
    end = time.monotonic() + FR_WAIT_S
    while True:
        traces, errors = flight.collect_detailed(ranks.targets(), ranks.run_dir, 5.0)
        findings = flight.analyze(traces)
        settled = 0 in findings.in_flight and findings.in_flight[0].seq == 4
        if (findings.missing and settled) or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert set(traces) == {0, 1}, errors
    assert dict(findings.last_seq["0"]) == {0: 4, 1: 3}
    m = findings.missing[0]
    assert (m.seq, m.op, m.desc, m.entered, m.missing) == (4, "all_reduce", "64x256 float32", (0,), (1,))
    assert findings.in_flight[0].seq == 4 and not findings.mismatches

    writer = BundleWriter(tmp_path / "dumps", keep=5, max_bytes=0)
    res = write_incident(
        writer, reason="hang", run_id=ranks.run_id, targets=ranks.targets(), run_dir=ranks.run_dir, deadline_s=8.0
    )
    s = json.loads((res.path / SUMMARY_JSON).read_text())
    assert s["culprit_ranks"] == [1] and s["class"] == "non_communication_hang"
    assert "skip_the_collective" in s["verdict"] and "rank 0 waits in all_reduce" in s["verdict"]
    assert s["flight_recorder"]["missing"][0]["missing"] == [1]
    assert any("rank 1 never entered all_reduce seq 4" in n for n in s["notes"])
    assert sorted(p.name for p in (res.path / "fr").iterdir()) == ["rank-0", "rank-1"]
    assert (res.path / "fr-json" / "rank-0.json").is_file() and (res.path / "fr-json" / "rank-1.json").is_file()
    # PyTorch's analyzer reads the bundle's fr/ as it reads torch's own dumps: every rank answered.
    frtrace = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(res.path / "fr")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert frtrace.returncode == 0, frtrace.stderr[-3000:]

    # Phase 2: rank 1 SIGSTOPped while rank 0 waits in the collective.
    ranks.stop(1)
    res = write_incident(
        writer, reason="hang", run_id=ranks.run_id, targets=ranks.targets(), run_dir=ranks.run_dir, deadline_s=8.0
    )
    s = json.loads((res.path / SUMMARY_JSON).read_text())
    assert s["culprit_ranks"] == [1] and s["class"] == "stopped"
    assert s["ranks"]["1"]["state"] == "T" and s["verdict"].startswith("rank 1 is stopped")
    assert "rank 0 waits in all_reduce" in s["verdict"]
    assert "all_reduce" in (res.path / "stacks" / "rank-0.txt").read_text()
    rank1 = (res.path / "stacks" / "rank-1.txt").read_text()
    if find_pyspy() is not None:
        assert "skip_the_collective" in rank1  # py-spy --nonblocking reads a stopped rank
    else:
        assert "stopped" in rank1
    assert "stopped" in s["flight_recorder"]["errors"]["1"]
