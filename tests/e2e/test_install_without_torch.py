"""The supervisor needs no torch (issue 37): installed without the `engine` extra it has none, and supervises
another environment's gloo program.

``pip install`` of the project (non-editable, no extra) into a fresh venv leaves torch, safetensors and tokenizers
out of it: installed in an engine's environment, tp-supervise neither pulls nor replaces the torch that engine
pins.  That venv's ``supervise serve --tree`` then runs the multiprocessing launcher of tests/fakes/mp_launcher.py
(two gloo ranks, all_reduce in a loop) under this project's python, as a supervisor in its own venv runs an
engine's launcher: the ranks are held (they joined the group, through the zero-code hook from the torch-less
install) and the supervisor counted their collectives.  The built-in engine, which does need torch in the
supervisor's python, is refused before anything starts, with the extra to install.

Needs the package index (the dependencies and the build backend); skipped when it cannot be reached.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.test_packaging import run, source_tree

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MP_LAUNCHER = Path(__file__).resolve().parents[1] / "fakes" / "mp_launcher.py"
ITERS = 60
ENGINE_ONLY = ("torch", "safetensors", "tokenizers")  # pyproject.toml's `engine` extra


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A venv with `pip install <the project>` and nothing else."""
    root = tmp_path_factory.mktemp("bare")
    venv = root / "v"
    run(sys.executable, "-m", "venv", venv)
    src = root / "src"
    src.mkdir()
    got = run(venv / "bin" / "pip", "install", "-q", source_tree(src), check=False)
    if got.returncode != 0:
        # A failure of ours (a dependency that does not resolve, a broken build) fails the test; only an index
        # that does not answer at all skips it.
        probe = run(
            venv / "bin" / "pip", "download", "-q", "--no-deps", "-d", root / "probe", "setuptools>=77", check=False
        )
        if probe.returncode != 0:
            pytest.skip(f"the package index cannot be reached: {probe.stderr.strip()[-300:]}")
        raise AssertionError(f"pip install of the project failed:\n{got.stdout[-2000:]}\n{got.stderr[-3000:]}")
    return venv


def test_install_without_the_extra_has_no_torch(bare_venv):
    python = bare_venv / "bin" / "python"
    shown = run(bare_venv / "bin" / "pip", "show", *ENGINE_ONLY, check=False)
    assert shown.returncode != 0 and not re.search(r"^Name:", shown.stdout, re.M), shown.stdout
    found = run(python, "-c", f"import importlib.util as u; print([m for m in {ENGINE_ONLY!r} if u.find_spec(m)])")
    assert found.stdout.strip() == "[]", found.stdout
    run(bare_venv / "bin" / "supervise", "--help")


def test_tree_around_another_venvs_gloo_program(bare_venv, supervise, tmp_path):
    # The fixture starts `<its python> ENTRY serve ...`: ENTRY hands the arguments to the bare venv's own script.
    entry = tmp_path / "bare_supervise.py"
    entry.write_text(
        f"import os, sys\nos.execv({str(bare_venv / 'bin' / 'supervise')!r}, ['supervise', *sys.argv[1:]])\n"
    )
    textfile = tmp_path / "metrics.prom"
    run_ = supervise(
        ["--tree", "--nproc-per-node", "2", "--metrics-textfile", str(textfile)],
        [sys.executable, str(MP_LAUNCHER), "--tp", "2", "--iters", str(ITERS)],
        entry=entry,
    )
    assert run_.wait(timeout=180) == 0, run_.stderr[-4000:]
    assert sorted(line["rank"] for line in run_.events("rank joined the group")) == [0, 1], run_.stderr[-4000:]
    assert run_.bundles() == []
    seqs = dict(re.findall(r'^supervise_rank_collective_seq\{rank="(\d)"\} (\S+)$', textfile.read_text(), re.M))
    assert sorted(seqs) == ["0", "1"] and all(float(v) >= ITERS for v in seqs.values()), seqs  # the all_reduces


def test_builtin_engine_without_the_extra_is_refused_before_anything_starts(bare_venv, tmp_path):
    got = run(
        bare_venv / "bin" / "supervise",
        "serve",
        "--metrics-addr",
        "127.0.0.1:0",
        "--port",
        "0",
        "--dump-dir",
        tmp_path / "dumps",
        check=False,
    )
    assert got.returncode == 64, got.stderr[-3000:]
    assert "the built-in engine needs torch" in got.stderr and "tp-supervise[engine]" in got.stderr, got.stderr
    assert "rank" not in got.stderr.lower(), got.stderr  # refused, not a run whose ranks failed
    assert not (tmp_path / "dumps").exists() or not any((tmp_path / "dumps").iterdir())
