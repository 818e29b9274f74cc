"""Rendering of a bundle's summary for people (rich), shared by summary.txt and analyze.

Works from the ``summary.json`` dict alone (plus optional stack texts), so
a bundle written by an older version still renders what it has.

Every string here comes from a rank, a bundle or a command line: it is data,
never markup.  It reaches rich only as ``Text`` (so ``[/x]`` in a collective
description is shown verbatim and cannot make a bundle write fail), and
``plain()`` makes control characters other than newline and tab visible
(``\x1b``), so a bundle cannot clear the screen, retitle the window or plant
a hyperlink in the terminal of whoever analyzes it.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping

from rich import box
from rich.console import Console, Group, JustifyMethod
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

TEXT_WIDTH = 110
CULPRIT_STYLE = "bold red"
MAX_STACK_LINES = 60
TITLE_CELL = 40  # a title longer than this (a launcher's command line) is cut in the processes table
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def plain(value) -> str:
    """``value`` as text safe for a terminal: control and bidi-override characters shown as escapes."""
    text = value if isinstance(value, str) else str(value)
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def data(value, style: str | None = None) -> Text:
    """Evidence as rich text: never parsed as markup."""
    return Text(plain(value), style=style or "")


def _exit_cell(exit_info) -> str:
    if not exit_info:
        return ""
    if isinstance(exit_info, Mapping):
        if exit_info.get("description"):
            return str(exit_info["description"])
        if exit_info.get("signal"):
            return str(exit_info["signal"])
        if exit_info.get("code") is not None:
            return f"code {exit_info['code']}"
    return str(exit_info)


def _cell(value) -> Text:
    return data("" if value is None else value)


def rank_table(summary: Mapping) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("rank", "right"),
        ("pid", "right"),
        ("state", "left"),
        ("exit", "left"),
        ("step", "right"),
        ("collective", "left"),
        ("cpu%", "right"),
        ("group", "left"),
        ("where", "left"),
    )
    for col, justify in columns:
        table.add_column(col, justify=justify, overflow="fold")
    ranks = summary.get("ranks") or {}
    for key in sorted(ranks, key=_rank_key):
        r = ranks[key] or {}
        state = "" if r.get("state") is None else str(r.get("state"))
        if r.get("state_name"):
            state = f"{state} ({r['state_name']})"
        collective = r.get("collective") or ("" if not r.get("in_collective") else "yes")
        style = CULPRIT_STYLE if r.get("culprit") else None
        mark = "*" if r.get("culprit") else ""
        table.add_row(
            _cell(f"{mark}{key}"),
            _cell(r.get("pid")),
            _cell(state),
            _cell(_exit_cell(r.get("exit"))),
            _cell(r.get("step")),
            _cell(collective),
            _cell(r.get("cpu_percent")),
            _cell(r.get("stack_group")),
            _cell(r.get("where") or (r.get("stack_error") or "")),
            style=style,
        )
    return table


def process_table(summary: Mapping) -> Table | None:
    """The processes of the run that are not ranks (an engine's scheduler, front end, launcher), by role."""
    procs = summary.get("processes") or {}
    if not isinstance(procs, Mapping) or not procs:
        return None
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, justify in (("role", "left"), ("pid", "right"), ("title", "left"), ("state", "left"),
                         ("step", "left"), ("cpu%", "right"), ("where", "left")):  # fmt: skip
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for pid in sorted(procs, key=_rank_key):
        p = procs[pid] or {}
        state = "" if p.get("state") is None else str(p.get("state"))
        if p.get("state_name"):
            state = f"{state} ({p['state_name']})"
        if not p.get("alive", True):
            state = _exit_cell(p.get("exit")) or "exited"
        step = ""
        if p.get("in_step") is not None:
            step = "in step" if p.get("in_step") else "between steps"
            step += f", {p['phase']}" if p.get("phase") else ""
        title = str(p.get("title") or "")
        table.add_row(
            _cell(f"{'*' if p.get('culprit') else ''}{p.get('role', '?')}"),
            _cell(pid),
            _cell(title if len(title) <= TITLE_CELL else title[: TITLE_CELL - 1] + "…"),
            _cell(state),
            _cell(step),
            _cell(p.get("cpu_percent")),
            _cell(p.get("where") or (p.get("stack_error") or "")),
            style=CULPRIT_STYLE if p.get("culprit") else None,
        )
    return table


def _node_key(item) -> int:
    return _rank_key(item[0])


def nodes_table(summary: Mapping) -> Table:
    """Every node's ranks of a merged multi-node incident (``nodes``), by global rank."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("node", "right"),
        ("rank", "right"),
        ("state", "left"),
        ("exit", "left"),
        ("step", "right"),
        ("collective", "left"),
        ("phase", "left"),
        ("hb age s", "right"),
        ("where", "left"),
    )
    for col, justify in columns:
        table.add_column(col, justify=justify, overflow="fold")
    culprits = set(summary.get("culprit_ranks") or [])
    origin = summary.get("culprit_node")
    rows = []
    for node, record in (summary.get("nodes") or {}).items():
        for key, r in ((record or {}).get("ranks") or {}).items():
            rows.append((_rank_key(key), _rank_key(node), r or {}))
    for rank, node, r in sorted(rows, key=lambda row: (row[0], row[1])):
        culprit = rank in culprits and node == origin
        collective = r.get("collective") or ("" if not r.get("in_collective") else "yes")
        table.add_row(
            _cell(node),
            _cell(f"{'*' if culprit else ''}{rank}"),
            _cell(r.get("state")),
            _cell(_exit_cell(r.get("exit"))),
            _cell(r.get("step")),
            _cell(collective),
            _cell(r.get("phase")),
            _cell(r.get("heartbeat_age_s")),
            _cell(r.get("where")),
            style=CULPRIT_STYLE if culprit else None,
        )
    return table


def _nodes_part(summary: Mapping) -> list:
    nodes = summary.get("nodes") or {}
    lines = [
        data(
            f"evidence of {len(nodes)} nodes merged (incident {summary.get('incident_id', '?')}); "
            f"this is node {summary.get('node_rank', '?')}'s bundle",
            style="bold",
        )
    ]
    for node, record in sorted(nodes.items(), key=_node_key):
        record = record or {}
        lines.append(
            data(
                f"  node {node} ({record.get('host') or '?'}): {record.get('reason') or '?'}, "
                f"bundle {record.get('bundle') or '?'}"
            )
        )
        if record.get("ranks_omitted"):
            lines.append(
                data(f"    {record['ranks_omitted']} ranks left out of its summary (see its bundle)", style="yellow")
            )
    missing = summary.get("nodes_missing") or []
    if missing:
        lines.append(data(f"  no summary in time from node(s) {', '.join(map(str, missing))}", style="yellow"))
    if summary.get("node_verdict"):
        lines.append(data(f"  node {summary.get('culprit_node', '?')}'s own verdict: {summary['node_verdict']}"))
    return [*lines, nodes_table(summary)]


def _peer_bundles_part(summary: Mapping) -> list:
    peers = summary.get("peer_bundles") or {}
    return [
        data(
            f"node {node}'s bundle of this incident ({(p or {}).get('reason') or '?'}, "
            f"{(p or {}).get('host') or '?'}): {(p or {}).get('bundle') or '?'}",
            style="dim",
        )
        for node, p in sorted(peers.items(), key=_node_key)
    ]


def _header(summary: Mapping) -> Text:
    text = Text()
    text.append(plain(summary.get("reason", "?")), style="bold")
    text.append(plain(f"  run {summary.get('run_id', '?')}  detected {summary.get('detected_at', '?')}"))
    if summary.get("class"):
        text.append(plain(f"  class {summary['class']}"), style="bold")
    culprits = summary.get("culprit_ranks") or []
    culprit = summary.get("culprit")
    if isinstance(culprit, Mapping) and culprit.get("role") not in (None, "rank"):
        text.append(plain(f"  culprit {culprit.get('role')} (pid {culprit.get('pid')}, {culprit.get('title')})"))
    else:
        text.append(plain(f"  culprit ranks {culprits if culprits else 'none named'}"))
    return text


def _groups(summary: Mapping, stacks: Mapping[int, str] | None) -> list:
    parts: list = []
    ranks = summary.get("ranks") or {}
    for g in summary.get("stack_groups") or []:
        members = g.get("ranks") or []
        label = f"group {g.get('label', '?')}: ranks {','.join(str(r) for r in members)}"
        body: str = g.get("short") or g.get("signature") or ""
        if stacks:
            sample_rank = next((r for r in members if _has_frames(stacks.get(r, ""))), None)
            if sample_rank is not None:
                lines = stacks[sample_rank].rstrip().splitlines()
                if len(lines) > MAX_STACK_LINES:
                    lines = lines[:MAX_STACK_LINES] + [f"… {len(lines) - MAX_STACK_LINES} more lines"]
                body = f"(stack of rank {sample_rank})\n" + "\n".join(lines)
        parts.append(Panel(data(body), title=data(label), title_align="left", box=box.ROUNDED))
    grouped = {int(r) for g in summary.get("stack_groups") or [] for r in g.get("ranks") or []}
    keys = {str(k) for k in ranks} | {str(r) for r in (stacks or {})}
    for key in sorted(keys, key=_rank_key):
        rank = _rank_key(key)
        if rank in grouped:
            continue
        text = (stacks or {}).get(rank, "")
        if _has_frames(text):
            parts.append(Panel(data(text.rstrip()), title=data(f"rank {key}"), title_align="left", box=box.ROUNDED))
        else:
            err = (ranks.get(key) or {}).get("stack_error") or "no stacks"
            parts.append(data(f"rank {key}: {err}", style="yellow"))
    return parts


def _rank_key(key) -> int:
    text = str(key)
    return int(text) if text.lstrip("-").isdigit() else 0


def _has_frames(text: str) -> bool:
    """Stack files start with '#' comment lines; anything else is a stack."""
    return any(line.strip() and not line.startswith("#") for line in text.splitlines())


def render(summary: Mapping, console: Console, stacks: Mapping[int, str] | None = None) -> None:
    """Verdict, notes, per-rank table and the stack groups."""
    console.print(_header(summary))
    console.print(Panel(data(summary.get("verdict", "(no verdict)"), style="bold"), title="verdict", box=box.HEAVY))
    error = summary.get("error")
    if isinstance(error, Mapping) and (error.get("traceback") or error.get("message")):
        culprits = summary.get("culprit_ranks") or []
        title = f"exception of rank {culprits[0]}" if culprits else "exception"
        if error.get("source") == "stderr":  # no @record error file: the last traceback of its stderr
            title += " (from its stderr)"
        body = str(error.get("traceback") or error.get("message")).rstrip()
        lines = body.splitlines()
        if len(lines) > MAX_STACK_LINES:
            lines = [f"… {len(lines) - MAX_STACK_LINES} earlier lines"] + lines[-MAX_STACK_LINES:]
        console.print(Panel(data("\n".join(lines)), title=data(title), title_align="left", box=box.ROUNDED))
    if isinstance(summary.get("nodes"), Mapping) and summary["nodes"]:
        for part in _nodes_part(summary):
            console.print(part)
    elif isinstance(summary.get("peer_bundles"), Mapping):
        for part in _peer_bundles_part(summary):
            console.print(part)
    for note in summary.get("notes") or []:
        console.print(data(f"- {note}"))
    for err in summary.get("errors") or []:
        console.print(data(f"! {err}", style="yellow"))
    console.print(rank_table(summary))
    procs = process_table(summary)
    if procs is not None:
        console.print(procs)
    groups = _groups(summary, stacks)
    if groups:
        console.print(Group(*groups))


def summary_text(summary: Mapping, stacks: Mapping[int, str] | None = None) -> str:
    """Plain-text rendering (no colour) for summary.txt."""
    buf = io.StringIO()
    console = Console(file=buf, width=TEXT_WIDTH, color_system=None, force_terminal=False, highlight=False)
    render(summary, console, stacks)
    return buf.getvalue()
