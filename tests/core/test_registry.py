"""The job registry is ours alone (issue 14): a planted directory steers nothing.

Another user pre-creates the /tmp registry of root with a crafted entry whose
"socket" names a file of ours, whose "run_dir" names a directory of ours, and
whose run id is carried by a process of that user.  Root's `supervise serve`
must skip that directory (saying why), delete nothing, kill nothing, and
still be reachable by `supervise dump` in its fallback registry.
"""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import MARK_VAR, ROOT, fake_rank
from tests.live import wait_for

OTHER_UID = 65534  # nobody


def _planted(tmp_path: Path) -> dict:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    victim_file = tmp_path / "precious.txt"
    victim_file.write_text("do not delete")
    victim_dir = tmp_path / "tp-supervise-victim"
    victim_dir.mkdir()
    (victim_dir / "data").write_text("keep")
    registry = tmp / f"tp-supervise-{os.geteuid()}"
    registry.mkdir()
    entry = {"run_id": "X", "pid": 999999, "socket": str(victim_file), "run_dir": str(victim_dir)}
    (registry / "X.json").write_text(json.dumps(entry))
    for path in (registry, registry / "X.json"):
        os.chown(path, OTHER_UID, OTHER_UID)
    return {"tmp": tmp, "registry": registry, "file": victim_file, "dir": victim_dir}


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a directory owned by another user needs root")
def test_a_planted_registry_is_skipped_and_nothing_is_deleted_or_killed(supervise, tmp_path):
    planted = _planted(tmp_path)
    home = Path(tempfile.mkdtemp(prefix="h", dir="/tmp"))  # short: the socket path must fit sun_path
    env = {"SUPERVISE_REGISTRY_DIR": "", "XDG_RUNTIME_DIR": "", "TMPDIR": str(planted["tmp"]), "HOME": str(home)}
    # a process of the other user that carries the crafted run id
    bystander = subprocess.Popen(["sleep", "120"], env={"SUPERVISE_RUN_ID": "X", MARK_VAR: "bystander"},
                                 user=OTHER_UID, group=OTHER_UID)
    try:
        run = supervise(["--nproc-per-node", "1"], fake_rank("--all", "loop"), env=env)
        fallback = home / ".cache" / "tp-supervise" / "registry"
        wait_for(lambda: list(fallback.glob("*.json")) or run.proc.poll() is not None, 30,
                 "an entry in the fallback registry")
        assert run.proc.poll() is None, f"supervise exited {run.wait()}: {run.stderr[-3000:]}"
        dumped = subprocess.run([sys.executable, "-m", "tp_supervise.supervisor.cli", "dump"], cwd=ROOT,
                                env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
        assert dumped.returncode == 0, dumped.stderr
        run.proc.send_signal(signal.SIGINT)
        assert run.wait(60) == 0, run.stderr[-3000:]
        assert bystander.poll() is None, "a process of another user was killed"
        assert oct(fallback.stat().st_mode & 0o777) == "0o700"
    finally:
        bystander.kill()
        bystander.wait()
        shutil.rmtree(home, ignore_errors=True)
    assert planted["file"].read_text() == "do not delete"
    assert (planted["dir"] / "data").read_text() == "keep"
    assert (planted["registry"] / "X.json").exists(), "the planted entry itself is the other user's"
    skipped = run.events("job registry skipped")
    assert skipped and "owned by uid 65534" in skipped[0]["reason"], run.stderr[-3000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a directory owned by another user needs root")
def test_an_explicit_foreign_registry_is_a_usage_error(supervise, tmp_path):
    foreign = tmp_path / "reg"
    foreign.mkdir()
    os.chown(foreign, OTHER_UID, OTHER_UID)
    run = supervise(["--nproc-per-node", "1"], fake_rank("--all", "exit0"), env={"SUPERVISE_REGISTRY_DIR": str(foreign)})
    assert run.wait(30) == 64
    assert "SUPERVISE_REGISTRY_DIR" in run.stderr and "owned by uid 65534" in run.stderr


def test_a_crafted_entry_in_our_own_registry_is_validated(supervise, tmp_path):
    """Fields are derived, not trusted: a 'socket' or 'run_dir' outside our directories is never touched."""
    registry = tmp_path / "registry"
    registry.mkdir(mode=0o700)
    victim = tmp_path / "precious.txt"
    victim.write_text("keep")
    (registry / "Y.json").write_text(json.dumps({"run_id": "Y", "pid": 999999, "socket": str(victim),
                                                  "run_dir": str(tmp_path)}))
    (registry / "bad.json").write_text(json.dumps({"run_id": "../../etc", "pid": "1"}))
    os.symlink(victim, registry / "Z.json")
    run = supervise(["--nproc-per-node", "1"], fake_rank("--all", "exit0"))
    assert run.wait(60) == 0, run.stderr[-3000:]
    assert victim.read_text() == "keep" and tmp_path.is_dir()
    assert not (registry / "Y.json").exists(), "a valid stale entry of ours is swept"
    assert (registry / "bad.json").exists() and (registry / "Z.json").is_symlink()
    assert run.events("registry entry ignored")
