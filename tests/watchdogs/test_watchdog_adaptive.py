"""Adaptive threshold arithmetic."""

from __future__ import annotations

import math

import pytest

from tp_supervise.watchdogs import adaptive
from tp_supervise.watchdogs.adaptive import AdaptiveParams

P = AdaptiveParams()


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"warmup_samples": 0}, "warmup_samples"),
        ({"warmup_samples": 100, "window_samples": 99}, "window_samples"),
        ({"percentile": 0.0}, "percentile"),
        ({"percentile": 100.5}, "percentile"),
        ({"soft_multiplier": 0.9}, "soft_multiplier must be >= 1"),
        ({"soft_max_multiplier": 0.5}, "soft_max_multiplier must be >= 1"),
        ({"hard_multiplier": 3.0}, "hard_multiplier must be >= soft_multiplier"),
        ({"hard_max_multiplier": 1.2}, "hard_max_multiplier must be >= soft_max_multiplier"),
        ({"soft_floor": 0.0}, "soft_floor must be a positive"),
        ({"hard_ceiling": math.inf}, "hard_ceiling must be a positive"),
        ({"soft_floor": 200.0}, "soft_floor must be <= soft_ceiling"),
        ({"hard_floor": 400.0}, "hard_floor must be <= hard_ceiling"),
        ({"soft_floor": 5.0}, "must not exceed the hard"),
        ({"warmup_soft": 70.0}, "warmup_soft must be <= warmup_hard"),
        ({"change_ratio": 0.0}, "change_ratio"),
        ({"change_ratio": 1.0}, "change_ratio"),
    ],
)
def test_params_validation(kwargs, text):
    with pytest.raises(ValueError, match=text):
        AdaptiveParams(**kwargs)


def test_percentile_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert adaptive.percentile(values, 99.0) == 99.0
    assert adaptive.percentile(values, 100.0) == 100.0
    assert adaptive.percentile(values, 50.0) == 50.0
    assert adaptive.percentile(values, 0.1) == 1.0
    assert adaptive.percentile([7.0], 99.0) == 7.0
    with pytest.raises(ValueError):
        adaptive.percentile([], 50.0)


def test_window_slides_and_drops_unusable_samples():
    params = AdaptiveParams(warmup_samples=3, window_samples=4)
    w = adaptive.extend_window((), [1.0, 0.0, -1.0, math.nan, math.inf, 2.0], params)
    assert w == (1.0, 2.0)
    w = adaptive.extend_window(w, [3.0, 4.0, 5.0], params)
    assert w == (2.0, 3.0, 4.0, 5.0)
    assert adaptive.extend_window(w, [], params) is w


def test_warmup_defaults():
    t = adaptive.thresholds(tuple([0.05] * (P.warmup_samples - 1)), P)
    assert (t.soft, t.hard, t.learned) == (P.warmup_soft, P.warmup_hard, False)
    assert t.samples == P.warmup_samples - 1


def test_floors_for_fast_steps():
    t = adaptive.thresholds(tuple([0.01] * P.warmup_samples), P)
    assert (t.soft, t.hard, t.learned) == (P.soft_floor, P.hard_floor, True)
    assert t.basis_s == 0.01


def test_percentile_term():
    window = tuple([1.0] * 990 + [1.5] * 10)
    t = adaptive.thresholds(window, P)
    assert t.basis_s == 1.0
    assert t.soft == pytest.approx(4.0) and t.hard == pytest.approx(8.0)


def test_max_term_covers_rare_long_gaps():
    window = tuple([0.1] * 999 + [5.0])
    t = adaptive.thresholds(window, P)
    assert t.basis_s == 0.1 and t.window_max_s == 5.0
    assert t.soft == pytest.approx(7.5) and t.hard == pytest.approx(15.0)


def test_ceilings():
    t = adaptive.thresholds(tuple([100.0] * P.warmup_samples), P)
    assert (t.soft, t.hard) == (P.soft_ceiling, P.hard_ceiling)


def test_hard_never_below_soft_over_a_range_of_windows():
    for scale in (0.001, 0.01, 0.3, 1.0, 3.0, 20.0, 60.0, 500.0):
        for outlier in (1.0, 2.0, 10.0):
            window = tuple([scale] * 500 + [scale * outlier])
            t = adaptive.thresholds(window, P)
            assert P.soft_floor <= t.soft <= t.hard <= P.hard_ceiling


def test_changed_materially():
    assert adaptive.changed_materially(None, (1.0, 2.0), 0.2)
    assert not adaptive.changed_materially((10.0, 20.0), (11.9, 23.9), 0.2)
    assert adaptive.changed_materially((10.0, 20.0), (12.0, 20.0), 0.2)
    assert adaptive.changed_materially((10.0, 20.0), (10.0, 15.0), 0.2)
