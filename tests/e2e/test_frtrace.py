"""Issue 13: PyTorch's own analyzer reads the hang bundle of a zero-code gloo program.

(The bundle test itself runs in test_hang_gloo.py on its stopped-rank run; here: the analyzer is there.)

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

FRTRACE_MODULE = "torch.distributed.flight_recorder.fr_trace"
FRTRACE_TIMEOUT_S = 120


def frtrace(*args: str) -> subprocess.CompletedProcess:
    """``torchfrtrace`` (the console script beside this interpreter), else the module it runs."""
    script = Path(sys.executable).with_name("torchfrtrace")
    argv = [str(script)] if script.is_file() else [sys.executable, "-m", FRTRACE_MODULE]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=FRTRACE_TIMEOUT_S)


# The hang bundle test runs on test_hang_gloo.py's stopped-rank run (the same gloo hang, run once):
# test_hang_gloo.py::test_torchfrtrace_reads_the_hang_bundle_of_a_zero_code_gloo_program.


def test_console_script_or_module_is_there():
    """docs/bundle.md shows both spellings; at least the module must run."""
    done = subprocess.run(
        [sys.executable, "-m", FRTRACE_MODULE, "--help"], capture_output=True, text=True, timeout=FRTRACE_TIMEOUT_S
    )
    assert done.returncode == 0 and "allow-incomplete-ranks" in done.stdout
    script = Path(sys.executable).with_name("torchfrtrace")
    if not script.is_file() and shutil.which("torchfrtrace") is None:
        pytest.skip("this torch installs no torchfrtrace console script")
