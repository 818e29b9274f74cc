"""The verdict as a pure function over synthetic evidence (no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from tp_supervise.dumps import stacks as st
from tp_supervise.dumps.diagnose import KLASSES, diagnose
from tp_supervise.dumps.evidence import Evidence, ProcInfo, RankEvidence
from tp_supervise.dumps.fr_analysis import analyze
from tp_supervise.supervisor.rank import heartbeat as hb

NOW = 1000.0
C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def snap(rank, *, step=812, coll_seq=4812, op="", desc="", instrumented=True, in_step=True) -> hb.SlotSnapshot:
    flags = hb.CLAIMED | hb.READY
    if instrumented:
        flags |= hb.INSTRUMENTED
    if in_step:
        flags |= hb.IN_STEP
    if op:
        flags |= hb.IN_COLLECTIVE
    return hb.SlotSnapshot(
        rank, 100 + rank, rank, flags, 12, step, coll_seq, NOW - 5, NOW - 6, NOW - 5, 0.01, 1.0, "decode", op, desc
    )


def frames(*names, file="/app/engine.py"):
    return tuple(st.Frame(n, file, i + 1) for i, n in enumerate(names))


def thread(*names, file="/app/engine.py"):
    return (st.ThreadStack("t", "MainThread", frames(*names, file=file), is_main=True),)


COLL_STACK = (
    st.ThreadStack(
        "t",
        "MainThread",
        (st.Frame("all_reduce", C10D, 3252), st.Frame("forward", "/app/model.py", 9), st.Frame("main", "/app/run.py", 1)),
        is_main=True,
    ),
)


def rank_ev(
    rank,
    *,
    state="S",
    alive=True,
    exit=None,
    heartbeat="coll",
    threads=None,
    cpu=0.0,
    wchan="",
    prev=None,
) -> RankEvidence:
    if heartbeat == "coll":
        heartbeat = snap(rank, op="all_reduce", desc="64x256 float32")
    if threads is None:
        threads = thread("wait_in_all_reduce", "step", "main")
    proc = ProcInfo(100 + rank, state, wchan, 1.0, 4, {state: 4}) if alive else None
    return RankEvidence(
        rank=rank,
        slot=rank,
        pid=100 + rank,
        alive=alive,
        exit=exit,
        heartbeat=heartbeat,
        proc=proc,
        cpu_used_s=cpu * 2.0 if alive else None,
        cpu_window_s=2.0 if alive else None,
        prev_progress=prev,
        threads=threads,
        method="py-spy",
    )


def evidence(*ranks: RankEvidence) -> Evidence:
    return Evidence(ranks={r.rank: r for r in ranks}, started_at=NOW, duration_s=0.1, method="auto", pyspy="py-spy")


def peers(*ranks):
    return [rank_ev(r) for r in ranks]


def test_stopped_rank_root_cause_first_then_peers():
    stopped = rank_ev(1, state="T", heartbeat=snap(1, op=""), threads=thread("sample", "step", "main"))
    d = diagnose(evidence(*peers(0, 2, 3), stopped), reason="hang")
    assert d.klass == "stopped" and d.culprit_ranks == [1]
    assert d.verdict.startswith("rank 1 is stopped (state T")
    assert "at step 812" in d.verdict
    assert d.verdict.endswith("ranks 0,2,3 wait in all_reduce #4812 [64x256 float32]")
    assert d.ranks[1]["state"] == "T" and d.ranks[1]["culprit"] and not d.ranks[0]["culprit"]


def test_dead_rank_with_exit_description():
    dead = rank_ev(1, alive=False, exit={"code": None, "signal": "SIGABRT", "core_dumped": True}, heartbeat=snap(1))
    d = diagnose(evidence(*peers(0, 2, 3), dead), reason="rank_exit")
    assert d.klass == "dead" and d.culprit_ranks == [1]
    assert d.verdict.startswith("rank 1 died (killed by SIGABRT, core dumped) at step 812")
    assert d.ranks[1]["alive"] is False and d.ranks[1]["state"] is None


def test_first_death_leads_when_several():
    a = rank_ev(2, alive=False, exit={"description": "exit code 1", "at": 50.0})
    b = rank_ev(3, alive=False, exit={"description": "killed by SIGTERM", "at": 51.0})
    d = diagnose(evidence(rank_ev(0), a, b), reason="rank_exit")
    assert d.culprit_ranks == [2, 3]
    assert d.verdict.startswith("rank 2 died (exit code 1)") and "then rank 3 exited" in d.verdict
    # the exits argument overrides what the evidence carries
    d2 = diagnose(
        evidence(rank_ev(0), a, b), reason="rank_exit", exits={3: {"description": "killed by SIGKILL", "at": 10.0}}
    )
    assert d2.verdict.startswith("rank 3 died (killed by SIGKILL)")


def test_zombie_counts_as_dead():
    z = rank_ev(1, state="Z", threads=())
    d = diagnose(evidence(rank_ev(0), z), reason="hang")
    assert d.klass == "dead" and d.culprit_ranks == [1] and "zombie" in d.verdict


def test_dead_outranks_stopped():
    d = diagnose(
        evidence(rank_ev(0), rank_ev(1, state="T"), rank_ev(2, alive=False, exit={"code": 3})), reason="hang"
    )
    assert d.klass == "dead" and d.culprit_ranks == [2]


def test_uninterruptible_io_names_wchan():
    d_rank = rank_ev(2, state="D", wchan="nfs_wait_bit_killable", heartbeat=snap(2), threads=thread("read_shard", "load"))
    d = diagnose(evidence(*peers(0, 1, 3), d_rank), reason="hang")
    assert d.klass == "uninterruptible_io" and d.culprit_ranks == [2]
    assert "state D, in nfs_wait_bit_killable" in d.verdict and "read_shard (engine.py)" in d.verdict


def test_tracing_stop_is_stopped():
    d = diagnose(evidence(rank_ev(0), rank_ev(1, state="t", heartbeat=snap(1))), reason="hang")
    assert d.klass == "stopped" and d.culprit_ranks == [1] and "tracer" in d.verdict


def test_non_communication_hang_names_function_and_cpu():
    stuck = rank_ev(2, heartbeat=snap(2), threads=thread("load_batch", "step", "main", file="/app/data.py"))
    d = diagnose(evidence(*peers(0, 1, 3), stuck), reason="hang")
    assert d.klass == "non_communication_hang" and d.culprit_ranks == [2]
    assert d.verdict.startswith("rank 2 is stuck outside collectives in load_batch (data.py) (sleeping, 0% CPU)")
    assert "ranks 0,1,3 wait in all_reduce #4812" in d.verdict


def test_spinning_rank_reported_running():
    spin = rank_ev(1, state="R", cpu=0.97, heartbeat=snap(1), threads=thread("spin", "main"))
    d = diagnose(evidence(rank_ev(0), spin), reason="hang")
    assert d.culprit_ranks == [1] and "(running, 97% CPU)" in d.verdict


def test_slow_when_culprit_still_progresses():
    late = rank_ev(1, state="R", cpu=0.9, heartbeat=snap(1, step=812), threads=thread("prefill"), prev=(811, 4800))
    d = diagnose(evidence(rank_ev(0, prev=(812, 4812)), late), reason="hang_suspected")
    assert d.klass == "slow" and d.culprit_ranks == [1] and "slow: still progressing" in d.verdict


def test_no_progress_since_previous_is_not_slow():
    stuck = rank_ev(1, heartbeat=snap(1), threads=thread("prefill"), prev=(812, 4812))
    assert diagnose(evidence(rank_ev(0), stuck), reason="hang").klass == "non_communication_hang"


def test_communication_hang_minority_collective():
    odd = rank_ev(3, heartbeat=snap(3, op="all_gather", desc="32x8 float16"))
    d = diagnose(evidence(*peers(0, 1, 2), odd), reason="hang")
    assert d.klass == "communication_hang" and d.culprit_ranks == [3]
    assert "all_gather #4812 [32x8 float16]" in d.verdict and "ranks 0,1,2 wait in all_reduce" in d.verdict


def test_communication_hang_tie_names_nobody():
    odd = rank_ev(1, heartbeat=snap(1, op="all_gather", desc="32x8 float16"), threads=thread("wait_in_all_reduce", "step", "main"))
    d = diagnose(evidence(rank_ev(0), odd), reason="hang")
    assert d.klass == "communication_hang" and d.culprit_ranks == []
    assert d.verdict.startswith("ranks disagree on the collective")


def test_all_in_same_collective_blames_transport():
    d = diagnose(evidence(*peers(0, 1, 2, 3)), reason="hang")
    assert d.klass == "communication_hang" and d.culprit_ranks == []
    assert "none is elsewhere" in d.verdict and "all 4 live ranks wait in all_reduce #4812" in d.verdict


def fr_trace(ranks, seqs, *, op="gloo:all_reduce", sizes=((64, 256),), dtype="Float", retired_upto=None):
    entries = []
    for s in seqs:
        entries.append(
            {
                "collective_seq_id": s,
                "process_group": ["0", "default_pg"],
                "profiling_name": op,
                "input_sizes": [list(x) for x in sizes],
                "input_dtypes": [dtype] * len(sizes),
                "is_p2p": False,
                "retired": retired_upto is None or s <= retired_upto,
            }
        )
    return {"entries": entries, "pg_config": {"0": {"ranks": str(list(ranks))}}}


def test_flight_recorder_names_rank_missing_from_collective():
    traces = {
        0: fr_trace([0, 1, 2], range(1, 6), retired_upto=4),
        1: fr_trace([0, 1, 2], range(1, 5)),
        2: fr_trace([0, 1, 2], range(1, 6), retired_upto=4),
    }
    findings = analyze(traces)
    # no heartbeats at all: the flight recorder alone says who waits in what
    ranks = [rank_ev(r, heartbeat=None, threads=thread("x")) for r in (0, 2)]
    ranks.append(rank_ev(1, heartbeat=None, threads=thread("sample_tokens", file="/app/sampler.py")))
    d = diagnose(evidence(*ranks), reason="hang", fr_findings=findings)
    assert d.klass == "non_communication_hang" and d.culprit_ranks == [1]
    assert "sample_tokens (sampler.py)" in d.verdict and "all_reduce #5 [64x256 float32]" in d.verdict
    assert any("rank 1 never entered all_reduce seq 5" in n for n in d.notes)


def test_flight_recorder_missing_rank_waiting_elsewhere_is_communication_hang():
    traces = {0: fr_trace([0, 1], range(1, 6), retired_upto=4), 1: fr_trace([0, 1], range(1, 5))}
    odd = rank_ev(1, heartbeat=snap(1, op="barrier", desc=""))
    d = diagnose(evidence(rank_ev(0), odd), reason="hang", fr_findings=analyze(traces))
    assert d.klass == "communication_hang" and d.culprit_ranks == [1]
    assert d.verdict.startswith("rank 1 never entered all_reduce seq 5 [64x256 float32] (pg 0) and waits in barrier")


def test_stack_minority_without_heartbeats_or_collectives():
    ranks = [rank_ev(r, heartbeat=None, threads=thread("serve_forever", "main")) for r in (0, 1, 3)]
    ranks.append(rank_ev(2, heartbeat=None, threads=thread("compile_graph", "main")))
    d = diagnose(evidence(*ranks), reason="hang")
    assert d.klass == "non_communication_hang" and d.culprit_ranks == [2]
    assert [(g.label, g.ranks) for g in d.groups] == [("A", (0, 1, 3)), ("B", (2,))]
    assert d.ranks[2]["stack_group"] == "B"


def test_stack_collective_frame_counts_as_waiting():
    ranks = [rank_ev(r, heartbeat=None, threads=COLL_STACK) for r in (0, 2)]
    ranks.append(rank_ev(1, heartbeat=None, threads=thread("tokenize", "main")))
    d = diagnose(evidence(*ranks), reason="hang")
    assert d.culprit_ranks == [1] and "ranks 0,2 wait in all_reduce" in d.verdict


def test_nothing_stands_out():
    ranks = [rank_ev(r, heartbeat=snap(r, in_step=False), threads=thread("idle", "main")) for r in range(3)]
    d = diagnose(evidence(*ranks), reason="hang")
    assert d.klass == "unknown" and d.culprit_ranks == []
    assert d.verdict == "no rank stands out: all 3 live ranks are in idle (engine.py) at step 812"


def test_on_demand_progressing_job():
    ranks = [rank_ev(r, prev=(811, 4800)) for r in range(4)]
    d = diagnose(evidence(*ranks), reason="on_demand")
    assert d.klass == "unknown" and d.culprit_ranks == []
    assert d.verdict == "on-demand snapshot: all 4 live ranks are progressing"


def test_zero_code_rank_reports_collectives_not_steps():
    lazy = rank_ev(1, heartbeat=snap(1, step=0, coll_seq=3, instrumented=False, in_step=False), threads=thread("skip"))
    d = diagnose(evidence(rank_ev(0, heartbeat=snap(0, op="all_reduce", desc="64x256 float32", instrumented=False)), lazy), reason="hang")
    assert "after 3 collectives" in d.verdict and "step" not in d.verdict


def test_heartbeat_override_and_missing_stacks():
    no_stack = rank_ev(1, threads=())
    fresher = {1: snap(1, op="", in_step=True)}
    d = diagnose(evidence(rank_ev(0), no_stack), reason="hang", heartbeats=fresher)
    assert d.culprit_ranks == [1] and d.ranks[1]["stack_group"] is None


def test_summary_fields_contract():
    d = diagnose(evidence(*peers(0, 1), rank_ev(2, state="T")), reason="hang")
    fields = d.summary_fields()
    assert set(fields) >= {"culprit_ranks", "verdict", "ranks", "class", "stack_groups"}
    assert set(fields["ranks"]) == {"0", "1", "2"}
    for r in fields["ranks"].values():
        assert {"pid", "state", "exit", "stack_signature"} <= set(r)
    assert d.klass in KLASSES


@pytest.mark.parametrize("n", [1, 2, 8])
def test_verdict_is_one_sentence(n):
    ranks = peers(*range(n - 1)) + [rank_ev(n - 1, state="T")]
    d = diagnose(evidence(*ranks), reason="hang")
    assert "\n" not in d.verdict and d.verdict.count(". ") == 0


# -- the control plane: a process that is not a rank holds the group ---------------------------------------


def idle_rank(rank) -> RankEvidence:
    """A TP worker waiting for the scheduler's next step: outside steps and collectives."""
    return rank_ev(rank, heartbeat=snap(rank, in_step=False), threads=thread("acquire_read", "dequeue", "busy_loop"))


def scheduler_ev(*, state="S", in_step=True, threads=None, cpu=0.0, pid=77) -> RankEvidence:
    flags = hb.CLAIMED | hb.READY | hb.INSTRUMENTED | (hb.IN_STEP if in_step else 0)
    control = hb.SlotSnapshot(0, pid, -1, flags, 0, 400, 0, NOW - 9, NOW - 9.8, 0.0, 0.1, 1.0, "schedule", "", "")
    return RankEvidence(
        rank=-1,
        slot=-2,
        pid=pid,
        alive=True,
        exit=None,
        heartbeat=control,
        proc=ProcInfo(pid, state, "", 1.0, 4, {state: 4}),
        cpu_used_s=cpu * 2.0,
        cpu_window_s=2.0,
        threads=threads if threads is not None else thread("schedule", "step", "run_busy_loop", file="/v/core.py"),
        method="py-spy",
        title="VLLM::EngineCore",
        role="scheduler",
    )


def test_stopped_scheduler_is_named_and_the_idle_ranks_wait_for_it():
    ev = Evidence({0: idle_rank(0), 1: idle_rank(1), -1: scheduler_ev(state="T")}, NOW, 0.1, "py-spy", None)
    d = diagnose(ev, reason="hang")
    assert d.klass == "control_plane" and d.culprit_ranks == []
    assert d.culprit == {"role": "scheduler", "pid": 77, "title": "VLLM::EngineCore", "rank": None}
    assert d.verdict.startswith("the scheduler (pid 77, VLLM::EngineCore) is stopped (state T"), d.verdict
    assert d.verdict.endswith("ranks 0,1 are idle, waiting for its next step"), d.verdict
    fields = d.summary_fields()
    assert set(fields["ranks"]) == {"0", "1"}
    assert fields["processes"]["77"]["state"] == "T" and fields["processes"]["77"]["culprit"]


def test_scheduler_stuck_inside_its_step_is_named_with_its_function():
    stuck = thread("_plan_stuck", "schedule", "step", file="/v/plugin.py")
    ev = Evidence({0: idle_rank(0), 1: idle_rank(1), -1: scheduler_ev(threads=stuck, cpu=0.02)}, NOW, 0.1, "py-spy", None)
    d = diagnose(ev, reason="hang")
    assert d.klass == "control_plane" and d.culprit["role"] == "scheduler"
    assert "is stuck inside its step for 9.8 s in _plan_stuck (plugin.py)" in d.verdict, d.verdict
    assert "phase schedule" in d.verdict
    named = Evidence({0: idle_rank(0), -1: dataclasses.replace(scheduler_ev(), words="vLLM's engine core")}, NOW, 0.1,
                     "py-spy", None)  # fmt: skip
    assert diagnose(named, reason="hang").verdict.startswith("vLLM's engine core (pid 77, VLLM::EngineCore) is stuck")


def test_a_rank_stopped_or_in_a_step_comes_before_the_control_plane():
    """The scheduler waits inside its step for the workers: a rank that is somewhere else is the culprit."""
    stopped = rank_ev(1, state="T", heartbeat=snap(1, in_step=True))
    ev = Evidence({0: rank_ev(0), 1: stopped, -1: scheduler_ev()}, NOW, 0.1, "py-spy", None)
    d = diagnose(ev, reason="hang")
    assert d.culprit_ranks == [1] and d.culprit["role"] == "rank" and d.culprit["rank"] == 1
    assert d.summary_fields()["processes"]["77"]["culprit"] is False
    busy = Evidence({0: rank_ev(0), 1: rank_ev(1, heartbeat=snap(1)), -1: scheduler_ev()}, NOW, 0.1, "py-spy", None)
    assert diagnose(busy, reason="hang").klass != "control_plane"


def test_a_scheduler_between_steps_and_running_names_nobody_of_the_control_plane():
    ev = Evidence({0: idle_rank(0), 1: idle_rank(1), -1: scheduler_ev(in_step=False)}, NOW, 0.1, "py-spy", None)
    d = diagnose(ev, reason="hang")
    assert d.klass != "control_plane" and d.culprit is None


def test_an_on_demand_snapshot_of_a_healthy_engine_names_no_control_plane_culprit():
    """Every step begins with the scheduler inside it and the workers idle: only a hang may blame it."""
    ev = Evidence({0: idle_rank(0), 1: idle_rank(1), -1: scheduler_ev()}, NOW, 0.1, "py-spy", None)
    d = diagnose(ev, reason="on_demand")
    assert d.klass != "control_plane" and d.culprit is None
    assert diagnose(ev, reason="hang").klass == "control_plane"


def test_a_scheduler_handling_a_request_between_steps_is_named_not_the_front_end():
    """Requests wait at the front end while the engine core is busy with a client's utility call: the engine
    core is what holds them."""
    busy = dataclasses.replace(scheduler_ev(in_step=False), heartbeat=dataclasses.replace(
        scheduler_ev(in_step=False).heartbeat, phase="request"), threads=thread("load_lora", "_handle_client_request"))  # fmt: skip
    ev = Evidence({0: idle_rank(0), 1: idle_rank(1), -1: busy}, NOW, 0.1, "py-spy", None)
    d = diagnose(ev, reason="hang")
    assert d.klass == "control_plane" and d.culprit["role"] == "scheduler"
    assert "stuck between steps handling a client's request in load_lora" in d.verdict, d.verdict
