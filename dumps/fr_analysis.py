"""Pure cross-rank analysis of flight-recorder traces (see ``dumps.flight``).

Input: ``{rank: trace}`` where a trace is what torch's ``fr_trace_json``
handler returns (``entries`` with ``collective_seq_id``, ``process_group``,
``profiling_name``, ``input_sizes``, ``input_dtypes``, ``retired``, and
``pg_config`` naming each group's ranks).  Point-to-point entries are left
out: sends and receives do not pair by sequence number.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_PG = "0"

_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}


@dataclass(frozen=True)
class FrEntry:
    pg: str
    seq: int
    op: str
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    retired: bool

    @property
    def desc(self) -> str:
        """``64x256 float32`` (the heartbeat's notation)."""
        shapes = ",".join("x".join(str(d) for d in s) or "scalar" for s in self.sizes)
        dtypes = ",".join(sorted(set(self.dtypes)))
        return " ".join(p for p in (shapes, dtypes) if p)

    @property
    def key(self) -> tuple:
        return (self.op, self.sizes, self.dtypes)


@dataclass(frozen=True)
class MissingCollective:
    """Ranks of ``pg`` that never entered collective ``seq`` which others entered."""

    pg: str
    seq: int
    op: str
    desc: str
    entered: tuple[int, ...]
    missing: tuple[int, ...]
    last_seq: Mapping[int, int] = field(default_factory=dict)  # of the missing ranks


@dataclass(frozen=True)
class Mismatch:
    """Ranks disagree on op, sizes or dtypes of the same collective."""

    pg: str
    seq: int
    kinds: tuple[str, ...]  # subset of ("op", "size", "dtype")
    by_rank: Mapping[int, str]  # rank -> "all_reduce 64x256 float32"
    minority: tuple[int, ...]  # ranks outside the largest agreeing group (empty on a tie)


@dataclass(frozen=True)
class FrFindings:
    ranks: tuple[int, ...]  # ranks whose trace was analysed
    last_seq: Mapping[str, Mapping[int, int]]  # pg -> rank -> last collective_seq_id
    in_flight: Mapping[int, FrEntry]  # rank -> oldest entry not retired (what it waits in)
    missing: tuple[MissingCollective, ...]  # most collectives behind first (root cause)
    mismatches: tuple[Mismatch, ...]  # earliest first

    @property
    def culprit_ranks(self) -> tuple[int, ...]:
        """Root cause only: ranks missing from the earliest collective, else the first mismatch's minority."""
        if self.missing:
            return self.missing[0].missing
        if self.mismatches:
            return self.mismatches[0].minority
        return ()

    def to_dict(self) -> dict:
        return {
            "ranks": list(self.ranks),
            "last_seq": {pg: {str(r): s for r, s in m.items()} for pg, m in self.last_seq.items()},
            "in_flight": {str(r): _entry_dict(e) for r, e in self.in_flight.items()},
            "missing": [
                {
                    "pg": m.pg,
                    "seq": m.seq,
                    "op": m.op,
                    "desc": m.desc,
                    "entered": list(m.entered),
                    "missing": list(m.missing),
                    "last_seq": {str(r): s for r, s in m.last_seq.items()},
                }
                for m in self.missing
            ],
            "mismatches": [
                {
                    "pg": m.pg,
                    "seq": m.seq,
                    "kinds": list(m.kinds),
                    "by_rank": {str(r): d for r, d in m.by_rank.items()},
                    "minority": list(m.minority),
                }
                for m in self.mismatches
            ],
            "culprit_ranks": list(self.culprit_ranks),
        }


def _entry_dict(e: FrEntry) -> dict:
    return {"pg": e.pg, "seq": e.seq, "op": e.op, "desc": e.desc, "retired": e.retired}


def _op_name(profiling_name: str) -> str:
    return profiling_name.split(":", 1)[-1] if profiling_name else "?"


def _entries(trace: Mapping) -> list[FrEntry]:
    out = []
    for raw in trace.get("entries") or []:
        if raw.get("is_p2p"):
            continue  # send/recv pair up asymmetrically; not compared here
        pg = raw.get("process_group") or [str(raw.get("pg_id", DEFAULT_PG))]
        try:
            seq = int(raw.get("collective_seq_id", 0))
        except (TypeError, ValueError):
            continue
        if seq <= 0:
            continue
        sizes = tuple(tuple(int(d) for d in s) for s in raw.get("input_sizes") or [])
        dtypes = tuple(_DTYPES.get(str(d), str(d).lower()) for d in raw.get("input_dtypes") or [])
        out.append(
            FrEntry(
                str(pg[0]),
                seq,
                _op_name(str(raw.get("profiling_name", ""))),
                sizes,
                dtypes,
                bool(raw.get("retired", False)),
            )
        )
    return out


def _members(trace: Mapping, pg: str) -> set[int] | None:
    conf = (trace.get("pg_config") or {}).get(pg)
    if not isinstance(conf, Mapping):
        return None
    try:
        ranks = ast.literal_eval(str(conf.get("ranks", "")))
        return {int(r) for r in ranks}
    except (ValueError, SyntaxError, TypeError):
        return None


def analyze(traces: Mapping[int, Mapping]) -> FrFindings:
    """Compare flight-recorder traces across ranks (pure).

    * ``last_seq``: highest collective sequence number per process group per rank;
    * ``missing``: per process group, each rank behind the group's highest
      sequence number is missing from the collective right after its last
      one; grouped by that collective, most-behind first (the root cause);
    * ``mismatches``: for each sequence number present on several ranks,
      differing op, input sizes or dtypes.

    Members of a group come from the trace's ``pg_config`` when it names
    them, else every analysed rank for the default group, else the ranks
    that have entries for it.
    """
    by_rank = {rank: _entries(trace) for rank, trace in traces.items()}
    ranks = tuple(sorted(by_rank))
    pgs = sorted({e.pg for entries in by_rank.values() for e in entries})
    last_seq: dict[str, dict[int, int]] = {}
    missing: list[tuple[int, bool, str, MissingCollective]] = []  # (-lag, not default, pg, finding)
    mismatches: list[Mismatch] = []
    for pg in pgs:
        table = {r: {e.seq: e for e in entries if e.pg == pg} for r, entries in by_rank.items()}
        members = None
        for r in ranks:
            members = _members(traces[r], pg)
            if members:
                break
        if not members:
            members = set(ranks) if pg == DEFAULT_PG else {r for r in ranks if table[r]}
        members &= set(ranks)
        last = {r: max(table[r], default=0) for r in sorted(members)}
        last_seq[pg] = last
        top = max(last.values(), default=0)
        behind: dict[int, list[int]] = {}
        for r, s in last.items():
            if s < top:
                behind.setdefault(s + 1, []).append(r)
        for seq in sorted(behind):
            entered = tuple(r for r, s in last.items() if s >= seq)
            sample = next((table[r][seq] for r in entered if seq in table[r]), None)
            lag = top - seq + 1
            missing.append(
                (
                    -lag,
                    pg != DEFAULT_PG,
                    pg,
                    MissingCollective(
                        pg=pg,
                        seq=seq,
                        op=sample.op if sample else "?",
                        desc=sample.desc if sample else "",
                        entered=entered,
                        missing=tuple(sorted(behind[seq])),
                        last_seq={r: last[r] for r in behind[seq]},
                    ),
                )
            )
        mismatches.extend(_mismatches(pg, table))
    in_flight = {}
    for r, entries in by_rank.items():
        pending = sorted((e for e in entries if not e.retired), key=lambda e: e.seq)
        if pending:
            in_flight[r] = pending[0]
    missing.sort(key=lambda item: item[:3])
    mismatches.sort(key=lambda m: (m.seq, m.pg))
    return FrFindings(ranks, last_seq, in_flight, tuple(m for *_, m in missing), tuple(mismatches))


def _mismatches(pg: str, table: Mapping[int, Mapping[int, FrEntry]]) -> list[Mismatch]:
    out = []
    seqs = sorted({s for entries in table.values() for s in entries})
    for seq in seqs:
        present = {r: entries[seq] for r, entries in table.items() if seq in entries}
        if len(present) < 2 or len({e.key for e in present.values()}) == 1:
            continue
        kinds = []
        if len({e.op for e in present.values()}) > 1:
            kinds.append("op")
        if len({e.sizes for e in present.values()}) > 1:
            kinds.append("size")
        if len({e.dtypes for e in present.values()}) > 1:
            kinds.append("dtype")
        groups: dict[tuple, list[int]] = {}
        for r, e in present.items():
            groups.setdefault(e.key, []).append(r)
        sizes = sorted((len(v) for v in groups.values()), reverse=True)
        minority: tuple[int, ...] = ()
        if sizes[0] > sizes[1]:
            biggest = max(groups.values(), key=len)
            minority = tuple(sorted(r for r in present if r not in biggest))
        out.append(
            Mismatch(
                pg=pg,
                seq=seq,
                kinds=tuple(kinds),
                by_rank={r: f"{e.op} {e.desc}".strip() for r, e in sorted(present.items())},
                minority=minority,
            )
        )
    return out
