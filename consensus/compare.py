"""Pure comparison of per-step digests across the ranks of one TP group.

No I/O and no clock: time is an argument.  The monitor feeds published
digests into a :class:`StepTable` and asks it which steps are decided.

When a step is decided
----------------------
Ranks progress at different speeds, so digests of a step arrive one by one.
For each pending step the members of the group are *present* (published this
step), *skipped* (published a later step but never this one: absent for
good) or *waiting* (not there yet: late, hung or not started).

* all present digests equal, nobody waiting            -> AGREE
* two present digests differ and nobody is waiting     -> DIVERGED
* they differ and one digest already holds a strict
  majority of the present + waiting ranks               -> DIVERGED (waiting
  ranks can no longer change the majority)
* they differ and ``wait_s`` passed since the mismatch
  was first seen                                       -> DIVERGED among the present
  (a hung rank must not delay the verdict)
* otherwise                                            -> PENDING

A step that stays pending past ``max_pending`` newer steps is dropped as
EXPIRED (a rank that never publishes, e.g. dead or not recording).

``force`` (the supervisor's ``settle``) judges every mismatch at once: used
when a rank exited or hung, to learn whether a divergence came first.

The step in progress
--------------------
:class:`OpenStepComparer` applies the same rules event by event to the step
ranks are still in, so a divergence whose next collective hangs or aborts is
caught although that step never publishes.

Who is the culprit
------------------
Ranks are grouped by digest.  The largest group is the reference and every
other rank is a culprit.  ``decided_by`` says how firm that is: ``majority``
(the reference holds more than half of the compared ranks), ``plurality``
(largest, but not more than half) or ``tie`` (several groups share the largest
size: the one holding the lowest rank is the reference, so with two ranks rank
0 is the reference and the other rank the culprit).

Episodes
--------
After a divergence the ranks usually keep disagreeing for a while; reporting
every step would bury the first cause.  A DIVERGED decision is flagged
``first_of_episode`` only when no divergence was reported since the last step
on which the group agreed.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tp_supervise.supervisor.rank import encoding

MAJORITY = "majority"
PLURALITY = "plurality"
TIE = "tie"


class Outcome(enum.Enum):
    PENDING = "pending"
    AGREE = "agree"
    DIVERGED = "diverged"
    EXPIRED = "expired"


@dataclass(frozen=True)
class DigestGroup:
    digest: bytes
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Split:
    """Ranks grouped by digest, largest group first (ties: lowest rank first)."""

    groups: tuple[DigestGroup, ...]
    reference: tuple[int, ...]
    culprits: tuple[int, ...]
    decided_by: str


def split_digests(digests: Mapping[int, bytes]) -> Split:
    if not digests:
        raise ValueError("no digests to split")
    by_digest: dict[bytes, list[int]] = {}
    for rank in sorted(digests):
        by_digest.setdefault(digests[rank], []).append(rank)
    groups = sorted(
        (DigestGroup(d, tuple(r)) for d, r in by_digest.items()),
        key=lambda g: (-len(g.ranks), g.ranks[0]),
    )
    top = groups[0]
    if len(groups) > 1 and len(groups[1].ranks) == len(top.ranks):
        decided_by = TIE
    elif 2 * len(top.ranks) > len(digests):
        decided_by = MAJORITY
    else:
        decided_by = PLURALITY
    culprits = tuple(sorted(r for g in groups[1:] for r in g.ranks))
    return Split(tuple(groups), top.ranks, culprits, decided_by)


def assess(
    digests: Mapping[int, bytes],
    waiting: Collection[int],
    mismatch_since: float | None,
    now: float,
    wait_s: float,
) -> Outcome:
    """Decide one step from what has been published so far (see the module doc)."""
    if not digests:
        return Outcome.PENDING
    counts: dict[bytes, int] = {}
    for d in digests.values():
        counts[d] = counts.get(d, 0) + 1
    if len(counts) == 1:
        return Outcome.PENDING if waiting else Outcome.AGREE
    if not waiting:
        return Outcome.DIVERGED
    if 2 * max(counts.values()) > len(digests) + len(waiting):
        return Outcome.DIVERGED
    if mismatch_since is not None and now - mismatch_since >= wait_s:
        return Outcome.DIVERGED
    return Outcome.PENDING


# The caller's handle of one published digest, kept opaque here (a ring entry; None across nodes).
Ref = TypeVar("Ref")


@dataclass
class _Pending(Generic[Ref]):
    first_seen: float
    digests: dict[int, bytes] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    refs: dict[int, Ref] = field(default_factory=dict)
    mismatch_since: float | None = None


@dataclass(frozen=True)
class Decision(Generic[Ref]):
    """A step that left the table.  ``refs`` are the caller's handles (e.g. ring entries)."""

    step: int
    outcome: Outcome
    digests: Mapping[int, bytes]
    counts: Mapping[int, int]
    refs: Mapping[int, Ref]
    missing: tuple[int, ...]
    first_of_episode: bool = False


class StepTable(Generic[Ref]):
    """Pending steps of one TP group.  Pure bookkeeping: no I/O, time passed in."""

    def __init__(self, members: Sequence[int], wait_s: float, max_pending: int):
        if not members:
            raise ValueError("a TP group needs at least one member")
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.members = tuple(sorted(set(members)))
        self.wait_s = wait_s
        self.max_pending = max_pending
        self._pending: dict[int, _Pending[Ref]] = {}
        self._latest: dict[int, int] = {}
        self._decided: OrderedDict[int, None] = OrderedDict()
        self._in_episode = False
        self._changed = False  # something was added since the last decide()
        self._timed: set[int] = set()  # pending steps whose verdict waits on the clock
        self.late_arrivals = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def is_pending(self, step: int) -> bool:
        return step in self._pending

    def add(self, member: int, step: int, digest: bytes, count: int, ref: Ref, now: float) -> None:
        """Record that ``member`` published ``step`` with ``digest``."""
        if member not in self.members:
            raise ValueError(f"{member} is not a member of this group {self.members}")
        if step > self._latest.get(member, -1):
            self._latest[member] = step
        if step in self._decided:
            self.late_arrivals += 1
            return
        entry = self._pending.get(step)
        if entry is None:
            entry = self._pending[step] = _Pending(first_seen=now)
        entry.digests[member] = digest
        entry.counts[member] = count
        entry.refs[member] = ref
        self._changed = True
        if entry.mismatch_since is None and len(set(entry.digests.values())) > 1:
            entry.mismatch_since = now
            self._timed.add(step)

    def reset_member(self, member: int) -> None:
        """``member`` restarted: its earlier digests and step numbers no longer count.

        Step numbers start over with the new incarnation, so decisions about
        earlier steps no longer shadow new digests and the episode ends.
        """
        self._latest.pop(member, None)
        self._decided.clear()
        self._in_episode = False
        self._changed = True
        for entry in self._pending.values():
            entry.digests.pop(member, None)
            entry.counts.pop(member, None)
            entry.refs.pop(member, None)

    def _waiting(self, step: int, entry: _Pending[Ref]) -> list[int]:
        return [m for m in self.members if m not in entry.digests and self._latest.get(m, -1) < step]

    @property
    def in_episode(self) -> bool:
        """A divergence was reported and the group has not agreed on a step since."""
        return self._in_episode

    def enter_episode(self) -> None:
        """A divergence was reported by other means (a step caught in progress)."""
        self._in_episode = True

    def decide(self, now: float, force: bool = False) -> list[Decision[Ref]]:
        """Steps decided by now, in step order; they leave the table.

        ``force`` judges every mismatch at once, without waiting for late
        ranks (the supervisor does that when a rank exited or hung, to learn
        whether a divergence came first).
        """
        out: list[Decision[Ref]] = []
        if not self._changed and not self._timed and not force:
            return out  # nothing new and no deadline: skip the scan (bounded idle cost)
        self._changed = False
        wait_s = 0.0 if force else self.wait_s
        for step in sorted(self._pending):
            entry = self._pending[step]
            waiting = self._waiting(step, entry)
            outcome = assess(entry.digests, waiting, entry.mismatch_since, now, wait_s)
            if outcome is Outcome.PENDING:
                continue
            out.append(self._close(step, entry, outcome))
        overflow = len(self._pending) - self.max_pending
        for step in sorted(self._pending)[: max(0, overflow)]:
            out.append(self._close(step, self._pending[step], Outcome.EXPIRED))
        out.sort(key=lambda d: d.step)
        return out

    def _close(self, step: int, entry: _Pending[Ref], outcome: Outcome) -> Decision[Ref]:
        del self._pending[step]
        self._timed.discard(step)
        self._decided[step] = None
        while len(self._decided) > self.max_pending:
            self._decided.popitem(last=False)
        first = False
        if outcome is Outcome.DIVERGED:
            first = not self._in_episode
            self._in_episode = True
        elif outcome is Outcome.AGREE:
            self._in_episode = False
        missing = tuple(m for m in self.members if m not in entry.digests)
        return Decision(step, outcome, dict(entry.digests), dict(entry.counts), dict(entry.refs), missing, first)


# -- the step in progress ----------------------------------------------------


@dataclass(frozen=True)
class OpenDecision:
    """Ranks in the same unfinished step disagree on one of its events."""

    after: int  # the last step they published (the open step is the one after it)
    index: int  # first event of the open step on which they disagree
    lines: Mapping[int, bytes]  # that event, per rank that recorded it
    missing: tuple[int, ...]  # members that had not recorded it (elsewhere or slower)


class OpenStepComparer:
    """Compares the events of the step still in progress, event by event.

    A rank's open step is identified by the last step it published
    (``after``); ranks with the same ``after`` are in the same step and must
    record the same events in the same order.  The first event index at which
    two of them differ is judged like a step's digests (:func:`assess`), with
    the ranks that have not recorded that event yet as the waiting ones.  This
    catches a divergence whose very next collective hangs or aborts (for
    example a batch of another shape), before the step could ever publish.
    Pure bookkeeping; ``lines`` are the caller's growing lists.
    """

    def __init__(self, members: Sequence[int], wait_s: float):
        self.members = tuple(sorted(set(members)))
        self.wait_s = wait_s
        self._open: dict[int, tuple[int, Sequence[bytes]]] = {}
        self._agreed: dict[tuple[int, tuple[int, ...]], int] = {}  # events all those ranks agree on
        self._since: dict[tuple[int, int], float] = {}
        self._reported: set[int] = set()

    def update(self, member: int, after: int, lines: Sequence[bytes]) -> None:
        self._open[member] = (after, lines)

    def forget(self, member: int) -> None:
        self._open.pop(member, None)

    def _prune(self, current: Collection[int]) -> None:
        low = min(current, default=0)
        self._agreed = {k: v for k, v in self._agreed.items() if k[0] in current}
        self._since = {k: v for k, v in self._since.items() if k[0] in current}
        self._reported = {a for a in self._reported if a >= low}

    def decide(self, now: float, force: bool = False) -> list[OpenDecision]:
        by_after: dict[int, list[int]] = {}
        for member, (after, _lines) in self._open.items():
            by_after.setdefault(after, []).append(member)
        self._prune(by_after)
        out = []
        for after in sorted(by_after):
            ranks = tuple(sorted(by_after[after]))
            if len(ranks) < 2 or after in self._reported:
                continue
            logs = {r: self._open[r][1] for r in ranks}
            key = (after, ranks)
            index = self._agreed.get(key, 0)
            while all(len(logs[r]) > index for r in ranks) and len({logs[r][index] for r in ranks}) == 1:
                index += 1
            self._agreed[key] = index
            present = {r: logs[r][index] for r in ranks if len(logs[r]) > index}
            if len(set(present.values())) < 2:
                continue
            since = self._since.setdefault((after, index), now)
            waiting = [m for m in self.members if m not in present]
            outcome = assess(present, waiting, since, now, 0.0 if force else self.wait_s)
            if outcome is Outcome.DIVERGED:
                self._reported.add(after)
                out.append(OpenDecision(after, index, present, tuple(waiting)))
        return out


# -- diffing the event logs of one step ------------------------------------


class _Missing:
    """Placeholder for "no such event / no such field" (renders as nothing)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


@dataclass(frozen=True)
class FirstDifference:
    """The first event of the step on which the compared ranks disagree."""

    index: int  # position of the event within the step
    kinds: Mapping[int, str | None]  # per rank; None: its log ended before ``index``
    events: Mapping[int, Any]  # decoded payload per rank (MISSING: no such event)
    path: tuple[str | int, ...]  # where inside the payload they first differ
    values: Mapping[int, Any]  # per rank, the value at ``path`` (MISSING: absent)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def locate(a: Any, b: Any) -> tuple[str | int, ...] | None:
    """Path to the first place where two decoded payloads differ (None: equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return (key,)
            sub = locate(a[key], b[key])
            if sub is not None:
                return (key,) + sub
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):  # lengths may differ: checked after the loop
            sub = locate(x, y)
            if sub is not None:
                return (i,) + sub
        if len(a) != len(b):
            return (min(len(a), len(b)),)
        return None
    return None if _same(a, b) else ()


def value_at(payload: Any, path: Sequence[str | int]) -> Any:
    value = payload
    for key in path:
        if isinstance(value, dict) and isinstance(key, str) and key in value:
            value = value[key]
        elif isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value):
            value = value[key]
        else:
            return MISSING
    return value


def first_difference(
    logs: Mapping[int, Sequence[bytes]], reference: int, culprits: Sequence[int]
) -> FirstDifference | None:
    """Diff the encoded event logs of one step: the reference against the culprits.

    Returns None when the logs of all compared ranks are identical (which
    happens only when a log was truncated or is unavailable).
    """
    ranks = [reference] + [r for r in culprits if r in logs and r != reference]
    if reference not in logs or len(ranks) < 2:
        return None
    longest = max(len(logs[r]) for r in ranks)
    for index in range(longest):
        lines = {r: (logs[r][index] if index < len(logs[r]) else None) for r in ranks}
        if len(set(lines.values())) == 1:
            continue
        kinds: dict[int, str | None] = {}
        events: dict[int, Any] = {}
        for r, line in lines.items():
            if line is None:
                kinds[r], events[r] = None, MISSING
            else:
                kinds[r], events[r] = encoding.decode_event(line)
        first_culprit = next(r for r in ranks[1:] if lines[r] != lines[reference])
        if kinds[reference] is None or kinds[first_culprit] != kinds[reference]:
            path: tuple[str | int, ...] = ()
        else:
            path = locate(events[reference], events[first_culprit]) or ()
        values = {r: value_at(events[r], path) for r in ranks}
        return FirstDifference(index, kinds, events, path, values)
    return None
