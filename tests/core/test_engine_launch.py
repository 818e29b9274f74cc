"""An engine's own multi-node launch read from its launcher's flags, and the job compared across nodes
(supervisor/rank/engines/launcher_flags.py, spec.node_place; docs/multinode.md, "An engine's own multi-node
launch")."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tp_supervise.supervisor.cli import spec_from_args
from tp_supervise.supervisor.cli.parser import build_parser
from tp_supervise.supervisor.nodes.handshake import fingerprint, mismatches
from tp_supervise.supervisor.rank.engines.launcher_flags import (
    EngineLaunch,
    LaunchFlagError,
    engine_launch,
    engine_versions,
    job_fields,
    launcher_nproc,
)
from tp_supervise.supervisor.spec import UsageError, node_place

PY = "/opt/venv/bin/python"
VLLM = [PY, "-m", "vllm.entrypoints.cli.main", "serve", "/models/llama", "--tensor-parallel-size", "2",
        "--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29600", "--dtype", "bfloat16"]
NODE0 = [*VLLM, "--node-rank", "0", "--host", "0.0.0.0", "--port", "8000", "--api-server-count", "1"]
NODE1 = [*VLLM, "--node-rank", "1", "--headless"]
SGLANG = [PY, "-m", "sglang.launch_server", "--model-path", "/models/llama", "--tp", "16", "--nnodes", "2",
          "--dist-init-addr", "10.0.0.1:5000"]


def test_vllm_multi_node_lines_read_as_one_job_on_two_nodes():
    zero, one = engine_launch(NODE0), engine_launch(NODE1)
    assert zero == EngineLaunch("vllm", 2, 2, 0, ("10.0.0.1", 29600), 1, headless=False)
    assert one == EngineLaunch("vllm", 2, 2, 1, ("10.0.0.1", 29600), 1, headless=True)
    assert zero.nproc_per_node == one.nproc_per_node == 1
    assert launcher_nproc(NODE1) == "1"  # one worker per node, not --tensor-parallel-size
    # node rank, --headless, --host/--port and the API server count are not the job: the two lines agree
    assert job_fields(NODE0) == job_fields(NODE1)
    assert job_fields(NODE0)["model"] == "/models/llama" and job_fields(NODE0)["dtype"] == "bfloat16"


def test_short_flags_defaults_and_the_data_parallel_world():
    line = ["vllm", "serve", "m", "-tp", "4", "-pp", "2", "-n", "4", "-r", "3"]
    launch = engine_launch(line)
    assert (launch.world, launch.nnodes, launch.node_rank, launch.nproc_per_node) == (8, 4, 3, 2)
    assert launch.rendezvous == ("127.0.0.1", 29501) and launch.headless  # vLLM's default rendezvous
    assert engine_launch(["vllm", "serve", "m", "-tp", "2", "-dp", "2"]).nproc_per_node == 4
    assert engine_launch(["vllm", "serve", "m", "-tp", "2"]).rendezvous is None  # a single node names none


def test_sglang_reads_dist_init_addr_and_its_port_span():
    launch = engine_launch([*SGLANG, "--node-rank", "1"])
    assert (launch.engine, launch.nproc_per_node, launch.node_rank) == ("sglang", 8, 1)
    assert launch.rendezvous == ("10.0.0.1", 5000) and launch.rendezvous_span == 6 and launch.headless
    assert job_fields([*SGLANG, "--node-rank", "0"]) == job_fields([*SGLANG, "--node-rank", "1"])


@pytest.mark.parametrize(
    "line, words",
    [
        (["vllm", "serve", "m", "-tp", "3", "--nnodes", "2"], "does not divide its world of 3"),
        (["vllm", "serve", "m", "-tp", "2", "--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is outside 0..1"),
        (["vllm", "serve", "m", "--nnodes", "two"], "'two' is not a number"),
        ([PY, "-m", "sglang.launch_server", "--tp", "2", "--nnodes", "2"], "no --dist-init-addr"),
    ],
)
def test_launch_flags_that_cannot_be_are_named(line, words):
    with pytest.raises(LaunchFlagError, match=words):
        engine_launch(line)


def test_switches_and_their_negations_are_part_of_the_job():
    eager = job_fields(["vllm", "serve", "m", "--enforce-eager", "--dtype", "half"])
    assert eager["enforce_eager"] == "true" and eager["dtype"] == "half"
    assert job_fields(["vllm", "serve", "m", "--no-enforce-eager"])["enforce_eager"] == "false"
    assert job_fields(["vllm", "serve", "m"])["enforce_eager"] == "(default)"
    assert job_fields(["torchrun", "--nproc-per-node", "2", "x.py"]) is None


def test_a_mismatch_names_the_field_and_both_values(tmp_path):
    other = [*NODE1]
    other[other.index("/models/llama")] = "/models/llama-v2"
    fps = {0: {"fingerprint": fingerprint(NODE0, 1, (), nnodes=2, job=job_fields(NODE0))},
           1: {"fingerprint": fingerprint(other, 1, (), nnodes=2, job=job_fields(other))}}
    assert mismatches(fps) == ["job.model: node 0: '/models/llama'; node 1: '/models/llama-v2'"]
    same = {n: {"fingerprint": fingerprint(line, 1, (), nnodes=2, job=job_fields(line))} for n, line in ((0, NODE0), (1, NODE1))}
    assert mismatches(same) == []


def test_the_same_model_path_holding_another_model_is_a_mismatch(tmp_path):
    a, b = tmp_path / "a" / "m", tmp_path / "b" / "m"
    for path, layers in ((a, 2), (b, 4)):
        path.mkdir(parents=True)
        (path / "config.json").write_text(f'{{"num_hidden_layers": {layers}}}')
    assert job_fields(["vllm", "serve", str(a)])["model_config"] != job_fields(["vllm", "serve", str(b)])["model_config"]


def test_engine_versions_are_read_in_the_launchers_interpreter_and_environment(tmp_path):
    """A PYTHONPATH entry that shadows the engine's distribution is what that node runs: its version counts."""
    line = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "m"]
    base = engine_versions(line, {"PATH": "/usr/bin:/bin"})
    assert set(base) == {"vllm", "torch"}
    shadow = tmp_path / "site"
    (shadow / "vllm-0.31.0.dist-info").mkdir(parents=True)
    (shadow / "vllm-0.31.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.0\n")
    shadowed = engine_versions(line, {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(shadow)})
    assert shadowed["vllm"] == "vllm 0.31.0" and shadowed["torch"] == base["torch"]
    missing = engine_versions(["/nonexistent/python3", "-m", "vllm.entrypoints.cli.main", "serve", "m"], {})
    assert missing["vllm"].startswith("unknown")


def test_node_place_takes_what_the_supervisor_was_not_told_from_the_launcher():
    place = node_place(None, None, None, None, None, engine_launch(NODE1))
    assert (place.nnodes, place.node_rank, place.master_addr, place.master_port) == (2, 1, "10.0.0.1", 29600)
    assert place.store_port == 29601 and place.engine_rendezvous == ("10.0.0.1", 29600)
    sglang = node_place(None, None, None, None, None, engine_launch([*SGLANG, "--node-rank", "1"]))
    assert sglang.store_port == 5006  # after SGLang's six ports
    # supervise --master-port 29500 beside vLLM's default rendezvous (29501): the store goes after it, not on it
    default_rdzv = engine_launch(["vllm", "serve", "m", "-tp", "2", "--nnodes", "2", "--node-rank", "1"])
    assert node_place(None, None, None, 29500, None, default_rdzv).store_port == 29502
    alone = node_place(None, None, None, None, None, None)
    assert (alone.nnodes, alone.node_rank, alone.master_addr) == (1, 0, "127.0.0.1")


@pytest.mark.parametrize(
    "given, words",
    [
        ({"nnodes": 3}, "supervise --nnodes 3 contradicts the launcher's --nnodes 2"),
        ({"node_rank": 0}, "supervise --node-rank 0 contradicts the launcher's --node-rank 1"),
    ],
)
def test_node_place_refuses_a_contradiction_naming_both_values(given, words):
    args = {"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None, "store_port": None} | given
    with pytest.raises(UsageError, match=words):
        node_place(launch=engine_launch(NODE1), **args)


def _spec(*args: str):
    return spec_from_args(build_parser().parse_args(["serve", "--tree", "--metrics-addr", "none", *args]))


def test_a_store_port_among_the_engines_own_ports_is_refused():
    with pytest.raises(UsageError, match="store port 29600 is taken by the engine's own rendezvous"):
        _spec("--store-port", "29600", "--", *NODE1)
    with pytest.raises(UsageError, match="store port 5003 is taken by the engine's own rendezvous"):
        _spec("--store-port", "5003", "--", *SGLANG, "--node-rank", "1")
    spec = _spec("--", *NODE1)
    assert (spec.nnodes, spec.node_rank, spec.nproc_per_node, spec.resolved_store_port) == (2, 1, 1, 29601)


def test_a_headless_node_reads_no_engine_metrics_it_does_not_serve():
    assert _spec("--", *NODE1).watchdog.engine_metrics_url is None
    assert _spec("--", *NODE0).watchdog.engine_metrics_url == "http://127.0.0.1:8000/metrics"


def test_rank_count_that_contradicts_the_launcher_is_refused():
    with pytest.raises(UsageError, match="contradicts the launcher: vllm starts 1 here"):
        _spec("--nproc-per-node", "2", "--", *NODE1)


def test_cli_exits_64_naming_both_values_before_anything_starts(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", "--tree", "--metrics-addr", "none",
         "--nnodes", "2", "--node-rank", "0", "--", *NODE1],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert out.returncode == 64, out.stderr[-2000:]
    assert "--node-rank 0 contradicts the launcher's --node-rank 1" in out.stderr


def test_which_launchers_compile_their_model():
    """vLLM compiles unless --enforce-eager; SGLang only with --enable-torch-compile; a program we do not know,
    never (the drill and the docs' "Engine modes" read this)."""
    from tp_supervise.supervisor.rank.engines.launcher_flags import compiles_model

    assert "vllm compiles its model by default" in compiles_model(["vllm", "serve", "m", "-tp", "2"])
    assert compiles_model(["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--enforce-eager"]) == ""
    assert compiles_model(["python", "-m", "sglang.launch_server", "--model-path", "m", "--tp", "2"]) == ""
    assert "--enable-torch-compile" in compiles_model(
        ["python", "-m", "sglang.launch_server", "--model-path", "m", "--enable-torch-compile"]
    )
    assert compiles_model(["python", "train.py"]) == ""
