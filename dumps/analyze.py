"""``supervise analyze BUNDLE [--json]``: render an incident bundle.

Without ``--json``: the verdict, a per-rank table and the grouped stacks
(rich).  With ``--json``: the bundle's ``summary.json`` content on stdout
(the same keys, so scripts can read either).  Exit 0 on success, 2 when
the path is not a bundle (the message says what it is instead).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from .bundle import BUNDLE_NAME, SUMMARY_JSON, read_stacks
from .render import render

EXIT_OK = 0
EXIT_NOT_A_BUNDLE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="supervise analyze", description="Render an incident bundle.")
    p.add_argument("bundle", type=Path, help="bundle directory (<dump-dir>/<time>-<reason>[-N])")
    p.add_argument("--json", action="store_true", help="print summary.json-compatible JSON")
    p.add_argument("--no-stacks", action="store_true", help="leave the grouped stacks out")
    return p


def _not_a_bundle(path: Path) -> str:
    if not path.exists():
        return f"{path}: no such file or directory"
    if not path.is_dir():
        return f"{path}: not a bundle (a bundle is a directory with {SUMMARY_JSON})"
    inner = sorted(p.name for p in path.iterdir() if p.is_dir() and BUNDLE_NAME.match(p.name))
    if inner:
        return (
            f"{path}: not a bundle but a dump dir with {len(inner)} bundle(s); "
            f"newest: {path / inner[-1]}"
        )
    return f"{path}: not a bundle (no {SUMMARY_JSON})"


def load_summary(path: Path) -> dict:
    """summary.json of a bundle; raises ValueError with a message for people."""
    file = Path(path) / SUMMARY_JSON
    if not file.is_file():
        raise ValueError(_not_a_bundle(Path(path)))
    try:
        summary = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: unreadable summary ({exc})") from exc
    if not isinstance(summary, dict) or "verdict" not in summary or "ranks" not in summary:
        raise ValueError(f"{file}: not a tp-supervise summary (no verdict/ranks)")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        summary = load_summary(args.bundle)
    except ValueError as exc:
        print(f"supervise analyze: {exc}", file=sys.stderr)
        return EXIT_NOT_A_BUNDLE
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    stacks = None if args.no_stacks else read_stacks(args.bundle)
    console = Console(highlight=False)
    console.print(f"[dim]bundle {args.bundle}[/dim]")
    render(summary, console, stacks)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
