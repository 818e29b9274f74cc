"""``supervise [SUBCOMMAND] --help`` and ``supervise --version``, run as a user runs them: real subprocesses.

What ``--help`` must hold, for the top-level parser and every subcommand (found by walking the parser,
so one added later is covered):

* every option has a help text;
* "(default: None)" never appears;
* an option's default is stated at most once (one "default" in its help), and an option that takes a
  value and has one (not None, "", []) states it.

The help is read from the printed text, not from the parser objects: what is checked is what a user sees.
The parser is walked only to know which subcommands and options must be there.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata

import pytest

from tests.test_docs_flags import subcommands
from tp_supervise.supervisor.cli import DISTRIBUTION, build_parser

HELP_TIMEOUT_S = 60
MODULE = "tp_supervise.supervisor.cli"
DEFAULT_WORD = re.compile(r"\bdefault\b", re.IGNORECASE)


@dataclass(frozen=True)
class Entry:
    """One option as ``--help`` prints it: its spellings and its help text (lines joined)."""

    flags: tuple[str, ...]
    help: str


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="100")  # a fixed width: the same wrapping on every terminal
    return subprocess.run(
        [sys.executable, "-m", MODULE, *args], capture_output=True, text=True, timeout=HELP_TIMEOUT_S, env=env
    )


def entries(text: str) -> list[Entry]:
    """The option entries of an argparse help text.

    The usage block (up to the first blank line) is skipped.  An entry starts on a line indented by exactly
    two spaces with a ``-``; its help follows the invocation after two or more spaces on that line, or on
    the lines indented deeper that follow."""
    lines = text.splitlines()
    body = lines[lines.index("") + 1 :] if "" in lines else []
    found: list[Entry] = []
    flags: tuple[str, ...] | None = None
    parts: list[str] = []
    for line in [*body, ""]:
        if line.startswith("   ") and flags is not None:
            parts.append(line.strip())
            continue
        if flags is not None:
            found.append(Entry(flags, " ".join(parts)))
            flags, parts = None, []
        if line.startswith("  -"):
            invocation, _, rest = line.strip().partition("  ")
            flags = tuple(s.split(" ")[0] for s in invocation.split(", "))
            parts = [rest.strip()] if rest.strip() else []
    return found


def problems(text: str) -> list[str]:
    """Every rule of the module docstring that ``text`` breaks, one sentence each (the "states it" rule
    needs the parser: ``missing_defaults``)."""
    found = ["'(default: None)' is printed"] if "(default: None)" in text else []
    for entry in entries(text):
        name = entry.flags[0]
        if not entry.help:
            found.append(f"{name} has no help text")
        said = len(DEFAULT_WORD.findall(entry.help))
        if said > 1:
            found.append(f"{name} states its default {said} times: {entry.help!r}")
    return found


def has_default_to_state(action: argparse.Action) -> bool:
    value = action.default
    return action.nargs != 0 and not (value is None or value is argparse.SUPPRESS or value == "" or value == [])


PARSER = build_parser()
COMMANDS = subcommands(PARSER)
CASES = [((), PARSER)] + [((name,), sub) for name, sub in COMMANDS.items()]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: " ".join(case[0]) or "supervise")
def printed(request) -> tuple[argparse.ArgumentParser, str]:
    args, parser = request.param
    run = run_cli(*args, "--help")
    assert run.returncode == 0, run.stderr
    return parser, run.stdout


def test_every_option_has_help_and_states_its_default_once(printed):
    _parser, text = printed
    found = problems(text)
    assert not found, "\n".join(found) + "\n\n" + text


def test_every_option_is_printed_and_states_a_default_it_has(printed):
    parser, text = printed
    shown = {entry.flags[0]: entry for entry in entries(text)}
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        entry = shown.get(action.option_strings[0])
        if entry is None:
            missing.append(f"{action.option_strings[0]} is not in --help")
        elif has_default_to_state(action) and not DEFAULT_WORD.search(entry.help):
            missing.append(f"{action.option_strings[0]} defaults to {action.default!r} but --help does not say so")
    assert not missing, "\n".join(missing) + "\n\n" + text


def test_the_walk_finds_every_subcommand():
    """Guards the walk: if it found nothing, the checks above would pass on nothing."""
    assert {"serve", "dump", "status", "analyze", "drill"} <= set(COMMANDS)
    assert len(entries(run_cli("serve", "--help").stdout)) > 40


@pytest.mark.parametrize(
    ("what", "text", "expect"),
    [
        ("an option without help", "usage: x\n\noptions:\n  --json\n  --tp N      ranks\n", "--json has no help"),
        (
            "argparse's '(default: None)'",
            "usage: x\n\noptions:\n  --port PORT  the port (default: None)\n",
            "'(default: None)' is printed",
        ),
        (
            "a default stated twice",
            "usage: x\n\noptions:\n  --master-port PORT\n      the port (default: a free port)\n      (default: None)\n",
            "--master-port states its default 2 times",
        ),
    ],
)
def test_the_check_catches(what, text, expect):
    """The check can fail: each text breaks one rule."""
    assert any(expect in p for p in problems(text)), f"{what} not reported"


def test_version_prints_the_installed_distribution_version():
    run = run_cli("--version")
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"supervise {metadata.version(DISTRIBUTION)}\n"


@pytest.mark.parametrize("spelling", ["--straggler-sustain", "--straggler-window"])
def test_the_straggler_sustain_time_keeps_its_old_spelling(spelling):
    """``--straggler-window`` set the sustain time, not a window: renamed, the old spelling still works."""
    from tp_supervise.supervisor.cli import spec_from_args

    args = build_parser().parse_args(["serve", spelling, "7"])
    spec = spec_from_args(args)
    assert spec.straggler.config().sustain_s == 7.0
