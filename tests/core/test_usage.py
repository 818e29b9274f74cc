"""Usage errors: exit 64 with an actionable message, and nothing started."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys

import pytest

from tests.conftest import fake_rank


def _assert_usage(run, *needles):
    assert run.wait(timeout=30) == 64, run.stderr
    for needle in needles:
        assert needle in run.stderr, run.stderr
    assert not run.events("rank started")


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--nnodes", "2", "--node-rank", "2", "--nproc-per-node", "1"], ["--node-rank 2", "[0, 2)"]),
        (["--tp", "3", "--nnodes", "2"], ["--tp 3", "--nnodes 2", "divisible"]),
        (["--nproc-per-node", "0"], ["--nproc-per-node"]),
        (["--soft-timeout", "5", "--hard-timeout", "2", "--nproc-per-node", "1"], ["--soft-timeout"]),
        (["--nproc-per-node", "1", "--consensus", "sometimes"], ["--consensus"]),
    ],
)
def test_bad_launch_arithmetic(supervise, args, needles):
    _assert_usage(supervise(args, fake_rank()), *needles)


def test_missing_command(supervise):
    _assert_usage(supervise(["--nproc-per-node", "1"], ["no-such-binary-xyz"]), "no-such-binary-xyz", "PATH")


def test_not_executable(supervise, tmp_path):
    script = tmp_path / "rank.sh"
    script.write_text("#!/bin/sh\nsleep 1\n")
    script.chmod(stat.S_IRUSR | stat.S_IWUSR)
    _assert_usage(supervise(["--nproc-per-node", "1"], [str(script)]), "not executable")


def test_port_in_use(supervise):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _assert_usage(
            supervise(["--nproc-per-node", "1", "--master-port", str(port)], fake_rank()),
            "--master-port",
            "already in use",
        )


def test_metrics_port_in_use(supervise):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _assert_usage(
            supervise(["--nproc-per-node", "1"], fake_rank(), metrics_addr=f"127.0.0.1:{port}"),
            "--metrics-addr",
        )


def test_unwritable_dump_dir(supervise, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    _assert_usage(supervise(["--nproc-per-node", "1"], fake_rank(), dump_dir=blocker / "dumps"), "--dump-dir")


def test_gpu_count_checked_for_cuda_engine(supervise):
    run = supervise(["--tp", "2", "--device", "cuda"], env={"CUDA_VISIBLE_DEVICES": ""})
    _assert_usage(run, "--device cuda", "GPU")


def test_inject_rank_out_of_range(supervise):
    _assert_usage(supervise(["--tp", "2", "--inject", "stop@5"]), "stop@5")


# -- torchrun command lines carry over (issue 13) -------------------------------------------------
def test_torchrun_spellings_and_standalone_are_accepted():
    from tp_supervise.supervisor.cli import build_parser, spec_from_args

    args = build_parser().parse_args(["serve", "--nproc_per_node", "3", "--standalone", "--max_restarts", "1",
                                      "--", "python", "x.py"])
    spec = spec_from_args(args)
    assert (spec.nproc_per_node, spec.nnodes, spec.max_restarts) == (3, 1, 1)
    args = build_parser().parse_args(["serve", "--nproc-per-node", "cpu", "--", "python", "x.py"])
    assert spec_from_args(args).nproc_per_node == (os.cpu_count() or 1)


@pytest.mark.parametrize("launcher, expected", [
    (["torchrun", "--nproc-per-node", "2", "train.py"], 2),
    (["torchrun", "--nproc_per_node=4", "train.py"], 4),
    (["vllm", "serve", "m", "--tensor-parallel-size", "8"], 8),
    (["python", "-m", "sglang.launch_server", "--model", "m", "--tp", "2"], 2),
])
def test_tree_mode_reads_the_launchers_own_rank_count(launcher, expected):
    from tp_supervise.supervisor.cli import build_parser, spec_from_args

    spec = spec_from_args(build_parser().parse_args(["serve", "--tree", "--", *launcher]))
    assert spec.nproc_per_node == expected


def test_nproc_gpu_without_a_gpu_is_a_usage_error(supervise):
    run = supervise(["--nproc-per-node", "gpu"], fake_rank("--all", "exit0"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert run.wait(30) == 64
    assert "--nproc-per-node gpu: no GPU is visible" in run.stderr


def test_ranks_get_torchruns_whole_environment(supervise, tmp_path):
    out = tmp_path / "env"
    out.mkdir()
    script = ("import json, os, sys; json.dump(dict(os.environ), open(os.path.join(sys.argv[1], "
              "os.environ['RANK'] + '.json'), 'w'))")
    run = supervise(["--nproc-per-node", "2", "--max-restarts", "3"], [sys.executable, "-c", script, str(out)],
)
    assert run.wait(60) == 0, run.stderr[-3000:]
    for rank in (0, 1):
        env = json.loads((out / f"{rank}.json").read_text())
        assert env["RANK"] == env["ROLE_RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1" and env["ROLE_NAME"] == "default"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"errors/rank-{rank}.json")
        assert env["TORCHELASTIC_RUN_ID"] == env["SUPERVISE_RUN_ID"]
        assert env.get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS", "1")


def test_tree_mode_multiplies_vllm_tensor_and_pipeline_parallel_sizes():
    from tp_supervise.supervisor.cli import build_parser, spec_from_args

    argv = ["serve", "--tree", "--", "vllm", "serve", "m", "-tp", "4", "--pipeline-parallel-size=2"]
    assert spec_from_args(build_parser().parse_args(argv)).nproc_per_node == 8


@pytest.mark.parametrize("launcher, upstream, engine", [
    (["vllm", "serve", "m", "--tensor-parallel-size", "2", "--port", "8100"], "http://127.0.0.1:8100", "vllm"),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--host", "0.0.0.0", "-tp", "2"],
     "http://127.0.0.1:8000", "vllm"),
    (["python", "-m", "sglang.launch_server", "--model", "m", "--tp", "2", "--host", "::1", "--port=31000"],
     "http://[::1]:31000", "openai"),
])
def test_relay_reads_the_engines_own_listener_from_the_launcher(launcher, upstream, engine):
    from tp_supervise.supervisor.cli import build_parser, spec_from_args

    spec = spec_from_args(build_parser().parse_args(["serve", "--tree", "--relay", "127.0.0.1:9000", "--", *launcher]))
    assert (spec.relay.address, spec.relay.upstream, spec.relay.engine) == (("127.0.0.1", 9000), upstream, engine)
    assert spec.relay.hold_s(builtin=False) == 180.0


@pytest.mark.parametrize("args, command, needles", [
    (["--relay", "127.0.0.1:9000"], None, ["--relay is for a COMMAND"]),
    (["--relay", "127.0.0.1:9000", "--nproc-per-node", "1"], ["python", "serve.py"], ["--relay-upstream"]),
    (["--relay-upstream", "http://127.0.0.1:8000", "--nproc-per-node", "1"], ["python", "serve.py"], ["--relay HOST"]),
    (["--tree", "--relay", "127.0.0.1:8000"], ["vllm", "serve", "m", "--tensor-parallel-size", "2"],
     ["is the engine's own port"]),
    (["--tree", "--relay", "127.0.0.1:9000", "--relay-hold", "0"], ["vllm", "serve", "m", "--tensor-parallel-size", "2"],
     ["--relay-hold"]),
    (["--tree", "--relay", "127.0.0.1:9000", "--relay-max-held", "0"],
     ["vllm", "serve", "m", "--tensor-parallel-size", "2"], ["--relay-max-held"]),
    (["--relay", "127.0.0.1:9000", "--relay-upstream", "http://127.0.0.1:8000", "--listen", "127.0.0.1:9001",
      "--nproc-per-node", "1"], ["python", "serve.py"], ["--relay and --listen"]),
])
def test_relay_usage_errors(supervise, args, command, needles):
    _assert_usage(supervise(args, command), *needles)


def test_relay_port_in_use(supervise):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        launcher = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--tensor-parallel-size", "2"]
        run = supervise(["--tree", "--relay", f"127.0.0.1:{port}"], launcher)
        _assert_usage(run, "--relay", "already in use")


def test_relay_port_alone_is_every_interface_and_the_supervisors_own_endpoints_need_a_host():
    from tp_supervise.supervisor.cli import build_parser, spec_from_args
    from tp_supervise.supervisor.spec import UsageError

    launcher = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "-tp", "2", "--port", "8001"]
    spec = spec_from_args(build_parser().parse_args(["serve", "--tree", "--relay", ":8000", "--", *launcher]))
    assert spec.relay.address == ("0.0.0.0", 8000)
    with pytest.raises(UsageError, match="--metrics-addr ':9180': expected HOST:PORT"):
        spec_from_args(build_parser().parse_args(["serve", "--metrics-addr", ":9180", "--tree", "--", *launcher]))
