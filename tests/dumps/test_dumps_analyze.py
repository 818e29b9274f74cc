"""`supervise analyze`: rendering, --json, and paths that are not bundles."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tp_supervise.dumps.analyze import EXIT_NOT_A_BUNDLE, EXIT_OK, main
from tp_supervise.dumps.bundle import SUMMARY_JSON, BundleWriter
from tp_supervise.dumps.capture import ENV_PYSPY
from tp_supervise.dumps.incident import write_incident


@pytest.fixture
def bundle(fake_ranks, tmp_path, monkeypatch):
    """A real bundle: rank 1 stuck in Python, its peers in a collective (fallback capture)."""
    monkeypatch.setenv(ENV_PYSPY, "off")
    ranks = fake_ranks(3)
    ranks.start({0: "collective", 1: "python", 2: "collective"})
    writer = BundleWriter(tmp_path / "dumps", keep=5, max_bytes=0)
    res = write_incident(
        writer, reason="hang", run_id=ranks.run_id, targets=ranks.targets(), run_dir=ranks.run_dir, deadline_s=8.0
    )
    assert res.ok
    return res.path


def test_render_verdict_table_and_grouped_stacks(bundle, capsys):
    assert main([str(bundle), "--no-stacks"]) == EXIT_OK
    short = capsys.readouterr().out
    assert main([str(bundle)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "rank 1 is stuck outside collectives in stuck_in_user_code" in " ".join(out.split())
    for col in ("rank", "pid", "state", "exit", "step", "collective", "group"):
        assert col in out
    assert "*1" in out  # culprit marked in the table
    assert "group A: ranks 0,2" in out and "group B: ranks 1" in out
    assert "wait_in_all_reduce" in out and "stuck_in_user_code (" in out  # the stacks themselves
    assert "(stack of rank" not in short


def test_json_is_summary_compatible(bundle, capsys):
    assert main([str(bundle), "--json"]) == EXIT_OK
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((bundle / SUMMARY_JSON).read_text())
    assert printed["culprit_ranks"] == [1] and set(printed["ranks"]) == {"0", "1", "2"}


def test_not_a_bundle(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == EXIT_NOT_A_BUNDLE
    assert "no such file or directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == EXIT_NOT_A_BUNDLE
    assert "not a bundle (no summary.json)" in capsys.readouterr().err
    afile = tmp_path / "f.txt"
    afile.write_text("x")
    assert main([str(afile)]) == EXIT_NOT_A_BUNDLE
    assert "not a bundle" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / SUMMARY_JSON).write_text("{nope")
    assert main([str(broken), "--json"]) == EXIT_NOT_A_BUNDLE
    assert "unreadable summary" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / SUMMARY_JSON).write_text('{"hello": 1}')
    assert main([str(foreign)]) == EXIT_NOT_A_BUNDLE
    assert "not a tp-supervise summary" in capsys.readouterr().err


def test_dump_dir_hint_names_newest_bundle(bundle, capsys):
    assert main([str(bundle.parent)]) == EXIT_NOT_A_BUNDLE
    err = capsys.readouterr().err
    assert "dump dir with 1 bundle(s)" in err and bundle.name in err


def test_cli_process_exit_codes(bundle, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(bundle), "--json"], capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["reason"] == "hang"
    bad = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "supervise analyze:" in bad.stderr
