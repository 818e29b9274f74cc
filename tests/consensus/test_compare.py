"""Pure comparison: digest splits, step decisions with a fake clock, first differences."""

from __future__ import annotations

import itertools

import pytest

from tp_supervise.supervisor.rank import encoding
from tp_supervise.consensus.compare import (
    MAJORITY,
    MISSING,
    PLURALITY,
    TIE,
    OpenStepComparer,
    Outcome,
    StepTable,
    assess,
    first_difference,
    locate,
    split_digests,
    value_at,
)

WAIT = 1.0


def d(label) -> bytes:
    return encoding.digest(str(label).encode())


# -- split_digests: every assignment of digests to 1..4 ranks ------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_split_exhaustive(n):
    for labels in itertools.product(range(n), repeat=n):
        digests = {r: d(lab) for r, lab in enumerate(labels)}
        split = split_digests(digests)
        sizes = sorted((len(g.ranks) for g in split.groups), reverse=True)
        # groups partition the ranks, largest first
        assert sorted(r for g in split.groups for r in g.ranks) == list(range(n))
        assert [len(g.ranks) for g in split.groups] == sizes
        assert split.reference == split.groups[0].ranks
        assert set(split.culprits) == set(range(n)) - set(split.reference)
        assert list(split.culprits) == sorted(split.culprits)
        top = sizes[0]
        if len(sizes) > 1 and sizes[1] == top:
            assert split.decided_by == TIE
            tied = [g.ranks for g in split.groups if len(g.ranks) == top]
            assert split.reference == min(tied, key=lambda r: r[0])
            assert min(r for t in tied for r in t) in split.reference  # lowest rank is the reference
        elif 2 * top > n:
            assert split.decided_by == MAJORITY
        else:
            assert split.decided_by == PLURALITY
        # the reference's members all share one digest, culprits never share the reference digest
        ref_digest = digests[split.reference[0]]
        assert all(digests[r] == ref_digest for r in split.reference)
        assert all(digests[r] != ref_digest for r in split.culprits)


def test_split_two_ranks_rank0_is_reference():
    split = split_digests({0: d("a"), 1: d("b")})
    assert split.decided_by == TIE and split.reference == (0,) and split.culprits == (1,)
    split = split_digests({1: d("a"), 0: d("b")})
    assert split.reference == (0,) and split.culprits == (1,)


def test_split_majority_decides_for_three_and_four():
    assert split_digests({0: d("x"), 1: d("a"), 2: d("a")}).culprits == (0,)
    split = split_digests({0: d("a"), 1: d("a"), 2: d("b"), 3: d("a")})
    assert split.culprits == (2,) and split.decided_by == MAJORITY
    split = split_digests({0: d("a"), 1: d("b"), 2: d("b"), 3: d("c")})
    assert split.culprits == (0, 3) and split.decided_by == PLURALITY
    split = split_digests({0: d("a"), 1: d("b"), 2: d("b"), 3: d("a")})
    assert split.reference == (0, 3) and split.culprits == (1, 2) and split.decided_by == TIE


def test_split_rejects_empty():
    with pytest.raises(ValueError):
        split_digests({})


# -- assess: every combination of present digests and waiting ranks -------------------


@pytest.mark.parametrize("n", [2, 3, 4])
def test_assess_exhaustive(n):
    for present_mask in itertools.product([False, True], repeat=n):
        present = [r for r in range(n) if present_mask[r]]
        waiting = [r for r in range(n) if not present_mask[r]]
        for labels in itertools.product(range(2), repeat=len(present)):
            digests = {r: d(lab) for r, lab in zip(present, labels)}
            for since, now in [(None, 0.0), (0.0, WAIT / 2), (0.0, WAIT), (0.0, WAIT * 3)]:
                out = assess(digests, waiting, since, now, WAIT)
                distinct = set(digests.values())
                if not digests:
                    assert out is Outcome.PENDING
                elif len(distinct) == 1:
                    assert out is (Outcome.PENDING if waiting else Outcome.AGREE)
                elif not waiting:
                    assert out is Outcome.DIVERGED
                else:
                    top = max(list(digests.values()).count(x) for x in distinct)
                    timed_out = since is not None and now - since >= WAIT
                    expect = 2 * top > n or timed_out
                    assert out is (Outcome.DIVERGED if expect else Outcome.PENDING), (digests, waiting, now)


# -- StepTable: arrival orders, late ranks, skipped steps, episodes ----------------------


def _table(n, max_pending=16):
    return StepTable(list(range(n)), WAIT, max_pending)


def test_agreement_needs_every_member():
    t = _table(3)
    t.add(0, 5, d("a"), 3, "r0", now=0.0)
    t.add(1, 5, d("a"), 3, "r1", now=0.0)
    assert t.decide(0.1) == [] and t.pending == 1
    t.add(2, 5, d("a"), 3, "r2", now=0.2)
    [dec] = t.decide(0.2)
    assert dec.outcome is Outcome.AGREE and dec.step == 5 and dec.missing == ()
    assert dec.refs == {0: "r0", 1: "r1", 2: "r2"} and t.pending == 0


@pytest.mark.parametrize("order", list(itertools.permutations(range(2))))
def test_two_ranks_any_arrival_order(order):
    t = _table(2)
    for r in order:
        t.add(r, 20, d("a" if r == 0 else "b"), 2, r, now=0.0)
    [dec] = t.decide(0.0)
    assert dec.outcome is Outcome.DIVERGED and dec.first_of_episode
    assert split_digests(dec.digests).culprits == (1,)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_four_ranks_every_arrival_order_detects_at_the_step(order):
    t = _table(4)
    decisions = []
    now = 0.0
    for r in order:
        t.add(r, 7, d("bad" if r == 2 else "ok"), 4, r, now=now)
        decisions += t.decide(now)
        now += 0.01
    [dec] = decisions
    assert dec.outcome is Outcome.DIVERGED and dec.step == 7
    assert split_digests(dec.digests).culprits == (2,)


def test_majority_is_decided_before_a_late_rank_arrives():
    t = _table(4)
    for r in (0, 1, 3):
        t.add(r, 3, d("bad" if r == 3 else "ok"), 1, r, now=0.0)
    # 2 of 4 agree: not yet a strict majority, rank 2 may still tip it
    assert t.decide(0.0) == []
    t2 = _table(3)
    t2.add(0, 3, d("ok"), 1, 0, now=0.0)
    t2.add(1, 3, d("ok"), 1, 1, now=0.0)
    assert t2.decide(0.0) == []  # agree so far, rank 2 waiting
    t2.add(2, 3, d("bad"), 1, 2, now=0.0)
    [dec] = t2.decide(0.0)
    assert dec.outcome is Outcome.DIVERGED


def test_strict_majority_with_a_hung_rank_decides_at_once():
    t = _table(4)
    t.add(0, 3, d("ok"), 1, 0, now=0.0)
    t.add(1, 3, d("ok"), 1, 1, now=0.0)
    t.add(2, 3, d("ok"), 1, 2, now=0.0)
    assert t.decide(0.0) == []
    t2 = _table(5)
    for r, lab in [(0, "ok"), (1, "ok"), (2, "ok"), (3, "bad")]:
        t2.add(r, 3, d(lab), 1, r, now=0.0)
    [dec] = t2.decide(0.0)  # 3 of 5 already agree: rank 4 cannot change the verdict
    assert dec.outcome is Outcome.DIVERGED and dec.missing == (4,)
    assert split_digests(dec.digests).culprits == (3,)


def test_mismatch_with_a_hung_rank_waits_then_decides_without_it():
    t = _table(3)
    t.add(0, 9, d("a"), 1, 0, now=10.0)
    t.add(1, 9, d("b"), 1, 1, now=10.5)  # mismatch first seen at 10.5
    assert t.decide(10.6) == []
    assert t.decide(10.5 + WAIT - 0.01) == []
    [dec] = t.decide(10.5 + WAIT)
    assert dec.outcome is Outcome.DIVERGED and dec.missing == (2,)
    assert split_digests(dec.digests).culprits == (1,)  # a tie among the present: rank 0 reference


def test_late_rank_resolves_the_tie_before_the_wait_ends():
    t = _table(3)
    t.add(0, 9, d("a"), 1, 0, now=0.0)
    t.add(1, 9, d("b"), 1, 1, now=0.0)
    assert t.decide(0.1) == []
    t.add(2, 9, d("b"), 1, 2, now=0.2)
    [dec] = t.decide(0.2)
    assert split_digests(dec.digests).culprits == (0,)  # the majority decides, not rank order


def test_skipped_step_does_not_block_agreement():
    t = _table(2)
    t.add(0, 4, d("a"), 1, 0, now=0.0)
    t.add(1, 5, d("c"), 1, 1, now=0.0)  # rank 1 never published step 4
    t.add(0, 5, d("c"), 1, 0, now=0.0)
    decs = t.decide(0.0)
    assert [(x.step, x.outcome) for x in decs] == [(4, Outcome.AGREE), (5, Outcome.AGREE)]
    assert decs[0].missing == (1,)


def test_decisions_come_in_step_order_and_late_arrivals_are_ignored():
    t = _table(2)
    for step in (3, 1, 2):
        t.add(0, step, d(step), 1, 0, now=0.0)
        t.add(1, step, d(step), 1, 1, now=0.0)
    assert [x.step for x in t.decide(0.0)] == [1, 2, 3]
    t.add(1, 2, d("again"), 1, 1, now=0.0)
    assert t.decide(0.0) == [] and t.late_arrivals == 1


def test_episode_reports_first_divergence_only_until_agreement():
    t = _table(2)
    firsts = []
    for step, (a, b) in enumerate([("x", "x"), ("x", "y"), ("x", "z"), ("x", "x"), ("p", "q")]):
        t.add(0, step, d(a), 1, 0, now=0.0)
        t.add(1, step, d(b), 1, 1, now=0.0)
        for dec in t.decide(0.0):
            firsts.append((dec.step, dec.outcome, dec.first_of_episode))
    assert firsts == [
        (0, Outcome.AGREE, False),
        (1, Outcome.DIVERGED, True),
        (2, Outcome.DIVERGED, False),
        (3, Outcome.AGREE, False),
        (4, Outcome.DIVERGED, True),
    ]


def test_pending_steps_are_bounded():
    t = _table(2, max_pending=4)
    expired = []
    for step in range(10):
        t.add(0, step, d(step), 1, 0, now=0.0)  # rank 1 never publishes
        expired += [x.step for x in t.decide(0.0) if x.outcome is Outcome.EXPIRED]
    assert expired == list(range(6)) and t.pending == 4


def test_reset_member_forgets_a_restarted_rank():
    t = _table(2)
    t.add(1, 50, d("old"), 1, 1, now=0.0)
    t.add(0, 0, d("new"), 1, 0, now=0.0)
    t.reset_member(1)  # rank 1 restarted: its step numbers start over
    t.add(1, 0, d("new"), 1, 1, now=0.0)
    decs = t.decide(0.0)
    assert [(x.step, x.outcome) for x in decs] == [(0, Outcome.AGREE)]
    assert t.pending == 1  # step 50 now waits for rank 0


def test_idle_decide_does_no_work_but_deadlines_still_fire():
    t = _table(3)
    t.add(0, 1, d("a"), 1, 0, now=0.0)
    t.add(1, 1, d("b"), 1, 1, now=0.0)
    assert t.decide(0.0) == []
    assert t.decide(0.5) == []
    assert [x.outcome for x in t.decide(WAIT)] == [Outcome.DIVERGED]


def test_table_validates():
    with pytest.raises(ValueError):
        StepTable([], WAIT, 4)
    with pytest.raises(ValueError):
        StepTable([0], WAIT, 0)
    with pytest.raises(ValueError):
        _table(2).add(5, 0, d("a"), 1, 0, now=0.0)


# -- first differences ---------------------------------------------------------------


def enc(*events):
    return [encoding.encode_event(k, p).encode() for k, p in events]


def test_locate_paths():
    assert locate({"a": 1}, {"a": 1}) is None
    assert locate({"a": [1, 2]}, {"a": [1, 3]}) == ("a", 1)
    assert locate({"a": 1, "b": 2}, {"a": 1}) == ("b",)
    assert locate([1, 2], [1, 2, 3]) == (2,)
    assert locate(1, True) == ()  # bool is not int: encodings differ
    assert locate(1, 1.0) == ()
    assert locate(float("nan"), float("nan")) is None
    assert locate({"x": {"y": [0, {"z": "p"}]}}, {"x": {"y": [0, {"z": "q"}]}}) == ("x", "y", 1, "z")
    assert value_at({"x": [5]}, ("x", 0)) == 5
    assert value_at({"x": [5]}, ("x", 1)) is MISSING
    assert value_at({"x": [5]}, ("y",)) is MISSING


def test_first_difference_in_payload():
    ref = enc(("batch", {"ids": ["a", "b"]}), ("sample", {"tokens": [42, 7]}))
    bad = enc(("batch", {"ids": ["a", "b"]}), ("sample", {"tokens": [17, 7]}))
    fd = first_difference({0: ref, 1: bad}, 0, [1])
    assert fd.index == 1 and fd.kinds == {0: "sample", 1: "sample"}
    assert fd.path == ("tokens", 0) and fd.values == {0: 42, 1: 17}
    assert fd.events[1] == {"tokens": [17, 7]}


def test_first_difference_kind_and_length():
    ref = enc(("batch", 1), ("sample", 2), ("stop", 3))
    other_kind = enc(("batch", 1), ("stop", 3))
    fd = first_difference({0: ref, 1: other_kind}, 0, [1])
    assert fd.index == 1 and fd.kinds == {0: "sample", 1: "stop"} and fd.path == ()
    short = enc(("batch", 1), ("sample", 2))
    fd = first_difference({0: ref, 2: short}, 0, [2])
    assert fd.index == 2 and fd.kinds == {0: "stop", 2: None} and fd.values[2] is MISSING
    fd = first_difference({0: short, 2: ref}, 0, [2])
    assert fd.kinds == {0: None, 2: "stop"}


def test_first_difference_several_culprits_earliest_index():
    ref = enc(("a", 1), ("b", 2), ("c", 3))
    c1 = enc(("a", 1), ("b", 2), ("c", 4))
    c2 = enc(("a", 1), ("b", 9), ("c", 3))
    fd = first_difference({0: ref, 1: c1, 2: c2}, 0, [1, 2])
    assert fd.index == 1 and fd.values == {0: 2, 1: 2, 2: 9}


def test_first_difference_none_when_logs_equal_or_missing():
    logs = enc(("a", 1))
    assert first_difference({0: logs, 1: logs}, 0, [1]) is None
    assert first_difference({1: logs}, 0, [1]) is None
    assert first_difference({0: logs}, 0, [1]) is None


# -- forced decisions and the step in progress ---------------------------------------


def test_force_judges_mismatches_without_waiting_but_not_agreements():
    t = _table(3)
    t.add(0, 1, d("a"), 1, 0, now=0.0)
    t.add(1, 1, d("b"), 1, 1, now=0.0)
    t.add(0, 2, d("c"), 1, 0, now=0.0)
    t.add(1, 2, d("c"), 1, 1, now=0.0)
    assert t.decide(0.0) == []
    [dec] = t.decide(0.0, force=True)
    assert (dec.step, dec.outcome, dec.missing) == (1, Outcome.DIVERGED, (2,))
    assert t.pending == 1  # step 2 agrees so far: it still waits for rank 2


def test_episode_can_be_entered_from_outside():
    t = _table(2)
    assert not t.in_episode
    t.enter_episode()
    t.add(0, 0, d("a"), 1, 0, now=0.0)
    t.add(1, 0, d("b"), 1, 1, now=0.0)
    [dec] = t.decide(0.0)
    assert dec.outcome is Outcome.DIVERGED and not dec.first_of_episode


def lines(*items):
    return [str(x).encode() for x in items]


def test_open_step_mismatch_is_found_event_by_event():
    c = OpenStepComparer([0, 1], WAIT)
    log0, log1 = lines("b1"), []
    c.update(0, 9, log0)
    c.update(1, 9, log1)
    assert c.decide(0.0) == []  # rank 1 has not recorded anything yet
    log1.extend(lines("b1"))
    assert c.decide(0.0) == []
    log0.extend(lines("t42"))
    log1.extend(lines("t17"))
    [dec] = c.decide(0.0)
    assert (dec.after, dec.index, dec.missing) == (9, 1, ())
    assert dec.lines == {0: b"t42", 1: b"t17"}
    assert c.decide(0.0) == []  # reported once per open step


def test_open_step_only_compares_ranks_in_the_same_step():
    c = OpenStepComparer([0, 1], WAIT)
    c.update(0, 9, lines("x"))
    c.update(1, 8, lines("y"))  # rank 1 is still in the step before
    assert c.decide(100.0) == []
    c.update(1, 9, lines("x"))
    assert c.decide(100.0) == []


def test_open_step_waits_for_a_third_rank_then_decides_or_is_forced():
    c = OpenStepComparer([0, 1, 2], WAIT)
    c.update(0, 4, lines("a"))
    c.update(1, 4, lines("b"))
    c.update(2, 3, lines())  # rank 2 is behind
    assert c.decide(0.0) == []
    assert c.decide(WAIT / 2) == []
    [dec] = c.decide(WAIT / 2, force=True)
    assert dec.missing == (2,) and dec.index == 0


def test_open_step_majority_decides_without_waiting():
    c = OpenStepComparer([0, 1, 2, 3, 4], WAIT)
    for r, item in enumerate(["a", "a", "a", "b"]):
        c.update(r, 0, lines(item))
    [dec] = c.decide(0.0)
    assert split_digests(dec.lines).culprits == (3,) and dec.missing == (4,)


def test_open_step_new_step_rearms_and_forgets():
    c = OpenStepComparer([0, 1], 0.0)
    c.update(0, 1, lines("a"))
    c.update(1, 1, lines("b"))
    assert len(c.decide(0.0)) == 1
    c.update(0, 2, lines("a"))
    c.update(1, 2, lines("a", "z"))
    assert c.decide(0.0) == []
    c.forget(1)
    assert c.decide(0.0) == []
