"""Usage errors: exit 64 with an actionable message, and nothing started."""

from __future__ import annotations

import socket
import stat

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
