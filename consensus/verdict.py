"""The divergence verdict: who diverged, where, and one sentence a person can act on.

Built by a pure function from the digests and event logs of one step;
``to_dict`` is what goes into ``summary.json`` (reason ``divergence``) and
``bundle_files`` the per-rank event logs for the incident bundle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .compare import (
    MAJORITY,
    MISSING,
    PLURALITY,
    FirstDifference,
    first_difference,
    split_digests,
    value_at,
)

VALUE_TEXT_LIMIT = 80  # characters of one value quoted in the sentence


@dataclass(frozen=True)
class DivergenceVerdict:
    step: int
    ranks: tuple[int, ...]  # ranks whose digests were compared
    culprit_ranks: tuple[int, ...]
    reference_ranks: tuple[int, ...]
    groups: tuple[tuple[str, tuple[int, ...]], ...]  # (digest hex, ranks), largest first
    decided_by: str  # majority | plurality | tie
    missing_ranks: tuple[int, ...]  # group members without a digest for this step
    first_difference: FirstDifference | None
    event_counts: Mapping[int, int]
    verdict: str
    detected_at: float  # monotonic
    published_at: float  # monotonic, the latest publication among the compared digests
    logs: Mapping[int, tuple[bytes, ...]] = field(default_factory=dict)  # encoded events per rank
    log_notes: Mapping[int, str] = field(default_factory=dict)  # "truncated" / "unavailable"
    in_progress: bool = False  # caught before the step ended (its events so far)

    @property
    def values(self) -> dict[int, Any]:
        """Per rank, the first differing value (empty when the logs could not be diffed)."""
        if self.first_difference is None:
            return {}
        return {r: _jsonable(v) for r, v in self.first_difference.values.items()}

    def to_dict(self) -> dict[str, Any]:
        fd = self.first_difference
        return {
            "reason": "divergence",
            "step": self.step,
            "step_in_progress": self.in_progress,
            "culprit_ranks": list(self.culprit_ranks),
            "reference_ranks": list(self.reference_ranks),
            "ranks": list(self.ranks),
            "missing_ranks": list(self.missing_ranks),
            "decided_by": self.decided_by,
            "groups": [{"digest": d, "ranks": list(r)} for d, r in self.groups],
            "event_counts": {str(r): c for r, c in sorted(self.event_counts.items())},
            "first_difference": None
            if fd is None
            else {
                "index": fd.index,
                "kinds": {str(r): k for r, k in sorted(fd.kinds.items())},
                "path": render_path(fd.path),
                "values": {str(r): _jsonable(v) for r, v in sorted(fd.values.items())},
                "events": {str(r): _jsonable(v) for r, v in sorted(fd.events.items())},
            },
            "log_notes": {str(r): n for r, n in sorted(self.log_notes.items())},
            "verdict": self.verdict,
            "detection_latency_seconds": max(0.0, self.detected_at - self.published_at),
        }

    def bundle_files(self) -> dict[str, str]:
        """Relative path -> text, for the incident bundle (the caller writes them)."""
        files = {"consensus/verdict.json": json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"}
        for rank, lines in sorted(self.logs.items()):
            text = "\n".join(line.decode("ascii", "replace") for line in lines)
            files[f"consensus/step-{self.step}-rank-{rank}.jsonl"] = text + ("\n" if text else "")
        return files


def _jsonable(value: Any) -> Any:
    return None if value is MISSING else value


def render_path(path: Sequence[str | int]) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def _render_value(value: Any) -> str:
    if value is MISSING:
        return "nothing"
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    if len(text) > VALUE_TEXT_LIMIT:
        text = text[: VALUE_TEXT_LIMIT - 3] + "..."
    return text


def _who(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _detail(fd: FirstDifference | None, reference: int, culprits: Sequence[int], notes: Mapping[int, str]) -> str:
    if fd is None:
        if notes:
            why = "; ".join(f"rank {r}: {n}" for r, n in sorted(notes.items()))
            return f"digests differ, event logs could not be diffed ({why})"
        return "digests differ but the stored event logs are identical"
    ref_kind = fd.kinds.get(reference)
    shown = [r for r in culprits if r in fd.kinds]
    at = f"event #{fd.index}"
    if ref_kind is None:
        kinds = ", ".join(f"'{fd.kinds[r]}' on rank {r}" for r in shown)
        return f"{at} is {kinds} where rank {reference} recorded no more events"
    ended = [r for r in shown if fd.kinds[r] is None]
    other = [r for r in shown if fd.kinds[r] is not None and fd.kinds[r] != ref_kind]
    if ended or other:
        parts = [f"rank {r} recorded no more events" for r in ended]
        parts += [f"rank {r} recorded '{fd.kinds[r]}'" for r in other]
        return f"{at}: {', '.join(parts)} where rank {reference} recorded '{ref_kind}'"
    if fd.path and isinstance(fd.path[-1], int) and any(fd.values[r] is MISSING for r in [reference, *shown]):
        return _length_detail(fd, reference, shown, _label(at, ref_kind, fd.path[:-1]))
    label = _label(at, ref_kind, fd.path)
    rendered = {r: _render_value(fd.values[r]) for r in shown}
    if len(set(rendered.values())) == 1:
        got = f"is {next(iter(rendered.values()))}"
    else:
        got = "is " + ", ".join(f"{v} on rank {r}" for r, v in rendered.items())
    return f"{label} {got} where rank {reference} has {_render_value(fd.values[reference])}"


def _label(at: str, kind: str, path: Sequence[str | int]) -> str:
    where = render_path(path)
    return f"{at} '{kind}'" + (f" {where}" if where and not where.startswith("[") else where)


def _length_detail(fd: FirstDifference, reference: int, shown: Sequence[int], label: str) -> str:
    """Lists of different lengths: say so, and quote the first item only one side has."""
    parent = fd.path[:-1]
    sizes = {}
    for r in [reference, *shown]:
        value = value_at(fd.events[r], parent)
        sizes[r] = len(value) if isinstance(value, list) else 0
    if len({sizes[r] for r in shown}) == 1:
        got = f"has {sizes[shown[0]]} items"
    else:
        got = "has " + ", ".join(f"{sizes[r]} items on rank {r}" for r in shown)
    holder = reference if fd.values[reference] is not MISSING else next(r for r in shown if fd.values[r] is not MISSING)
    item = f"item [{fd.path[-1]}] on rank {holder}: {_render_value(fd.values[holder])}"
    return f"{label} {got} where rank {reference} has {sizes[reference]} ({item})"


def _basis(decided_by: str, reference: Sequence[int], compared: int, groups: int) -> str:
    ref = _who(reference)
    if decided_by == MAJORITY:
        return f"{ref} agree: majority of {len(reference)} of {compared}"
    if decided_by == PLURALITY:
        return f"no majority; {ref} form the largest group ({len(reference)} of {compared})"
    if compared == 2:
        return f"no majority in a two-way split; {ref} taken as reference"
    return f"no majority ({groups} groups tie at {len(reference)}); {ref} taken as reference"


def build_verdict(
    step: int,
    digests: Mapping[int, bytes],
    counts: Mapping[int, int],
    logs: Mapping[int, Sequence[bytes] | None],
    notes: Mapping[int, str],
    missing: Sequence[int],
    detected_at: float,
    published_at: float,
    keep_lines: int | None = None,
    in_progress: bool = False,
) -> DivergenceVerdict:
    """The verdict for a step whose digests differ (pure).

    ``logs`` maps rank -> the step's encoded event lines (None: unavailable);
    ``notes`` says why a log is partial or absent; ``keep_lines`` bounds the
    events per rank kept in the verdict (the diff always sees whole logs);
    ``in_progress``: the step had not ended, the logs are its events so far.
    """
    split = split_digests(digests)
    reference = split.reference[0]
    available = {r: list(v) for r, v in logs.items() if v is not None}
    fd = first_difference(available, reference, split.culprits)
    # A truncated log can hide the difference: only then do its notes matter.
    relevant = notes if fd is None else {}
    sentence = (
        f"{_who(split.culprits)} diverged at step {step}{' (in progress)' if in_progress else ''}: "
        f"{_detail(fd, reference, split.culprits, relevant)} "
        f"({_basis(split.decided_by, split.reference, len(digests), len(split.groups))})"
    )
    return DivergenceVerdict(
        step=step,
        ranks=tuple(sorted(digests)),
        culprit_ranks=split.culprits,
        reference_ranks=split.reference,
        groups=tuple((g.digest.hex(), g.ranks) for g in split.groups),
        decided_by=split.decided_by,
        missing_ranks=tuple(sorted(missing)),
        first_difference=fd,
        event_counts=dict(counts),
        verdict=sentence,
        detected_at=detected_at,
        published_at=published_at,
        logs={r: tuple(v[:keep_lines]) for r, v in available.items()},
        log_notes=dict(notes),
        in_progress=in_progress,
    )
