"""In-band comparison on real gloo collectives (two processes, imports torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tp_supervise.supervisor.rank.channel import rank_env

SCRIPT = Path(__file__).with_name("inband_rank.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_minmax_and_fused_checks_agree_and_catch_the_divergent_step(tmp_path):
    procs = []
    try:
        for rank in range(2):
            env = dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(rank))
            env.update(rank_env(tmp_path, rank, "off", inband_every=1))
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPT), str(rank), "2", str(tmp_path / "store")],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )
            )
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    expected = [True, True, True, True, False, True]  # checked: steps 0, 2, 4
    for out in outs:
        assert out["minmax"] == [expected, 3, 1]
        assert out["fused"] == [expected, 3, 1]
        assert out["recorder"] == [5, 1]  # every step checked, step 3 differs on rank 1
    assert not (tmp_path / "consensus").exists()  # in-band only: no ring
