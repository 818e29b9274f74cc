"""docs/supervisor.md's flag tables say what the ``supervise`` parsers say: names and defaults.

The rule the docs follow, and this test checks (in process: it builds the real
parser, ``build_parser()``, and reads the Markdown; no subprocess):

* A **flag table** is a Markdown table of docs/supervisor.md whose header is
  ``| flag | default | meaning |``.  It documents the subcommand whose section
  it is in: a section starts at a heading that names the subcommand in
  backticks (`` `supervise serve` ``, `` `supervise dump` ``, ...) and ends at
  the next heading of the same or a higher level.  Other tables
  (``| flag | meaning |``, the environment) are prose and not checked.
* **Every option of every subcommand has exactly one row.**  The subcommands
  are found by walking the parser, so one added later is covered without
  touching this test; ``-h``/``--help`` and positionals are left out.
* A row documents **one option**.  Its first cell names the option's first
  spelling (the one ``--help`` shows first), then a metavar if any, and may
  name other spellings, e.g. ``(`--nproc_per_node`)``.  A spelling that is only
  torchrun's underscore twin of a spelling the row names may be left out (the
  page says once that they are accepted); any other spelling must be named.
  Every flag the first cell names must be a spelling of that one option, so a
  row for a flag the parser does not have, or one that mixes two options,
  fails.
* The **default cell**, without its backticks, starts with the argparse
  default as ``formatted()`` writes it: a switch (a flag that takes no value)
  is ``off``; ``None``, ``""`` and ``[]`` are ``none``; a float in Python's
  ``g`` format (600.0 -> ``600``); a relative path as ``./path``; anything else
  as ``str()``.  Words after it explain it (``none (adaptive)``).
* ``COMPUTED``: options whose argparse default is ``None`` because the value
  is worked out at run time.  Their cell says that value instead of ``none``
  and must contain the texts given (taken from the code's constants where
  there is one).  Keep it short: each entry says why it cannot be a literal.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path, PurePath

import pytest

from tp_supervise.supervisor import spec as specs
from tp_supervise.supervisor.cli import build_parser
from tp_supervise.watchdogs.adaptive import AdaptiveParams

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "supervisor.md"
FLAG_HEADER = ["flag", "default", "meaning"]
SUBCOMMAND_HEADING = re.compile(r"`supervise ([a-z][a-z0-9-]*)`")
FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][A-Za-z0-9_-]*")
CELL_SPLIT = re.compile(r"(?<!\\)\|")

_ADAPTIVE = AdaptiveParams()
# (subcommand, first spelling): (texts the default cell must contain, why the default is not a literal)
COMPUTED: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    ("serve", "--nproc-per-node"): (
        (f"{specs.DEFAULT_BUILTIN_TP} for the built-in engine",),
        "the built-in engine's TP, the launcher's own flag in --tree mode",
    ),
    ("serve", "--nnodes"): (("1", "the launcher's --nnodes"), "an engine launcher's own flag in --tree mode"),
    ("serve", "--node-rank"): (("0", "the launcher's --node-rank"), "an engine launcher's own flag in --tree mode"),
    ("serve", "--master-addr"): (("127.0.0.1", "the launcher's"), "an engine launcher's own flag in --tree mode"),
    ("serve", "--master-port"): (("a free port",), "picked when the run starts"),
    ("serve", "--store-port"): (("--master-port + 1",), "follows --master-port"),
    ("serve", "--run-id"): (("node 0 picks",), "made when the run starts, by node 0"),
    ("serve", "--adaptive-floors"): (
        (f"{_ADAPTIVE.soft_floor:g},{_ADAPTIVE.hard_floor:g}",),
        "the adaptive watchdog's own floors",
    ),
    ("serve", "--adaptive-ceilings"): (
        (f"{_ADAPTIVE.soft_ceiling:g},{_ADAPTIVE.hard_ceiling:g}",),
        "the adaptive watchdog's own ceilings",
    ),
    ("serve", "--metrics-linger"): (
        (f"{specs.DEFAULT_FAULT_LINGER_S:g} s after a fault", "0 after a clean run"),
        "decided at exit by how the run ended",
    ),
}


@dataclass(frozen=True)
class Row:
    command: str | None  # None: a flag table under no subcommand heading
    line: int
    flags: tuple[str, ...]
    default: str


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    out: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if all(sub is not seen for seen in out.values()):  # an alias names a parser already seen
                    out[name] = sub
    return out


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def formatted(action: argparse.Action) -> str:
    if action.nargs == 0:  # store_true / store_false / store_const: a switch
        return "off"
    value = action.default
    if value is None or value == "" or value == []:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, PurePath) and not value.is_absolute():
        return f"./{value}"
    return str(value)


def _cells(line: str) -> list[str]:
    cells = [c.strip().replace("\\|", "|") for c in CELL_SPLIT.split(line.strip())]
    return cells[1:-1] if len(cells) >= 2 else cells


def flag_rows(text: str) -> list[Row]:
    rows: list[Row] = []
    command: str | None = None
    command_level = 0  # heading level of the section that names ``command``
    table: str | None = None  # "flag", "other" or None (not in a table)
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            found = SUBCOMMAND_HEADING.search(line)
            if found:
                command, command_level = found.group(1), level
            elif level <= command_level:  # the subcommand's section ended
                command, command_level = None, 0
            table = None
            continue
        if not line.startswith("|"):
            table = None
            continue
        cells = _cells(line)
        if table is None:
            table = "flag" if [c.lower() for c in cells] == FLAG_HEADER else "other"
            continue
        if table != "flag" or all(set(c) <= set("-: ") for c in cells):
            continue
        flags = tuple(FLAG.findall(cells[0].replace("`", "")))
        rows.append(Row(command, number, flags, cells[1].replace("`", "").strip() if len(cells) > 1 else ""))
    return rows


def _twin(spelling: str) -> str:
    """torchrun's underscore spelling of a dash spelling."""
    return spelling[:2] + spelling[2:].replace("-", "_")


def problems(text: str, parser: argparse.ArgumentParser) -> list[str]:
    """Every disagreement between the flag tables in ``text`` and ``parser``, one sentence each."""
    found: list[str] = []
    commands = subcommands(parser)
    documented: dict[tuple[str, int], Row] = {}
    for row in flag_rows(text):
        where = f"docs/supervisor.md:{row.line}"
        if row.command is None or row.command not in commands:
            found.append(
                f"{where}: flag table under no heading naming a subcommand of {sorted(commands)} "
                f"(found {row.command!r})"
            )
            continue
        sub = commands[row.command]
        if not row.flags:
            found.append(f"{where}: the first cell names no flag")
            continue
        owners = {id(a): a for a in sub._actions if a.option_strings and set(a.option_strings) & set(row.flags)}
        unknown = [f for f in row.flags if all(f not in a.option_strings for a in owners.values())]
        if unknown:
            found.append(f"{where}: `supervise {row.command}` has no flag {', '.join(unknown)}")
        if len(owners) != 1:
            if len(owners) > 1:
                found.append(
                    f"{where}: one row per flag, but this one names "
                    f"{' and '.join(a.option_strings[0] for a in owners.values())}"
                )
            continue
        action = next(iter(owners.values()))
        key = (row.command, id(action))
        if key in documented:
            found.append(f"{where}: {action.option_strings[0]} already has a row (line {documented[key].line})")
            continue
        documented[key] = row
        first = action.option_strings[0]
        if first not in row.flags:
            found.append(f"{where}: the row must name {first}, the flag's first spelling")
        for spelling in action.option_strings:
            if spelling not in row.flags and all(spelling == named or spelling != _twin(named) for named in row.flags):
                found.append(f"{where}: the row does not name {spelling}, another spelling of {first}")
        found.extend(_default_problems(where, row, action))
    for name, sub in commands.items():
        for action in options(sub):
            if (name, id(action)) not in documented:
                found.append(
                    f"`supervise {name}` {action.option_strings[0]} has no row in a flag table "
                    f"of docs/supervisor.md (under a heading naming `supervise {name}`)"
                )
    return found


def _default_problems(where: str, row: Row, action: argparse.Action) -> list[str]:
    first = action.option_strings[0]
    computed = COMPUTED.get((row.command, first))
    if computed is not None:
        texts, _why = computed
        return [
            f"{where}: {first}'s default cell {row.default!r} should say {text!r} (computed at run time)"
            for text in texts
            if text not in row.default
        ]
    want = formatted(action)
    if re.match(re.escape(want) + r"(?![\w.-])", row.default):
        return []
    return [
        f"{where}: {first} defaults to {want!r} (argparse default {action.default!r}), the table says {row.default!r}"
    ]


# -- the checks ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def test_flag_tables_match_the_parser(parser):
    found = problems(DOC.read_text(), parser)
    assert not found, "docs/supervisor.md disagrees with build_parser():\n" + "\n".join(found)


def test_the_walk_finds_every_subcommand_and_their_options(parser):
    """Guards the walker itself: if it found nothing, the check above would pass on nothing."""
    commands = subcommands(parser)
    assert {"serve", "dump", "analyze", "drill"} <= set(commands)
    assert len(options(commands["serve"])) > 40
    rows = flag_rows(DOC.read_text())
    assert {r.command for r in rows} >= {"serve", "dump", "analyze", "drill"}


def test_computed_defaults_are_still_computed(parser):
    """An entry of COMPUTED whose flag gained a literal default (or left) would hide drift: it must go."""
    commands = subcommands(parser)
    for (command, first), (texts, why) in COMPUTED.items():
        assert texts and why
        action = next((a for a in options(commands[command]) if a.option_strings[0] == first), None)
        assert action is not None, f"COMPUTED names `supervise {command} {first}`, which the parser lacks"
        assert action.default is None, f"{first} now defaults to {action.default!r}: drop it from COMPUTED"


@pytest.mark.parametrize(
    ("what", "edit", "expect"),
    [
        (
            "a changed default",
            lambda t: t.replace("| `--kill-grace S` | 5 |", "| `--kill-grace S` | 7 |"),
            "--kill-grace defaults to '5'",
        ),
        (
            "a computed default written as a literal",
            lambda t: re.sub(r"(\| `--metrics-linger S` \|)[^|]*\|", r"\1 0 |", t),
            "--metrics-linger's default cell",
        ),
        (
            "a missing row",
            lambda t: re.sub(r"^\| `--consensus-inband N` \|.*\n", "", t, flags=re.M),
            "--consensus-inband has no row",
        ),
        (
            "a flag the parser lacks",
            lambda t: t.replace("| `--native` | off |", "| `--native` | off |\n| `--no-such-flag` | off | x |"),
            "has no flag --no-such-flag",
        ),
        (
            "two flags in one row",
            lambda t: t.replace("| `--nnodes N` | 1;", "| `--nnodes N`, `--node-rank R` | 1;"),
            "one row per flag",
        ),
        (
            "a dump flag documented under drill",
            lambda t: t.replace(
                "| `--tp N` | 2 | ranks of each run of the built-in engine |",
                "| `--tp N` | 2 | ranks of each run of the built-in engine |\n| `--timeout S` | 30 | x |",
            ),
            "`supervise drill` has no flag --timeout",
        ),
    ],
)
def test_the_check_catches_drift(parser, what, edit, expect):
    """The check can fail: each edit of a copy of the page is one kind of drift it must report."""
    text = DOC.read_text()
    edited = edit(text)
    assert edited != text, f"the edit for {what} no longer applies to docs/supervisor.md"
    found = problems(edited, parser)
    assert any(expect in p for p in found), f"{what} not reported; got {found}"
