"""Steps judged by their shape, and the control plane's slots in the watchdog (pure, fake clock)."""

from __future__ import annotations

import dataclasses

import pytest
from wdfakes import TICK, snap

from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.watchdogs import adaptive
from tp_supervise.watchdogs.policy import VerdictKind as K
from tp_supervise.watchdogs.policy import WatchdogConfig, WatchdogState, observe, step_at_hand

DECODE_S = 0.05
PREFILL_S = 3.3


class ShapedGroup:
    """Two ranks whose steps say how many tokens they were given (vLLM's execute_model does)."""

    def __init__(self):
        self.step = 0
        self.tokens = 4
        self.last = (0.0, 0)  # (seconds, tokens) of the last completed step

    def slots(self, in_step: bool = True, stuck: int | None = None, since_step: int | None = None, extra: int = 0):
        out = []
        for r in range(2):
            step = self.step if since_step is None or r != stuck else since_step
            coll = step * 4 + extra + (1 if stuck is not None and r != stuck else 0)
            s = snap(r, step=step, coll=coll, in_step=in_step)
            out.append(
                dataclasses.replace(
                    s, step_tokens=self.tokens, last_step_s=self.last[0], last_step_tokens=self.last[1]
                )
            )
        return out

    def steps(self, seconds: float, tokens: int, n: int = 1):
        self.tokens = tokens
        self.step += n
        self.last = (seconds, tokens)


class Clock:
    def __init__(self, config: WatchdogConfig | None = None):
        self.config = config or WatchdogConfig()
        self.now = 1000.0
        self.state = WatchdogState.initial(self.now)
        self.verdicts = []

    def tick(self, slots, dt: float = TICK, control=()):
        self.now += dt
        self.state, v = observe(self.state, slots, self.now, self.config, None, frozenset(), control)
        self.verdicts.append(v)
        return v

    def first(self, kind):
        return next((v for v in self.verdicts if v.kind is kind), None)


def decode_for(clock: Clock, group: ShapedGroup, seconds: float) -> None:
    for _ in range(int(seconds / TICK)):
        group.steps(DECODE_S, 4, n=2)
        clock.tick(group.slots())


def test_a_long_prefill_raises_only_its_own_bar():
    """30 s of 4-token decode steps, then one 3.3 s prefill of 512 tokens (not a hang: no class of its size is
    learned, the window's bar applies and rises), then decode again: a rank stopped in a decode step is ruled
    by the decode steps' bar (3 s), not by 3 x the prefill (9.9 s)."""
    clock, group = Clock(), ShapedGroup()
    decode_for(clock, group, 30)
    group.tokens = 512
    for i in range(int(PREFILL_S / TICK)):  # the prefill: inside the step, a collective a second (a layer)
        v = clock.tick(group.slots(extra=i // 10))
        assert v.kind in (K.OK, K.SOFT, K.SUSPECT), v.message
    assert clock.first(K.HARD) is None
    group.steps(PREFILL_S, 512)
    clock.tick(group.slots(extra=4))
    assert clock.verdicts[-1].adaptive.window_max_s >= PREFILL_S
    assert clock.verdicts[-1].adaptive.hard == pytest.approx(3 * PREFILL_S, rel=0.1)  # the window's bar
    decode_for(clock, group, 10)
    stopped_at = clock.now
    stuck = group.step
    for _ in range(100):
        clock.tick(group.slots(stuck=1, since_step=stuck))
    hard = clock.first(K.HARD)
    assert hard is not None and hard.at - stopped_at <= 3.0 + 2 * TICK, hard.message
    assert hard.hard_timeout == pytest.approx(3.0) and hard.step_tokens == 4
    assert "a step of 4 tokens" in hard.message


def test_a_prefill_class_once_learned_judges_prefills_by_prefills():
    learned = adaptive.Learned()
    params = adaptive.AdaptiveParams()
    observed = adaptive.Observed(shaped=tuple((adaptive.bucket(512), PREFILL_S) for _ in range(8)))
    learned = adaptive.learn(learned, observed, params)
    assert adaptive.shape_thresholds(learned, params, 600)[1] == pytest.approx(8 * PREFILL_S)  # 8 x p99
    # a class with no samples of its own borrows the nearest larger one; a step of unknown size has none
    assert adaptive.shape_thresholds(learned, params, 4)[1] == pytest.approx(8 * PREFILL_S)
    assert adaptive.shape_thresholds(learned, params, 0) is None
    assert adaptive.shape_thresholds(learned, params, 4096) is None
    few = adaptive.learn(adaptive.Learned(), adaptive.Observed(shaped=((3, 0.05),) * 7), params)
    assert adaptive.shape_thresholds(few, params, 4) is None  # under shape_min_samples


def test_size_classes_keep_their_last_samples_only():
    params = adaptive.AdaptiveParams(shape_samples=4, shape_min_samples=2)
    learned = adaptive.Learned()
    for seconds in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        learned = adaptive.learn(learned, adaptive.Observed(shaped=((3, seconds),)), params)
    assert dict(learned.shapes)[3] == (3.0, 4.0, 5.0, 6.0)
    with pytest.raises(ValueError):
        adaptive.AdaptiveParams(shape_samples=4, shape_min_samples=5)


def test_step_at_hand_is_the_largest_step_in_progress_and_none_between_steps():
    """Between steps nothing says what the next should take (an engine core busy with a utility call while
    requests wait): the window's thresholds judge a stall there, not the last step's class."""
    a = dataclasses.replace(snap(0, in_step=True), step_tokens=4, last_step_tokens=600)
    b = dataclasses.replace(snap(1, in_step=True), step_tokens=8, last_step_tokens=4)
    assert step_at_hand([a, b]) == 8
    idle = [dataclasses.replace(s, flags=s.flags & ~hb.IN_STEP) for s in (a, b)]
    assert step_at_hand(idle) == 0
    assert step_at_hand([snap(0)]) == 0


def control(step: int, in_step: bool, role: int = hb.ROLE_SCHEDULER, pid: int = 77) -> hb.SlotSnapshot:
    s = snap(0, step=step, in_step=in_step, pid=pid)
    return dataclasses.replace(s, slot=hb.CONTROL_SLOT_BASE + hb.control_slot(role), rank=-1, role=role)


def test_a_scheduler_inside_its_step_makes_the_group_busy_and_its_steps_are_progress():
    """Ranks idle (waiting for the next step): the scheduler stuck in its step is a stall, its steps are
    progress, and the verdict says where it is."""
    clock = Clock(WatchdogConfig(soft_timeout=1.0, hard_timeout=2.0))
    idle = [snap(r, step=10) for r in range(2)]
    for i in range(30):  # the scheduler steps: progress every tick, never a stall
        v = clock.tick(idle, control=[control(i, True)])
        assert v.kind in (K.OK, K.IDLE), v.message
    for _ in range(30):  # it stops inside step 30
        clock.tick(idle, control=[control(30, True)])
    hard = clock.first(K.HARD)
    assert hard is not None and hard.busy_ranks == ()
    assert "scheduler (pid 77) in its step" in hard.message, hard.message
    assert hard.to_dict()["control"][0]["role"] == "scheduler"


def test_a_scheduler_stuck_in_its_scheduling_call_is_judged_by_the_smallest_step_class():
    """Decode steps learned (0.05 s), then one 3.3 s prefill in the window (its longest: the window's bar is
    3x it), then the scheduler stops inside ``schedule()`` while the ranks wait for its next step: no step size
    yet, but the scheduling call is part of every step, so the decode class rules it (3 s), not the window (9.9 s).
    The same stall outside the scheduling call (its step's size unknown) keeps the window's bar."""
    for phase, bar in ((hb.SCHEDULE_PHASE, 3.0), ("", 3 * PREFILL_S)):
        clock, group = Clock(), ShapedGroup()
        decode_for(clock, group, 30)
        group.tokens = 512
        for i in range(int(PREFILL_S / TICK)):
            clock.tick(group.slots(extra=i // 10))
        group.steps(PREFILL_S, 512)
        clock.tick(group.slots(extra=4))
        idle = group.slots(in_step=False, extra=4)
        stuck = dataclasses.replace(control(40, True), phase=phase)
        stopped_at = clock.now
        for _ in range(120):
            clock.tick(idle, control=[stuck])
        hard = clock.first(K.HARD)
        assert hard is not None and hard.hard_timeout == pytest.approx(bar, rel=0.1), (phase, hard and hard.message)
        assert hard.at - stopped_at <= bar + 2 * TICK, hard.message


def test_a_cold_engines_first_wait_is_not_the_bar_of_later_stalls():
    """An engine that reports steps: its first requests wait 3.3 s inside the first step (a cold start, before
    anything is learned), then decode steps are learned; a rank stopped later in a step of a size never seen
    is ruled by the window of the steady state (its bars: 1.5 / 3 s floors), not by 3 x the cold wait."""
    clock, group = Clock(), ShapedGroup()
    for _ in range(int(PREFILL_S / TICK)):  # the cold start: inside step 0, no progress
        clock.tick(group.slots())
    group.steps(PREFILL_S, 4)
    clock.tick(group.slots())
    decode_for(clock, group, 30)
    assert clock.verdicts[-1].adaptive.window_max_s < 1.0, clock.verdicts[-1].adaptive
    group.tokens = 300  # a size with no class
    stuck = group.step
    stopped_at = clock.now
    for _ in range(100):
        clock.tick(group.slots(stuck=1, since_step=stuck))
    hard = clock.first(K.HARD)
    assert hard is not None and hard.at - stopped_at <= 3.0 + 2 * TICK, hard.message


def test_a_scheduler_between_steps_with_idle_ranks_is_idle():
    clock = Clock(WatchdogConfig(soft_timeout=1.0, hard_timeout=2.0))
    idle = [snap(r, step=10) for r in range(2)]
    for _ in range(50):
        v = clock.tick(idle, control=[control(5, False)])
    assert v.kind is K.IDLE and clock.first(K.HARD) is None


def test_a_front_end_holding_requests_with_no_output_is_a_stall():
    clock = Clock(WatchdogConfig(soft_timeout=1.0, hard_timeout=2.0))
    idle = [snap(r, step=10) for r in range(2)]
    front = control(3, True, role=hb.ROLE_FRONTEND, pid=55)
    for _ in range(30):
        clock.tick(idle, control=[front, control(5, False)])
    hard = clock.first(K.HARD)
    assert hard is not None, [v.message for v in clock.verdicts[-3:]]
    assert "frontend (pid 55) has requests in flight, no output" in hard.message, hard.message


def sized(slot: hb.SlotSnapshot, tokens: int = 4) -> hb.SlotSnapshot:
    return dataclasses.replace(slot, step_tokens=tokens)


def learned_decode(clock: Clock) -> None:
    group = ShapedGroup()
    decode_for(clock, group, 30)


def test_a_rank_missing_from_the_collective_its_peers_wait_in_is_ruled_at_the_arrival_floor():
    """Rank 0 waits in all_reduce #k, rank 1 never arrives (stopped outside collectives): the peers' wait is
    rank 1's lateness, ruled at max(soft, 2 s), not at the 3 s floor of any stall."""
    clock = Clock()
    learned_decode(clock)
    seq = 10_000
    waiting = sized(snap(0, step=900, coll=seq, in_step=True, in_coll=True, op="vllm.all_reduce"))
    behind = sized(snap(1, step=900, coll=seq - 1, in_step=True))
    start = clock.now
    for _ in range(40):
        clock.tick([waiting, behind])
    hard = clock.first(K.HARD)
    assert hard is not None and hard.hard_timeout == pytest.approx(2.0), [v.message for v in clock.verdicts[-2:]]
    assert hard.at - start <= 2.0 + 2 * TICK
    assert "rank 1 has not arrived at the collective its peers wait in" in hard.message


def test_ranks_waiting_in_the_same_collective_or_explicit_timeouts_or_unsized_steps_keep_their_bar():
    clock = Clock()
    learned_decode(clock)
    both = [sized(snap(r, step=900, coll=10_000, in_step=True, in_coll=True)) for r in range(2)]
    for _ in range(40):
        clock.tick(both)
    assert clock.first(K.HARD).hard_timeout == pytest.approx(3.0)
    waiting = sized(snap(0, step=900, coll=10_000, in_step=True, in_coll=True))
    behind = sized(snap(1, step=900, coll=9_999, in_step=True))
    for config in (WatchdogConfig(hard_timeout=5.0), WatchdogConfig(soft_timeout=2.0)):
        explicit = Clock(config)
        learned_decode(explicit)
        for _ in range(60):
            explicit.tick([waiting, behind])
        hard = explicit.first(K.HARD)
        assert hard.hard_timeout >= 3.0 and explicit.first(K.SOFT) is not None, config  # a dump-only stage first
    unsized = Clock()
    learned_decode(unsized)
    for _ in range(40):
        unsized.tick([snap(0, step=900, coll=10_000, in_step=True, in_coll=True), snap(1, step=900, coll=9_999)])
    assert unsized.first(K.HARD).hard_timeout == pytest.approx(3.0)
