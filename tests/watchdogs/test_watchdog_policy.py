"""Watchdog verdicts as a pure function of snapshots and a fake clock."""

from __future__ import annotations

import json
import math

import pytest
from wdfakes import TICK, Driver, SteadyGroup, snap

from tp_supervise.watchdogs.adaptive import AdaptiveParams
from tp_supervise.watchdogs.policy import (
    RENDEZVOUS_PHASE,
    VerdictKind as K,
    WatchdogConfig,
    WatchdogState,
    effective_thresholds,
    observe,
)
from tp_supervise.watchdogs.progress import ExternalProgress

EXPLICIT = WatchdogConfig(soft_timeout=3.0, hard_timeout=6.0, startup_timeout=30.0)


def idle_pair(step: int = 5):
    return [snap(0, step=step, coll=step * 4), snap(1, step=step, coll=step * 4)]


# -- configuration -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"soft_timeout": 0}, "soft_timeout must be a positive"),
        ({"soft_timeout": -1.0}, "soft_timeout must be a positive"),
        ({"hard_timeout": math.nan}, "hard_timeout must be a positive"),
        ({"hard_timeout": math.inf}, "hard_timeout must be a positive"),
        ({"startup_timeout": 0.0}, "startup_timeout must be a positive"),
        ({"startup_timeout": None}, "startup_timeout is required"),
        ({"soft_timeout": True}, "soft_timeout must be a number"),
        ({"soft_timeout": "3"}, "soft_timeout must be a number"),
        ({"soft_timeout": 7.0, "hard_timeout": 6.0}, "must not exceed hard timeout"),
        ({"adaptive": {"warmup_samples": 3}}, "adaptive must be an AdaptiveParams"),
    ],
)
def test_config_rejects_bad_values(kwargs, text):
    with pytest.raises(ValueError, match=text):
        WatchdogConfig(**kwargs)


def test_config_defaults_are_adaptive_and_frozen():
    cfg = WatchdogConfig()
    assert cfg.soft_timeout is None and cfg.hard_timeout is None
    assert cfg.startup_timeout > 0
    with pytest.raises(AttributeError):
        cfg.soft_timeout = 1.0  # type: ignore[misc]


def test_equal_soft_and_hard_allowed():
    WatchdogConfig(soft_timeout=5.0, hard_timeout=5.0)


# -- idle is never a hang --------------------------------------------------------


def test_idle_engine_never_hangs_however_long():
    d = Driver(EXPLICIT)
    for _ in range(2000):
        d.tick(idle_pair(), dt=5.0)  # 10 000 s of idling
    assert set(d.kinds()) == {K.IDLE}
    assert all(v.stalled_s == 0.0 for v in d.verdicts)


def test_uninstrumented_idle_ranks_are_idle_not_starting():
    d = Driver(EXPLICIT)
    ranks = [snap(0, ready=False, instrumented=False), snap(1, ready=False, instrumented=False)]
    for _ in range(100):
        d.tick(ranks, dt=1.0)
    assert set(d.kinds()) == {K.IDLE}


def test_no_claimed_rank_is_idle():
    d = Driver(EXPLICIT)
    v = d.tick([snap(0, claimed=False), snap(1, claimed=False)], dt=100.0)
    assert v.kind is K.IDLE and v.busy_ranks == ()


# -- stall, soft, hard -------------------------------------------------------------


def stop_rank1(d: Driver, g: SteadyGroup, seconds: float):
    since = d.now
    for _ in range(round(seconds / TICK)):
        d.tick(g.stopped(1, since))


def test_stopped_rank_fires_soft_once_then_hard_once():
    d = Driver(EXPLICIT)
    g = SteadyGroup()
    for _ in range(20):
        d.tick(g.advance(0.05))
    assert set(d.kinds()) == {K.OK}
    since = d.now
    stop_rank1(d, g, 8.0)
    assert d.fired() == [K.SOFT, K.HARD]
    soft, hard = d.first(K.SOFT), d.first(K.HARD)
    assert 3.0 <= soft.stalled_s <= 3.0 + TICK + 1e-9
    assert 6.0 <= hard.stalled_s <= 6.0 + TICK + 1e-9
    kinds = d.kinds()
    i_soft, i_hard = kinds.index(K.SOFT), kinds.index(K.HARD)
    assert set(kinds[i_soft + 1 : i_hard]) == {K.SUSPECT}
    assert set(kinds[i_hard + 1 :]) == {K.HUNG}
    # Evidence: who is where.
    assert hard.busy_ranks == (0, 1)
    assert [c.rank for c in hard.in_collective] == [0]
    c = hard.in_collective[0]
    assert (c.op, c.desc, c.coll_seq) == ("all_reduce", "8x64 float32", g.step * 4 + 1)
    assert c.waiting_s == pytest.approx(hard.at - since)
    assert hard.outside_collective == (1,)
    assert (hard.min_coll_seq, hard.max_coll_seq) == (g.step * 4, g.step * 4 + 1)
    assert (hard.min_step, hard.max_step) == (g.step, g.step)
    assert "rank 0 in all_reduce" in hard.message and "rank 1 outside collectives" in hard.message
    assert "hard 6.00 s" in hard.message and "soft 3.00 s" in soft.message
    assert hard.soft_source == hard.hard_source == "explicit"


def test_time_waiting_for_a_cpu_is_counted_out_of_the_hard_bar_at_most_once_over():
    """Soft 3 s, hard 6 s.  A stall whose processes wait for a CPU half the time since its soft stage is ruled
    only when the stall less that wait reaches 6 s; a stall whose every second was waiting is ruled at twice the
    bar (12 s), never later; no wait, at the bar exactly.  The soft stage keeps the clock's stall."""

    def stall(wait_share: float) -> tuple[Driver, float]:
        d = Driver(EXPLICIT)
        g = SteadyGroup()
        for _ in range(20):
            d.tick(g.advance(0.05))
        since, soft_at = d.now, None
        for _ in range(200):
            v = d.tick(g.stopped(1, since), cpu_wait_s=0.0 if soft_at is None else (d.now - soft_at) * wait_share)
            if v.kind is K.SOFT:
                soft_at = d.now
        return d, since

    d, since = stall(0.0)
    assert d.first(K.HARD).stalled_s == pytest.approx(6.0, abs=TICK + 1e-9)
    assert not any(v.counted_out for v in d.verdicts)
    d, since = stall(0.5)
    soft, hard = d.first(K.SOFT), d.first(K.HARD)
    assert soft.stalled_s == pytest.approx(3.0, abs=TICK + 1e-9)
    # stalled - (stalled - 3) / 2 >= 6  <=>  stalled >= 9
    assert hard.stalled_s == pytest.approx(9.0, abs=2 * TICK)
    assert "s for a CPU meanwhile" in hard.message and hard.to_dict()["cpu_wait_seconds"] == pytest.approx(3.0, abs=0.2)
    over = [v for v in d.verdicts if v.counted_out]
    assert over and over[0].stalled_s == pytest.approx(6.0, abs=TICK + 1e-9) and over[0].kind is K.SUSPECT
    d, since = stall(1.0)
    assert d.first(K.HARD).stalled_s == pytest.approx(12.0, abs=TICK + 1e-9)  # the bar counted out once, no more
    assert d.fired() == [K.SOFT, K.HARD] and set(d.kinds()[d.kinds().index(K.HARD) + 1 :]) == {K.HUNG}


def test_time_a_helper_worked_is_counted_out_of_both_bars_up_to_the_startup_timeout():
    """Soft 3 s, hard 6 s, startup 30 s.  A rank waiting on a compiler it started: the seconds the compiler
    worked are not the rank's stall, for the soft bar as for the hard one; a helper that works for ever is
    counted out for the startup timeout at most, then the stall is ruled like any other."""

    def stall(work_from: float, work_until: float) -> Driver:
        d = Driver(EXPLICIT)
        g = SteadyGroup()
        for _ in range(20):
            d.tick(g.advance(0.05))
        since, worked = d.now, 0.0
        for _ in range(600):
            stalled = d.now - since
            if work_from <= stalled < work_until:
                worked += TICK
            d.tick(g.stopped(1, since), helper_work_s=worked)
        return d

    d = stall(1.0, 11.0)  # 10 s of compiler work inside the stall: the bars move by 10 s
    soft, hard = d.first(K.SOFT), d.first(K.HARD)
    assert soft.stalled_s == pytest.approx(13.0, abs=2 * TICK) and hard.stalled_s == pytest.approx(16.0, abs=2 * TICK)
    assert "processes they started worked 10.0 s of it" in hard.message
    assert hard.to_dict()["helper_work_seconds"] == pytest.approx(10.0, abs=TICK)
    assert not any(v.counted_out for v in d.verdicts)
    d = stall(0.0, math.inf)  # a helper that never stops: counted out for 30 s, then ruled
    assert d.first(K.SOFT).stalled_s == pytest.approx(33.0, abs=2 * TICK)
    assert d.first(K.HARD).stalled_s == pytest.approx(36.0, abs=2 * TICK)
    assert d.fired() == [K.SOFT, K.HARD]
    d = stall(0.0, 0.0)  # a stall nobody worked through: at its bars exactly
    assert d.first(K.SOFT).stalled_s == pytest.approx(3.0, abs=TICK + 1e-9)
    assert "started worked" not in d.first(K.HARD).message


def test_soft_and_hard_crossed_in_one_tick_fires_only_hard():
    d = Driver(EXPLICIT)
    g = SteadyGroup()
    d.tick(g.advance(0.05))
    d.tick(g.stopped(1, d.now))
    d.tick(g.stopped(1, d.now), dt=10.0)
    assert d.fired() == [K.HARD]


def test_recovery_clears_incident_and_next_stall_fires_again():
    d = Driver(EXPLICIT)
    g = SteadyGroup()
    d.tick(g.advance(0.05))
    stop_rank1(d, g, 4.0)
    assert d.fired() == [K.SOFT]
    v = d.tick(g.advance(0.05))
    assert v.kind is K.RECOVERED and v.message == "progress resumed"
    assert d.tick(g.advance(0.05)).kind is K.OK
    stop_rank1(d, g, 4.0)
    assert d.fired() == [K.SOFT, K.RECOVERED, K.SOFT]


def test_group_going_idle_ends_incident():
    d = Driver(EXPLICIT)
    g = SteadyGroup()
    d.tick(g.advance(0.05))
    stop_rank1(d, g, 4.0)
    # Nobody busy any more, counters unchanged (e.g. the collective errored out).
    left = [snap(0, step=g.step, coll=g.step * 4 + 1), snap(1, step=g.step, coll=g.step * 4)]
    v = d.tick(left)
    assert v.kind is K.RECOVERED and "idle" in v.message
    assert d.tick(left).kind is K.IDLE


def test_slow_rank_under_soft_timeout_is_not_a_hang():
    """Peers wait 2 s inside each collective for a slow rank; soft is 3 s."""
    d = Driver(EXPLICIT)
    coll = 0
    for _ in range(30):
        coll += 1
        since = d.now
        for _ in range(20):  # rank 0 waits inside all_reduce #coll, rank 1 computes
            d.tick([snap(0, coll=coll, in_coll=True, op="all_reduce", ts_coll=since), snap(1, coll=coll - 1)])
        d.tick([snap(0, coll=coll), snap(1, coll=coll)])  # rank 1 arrives: both leave
    assert not any(v.stalled for v in d.verdicts)
    assert max(v.stalled_s for v in d.verdicts) == pytest.approx(2.0 - TICK, abs=1e-6)


def test_stall_clock_starts_when_group_becomes_busy():
    d = Driver(EXPLICIT)
    d.tick(idle_pair())
    d.tick(idle_pair(), dt=500.0)  # long idle: the last progress is ancient
    busy = [snap(0, step=5, coll=20, in_step=True), snap(1, step=5, coll=20)]
    v = d.tick(busy)
    assert v.kind is K.OK and v.stalled_s == 0.0
    v = d.tick(busy, dt=2.0)
    assert v.kind is K.OK and v.stalled_s == pytest.approx(2.0)
    v = d.tick(busy, dt=1.0)
    assert v.kind is K.SOFT and v.stalled_s == pytest.approx(3.0)


def test_stall_clock_starts_at_last_progress_when_later():
    d = Driver(EXPLICIT)
    d.tick([snap(0, step=1, in_step=True)])
    d.tick([snap(0, step=1, in_step=True)], dt=2.0)
    v = d.tick([snap(0, step=2, in_step=True)], dt=0.5)  # progress, still busy
    assert v.stalled_s == 0.0
    v = d.tick([snap(0, step=2, in_step=True)], dt=2.9)
    assert v.kind is K.OK and v.stalled_s == pytest.approx(2.9)


def test_busy_idle_toggling_does_not_accumulate():
    d = Driver(EXPLICIT)
    for i in range(200):
        d.tick([snap(0, step=3, in_step=(i % 2 == 0))], dt=1.0)
    assert not any(v.stalled for v in d.verdicts)


def test_progress_from_any_counter_or_identity():
    d = Driver(EXPLICIT)
    base = [snap(0, step=1, coll=1, in_coll=True)]
    d.tick(base)
    assert d.tick(base, dt=2.0).stalled_s == pytest.approx(2.0)
    assert d.tick([snap(0, step=1, coll=2, in_coll=True)], dt=2.0).stalled_s == 0.0  # collective counter
    d.tick([snap(0, step=1, coll=2, in_coll=True)], dt=2.0)
    assert d.tick([snap(0, step=2, coll=2, in_coll=True)], dt=2.0).stalled_s == 0.0  # step counter
    d.tick([snap(0, step=2, coll=2, in_coll=True)], dt=2.0)
    v = d.tick([snap(0, step=2, coll=2, in_coll=True, pid=4242)], dt=2.0)  # re-claimed by a new process
    assert v.stalled_s == 0.0 and not d.fired()


def test_exited_ranks_do_not_make_the_group_busy():
    """A rank that died inside a collective leaves its flags set; the exit monitor owns that fault."""
    d = Driver(EXPLICIT)
    dead = snap(1, coll=7, in_coll=True, op="all_reduce")
    for _ in range(100):
        d.tick([snap(0, coll=6), dead], dt=1.0, exited={1})
    assert set(d.kinds()) == {K.IDLE}
    d2 = Driver(EXPLICIT)
    for _ in range(100):
        d2.tick([snap(0, coll=6), dead], dt=1.0)
    assert K.HARD in d2.fired()


def test_finished_ranks_are_ignored():
    d = Driver(EXPLICIT)
    for _ in range(100):
        d.tick([snap(0, in_step=True, finished=True), snap(1)], dt=1.0)
    assert set(d.kinds()) == {K.IDLE}


def test_torn_slot_counts_as_busy():
    """A rank stopped in the middle of a heartbeat update reads torn forever: that is a stall."""
    d = Driver(EXPLICIT)
    for _ in range(70):
        d.tick([snap(0, step=4), snap(1, step=4, torn=True)])
    assert d.fired() == [K.SOFT, K.HARD]
    assert d.verdicts[-1].busy_ranks == (1,)


# -- startup -------------------------------------------------------------------------


def test_startup_waits_for_instrumented_ranks_then_times_out_once():
    d = Driver(EXPLICIT)
    loading = [snap(0, ready=True), snap(1, ready=False, in_step=True)]
    for _ in range(299):
        d.tick(loading)
    assert set(d.kinds()) == {K.STARTUP_WAIT}
    assert d.verdicts[-1].pending_ranks == (1,)
    assert "rank(s) 1 to report ready" in d.verdicts[-1].message
    for _ in range(20):
        d.tick(loading)
    assert d.fired() == [K.STARTUP_TIMEOUT]
    t = d.first(K.STARTUP_TIMEOUT)
    assert t.at - 1000.0 == pytest.approx(30.0, abs=1e-6)
    assert d.kinds()[-1] is K.STARTUP_OVERDUE


def test_no_hang_verdict_during_startup_even_when_busy():
    d = Driver(EXPLICIT)
    for _ in range(250):
        d.tick([snap(0, coll=1, in_coll=True, op="broadcast"), snap(1, ready=False)])
    assert set(d.kinds()) == {K.STARTUP_WAIT}


def test_rendezvous_phase_makes_uninstrumented_rank_pending():
    d = Driver(EXPLICIT)
    v = d.tick([snap(0, ready=False, instrumented=False, phase=RENDEZVOUS_PHASE), snap(1, ready=False, instrumented=False)])
    assert v.kind is K.STARTUP_WAIT and v.pending_ranks == (0,)
    v = d.tick([snap(0, ready=False, instrumented=False, phase=""), snap(1, ready=False, instrumented=False)])
    assert v.kind is K.IDLE


def test_unclaimed_slots_do_not_block_startup_and_late_claims_do():
    d = Driver(EXPLICIT)
    assert d.tick([snap(0), snap(1, claimed=False)]).kind is K.IDLE
    v = d.tick([snap(0), snap(1, ready=False)])
    assert v.kind is K.STARTUP_WAIT and v.pending_ranks == (1,)
    assert d.tick([snap(0), snap(1)]).kind is K.IDLE


def test_steady_state_starts_fresh_after_startup():
    d = Driver(EXPLICIT)
    busy = [snap(0, coll=1, in_coll=True), snap(1, ready=False)]
    for _ in range(100):
        d.tick(busy)  # 10 s busy while rank 1 loads
    v = d.tick([snap(0, coll=1, in_coll=True), snap(1, ready=True)])
    assert v.kind is K.OK and v.stalled_s == 0.0


# -- external progress ------------------------------------------------------------------


def ext(tokens: float, running: float) -> ExternalProgress:
    return ExternalProgress(tokens_total=tokens, running=running, ok=True)


def test_external_running_with_flat_tokens_is_a_stall():
    d = Driver(EXPLICIT)
    idle = idle_pair()
    tokens = 0.0
    for _ in range(50):
        tokens += 3
        assert d.tick(idle, external=ext(tokens, 2)).kind is K.OK
    for _ in range(70):
        d.tick(idle, external=ext(tokens, 2))
    assert d.fired() == [K.SOFT, K.HARD]
    assert "2 running request(s)" in d.first(K.HARD).message


def test_external_no_requests_is_idle():
    d = Driver(EXPLICIT)
    for _ in range(100):
        assert d.tick(idle_pair(), dt=1.0, external=ext(10, 0)).kind is K.IDLE


def test_external_failure_holds_last_known_running_and_counts_no_progress():
    d = Driver(EXPLICIT)
    d.tick(idle_pair(), external=ext(5, 1))
    bad = ExternalProgress(0.0, 0.0, ok=False, error="timed out")
    for _ in range(65):
        d.tick(idle_pair(), external=bad)
    assert d.fired() == [K.SOFT, K.HARD]
    assert "engine metrics unavailable (timed out)" in d.verdicts[-1].message
    # Failures before any good scrape: nothing known, nothing busy.
    d2 = Driver(EXPLICIT)
    for _ in range(100):
        assert d2.tick(idle_pair(), dt=1.0, external=bad).kind is K.IDLE


def test_first_external_sample_is_a_baseline_and_counter_reset_is_progress():
    d = Driver(EXPLICIT)
    d.tick(idle_pair(), external=ext(100, 1), dt=2.0)
    v = d.tick(idle_pair(), external=ext(100, 1), dt=2.0)
    assert v.stalled_s == pytest.approx(2.0)
    v = d.tick(idle_pair(), external=ext(3, 1), dt=2.0)  # engine restarted: counter reset
    assert v.stalled_s == 0.0


# -- thresholds -----------------------------------------------------------------------------


def test_only_soft_given_hard_stays_adaptive_but_not_below_soft():
    cfg = WatchdogConfig(soft_timeout=90.0)
    d = Driver(cfg)
    v = d.tick(idle_pair())
    assert (v.soft_timeout, v.hard_timeout) == (90.0, 90.0)  # warm-up hard is 60 s, lifted to 90
    assert (v.soft_source, v.hard_source) == ("explicit", "warmup")


def test_only_hard_given_soft_stays_adaptive_but_not_above_hard():
    cfg = WatchdogConfig(hard_timeout=10.0)
    d = Driver(cfg)
    v = d.tick(idle_pair())
    assert (v.soft_timeout, v.hard_timeout) == (10.0, 10.0)  # warm-up soft is 30 s, capped at 10
    assert (v.soft_source, v.hard_source) == ("warmup", "explicit")
    # After warm-up the learned soft applies when it is lower.
    g = SteadyGroup()
    for _ in range(200):
        v = d.tick(g.advance(0.05))
    assert v.soft_timeout == 1.5 and v.hard_timeout == 10.0 and v.soft_source == "learned"


def test_effective_thresholds_pass_explicit_values_through():
    from tp_supervise.watchdogs.adaptive import Thresholds

    learned = Thresholds(soft=2.0, hard=4.0, learned=True, basis_s=0.3, window_max_s=0.5, samples=500)
    assert effective_thresholds(EXPLICIT, learned) == (3.0, 6.0, "explicit", "explicit")
    assert effective_thresholds(WatchdogConfig(), learned) == (2.0, 4.0, "learned", "learned")


def test_warmup_defaults_until_enough_samples():
    d = Driver(WatchdogConfig())
    g = SteadyGroup()
    v = d.tick(g.advance(0.05))
    assert (v.soft_timeout, v.hard_timeout, v.soft_source) == (30.0, 60.0, "warmup")
    assert v.thresholds_changed  # the first verdict always reports the thresholds


def test_adaptive_detects_stopped_rank_well_under_60_s():
    d = Driver(WatchdogConfig())
    g = SteadyGroup()
    for _ in range(300):  # 30 s of steady decode with 50 ms steps
        d.tick(g.advance(0.05))
    v = d.verdicts[-1]
    assert v.soft_source == "learned"
    assert (v.soft_timeout, v.hard_timeout) == (1.5, 3.0)  # floors: steps are fast
    changes = [x for x in d.verdicts if x.thresholds_changed]
    assert len(changes) == 2  # the first verdict and the end of warm-up
    stop_rank1(d, g, 5.0)
    soft, hard = d.first(K.SOFT), d.first(K.HARD)
    assert soft.stalled_s <= max(2.0, 5 * 0.05)
    assert hard.stalled_s < 3.0 + 2 * TICK
    assert d.fired() == [K.SOFT, K.HARD]


def test_adaptive_slow_steps_scale_thresholds_and_detection_meets_goal():
    """Steps of 1 s: soft = 4 x p99, detection within 5 x p99."""
    d = Driver(WatchdogConfig())
    g = SteadyGroup()
    for _ in range(120):
        d.tick(g.advance(1.0, dt=1.0), dt=1.0)
    v = d.verdicts[-1]
    assert v.soft_timeout == pytest.approx(4.0) and v.hard_timeout == pytest.approx(8.0)
    since = d.now
    for _ in range(100):
        d.tick(g.stopped(1, since))
    assert d.first(K.SOFT).stalled_s <= 5 * 1.0
    assert d.fired() == [K.SOFT, K.HARD]


def test_adaptive_no_false_alarm_when_step_time_drifts_up():
    d = Driver(WatchdogConfig())
    g = SteadyGroup()
    step_s = 0.05
    while step_s < 3.0:  # 60x slower by the end
        d.tick(g.advance(step_s, dt=step_s), dt=step_s)
        step_s *= 1.01
    assert not any(v.stalled for v in d.verdicts)
    assert d.verdicts[-1].soft_timeout > 4.0 * 2.5


def test_adaptive_slow_rank_injection_is_not_a_hang():
    """Rank 1 becomes 200 ms slower per step (the engine's slow@1): peers wait in collectives."""
    d = Driver(WatchdogConfig())
    g = SteadyGroup()
    for _ in range(300):
        d.tick(g.advance(0.02))
    for _ in range(600):
        since = d.now
        d.tick(g.stopped(1, since), dt=0.1)
        d.tick(g.stopped(1, since), dt=0.1)
        d.tick(g.advance(0.22, dt=0.02), dt=0.02)
    assert not any(v.stalled for v in d.verdicts)


def test_recovered_stall_is_learned():
    """A long but legitimate gap (a big prefill) raises the thresholds through the window max."""
    d = Driver(WatchdogConfig())
    g = SteadyGroup()
    for _ in range(300):
        d.tick(g.advance(0.05))
    before = d.verdicts[-1].adaptive.samples
    busy = g.snapshot(in_step=True)
    d.tick(busy)
    d.tick(busy, dt=1.2)
    v = d.tick(g.advance(0.05))
    assert v.adaptive.samples > before
    gap = TICK + 1.2 + TICK  # from the last progress to the progress that ended the gap
    assert v.adaptive.window_max_s == pytest.approx(gap)
    assert v.soft_timeout == pytest.approx(1.5 * gap)  # soft_max_multiplier x window max
    assert v.hard_timeout == pytest.approx(3.0 * gap)


def test_no_learning_during_startup():
    d = Driver(WatchdogConfig())
    for i in range(300):
        d.tick([snap(0, step=i, last_step=0.01, in_step=True), snap(1, ready=False)])
    assert d.verdicts[-1].adaptive.samples == 0


def test_custom_adaptive_params_are_used():
    params = AdaptiveParams(warmup_events=10, window_samples=10, soft_floor=0.5, hard_floor=1.0)
    d = Driver(WatchdogConfig(adaptive=params))
    g = SteadyGroup(nranks=1)
    for _ in range(20):
        v = d.tick(g.advance(0.05))
    assert (v.soft_timeout, v.hard_timeout) == (0.5, 1.0)
    assert v.adaptive.samples == 10


# -- verdict values -------------------------------------------------------------------------


def test_verdict_to_dict_is_json():
    d = Driver(EXPLICIT)
    g = SteadyGroup()
    d.tick(g.advance(0.05), external=ext(1, 1))
    stop_rank1(d, g, 7.0)
    doc = json.loads(json.dumps(d.first(K.HARD).to_dict()))
    assert doc["kind"] == "hard" and doc["in_collective"][0]["op"] == "all_reduce"
    assert doc["outside_collective"] == [1]
    assert doc["external"] is None
    assert json.loads(json.dumps(d.verdicts[0].to_dict()))["external"]["running"] == 1


def test_observe_is_pure():
    state = WatchdogState.initial(0.0)
    snaps = [snap(0, step=1, in_step=True)]
    a = observe(state, snaps, 1.0, EXPLICIT)
    b = observe(state, snaps, 1.0, EXPLICIT)
    assert a == b
    assert state == WatchdogState.initial(0.0)
