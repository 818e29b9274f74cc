"""Exit arbitration, restart policy and the published attempt view, as
functions over values: no process, no thread, no clock."""

import dataclasses
import signal

import pytest

from tp_supervise.supervisor import arbitration
from tp_supervise.supervisor.processes import exits
from tp_supervise.supervisor.arbitration import Meaning
from tp_supervise.supervisor.processes.attempt import NOT_STARTED, Attempt, Published
from tp_supervise.supervisor.processes.exits import ExitStatus
from tp_supervise.supervisor.processes.spawn import RankHandle, RankSpec
from tp_supervise.supervisor.outcome import EXIT_OK, EXIT_RANK, TEARDOWN_EXIT, Outcome
from tp_supervise.supervisor.events import EarlyExitCheck
from tp_supervise.supervisor.rank.heartbeat import CLAIMED, FINISHED, empty_slot
from tp_supervise.supervisor.restart import RESTART_BACKOFF_MAX_S, RESTART_STABLE_S, RestartPolicy


def handle(slot: int, pid: int | None = None) -> RankHandle:
    return RankHandle(spec=RankSpec(slot=slot, rank=slot, argv=(), env={}), pid=pid or 1000 + slot, started_at=1.0)


def attempt_of(n: int, launcher: bool = False) -> tuple[Attempt, Published]:
    cell = Published(NOT_STARTED)
    attempt = Attempt(cell.set, started_at=1.0)
    for slot in range(n):
        attempt.add_rank(handle(slot))
    if launcher:
        attempt.set_launcher(handle(-1, pid=999))
    return attempt, cell


def exit_with(attempt: Attempt, h: RankHandle, status: ExitStatus | None, at: float, finished: bool = False):
    def read_slot(slot):
        snap = empty_slot(slot)
        return dataclasses.replace(snap, flags=CLAIMED | FINISHED) if finished else snap

    info = arbitration.classify_exit(attempt, h, status, read_slot=read_slot, oom_said=lambda _pid: "")
    attempt.record_exit(h, info, at)
    return info


CODE0 = ExitStatus(code=0, signal=None)
CODE1 = ExitStatus(code=1, signal=None)
ABORT = ExitStatus(code=None, signal=signal.SIGABRT)


def test_a_crash_while_peers_run_is_a_failure_counted_by_its_reason():
    attempt, _ = attempt_of(2)
    h = attempt.ranks[1]
    info = exit_with(attempt, h, ABORT, at=5.0)
    ruling = arbitration.rule_exit(attempt, h, info, tearing_down=False)
    assert ruling.meaning is Meaning.FAILED
    assert ruling.count_as == exits.NATIVE_ABORT


def test_exit_zero_while_peers_run_waits_for_the_recheck_uncounted():
    attempt, _ = attempt_of(2)
    h = attempt.ranks[0]
    info = exit_with(attempt, h, CODE0, at=5.0)
    assert info.reason == exits.EARLY_EXIT
    ruling = arbitration.rule_exit(attempt, h, info, tearing_down=False)
    assert ruling.meaning is Meaning.RECHECK and ruling.count_as is None


def test_recheck_peers_still_running_is_a_failure():
    attempt, _ = attempt_of(2)
    h = attempt.ranks[0]
    exit_with(attempt, h, CODE0, at=5.0)
    ruling = arbitration.rule_early_exit_check(attempt, EarlyExitCheck(0, h.pid))
    assert ruling.meaning is Meaning.FAILED and ruling.count_as == exits.EARLY_EXIT


def test_recheck_peers_followed_is_a_clean_run():
    attempt, _ = attempt_of(2)
    h0, h1 = attempt.ranks[0], attempt.ranks[1]
    exit_with(attempt, h0, CODE0, at=5.0)
    info1 = exit_with(attempt, h1, CODE0, at=5.1)
    assert arbitration.rule_exit(attempt, h1, info1, tearing_down=False).meaning is Meaning.CLEAN
    ruling = arbitration.rule_early_exit_check(attempt, EarlyExitCheck(0, h0.pid))
    assert ruling.meaning is Meaning.CLEAN and ruling.count_as == exits.CLEAN


def test_recheck_of_another_process_in_the_slot_is_stale():
    attempt, _ = attempt_of(2)
    exit_with(attempt, attempt.ranks[0], CODE0, at=5.0)
    assert arbitration.rule_early_exit_check(attempt, EarlyExitCheck(0, 4242)).meaning is Meaning.STALE
    assert arbitration.rule_early_exit_check(attempt, EarlyExitCheck(1, 1001)).meaning is Meaning.STALE


def test_exits_after_an_outcome_or_during_teardown_are_consequences():
    attempt, _ = attempt_of(2)
    h = attempt.ranks[0]
    info = exit_with(attempt, h, CODE1, at=5.0)
    assert arbitration.rule_exit(attempt, h, info, tearing_down=True).count_as == TEARDOWN_EXIT
    attempt.finish(Outcome(EXIT_RANK, "rank_exit"))
    ruling = arbitration.rule_exit(attempt, h, info, tearing_down=False)
    assert ruling.meaning is Meaning.CONSEQUENCE and ruling.count_as == TEARDOWN_EXIT


def test_a_rank_that_said_it_finished_is_not_early():
    attempt, _ = attempt_of(2)
    h = attempt.ranks[0]
    info = exit_with(attempt, h, CODE0, at=5.0, finished=True)
    assert info.reason == exits.CLEAN
    assert arbitration.rule_exit(attempt, h, info, tearing_down=False).meaning is Meaning.DONE


def test_launcher_exit_zero_is_clean_unless_a_rank_failed_first():
    attempt, _ = attempt_of(2, launcher=True)
    info = exit_with(attempt, attempt.launcher, CODE0, at=5.0)
    assert arbitration.rule_exit(attempt, attempt.launcher, info, tearing_down=False).meaning is Meaning.CLEAN
    attempt.first_failure = (attempt.ranks[0], info)
    assert arbitration.rule_exit(attempt, attempt.launcher, info, tearing_down=False).meaning is Meaning.FAILED


def test_root_cause_is_the_earliest_failure():
    attempt, _ = attempt_of(3)
    late = exit_with(attempt, attempt.ranks[2], CODE1, at=9.0)
    exit_with(attempt, attempt.ranks[1], ABORT, at=4.0)
    first, info = arbitration.root_cause(attempt, attempt.ranks[2], late)
    assert first is attempt.ranks[1] and info.reason == exits.NATIVE_ABORT


def test_divergence_in_flight_comes_first():
    assert arbitration.divergence_first(lambda now: [], 1.0) is None
    found = arbitration.divergence_first(lambda now: ["v1", "v2"], 2.0)
    assert found.verdict == "v1" and found.at == 2.0


def test_every_change_publishes_a_new_immutable_view():
    attempt, cell = attempt_of(0)
    assert cell() is attempt.view and not cell().launched
    attempt.add_rank(handle(0))
    before = cell()
    assert before.launched and before.ranks[0].alive
    exit_with(attempt, attempt.ranks[0], CODE1, at=3.0)
    after = cell()
    assert before.ranks[0].alive, "an earlier view never changes"
    assert not after.ranks[0].alive and after.ranks[0].exit.reason == exits.NONZERO
    with pytest.raises(TypeError):
        after.ranks[1] = after.ranks[0]
    attempt.finish(Outcome(EXIT_OK, "clean"))
    assert cell().finished
    attempt.finish(Outcome(EXIT_RANK, "rank_exit"))
    assert attempt.outcome.reason == "clean", "the first outcome wins"


def test_restart_backoff_doubles_up_to_the_cap_then_gives_up():
    policy = RestartPolicy(max_restarts=7)
    fail = Outcome(EXIT_RANK, "rank_exit")
    delays = [policy.after(fail, stopping=False, uptime_s=1.0) for _ in range(7)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, RESTART_BACKOFF_MAX_S]
    assert policy.after(fail, stopping=False, uptime_s=1.0) is None


def test_backoff_starts_over_after_a_stable_run():
    policy = RestartPolicy(max_restarts=3)
    fail = Outcome(EXIT_RANK, "rank_exit")
    assert policy.after(fail, stopping=False, uptime_s=1.0) == 0.0
    assert policy.after(fail, stopping=False, uptime_s=1.0) == 1.0
    assert policy.after(fail, stopping=False, uptime_s=RESTART_STABLE_S) == 0.0
    assert policy.restarts == 1


def test_a_stable_run_gets_the_whole_budget_again_even_after_using_it_up():
    policy = RestartPolicy(max_restarts=1)
    fail = Outcome(EXIT_RANK, "rank_exit")
    assert policy.after(fail, stopping=False, uptime_s=1.0) == 0.0
    assert policy.after(fail, stopping=False, uptime_s=RESTART_STABLE_S) == 0.0  # hours later: not a crash loop
    assert policy.after(fail, stopping=False, uptime_s=1.0) is None  # a quick repeat is


def test_no_restart_when_stopping_or_clean_or_not_allowed():
    fail = Outcome(EXIT_RANK, "rank_exit")
    assert RestartPolicy(3).after(fail, stopping=True, uptime_s=1.0) is None
    assert RestartPolicy(3).after(Outcome(EXIT_OK, "clean"), stopping=False, uptime_s=1.0) is None
    assert RestartPolicy(0).after(fail, stopping=False, uptime_s=1.0) is None


def test_watchdog_reads_the_published_view_and_only_posts():
    from tp_supervise.supervisor.spec import LaunchSpec, MetricsOptions
    from tp_supervise.supervisor.observers.watchdog_thread import WatchdogThread

    spec = LaunchSpec(command=("rank-binary",), nproc_per_node=2, zero_code_hook=False, metrics=MetricsOptions(addr=None))
    cell = Published(NOT_STARTED)
    posted, ticks = [], []
    wd = WatchdogThread(
        spec,
        read_heartbeats=lambda: [empty_slot(0), empty_slot(1)],
        attempt=cell,
        post=posted.append,
        on_tick=lambda snaps, verdict, now, alive: ticks.append(dict(alive)),
    )
    wd.tick(10.0)
    assert posted == [] and ticks == [], "nothing launched: nothing watched"

    attempt = Attempt(cell.set, started_at=1.0)
    for slot in range(2):
        attempt.add_rank(handle(slot))
    wd.tick(10.0)  # unclaimed slots past the grace period: ready
    assert [type(p).__name__ for p in posted] == ["AllRanksReady"] and ticks == [{0: True, 1: True}]
    wd.tick(10.1)
    assert len(posted) == 1, "all_ready once per attempt"

    attempt.finish(Outcome(EXIT_OK, "shutdown"))
    wd.tick(10.2)
    assert len(ticks) == 2, "a finished attempt is no longer watched"

    again = Attempt(cell.set, started_at=20.0)
    for slot in range(2):
        again.add_rank(handle(slot, pid=2000 + slot))
    wd.tick(30.0)
    assert [type(p).__name__ for p in posted] == ["AllRanksReady", "AllRanksReady"], "a new attempt is watched afresh"


def test_a_rank_reaped_by_its_parent_is_an_oom_kill_when_the_kernel_says_so_else_lost():
    said = "the kernel: Memory cgroup out of memory: Killed process 11 (VLLM::Worker_TP)"
    for oom, reason in ((said, exits.OOM_KILLED), ("", exits.LOST)):
        attempt, _ = attempt_of(2)
        h = attempt.ranks[1]
        info = arbitration.classify_exit(attempt, h, None, read_slot=empty_slot, oom_said=lambda _pid, s=oom: s)
        assert info.reason == reason and (not oom or "OOM killer" in info.description), info
        assert arbitration.rule_exit(attempt, h, info, tearing_down=False).meaning is Meaning.FAILED
