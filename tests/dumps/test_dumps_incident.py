"""write_incident end to end on fake ranks: the bundle a supervisor would leave."""

from __future__ import annotations

import json

import pytest

from tp_supervise.dumps.bundle import SUMMARY_JSON, BundleWriter
from tp_supervise.dumps.capture import ENV_PYSPY, find_pyspy
from tp_supervise.dumps.incident import write_incident

DEADLINE_S = 8.0  # generous; bench/bench_dumps.py measures the real figure
needs_pyspy = pytest.mark.skipif(find_pyspy() is None, reason="py-spy not installed")


def incident(ranks, writer, reason="hang", **kw):
    return write_incident(
        writer,
        reason=reason,
        run_id=ranks.run_id,
        targets=ranks.targets(),
        run_dir=ranks.run_dir,
        deadline_s=DEADLINE_S,
        **kw,
    )


def load(path):
    return json.loads((path / SUMMARY_JSON).read_text())


@pytest.fixture
def writer(tmp_path):
    return BundleWriter(tmp_path / "dumps", keep=20, max_bytes=0)


@needs_pyspy
def test_rank_stuck_in_python_function(fake_ranks, writer):
    ranks = fake_ranks(4)
    ranks.start({0: "collective", 1: "python", 2: "collective", 3: "collective"})
    res = incident(ranks, writer, extra_summary={"watchdog": {"kind": "hard"}}, extra_files={"events.log": "e1\n"})
    assert res.ok and res.error is None
    s = load(res.path)
    assert s["reason"] == "hang" and s["run_id"] == ranks.run_id
    assert s["culprit_ranks"] == [1] and s["class"] == "non_communication_hang"
    assert "stuck_in_user_code" in s["verdict"] and "ranks 0,2,3 wait in all_reduce #4" in s["verdict"]
    assert set(s["ranks"]) == {"0", "1", "2", "3"}
    assert s["ranks"]["1"]["stack_group"] == "B" and s["ranks"]["0"]["stack_group"] == "A"
    assert s["watchdog"] == {"kind": "hard"} and (res.path / "events.log").read_text() == "e1\n"
    assert "stuck_in_user_code" in (res.path / "stacks" / "rank-1.txt").read_text()
    assert "wait_in_all_reduce" in (res.path / "stacks" / "rank-0.txt").read_text()
    evidence = json.loads((res.path / "evidence.json").read_text())
    assert evidence["ranks"]["1"]["heartbeat"]["phase"] == "user_code"
    assert s["flight_recorder"]["collected"] == []  # fake ranks serve no flight recorder
    assert "no worker server socket" in s["flight_recorder"]["errors"]["0"]
    assert res.samples is not None and set(res.samples.progress) == {0, 1, 2, 3}


def test_sigstopped_rank_with_fallback_only(fake_ranks, writer, monkeypatch):
    """py-spy made unavailable: the stopped rank is named, its peers' stacks come from faulthandler."""
    monkeypatch.setenv(ENV_PYSPY, "/nonexistent")
    ranks = fake_ranks(3)
    ranks.start({0: "collective", 1: "python", 2: "collective"})
    ranks.stop(1)
    res = incident(ranks, writer)
    s = load(res.path)
    assert s["culprit_ranks"] == [1] and s["class"] == "stopped"
    assert s["ranks"]["1"]["state"] == "T" and "stopped" in s["verdict"]
    assert s["verdict"].startswith("rank 1 is stopped")
    assert "wait_in_all_reduce" in (res.path / "stacks" / "rank-0.txt").read_text()
    assert "cannot run its signal handler" in (res.path / "stacks" / "rank-1.txt").read_text()
    assert s["capture"]["pyspy"] is None


@needs_pyspy
def test_sigstopped_rank_stacks_with_pyspy(fake_ranks, writer):
    ranks = fake_ranks(2)
    ranks.start({0: "collective", 1: "python"})
    ranks.stop(1)
    s = load(incident(ranks, writer).path)
    assert s["culprit_ranks"] == [1] and s["ranks"]["1"]["state"] == "T"
    assert s["ranks"]["1"]["stack_method"] == "py-spy --nonblocking"
    assert "stuck_in_user_code" in s["ranks"]["1"]["stack_signature"]


def test_every_rank_has_python_stacks_via_fallback(fake_ranks, writer, monkeypatch):
    monkeypatch.setenv(ENV_PYSPY, "/nonexistent")
    ranks = fake_ranks(4)
    ranks.start({0: "collective", 1: "collective", 2: "wrong", 3: "collective"})
    res = incident(ranks, writer)
    s = load(res.path)
    for r in range(4):
        assert s["ranks"][str(r)]["stack_method"] == "faulthandler"
        assert "wait_in_all_reduce" in (res.path / "stacks" / f"rank-{r}.txt").read_text()
    assert s["culprit_ranks"] == [2] and s["class"] == "communication_hang"
    assert "all_gather #4 [32x8 float16]" in s["verdict"]


def test_dead_rank(fake_ranks, writer):
    ranks = fake_ranks(3)
    ranks.start({0: "collective", 1: "collective", 2: "collective"})
    ranks.kill(1)
    s = load(incident(ranks, writer, reason="rank_exit").path)
    assert s["culprit_ranks"] == [1] and s["class"] == "dead"
    assert s["verdict"].startswith("rank 1 died (killed by SIGKILL)")
    assert s["ranks"]["1"]["exit"]["signal"] == "SIGKILL"


def test_on_demand_leaves_ranks_running(fake_ranks, writer):
    ranks = fake_ranks(2)
    ranks.start({0: "idle", 1: "idle"})
    res = incident(ranks, writer, reason="on_demand")
    s = load(res.path)
    assert res.path.name.endswith("-on_demand") and s["verdict"].startswith("on-demand snapshot: ")
    assert s["culprit_ranks"] == []
    assert all(p.poll() is None for p in ranks.procs.values())


def test_unwritable_dump_dir_never_raises(fake_ranks, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    ranks = fake_ranks(1)
    ranks.start({0: "python"})
    res = incident(ranks, BundleWriter(blocker / "dumps", keep=3, max_bytes=0))
    assert not res.ok and res.path is None and "bundle not written" in res.error
    assert res.diagnosis is not None and res.diagnosis.culprit_ranks == []
