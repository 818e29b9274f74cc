"""Issue 13: PyTorch's own analyzer reads the hang bundle of a zero-code gloo program.

A plain torch.distributed gloo loop (no supervisor code), rank 1 SIGSTOPs
itself, the hard watchdog fires (exit 81).  The stopped rank's worker server
cannot answer, so the bundle's ``fr/`` holds rank 0's trace only and
``torchfrtrace`` runs with ``--allow-incomplete-ranks``; without it, the
analyzer names the rank whose file is missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

GLOO = str(Path(__file__).resolve().parents[1] / "fakes" / "gloo_loop.py")
FRTRACE_MODULE = "torch.distributed.flight_recorder.fr_trace"
FRTRACE_TIMEOUT_S = 120


def frtrace(*args: str) -> subprocess.CompletedProcess:
    """``torchfrtrace`` (the console script beside this interpreter), else the module it runs."""
    script = Path(sys.executable).with_name("torchfrtrace")
    argv = [str(script)] if script.is_file() else [sys.executable, "-m", FRTRACE_MODULE]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=FRTRACE_TIMEOUT_S)


def test_torchfrtrace_reads_the_hang_bundle_of_a_zero_code_gloo_program(supervise):
    run = supervise(
        ["--nproc-per-node", "2", "--soft-timeout", "3", "--hard-timeout", "6", "--kill-grace", "2"],
        [sys.executable, GLOO, "--iters", "100000", "--fault", "stop", "--fault-at", "30"],
    )
    assert run.wait(timeout=90) == 81, run.stderr[-4000:]
    bundle = [b for b in run.bundles() if b.name.endswith("-hang") or "-hang-" in b.name][-1]
    summary = run.summary("-hang")
    assert summary["flight_recorder"]["collected"] == [0], summary["flight_recorder"]
    assert "stopped" in summary["flight_recorder"]["errors"]["1"]

    fr = bundle / "fr"
    assert sorted(p.name for p in fr.iterdir()) == ["rank-0"]
    assert (bundle / "fr-json" / "rank-0.json").is_file()

    done = frtrace("--allow-incomplete-ranks", str(fr))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # It knows the group has two ranks (the bundle completes gloo's group table) and says whose file is missing.
    assert "missed FR dumps from ranks ({1})" in done.stdout + done.stderr

    strict = frtrace(str(fr))
    assert strict.returncode != 0
    assert "Missing dump files from ranks {1}" in strict.stderr


def test_console_script_or_module_is_there():
    """docs/bundle.md shows both spellings; at least the module must run."""
    done = subprocess.run(
        [sys.executable, "-m", FRTRACE_MODULE, "--help"], capture_output=True, text=True, timeout=FRTRACE_TIMEOUT_S
    )
    assert done.returncode == 0 and "allow-incomplete-ranks" in done.stdout
    script = Path(sys.executable).with_name("torchfrtrace")
    if not script.is_file() and shutil.which("torchfrtrace") is None:
        pytest.skip("this torch installs no torchfrtrace console script")
