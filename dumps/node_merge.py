"""Several nodes' evidence of one incident as one verdict (multi-node).

Each node's supervisor writes its own bundle of its own ranks under the
incident's id, then publishes a **node summary** of it to the supervisors'
store (``node_summary``): a compact, bounded JSON record (at most
``MAX_NODE_SUMMARY_BYTES``) of what that node saw, per global rank::

    {"version": 1, "node_rank": 0, "host": "gpu-a", "bundle": "/dumps/2026…-peer_failed",
     "reason": "peer_failed", "incident_id": "…", "detected_at": "…",
     "verdict": "…", "culprit_ranks": [1],
     "ranks": {"0": {"state": "S", "alive": true, "exit": null, "in_collective": true,
                     "collective": "all_reduce #31 [64 float32]", "collective_seq": 31,
                     "step": 4, "phase": "decode", "heartbeat_age_s": 6.2,
                     "where": "all_reduce (distributed_c10d.py)", "culprit": false}},
     "processes": [{"role": "scheduler", "who": "vLLM's engine core (pid 12, VLLM::EngineCore)",
                    "state": "S", "alive": true, "exit": null, "in_step": true, "phase": "execute",
                    "where": "acquire_read (shm_broadcast.py)", "culprit": false}]}

``processes``: the engine's control plane on that node (its scheduler and front end), when it has one.

The originating node (the one whose fault the others followed) merges the
summaries it heard (``merge``): the culprit named by global rank *and* node,
then where every other rank of every node is, grouped ("rank 1 on node 1 is
stopped (state T) at step 4; rank 0 on node 0 waits in all_reduce #31"),
then that node's own verdict.  The root cause first, then the consequences.

Pure: plain dicts in, plain dicts and text out; no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

SUMMARY_VERSION = 1
MAX_NODE_SUMMARY_BYTES = 16 * 1024
VERDICT_CHARS = 1000
FIELD_CHARS = 200
SHORT_FIELD_CHARS = 60  # what a field keeps when a node has too many ranks for the full record
RANK_FIELDS = (
    "state",
    "alive",
    "exit",
    "in_collective",
    "collective",
    "collective_seq",
    "step",
    "phase",
    "heartbeat_age_s",
    "where",
    "culprit",
)
TEXT_FIELDS = ("collective", "where", "phase", "exit", "last_wait")
ESSENTIAL_FIELDS = ("state", "alive", "exit", "in_collective", "collective", "step", "culprit", "last_wait")
PEER_REASONS = ("peer_failed", "node_lost")  # a node that followed another's fault

# One rank's record: the fields of RANK_FIELDS (only ESSENTIAL_FIELDS when trimmed), ``last_wait`` when known.
RankRecord = dict[str, Any]


class _NodeSummaryFields(TypedDict):
    version: int
    node_rank: int
    host: str
    bundle: str
    reason: str
    incident_id: str
    detected_at: str
    verdict: str
    culprit_ranks: list[int]
    ranks: dict[str, RankRecord]  # global rank (as text) -> its record, culprits first


class NodeSummary(_NodeSummaryFields, total=False):
    """What ``node_summary`` publishes (the module doc shows one)."""

    ranks_omitted: int  # ranks left out to stay within the size bound
    processes: list[dict[str, Any]]  # the node's control plane (scheduler, front end)


CONTROL_ROLES = ("scheduler", "frontend")
PROCESS_FIELDS = ("role", "who", "state", "alive", "exit", "in_step", "phase", "where", "culprit")


def _text(value, limit: int) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _exit_text(exit_info) -> str | None:
    """A rank's exit as the verb phrase the exit classifier wrote ("exited with code 3")."""
    if not exit_info:
        return None
    if isinstance(exit_info, Mapping):
        if exit_info.get("description"):
            return str(exit_info["description"])
        if exit_info.get("signal"):
            return f"was killed by {exit_info['signal']}"
        if exit_info.get("code") is not None:
            return f"exited with code {exit_info['code']}"
    return str(exit_info)


def _rank_record(entry: Mapping, limit: int, last_wait: str | None) -> RankRecord:
    out = {key: entry.get(key) for key in RANK_FIELDS}
    out["exit"] = _exit_text(entry.get("exit"))
    if last_wait and not entry.get("in_collective"):
        out["last_wait"] = last_wait
    for key in TEXT_FIELDS:
        if out.get(key) is not None:
            out[key] = _text(out[key], limit)
    return out


def _size(record: Mapping) -> int:
    return len(encode(record))


def _rank_order(ranks: Mapping[str, Mapping]) -> list[str]:
    """Culprits first (they must survive any trimming), then by rank."""
    return sorted(ranks, key=lambda key: (not ranks[key].get("culprit"), _as_int(key)))


def node_summary(
    summary: Mapping,
    *,
    node_rank: int,
    host: str,
    bundle: str,
    last_waits: Mapping[int, str] | None = None,
    max_bytes: int = MAX_NODE_SUMMARY_BYTES,
) -> NodeSummary:
    """The compact record of one node's bundle (its ``summary.json`` content), at most ``max_bytes`` encoded.

    ``last_waits``: rank -> the collective it was last seen in (``"all_reduce #31 [64 float32]"``) for a rank
    that is out of it now with no heartbeat since it entered it: it waited there until the collective
    ended without it (the group broke as another node tore its ranks down, before this node's capture).
    It becomes the rank's ``last_wait``.

    Too many ranks for the full record: every rank keeps its essential fields, shortened; still too many:
    ranks are left out (culprits last) and ``ranks_omitted`` says how many."""
    culprits = [r for r in summary.get("culprit_ranks") or [] if isinstance(r, int)]
    out: NodeSummary = {
        "version": SUMMARY_VERSION,
        "node_rank": node_rank,
        "host": _text(host, FIELD_CHARS),
        "bundle": _text(bundle, 4 * FIELD_CHARS),
        "reason": _text(summary.get("reason"), FIELD_CHARS),
        "incident_id": _text(summary.get("incident_id"), FIELD_CHARS),
        "detected_at": _text(summary.get("detected_at"), FIELD_CHARS),
        "verdict": _text(summary.get("verdict"), VERDICT_CHARS),
        "culprit_ranks": culprits[:64],
        "ranks": {},
    }
    raw = summary.get("ranks")
    entries = {str(k): v for k, v in raw.items() if isinstance(v, Mapping)} if isinstance(raw, Mapping) else {}
    waits = {str(rank): text for rank, text in (last_waits or {}).items()}
    out["ranks"] = {key: _rank_record(entries[key], FIELD_CHARS, waits.get(key)) for key in _rank_order(entries)}
    control = _control_records(summary)
    if control:
        out["processes"] = control
    if _size(out) <= max_bytes:
        return out
    out["ranks"] = {
        key: {
            f: v
            for f, v in _rank_record(entries[key], SHORT_FIELD_CHARS, waits.get(key)).items()
            if f in ESSENTIAL_FIELDS
        }
        for key in _rank_order(entries)
    }
    kept = list(out["ranks"])
    while kept and _size(out) > max_bytes:
        out["ranks"].pop(kept.pop())  # the last in order: a non-culprit with the highest rank
        out["ranks_omitted"] = len(entries) - len(kept)
    return out


def _control_records(summary: Mapping) -> list[dict[str, Any]]:
    """The node's control-plane processes (at most 4), the summary's culprit marked among them."""
    procs = summary.get("processes")
    named = summary.get("culprit")
    culprit_pid = named.get("pid") if isinstance(named, Mapping) and named.get("role") in CONTROL_ROLES else None
    out = []
    for p in procs.values() if isinstance(procs, Mapping) else []:
        if not isinstance(p, Mapping) or p.get("role") not in CONTROL_ROLES:
            continue
        record = {f: p.get(f) for f in PROCESS_FIELDS}
        record["exit"] = _exit_text(p.get("exit"))
        record["culprit"] = bool(p.get("culprit")) or (culprit_pid is not None and p.get("pid") == culprit_pid)
        for key in ("who", "where", "phase", "exit"):
            if record.get(key) is not None:
                record[key] = _text(record[key], FIELD_CHARS)
        out.append(record)
    return sorted(out, key=lambda r: not r["culprit"])[:4]


def encode(record: Mapping) -> bytes:
    return json.dumps(record, separators=(",", ":"), sort_keys=True, default=str).encode()


def decode(raw: bytes) -> dict | None:
    """A node summary read from the store, or None when it is not one (another version, garbage)."""
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("version") != SUMMARY_VERSION:
        return None
    if not isinstance(record.get("node_rank"), int) or not isinstance(record.get("ranks"), dict):
        return None
    if not all(isinstance(v, dict) for v in record["ranks"].values()):
        return None
    return record


def _as_int(key) -> int:
    text = str(key)
    return int(text) if text.lstrip("-").isdigit() else 0


def whereabouts(entry: Mapping | None) -> tuple[str, str]:
    """Where one rank is, as a verb phrase: (singular, plural)."""
    if entry is None:
        return "was not captured", "were not captured"
    exit_text = entry.get("exit")
    state = entry.get("state")
    waited = f"waited in {entry['last_wait']} until the group broke" if entry.get("last_wait") else ""
    if exit_text or entry.get("alive") is False or state in ("Z", "X"):
        text = str(exit_text or ("is a zombie" if state == "Z" else "is dead"))
        plural = (
            "were " + text[4:] if text.startswith("was ") else "are " + text[3:] if text.startswith("is ") else text
        )
        return (f"{waited}, then {text}", f"{waited}, then {plural}") if waited else (text, plural)
    detail = ""
    if entry.get("where"):
        detail += f" in {entry['where']}"
    if entry.get("step"):
        detail += f" at step {entry['step']}"
    elif entry.get("collective_seq"):
        detail += f" after {entry['collective_seq']} collectives"
    if state in ("T", "t"):
        what = "stopped (state T)" if state == "T" else "held by a debugger (state t)"
        return f"is {what}{detail}", f"are {what}{detail}"
    if state == "D":
        return f"is in uninterruptible I/O (state D){detail}", f"are in uninterruptible I/O (state D){detail}"
    if entry.get("in_collective"):
        collective = entry.get("collective") or "a collective"
        return f"waits in {collective}", f"wait in {collective}"
    if waited:
        return waited, waited
    return f"is outside collectives{detail}", f"are outside collectives{detail}"


def _who(members: list[tuple[int, int]]) -> str:
    """``[(node, rank), …]`` as "ranks 0,1 on node 0 and rank 3 on node 1"."""
    by_node: dict[int, list[int]] = {}
    for node, rank in sorted(members):
        by_node.setdefault(node, []).append(rank)
    parts = [
        f"{'rank' if len(ranks) == 1 else 'ranks'} {','.join(map(str, ranks))} on node {node}"
        for node, ranks in by_node.items()
    ]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _grouped(members: Iterable[tuple[int, int, Mapping | None]]) -> list[str]:
    """Ranks of every node grouped by where they are: the largest group first."""
    groups: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for node, rank, entry in members:
        groups.setdefault(whereabouts(entry), []).append((node, rank))
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(r for _n, r in kv[1])))
    return [f"{_who(who)} {one if len(who) == 1 else many}" for (one, many), who in ordered]


def process_whereabouts(entry: Mapping) -> str:
    """Where a control-plane process is, as a verb phrase."""
    if entry.get("exit") or entry.get("alive") is False:
        return str(_exit_text(entry.get("exit")) or "is dead")
    state = entry.get("state")
    where = f" in {entry['where']}" if entry.get("where") else ""
    if state in ("T", "t"):
        return ("is stopped (state T)" if state == "T" else "is held by a debugger (state t)") + where
    if state == "D":
        return f"is in uninterruptible I/O (state D){where}"
    if entry.get("in_step"):
        if entry.get("role") == "frontend":
            return "holds requests in flight, waiting for their outputs"
        phase = f" (phase {entry['phase']})" if entry.get("phase") else ""
        return f"waits inside its step{phase} for the ranks"
    return "is idle between steps"


def _control_plane(nodes: Mapping[int, Mapping], culprits: bool) -> list[str]:
    """The engine's control plane of every node that reported one: its culprits, or the others."""
    return [
        f"{entry.get('who') or entry.get('role')} on node {node} {process_whereabouts(entry)}"
        for node, record in sorted(nodes.items())
        for entry in record.get("processes") or []
        if isinstance(entry, Mapping) and bool(entry.get("culprit")) == culprits
    ]


def merged_verdict(origin: int, nodes: Mapping[int, Mapping], missing: Iterable[int] = ()) -> str:
    """The culprit by global rank and node, where every other rank of every node is, then the originating
    node's own verdict."""
    own = nodes[origin]
    culprits = set(own.get("culprit_ranks") or [])
    ranks = own.get("ranks") or {}
    lead = _grouped((origin, r, ranks.get(str(r))) for r in sorted(culprits))
    others = [
        (node, _as_int(key), entry)
        for node, record in sorted(nodes.items())
        for key, entry in (record.get("ranks") or {}).items()
        if not (node == origin and _as_int(key) in culprits)
    ]
    parts = lead + _control_plane(nodes, culprits=True) + _grouped(others) + _control_plane(nodes, culprits=False)
    absent = sorted(missing)
    if absent:
        parts.append(
            f"{'node' if len(absent) == 1 else 'nodes'} {','.join(map(str, absent))} sent no summary "
            "in time (see their own bundles)"
        )
    text = "; ".join(parts)
    if own.get("verdict"):
        text = f"{text}. Node {origin}'s own verdict: {own['verdict']}" if text else str(own["verdict"])
    return text


def peer_bundles(nodes: Mapping[int, Mapping], me: int) -> dict:
    """Where the other nodes' bundles of the incident are: ``{node: {host, bundle, reason}}``."""
    return {
        str(node): {"host": record.get("host"), "bundle": record.get("bundle"), "reason": record.get("reason")}
        for node, record in sorted(nodes.items())
        if node != me
    }


def merge(origin: int, nodes: Mapping[int, Mapping], expected: Iterable[int]) -> dict:
    """The ``summary.json`` fields the originating node adds once it heard the others: ``nodes`` (every node
    summary, its own included), ``node_verdict`` (its own verdict, kept), ``verdict`` (merged),
    ``culprit_node``, ``peer_bundles`` and, when some did not answer, ``nodes_missing``."""
    missing = sorted(set(expected) - set(nodes) - {origin})
    fields = {
        "nodes": {str(node): dict(record) for node, record in sorted(nodes.items())},
        "node_verdict": nodes[origin].get("verdict"),
        "verdict": merged_verdict(origin, nodes, missing),
        "culprit_node": origin,
        "peer_bundles": peer_bundles(nodes, origin),
    }
    if missing:
        fields["nodes_missing"] = missing
    return fields


def origin_of(summary: Mapping) -> bool:
    """Whether a bundle is the originating node's (its reason is not one that followed a peer)."""
    return summary.get("reason") not in PEER_REASONS


__all__ = [
    "MAX_NODE_SUMMARY_BYTES",
    "NodeSummary",
    "decode",
    "encode",
    "merge",
    "merged_verdict",
    "node_summary",
    "origin_of",
    "peer_bundles",
    "process_whereabouts",
    "whereabouts",
]
