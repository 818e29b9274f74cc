"""Issue 13: logs that people and log agents both read.

- Every structlog call of the supervisor's packages gives a stable event name
  (a string literal, or a literal headline before ``:``/``;``/``(``, or an
  explicit ``event_name=``), and that name is in docs/logs.md's table with its
  level.  engine/ logs through its own stdlib formatter inside the rank
  processes (engine/log.py); its texts are checked for stable names too, but
  its lines are rank output, not rows of the supervisor's table.
- A real ``supervise serve --log-format json`` run whose rank crashes writes
  only JSON lines (the rank's traceback as ``rank_output`` records), each with
  message/level/timestamp/logger/event, named as documented.
- Library records, warnings and uncaught exceptions of a process that
  configured JSON logs are JSON lines too.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta

import pytest

from tests.conftest import ROOT, fake_rank
from tp_supervise.supervisor.logs import HEAD_KEYS, LIBRARY_EVENT, UNFORMATTABLE_EVENT, WARNING_EVENT, event_name

DOC = ROOT / "docs" / "logs.md"
PACKAGES = ("supervisor", "dumps", "watchdogs", "consensus")
RANK_SIDE = ROOT / "supervisor" / "rank"  # stdlib only, runs in the ranks: no structlog there
ENGINE = ("engine",)
LEVELS = {"debug": "debug", "info": "info", "warning": "warning", "warn": "warning", "error": "error",
          "exception": "error", "critical": "critical"}
FOREIGN = {LIBRARY_EVENT, WARNING_EVENT}

# Call sites whose text is not a literal, in files other engineers own, with the
# names they emit or are to emit.  Each entry must still match a call (the test
# says when one is fixed: drop it here).  Fix: pass event_name="<name>".
PENDING = {
    # the handshake's progress callback; its only text is "waiting for nodes".
    ("supervisor/nodes/handshake.py", "event"): {"waiting_for_nodes"},
    ("supervisor/nodes/transport.py", "event"): {"waiting_for_nodes"},
}

SERVE_GRACE_S = 2.0
SERVE_DELAY_S = 1.0
SERVE_LIMIT_S = 40.0


# -- the source walk -------------------------------------------------------------------------------
def _receivers(tree: ast.AST) -> set[str]:
    """Names assigned from a ``get_logger(...)`` (or ``rank_output_logger()``) call anywhere in the module (``log``, ``self._log``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("get_logger", "rank_output_logger"):
                names.update(ast.unparse(target) for target in node.targets)
    return names


def _is_log_call(node: ast.AST, receivers: set[str]) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LEVELS):
        return False
    target = node.func.value
    if isinstance(target, ast.Call):  # structlog.get_logger().error(...)
        func = target.func
        return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) == "get_logger"
    return ast.unparse(target) in receivers


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _static_names(text: ast.AST) -> list[str] | None:
    """The event names a text expression gives whatever its run-time value, or None if they vary."""
    literal = _literal(text)
    if literal is not None:
        return [event_name(literal)]
    if isinstance(text, ast.IfExp):
        body, orelse = _static_names(text.body), _static_names(text.orelse)
        return None if body is None or orelse is None else body + orelse
    head = None
    if isinstance(text, ast.BinOp) and isinstance(text.op, ast.Add):
        head = _literal(text.left)
    elif isinstance(text, ast.JoinedStr) and text.values:
        head = _literal(text.values[0])
    if head is not None and re.search(r"[:;(]", head):
        return [event_name(head)]  # "hang: " + detail: the headline is literal
    return None


def log_calls(packages=PACKAGES) -> list[tuple[str, int, str, str, list[str] | None]]:
    """(path, line, level, text source, names or None) of every structlog call under ``packages``."""
    found = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            if RANK_SIDE in path.parents:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            receivers = _receivers(tree)
            for node in ast.walk(tree):
                if not _is_log_call(node, receivers) or not node.args:
                    continue
                explicit = next((k.value for k in node.keywords if k.arg == "event_name"), None)
                names = [_literal(explicit)] if explicit is not None and _literal(explicit) else None
                rel = path.relative_to(ROOT).as_posix()
                found.append((rel, node.lineno, LEVELS[node.func.attr], ast.unparse(node.args[0]),
                              names or _static_names(node.args[0])))
    return found


def documented() -> dict[str, set[str]]:
    """docs/logs.md's event table: name -> levels."""
    section = DOC.read_text().split("## Event names", 1)[1].split("\n## ", 1)[0]
    table = {}
    for match in re.finditer(r"^\|\s*`([a-z0-9_]+)`\s*\|\s*([a-z, ]+?)\s*\|", section, re.MULTILINE):
        table[match.group(1)] = {level.strip() for level in match.group(2).split(",")}
    assert len(table) > 20, "docs/logs.md's event table was not found"
    return table


def emitted() -> dict[str, set[str]]:
    """Every name the supervisor's code logs -> its levels (PENDING call sites by their names)."""
    names: dict[str, set[str]] = {}
    for path, _line, level, text, static in log_calls():
        for name in static or PENDING.get((path, text), ()):
            names.setdefault(name, set()).add(level)
    return names


def test_every_event_text_gives_a_stable_name():
    varying = [f"{path}:{line}: {text}" for path, line, _level, text, names in log_calls(PACKAGES + ENGINE)
               if names is None and (path, text) not in PENDING]
    assert not varying, (
        "log calls whose event text is not a string literal (its name would change with the values; "
        "log the values as fields, or pass event_name=...):\n" + "\n".join(varying))
    calls = {(path, text) for path, _line, _level, text, names in log_calls() if names is None}
    fixed = [f"{path}: {text}" for path, text in PENDING if (path, text) not in calls]
    assert not fixed, "PENDING entries that no longer match a call (fixed? drop them):\n" + "\n".join(fixed)


def test_every_logged_name_is_in_the_table_with_its_level():
    table = documented()
    missing = sorted(name for name in emitted() if name not in table)
    assert not missing, f"event names missing from docs/logs.md: {missing}"
    wrong = {name: (sorted(levels), sorted(table[name])) for name, levels in emitted().items()
             if not levels <= table[name]}
    assert not wrong, f"levels in code vs docs/logs.md: {wrong}"


def test_the_table_lists_only_names_that_are_logged():
    stale = sorted(set(documented()) - set(emitted()) - FOREIGN - {"uncaught_exception", UNFORMATTABLE_EVENT})
    assert not stale, f"docs/logs.md names events no code logs: {stale}"


def test_names_are_snake_case():
    assert event_name("rank exited") == "rank_exited"
    assert event_name("hang: rank 1 is stuck in all_reduce (step 40)") == "hang"
    assert event_name("dump.captured") == "dump_captured"
    assert event_name("incident bundle not written within --dump-timeout; exiting") == \
        "incident_bundle_not_written_within_dump_timeout"
    for name in documented():
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", name), name


# -- real processes --------------------------------------------------------------------------------
def json_lines(*streams: str) -> list[dict]:
    """Every line of the streams that is a JSON object."""
    out = []
    for text in streams:
        for raw in text.splitlines():
            raw = raw.strip()
            if raw.startswith("{"):
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict):
                    out.append(line)
    return out


def assert_agent_keys(line: dict) -> None:
    for key in HEAD_KEYS:
        assert isinstance(line.get(key), str) and line[key], f"{key} missing: {line}"
    assert list(line)[: len(HEAD_KEYS)] == list(HEAD_KEYS), line
    assert line["level"] in ("debug", "info", "warning", "error", "critical"), line
    stamp = datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00"))
    assert stamp.utcoffset() == timedelta(0), line


def test_serve_json_lines_carry_the_agent_keys_and_documented_names(supervise):
    run = supervise(["--nproc-per-node", "2", "--kill-grace", str(SERVE_GRACE_S)],
                    fake_rank("--all", "sleep", "--on", "1=raise", "--delay", str(SERVE_DELAY_S)))
    assert run.wait(timeout=SERVE_LIMIT_S) == 80, run.stderr[-3000:]
    # Every line, the ranks' own text included (rank_output records, supervisor/processes/output_pump.py).
    raw = (run.stdout + run.stderr).splitlines()
    lines = json_lines(run.stdout, run.stderr)
    assert len(lines) == len(raw) >= 5, [line for line in raw if not line.startswith("{")][:5]
    table = documented()
    for line in lines:
        assert_agent_keys(line)
        assert line["logger"].startswith("tp_supervise.") or line["event"] in FOREIGN, line
        assert line["event"] in table, f"undocumented event: {line}"
        if line["event"] not in FOREIGN:  # a library's record has the library's level
            assert line["level"] in table.get(line["event"], {line["level"]}), line
    names = [line["event"] for line in lines]
    for expected in ("supervise_starting", "rank_started", "incident_bundle_written", "teardown_complete",
                     "supervise_exiting"):
        assert expected in names, (expected, names)
    death = [line for line in lines if line["event"] == "rank_exited"]
    assert death and death[0]["rank"] == 1 and "exit" in death[0]["message"], death
    said = [line["message"] for line in lines if line["event"] == "rank_output" and line.get("rank") == 1]
    assert "RuntimeError: injected failure in fake rank" in said, said
    assert run.events("rank started") and run.events("rank_started"), "Run.events finds text and name alike"


FOREIGN_SCRIPT = textwrap.dedent(
    """
    import logging, sys, threading, warnings
    from tp_supervise.supervisor import logs
    import structlog

    logs.configure("json", stream=sys.stdout)
    log = structlog.get_logger("some.name")
    log.info("rank joined the group", rank=1)
    log.info("rank_output", message="a rank's own line: {not json}", rank=0, stream="stdout")
    log.warning("dump.captured", event_name="explicitly_named")
    log.debug("below the level")
    try:
        1 / 0
    except ZeroDivisionError:
        log.exception("supervisor internal error: tearing down every rank")
    logging.getLogger("torch.distributed").warning("library text %s", "with args")
    logging.getLogger("urllib3").debug("below the level too")
    warnings.warn("a library warns", UserWarning)
    worker = threading.Thread(target=lambda: 1 / 0, name="worker-1")
    worker.start()
    worker.join()
    raise RuntimeError("the end")
    """
)


def test_json_mode_turns_every_line_of_the_process_into_json(tmp_path):
    script = tmp_path / "emit.py"
    script.write_text(FOREIGN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == "", proc.stderr  # the uncaught exception went to the log, not to stderr
    raw = proc.stdout.splitlines()
    lines = [json.loads(line) for line in raw]  # every line parses
    for line in lines:
        assert_agent_keys(line)
    by_event = {line["event"]: line for line in lines}
    assert list(by_event) == ["rank_joined_the_group", "rank_output", "explicitly_named", "supervisor_internal_error",
                              LIBRARY_EVENT, WARNING_EVENT, "uncaught_exception"], list(by_event)
    joined = by_event["rank_joined_the_group"]
    assert joined["message"] == "rank joined the group" and joined["rank"] == 1
    assert joined["logger"] == "__main__", "the logging module's name, not the name given to get_logger"
    assert by_event["rank_output"]["message"] == "a rank's own line: {not json}"
    assert by_event["explicitly_named"]["message"] == "dump.captured"
    assert "ZeroDivisionError" in by_event["supervisor_internal_error"]["exception"]
    library = by_event[LIBRARY_EVENT]
    assert (library["logger"], library["message"], library["level"]) == \
        ("torch.distributed", "library text with args", "warning")
    assert "a library warns" in by_event[WARNING_EVENT]["message"]
    crashes = [line for line in lines if line["event"] == "uncaught_exception"]
    assert [c.get("thread") for c in crashes] == ["worker-1", None]
    assert "RuntimeError: the end" in crashes[1]["exception"]


@pytest.mark.parametrize("args", [["--log-format", "json", "--nproc-per-node", "0"], ["--log-format=json", "--bogus"]])
def test_refusals_before_the_run_are_json_lines_too(args):
    out = subprocess.run([sys.executable, "-m", "tp_supervise.supervisor.cli", "serve", *args, "--", "true"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 64
    lines = [json.loads(line) for line in (out.stdout + out.stderr).splitlines()]
    assert lines and all(line["event"] == "usage_error" and line["level"] == "error" for line in lines), lines
    assert lines[0]["message"].startswith("supervise: error: ")
