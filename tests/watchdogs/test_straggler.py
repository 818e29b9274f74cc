"""The straggler detector (watchdogs/straggler.py), pure, with a fake clock.

A simulated TP group runs blocking collectives: each rank computes, then
arrives; a collective ends when the last rank arrived, and every rank leaves
it together.  The detector sees what the supervisor would: every 0.1 s, each
rank's arrival ring (its last ``ARRIVAL_DEPTH`` arrivals up to that instant).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tp_supervise.supervisor.rank.heartbeat import ARRIVAL_DEPTH, ArrivalWindow
from tp_supervise.watchdogs.straggler import (
    CLEARED,
    NAMED,
    RankLag,
    StragglerConfig,
    StragglerDetector,
    sentence,
)
from tp_supervise.watchdogs.straggler_nodes import (
    NodeBaselines,
    NodeEpisodes,
    NodeSummary,
    clock_offset,
    merge_nodes,
    summarize,
)

T0 = 1000.0  # the simulated monotonic clock starts here
TICK = 0.1
STEP = 0.02  # seconds of compute per step, spread over its collectives
COLLS = 4  # collectives per step

Extra = Callable[[int, int, int, float], float]  # (rank, step, collective, t since start) -> extra compute


def group(n: int, duration: float, extra: Extra | None = None, stop: Callable[[int, float], bool] | None = None,
          colls: int = COLLS, step: float = STEP, seed: int = 0) -> list[list[float]]:
    """Each rank's arrival times, collective after collective, for ``duration`` seconds.

    ``stop(rank, t)``: from the first collective it is true for, that rank never arrives again
    (stopped) and the others wait for it inside that collective (a hang).
    """
    rnd = random.Random(seed)
    arrivals: list[list[float]] = [[] for _ in range(n)]
    t, k = T0, 0
    while t < T0 + duration:
        for j in range(colls):
            at = [t + step / colls + rnd.uniform(0, 50e-6) + (extra(r, k, j, t - T0) if extra else 0.0) for r in range(n)]
            stopped = [stop is not None and stop(r, at[r] - T0) for r in range(n)]
            for r in range(n):
                if not stopped[r]:
                    arrivals[r].append(at[r])
            if any(stopped):
                return arrivals
            t = max(at) + 20e-6  # everyone leaves together
        k += 1
    return arrivals


@dataclass
class Run:
    events: list
    reports: list
    detector: StragglerDetector

    def kinds(self) -> list[tuple[str, int]]:
        return [(e.kind, e.rank) for e in self.events]


def watch(arrivals: list[list[float]], config: StragglerConfig | None = None, until: float | None = None,
          pids: Callable[[float], int] = lambda t: 100, step_s: float | None = None) -> Run:
    """What the supervisor sees, tick after tick: each rank's ring up to that instant."""
    det = StragglerDetector(config or StragglerConfig())
    end = until if until is not None else max((a[-1] for a in arrivals if a), default=T0) - T0 + 5.0
    events, reports = [], []
    t = T0
    while t < T0 + end:
        windows = []
        for rank, times in enumerate(arrivals):
            count = bisect.bisect_right(times, t)
            first = max(1, count - ARRIVAL_DEPTH + 2, det.since(rank) + 1)
            windows.append(ArrivalWindow(rank, pids(t) + rank, rank, 0, count, first, tuple(times[first - 1 : count])))
        report = det.observe(windows, t, step_s)
        events.extend(report.events)
        reports.append(report)
        t += TICK
    return Run(events, reports, det)


def slow(rank: int, seconds: float, start: float, end: float = float("inf"), collective: int = 0) -> Extra:
    """``rank`` computes ``seconds`` longer before one collective of each step, between ``start`` and ``end``."""
    return lambda r, k, j, t: seconds if (r == rank and j == collective and start <= t < end) else 0.0


# -- named -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_slowed_by_a_fifth_of_the_step_is_named_within_the_window(n):
    culprit = n - 1
    run = watch(group(n, 100, extra=slow(culprit, 0.2 * STEP, start=40)), step_s=STEP)
    assert run.kinds() == [(NAMED, culprit)]
    named = run.events[0]
    assert 40 + 20 <= named.at - T0 <= 40 + 30, "named after sustain_s, within the 30 s window"
    lag = named.lag
    assert lag.rank == culprit and lag.named
    assert lag.late_lag_s == pytest.approx(0.2 * STEP, rel=0.1)
    assert lag.late_fraction == pytest.approx(1 / COLLS, abs=0.05)  # late at one collective of each step
    assert lag.wait_share == pytest.approx(0.2 / 1.2, abs=0.02)
    assert run.reports[-1].named == frozenset({culprit}) and run.reports[-1].state == "straggler"
    for r in range(n - 1):
        assert run.reports[-1].ranks[r].wait_share < 0.02


@pytest.mark.parametrize("start", [13, 16])
def test_a_slowdown_that_starts_while_the_baseline_is_learned_is_named(start):
    """Warm-up is the first 10 s, the baseline is learned over the next 10: a rank that turns slow in between is
    not taken at its slow pace (its baseline is a low quantile of what was learned)."""
    run = watch(group(2, 90, extra=slow(1, 0.2 * STEP, start=start)), step_s=STEP)
    assert run.kinds() == [(NAMED, 1)]
    assert run.events[0].at - T0 <= start + 30


def test_cpu_contention_late_at_every_collective_is_named():
    extra = lambda r, k, j, t: 0.0015 if (r == 1 and t >= 40) else 0.0  # noqa: E731
    run = watch(group(2, 90, extra=extra))
    assert run.kinds() == [(NAMED, 1)]
    assert run.events[0].lag.late_fraction > 0.95


def test_an_episode_is_named_once_and_cleared_once():
    run = watch(group(2, 130, extra=slow(1, 0.2 * STEP, start=40, end=80)))
    assert run.kinds() == [(NAMED, 1), (CLEARED, 1)]
    named, cleared = run.events
    assert 60 <= named.at - T0 <= 70
    assert 80 + 10 <= cleared.at - T0 <= 80 + 15, "cleared after clear_s below the clear level"
    assert run.reports[-1].named == frozenset() and run.reports[-1].state == "ok"


def test_a_new_episode_after_the_first_one_ended_is_named_again():
    extra = lambda r, k, j, t: 0.2 * STEP if (r == 1 and j == 0 and (40 <= t < 70 or 110 <= t)) else 0.0  # noqa: E731
    run = watch(group(2, 150, extra=extra))
    assert run.kinds() == [(NAMED, 1), (CLEARED, 1), (NAMED, 1)]


# -- not named -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_an_uneven_role_on_rank_0_is_not_named(n):
    """Rank 0 detokenises: 15 % of the step more, every step, from the start."""
    run = watch(group(n, 120, extra=slow(0, 0.15 * STEP, start=0)))
    assert run.events == []
    lag = run.reports[-1].ranks[0]
    assert lag.wait_share > 0.1 and lag.baseline_share is not None and lag.baseline_share > 0.1
    assert run.reports[-1].state == "ok"


def test_a_rank_slow_from_its_first_steps_is_named_when_the_group_waits_half_its_time_for_it():
    """No baseline can be learned for a rank that is slow from the start (the engine's slow@1:20): above the
    gross share its peers' waiting names it anyway; an uneven role of a third of the step does not reach it."""
    run = watch(group(2, 90, extra=slow(1, 2.0 * STEP, start=0)))
    assert run.kinds() == [(NAMED, 1)]
    assert run.events[0].lag.wait_share > 0.5
    calm = watch(group(2, 90, extra=slow(0, 0.33 * STEP, start=0)))
    assert calm.events == []


def test_an_uneven_role_that_stops_does_not_name_its_peer():
    run = watch(group(2, 120, extra=slow(0, 0.15 * STEP, start=0, end=60)))
    assert run.events == []


def test_a_slow_rank_next_to_an_uneven_role_is_named():
    extra = lambda r, k, j, t: slow(0, 0.15 * STEP, 0)(r, k, j, t) + slow(1, 0.2 * STEP, 40, collective=2)(r, k, j, t)  # noqa: E731
    run = watch(group(2, 90, extra=extra))
    assert run.kinds() == [(NAMED, 1)]


def test_an_idle_group_says_nothing():
    arrivals = group(2, 5)  # five seconds of collectives, then nothing for minutes
    run = watch(arrivals, until=300)
    assert run.events == []
    assert run.reports[-1].state in ("learning", "ok")


def test_no_collectives_at_all_says_nothing():
    run = watch([[], []], until=60)
    assert run.events == [] and run.reports[-1].state == "waiting"


def test_warm_up_and_a_slow_first_step_are_not_named():
    extra = lambda r, k, j, t: (2.0 if k == 0 else 0.3 * STEP) if (r == 1 and j == 0 and t < 8) else 0.0  # noqa: E731
    run = watch(group(2, 90, extra=extra))
    assert run.events == []


def test_a_long_step_every_rank_shares_is_not_named():
    extra = lambda r, k, j, t: 0.4 if (j == 0 and k % 100 == 0) else 0.0  # noqa: E731  a prefill every 100 steps
    run = watch(group(2, 120, extra=extra))
    assert run.events == []


def test_a_hang_is_not_named_even_after_a_slow_start():
    """Rank 1 straggles for 15 s (less than sustain_s), then stops: the hang watchdog's, not ours."""
    arrivals = group(2, 200, extra=slow(1, 0.2 * STEP, start=40), stop=lambda r, t: r == 1 and t >= 55)
    run = watch(arrivals, until=200)
    assert run.events == []
    assert run.reports[-1].state == "held"


def test_one_long_wait_is_not_a_straggler():
    """A rank stopped for 25 s once (SIGSTOP, then SIGCONT): a recovered stall, not a slow rank."""
    run = watch(group(2, 120, extra=lambda r, k, j, t: 25.0 if (r == 1 and j == 0 and k == 3000) else 0.0))
    assert run.events == []


def test_many_fast_noisy_collectives_name_nobody():
    run = watch(group(4, 60, colls=16, step=0.004), until=65)
    assert run.events == []


def test_ranks_running_different_sequences_are_not_compared():
    """Counts that drift apart (pipeline stages): no judgement at all."""
    a = group(1, 60)[0]
    b = group(1, 60, step=STEP / 2, seed=1)[0]  # twice as many collectives
    run = watch([a, b], until=60)
    assert run.events == [] and run.reports[-1].state == "unaligned"


def test_threshold_off_names_nobody_but_keeps_the_numbers():
    run = watch(group(2, 90, extra=slow(1, 0.2 * STEP, start=40)), config=StragglerConfig(threshold=None))
    assert run.events == [] and run.reports[-1].state == "off"
    assert run.reports[-1].ranks[1].wait_share > 0.1


def test_a_restarted_group_warms_up_again_and_is_judged_afresh():
    first = group(2, 60)
    second = group(2, 80, extra=slow(1, 0.2 * STEP, start=40))
    restart_at = 62.0
    arrivals = [a + [t + restart_at for t in b] for a, b in zip(first, second, strict=True)]
    # The new processes count from 1 again: a window shows only the new process's numbers.
    det = StragglerDetector()
    events = []
    t = T0
    while t < T0 + restart_at + 80:
        windows = []
        for rank in range(2):
            new = t >= T0 + restart_at
            times = [x for x in arrivals[rank] if (x >= T0 + restart_at) == new]
            count = bisect.bisect_right(times, t)
            first_seq = max(1, count - ARRIVAL_DEPTH + 2, det.since(rank) + 1)
            windows.append(ArrivalWindow(rank, (200 if new else 100) + rank, rank, 0, count, first_seq,
                                         tuple(times[first_seq - 1 : count])))
        events.extend(det.observe(windows, t).events)
        t += TICK
    assert [(e.kind, e.rank) for e in events] == [(NAMED, 1)]
    assert 40 + 20 <= events[0].at - T0 - restart_at <= 40 + 30


# -- the sentence ----------------------------------------------------------------------------------


def _lag(**kw) -> RankLag:
    base = dict(rank=3, collectives=1000, lag_p50_s=0.0, lag_p90_s=0.04, lag_p99_s=0.05, late_fraction=0.97,
                late_lag_s=0.041, wait_share=0.34, baseline_share=0.0, excess_share=0.34, named=True)
    base.update(kw)
    return RankLag(**base)


def test_the_sentence_carries_the_numbers():
    assert sentence(_lag(), step_s=0.120) == (
        "rank 3 arrives 41 ms late at 97 % of collectives (step 120 ms, 34 % of it waiting for rank 3)"
    )
    assert sentence(_lag(late_lag_s=0.0042, baseline_share=0.05)) == (
        "rank 3 arrives 4.2 ms late at 97 % of collectives (34 % of the group's time waiting for rank 3; usually 5 %)"
    )


def test_the_named_event_says_the_sentence():
    run = watch(group(2, 90, extra=slow(1, 0.2 * STEP, start=40)), step_s=STEP * 1.2)
    text = run.events[0].sentence()
    assert text.startswith("rank 1 arrives 4.0 ms late at 25 % of collectives (step 24 ms, 1") and "waiting for rank 1" in text
    assert run.events[0].to_dict()["sentence"] == text


def test_config_is_validated():
    for bad in (dict(threshold=0.0), dict(threshold=1.5), dict(window_s=0), dict(bucket_s=40.0),
                dict(clear_ratio=0.0), dict(max_per_observe=0), dict(warmup_s=-1)):
        with pytest.raises(ValueError):
            StragglerConfig(**bad)


# -- across nodes ----------------------------------------------------------------------------------


def _node_run(arrivals: list[list[float]], ranks: list[int], shift: float = 0.0) -> tuple:
    """A node's detector over some ranks' arrivals, its clock ``shift`` seconds ahead of the reference."""
    det = StragglerDetector()
    t = T0
    end = max(a[-1] for a in arrivals) - T0
    report = None
    while t < T0 + end:
        windows = []
        for i, rank in enumerate(ranks):
            times = arrivals[i]
            count = bisect.bisect_right(times, t)
            first = max(1, count - ARRIVAL_DEPTH + 2, det.since(rank) + 1)
            windows.append(ArrivalWindow(i, 100 + rank, rank, 0, count, first,
                                         tuple(x + shift for x in times[first - 1 : count])))
        report = det.observe(windows, t + shift)
        t += TICK
    return det, report


def test_a_rank_named_on_its_node_is_named_by_every_node():
    arrivals = group(4, 90, extra=slow(3, 0.2 * STEP, start=40))
    det0, rep0 = _node_run(arrivals[:2], [0, 1])
    det1, rep1 = _node_run(arrivals[2:], [2, 3])
    s0 = summarize(rep0, det0.references(), node=0)
    s1 = NodeSummary.from_dict(summarize(rep1, det1.references(), node=1).to_dict())  # as through the store
    judgement = merge_nodes([s0, s1])
    assert [(node, rank) for node, rank, _text in judgement.named] == [(1, 3)]
    assert judgement.sentences()[0].startswith("node 1: rank 3 arrives")
    assert judgement.late_nodes == ()


def test_a_late_node_is_named_and_a_clock_offset_alone_is_not():
    # Node 1's ranks both arrive 3 ms late at every collective: within node 1 nobody is late.
    arrivals = group(4, 40, extra=lambda r, k, j, t: 0.003 if r >= 2 else 0.0)
    det0, rep0 = _node_run(arrivals[:2], [0, 1])
    shift = 5.0  # node 1's monotonic clock reads 5 s more than node 0's
    det1, rep1 = _node_run(arrivals[2:], [2, 3], shift=shift)
    assert rep1.named == frozenset()
    offset, error = clock_offset(sent=50.0 + shift, remote=50.0005, received=50.001 + shift)  # node 1 asks node 0
    s0 = summarize(rep0, det0.references(), node=0)
    s1 = summarize(rep1, det1.references(), node=1, clock_offset_s=offset, offset_error_s=error)
    judgement = merge_nodes([s0, s1])
    assert [(n.node, n.ranks) for n in judgement.late_nodes] == [(1, (2, 3))]
    assert judgement.late_nodes[0].median_lag_s == pytest.approx(0.003, abs=0.0005)
    assert judgement.sentences()[0].startswith("node 1 (ranks 2, 3) arrives late at 10 of 10 reference collectives (median 3.0 ms")

    on_time = group(4, 40)  # the same clocks, nobody late: the offset corrects the 5 s
    det0, rep0 = _node_run(on_time[:2], [0, 1])
    det1, rep1 = _node_run(on_time[2:], [2, 3], shift=shift)
    s1 = summarize(rep1, det1.references(), node=1, clock_offset_s=offset, offset_error_s=error)
    assert merge_nodes([summarize(rep0, det0.references(), node=0), s1]).late_nodes == ()

    # An offset known only to +-5 ms cannot tell 3 ms of lateness from the clocks.
    s1 = summarize(rep1, det1.references(), node=1, clock_offset_s=offset, offset_error_s=0.005)
    assert merge_nodes([summarize(rep0, det0.references(), node=0), s1]).late_nodes == ()


def test_a_node_late_by_design_is_learned_and_a_node_that_turns_late_is_named():
    """Node 1's ranks always arrive 3 ms late (its role is uneven: say it hosts the scheduler).  Once its
    baseline is learned it is no longer late; when it becomes 8 ms later than that, it is."""
    def summaries(extra_s: float) -> list[NodeSummary]:
        arrivals = group(4, 40, extra=lambda r, k, j, t: extra_s if r >= 2 else 0.0)
        det0, rep0 = _node_run(arrivals[:2], [0, 1])
        det1, rep1 = _node_run(arrivals[2:], [2, 3])
        return [summarize(rep0, det0.references(), node=0), summarize(rep1, det1.references(), node=1)]

    usual = summaries(0.003)
    assert [n.node for n in merge_nodes(usual).late_nodes] == [1], "without a baseline it reads as late"
    baselines = NodeBaselines(learn_s=20.0)
    for t in range(0, 31, 2):  # a merge every 2 s, as the straggler thread does
        judgement = merge_nodes(usual, baselines=baselines.values(float(t)))
        # while its baseline is learned it is judged without one (a node slow from the start is named once)
        assert [n.node for n in judgement.late_nodes] == ([1] if t < 20 else []), t
        baselines.observe(float(t), judgement)
    learned = baselines.values(30.0)
    assert learned[1] == pytest.approx(judgement.shares[1]) and learned[1] > 0.1 and learned[0] < 0.05
    assert merge_nodes(usual, baselines=learned).late_nodes == ()

    worse = summaries(0.011)  # 8 ms later than its usual 3 ms, at every collective
    late = merge_nodes(worse, baselines=learned)
    assert [(n.node, n.ranks) for n in late.late_nodes] == [(1, (2, 3))]
    baselines.observe(32.0, late)
    assert baselines.values(32.0)[1] == pytest.approx(learned[1]), "a late node's share is not learned"


def test_node_episodes_learn_a_node_uneven_by_design_and_announce_a_sustained_one():
    """What the straggler thread says across nodes: a node 3 ms late by design is never announced (it is learned,
    not an alarm, though it reads as late without a baseline); a node that turns 8 ms later than that is announced
    once it has been late for sustain_s of merges; a node slow from the start at the gross share is announced
    while baselines are still being learned."""
    def summaries(extra_s: float) -> list[NodeSummary]:
        arrivals = group(4, 40, extra=lambda r, k, j, t: extra_s if r >= 2 else 0.0)
        det0, rep0 = _node_run(arrivals[:2], [0, 1])
        det1, rep1 = _node_run(arrivals[2:], [2, 3])
        return [summarize(rep0, det0.references(), node=0), summarize(rep1, det1.references(), node=1)]

    config = StragglerConfig(sustain_s=6.0, baseline_min_s=10.0)
    episodes = NodeEpisodes(config)
    usual, worse = summaries(0.003), summaries(0.011)
    for t in range(0, 21, 2):
        assert episodes.judge(usual, float(t)).late_nodes == (), t
    said = [(t, [n.node for n in episodes.judge(worse, float(t)).late_nodes]) for t in range(22, 34, 2)]
    assert said == [(22, []), (24, []), (26, []), (28, [1]), (30, [1]), (32, [1])]
    assert episodes.judge(usual, 34.0).late_nodes == (), "back to its usual: the run of late merges ends"
    assert episodes.judge(worse, 36.0).late_nodes == () and episodes.judge(worse, 42.0).late_nodes != ()

    gross = summaries(0.2)  # the others wait for node 1 most of their time from the first collective
    episodes = NodeEpisodes(config)
    assert [bool(episodes.judge(gross, float(t)).late_nodes) for t in range(0, 9, 2)] == [False] * 3 + [True] * 2


def test_clock_offset_from_a_round_trip():
    assert clock_offset(10.0, 110.5, 11.0) == (100.0, 0.5)


def test_a_node_summary_that_is_not_one_is_refused():
    for raw in ({}, {"node": 1}, {"node": "x", "at": 0, "ranks": [], "references": [], "offset_error_seconds": 0}):
        with pytest.raises(ValueError):
            NodeSummary.from_dict(raw)


def test_the_lateness_in_the_sentence_is_where_the_waiting_is():
    """Late by 8 ms at one collective of each step, by noise (0.3 ms) at two others: the sentence says 8 ms
    (the wait-weighted median), not the plain median of the late arrivals (0.3 ms)."""
    from tp_supervise.watchdogs.straggler import _wait_median

    assert _wait_median([0.0003, 0.0003, 0.008] * 50) == 0.008
    assert _wait_median([0.004] * 10) == 0.004
    assert _wait_median([]) == 0.0
