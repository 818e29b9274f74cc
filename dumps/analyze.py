"""``supervise analyze BUNDLE [--json]``: render an incident bundle.

Without ``--json``: the verdict, a per-rank table and the grouped stacks
(rich).  With ``--json``: the bundle's ``summary.json`` content on stdout
(the same keys, so scripts can read either).  Exit 0 on success, 2 when the
path is not a bundle (the message says what it is instead), 65 (EX_DATAERR)
when it is a malformed bundle.

A bundle may come from anywhere (a ticket, another host), so it is read
defensively: only regular files inside it, opened without following links
(a ``stacks/rank-0.txt`` that links to ``/etc/shadow`` is refused, so is a
hard link), never a FIFO or a device (opened non-blocking, checked before
reading), each file capped in size, and ``summary.json`` checked against its
schema (wrong types, or nesting deeper than any bundle has, are "malformed
bundle", never a traceback).  What it prints is plain text (dumps.render).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path

from rich.console import Console

from .bundle import BUNDLE_NAME, SUMMARY_JSON, stacks_from_files
from .render import data, render

EXIT_OK = 0
EXIT_NOT_A_BUNDLE = 2
EXIT_MALFORMED = 65  # EX_DATAERR
MAX_SUMMARY_BYTES = 4 << 20
MAX_STACK_BYTES = 1 << 20
MAX_STACK_FILES = 4096
MAX_DEPTH = 16  # summary.json nests 4 levels; anything deeper is not ours
STACKS_DIR = "stacks"


class NotABundle(ValueError):
    pass


class MalformedBundle(ValueError):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="supervise analyze", description="Render an incident bundle.")
    p.add_argument(
        "bundles",
        type=Path,
        nargs="+",
        metavar="bundle",
        help="bundle directory (<dump-dir>/<time>-<reason>[-N]); several: the bundles of one incident "
        "from several nodes, rendered as one",
    )
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
        return f"{path}: not a bundle but a dump dir with {len(inner)} bundle(s); newest: {path / inner[-1]}"
    return f"{path}: not a bundle (no {SUMMARY_JSON})"


def read_member(dir_fd: int, name: str, cap: int) -> bytes:
    """A regular file directly in the directory ``dir_fd``: no link followed, no FIFO or device, at most ``cap`` bytes."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{name} is not a regular file")
        if st.st_nlink > 1:
            raise OSError(f"{name} is a hard link to a file outside the bundle")
        chunks, left = [], cap
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _depth(value, limit: int) -> int:
    """Nesting depth of a JSON value, without recursion (stops counting past ``limit``)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise MalformedBundle(what)


def check_summary(summary) -> dict:
    """The schema ``render`` relies on; raises MalformedBundle naming the first field that breaks it."""
    _check(isinstance(summary, dict), "summary.json is not a JSON object")
    _check(_depth(summary, MAX_DEPTH) <= MAX_DEPTH, f"summary.json nests deeper than {MAX_DEPTH} levels")
    _check("verdict" in summary and "ranks" in summary, "summary.json has no verdict/ranks")
    _check(isinstance(summary["verdict"], str), "'verdict' is not a string")
    for key in ("reason", "run_id", "detected_at", "class", "incident_id"):
        _check(summary.get(key) is None or isinstance(summary[key], str), f"'{key}' is not a string")
    ranks = summary["ranks"]
    _check(isinstance(ranks, dict), "'ranks' is not an object")
    for key, rank in ranks.items():
        _check(isinstance(rank, dict), f"ranks[{key!r}] is not an object")
        _check(
            rank.get("exit") is None or isinstance(rank["exit"], (dict, str, int)),
            f"ranks[{key!r}].exit has a wrong type",
        )
    culprits = summary.get("culprit_ranks") or []
    _check(
        isinstance(culprits, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in culprits),
        "'culprit_ranks' is not a list of rank numbers",
    )
    for key in ("notes", "errors"):
        items = summary.get(key) or []
        _check(isinstance(items, list), f"'{key}' is not a list")
    _check_nodes(summary)
    groups = summary.get("stack_groups") or []
    _check(isinstance(groups, list), "'stack_groups' is not a list")
    for g in groups:
        _check(isinstance(g, dict), "a stack group is not an object")
        members = g.get("ranks") or []
        _check(
            isinstance(members, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in members),
            "a stack group's 'ranks' is not a list of rank numbers",
        )
        for key in ("short", "signature"):
            _check(g.get(key) is None or isinstance(g[key], str), f"a stack group's '{key}' is not a string")
    return summary


def _check_nodes(summary: dict) -> None:
    """A multi-node bundle's ``nodes`` (the node summaries it merged) and ``peer_bundles``."""
    nodes = summary.get("nodes")
    _check(nodes is None or isinstance(nodes, dict), "'nodes' is not an object")
    for node, record in (nodes or {}).items():
        _check(isinstance(record, dict), f"nodes[{node!r}] is not an object")
        ranks = record.get("ranks") or {}
        _check(
            isinstance(ranks, dict) and all(isinstance(r, dict) for r in ranks.values()),
            f"nodes[{node!r}].ranks is not an object of rank records",
        )
    peers = summary.get("peer_bundles")
    _check(
        peers is None or (isinstance(peers, dict) and all(isinstance(p, dict) for p in peers.values())),
        "'peer_bundles' is not an object of bundle records",
    )
    missing = summary.get("nodes_missing") or []
    _check(isinstance(missing, list), "'nodes_missing' is not a list")


def _open_bundle(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        raise NotABundle(_not_a_bundle(Path(path))) from None


def load_summary(path: Path) -> dict:
    """summary.json of a bundle; raises NotABundle or MalformedBundle with a message for people."""
    dir_fd = _open_bundle(path)
    try:
        try:
            raw = read_member(dir_fd, SUMMARY_JSON, MAX_SUMMARY_BYTES + 1)
        except FileNotFoundError:
            raise NotABundle(_not_a_bundle(Path(path))) from None
        except OSError as exc:
            raise MalformedBundle(f"{SUMMARY_JSON}: {exc.strerror or exc}") from None
    finally:
        os.close(dir_fd)
    if len(raw) > MAX_SUMMARY_BYTES:
        raise MalformedBundle(f"{SUMMARY_JSON} is larger than {MAX_SUMMARY_BYTES} bytes")
    try:
        summary = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise MalformedBundle(f"{SUMMARY_JSON} is not valid JSON ({type(exc).__name__})") from None
    return check_summary(summary)


def read_stacks(path: Path) -> tuple[dict[int, str], list[str]]:
    """Rank -> stack text, safely; and what was refused (a link, a FIFO, ...), for the reader to see."""
    files: dict[str, bytes] = {}
    refused: list[str] = []
    dir_fd = _open_bundle(path)
    try:
        try:
            stacks_fd = os.open(STACKS_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError:
            return {}, refused
        try:
            names = sorted(os.listdir(stacks_fd))[:MAX_STACK_FILES]
            for name in names:
                if not name.startswith("rank-") or not name.endswith(".txt"):
                    continue
                try:
                    files[f"{STACKS_DIR}/{name}"] = read_member(stacks_fd, name, MAX_STACK_BYTES)
                except OSError as exc:
                    refused.append(f"{STACKS_DIR}/{name}: not read ({exc.strerror or exc})")
        finally:
            os.close(stacks_fd)
    finally:
        os.close(dir_fd)
    return stacks_from_files(files), refused


def _origin_first(summaries: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """The node where the incident began first (its reason is not a peer's), then the others by node rank."""

    def key(item):
        reason = item[1].get("reason")
        return (reason in ("peer_failed", "node_lost"), item[1].get("node_rank") or 0)

    return sorted(summaries, key=key)


def merged(summaries: list[tuple[Path, dict]]) -> dict:
    """Several nodes' bundles of one incident as one record (``--json``)."""
    ordered = _origin_first(summaries)
    origin = ordered[0][1]
    ids = sorted({str(s.get("incident_id")) for _, s in summaries if s.get("incident_id")})
    return {
        "incident_id": ids[0] if len(ids) == 1 else ids,
        "run_id": origin.get("run_id"),
        "reason": origin.get("reason"),
        "culprit_ranks": origin.get("culprit_ranks") or [],
        "verdict": origin.get("verdict"),
        "nodes": {str(s.get("node_rank", i)): dict(s, bundle=str(path)) for i, (path, s) in enumerate(ordered)},
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    loaded: list[tuple[Path, dict]] = []
    for bundle in args.bundles:
        try:
            loaded.append((bundle, load_summary(bundle)))
        except NotABundle as exc:
            print(f"supervise analyze: {exc}", file=sys.stderr)
            return EXIT_NOT_A_BUNDLE
        except MalformedBundle as exc:
            print(f"supervise analyze: {bundle}: malformed bundle: {exc}", file=sys.stderr)
            return EXIT_MALFORMED
    if args.json:
        json.dump(loaded[0][1] if len(loaded) == 1 else merged(loaded), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    console = Console(highlight=False)
    if len(loaded) > 1:
        whole = merged(loaded)
        ids = whole["incident_id"]
        console.print(
            data(
                f"incident {ids if isinstance(ids, str) else ' / '.join(ids)}: {len(loaded)} node bundles", style="bold"
            )
        )
        if not isinstance(ids, str):
            console.print(data("! these bundles belong to different incidents", style="yellow"))
    for bundle, summary in _origin_first(loaded):
        stacks, refused = ({}, []) if args.no_stacks else read_stacks(bundle)
        node = summary.get("node_rank")
        console.print(data(f"bundle {bundle}" + (f" (node {node})" if node is not None else ""), style="dim"))
        if refused:
            summary = dict(summary, errors=[*(summary.get("errors") or []), *refused])
        render(summary, console, stacks or None)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
