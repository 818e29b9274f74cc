"""A rank that raises under torch's @record: the rank_exit bundle quotes the exception and keeps the traceback
(TORCHELASTIC_ERROR_FILE, issue 13); `supervise analyze` shows it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

RAISING = """
from torch.distributed.elastic.multiprocessing.errors import record

def load_shard():
    raise RuntimeError("shard 3 of model.safetensors is truncated")

@record
def main():
    load_shard()

main()
"""


def test_the_rank_exit_bundle_quotes_the_exception_and_keeps_the_traceback(supervise):
    run = supervise(["--nproc-per-node", "1"], [sys.executable, "-c", RAISING])
    assert run.wait(120) == 80, run.stderr[-3000:]
    [bundle] = [b for b in run.bundles() if "rank_exit" in b.name]
    summary = json.loads((bundle / "summary.json").read_text())
    assert "RuntimeError: shard 3 of model.safetensors is truncated" in summary["verdict"]
    assert "Traceback" in summary["error"]["traceback"] and "load_shard" in summary["error"]["traceback"]
    assert (bundle / "logs" / "rank-0.error.json").is_file()
    shown = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(bundle)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "load_shard" in shown.stdout and "exception of rank 0" in shown.stdout
