"""A peer's hang query answered by this node's watchdog (watchdogs/policy.py ``answer_hang_query``): which
ranks here are elsewhere, and the culprit the other nodes are told (docs/multinode.md, "A hang whose culprit is
on another node")."""

from __future__ import annotations

from wdfakes import Driver, SteadyGroup, snap

from tp_supervise.watchdogs import policy
from tp_supervise.watchdogs.policy import VerdictKind as K
from tp_supervise.watchdogs.policy import WatchdogConfig


def _verdict():
    """A verdict of a group in steady steps, before any query."""
    group, driver = SteadyGroup(nranks=2), Driver(WatchdogConfig(soft_timeout=3.0, hard_timeout=6.0))
    verdict = None
    for _ in range(3):
        verdict = driver.tick(group.advance(0.05))
    return verdict


def test_a_rank_stopped_inside_the_collective_is_named_like_one_outside_it():
    base = _verdict()
    snaps = [snap(0, step=5, coll=31, in_coll=True, pid=100), snap(1, step=5, coll=31, in_coll=True, pid=101)]
    answered, elsewhere = policy.answer_hang_query(31, 0, base, snaps, {100: "S", 101: "T"})
    assert answered.kind is K.HARD and answered.elsewhere_ranks == (1,)
    assert elsewhere == ["rank 1 is stopped (state T)"]


def test_outside_and_behind_are_named_and_a_rank_in_the_collective_is_not():
    base = _verdict()
    snaps = [snap(0, step=5, coll=31, in_coll=True, pid=100), snap(1, step=5, coll=30, in_coll=True, pid=101),
             snap(2, step=4, coll=29, pid=102)]
    answered, elsewhere = policy.answer_hang_query(31, 0, base, snaps, {})
    assert answered.elsewhere_ranks == (1, 2) and len(elsewhere) == 2


def test_every_rank_in_the_collective_too_leaves_the_verdict_as_it_was():
    base = _verdict()
    snaps = [snap(0, step=5, coll=31, in_coll=True, pid=100)]
    answered, elsewhere = policy.answer_hang_query(31, 0, base, snaps, {100: "S"})
    assert answered is base and elsewhere == []


def test_a_query_by_step_names_the_stopped_the_idle_and_the_behind_and_not_a_rank_inside_the_step():
    """The asking node's engine compiled its model (its ranks inside step 40, collectives unseen): a rank here
    inside step 40 outside collectives is where its peers are; stopped, outside any step or behind are elsewhere."""
    base = _verdict()
    snaps = [snap(0, step=40, in_step=True, pid=100), snap(1, step=40, in_step=True, pid=101),
             snap(2, step=40, pid=102), snap(3, step=39, in_step=True, pid=103)]  # fmt: skip
    answered, elsewhere = policy.answer_hang_query(40, 0, base, snaps, {100: "S", 101: "T"}, inside_step=True)
    assert answered.kind is K.HARD and answered.elsewhere_ranks == (1, 2, 3), elsewhere
    assert elsewhere == [
        "rank 1 is stopped (state T)",
        "rank 2 is outside steps at step 40",
        "rank 3 is behind, at step 39",
    ]
    assert "waits in step 40 (its collectives unseen)" in answered.message
    same, none = policy.answer_hang_query(40, 0, base, snaps[:1], {100: "S"}, inside_step=True)
    assert same is base and none == [], "a rank inside the step, outside collectives, is not elsewhere"
    # the same rank, asked by collective, is outside collectives: the eager answer is unchanged
    _, eager = policy.answer_hang_query(40, 0, base, snaps[:1], {100: "S"})
    assert eager == ["rank 0 is outside collectives at step 40"]


def test_the_query_by_step_crosses_the_wire_and_an_older_nodes_query_reads_as_by_collective():
    from tp_supervise.supervisor.nodes.messages import HangQuery

    query = HangQuery(1, "20261207T120000Z-abcdef", 40, "hang", inside_step=True)
    assert HangQuery.decode(query.encode(), nnodes=2) == query
    older = b'{"node": 1, "incident_id": "20261207T120000Z-abcdef", "seq": 31, "verdict": "hang"}'
    assert HangQuery.decode(older, nnodes=2).inside_step is False
