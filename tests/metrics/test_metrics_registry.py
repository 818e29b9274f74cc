"""SupervisorMetrics: names, pre-initialised label values, derived values (fake clock)."""

from __future__ import annotations

import dataclasses
import math

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tp_supervise.supervisor.processes import exits
from tp_supervise.supervisor.rank import heartbeat as hb
from tp_supervise.supervisor.observers.metrics import (
    DUMP_REASONS,
    DUMP_RESULTS,
    ENGINE_STATES,
    OTHER,
    RANK_EXIT_REASONS,
    TEARDOWN_EXIT,
    SupervisorMetrics,
)
from tp_supervise.supervisor.state import EngineState


def samples(m: SupervisorMetrics) -> dict[tuple[str, frozenset], float]:
    body, _ = m.exposition()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: SupervisorMetrics, name: str, **labels) -> float:
    return samples(m)[(name, frozenset(labels.items()))]


def has(m: SupervisorMetrics, name: str, **labels) -> bool:
    return (name, frozenset(labels.items())) in samples(m)


def snap(slot: int, **fields) -> hb.SlotSnapshot:
    base = dataclasses.replace(hb.empty_slot(slot), pid=1000 + slot, rank=slot, flags=hb.CLAIMED)
    return dataclasses.replace(base, **fields)


# -- names and pre-initialisation ------------------------------------------------


def test_fresh_registry_has_every_closed_label_value_at_zero():
    m = SupervisorMetrics("run-a", slot_ranks=[4, 5], node=2, version="9.9")
    s = samples(m)
    assert s[("supervise_info", frozenset({"run_id": "run-a", "version": "9.9", "node": "2"}.items()))] == 1
    for kind in ("soft", "hard"):
        assert s[("supervise_hangs_total", frozenset({"kind": kind}.items()))] == 0
    for reason in RANK_EXIT_REASONS:
        assert s[("supervise_rank_exits_total", frozenset({"reason": reason}.items()))] == 0
    for reason in DUMP_REASONS:
        for result in DUMP_RESULTS:
            assert s[("supervise_dumps_total", frozenset({"reason": reason, "result": result}.items()))] == 0
    for result in ("complete", "incomplete"):
        assert s[("supervise_teardowns_total", frozenset({"result": result}.items()))] == 0
    for kind in ("soft", "hard", "startup"):
        assert math.isnan(s[("supervise_watchdog_threshold_seconds", frozenset({"kind": kind}.items()))])
    assert math.isnan(s[("supervise_teardown_seconds", frozenset())])
    for rank in ("4", "5"):
        labels = frozenset({"rank": rank}.items())
        assert s[("supervise_rank_up", labels)] == 0
        assert s[("supervise_step_duration_seconds_count", labels)] == 0
        assert s[("supervise_collective_duration_seconds_count", labels)] == 0
        assert math.isnan(s[("supervise_rank_heartbeat_age_seconds", labels)])
    for name in (
        "supervise_divergences_total",
        "supervise_restarts_total",
        "supervise_consensus_comparisons_total",
        "supervise_consensus_mismatches_total",
        "supervise_incident_open",
        "supervise_stall_seconds",
        "supervise_dump_duration_seconds_count",
    ):
        assert s[(name, frozenset())] == 0, name


def test_exit_reasons_cover_the_supervisor_taxonomy():
    assert set(RANK_EXIT_REASONS) == {exits.CLEAN, *exits.REASONS, TEARDOWN_EXIT, OTHER}


def test_engine_state_is_one_hot_over_every_state():
    m = SupervisorMetrics("run")
    assert set(ENGINE_STATES) == {s.value for s in EngineState}
    assert m.state == "starting"
    for state in EngineState:
        m.set_engine_state(state)
        values = {st: value(m, "supervise_engine_state", state=st) for st in ENGINE_STATES}
        assert values == {st: (1.0 if st == state.value else 0.0) for st in ENGINE_STATES}
        assert m.state == state.value
    m.set_engine_state("ready")
    assert value(m, "supervise_engine_state", state="ready") == 1
    with pytest.raises(ValueError, match="unknown engine state"):
        m.set_engine_state("exploded")


def test_instances_are_independent_and_stay_out_of_the_global_registry():
    a, b = SupervisorMetrics("a"), SupervisorMetrics("b")
    a.record_hang("hard")
    assert value(a, "supervise_hangs_total", kind="hard") == 1
    assert value(b, "supervise_hangs_total", kind="hard") == 0
    global_names = {mf.name for mf in prometheus_client.REGISTRY.collect()}
    assert not any(n.startswith("supervise_") for n in global_names)


# -- counters and folding -----------------------------------------------------------


def test_counters_advance_and_unknown_labels_fold_into_other():
    m = SupervisorMetrics("run")
    m.record_hang("soft")
    m.record_hang("soft")
    m.record_divergence()
    m.record_restart()
    m.record_rank_exit(exits.SEGFAULT)
    m.record_rank_exit("struck-by-lightning")
    m.record_dump("hang", ok=True, duration_s=0.4)
    m.record_dump("nonsense", ok=False, duration_s=2.0)
    m.record_teardown(1.5, complete=False)
    assert value(m, "supervise_hangs_total", kind="soft") == 2
    assert value(m, "supervise_divergences_total") == 1
    assert value(m, "supervise_restarts_total") == 1
    assert value(m, "supervise_rank_exits_total", reason="segfault") == 1
    assert value(m, "supervise_rank_exits_total", reason=OTHER) == 1
    assert not has(m, "supervise_rank_exits_total", reason="struck-by-lightning")
    assert value(m, "supervise_dumps_total", reason="hang", result="ok") == 1
    assert value(m, "supervise_dumps_total", reason=OTHER, result="failed") == 1
    assert value(m, "supervise_dump_duration_seconds_count") == 2
    assert value(m, "supervise_dump_duration_seconds_sum") == pytest.approx(2.4)
    assert value(m, "supervise_dump_duration_seconds_bucket", le="0.5") == 1
    assert value(m, "supervise_teardown_seconds") == 1.5
    assert value(m, "supervise_teardowns_total", result="incomplete") == 1
    with pytest.raises(ValueError):
        m.record_hang("medium")


def test_consensus_counts_advance_by_difference_and_survive_a_monitor_restart():
    m = SupervisorMetrics("run")
    m.set_consensus_counts(10, 0)
    m.set_consensus_counts(25, 1)
    m.set_consensus_counts(25, 1)
    assert value(m, "supervise_consensus_comparisons_total") == 25
    assert value(m, "supervise_consensus_mismatches_total") == 1
    m.set_consensus_counts(3, 0)  # a new monitor after a restart counts from zero
    assert value(m, "supervise_consensus_comparisons_total") == 28
    assert value(m, "supervise_consensus_mismatches_total") == 1


def test_watchdog_thresholds_nan_when_off_and_stall_never_negative():
    m = SupervisorMetrics("run")
    m.set_watchdog(soft=3.0, hard=None, startup=120.0, stalled_s=1.25)
    assert value(m, "supervise_watchdog_threshold_seconds", kind="soft") == 3.0
    assert math.isnan(value(m, "supervise_watchdog_threshold_seconds", kind="hard"))
    assert value(m, "supervise_watchdog_threshold_seconds", kind="startup") == 120.0
    assert value(m, "supervise_stall_seconds") == 1.25
    m.set_watchdog(soft=math.inf, hard=60.0, stalled_s=-1.0)
    assert math.isnan(value(m, "supervise_watchdog_threshold_seconds", kind="soft"))
    assert math.isnan(value(m, "supervise_watchdog_threshold_seconds", kind="startup"))
    assert value(m, "supervise_stall_seconds") == 0


def test_gpu_gauges_convert_percent_and_skip_refused_readings():
    m = SupervisorMetrics("run")
    assert not any(name.startswith("supervise_gpu_") for name, _ in samples(m))
    m.set_gpu(0, utilization_pct=97.0, power_watts=412.5, memory_used_bytes=8 << 30, memory_total_bytes=80 << 30)
    m.set_gpu(1, utilization_pct=None, power_watts=100.0, memory_used_bytes=None)
    assert value(m, "supervise_gpu_utilization_ratio", gpu="0") == pytest.approx(0.97)
    assert value(m, "supervise_gpu_power_watts", gpu="0") == 412.5
    assert value(m, "supervise_gpu_memory_used_bytes", gpu="0") == 8 << 30
    assert value(m, "supervise_gpu_memory_total_bytes", gpu="0") == 80 << 30
    assert value(m, "supervise_gpu_power_watts", gpu="1") == 100.0
    assert not has(m, "supervise_gpu_utilization_ratio", gpu="1")
    assert not has(m, "supervise_gpu_memory_used_bytes", gpu="1")


def test_observe_gpus_reads_telemetry_samples():
    from tp_supervise.watchdogs.gpu import GpuSample

    m = SupervisorMetrics("run")
    m.observe_gpus(
        [
            GpuSample(index=0, uuid="GPU-a", utilization_pct=100.0, power_w=650.0, memory_used=70 << 30,
                      memory_total=141 << 30, processes=()),
            GpuSample(index=1, uuid="GPU-b", utilization_pct=None, power_w=None, memory_used=None,
                      memory_total=None, processes=()),
        ]
    )
    assert value(m, "supervise_gpu_utilization_ratio", gpu="0") == 1.0
    assert value(m, "supervise_gpu_power_watts", gpu="0") == 650.0
    assert value(m, "supervise_gpu_memory_used_bytes", gpu="0") == 70 << 30
    assert value(m, "supervise_gpu_memory_total_bytes", gpu="0") == 141 << 30
    assert not any(dict(labels).get("gpu") == "1" for _, labels in samples(m))


# -- observe_ranks: pure, fake clock -----------------------------------------------------


def test_observe_ranks_sets_per_rank_gauges_from_snapshots():
    m = SupervisorMetrics("run", slot_ranks=[0, 1, 2])
    now = 1000.0
    snaps = [
        snap(0, step=7, coll_seq=40, ts_heartbeat=now - 0.5, flags=hb.CLAIMED | hb.IN_STEP),
        snap(1, step=7, coll_seq=41, ts_heartbeat=now - 2.0, ts_coll_begin=now - 2.0,
             flags=hb.CLAIMED | hb.IN_COLLECTIVE),
        hb.empty_slot(2),  # launched, not claimed yet
    ]
    m.observe_ranks(snaps, now, alive={0: True, 1: True, 2: True})
    assert value(m, "supervise_rank_up", rank="0") == 1
    assert value(m, "supervise_rank_up", rank="2") == 1
    assert value(m, "supervise_rank_heartbeat_age_seconds", rank="0") == pytest.approx(0.5)
    assert value(m, "supervise_rank_heartbeat_age_seconds", rank="1") == pytest.approx(2.0)
    assert value(m, "supervise_rank_step", rank="0") == 7
    assert value(m, "supervise_rank_collective_seq", rank="1") == 41
    assert value(m, "supervise_rank_busy", rank="0") == 1
    assert value(m, "supervise_rank_busy", rank="1") == 1
    assert value(m, "supervise_rank_collective_wait_seconds", rank="0") == 0
    assert value(m, "supervise_rank_collective_wait_seconds", rank="1") == pytest.approx(2.0)
    # An unclaimed slot has no heartbeat yet: its age is unknown, not fresh.
    assert math.isnan(value(m, "supervise_rank_heartbeat_age_seconds", rank="2"))
    assert value(m, "supervise_rank_step", rank="2") == 0
    assert value(m, "supervise_rank_busy", rank="2") == 0


def test_observe_ranks_labels_and_liveness():
    m = SupervisorMetrics("run", slot_ranks=[8, 9])
    now = 50.0
    m.observe_ranks(
        [
            snap(0, rank=8, ts_heartbeat=now),
            dataclasses.replace(hb.empty_slot(1)),  # unclaimed: labelled by slot_ranks
            hb.empty_slot(5),  # beyond slot_ranks and unclaimed: ignored
            snap(6, rank=14, ts_heartbeat=now),  # claimed: its own rank wins
        ],
        now,
        alive={0: True},  # slots missing from alive are dead
    )
    assert value(m, "supervise_rank_up", rank="8") == 1
    assert value(m, "supervise_rank_up", rank="9") == 0
    assert value(m, "supervise_rank_up", rank="14") == 0
    assert not any(labels and dict(labels).get("rank") == "5" for _, labels in samples(m))
    assert value(m, "supervise_rank_busy", rank="8") == 0


def test_step_duration_sampled_only_when_steps_complete():
    m = SupervisorMetrics("run", slot_ranks=[0])
    t = 10.0
    m.observe_ranks([snap(0, step=3, last_step_s=0.02, ts_heartbeat=t)], t, {0: True})
    assert value(m, "supervise_step_duration_seconds_count", rank="0") == 0  # first sight: no baseline
    t += 0.05
    m.observe_ranks([snap(0, step=3, last_step_s=0.02, ts_heartbeat=t)], t, {0: True})
    assert value(m, "supervise_step_duration_seconds_count", rank="0") == 0  # no new step
    t += 0.05
    m.observe_ranks([snap(0, step=6, last_step_s=0.03, ts_heartbeat=t)], t, {0: True})
    assert value(m, "supervise_step_duration_seconds_count", rank="0") == 1
    assert value(m, "supervise_step_duration_seconds_sum", rank="0") == pytest.approx(0.03)
    assert value(m, "supervise_step_duration_seconds_bucket", rank="0", le="0.025") == 0
    assert value(m, "supervise_step_duration_seconds_bucket", rank="0", le="0.05") == 1
    # A new process in the slot (restart) starts its counters over: no sample from the jump.
    t += 0.05
    m.observe_ranks([snap(0, pid=4242, step=1, last_step_s=0.5, ts_heartbeat=t)], t, {0: True})
    t += 0.05
    m.observe_ranks([snap(0, pid=4242, step=1, last_step_s=0.5, ts_heartbeat=t)], t, {0: True})
    assert value(m, "supervise_step_duration_seconds_count", rank="0") == 1
    # A torn read is not used as a baseline or a sample.
    t += 0.05
    m.observe_ranks([snap(0, pid=4242, step=9, last_step_s=0.7, torn=True)], t, {0: True})
    assert value(m, "supervise_step_duration_seconds_count", rank="0") == 1
    t += 0.05
    m.observe_ranks([snap(0, pid=4242, step=2, last_step_s=0.5, ts_heartbeat=t)], t, {0: True})
    assert value(m, "supervise_step_duration_seconds_count", rank="0") == 2


def test_collective_duration_is_the_wait_last_seen_by_a_tick():
    m = SupervisorMetrics("run", slot_ranks=[0])
    in_coll = hb.CLAIMED | hb.IN_COLLECTIVE
    m.observe_ranks([snap(0, coll_seq=5, ts_coll_begin=99.0, flags=in_coll)], 100.0, {0: True})
    m.observe_ranks([snap(0, coll_seq=5, ts_coll_begin=99.0, flags=in_coll)], 101.5, {0: True})
    assert value(m, "supervise_collective_duration_seconds_count", rank="0") == 0  # still inside
    # Ended between ticks, next collective already running: the one seen ran >= 2.5 s.
    m.observe_ranks([snap(0, coll_seq=6, ts_coll_begin=101.9, flags=in_coll)], 102.0, {0: True})
    assert value(m, "supervise_collective_duration_seconds_count", rank="0") == 1
    assert value(m, "supervise_collective_duration_seconds_sum", rank="0") == pytest.approx(2.5)
    # Ended, now outside any collective.
    m.observe_ranks([snap(0, coll_seq=6, ts_coll_begin=101.9)], 102.2, {0: True})
    assert value(m, "supervise_collective_duration_seconds_count", rank="0") == 2
    assert value(m, "supervise_collective_duration_seconds_sum", rank="0") == pytest.approx(2.6)
    assert value(m, "supervise_rank_collective_wait_seconds", rank="0") == 0
