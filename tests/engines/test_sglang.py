"""SGLang's engine adapter against SGLang's real distributed layer (sglang 0.5.23's ``GroupCoordinator`` on gloo,
from the overlay tests/engines/setup_vllm.sh installs): its collectives are seen as SGLang's, so a stopped rank is
named and its peer is shown waiting in SGLang's all-reduce.  The server itself needs CUDA (``make gpu-check``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import VLLM_PYTHON, VLLM_VENV

pytestmark = [pytest.mark.engines, pytest.mark.timeout(300)]

OVERLAY = VLLM_VENV / "sglang-overlay"
RANK = str(Path(__file__).parent / "sglang_rank.py")

if not (OVERLAY / "sglang").is_dir():
    pytestmark.append(pytest.mark.skip(reason=f"no SGLang overlay at {OVERLAY} (run tests/engines/setup_vllm.sh)"))


def sglang_ranks(*args: str) -> list[str]:
    return [str(VLLM_PYTHON), RANK, *args]


ENV = {"PYTHONPATH": str(OVERLAY)}


def test_sglang_ranks_run_clean_with_the_adapter_installed(supervise):
    run = supervise(["--nproc-per-node", "2"], sglang_ranks("--iters", "100"), env=ENV)
    assert run.wait(timeout=180) == 0, run.stderr[-4000:]
    assert not [line for line in run.events("engine_adapter_unavailable") if line.get("level") == "warning"]
    assert run.bundles() == []


def test_stopped_sglang_rank_is_named_and_its_peer_waits_in_sglang_all_reduce(supervise):
    run = supervise(
        ["--nproc-per-node", "2", "--soft-timeout", "2", "--hard-timeout", "4", "--kill-grace", "2"],
        sglang_ranks("--iters", "100000", "--stop-rank", "1", "--stop-at", "300"),
        env=ENV,
    )
    assert run.wait(timeout=180) == 81, run.stderr[-4000:]
    hang = run.summary("-hang")
    assert hang["culprit_ranks"] == [1], hang["verdict"]
    assert hang["ranks"]["1"]["state"] == "T"
    assert hang["ranks"]["1"]["title"].startswith("sglang::scheduler_TP1"), hang["ranks"]["1"]
    # rank 0 is inside one of SGLang's collectives (the lane op is the engine's, not torch.distributed's)
    assert "sglang." in (hang["ranks"]["0"].get("collective") or ""), hang["ranks"]["0"]
