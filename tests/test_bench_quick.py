"""Every benchmark's --quick mode runs and succeeds, so a broken benchmark fails CI.

`python -m bench.run_all --quick` runs each benchmark of bench/ in its smoke mode (a few seconds each,
the same code paths as `make bench` with fewer rounds, ranks or iterations; what needs a GPU, Prometheus
or transformers is skipped with the reason printed) and exits non-zero when one that ran failed.  How
long it takes is a benchmark figure, not a test assertion: run_all prints it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A guard against a hung benchmark, not a time goal: ~2.5 min alone, more while .ci/run makes vLLM's venv beside it.
LIMIT_S = 420
pytestmark = [pytest.mark.bench, pytest.mark.timeout(LIMIT_S + 60)]  # make test-bench


def test_every_benchmark_quick_mode_exits_0():
    proc = subprocess.Popen([sys.executable, "-m", "bench.run_all", "--quick"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # run_all stops the benchmark in progress (its own session) first
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"bench.run_all --quick ran past {LIMIT_S} s:\n{out[-6000:]}\n{err[-3000:]}") from None
    summary = out[out.rfind("quick run:"):]
    assert proc.returncode == 0, f"{summary}\n{err[-6000:]}\n{out[-6000:]}"
    assert "bench_core" in summary and " ok " in summary, out[-3000:]
