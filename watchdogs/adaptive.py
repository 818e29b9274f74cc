"""Adaptive hang thresholds: learned from how long a busy group normally goes without progress.

Samples are durations in seconds:

* the gap between two progress events while the group was busy (the exact
  quantity the hang rule compares with the timeout, at the resolution of the
  supervisor's tick), and
* the step durations ranks report (``last_step_s``), which are precise.

After ``warmup_samples`` samples the thresholds are::

    soft = clamp(max(soft_multiplier * pXX, soft_max_multiplier * window_max), soft_floor, soft_ceiling)
    hard = clamp(max(hard_multiplier * pXX, hard_max_multiplier * window_max), hard_floor, hard_ceiling)

where pXX is the ``percentile`` of the last ``window_samples`` samples and
window_max their maximum.  The percentile term keeps detection within a few
normal step times; the max term keeps rare but legitimate long gaps (a long
prefill, a GC pause) from looking like hangs; the window lets thresholds follow
an engine whose step time drifts.  Before warm-up the conservative
``warmup_soft``/``warmup_hard`` apply.

Everything here is pure: values in, values out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

PERCENT = 100.0


@dataclass(frozen=True)
class AdaptiveParams:
    """How adaptive thresholds are derived (defaults documented in docs/watchdogs.md)."""

    warmup_samples: int = 100
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

    def __post_init__(self) -> None:
        if self.warmup_samples < 1:
            raise ValueError(f"warmup_samples must be >= 1, got {self.warmup_samples}")
        if self.window_samples < self.warmup_samples:
            raise ValueError(
                f"window_samples ({self.window_samples}) must be >= warmup_samples ({self.warmup_samples})"
            )
        if not 0.0 < self.percentile <= PERCENT:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        for name in ("soft_multiplier", "soft_max_multiplier"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"{name} must be >= 1 (below 1 a normal gap is a hang), got {getattr(self, name)}")
        if self.hard_multiplier < self.soft_multiplier:
            raise ValueError("hard_multiplier must be >= soft_multiplier")
        if self.hard_max_multiplier < self.soft_max_multiplier:
            raise ValueError("hard_max_multiplier must be >= soft_max_multiplier")
        for name in ("soft_floor", "hard_floor", "soft_ceiling", "hard_ceiling", "warmup_soft", "warmup_hard"):
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
    samples: int


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


def thresholds(window: tuple[float, ...], params: AdaptiveParams) -> Thresholds:
    """Soft/hard thresholds for a window of samples."""
    if len(window) < params.warmup_samples:
        return Thresholds(
            soft=params.warmup_soft,
            hard=params.warmup_hard,
            learned=False,
            basis_s=0.0,
            window_max_s=max(window, default=0.0),
            samples=len(window),
        )
    ordered = sorted(window)
    basis = percentile(ordered, params.percentile)
    top = ordered[-1]
    soft = clamp(
        max(params.soft_multiplier * basis, params.soft_max_multiplier * top), params.soft_floor, params.soft_ceiling
    )
    hard = clamp(
        max(params.hard_multiplier * basis, params.hard_max_multiplier * top), params.hard_floor, params.hard_ceiling
    )
    return Thresholds(soft=soft, hard=hard, learned=True, basis_s=basis, window_max_s=top, samples=len(window))


def changed_materially(old: tuple[float, float] | None, new: tuple[float, float], ratio: float) -> bool:
    """True when soft or hard moved by at least ``ratio`` (relative) since ``old`` was reported."""
    if old is None:
        return True
    return any(abs(n - o) >= ratio * o for o, n in zip(old, new))
