"""A hang query another node sends is never lost between the main thread and the watchdog's tick (issue 37).

The main thread hands the query over (``answer_hang_query``) while the watchdog
thread may be anywhere in its tick.  Where exactly is a matter of bytecode, so
the test puts it everywhere: for every opcode the tick runs, one tick with the
query handed over at that opcode (a trace function, run by the same interpreter
that would switch threads there), then a second tick.  The query must be
answered by one of the two, whichever opcode it came at.  Real watchdog thread
object, real policy; the trace only decides when the hand-over happens.
"""

from __future__ import annotations

import sys

from tp_supervise.supervisor.observers import watchdog_thread
from tp_supervise.supervisor.observers.watchdog_thread import WatchdogThread
from tp_supervise.supervisor.processes.attempt import NOT_STARTED, Attempt, Published
from tp_supervise.supervisor.processes.spawn import RankHandle, RankSpec
from tp_supervise.supervisor.rank.heartbeat import empty_slot
from tp_supervise.supervisor.spec import LaunchSpec, MetricsOptions

TICK = WatchdogThread.tick.__code__


def watchdog() -> WatchdogThread:
    spec = LaunchSpec(command=("rank-binary",), nproc_per_node=2, zero_code_hook=False, metrics=MetricsOptions(addr=None))
    cell = Published(NOT_STARTED)
    attempt = Attempt(cell.set, started_at=1.0)
    for slot in range(2):
        attempt.add_rank(RankHandle(spec=RankSpec(slot=slot, rank=slot, argv=(), env={}), pid=4_000_000 + slot,
                                    started_at=1.0))  # fmt: skip
    return WatchdogThread(spec, read_heartbeats=lambda: [empty_slot(0), empty_slot(1)], attempt=cell,
                          post=lambda _ev: None, on_tick=lambda *_a: None)  # fmt: skip


def tick_with_query_at(wd: WatchdogThread, at: int | None, seq: int) -> int:
    """One tick; the query (seq, node 1) is handed over at the ``at``-th opcode of the tick's own frame.
    Returns how many opcodes that frame ran."""
    count = 0

    def local(frame, event, _arg):
        nonlocal count
        if event == "opcode":
            if count == at:
                wd.answer_hang_query(seq, 1)
            count += 1
        return local

    def calls(frame, event, _arg):
        if frame.f_code is TICK:
            frame.f_trace_opcodes = True
            return local
        return None

    sys.settrace(calls)
    try:
        wd.tick(10.0)
    finally:
        sys.settrace(None)
    return count


def test_a_query_handed_over_at_any_opcode_of_a_tick_is_answered(monkeypatch):
    answered: list[int] = []
    real = watchdog_thread.policy.answer_hang_query

    def spy(seq, node, verdict, snaps, states, inside_step=False):
        answered.append(seq)
        return real(seq, node, verdict, snaps, states, inside_step)

    monkeypatch.setattr(watchdog_thread.policy, "answer_hang_query", spy)
    opcodes = tick_with_query_at(watchdog(), None, -1)
    assert opcodes > 20, "the trace did not see the tick's frame"
    lost = []
    for at in range(opcodes):
        wd = watchdog()
        answered.clear()
        tick_with_query_at(wd, at, seq=at)
        wd.tick(10.1)
        if answered != [at]:
            lost.append((at, list(answered)))
    assert not lost, f"queries lost or answered twice (opcode, answered): {lost[:5]} of {len(lost)}"
