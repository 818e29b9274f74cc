"""Adaptive hang thresholds: learned from how long a busy group normally goes without progress.

Samples are durations in seconds, taken from what the ranks report in their
heartbeat slots (precise, rank-side ``time.monotonic()`` instants), not from
the supervisor's 0.1 s tick:

* **progress intervals**: between two observations a rank entered ``n``
  collectives, the latest at ``ts_coll`` (it was at ``ts_coll'`` before), so
  its collectives were ``(ts_coll - ts_coll') / n`` s apart on average; one
  sample, worth ``n`` progress events.  An interval that spans a *quiet*
  observation (nobody busy, nothing progressed: an idle engine) is not
  learned, so idling never raises the thresholds;
* **step durations** (``last_step_s``) of ranks that report steps, worth one
  event per completed step;
* the length of a **busy stall that ended in progress**, as the hang rule
  measured it (tick resolution, an over-estimate by less than a tick): a
  legitimate long gap (a long first step, a prefill) raises the bar;
* only when an observation yields none of these (progress known only from an
  engine's token counter): the time between two progressing observations.

Warm-up counts the group's **progress events** (collectives entered and
steps completed, the most any rank made: the ranks of a TP group progress
together), not samples or ticks: the learned thresholds apply once
``warmup_events`` events were measured and, when ranks report steps,
``warmup_steps`` steps of the group completed (the first steps, a compile or
a long prefill, are never judged by a rhythm that does not know them).  Until then the conservative ``warmup_soft``/``warmup_hard`` apply.
After warm-up::

    soft = clamp(max(soft_multiplier * pXX, soft_max_multiplier * window_max), soft_floor, soft_ceiling)
    hard = clamp(max(hard_multiplier * pXX, hard_max_multiplier * window_max), hard_floor, hard_ceiling)

where pXX is the ``percentile`` of the last ``window_samples`` samples and
window_max their maximum.

**Steps judged by their shape.**  Ranks and schedulers that say how many
tokens a step was given (``step_tokens`` in their slot: vLLM's scheduled
tokens) teach one more thing: each completed step's duration filed under
its size class, ``bucket(tokens)`` = the bit length of ``tokens`` (1, 2-3,
4-7, ... 512-1023 tokens), the last ``shape_samples`` of each class kept.
``shape_thresholds(learned, tokens)`` is the formula above over the samples
of that class alone (or, with fewer than ``shape_min_samples`` there, of the
nearest larger class that has them): a stall while a 4-token decode step is
in progress is judged by decode steps, a 512-token prefill by prefills, and
one long prefill no longer raises every later decode step's bar.  With no
class learned yet, the window's thresholds apply.  The percentile term keeps detection within a few
normal step times; the max term keeps rare but legitimate long gaps (a long
prefill, a GC pause) from looking like hangs; the window lets thresholds follow
an engine whose step time drifts.

Everything here is pure: values in, values out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotation only: this module imports nothing of the heartbeat at run time
    from tp_supervise.supervisor.rank.heartbeat import SlotSnapshot

PERCENT = 100.0


@dataclass(frozen=True)
class AdaptiveParams:
    """How adaptive thresholds are derived (defaults documented in docs/watchdogs.md)."""

    warmup_events: int = 50
    warmup_steps: int = 3
    window_samples: int = 2000
    percentile: float = 99.0
    soft_multiplier: float = 4.0
    hard_multiplier: float = 8.0
    soft_max_multiplier: float = 1.5
    hard_max_multiplier: float = 3.0
    soft_floor: float = 1.5
    hard_floor: float = 3.0
    soft_ceiling: float = 120.0
    hard_ceiling: float = 300.0
    warmup_soft: float = 30.0
    warmup_hard: float = 60.0
    change_ratio: float = 0.2
    shape_samples: int = 64  # completed steps kept per size class
    shape_min_samples: int = 8  # a size class judges its steps once it has this many
    shape_percentile: float = 90.0  # of a class's few samples (its p99 would be its maximum)
    # A rank missing from the collective its peers wait in (policy.missing_ranks) is ruled at
    # max(soft, arrival_floor) rather than at hard: the peers' wait is the rank's lateness itself.
    arrival_floor: float = 2.0

    def __post_init__(self) -> None:
        for name in ("warmup_events", "warmup_steps", "window_samples", "shape_samples", "shape_min_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0.0 < self.percentile <= PERCENT:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        for name in ("soft_multiplier", "soft_max_multiplier"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"{name} must be >= 1 (below 1 a normal gap is a hang), got {getattr(self, name)}")
        if self.hard_multiplier < self.soft_multiplier:
            raise ValueError("hard_multiplier must be >= soft_multiplier")
        if self.hard_max_multiplier < self.soft_max_multiplier:
            raise ValueError("hard_max_multiplier must be >= soft_max_multiplier")
        for name in (
            "soft_floor",
            "hard_floor",
            "soft_ceiling",
            "hard_ceiling",
            "warmup_soft",
            "warmup_hard",
            "arrival_floor",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.soft_floor > self.soft_ceiling:
            raise ValueError("soft_floor must be <= soft_ceiling")
        if self.hard_floor > self.hard_ceiling:
            raise ValueError("hard_floor must be <= hard_ceiling")
        if self.soft_floor > self.hard_floor or self.soft_ceiling > self.hard_ceiling:
            raise ValueError("soft floor/ceiling must not exceed the hard floor/ceiling")
        if self.warmup_soft > self.warmup_hard:
            raise ValueError("warmup_soft must be <= warmup_hard")
        if not 0.0 < self.shape_percentile <= PERCENT:
            raise ValueError(f"shape_percentile must be in (0, 100], got {self.shape_percentile}")
        if self.shape_min_samples > self.shape_samples:
            raise ValueError("shape_min_samples must be <= shape_samples")
        if not 0.0 < self.change_ratio < 1.0:
            raise ValueError(f"change_ratio must be in (0, 1), got {self.change_ratio}")


@dataclass(frozen=True)
class Thresholds:
    """Learned soft/hard thresholds and what they were derived from."""

    soft: float
    hard: float
    learned: bool  # False: still warming up, the warm-up defaults apply
    basis_s: float  # the percentile of the window (0 while warming up)
    window_max_s: float
    samples: int  # in the window
    events: int = 0  # progress events learned from (warm-up counts these)
    steps: int = 0  # steps of the group learned from


@dataclass(frozen=True)
class Mark:
    """One rank's progress as one observation saw it: where its next interval starts."""

    pid: int
    step: int
    coll_seq: int
    ts_coll: float  # when its latest collective began (rank-reported, monotonic; 0: none yet)
    last_step_s: float  # duration of its latest completed step (0: none yet)
    last_step_tokens: int = 0  # what that step was given (0: not reported)

    @classmethod
    def of(cls, slot: SlotSnapshot) -> Mark:
        """The mark of one heartbeat slot read."""
        return cls(slot.pid, slot.step, slot.coll_seq, slot.ts_coll_begin, slot.last_step_s, slot.last_step_tokens)


@dataclass(frozen=True)
class Observed:
    """What one observation teaches: samples (seconds) and the progress events behind them."""

    samples: tuple[float, ...] = ()
    events: int = 0  # progress events measured (of the group: the most any rank made)
    steps: int = 0  # steps the group completed (the most any rank did)
    shaped: tuple[tuple[int, float], ...] = ()  # (size class, seconds) of completed steps that gave their tokens


@dataclass(frozen=True)
class Learned:
    """Everything learned so far: the sliding window and the events behind it.

    Survives a restart of the ranks (the engine's rhythm does not change with
    its pids); the marks the next intervals start from do not.
    """

    window: tuple[float, ...] = ()
    events: int = 0
    steps: int = 0
    # size class -> its last ``shape_samples`` step durations, ascending by class
    shapes: tuple[tuple[int, tuple[float, ...]], ...] = ()


def bucket(tokens: int) -> int:
    """The size class of a step of ``tokens`` tokens: 1, 2-3, 4-7, ... are classes 1, 2, 3, ..."""
    return max(0, int(tokens)).bit_length()


def clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def percentile(sorted_values: list[float] | tuple[float, ...], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (q in (0, 100])."""
    if not sorted_values:
        raise ValueError("percentile of no samples")
    rank = math.ceil(q / PERCENT * len(sorted_values))
    return sorted_values[min(max(rank, 1), len(sorted_values)) - 1]


def usable(sample: float) -> bool:
    """A duration worth learning from (finite, positive)."""
    return math.isfinite(sample) and sample > 0.0


def extend_window(window: tuple[float, ...], samples: Iterable[float], params: AdaptiveParams) -> tuple[float, ...]:
    """The sliding window after appending ``samples`` (oldest dropped first)."""
    fresh = tuple(s for s in samples if usable(s))
    if not fresh:
        return window
    merged = window + fresh
    if len(merged) > params.window_samples:
        merged = merged[-params.window_samples :]
    return merged


def rank_progress(before: Mark | None, after: Mark, quiet_at: float) -> Observed:
    """What one rank's progress between two observations teaches.

    ``before`` is the rank's mark at the previous observation (None: not seen
    yet); ``quiet_at`` the time of the latest quiet observation (nobody busy,
    no progress), which an interval must not span.  A new pid in the slot is
    a new process: nothing is measured across it.
    """
    if before is None or before.pid != after.pid:
        return Observed()
    samples: list[float] = []
    events = steps = 0
    done = after.step - before.step
    shaped: tuple[tuple[int, float], ...] = ()
    if done > 0 and usable(after.last_step_s):
        events += done
        steps = done
        # A process's first step is its warm-up (lazy initialisation, cold caches: 6 s for vLLM's first step on
        # CPU, where the next take 0.1 s): counted as progress, never as a sample.  As the window's longest it
        # would set the thresholds of every stall without a step size (an engine core stuck in its scheduling
        # call waited 4x its cold first step).
        if before.step > 0:
            samples.append(after.last_step_s)
            if after.last_step_tokens > 0:
                shaped = ((bucket(after.last_step_tokens), after.last_step_s),)
    entered = after.coll_seq - before.coll_seq
    if entered > 0 and before.ts_coll > quiet_at and before.ts_coll > 0.0 and after.ts_coll > before.ts_coll:
        samples.append((after.ts_coll - before.ts_coll) / entered)
        events += entered
    return Observed(tuple(samples), events, steps, shaped)


def combine(observed: Iterable[Observed]) -> Observed:
    """One observation of the group from its ranks': every sample; events and
    steps are the group's, the most any rank made (they progress together)."""
    samples: list[float] = []
    shaped: list[tuple[int, float]] = []
    events = steps = 0
    for o in observed:
        samples.extend(o.samples)
        shaped.extend(o.shaped)
        events = max(events, o.events)
        steps = max(steps, o.steps)
    return Observed(tuple(samples), events, steps, tuple(shaped))


def observation(
    before: Mapping[int, Mark],
    after: Iterable[tuple[int, Mark]],
    quiet_at: float,
    stall_s: float | None = None,
    untimed_gap_s: float | None = None,
) -> Observed:
    """What one observation of the group teaches.

    ``before``/``after``: each slot's mark at the previous and at this
    observation (``rank_progress`` of each); ``stall_s``: the length of a
    busy stall that this observation saw end in progress (a sample, no event:
    the ranks' own progress is counted already); ``untimed_gap_s``: for
    progress that no rank timestamped (an engine's token counter), the time
    since the previous progressing observation (a sample worth one event).
    """
    group = combine(rank_progress(before.get(slot), mark, quiet_at) for slot, mark in after)
    extra = tuple(s for s in (stall_s, untimed_gap_s) if s is not None)
    if not extra:
        return group
    return Observed(group.samples + extra, group.events + (untimed_gap_s is not None), group.steps, group.shaped)


def extend_shapes(
    shapes: tuple[tuple[int, tuple[float, ...]], ...], shaped: Iterable[tuple[int, float]], params: AdaptiveParams
) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """Each size class's window after appending the steps of ``shaped`` (oldest dropped first)."""
    fresh = [(b, s) for b, s in shaped if usable(s)]
    if not fresh:
        return shapes
    by_class = dict(shapes)
    for b, seconds in fresh:
        merged = by_class.get(b, ()) + (seconds,)
        by_class[b] = merged[-params.shape_samples :]
    return tuple(sorted(by_class.items()))


def learn(learned: Learned, observed: Observed, params: AdaptiveParams) -> Learned:
    """``learned`` with one more observation (the same object when it teaches nothing)."""
    window = extend_window(learned.window, observed.samples, params)
    shapes = extend_shapes(learned.shapes, observed.shaped, params)
    if window is learned.window and shapes is learned.shapes and not observed.events and not observed.steps:
        return learned
    return Learned(window, learned.events + observed.events, learned.steps + observed.steps, shapes)


def warmed_up(learned: Learned, params: AdaptiveParams, reports_steps: bool) -> bool:
    """Enough progress seen to trust the window (``reports_steps``: some rank reports steps)."""
    if not learned.window or learned.events < params.warmup_events:
        return False
    return not reports_steps or learned.steps >= params.warmup_steps


def thresholds(learned: Learned, params: AdaptiveParams, reports_steps: bool = False) -> Thresholds:
    """Soft/hard thresholds from what was learned (warm-up defaults until ``warmed_up``)."""
    window = learned.window
    if not warmed_up(learned, params, reports_steps):
        return Thresholds(
            soft=params.warmup_soft,
            hard=params.warmup_hard,
            learned=False,
            basis_s=0.0,
            window_max_s=max(window, default=0.0),
            samples=len(window),
            events=learned.events,
            steps=learned.steps,
        )
    soft, hard, basis, top = _bars(window, params)
    return Thresholds(
        soft=soft,
        hard=hard,
        learned=True,
        basis_s=basis,
        window_max_s=top,
        samples=len(window),
        events=learned.events,
        steps=learned.steps,
    )


def _bars(
    samples: Iterable[float], params: AdaptiveParams, q: float | None = None
) -> tuple[float, float, float, float]:
    """(soft, hard, pXX, max) of some samples, by the module's formula (``q``: the percentile, else params')."""
    ordered = sorted(samples)
    basis = percentile(ordered, params.percentile if q is None else q)
    top = ordered[-1]
    soft = clamp(
        max(params.soft_multiplier * basis, params.soft_max_multiplier * top), params.soft_floor, params.soft_ceiling
    )
    hard = clamp(
        max(params.hard_multiplier * basis, params.hard_max_multiplier * top), params.hard_floor, params.hard_ceiling
    )
    return soft, hard, basis, top


def shape_thresholds(learned: Learned, params: AdaptiveParams, tokens: int) -> tuple[float, float] | None:
    """(soft, hard) for a step of ``tokens`` tokens, from the steps of its size class (or the nearest larger
    class with ``shape_min_samples`` of them); None when none has, or for a step of unknown size."""
    if tokens <= 0:
        return None
    wanted = bucket(tokens)
    for size_class, samples in learned.shapes:
        if size_class >= wanted and len(samples) >= params.shape_min_samples:
            soft, hard, _basis, _top = _bars(samples, params, params.shape_percentile)
            return soft, hard
    return None


def changed_materially(old: tuple[float, float] | None, new: tuple[float, float], ratio: float) -> bool:
    """True when soft or hard moved by at least ``ratio`` (relative) since ``old`` was reported."""
    if old is None:
        return True
    return any(abs(n - o) >= ratio * o for o, n in zip(old, new, strict=True))
