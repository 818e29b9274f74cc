"""The real-engine tier (``make test-engines``): vLLM's CPU build run as its users run it, under `supervise serve
--tree`.  Skipped unless the vLLM environment exists (tests/engines/setup_vllm.sh makes it; VLLM_VENV names
another)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"


def pytest_collection_modifyitems(config, items):
    if VLLM_PYTHON.exists():
        return
    skip = pytest.mark.skip(reason=f"no vLLM environment at {VLLM_VENV} (run tests/engines/setup_vllm.sh)")
    for item in items:
        if "tests/engines" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(
        [sys.executable, str(Path(__file__).parent / "make_tiny_llama.py"), str(path)], check=True, capture_output=True
    )
    return path
