"""An engine's own multi-node launch under one supervisor per node: the bad launches an operator makes are
refused on every node, in seconds, naming what to change, before the engine starts (docs/multinode.md, "An
engine's own multi-node launch").  The launcher lines are vLLM's; the refusals come before it would run, so
this interpreter stands in for vLLM's (its versions are read the same way)."""

from __future__ import annotations

import sys
import time

import pytest

from tests.conftest import marked_pids
from tp_supervise.supervisor.rank.net import free_port

pytestmark = pytest.mark.e2e

EXIT_TIMEOUT_S = 60


def vllm_line(port: int, node_rank: int, model: str = "/models/tiny", nnodes: int = 2) -> list[str]:
    line = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--tensor-parallel-size", "2",
            "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
            "--master-port", str(port)]
    return line + (["--headless"] if node_rank else ["--port", str(free_port())])


def start(supervise, tmp_path, lines, envs=None):
    return [
        supervise(["--tree", "--kill-grace", "2", "--rendezvous-timeout", "120"], line,
                  env=(envs or {}).get(i), dump_dir=tmp_path / f"dumps-{i}")
        for i, line in enumerate(lines)
    ]


def assert_refused(supervise, runs, *needles, within_s=None):
    t0 = time.monotonic()
    codes = [run.wait(EXIT_TIMEOUT_S) for run in runs]
    took = time.monotonic() - t0
    assert codes == [64] * len(runs), [run.stderr[-2000:] for run in runs]
    for run in runs:
        for needle in needles:
            assert needle in run.stderr, run.stderr[-2000:]
        assert not run.events("launcher started") and not run.events("rank started"), "something was started"
    if within_s is not None:
        assert took < within_s, f"refused after {took:.1f} s"
    assert marked_pids(supervise.mark) == []


@pytest.mark.slow  # ~12 s of real time: 8 s of nothing listening, 3 s standing in
def test_node_rank_1_on_both_nodes_is_named_as_a_duplicate_on_both_within_30_s(supervise, tmp_path):
    """Nobody is node 0: the node that holds --master-addr says so after a few seconds of nothing listening,
    and tells the other node, which dials it, that it is a duplicate."""
    port = free_port()
    runs = start(supervise, tmp_path, [vllm_line(port, 1), vllm_line(port, 1)])
    assert_refused(supervise, runs, "duplicate --node-rank 1", within_s=30)


def test_a_model_path_that_differs_is_refused_naming_the_field_and_both_values(supervise, tmp_path):
    port = free_port()
    runs = start(supervise, tmp_path, [vllm_line(port, 0), vllm_line(port, 1, model="/models/other")])
    assert_refused(supervise, runs, "job.model: node 0: '/models/tiny'; node 1: '/models/other'")


@pytest.mark.slow
def test_an_engine_version_that_differs_is_refused_before_the_engine_starts(supervise, tmp_path):
    """Node 1's interpreter finds another vLLM first on its path (a stale install shadowing the image's)."""
    shadow = tmp_path / "site"
    (shadow / "vllm-0.31.0.dist-info").mkdir(parents=True)
    (shadow / "vllm-0.31.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.0\n")
    port = free_port()
    runs = start(supervise, tmp_path, [vllm_line(port, 0), vllm_line(port, 1)], envs={1: {"PYTHONPATH": str(shadow)}})
    assert_refused(supervise, runs, "engine.vllm: node 0:", "node 1: 'vllm 0.31.0'")


@pytest.mark.slow
def test_nnodes_that_differ_are_refused_on_every_node(supervise, tmp_path):
    port = free_port()
    runs = start(supervise, tmp_path, [vllm_line(port, 0), vllm_line(port, 1, nnodes=3)])
    # node 1 says a world of 2 over 3 nodes: its own flags cannot be
    assert runs[1].wait(EXIT_TIMEOUT_S) == 64 and "does not divide its world of 2" in runs[1].stderr
    runs[0].proc.kill()
    runs[0].wait(EXIT_TIMEOUT_S)
    port = free_port()
    line0, line1 = vllm_line(port, 0), vllm_line(port, 1)
    line0[line0.index("--tensor-parallel-size") + 1] = line1[line1.index("--tensor-parallel-size") + 1] = "4"
    line1[line1.index("--nnodes") + 1] = "4"
    runs = start(supervise, tmp_path / "b", [line0, line1])
    assert_refused(supervise, runs, "nnodes")


@pytest.mark.slow  # its subject is an 8 s rendezvous timeout
def test_an_unreachable_master_address_is_named_with_what_was_tried(supervise, tmp_path):
    """10.255.255.1 answers nobody here: every few seconds a line says what the dial got, and at the
    rendezvous timeout the error names the address, the port, the tries and the last problem."""
    port = free_port()
    line = vllm_line(port, 1)
    line[line.index("--master-addr") + 1] = "10.255.255.1"
    run = supervise(["--tree", "--rendezvous-timeout", "8"], line, dump_dir=tmp_path / "dumps")
    assert run.wait(EXIT_TIMEOUT_S) == 83, run.stderr[-2000:]
    assert f"node 0's store at 10.255.255.1:{port + 1} never answered: tried" in run.stderr, run.stderr[-2000:]
    waiting = run.events("waiting for nodes")
    assert waiting and all(w["store"] == f"10.255.255.1:{port + 1}" and w["tried"] >= 1 for w in waiting)
