"""`supervise analyze`: rendering, --json, and paths that are not bundles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tp_supervise.dumps.analyze import EXIT_MALFORMED, EXIT_NOT_A_BUNDLE, EXIT_OK, main
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
    assert main([str(broken), "--json"]) == EXIT_MALFORMED
    assert "malformed bundle: summary.json is not valid JSON" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / SUMMARY_JSON).write_text('{"hello": 1}')
    assert main([str(foreign)]) == EXIT_MALFORMED
    assert "malformed bundle: summary.json has no verdict/ranks" in capsys.readouterr().err


def test_dump_dir_hint_names_newest_bundle(bundle, capsys):
    assert main([str(bundle.parent)]) == EXIT_NOT_A_BUNDLE
    err = capsys.readouterr().err
    assert "dump dir with 1 bundle(s)" in err and bundle.name in err


def test_cli_process_exit_codes(bundle, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(bundle), "--json"], capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["reason"] == "hang"
    bad = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "supervise analyze:" in bad.stderr


# -- hostile bundles (issue 14): plain text, nothing outside read, no hang, exit 65 when malformed ----------
HOSTILE_TEXT = "\x1b[2J\x1b]0;pwned\x07\x1b]8;;http://evil\x1b\\click\x1b]8;;\x1b\\ [/x] [bold]x"


def _summary(tmp_path, **fields):
    bundle = tmp_path / "b"
    (bundle / "stacks").mkdir(parents=True)
    summary = {"reason": "hang", "verdict": HOSTILE_TEXT, "ranks": {"0": {"pid": 1, "collective": "[/x] 64x256"}},
               "culprit_ranks": [0], **fields}
    (bundle / SUMMARY_JSON).write_text(json.dumps(summary))
    return bundle


def test_hostile_text_is_shown_as_plain_text(tmp_path):
    bundle = _summary(tmp_path)
    (bundle / "stacks" / "rank-0.txt").write_text("Thread 1\n  f (x.py:1)\x1b[31m red\n")
    out = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(bundle)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == EXIT_OK, out.stderr
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout, "a control character reached the terminal"
    assert "\\x1b[2J" in out.stdout and "\\x1b]0;pwned\\x07" in out.stdout  # made visible instead
    assert "[/x] 64x256" in out.stdout and "[bold]x" in out.stdout  # verbatim, not markup


def test_links_fifos_and_devices_in_a_bundle_are_not_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-LINE")
    bundle = _summary(tmp_path)
    stacks = bundle / "stacks"
    os.symlink(secret, stacks / "rank-0.txt")
    os.link(secret, stacks / "rank-1.txt")
    os.mkfifo(stacks / "rank-2.txt")
    os.symlink("/dev/zero", stacks / "rank-3.txt")
    out = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(bundle)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == EXIT_OK, out.stderr
    assert "TOP-SECRET-LINE" not in out.stdout
    text = " ".join(out.stdout.split())
    for n in range(4):
        assert f"stacks/rank-{n}.txt: not read" in text, text


def test_summary_json_as_a_link_or_fifo_is_refused(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"verdict": "TOP-SECRET", "ranks": {}}))
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(secret, linked / SUMMARY_JSON)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / SUMMARY_JSON)
    for bundle in (linked, fifo):
        out = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(bundle), "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == EXIT_MALFORMED and "TOP-SECRET" not in out.stdout, (out.stdout, out.stderr)


@pytest.mark.parametrize("fields", [
    {"ranks": ["0"]},
    {"ranks": {"0": "x"}},
    {"verdict": 7},
    {"culprit_ranks": "1"},
    {"stack_groups": [{"ranks": "0,1"}]},
    {"notes": {"a": 1}},
    {"ranks": {"0": {"exit": [[[]]]}}},
], ids=["ranks-list", "rank-str", "verdict-int", "culprits-str", "group-ranks-str", "notes-dict", "exit-list"])
def test_wrong_types_are_a_malformed_bundle(tmp_path, fields):
    bundle = _summary(tmp_path, **fields)
    out = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(bundle)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == EXIT_MALFORMED, (out.stdout, out.stderr)
    assert "malformed bundle" in out.stderr and "Traceback" not in out.stderr


def test_deep_nesting_and_huge_summaries_are_malformed(tmp_path):
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / SUMMARY_JSON).write_text('{"verdict": "v", "ranks": {}, "x": ' + "[" * 5000 + "]" * 5000 + "}")
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / SUMMARY_JSON).write_text('{"verdict": "v", "ranks": {}, "x": ' + "[" * 100 + "]" * 100 + "}")
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / SUMMARY_JSON).write_text('{"verdict": "' + "a" * (5 << 20) + '", "ranks": {}}')
    for bundle in (deep, nested, huge):
        out = subprocess.run([sys.executable, "-m", "tp_supervise.dumps.analyze", str(bundle)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == EXIT_MALFORMED and "Traceback" not in out.stderr, out.stderr[-500:]
