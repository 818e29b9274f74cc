"""The command line of ``supervise``: every subcommand's flags, their help and defaults, and how a refusal
before anything starts is said (``say_error``: text for people, a JSON line with ``--log-format json``).

Parsing only: what the flags mean for a run is ``spec_from_args`` (``cli/__init__.py``) and ``spec.py``.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path
from typing import NoReturn

import structlog

from ..outcome import EXIT_USAGE
from .serve_flags import add_serve_arguments, seconds

_json_errors = False  # --log-format json: errors before the run are JSON lines too (docs/logs.md, usage_error)


def wants_json_logs(argv: list[str]) -> bool:
    """``--log-format json`` on the command line, read before argparse (whose errors come first)."""
    return "--log-format=json" in argv or any(
        a == "--log-format" and b == "json" for a, b in zip(argv, argv[1:], strict=False)
    )


def errors_as_json(on: bool) -> None:
    """Refusals before the run (``say_error``, argparse's) as JSON lines (``--log-format json``) or as text."""
    global _json_errors
    _json_errors = on


def say_error(message: str) -> None:
    """A refusal before anything starts: ``supervise: error: ...`` for people, a JSON line for machines."""
    if not _json_errors:
        print(f"supervise: error: {message}", file=sys.stderr)
        return
    from .. import logs

    logs.ensure_json()
    structlog.get_logger("supervise.cli").error(
        "supervise: error", event_name="usage_error", message=f"supervise: error: {message}"
    )


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # argparse exits 2; our contract says 64
        if not _json_errors:
            self.print_usage(sys.stderr)
        say_error(message)
        raise SystemExit(EXIT_USAGE)


_STATES_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


class _HelpFormatter(argparse.HelpFormatter):
    """``--help`` states each default once.

    A help text that names its default in words ("default: a free port") is printed as written; any other
    option that takes a value and has one gets ``(default: X)``; a switch, and an option left unset by
    default (None, "", []), get nothing added (tests/test_cli_help.py)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or action.nargs == 0 or _STATES_DEFAULT.search(text):
            return action.help
        value = action.default
        if value is None or value is argparse.SUPPRESS or value == "" or value == []:
            return action.help
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        return f"{text} (default: {shown.replace('%', '%%')})"

    def _split_lines(self, text: str, width: int) -> list[str]:
        """As argparse's, but a flag name is never cut at one of its hyphens."""
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _VersionAction(argparse.Action):
    """``supervise --version``: the installed distribution's version, read only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace, values, option_string=None) -> NoReturn:
        print(f"{parser.prog} {package_version()}")
        parser.exit()


DISTRIBUTION = "tp-supervise"  # [project] name in pyproject.toml


def package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="supervise", description="Fault detection and hang diagnosis for tensor-parallel inference.")
    parser.add_argument("--version", action=_VersionAction, help="print the installed version of tp-supervise and exit")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    serve = sub.add_parser(
        "serve",
        help="launch and supervise the TP ranks",
        description="Launch and supervise the TP ranks. With no COMMAND, run the built-in reference engine. torchrun's spellings (--nproc_per_node, --node_rank, ...) are accepted too.",
    )
    add_serve_arguments(serve)
    serve.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")

    dump = sub.add_parser("dump", help="on-demand soft dump of a running supervised job")
    dump.add_argument("--run-id", metavar="ID", help="which job (default: the only one running on this host)")
    dump.add_argument(
        "--timeout",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for the supervisor's answer (the bundle written)",
    )

    status = sub.add_parser("status", help="every rank of a running supervised job, now (or live with --watch)")
    status.add_argument("--run-id", metavar="ID", help="which job (default: the only one running on this host)")
    status.add_argument("--json", action="store_true", help="print the status reply as JSON (once)")
    status.add_argument("--watch", action="store_true", help="a live table, refreshed every --interval, until Ctrl-C")
    status.add_argument(
        "--interval", type=seconds, default=1.0, metavar="SECONDS", help="--watch: seconds between refreshes"
    )
    status.add_argument(
        "--timeout", type=seconds, default=5.0, metavar="SECONDS", help="how long to wait for the job's answer"
    )

    analyze = sub.add_parser("analyze", help="render an incident bundle")
    analyze.add_argument("bundle", type=Path, nargs="+", help="a bundle, or several nodes' bundles of one incident")
    analyze.add_argument(
        "--json",
        action="store_true",
        help="print summary.json instead (several bundles: one record with every node's summary under 'nodes')",
    )

    drill = sub.add_parser(
        "drill",
        help="run the fault matrix against the built-in engine, or against COMMAND (signals to rank 1, behind the relay)",
    )
    drill.add_argument(
        "--kinds",
        default=None,
        metavar="K1,K2,...",
        help="comma-separated kinds or 'all' (default: every inject kind of the built-in engine, poison included; "
        "for a COMMAND kill_rank,stop_rank; a COMMAND takes the kinds and families --list-kinds shows)",
    )
    drill.add_argument("--tp", type=int, default=2, metavar="N", help="ranks of each run of the built-in engine")
    drill.add_argument(
        "--dump-dir",
        type=Path,
        default=Path("supervise-drill"),
        metavar="DIR",
        help="each kind's bundles go to DIR/<kind>/, its supervisor's log to DIR/<kind>.log",
    )
    drill.add_argument("--json", action="store_true", help="print one JSON record per kind instead of the table")
    drill.add_argument(
        "--serve-flags",
        default="",
        metavar="'FLAGS'",
        help="a COMMAND's drill: flags of supervise serve for each run, in one string (e.g. --serve-flags=--tree; the = keeps argparse from reading it as a flag)",
    )
    drill.add_argument(
        "--ready-timeout",
        type=seconds,
        default=600.0,
        metavar="SECONDS",
        help="a COMMAND's drill: how long the engine may take to serve, at the start and again after the fault",
    )
    drill.add_argument(
        "--load-before",
        type=seconds,
        default=25.0,
        metavar="SECONDS",
        help="a COMMAND's drill: how long the load runs before the fault (the watchdog learns the engine's steps "
        "from it, as it has in production; before that its warm-up thresholds apply)",
    )
    drill.add_argument(
        "--roles",
        default=None,
        metavar="R1,R2,...",
        help="a COMMAND's drill: only the kinds that break a process of these roles (rank, scheduler, frontend, node)",
    )
    drill.add_argument(
        "--trials", type=int, default=1, metavar="N", help="a COMMAND's drill: run each kind N times (default 1)"
    )
    drill.add_argument(
        "--markdown", action="store_true", help="a COMMAND's drill: print the table as markdown (for a runbook)"
    )
    drill.add_argument(
        "--list-kinds", action="store_true", help="list a COMMAND's drill kinds, what each does and expects, and exit"
    )
    drill.add_argument(
        "--soak",
        type=float,
        default=None,
        metavar="MINUTES",
        help="a COMMAND's drill: no fault, MINUTES of realistic load; every verdict is a false alarm",
    )
    drill.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]: drill this engine instead")
    return parser
