"""Installing tp-supervise takes no top-level name another distribution uses (issue 10).

In a fresh venv that already has supervisord (the `supervisor` distribution,
common in container images), installing and then uninstalling tp-supervise
leaves ``supervisord --version`` working: our packages live under the
``tp_supervise`` namespace.  Needs the package index (supervisord and the
build backend are downloaded); skipped when it cannot be reached.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT

OURS = ("supervisor", "engine", "watchdogs", "consensus", "dumps")
STEP_TIMEOUT_S = 300


def run(*argv, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


@pytest.fixture(scope="module")
def venv_with_supervisord(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "v"
    run(sys.executable, "-m", "venv", venv)
    got = run(venv / "bin" / "pip", "install", "-q", "supervisor", check=False)
    if got.returncode != 0:
        pytest.skip(f"cannot install supervisord from the package index: {got.stderr.strip()[-300:]}")
    assert "." in run(venv / "bin" / "supervisord", "--version").stdout
    return venv


def source_tree(dest: Path) -> Path:
    """The project's files in a fresh folder: setuptools' build/ never lands in (or comes from) the repo."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for name in OURS:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sysconfig.get_python_version()}" / "site-packages"


@pytest.mark.slow
def test_install_and_uninstall_leave_supervisord_working(venv_with_supervisord, tmp_path):
    venv = venv_with_supervisord
    pip = venv / "bin" / "pip"
    theirs = sorted(p.name for p in (site_packages(venv) / "supervisor").iterdir())
    run(pip, "install", "-q", "--no-deps", source_tree(tmp_path))
    site = site_packages(venv)
    assert (site / "tp_supervise" / "supervisor" / "cli" / "__init__.py").is_file()
    assert (site / "tp_supervise" / "supervisor" / "rank" / "_hook" / "sitecustomize.py").is_file()
    assert not any((site / name).exists() for name in OURS[1:]), "a generic top-level package was installed"
    assert sorted(p.name for p in (site / "supervisor").iterdir()) == theirs, "supervisord's package was changed"
    assert (venv / "bin" / "supervise").exists()
    run(venv / "bin" / "supervisord", "--version")
    run(pip, "uninstall", "-y", "-q", "tp-supervise")
    assert not [p for p in (site / "tp_supervise").rglob("*") if p.is_file()], "files of ours survived uninstall"
    assert (site / "supervisor" / "http.py").is_file()
    run(venv / "bin" / "supervisord", "--version")
