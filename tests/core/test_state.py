"""EngineState transitions, exhaustively."""

import itertools

from tp_supervise.supervisor.state import EngineState as S
from tp_supervise.supervisor.state import Event as E
from tp_supervise.supervisor.state import healthy, is_fault, next_state, ready

EXPECTED = {
    (S.STARTING, E.ALL_READY): S.READY,
    (S.STARTING, E.STARTUP_TIMEOUT): S.FAILED,
    (S.STARTING, E.RANK_EXIT): S.FAILED,
    (S.STARTING, E.HARD_HANG): S.HUNG,
    (S.STARTING, E.DIVERGENCE_ENFORCED): S.DIVERGED,
    (S.STARTING, E.TEARDOWN): S.TEARING_DOWN,
    (S.STARTING, E.STOPPED): S.STOPPED,
    (S.READY, E.SOFT_HANG): S.SUSPECT,
    (S.READY, E.DIVERGENCE_OBSERVED): S.SUSPECT,
    (S.READY, E.HARD_HANG): S.HUNG,
    (S.READY, E.DIVERGENCE_ENFORCED): S.DIVERGED,
    (S.READY, E.RANK_EXIT): S.FAILED,
    (S.READY, E.TEARDOWN): S.TEARING_DOWN,
    (S.SUSPECT, E.PROGRESS): S.READY,
    (S.SUSPECT, E.SOFT_HANG): S.SUSPECT,
    (S.SUSPECT, E.DIVERGENCE_OBSERVED): S.SUSPECT,
    (S.SUSPECT, E.HARD_HANG): S.HUNG,
    (S.SUSPECT, E.DIVERGENCE_ENFORCED): S.DIVERGED,
    (S.SUSPECT, E.RANK_EXIT): S.FAILED,
    (S.SUSPECT, E.TEARDOWN): S.TEARING_DOWN,
    (S.HUNG, E.TEARDOWN): S.TEARING_DOWN,
    (S.DIVERGED, E.TEARDOWN): S.TEARING_DOWN,
    (S.FAILED, E.TEARDOWN): S.TEARING_DOWN,
    (S.TEARING_DOWN, E.STOPPED): S.STOPPED,
    (S.STOPPED, E.RESTART): S.STARTING,
}


def test_every_pair():
    for state, event in itertools.product(S, E):
        assert next_state(state, event) is EXPECTED.get((state, event), state), (state, event)


def test_fault_states_never_return_to_ready_without_teardown():
    for state in (S.HUNG, S.DIVERGED, S.FAILED):
        for event in E:
            assert next_state(state, event) in (state, S.TEARING_DOWN)


def test_health_predicates():
    assert [s for s in S if healthy(s)] == [S.READY, S.SUSPECT]
    assert [s for s in S if ready(s)] == [S.READY]
    assert {s for s in S if is_fault(s)} == {S.HUNG, S.DIVERGED, S.FAILED}
