"""A benchmark's stamp names the code it measured: ``--update-docs`` from a tree whose tracked files differ
from the commit is refused before anything runs, unless ``--allow-dirty`` (then the stamp says so)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench(tree: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.bench_core", *args], cwd=tree, capture_output=True, text=True, timeout=120
    )


def test_update_docs_from_a_dirty_tree_is_refused(tmp_path):
    tree = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(tree)], check=True, timeout=120)
    docs = tmp_path / "benchmarks.md"
    readme = tree / "README.md"
    readme.write_text(readme.read_text() + "\nan uncommitted line\n")
    refused = _bench(tree, "--update-docs", str(docs))
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "--allow-dirty" in refused.stderr and not docs.exists()
    for runner in (["-m", "bench.run_all"],):
        whole = subprocess.run([sys.executable, *runner], cwd=tree, capture_output=True, text=True, timeout=120)
        assert whole.returncode == 2 and "--allow-dirty" in whole.stderr, whole.stderr[-2000:]
